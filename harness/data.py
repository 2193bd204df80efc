"""Data: a text source -> tokenizer -> fixed-length examples with a loss mask.

Sources (`DataConfig.source`):
- "embedded": procedurally generated TinyGSM-style word problems (offline default) and a byte-level
  BPE trained on them locally;
- "tinygsm": the hub dataset TinyGSM/TinyGSM (fields `question`, `code`), or local JSON/JSONL
  files of the same schema (`path`);
- "owt": OpenWebText (`text`), documents joined with EOS and cut into `seq_len` chunks, the last
  100k documents held out for validation; or local files of the same schema;
- "text": offline English text every Python has, the documentation topics of `pydoc_data.topics`
  (or local files, `path`), laid out as OWT; a document is held out when a stable hash of its text
  says so (one in ten), so the split does not depend on file order.

`document_split` is the one definition of the document sources' train / held-out split: training's
validation and the `owt_ppl` / `owt_genppl` tasks both read it.

Word problems become `[BOS] question SEP code [EOS] PAD...`: no loss on the question, which also
stays clean in the noisy stream (`condition_mask`), as the prompt is at sampling time.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import numpy as np
import torch

from blockgen.harness.hub import hub_call
from blockgen.harness.tokenizer import SpecialTokens, load_tokenizer, special_tokens, train_bpe
from blockgen.harness.wordproblems import DEFAULT_DIFFICULTY, difficulty

SOURCES = ("embedded", "tinygsm", "owt", "text")
DOCUMENT_SOURCES = ("owt", "text")  # documents joined with EOS and cut into chunks
OWT_VALIDATION_DOCS = 100_000
TEXT_HELD_OUT_ONE_IN = 10  # "text": a document is held out when its hash is 0 modulo this


@dataclass(frozen=True)
class DataConfig:
    source: Literal["embedded", "tinygsm", "owt", "text"] = "embedded"
    tokenizer: str = "embedded"  # "embedded" (train a BPE on the source locally), a local directory or a hub name
    path: str | None = None  # local files instead of the hub (JSON/JSONL with the hub schema; "text": also plain text)
    n_train: int = 50_000  # embedded: number of generated training problems
    difficulty: str = DEFAULT_DIFFICULTY  # embedded: the generator's level (wordproblems.DIFFICULTIES)
    n_val: int = 256  # validation examples
    vocab_size: int = 1024  # embedded BPE vocabulary
    seed: int = 0
    cache_dir: str = "runs/data"  # where the embedded tokenizer and data are kept

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown data source {self.source!r}; choose one of {list(SOURCES)}")
        difficulty(self.difficulty)  # a clear error now rather than at data generation


@dataclass(frozen=True)
class Examples:
    """Fixed-length examples: tokens (N, L); loss_mask and condition_mask (N, L) bool.

    `tokens` is int64, or int32 when it is a memory-mapped token cache (`chunk_documents` with a
    cache file); indexing always returns int64 tokens, which is what the model takes.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    condition_mask: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, idx) -> "Examples":
        return Examples(self.tokens[idx].long(), self.loss_mask[idx], self.condition_mask[idx])


def encode_problems(
    records: Iterable[dict], tokenizer, special: SpecialTokens, seq_len: int
) -> tuple[Examples, int]:
    """TinyGSM records -> examples; returns (examples, number dropped for being longer than seq_len)."""
    records = list(records)
    questions = tokenizer([r["question"] for r in records], add_special_tokens=False)["input_ids"]
    codes = tokenizer([r["code"] for r in records], add_special_tokens=False)["input_ids"]
    rows, loss, cond, dropped = [], [], [], 0
    for q, c in zip(questions, codes):
        prompt = [special.bos, *q, *special.sep]
        ids = prompt + c + [special.eos]
        if len(ids) > seq_len:
            dropped += 1
            continue
        pad = seq_len - len(ids)
        rows.append(ids + [special.pad] * pad)
        loss.append([False] * len(prompt) + [True] * (len(c) + 1) + [False] * pad)
        cond.append([True] * len(prompt) + [False] * (seq_len - len(prompt)))
    if not rows:
        raise ValueError(f"no example fits in seq_len={seq_len}")
    as_tensor = torch.tensor
    return Examples(as_tensor(rows), as_tensor(loss), as_tensor(cond)), dropped


def encode_prompt(question: str, tokenizer, special: SpecialTokens) -> list[int]:
    """The prompt a word-problem model continues at sampling time: `[BOS] question SEP`."""
    return [special.bos, *tokenizer.encode(question, add_special_tokens=False), *special.sep]


