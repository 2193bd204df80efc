"""Data preparation (harness/data/prepare.py): the memory-mapped cache training reads, built before any
process group; the authors' framing and splits; OWT from a local copy of the hub's parquet export;
hub-check on what training really loads; one permutation per epoch and exact resume across epochs."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from blockgen.harness.data import sources as data_mod
from blockgen.harness.checkpoints.checkpoint import TRAINING_STATE
from blockgen.harness.data import prepare
from blockgen.harness.data.sources import DataConfig, chunk_documents, document_split
from blockgen.harness.data.prepare import load_examples
from blockgen.harness.checkpoints.tokenizer import special_tokens, train_bpe
from limits import HANG_S

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A small local BPE (no hub), saved so subprocesses can load it by directory."""
    from blockgen.harness.data.wordproblems import generate

    problems = generate("train", 2000, seed=0)
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("tok") / "bpe"
    train_bpe([p.question for p in problems] + [p.code for p in problems] + ["words and more words"] * 50, 512, directory)
    return PreTrainedTokenizerFast.from_pretrained(str(directory))  # name_or_path: the directory


def _documents(n: int) -> list[str]:
    return [f"Document {i}. " + "words and more words " * (i % 9 + 1) for i in range(n)]


def _write_parquet(path: Path, columns: dict[str, list]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=4096)  # the reader holds a row group at a time


def _framed_by_hand(docs: list[str], tok, seq_len: int, per_batch: int) -> list[list[int]]:
    """The authors' wrapping, written out: per batch of documents, tokens + EOS concatenated, cut into
    (L - 2)-token pieces framed BOS + piece + EOS, the batch's remainder dropped."""
    special = special_tokens(tok)
    rows = []
    for start in range(0, len(docs), per_batch):
        stream = []
        for d in docs[start : start + per_batch]:
            stream += tok.encode(d, add_special_tokens=False) + [special.eos]
        for at in range(0, len(stream) - (seq_len - 2) + 1, seq_len - 2):
            rows.append([special.bos] + stream[at : at + seq_len - 2] + [special.eos])
    return rows


def test_owt_loads_a_local_copy_of_the_hub_parquet_export(tmp_path, tok, monkeypatch):
    """`--data.hub-name <folder>` laid out as the hub's export of Skylion007/openwebtext at
    refs/convert/parquet (`plain_text/train/0000.parquet`, `0001.parquet`, ...): the last documents are
    held out, chunks are framed as the authors' (checked against a hand-written framing, with batch
    remainders), and the prepared cache holds exactly those chunks, memory-mapped."""
    docs = _documents(230)
    export = tmp_path / "openwebtext-export"
    _write_parquet(export / "plain_text" / "train" / "0000.parquet", {"text": docs[:150]})
    _write_parquet(export / "plain_text" / "train" / "0001.parquet", {"text": docs[150:]})
    # the authors hold out the last 100k of 8M documents; a corpus under 1M its last tenth
    assert data_mod.owt_held_out_docs(8_013_769) == 100_000 and data_mod.owt_held_out_docs(79) == 7
    monkeypatch.setattr(data_mod, "OWT_VALIDATION_DOCS", 20)  # below the tenth of 230: the cap holds
    monkeypatch.setattr(data_mod, "DOCUMENTS_PER_BATCH", 40)  # several batches, each with a remainder dropped
    config = DataConfig(source="owt", hub_name=str(export), n_val=5, cache_dir=str(tmp_path / "cache"))
    train_docs, held_out = document_split(config)
    assert list(train_docs) == docs[:210] and list(held_out) == docs[210:]

    train, val, info = load_examples(config, tok, 24)
    assert train.tokens.dtype == torch.int32 and train[[0, 2]].tokens.dtype == torch.long  # memory-mapped, int64 out
    assert train.tokens.tolist() == _framed_by_hand(docs[:210], tok, 24, 40)
    assert val.tokens.tolist() == _framed_by_hand(docs[210:], tok, 24, 40)[:5]
    assert info["validation_documents"] == 20 and info["train_examples"] == len(train) > 20
    assert train.loss_mask.all() and not train.condition_mask.any()
    # The tasks' in-memory chunks (owt_ppl) are training's validation chunks.
    assert torch.equal(chunk_documents(held_out, tok, special_tokens(tok), 24).tokens[:5], val.tokens)

    from blockgen.harness.checkpoints.hub import check_files

    check_files([(str(export), None, "train")], [str(Path(tok.name_or_path))], [])  # hub-check on the local copy


