"""Training end to end on the generated word problems: learning, resuming, checkpoints, torchrun, data sources."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockgen.harness.checkpoints.checkpoint import CheckpointError, checkpoint_hash, load_checkpoint, read_config, save_checkpoint
from blockgen.harness.data.sources import DataConfig, get_tokenizer
from blockgen.harness.data.prepare import load_examples
from blockgen.harness.checkpoints.tokenizer import special_tokens
from blockgen.harness.training.presets import preset
from blockgen.harness.training.train import train, warm_start
from blockgen.models.model import BlockGen
from limits import HANG_S

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def ci_config(tmp: Path, name: str, **overrides):
    data = DataConfig(n_train=2000, n_val=32, vocab_size=512, cache_dir=str(tmp.parent / "data-cache"))
    return preset("ci", out_dir=str(tmp / name), data=data, **overrides)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train")


def unigram_entropy(config) -> float:
    """Entropy (nats) of the answer tokens' unigram distribution: what a context-free model achieves."""
    tok = get_tokenizer(config.data)
    train_set, _, _ = load_examples(config.data, tok, config.seq_len)
    counts = torch.bincount(train_set.tokens[train_set.loss_mask], minlength=len(tok)).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def test_short_run_learns_far_below_unigram_entropy(workdir):
    """150 AR steps on generated word problems end far below the unigram entropy. Over 30 s (about 40-50 s):
    learning needs that many steps of the micro model; fewer leave the margin to chance."""
    config = ci_config(workdir, "learn", block_sizes=(1,), block_weights=(1.0,), max_steps=150, lr=3e-3, eval_every=150, save_every=150, batch_size=32)
    train(config, progress=False)
    records = [json.loads(line) for line in (workdir / "learn" / "metrics.jsonl").read_text().splitlines()]
    val = records[-1]["val_nll_lse"]
    entropy = unigram_entropy(config)
    assert val < 0.6 * entropy, f"validation NLL {val:.3f} nats/token vs unigram entropy {entropy:.3f}"
    assert not [r["step"] for r in records if "loss_spike" in r]  # a healthy curve: no spike warning


