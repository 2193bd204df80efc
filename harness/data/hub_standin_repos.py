"""Tiny repositories for the hub stand-in (harness/checkpoints/hub_standin.py) under the real ids and layouts a full-scale
run loads, and the command that serves a folder (`blockgen hub-standin --root DIR [--write-tiny-repos]`, `make hub-standin`).

Generated here, nothing downloaded and no binary committed:
- datasets: `Skylion007/openwebtext` at `refs/convert/parquet` (`plain_text/train/NNNN.parquet`, the hub's export; the
  documents of the offline `text` source), `TinyGSM/TinyGSM` (`data/train-*.parquet`: `question`, `code`) and
  `openai/gsm8k` (config `main`: a README's configs and `main/test-*.parquet`: `question`, `answer` ending `#### N`),
  the last two from the word-problem generator;
- `gpt2` and `gpt2-large`: a gpt2-layout tokenizer (`vocab.json`, `merges.txt`, `tokenizer.json`; `<|endoftext|>` is
  BOS, EOS and UNK, no PAD) and, for `gpt2-large` (the scorer), a random `GPT2LMHeadModel` of the real config keys at a
  tiny width; `HuggingFaceTB/SmolLM-135M`: a tokenizer with its own PAD (vocab_size == len, as SmolLM's);
- `jdeschena/blockgen`: with `release_fixtures` (the folders `released/` and `released-gpt2/` in the authors' format),
  each fixture under the real subfolder it stands for (`tiny` -> `tinygsm` / `owt`, block size 8 -> 16) where that
  subfolder is a real release; the gpt2 and SmolLM tokenizers are then the fixtures' own, so the releases convert.

No package ships GPT-2's or SmolLM's real vocabularies, so the tokenizers are small: the layouts, special tokens and
row rules are the real ones, the merges are not.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import threading
from pathlib import Path

from blockgen.harness.checkpoints.hub_standin import KINDS, HubStandin, publish

COMMAND_HELP = """Serve a folder of repositories as the Hugging Face hub on 127.0.0.1, until Ctrl-C.

It prints `export HF_ENDPOINT=http://127.0.0.1:PORT`: in a shell with it exported, huggingface_hub, datasets,
transformers and every blockgen command that loads from the hub read these repositories instead. The folder holds
{models,datasets}/<org>--<name>/<revision>/<files> (a revision with slashes, such as refs/convert/parquet, URL-quoted).
--write-tiny-repos first writes tiny repositories under the ids full-scale runs load: OpenWebText's parquet export,
TinyGSM, GSM8K, gpt2, gpt2-large, SmolLM-135M's tokenizer, and with --release-fixtures the paper's releases."""

OWT = ("Skylion007/openwebtext", "refs/convert/parquet")
TINYGSM = "TinyGSM/TinyGSM"
GSM8K = "openai/gsm8k"
GPT2_IDS = ("gpt2", "gpt2-large")
SMOLLM = "HuggingFaceTB/SmolLM-135M"
RELEASES = "jdeschena/blockgen"
GPT2_SPECIAL = "<|endoftext|>"
GSM8K_CARD = b"---\nconfigs:\n- config_name: main\n  data_files:\n  - split: test\n    path: main/test-*\n---\n"
# the fixture sets' tokenizer layouts -> the dataset whose tokenizer they stand for
FIXTURE_DATASETS = {"released": "tinygsm", "released-gpt2": "owt"}


def _parquet(columns: dict[str, list]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table(columns), out)
    return out.getvalue()


def _documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _gpt2_tokenizer(texts: list[str], out: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE saved as GPT-2's files, with GPT-2's one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[GPT2_SPECIAL], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    GPT2TokenizerFast(tokenizer_object=tok, bos_token=GPT2_SPECIAL, eos_token=GPT2_SPECIAL,
                      unk_token=GPT2_SPECIAL).save_pretrained(str(out))
    tok.model.save(str(out))  # vocab.json and merges.txt, which gpt2's repository has beside tokenizer.json
    return out


def smollm_like_tokenizer(out: Path) -> Path:
    """SmolLM's layout in miniature, the release fixtures' (`released/`): 64 tokens, its own PAD, vocab_size == len."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<bos>", "<eos>", "<pad>", "<unk>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!'-:;\n=+*/()ABCDEFGH")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(out))
    return out