def test_hub_check_and_loading_failures_are_the_projects_clear_errors(tmp_path):
    """hub-check looks at the files training would load: a loading script (refused by datasets >= 4) or
    a partial parquet export fails with the reason; the unreachable hub fails naming the offline path;
    loading a script dataset becomes the project's error, not datasets' RuntimeError."""
    from blockgen.harness.checkpoints.hub import HubUnavailableError, check_files, dataset_layout_problem, model_files_problem

    export = ["plain_text/train/0000.parquet", "plain_text/train/0001.parquet"]
    assert dataset_layout_problem(export, "train") is None
    assert dataset_layout_problem(["data/train-00000-of-00093.parquet", "README.md"], "train") is None
    assert dataset_layout_problem(["data.parquet"], "train") is None  # files named for no split are "train"
    assert "loading script" in dataset_layout_problem(["openwebtext.py", "subsets/urlsf_subset00.tar"], "train")
    assert "partial export" in dataset_layout_problem(["plain_text/partial-train/0000.parquet"], "train")
    assert "no data files of split 'train'" in dataset_layout_problem(["main/test-00000-of-00001.parquet"], "train")
    assert model_files_problem(["config.json", "tokenizer.json", "model.safetensors"], weights=True) is None
    assert "no weights" in model_files_problem(["tokenizer.json", "config.json"], weights=True)
    assert "no tokenizer" in model_files_problem(["config.json"], weights=False)

    scripted = tmp_path / "scripted"
    scripted.mkdir()
    (scripted / "scripted.py").write_text("raise SystemExit('a loading script must never run')\n")
    with pytest.raises(HubUnavailableError, match="OFFLINE=1"):
        data_mod.load_rows(DataConfig(source="owt", hub_name=str(scripted)))

    env = {**ENV, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    cli = [PY, "-m", "blockgen.harness.cli", "hub-check", "--presets", "owt-masked-mix", "--models", "gpt2-large", "--hint", "use OFFLINE=1"]
    result = subprocess.run(cli, capture_output=True, text=True, timeout=HANG_S, env=env, cwd=tmp_path)
    assert result.returncode == 1 and "HF_HUB_OFFLINE" in result.stderr and "use OFFLINE=1" in result.stderr
    partial = tmp_path / "partial"
    _write_parquet(partial / "plain_text" / "partial-train" / "0000.parquet", {"text": ["a"]})
    with pytest.raises(HubUnavailableError, match="partial export"):
        check_files([(str(partial), None, "train")], [], [])


def test_tinygsm_split_and_format_follow_the_authors(tmp_path, tok, monkeypatch):
    """The held-out rows are `train_test_split(test_size=0.01, seed=42)`'s test rows; examples are
    `[BOS] question SEP code [EOS] PAD...`, over-long ones dropped, no loss on the prompt, loss on the
    padding with train_on_pad (the authors' setting) and not without."""
    from datasets import Dataset

    n = 1234
    ids = Dataset.from_dict({"i": list(range(n))}).train_test_split(test_size=0.01, seed=42)["test"]["i"]
    assert sorted(data_mod.tinygsm_held_out(n).tolist()) == sorted(ids) and len(ids) == math.ceil(0.01 * n)

    from blockgen.harness.data.wordproblems import generate, to_records

    records = to_records(generate("train", 400, seed=1))
    records[7]["code"] = "x = 1\n" * 200  # longer than seq_len: dropped
    path = tmp_path / "tinygsm.parquet"
    _write_parquet(path, {"question": [r["question"] for r in records], "code": [r["code"] for r in records]})
    special = special_tokens(tok)
    held = set(data_mod.tinygsm_held_out(400).tolist())
    for train_on_pad in (False, True):
        config = DataConfig(source="tinygsm", path=str(path), n_val=100, train_on_pad=train_on_pad, cache_dir=str(tmp_path / "cache"))
        train, val, info = load_examples(config, tok, 200)
        kept = [r for i, r in enumerate(records) if i not in held and i != 7]
        assert len(train) == len(kept) and info["dropped_too_long"] == (7 not in held)
        assert len(val) == len(held - {7})
        for row, r in ((0, kept[0]), (len(kept) - 1, kept[-1])):
            q = tok.encode(r["question"], add_special_tokens=False)
            c = tok.encode(r["code"], add_special_tokens=False)
            want = [special.bos, *q, *special.sep, *c, special.eos]
            assert train.tokens[row].tolist() == want + [special.pad] * (200 - len(want))
            prompt = 1 + len(q) + len(special.sep)
            assert train.condition_mask[row].tolist() == [True] * prompt + [False] * (200 - prompt)
            end = 200 if train_on_pad else len(want)
            assert train.loss_mask[row].tolist() == [False] * prompt + [True] * (end - prompt) + [False] * (200 - end)


def test_prepared_cache_is_atomic_reused_and_cleans_up_a_killed_attempt(tmp_path, tok, monkeypatch):
    config = DataConfig(source="text", n_val=8, cache_dir=str(tmp_path / "cache"))
    directory = prepare.prepared_dir(config, 64, tok)
    with pytest.raises(prepare.DataNotPreparedError, match="blockgen prepare-data"):
        prepare.load_prepared(directory, 8)
    # A killed attempt's leftover (its process is gone) is removed; a live attempt's is not touched.
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    stale = directory.with_name(f"{directory.name}.tmp-{socket.gethostname()}-{dead.pid}")
    live = directory.with_name(f"{directory.name}.tmp-{socket.gethostname()}-{os.getppid()}")
    for leftover in (stale, live):
        leftover.mkdir(parents=True)
        (leftover / "train.tokens").write_bytes(b"\0" * 100)
    # A preparation that fails half-way leaves neither a cache nor a temporary folder behind.
    monkeypatch.setattr(prepare, "frame_documents", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_data(config, 64, tokenizer=tok)
    assert not stale.exists() and live.exists() and not directory.exists()
    assert [p.name for p in directory.parent.iterdir() if ".tmp-" in p.name] == [live.name]
    monkeypatch.undo()
    assert prepare.prepare_data(config, 64, tokenizer=tok) == directory and prepare.is_prepared(directory)
    stamp = (directory / "train.tokens").stat().st_mtime_ns
    monkeypatch.setattr(prepare, "_write_documents", lambda *a: pytest.fail("prepared the data again"))
    loaded_tok, train, val, info = prepare.load_prepared(prepare.prepare_data(config, 64, tokenizer=tok), 8)
    assert (directory / "train.tokens").stat().st_mtime_ns == stamp and len(val) == 8
    assert loaded_tok.get_vocab() == tok.get_vocab()  # training reads the tokenizer saved with the tokens
    train_docs, _ = document_split(config)
    assert torch.equal(train.tokens.long(), chunk_documents(train_docs, tok, special_tokens(tok), 64).tokens)


def test_resume_across_an_epoch_boundary_draws_the_same_batches_and_weights(tmp_path, monkeypatch):
    """One permutation per epoch (drawn once, not per step); a run stopped after an epoch boundary and
    resumed draws the batches of an uninterrupted run and ends with identical weights."""
    from blockgen.harness.training import train as train_mod
    from blockgen.harness.training.presets import preset

    draws, batches = [], {}
    real_randperm, real_slot_batches = torch.randperm, train_mod._slot_batches
    monkeypatch.setattr(torch, "randperm", lambda n, **kw: draws.append(n) or real_randperm(n, **kw))

    def recording(n, step, batch, seed):
        idx = real_slot_batches(n, step, batch, seed)
        batches.setdefault(current, {})[step] = idx.tolist()
        return idx

    monkeypatch.setattr(train_mod, "_slot_batches", recording)
    data = DataConfig(n_train=96, n_val=16, vocab_size=512, cache_dir=str(tmp_path / "data"))
    base = preset("ci", data=data, max_steps=14, eval_every=10**9, save_every=1000, k_mc=1)
    per_epoch = 96 // base.batch_size  # 6 steps
    current = "straight"
    train_mod._epoch_permutation.cache_clear()
    train_mod.train(replace(base, out_dir=str(tmp_path / "straight")), progress=False)
    assert len([n for n in draws if n == 96]) == math.ceil(14 / per_epoch)  # epochs 0, 1, 2: one draw each
    current = "resumed"
    stopped = replace(base, out_dir=str(tmp_path / "resumed"), max_steps=per_epoch + 2)  # stops inside epoch 1
    train_mod.train(stopped, progress=False)
    train_mod._epoch_permutation.cache_clear()  # a new process: nothing cached
    train_mod.train(replace(stopped, max_steps=14), progress=False)
    assert batches["resumed"] == batches["straight"] and len(batches["straight"]) == 14
    a = torch.load(tmp_path / "straight" / "checkpoint" / TRAINING_STATE, weights_only=False)
    b = torch.load(tmp_path / "resumed" / "checkpoint" / TRAINING_STATE, weights_only=False)
    assert a["step"] == b["step"] == 14
    for part in ("model", "ema"):
        for key in a[part]:
            torch.testing.assert_close(a[part][key], b[part][key], rtol=0, atol=0, msg=f"{part}.{key}")


MEMORY_PROBE = """
import json, resource, sys, threading, time
from blockgen.harness.data.sources import DataConfig
from blockgen.harness.data.prepare import prepare_data

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

peak = [anon_kb()]
def sample():
    while True:
        peak[0] = max(peak[0], anon_kb()); time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
path, tok, cache = sys.argv[1:4]
start = anon_kb()
prepare_data(DataConfig(source="tinygsm", path=path, tokenizer=tok, cache_dir=cache), 512, log=lambda *a: None)
peak[0] = max(peak[0], anon_kb())
print(json.dumps({"start_kb": start, "peak_anon_kb": peak[0], "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def test_tinygsm_preparation_memory_is_flat_in_the_number_of_rows(tmp_path, tok):
    """Preparing 10k and 100k TinyGSM-schema rows (a subprocess each, peak anonymous memory sampled):
    the growth is a small fraction of the extra examples' own size (the old Python lists took +635 MB
    for 20k rows). File-backed pages (the memory-mapped Arrow table) are the page cache's, not counted."""
    rng = np.random.default_rng(0)
    words = np.array("the of a number apples costs each total how many does she have left after buying".split())
    results = {}
    for n in (10_000, 100_000):
        questions = [" ".join(rng.choice(words, 8)) + "?" for _ in range(n)]
        codes = [f"def simple_math_problem():\n    return {i % 97} + 3" for i in range(n)]
        path = tmp_path / f"tinygsm-{n}.parquet"
        _write_parquet(path, {"question": questions, "code": codes})
        env = {**ENV, "HF_DATASETS_CACHE": str(tmp_path / f"hf-{n}")}
        out = subprocess.run([PY, "-c", MEMORY_PROBE, str(path), tok.name_or_path, str(tmp_path / f"cache-{n}")],
                             capture_output=True, text=True, timeout=HANG_S, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        results[n] = json.loads(out.stdout.strip().splitlines()[-1])
    grow = {n: (r["peak_anon_kb"] - r["start_kb"]) / 1024 for n, r in results.items()}
    print("peak anonymous memory growth, MB:", grow)
    extra_mb = 90_000 * 512 * 4 / 2**20  # the extra examples' tokens alone: 176 MB
    assert grow[100_000] - grow[10_000] < 0.25 * extra_mb, (grow, results)


def test_torchrun_trains_when_preparation_outlasts_the_process_group_timeout(tmp_path):
    """2 gloo ranks, a 15 s process-group timeout and a data preparation that takes 18 s: rank 0
    prepares before the group exists while rank 1 waits on the file system, then both train."""
    script = tmp_path / "slow_prepare_train.py"
    script.write_text(
        "import sys, time\n"
        "from blockgen.harness.data import prepare\n"
        "real = prepare.prepare_data\n"
        "def slow(*args, **kwargs):\n"
        "    time.sleep(18)  # longer than the process group's timeout\n"
        "    return real(*args, **kwargs)\n"
        "prepare.prepare_data = slow\n"
        "from blockgen.harness.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "run"
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "train", "--preset", "ci",
           "--out-dir", str(out), "--max-steps", "3", "--eval-every", "3", "--save-every", "3", "--device", "cpu",
           "--data.cache-dir", str(tmp_path / "data"), "--dist-timeout-s", "15"]
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=ENV, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - start > 18
    assert "timeout 15 s" in result.stdout and "preparing it now" in result.stdout
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_make_prepares_before_torchrun():
    for extra in (["NGPU=8"], ["OFFLINE=1"]):
        for target, preset in (("train-owt", "owt"), ("train-tinygsm", "tinygsm")):
            lines = subprocess.run(["make", "-n", target, *extra], capture_output=True, text=True, cwd=REPO, check=True).stdout.splitlines()
            prep = next(i for i, line in enumerate(lines) if "prepare-data --preset " + preset in line)
            first_torchrun = next(i for i, line in enumerate(lines) if "torchrun" in line)
            assert prep < first_torchrun and "torchrun" not in lines[prep]


def test_the_word_problem_tokenizer_spells_a_number_by_the_same_digit_tokens_in_question_and_program(tmp_path):
    """The local BPE of the word problems splits digits: a number copied from the question ("$48", "for 48
    hours") into the program ("x = 48") is the same token ids in both, and decoding gives every text back;
    a BPE without the rule glues the space to the number, so " 48" and "$48" spell it differently."""
    import re

    from blockgen.harness.data.sources import local_tokenizer, local_tokenizer_dir
    from blockgen.harness.data.wordproblems import generate

    config = DataConfig(n_train=2000, vocab_size=512, cache_dir=str(tmp_path))
    tok = local_tokenizer(config)
    assert "-digits-" in local_tokenizer_dir(config)[0].name
    copied = 0
    for p in generate("train", 300, seed=5):
        q, code = (tok.encode(t, add_special_tokens=False) for t in (p.question, p.code))
        assert tok.decode(q) == p.question and tok.decode(code) == p.code
        for number in re.findall(r"= (\d+)\n", p.code):
            digits = [tok.convert_tokens_to_ids(d) for d in number]
            assert tok.encode(f" = {number}", add_special_tokens=False)[-len(number):] == digits
            if re.search(rf"(?<!\d){number}(?!\d)", p.question):
                assert any(q[i : i + len(digits)] == digits for i in range(len(q))), (number, p.question)
                copied += 1
    assert copied > 500  # most assignments copy a number of the question
    plain = train_bpe([p.question for p in generate("train", 2000, seed=0)], 512)  # the rule is what splits them
    assert plain.tokenize(" 48")[-2:] != plain.tokenize("$48")[-2:]  # e.g. "Ġ4", "8" against "4", "8"
    assert tok.tokenize(" 48")[-2:] == tok.tokenize("$48")[-2:] == ["4", "8"]