def test_resume_continues_exactly(workdir):
    """20 + 20 steps with a restart in between give the same weights as 40 straight steps."""
    straight = ci_config(workdir, "straight", max_steps=40)
    train(straight, progress=False)
    resumed = ci_config(workdir, "resumed", max_steps=20)
    train(resumed, progress=False)
    with pytest.raises(ValueError, match=r"different \['lr'\]"):
        train(replace(resumed, max_steps=40, lr=1.0), progress=False)
    with pytest.raises(ValueError, match=r"different \['data'\]"):
        train(replace(resumed, max_steps=40, data=replace(resumed.data, n_train=1000)), progress=False)
    # extending the budget resumes, also from a data cache at another place (a run folder moved with it)
    moved = replace(resumed.data, cache_dir=str(workdir / "moved-data-cache"))
    train(replace(resumed, max_steps=40, data=moved), progress=False)
    a = load_file(str(workdir / "straight" / "checkpoint" / "model.safetensors"))
    b = load_file(str(workdir / "resumed" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_warm_start_copies_the_weights_across_priors(workdir):
    """`init_from`: every weight of the source, the real-vocabulary rows when the priors differ."""
    source = train(ci_config(workdir, "ws-source", max_steps=2, eval_every=2, save_every=2), progress=False)
    weights = load_file(str(source / "model.safetensors"))
    tok = get_tokenizer(ci_config(workdir, "ws").data)
    vocab = len(tok)
    for prior in ("masked", "uniform"):
        config = ci_config(workdir, f"ws-{prior}", prior=prior)
        model = BlockGen(config.model_config(vocab, special_tokens(tok).to_dict(), "cpu"))
        warm_start(model, source, tok)
        for name, value in model.state_dict().items():
            rows = vocab if value.shape != weights[name].shape else len(value)
            torch.testing.assert_close(value[:rows], weights[name][:rows], rtol=0, atol=0)
        assert model.dit.embed.weight.shape[0] == vocab + (prior == "masked")
    wider = BlockGen(ci_config(workdir, "ws-wide", size="tiny").model_config(vocab, special_tokens(tok).to_dict(), "cpu"))
    with pytest.raises(CheckpointError, match="another architecture"):
        warm_start(wider, source, tok)
    # Through training: one step at a negligible learning rate leaves the source's weights.
    tuned = train(ci_config(workdir, "ws-train", prior="uniform", init_from=str(source), max_steps=1, lr=1e-12,
                            warmup_steps=1, save_every=1, eval_every=1), progress=False)
    after = load_file(str(tuned / "model.safetensors"))
    torch.testing.assert_close(after["dit.blocks.0.attn.qkv.weight"], weights["dit.blocks.0.attn.qkv.weight"], rtol=0, atol=1e-6)


def test_checkpoint_errors_are_clear(workdir, tmp_path):
    config = ci_config(workdir, "ckpt", max_steps=2, eval_every=2, save_every=2)
    ckpt = train(config, progress=False)
    model, tok = load_checkpoint(ckpt)
    assert read_config(ckpt).block_sizes == (1, 4) and tok is not None
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in ckpt.iterdir() if p.is_file()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # the weights too (safetensors writes 0600)
    with pytest.raises(CheckpointError, match="init_from=/nope/run: does not exist"):
        train(replace(config, out_dir=str(tmp_path / "from-nowhere"), init_from="/nope/run"), progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    broken = tmp_path / "truncated"
    save_checkpoint(broken, model, tok)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(broken)
    mismatched = tmp_path / "mismatched"
    save_checkpoint(mismatched, model, tok)
    cfg = json.loads((mismatched / "config.json").read_text())
    cfg["d_model"] = 2 * cfg["d_model"]
    (mismatched / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not match"):
        load_checkpoint(mismatched)
    (mismatched / "config.json").write_text("{\"model_type\": \"blockgen\", \"vocab")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(mismatched)


def test_cli_trains_and_torchrun_two_processes(workdir):
    """`blockgen train` through torchrun with 2 CPU processes (gloo): one block size per rank (Algorithm 1)."""
    out = workdir / "ddp"
    cmd = [
        PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "blockgen.harness.cli",
        "train", "--preset", "ci", "--out-dir", str(out), "--max-steps", "6", "--eval-every", "6", "--save-every", "6",
        "--data.cache-dir", str(workdir / "data-cache"), "--device", "cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=env, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6
    # gamma = (0.5, 0.5) over 2 slots: each step one rank trains L' = 1 and the other L' = 4
    assert all(sorted(r["block_sizes"]) == [1, 4] for r in records)
    assert math.isfinite(records[-1]["val_nll_lse"])
    model, _ = load_checkpoint(out / "checkpoint")
    assert model.config.block_sizes == (1, 4)


def test_local_files_with_hub_schema(tmp_path):
    """The hub loaders read local JSON files of the same schema (TinyGSM: question/code; OWT: text)."""
    from blockgen.harness.data.wordproblems import generate, to_records

    tiny = tmp_path / "tinygsm.jsonl"
    tiny.write_text("\n".join(json.dumps({"question": r["question"], "code": r["code"]}) for r in to_records(generate("train", 300))))
    owt = tmp_path / "owt.jsonl"
    owt.write_text("\n".join(json.dumps({"text": f"Document {i}. " + "words and more words " * 20}) for i in range(200)))
    tok = get_tokenizer(DataConfig(vocab_size=512, n_train=2000, cache_dir=str(tmp_path / "cache")))
    cache = str(tmp_path / "cache")
    train_set, val, info = load_examples(DataConfig(source="tinygsm", path=str(tiny), n_val=20, cache_dir=cache), tok, 160)
    assert info["train_examples"] + info["dropped_too_long"] == 297 and len(val) <= 3  # the authors' random 1 % held out
    assert not (train_set.loss_mask & train_set.condition_mask).any()
    train_set, val, info = load_examples(DataConfig(source="owt", path=str(owt), n_val=4, cache_dir=str(tmp_path / "cache")), tok, 64)
    assert info["validation_documents"] == 20 and train_set.loss_mask.all() and len(val) == 4


def test_unreachable_hub_fails_loudly(tmp_path):
    code = (
        "from blockgen.harness.data.sources import DataConfig\nfrom blockgen.harness.data.prepare import load_examples\n"
        "from blockgen.harness.checkpoints.tokenizer import load_tokenizer, train_bpe\n"
        "tok = train_bpe(['some text'] * 10, 300)\n"
        "for call in (lambda: load_tokenizer('gpt2'), lambda: load_examples(DataConfig(source='owt'), tok, 1024)):\n"
        "    try:\n        call()\n    except Exception as e:\n        print(type(e).__name__, '|', str(e).replace(chr(10), ' '))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=HANG_S, env=env).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("HubUnavailableError") and "make demo" in line


def test_bad_configs_name_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        preset("no-such-preset")
    with pytest.raises(ValueError, match="choose one of"):
        DataConfig(source="wikipedia")
    with pytest.raises(ValueError, match="choose one of"):
        preset("ci", size="huge")


def blockgen_train(*flags, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [str(Path(PY).parent / "blockgen"), "train", "--preset", "ci", "--device", "cpu", *map(str, flags)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_errors_are_one_line_and_leave_no_out_dir(workdir, tmp_path):
    """`blockgen train` with bad settings or a missing file: exit 2, one line naming the choices (no
    traceback), and no empty out-dir left behind (nothing was written)."""
    cases = {("--data.difficulty", "impossible"): "choose one of ['easy', 'hard', 'medium']",
             ("--batch-size", "7", "--micro-batch", "2"): "batch_size=7 (--batch-size / BATCH) is not divisible",
             ("--device", "gpu"): "choose one of ['auto', 'cpu', 'cuda', 'cuda:N', 'mps']",
             ("--init-from", tmp_path / "nowhere"): f"init_from={tmp_path / 'nowhere'}: does not exist"}
    for flags, named in cases.items():
        out = tmp_path / "run"
        r = blockgen_train("--out-dir", out, "--data.cache-dir", workdir.parent / "data-cache", *flags, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (flags, r.stderr[-2000:])
        last = r.stderr.strip().splitlines()[-1]  # data preparation may report before it
        assert last.startswith("blockgen train: error: ") and named in last, (flags, last)
        assert not out.exists(), flags


def test_a_second_run_into_a_directory_in_use_is_refused(workdir, tmp_path):
    """Two processes training into one directory would overwrite each other's checkpoints: while a live
    process holds the run directory, `blockgen train` into it stops at once naming that process; once
    the holder is gone (killed, as a crash would), its lock file does not keep the next run out."""
    out = tmp_path / "run"
    hold = ("import sys, time; from pathlib import Path; from blockgen.harness.training.run_directory import hold_run_directory\n"
            "with hold_run_directory(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(3600)")
    flags = ("--out-dir", out, "--data.cache-dir", workdir.parent / "data-cache", "--max-steps", "1", "--eval-every", "1000")
    holder = subprocess.Popen([PY, "-c", hold, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = blockgen_train(*flags, cwd=tmp_path)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith(f"blockgen train: error: {out} is in use: pid {holder.pid} on "), last
        assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait(timeout=HANG_S)
    after = blockgen_train(*flags, cwd=tmp_path)
    assert after.returncode == 0, after.stderr[-2000:]
    assert (out / "checkpoint" / "training_state.pt").is_file()


def test_the_optimizer_uses_the_configured_beta2(workdir):
    config = ci_config(workdir, "beta2", adam_beta2=0.9, max_steps=1, eval_every=10**9, save_every=1)
    train(config, progress=False)
    state = torch.load(Path(config.out_dir) / "checkpoint" / "training_state.pt", weights_only=False)
    assert {tuple(g["betas"]) for g in state["optimizer"]["param_groups"]} == {(0.9, 0.9)}


def test_cli_resume_says_where_it_resumed(workdir):
    out = workdir / "cli-resume"
    flags = ("--out-dir", out, "--data.cache-dir", workdir.parent / "data-cache", "--eval-every", "1000", "--save-every", "2")
    first = blockgen_train(*flags, "--max-steps", "2", cwd=workdir)
    assert first.returncode == 0 and "resuming" not in first.stdout, first.stderr[-2000:]
    again = blockgen_train(*flags, "--max-steps", "3", cwd=workdir)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from step 2 of {out / 'checkpoint'}" in again.stdout.splitlines()


def test_a_demo_model_trains_again_when_its_warm_start_parent_or_its_tokenizer_changed(tmp_path, monkeypatch):
    """`blockgen demo` keeps a trained model by a record of what it depended on (`demo._training_key`): its
    settings, the data as tokenized (the prepared cache's name) and the hash of the checkpoint it started from.
    A retrained parent or another tokenizer rule changes the key, so the model is trained again instead of kept
    (until 2026-11-29 only the settings were compared: a retrained `gsm-ar` left its mixtures stale)."""
    from blockgen.harness import demo
    from blockgen.harness.checkpoints.checkpoint import CONFIG, WEIGHTS
    from blockgen.harness.data import sources

    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / CONFIG).write_text("{}")
    (parent / WEIGHTS).write_bytes(b"weights, first training")
    data = replace(preset("ci").data, cache_dir=str(tmp_path / "data"))
    child = replace(preset("ci"), init_from=str(parent), out_dir=str(tmp_path / "child"), data=data)
    record = tmp_path / "child-record.json"
    demo._write_record(record, demo._training_key(child), "sha of the child", {"train_seconds": 1.0})

    def kept() -> bool:
        return demo._fresh_record(record, demo._training_key(child), "sha of the child") is not None

    assert kept()
    (parent / WEIGHTS).write_bytes(b"weights, trained again")
    assert not kept()
    (parent / WEIGHTS).write_bytes(b"weights, first training")
    assert kept()
    monkeypatch.setattr(sources, "_splits_digits", lambda config: False)  # the plain BPE of before
    demo._prepared_name.cache_clear()
    assert not kept()
    demo._prepared_name.cache_clear()


def test_demo_command_end_to_end(tmp_path):
    """`blockgen demo` (the README's main job) on the CI preset: trains, sweeps the samplers in worker
    processes, writes a leaderboard whose bounds hold, plots and a page; a rerun redoes nothing.
    Over 30 s (about 40-50 s): the whole main job end to end (two trainings, the sampler sweep, the reports);
    a smaller one would not be the command a newcomer runs."""
    from blockgen.harness.reports import leaderboard

    out = tmp_path / "demo"
    cmd = [PY, "-m", "blockgen.harness.cli", "demo", "--out-dir", str(out), "--presets", "ci-ar", "ci", "lang-masked-mix",
           "--max-steps", "4", "--problems", "8", "--nfes", "4", "--language-prompts", "8", "--language-nfes", "2", "--jobs", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["provenance"]["command"].startswith("blockgen demo")
    # The mixture starts from the AR model's weights; the AR model trains alone, on both workers' cores.
    models = summary["models"]
    assert models["ci"]["init_from"] == str(out / "ci-ar" / "checkpoint") and models["ci-ar"]["init_from"] is None
    # The AR parent trains first and alone, on both workers' cores; the language's model starts after it.
    assert (models["ci-ar"]["threads"], models["ci"]["threads"], models["lang-masked-mix"]["threads"]) == (2, 1, 1)
    assert models["lang-masked-mix"]["init_from"] is None
    assert "ci starts from the weights of ci-ar" in result.stdout
    rows = leaderboard.read(out / "leaderboard.json").rows
    assert {r.sampler for r in rows if r.model == "ci-ar" and r.metric == "exact_match"} == {"ar_greedy", "ar_sample"}
    assert {r.note for r in rows if r.model == "ci"} == {"warm-started from ci-ar (4 steps)"}
    accuracy = [r for r in rows if r.metric == "exact_match" and r.model == "ci"]
    assert {r.sampler for r in accuracy} == {"ancestral", "eipc", "arpc", "ar_greedy", "confidence_threshold",
                                             "entropy_bounded", "low_confidence"}
    assert all(r.n == 8 and r.train_steps == 4 and r.tokens_per_s > 0 for r in accuracy)
    paper = {"ancestral", "eipc", "arpc", "low_confidence"}
    assert {r.nfe_per_block for r in accuracy if r.sampler in paper} == {4}  # low-confidence at N 4 (grids.DEMO_FIELD)
    for r in accuracy:  # the field's adaptive samplers: their NFE is their rows' measured mean, at most one per position
        assert r.calls_per_block_per_row is not None and 1 <= r.max_calls_per_block and r.tokens_per_forward > 0
        if r.sampler in ("confidence_threshold", "entropy_bounded"):
            assert r.nfe_per_block == r.calls_per_block_per_row <= r.max_calls_per_block <= r.block_size
    for name in ("confidence_threshold", "entropy_bounded", "low_confidence", "tok/fwd", "calls/blk"):
        assert name in result.stdout  # the demo's table prints them
    # The likelihood rows: log-sum-exp bound <= NLL_s - log(gamma_s) per sequence, and <= Jensen.
    nll = {r.metric: r.value for r in rows if r.task == "wordproblems_validation_nll" and r.model == "ci"}
    info = summary["models"]["ci"]["likelihood"]
    per_token = info["sequences"] / info["tokens"]
    for size, weight in zip(preset("ci").block_sizes, preset("ci").block_weights):
        assert nll["nll_lse"] <= nll[f"nll_block_{size}"] - math.log(weight) * per_token + 1e-9
    assert nll["nll_lse"] <= nll["nll_jensen"] + 1e-9
    # The 3 worst of n sequences carry at least 3/n of the (non-negative) total, and never more than all of it.
    assert info["worst_sequences"] == 3 and 3 / info["sequences"] - 1e-9 <= info["worst_sequences_share"] <= 1 + 1e-9
    assert "worst_sequences_share" not in nll  # a share, not an NLL: no leaderboard row
    plots = {p.name for p in (out / "page").glob("*.png")}
    assert any(n.startswith("accuracy_vs_nfe_gsm8k_code_embedded") for n in plots)
    assert any(n.startswith("frontier_gsm8k_code_embedded") for n in plots)
    assert (out / "page" / "index.html").is_file()
    assert "accuracy" in result.stdout and "validation NLL/token" in result.stdout
    # The synthetic language: every sampler at NFE 2 per block, scored exactly; its likelihood pass beside
    # the exact NLL of the same documents.
    language = [r for r in rows if r.task == "synthlang_gen" and r.metric == "invalid_pairs"]
    assert {(r.sampler, r.nfe_per_block) for r in language if r.sampler not in ("confidence_threshold", "entropy_bounded")} == {
        ("ancestral", 2), ("eipc", 2), ("arpc", 2), ("low_confidence", 2), ("ar_greedy", 1), ("ar_sample", 1)}
    assert {r.sampler for r in language} >= {"confidence_threshold", "entropy_bounded"}
    assert all(r.n == 8 and 0 <= r.value <= 1 for r in language)
    from blockgen.harness.data.language import load_language

    exact = {r.metric: r.value for r in rows if r.task == "synthlang_validation_nll" and r.model == "lang-masked-mix"}
    assert exact["entropy_rate"] == load_language("default").entropy_rate
    assert exact["nll_true"] <= exact["nll_lse"] <= exact["nll_jensen"] + 1e-9
    assert (out / "language.png").is_file() and "broken pairs" in result.stdout
    # Nothing lost, nothing redone: a rerun keeps the checkpoint and every results file.
    results = sorted((out / "results").rglob("*.json"))
    stamps = [p.stat().st_mtime_ns for p in results]
    logs = {p: p.stat().st_size for p in (out / "logs").iterdir()}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.stat().st_mtime_ns for p in results] == stamps
    assert leaderboard.read(out / "leaderboard.json").rows == rows
    # the trainings and likelihood passes are kept by their records: no job ran, so no worker log grew
    assert {p: p.stat().st_size for p in (out / "logs").iterdir()} == logs
    assert "ci-ar: trained earlier" in again.stdout and "ci: trained earlier" in again.stdout
    assert json.loads((out / "summary.json").read_text())["models"]["ci"]["likelihood"] == info
    # A second training seed: seed 0 is the run above (kept as it is), seed 1 trains anew under
    # seed-1/ with its own warm start, and the findings are pooled over the two runs (the word problems' here;
    # the language's findings map onto its grid in tests/test_findings.py).
    word_problems = [a for a in cmd if a != "lang-masked-mix"]
    seeds = subprocess.run([*word_problems, "--seeds", "0", "1"], capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert seeds.returncode == 0, seeds.stderr[-3000:]
    assert [p.stat().st_mtime_ns for p in results] == stamps
    second = json.loads((out / "seed-1" / "summary.json").read_text())["models"]
    assert second["ci"]["init_from"] == str(out / "seed-1" / "ci-ar" / "checkpoint")
    assert checkpoint_hash(out / "seed-1" / "ci" / "checkpoint") != checkpoint_hash(out / "ci" / "checkpoint")
    assert "training seed 1" in leaderboard.read(out / "seed-1" / "leaderboard.json").description
    findings = json.loads((out / "findings.json").read_text())
    assert findings["runs"] == [str(out), str(out / "seed-1")]
    assert {f["finding"]["name"] for f in findings["findings"]} >= {"masked: ARPC - ancestral, NFE 4, T 0.1",
                                                                    "masked: ARPC NFE 4 - AR greedy, T 0.1"}
    assert all(len(f["runs"]) == 2 for f in findings["findings"])
    assert (out / "findings.png").is_file() and "findings across 2 runs" in seeds.stdout
    assert "held-out NLL across 2 training seeds" in seeds.stdout
    # --train-only with a third seed: seed 2 trains, nothing is swept, the spread covers the three seeds and the
    # findings (which need the sweep) are left as they were.
    findings_before = (out / "findings.json").read_bytes()
    train_only = subprocess.run([*word_problems, "--seeds", "0", "1", "2", "--train-only"], capture_output=True, text=True,
                                timeout=HANG_S, cwd=tmp_path)
    assert train_only.returncode == 0, train_only.stderr[-3000:]
    assert (out / "seed-2" / "ci" / "checkpoint").is_dir() and not (out / "seed-2" / "results").exists()
    assert not (out / "seed-2" / "leaderboard.json").exists() and (out / "findings.json").read_bytes() == findings_before
    spread = json.loads((out / "training-spread.json").read_text())
    assert spread["seeds"] == [0, 1, 2] and {r["model"] for r in spread["models"]} == {"ci-ar", "ci"}
    assert all(len(r["nll"]) == 3 and r["worst_ratio"] >= 1 for r in spread["models"])


def test_a_kept_result_must_match_the_checkpoint_and_the_task_settings(tmp_path):
    """A rerun keeps a results file only for the same checkpoint, the same task settings (a run with
    --problems 400 after one with 500 evaluates again) and with its per-problem samples beside it."""
    from blockgen.harness.demo import _fresh
    from blockgen.harness.evaluation.wordproblem_eval import samples_path

    path = tmp_path / "ancestral(N4,T0.1).json"
    path.write_text(json.dumps({"config": {"model_sha": "abc"},
                                "configs": {"gsm8k_code_embedded": {"metadata": {"embedded_problems": 500, "difficulty": "easy"}}}}))
    same = {"embedded_problems": 500, "difficulty": "easy"}
    assert not _fresh(path, "abc", same)  # no samples file yet
    samples_path(path).write_text("")
    assert _fresh(path, "abc", same)
    assert not _fresh(path, "abd", same)
    assert not _fresh(path, "abc", {**same, "embedded_problems": 400})
    assert not _fresh(path, "abc", {**same, "difficulty": "hard"})


def test_demo_sweep_matches_the_paper_nfe_labels():
    from blockgen.harness.demo import DIFFUSION_VARIANTS, DemoConfig, samplers_for
    from blockgen.models.sampler_config import paper_nfe_per_block

    for nfe, variants in DIFFUSION_VARIANTS.items():
        assert all(paper_nfe_per_block(v) == nfe for v in variants)
    mixture = samplers_for((1, 16), (1.0, 0.1), (4, 8, 16))
    # per temperature: 3 NFEs x (ancestral, EIPC, ARPC), then the field's samplers at one setting each
    assert len(mixture) == 2 * 3 * 3 + 2 * 3 + 1 and mixture[-1].name == "ar_greedy"
    assert [s.name for s in mixture[18:21]] == ["confidence_threshold", "entropy_bounded", "low_confidence"]
    assert {s.name for s in samplers_for((16,), (0.1,), (4,))} == {  # ARPC needs block size 1
        "ancestral", "eipc", "confidence_threshold", "entropy_bounded", "low_confidence"}
    assert [(s.name, s.temperature) for s in samplers_for((1,), (1.0,), (4,))] == [("ar_greedy", 1.0), ("ar_sample", 1.0)]
    with pytest.raises(ValueError, match="choose from"):
        DemoConfig(nfes=(5,))


def test_cosine_schedule_warms_up_then_decays_to_a_tenth():
    config = preset("ci", lr=1e-3, warmup_steps=10, max_steps=110, lr_schedule="cosine")
    lrs = [config.lr_at(step) for step in range(110)]
    assert lrs[:10] == pytest.approx([1e-3 * (i + 1) / 10 for i in range(10)])
    assert lrs[10] == pytest.approx(1e-3) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert config.lr_at(110) == pytest.approx(1e-4) and lrs[60] == pytest.approx(0.55e-3)
    assert replace(config, lr_schedule="constant").lr_at(50) == 1e-3
    with pytest.raises(ValueError, match="choose 'constant' or 'cosine'"):
        replace(config, lr_schedule="linear")