DOCUMENTS_PER_BATCH = 10_000  # documents tokenized per call (the fast tokenizer parallelises a batch)


def _token_batches(texts: Sequence[str], tokenizer, eos: int) -> Iterator[np.ndarray]:
    """The token stream of the documents, each followed by EOS, in int32 pieces of a batch of documents."""
    for start in range(0, len(texts), DOCUMENTS_PER_BATCH):
        ids = tokenizer(list(texts[start : start + DOCUMENTS_PER_BATCH]), add_special_tokens=False)["input_ids"]
        piece = np.empty(sum(len(d) + 1 for d in ids), dtype=np.int32)
        at = 0
        for d in ids:
            piece[at : at + len(d)] = d
            piece[at + len(d)] = eos
            at += len(d) + 1
        yield piece


def _write_token_cache(pieces: Iterator[np.ndarray], cache: Path) -> None:
    """Write the stream to `cache` piece by piece; the file appears (atomically) only when complete."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for piece in pieces:
            f.write(piece.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, cache)


def chunk_documents(texts: Sequence[str], tokenizer, special: SpecialTokens, seq_len: int, cache: str | Path | None = None) -> Examples:
    """OWT layout: documents joined with EOS and cut into seq_len chunks (the remainder dropped).

    Documents are tokenized a batch at a time. With `cache` (a file path) the token stream goes to
    that file as it is made and is then memory-mapped, so a corpus larger than memory (OWT: about 9B
    tokens) never sits in RAM; an existing cache file is reused without tokenizing again.
    """
    if cache is None:
        pieces = list(_token_batches(texts, tokenizer, special.eos))
        stream = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int32)
    else:
        cache = Path(cache)
        if not cache.is_file():
            _write_token_cache(_token_batches(texts, tokenizer, special.eos), cache)
        stream = np.memmap(cache, dtype=np.int32, mode="c")  # copy-on-write: a writable view, read lazily
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"the documents hold {len(stream)} tokens, fewer than seq_len={seq_len}")
    tokens = torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len))
    if cache is None:
        tokens = tokens.long()
    # Views of one element: no (N, L) masks in memory for an OWT-sized corpus.
    loss_mask = torch.ones((), dtype=torch.bool).expand(n, seq_len)
    return Examples(tokens, loss_mask, torch.zeros((), dtype=torch.bool).expand(n, seq_len))


def token_cache_path(config: "DataConfig", tokenizer, split: str) -> Path:
    """Where a document source's token stream is cached: keyed by the tokenizer, the data and `split`
    (the stream does not depend on seq_len, so one cache serves every model length)."""
    key = json.dumps([tokenizer.backend_tokenizer.to_str(), config.source, config.path, split])
    return Path(config.cache_dir) / f"tokens-{config.source}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.int32"


def embedded_tokenizer(config: DataConfig):
    """A BPE trained locally on the source's training text, cached under cache_dir.

    Word problems ("embedded"): questions and programs of generated training problems. Other
    sources: the training documents of `document_split` (the cache key hashes them, so other text
    gets another tokenizer).
    """
    from transformers import PreTrainedTokenizerFast

    if config.source == "embedded":
        from blockgen.harness.wordproblems import generate

        problems = generate("train", min(config.n_train, 20_000), seed=config.seed, level=config.difficulty)
        texts = [p.question for p in problems] + [p.code for p in problems]
        name = f"{config.source}-{config.difficulty}"
    else:
        texts = document_split(config)[0] if config.source in DOCUMENT_SOURCES else None
        if texts is None:
            raise ValueError(f"tokenizer='embedded' trains on the embedded word problems or a document source "
                             f"{list(DOCUMENT_SOURCES)}; source {config.source!r} needs tokenizer=<directory or hub name>")
        name = config.source
    # The key hashes the training text, so a changed generator or corpus never reuses a stale tokenizer.
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:12]
    directory = Path(config.cache_dir) / f"tokenizer-{name}-{digest}-v{config.vocab_size}"
    if (directory / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    return train_bpe(texts, config.vocab_size, directory)


def get_tokenizer(config: DataConfig):
    if config.tokenizer == "embedded":
        return embedded_tokenizer(config)
    return load_tokenizer(config.tokenizer)


def _hub_or_local(name: str, config: DataConfig, split: str | None = None, **kwargs):
    from datasets import load_dataset

    if config.path is not None:
        files = sorted(glob.glob(config.path)) or [config.path]  # a file, or a pattern like "dir/*.jsonl"
        return load_dataset("json", data_files=files, split="train")
    return hub_call(lambda: load_dataset(name, split=split, **kwargs), f"dataset {name}")


def _stable_fraction_held_out(text: str) -> bool:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % TEXT_HELD_OUT_ONE_IN == 0


def _local_documents(pattern: str) -> list[str]:
    """Documents of local files: JSON/JSONL records with a `text` field, any other file one document."""
    files = sorted(glob.glob(pattern)) or [pattern]
    docs: list[str] = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"data path {pattern!r}: no such file")
        raw = path.read_text(encoding="utf-8")
        if path.suffix not in (".json", ".jsonl"):
            docs.append(raw)
            continue
        try:  # a JSON array (or one object), else JSON lines, as the hub's `json` loader reads them
            records = json.loads(raw)
            records = records if isinstance(records, list) else [records]
        except json.JSONDecodeError:
            records = [json.loads(line) for line in raw.splitlines() if line.strip()]
        docs.extend(r["text"] for r in records)
    return docs


@dataclass(frozen=True)
class TextColumn(Sequence):
    """Rows [start, stop) of a `datasets.Dataset`'s `text` column, read on demand (OWT's 8M training
    documents are never one Python list); slicing returns a list of that slice's texts."""

    dataset: Any
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            if step != 1:
                raise ValueError("TextColumn slices must be contiguous")
            return self.dataset[self.start + lo : self.start + hi]["text"] if hi > lo else []
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.dataset[self.start + i % len(self)]["text"]