def _scorer_model(tokenizer_dir: Path, out: Path, seed: int) -> Path:
    """GPT-2 Large's architecture, config keys and head width (64: vLLM's CPU attention has no kernel for 16) at two
    heads and two layers, random weights."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=128, n_layer=2, n_head=2,
                        bos_token_id=vocab - 1, eos_token_id=vocab - 1, architectures=["GPT2LMHeadModel"])
    GPT2LMHeadModel(config).save_pretrained(str(out), safe_serialization=True)
    return out


def release_subfolder(fixture: str, dataset: str) -> str | None:
    """A fixture's folder (`blockgen/multi_block_size/8/tiny/0.05_0.95/absorb`) -> the real release subfolder it stands
    for on `dataset`, or None when that is no release of the paper."""
    from blockgen.harness.checkpoints.release_catalogue import RELEASES as CATALOGUE

    parts = ["16" if p == "8" else dataset if p == "tiny" else p for p in fixture.split("/")]
    subfolder = "/".join(parts)
    return subfolder if subfolder in set(CATALOGUE.values()) else None


def write_tiny_hub(root: str | Path, release_fixtures: str | Path | None = None, seed: int = 0) -> list[str]:
    """Write every repository under `root` (the stand-in's folder); returns the ids written."""
    from blockgen.harness.data.wordproblems import generate, to_records

    fixtures = Path(release_fixtures) if release_fixtures is not None else None
    if fixtures is not None:
        missing = [str(fixtures / p) for p in (*FIXTURE_DATASETS, "released-gpt2/tokenizer") if not (fixtures / p).is_dir()]
        if missing:
            raise ValueError(f"release fixtures {fixtures}: no folder {', '.join(missing)} (it holds released/ and "
                             "released-gpt2/ in the authors' format, released-gpt2/tokenizer/ among them)")
    root = Path(root)
    work = root / ".build"
    docs = _documents()
    publish(root, "datasets", OWT[0], {f"plain_text/train/{i:04d}.parquet": _parquet({"text": part})
                                        for i, part in enumerate((docs[: len(docs) // 2], docs[len(docs) // 2 :]))},
            revision=OWT[1])
    train = to_records(generate("train", 512, seed))
    publish(root, "datasets", TINYGSM, {"data/train-00000-of-00001.parquet": _parquet(
        {"question": [r["question"] for r in train], "code": [r["code"] for r in train]})})
    test = to_records(generate("test", 64, seed))
    publish(root, "datasets", GSM8K, {"README.md": GSM8K_CARD, "main/test-00000-of-00001.parquet": _parquet(
        {"question": [r["question"] for r in test], "answer": [f"#### {r['answer']}" for r in test]})})

    gpt2 = fixtures / "released-gpt2" / "tokenizer" if fixtures else _gpt2_tokenizer(docs, work / "gpt2")
    smollm = smollm_like_tokenizer(work / "smollm")
    for repo_id in GPT2_IDS:
        publish(root, "models", repo_id, {p.name: p for p in gpt2.iterdir() if p.is_file()})
    scorer = _scorer_model(gpt2, work / "gpt2-large", seed)
    publish(root, "models", "gpt2-large", {p.name: p for p in scorer.iterdir() if p.is_file()})
    publish(root, "models", SMOLLM, {p.name: p for p in smollm.iterdir() if p.is_file()})
    written = [OWT[0], TINYGSM, GSM8K, *GPT2_IDS, SMOLLM]
    if fixtures is not None:
        files = {}
        for layout, dataset in FIXTURE_DATASETS.items():
            for config in sorted((fixtures / layout).rglob("config.json")):
                folder = config.parent.relative_to(fixtures / layout).as_posix()
                if (subfolder := release_subfolder(folder, dataset)) is not None:
                    files |= {f"{subfolder}/{n}": config.parent / n for n in ("config.json", "model.safetensors")}
        publish(root, "models", RELEASES, files)
        written.append(RELEASES)
    shutil.rmtree(work)  # the tokenizers' and the scorer's build folders: their files are published
    (root / "README.md").write_text(json.dumps({"written_by": "blockgen hub-standin --write-tiny-repos", "repos": written}, indent=2))
    return written


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", required=True, help="the repositories' folder (ROOT/{models,datasets}/<org>--<name>/<revision>/)")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--write-tiny-repos", action="store_true",
                        help="first write tiny repositories of the real ids (OpenWebText, TinyGSM, GSM8K, gpt2, gpt2-large, SmolLM) into --root")
    parser.add_argument("--release-fixtures", default=None, metavar="DIR",
                        help="with --write-tiny-repos: the folder holding released/ and released-gpt2/ (the authors' format), "
                             "served as jdeschena/blockgen with their tokenizers as gpt2's and SmolLM's")


def run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if args.release_fixtures and not args.write_tiny_repos:
        raise SystemExit("blockgen hub-standin: --release-fixtures is read by --write-tiny-repos; add it")
    if args.write_tiny_repos:
        try:
            print(f"# wrote {', '.join(write_tiny_hub(root, args.release_fixtures))} under {root}", flush=True)
        except ValueError as err:
            raise SystemExit(f"blockgen hub-standin: {err}") from None
    if not root.is_dir():
        raise SystemExit(f"blockgen hub-standin: {root} is not a folder; it holds {'/'.join(KINDS)}/<org>--<name>/<revision>/")
    hub = HubStandin(root, args.port)
    print(f"export HF_ENDPOINT={hub.endpoint}", flush=True)
    hub.start()
    try:
        threading.Event().wait()  # until Ctrl-C or SIGTERM
    except KeyboardInterrupt:
        pass
    finally:
        hub.stop()
    return 0