def document_split(config: DataConfig) -> tuple[Sequence[str], list[str]]:
    """(training documents, held-out documents) of a document source ("owt" or "text").

    "owt": the last 100k documents are held out (local files: the last tenth, at most 100k).
    "text": `pydoc_data.topics` in topic order (or local files); a document is held out when the
    SHA-256 of its text is 0 modulo 10, so the split is the same on every machine and in any order.
    """
    if config.source == "owt":
        if config.path is not None:
            texts = _local_documents(config.path)
            held_out = min(OWT_VALIDATION_DOCS, len(texts) // 10)
            return texts[: len(texts) - held_out], texts[len(texts) - held_out :]
        data = _hub_or_local("Skylion007/openwebtext", config, split="train")
        cut = len(data) - OWT_VALIDATION_DOCS
        return TextColumn(data, 0, cut), TextColumn(data, cut, len(data))[:]
    if config.source == "text":
        if config.path is None:
            from pydoc_data.topics import topics

            texts = [topics[name] for name in sorted(topics)]
        else:
            texts = _local_documents(config.path)
        train = [t for t in texts if not _stable_fraction_held_out(t)]
        held_out = [t for t in texts if _stable_fraction_held_out(t)]
        if not train or not held_out:
            raise ValueError(f"source 'text' ({config.path or 'pydoc_data.topics'}): {len(texts)} documents give "
                             f"{len(train)} for training and {len(held_out)} held out; both need at least one")
        return train, held_out
    raise ValueError(f"source {config.source!r} has no document split; document sources: {list(DOCUMENT_SOURCES)}")


def load_examples(config: DataConfig, tokenizer, seq_len: int) -> tuple[Examples, Examples, dict]:
    """(train, validation, info) for a data config."""
    special = special_tokens(tokenizer)
    if config.source == "embedded":
        from blockgen.harness.wordproblems import generate, to_records

        level = config.difficulty
        train, dropped = encode_problems(to_records(generate("train", config.n_train, config.seed, level)), tokenizer, special, seq_len)
        val, _ = encode_problems(to_records(generate("validation", config.n_val, config.seed, level)), tokenizer, special, seq_len)
        info = {"dropped_too_long": dropped}
    elif config.source == "tinygsm":
        data = _hub_or_local("TinyGSM/TinyGSM", config, split="train")
        n_val = min(config.n_val, len(data) // 10)
        records = [{"question": r["question"], "code": r["code"]} for r in data]
        train, dropped = encode_problems(records[: len(records) - n_val], tokenizer, special, seq_len)
        val, _ = encode_problems(records[len(records) - n_val :], tokenizer, special, seq_len)
        info = {"dropped_too_long": dropped}
    else:
        train_docs, held_out = document_split(config)
        # OWT's training stream (about 9B tokens) is cached on disk and memory-mapped; held-out text is small.
        cache = token_cache_path(config, tokenizer, f"train:{len(train_docs)}:{len(held_out)}") if config.source == "owt" else None
        train = chunk_documents(train_docs, tokenizer, special, seq_len, cache=cache)
        val = chunk_documents(held_out, tokenizer, special, seq_len)[: config.n_val]
        info = {"validation_documents": len(held_out)}
    info.update(train_examples=len(train), validation_examples=len(val), source=config.source)
    return train, val, info

