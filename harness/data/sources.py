"""Data: a text source -> tokenizer -> fixed-length examples with a loss mask.

Sources (`DataConfig.source`):
- "wordproblems" (the default): TinyGSM-style word problems generated offline by
  `blockgen.harness.data.wordproblems`;
- "tinygsm": the hub dataset TinyGSM/TinyGSM (fields `question`, `code`), or local JSON/JSONL/parquet
  files of the same schema (`path`); a random 1 % (seed 42) is held out, as the authors' scripts do;
- "owt": OpenWebText (`text`), read from the hub's parquet export (`hub_name`, `hub_revision`; a
  local folder laid out as that export works too) or local files (`path`); the last 100k documents
  of the train split are held out;
- "language": documents of the synthetic language with exact probabilities (`harness/data/language.py`,
  `language` names it): `n_train` training documents drawn with the data seed, a fixed held-out set;
- "text": offline English text every Python has, the documentation topics of `pydoc_data.topics`
  (or local files, `path`), laid out as OWT; a document is held out when a stable hash of its text
  says so (one in ten), so the split does not depend on file order.

Tokenizers (`DataConfig.tokenizer`): "local" (the default) trains a byte-level BPE of `vocab_size`
on the source's training text and caches it; anything else is a local directory or a hub name.
Both defaults were once spelled "embedded", a word now kept for the offline tasks and grids
(`gsm8k_code_embedded`, `owt-embedded`, ...): `RENAMED` maps the old spelling where it is stored,
and cache keys keep it (`cache_spelling`).

Document sources ("owt", "text") are framed as the authors' (MDLM's wrapping): documents tokenized
with EOS appended, concatenated per batch of 1,000 documents, cut into (L - 2)-token pieces, each
framed BOS + piece + EOS; each batch's remainder is dropped (`frame_documents`).

`document_split` is the one definition of the document sources' train / held-out split: training's
validation and the `owt_ppl` / `owt_genppl` tasks both read it.

Word problems become `[BOS] question SEP code [EOS] PAD...`: no loss on the question, which also
stays clean in the noisy stream (`condition_mask`), as the prompt is at sampling time; loss on the
padding only with `train_on_pad` (the authors' TinyGSM runs; the generated problems leave it off).

Preparing a source into the memory-mapped cache that training reads is `blockgen.harness.data.prepare`.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import numpy as np
import torch

from blockgen.harness.checkpoints.hub import HubUnavailableError, file_id, hub_call
from blockgen.harness.checkpoints.tokenizer import SpecialTokens, load_tokenizer, special_tokens, train_bpe
from blockgen.harness.data.language import TEST_SEED, documents, language_identity, load_language
from blockgen.harness.data.wordproblems import DEFAULT_DIFFICULTY, difficulty

WORDPROBLEMS = "wordproblems"  # the generated word problems (harness/data/wordproblems/)
LOCAL_TOKENIZER = "local"  # a BPE trained on the source's own training text
LANGUAGE = "language"  # the synthetic language with exact probabilities (harness/data/language.py)
SOURCES = (WORDPROBLEMS, "tinygsm", "owt", "text", LANGUAGE)
# Values renamed when "embedded" stopped naming four things. Stored configs still spell them the old
# way: a run's training_state.pt and train_config.json, a prepared cache's meta.json, a checkpoint's
# config.json ("training"). New configs and the command line take the new names only.
RENAMED = {"source": {"embedded": WORDPROBLEMS}, "tokenizer": {"embedded": LOCAL_TOKENIZER}}
DOCUMENT_SOURCES = ("owt", "text", LANGUAGE)  # documents joined with EOS and cut into framed chunks
OWT_VALIDATION_DOCS = 100_000
TEXT_HELD_OUT_ONE_IN = 10  # "text": a document is held out when its hash is 0 modulo this
LANGUAGE_HELD_OUT_DOCS = 1_000  # "language": held-out documents (drawn with language.TEST_SEED)
# TinyGSM's held-out split, as the authors' scripts: a random 1 % of the train split, seed 42, drawn as
# `datasets.Dataset.train_test_split(test_size=0.01, seed=42)` draws it.
TINYGSM_HELD_OUT_FRACTION = 0.01
TINYGSM_SPLIT_SEED = 42
# Where the hub sources live. OWT's main branch shipped a loading script, which datasets >= 4 refuses;
# the hub's automatic parquet export of the same train split (config `plain_text`, files
# `plain_text/train/NNNN.parquet`) loads with any datasets version.
HUB_DATASETS = {"owt": ("Skylion007/openwebtext", "refs/convert/parquet"), "tinygsm": ("TinyGSM/TinyGSM", None)}
DOCUMENTS_PER_BATCH = 1_000  # the authors' map batch: each batch's remainder is dropped
OFFLINE_PATHS = (
    "Offline, run the same pipeline at small scale (make train-owt / train-tinygsm OFFLINE=1: offline text "
    "and word problems), or point --data.hub-name at a local copy of the dataset's parquet export, or "
    "--data.path at local files of the same schema."
)


@dataclass(frozen=True)
class DataConfig:
    source: Literal["wordproblems", "tinygsm", "owt", "text", "language"] = WORDPROBLEMS
    tokenizer: str = LOCAL_TOKENIZER  # "local" (a BPE trained on the source), a local directory or a hub name
    path: str | None = None  # local files instead of the hub (JSON/JSONL/parquet with the hub schema; "text": also plain text)
    hub_name: str | None = None  # hub dataset (or a local folder laid out as its parquet export); None: HUB_DATASETS
    hub_revision: str | None = None  # branch, tag or commit of hub_name; None: HUB_DATASETS' (OWT: the parquet export)
    train_on_pad: bool = False  # word problems: loss on the padding too (the authors' TinyGSM runs)
    n_train: int = 50_000  # wordproblems / language: number of generated training problems / documents
    difficulty: str = DEFAULT_DIFFICULTY  # wordproblems: the generator's level (wordproblems.DIFFICULTIES)
    language: str = "default"  # language: a registered language (language.LANGUAGES) or a JSON file
    n_val: int = 256  # validation examples
    vocab_size: int = 1024  # tokenizer "local": the BPE's vocabulary
    seed: int = 0
    cache_dir: str = "runs/data"  # where the local tokenizer and the prepared data are kept

    def __post_init__(self) -> None:
        for name, renamed in RENAMED.items():
            if (value := getattr(self, name)) in renamed:
                choices = f"one of {list(SOURCES)}" if name == "source" else f"{LOCAL_TOKENIZER!r}, a local directory or a hub name"
                raise ValueError(f"{name}={value!r} is now spelled {renamed[value]!r}; choose {choices}")
        if self.source not in SOURCES:
            raise ValueError(f"unknown data source {self.source!r}; choose one of {list(SOURCES)}")
        difficulty(self.difficulty)  # a clear error now rather than at data generation

    def hub_dataset(self) -> tuple[str, str | None]:
        """(name, revision) of the hub dataset this source reads when `path` is not given."""
        if self.source not in HUB_DATASETS:
            raise ValueError(f"source {self.source!r} reads no hub dataset; hub sources: {sorted(HUB_DATASETS)}")
        name, revision = HUB_DATASETS[self.source]
        if self.hub_name is not None and self.hub_name != name:
            return self.hub_name, self.hub_revision  # another repository or a local mirror: its own revision
        return name, self.hub_revision if self.hub_revision is not None else revision


def current_names(stored: dict) -> dict:
    """A stored DataConfig dict, or a prepared cache's info, with renamed values in today's spelling."""
    return {**stored, **{k: table.get(stored[k], stored[k]) for k, table in RENAMED.items() if isinstance(stored.get(k), str)}}


def cache_spelling(name: str, value: str) -> str:
    """How cache keys and directory names spell a value of field `name`: as before the rename, so the
    caches prepared then are still found (new spellings would rebuild every cache under a new key)."""
    return next((old for old, new in RENAMED[name].items() if new == value), value)


@dataclass(frozen=True)
class Examples:
    """Fixed-length examples: tokens (N, L); per example, the prompt length and the loss length.

    Position p of example i is prompt (clean in the noisy stream, no loss) when p < prompt_len[i], and
    carries loss when prompt_len[i] <= p < loss_len[i]. The (N, L) masks are computed on access, so an
    OWT- or TinyGSM-sized set never holds them. `tokens` is int64, or int32 when memory-mapped from a
    prepared cache; indexing always returns int64 tokens, which is what the model takes.
    """

    tokens: torch.Tensor
    prompt_len: torch.Tensor
    loss_len: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, idx) -> "Examples":
        return Examples(self.tokens[idx].long(), self.prompt_len[idx], self.loss_len[idx])

    def _positions(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[-1])

    @property
    def loss_mask(self) -> torch.Tensor:
        pos = self._positions()
        return (pos >= self.prompt_len[..., None]) & (pos < self.loss_len[..., None])

    @property
    def condition_mask(self) -> torch.Tensor:
        return self._positions() < self.prompt_len[..., None]

    @staticmethod
    def documents(tokens: torch.Tensor) -> "Examples":
        """Document chunks: no prompt, loss everywhere (views of one element: no (N,) arrays)."""
        n, length = tokens.shape
        return Examples(tokens, torch.zeros((), dtype=torch.int32).expand(n), torch.full((), length, dtype=torch.int32).expand(n))


@dataclass(frozen=True)
class ProblemBatch:
    """Encoded word problems: rows (k, L) int32, prompt and content lengths (k,), and how many were dropped."""

    rows: np.ndarray
    prompt_len: np.ndarray
    length: np.ndarray
    dropped: int


def token_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of a batch of texts, no special tokens: the same ids as `tokenizer(texts)`, from the
    backend's batch encoder without offsets (about a third faster on this machine)."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:  # a tokenizer file that sets them
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [e.ids for e in backend.encode_batch_fast(list(texts), add_special_tokens=False)]


def encode_problem_batch(questions: Sequence[str], codes: Sequence[str], tokenizer, special: SpecialTokens, seq_len: int) -> ProblemBatch:
    """`[BOS] question SEP code [EOS] PAD...` for a batch; examples longer than seq_len are dropped (the authors' too)."""
    qs, cs = token_ids(tokenizer, questions), token_ids(tokenizer, codes)
    rows = np.full((len(qs), seq_len), special.pad, dtype=np.int32)
    prompt_len = np.empty(len(qs), dtype=np.int32)
    length = np.empty(len(qs), dtype=np.int32)
    kept = 0
    for q, c in zip(qs, cs):
        ids = [special.bos, *q, *special.sep, *c, special.eos]
        if len(ids) > seq_len:
            continue
        rows[kept, : len(ids)] = ids
        prompt_len[kept] = 1 + len(q) + len(special.sep)
        length[kept] = len(ids)
        kept += 1
    return ProblemBatch(rows[:kept], prompt_len[:kept], length[:kept], len(qs) - kept)


def problem_examples(batch: ProblemBatch, train_on_pad: bool) -> Examples:
    loss_len = np.full_like(batch.length, batch.rows.shape[1]) if train_on_pad else batch.length
    return Examples(torch.from_numpy(batch.rows).long(), torch.from_numpy(batch.prompt_len), torch.from_numpy(loss_len))


def encode_problems(
    records: Iterable[dict], tokenizer, special: SpecialTokens, seq_len: int, train_on_pad: bool = False
) -> tuple[Examples, int]:
    """TinyGSM records -> examples in memory; returns (examples, number dropped for being longer than seq_len)."""
    records = list(records)
    batch = encode_problem_batch([r["question"] for r in records], [r["code"] for r in records], tokenizer, special, seq_len)
    if not len(batch.rows):
        raise ValueError(f"no example fits in seq_len={seq_len}")
    return problem_examples(batch, train_on_pad), batch.dropped


def encode_prompt(question: str, tokenizer, special: SpecialTokens) -> list[int]:
    """The prompt a word-problem model continues at sampling time: `[BOS] question SEP`."""
    return [special.bos, *tokenizer.encode(question, add_special_tokens=False), *special.sep]


def frame_documents(texts: Sequence[str], tokenizer, special: SpecialTokens, seq_len: int) -> np.ndarray:
    """One batch of documents -> (k, seq_len) int32 chunks: each document's tokens and EOS, concatenated,
    cut into (seq_len - 2)-token pieces framed BOS + piece + EOS; the batch's remainder is dropped."""
    if seq_len < 3:
        raise ValueError(f"seq_len={seq_len}: a framed chunk needs BOS, at least one token and EOS")
    ids = token_ids(tokenizer, texts)
    stream = np.empty(sum(len(d) + 1 for d in ids), dtype=np.int32)
    at = 0
    for d in ids:
        stream[at : at + len(d)] = d
        stream[at + len(d)] = special.eos
        at += len(d) + 1
    piece = seq_len - 2
    k = len(stream) // piece
    rows = np.empty((k, seq_len), dtype=np.int32)
    rows[:, 0], rows[:, -1] = special.bos, special.eos
    rows[:, 1:-1] = stream[: k * piece].reshape(k, piece)
    return rows


def document_batches(texts: Sequence[str]) -> Iterator[Sequence[str]]:
    """The documents in the authors' map batches (DOCUMENTS_PER_BATCH, from the split's first document)."""
    for start in range(0, len(texts), DOCUMENTS_PER_BATCH):
        yield texts[start : start + DOCUMENTS_PER_BATCH]


def chunk_documents(texts: Sequence[str], tokenizer, special: SpecialTokens, seq_len: int) -> Examples:
    """Documents -> framed chunks in memory (`frame_documents` per batch): the held-out text of the
    tasks and the scorer. Training reads the same chunks from its prepared cache."""
    pieces = [frame_documents(batch, tokenizer, special, seq_len) for batch in document_batches(texts)]
    rows = np.concatenate(pieces) if pieces else np.empty((0, seq_len), dtype=np.int32)
    if len(rows) == 0:
        raise ValueError(f"the documents hold fewer tokens than one chunk of seq_len={seq_len} per batch of {DOCUMENTS_PER_BATCH}")
    return Examples.documents(torch.from_numpy(rows).long())


def _local_tokenizer_texts(config: DataConfig) -> tuple[str, list[str]]:
    if config.source == WORDPROBLEMS:
        from blockgen.harness.data.wordproblems import generate

        problems = generate("train", min(config.n_train, 20_000), seed=config.seed, level=config.difficulty)
        name = f"{cache_spelling('source', config.source)}-{config.difficulty}"
        return name, [p.question for p in problems] + [p.code for p in problems]
    if config.source == LANGUAGE:
        return f"language-{hashlib.sha256(language_identity(config.language).encode()).hexdigest()[:8]}", list(document_split(config)[0])
    if config.source not in DOCUMENT_SOURCES:
        raise ValueError(f"tokenizer={LOCAL_TOKENIZER!r} trains on the generated word problems or a document source "
                         f"{list(DOCUMENT_SOURCES)}; source {config.source!r} needs tokenizer=<directory or hub name>")
    return config.source, list(document_split(config)[0])


def _splits_digits(config: DataConfig) -> bool:
    """The word problems' programs copy the question's numbers: one token per digit makes that a copy of the
    same tokens (docs/results.md, "Copying numbers: digit tokens and half the learning rate")."""
    return config.source == WORDPROBLEMS


def local_tokenizer_dir(config: DataConfig) -> tuple[Path, list[str]]:
    """Where the local tokenizer of `config` is kept, and the text it trains on. The name hashes
    the training text, so a changed generator or corpus never reuses a stale tokenizer."""
    name, texts = _local_tokenizer_texts(config)
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:12]
    digits = "-digits" if _splits_digits(config) else ""
    return Path(config.cache_dir) / f"tokenizer-{name}{digits}-{digest}-v{config.vocab_size}", texts


def local_tokenizer(config: DataConfig):
    """A BPE trained locally on the source's training text, cached under cache_dir.

    Word problems: questions and programs of generated training problems, one token per digit. Document sources: the
    training documents of `document_split`.
    """
    from transformers import PreTrainedTokenizerFast

    directory, texts = local_tokenizer_dir(config)
    if (directory / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    return train_bpe(texts, config.vocab_size, directory, split_digits=_splits_digits(config))


def get_tokenizer(config: DataConfig):
    if config.tokenizer == LOCAL_TOKENIZER:
        return local_tokenizer(config)
    return load_tokenizer(config.tokenizer)


def _local_files(pattern: str) -> list[str]:
    files = sorted(glob.glob(pattern)) or [pattern]
    for name in files:
        if not Path(name).exists():
            raise FileNotFoundError(f"data path {pattern!r}: no such file")
    return files


def load_rows(config: DataConfig, split: str = "train"):
    """The source's rows as a `datasets.Dataset` (Arrow, memory-mapped: never a Python list): local
    files (`path`: JSON/JSONL, or parquet), else the hub dataset at its revision (or a local folder laid
    out as the hub's export). Every failure of `datasets` becomes one clear error naming the offline paths."""
    from datasets import load_dataset

    if config.path is not None:
        files = _local_files(config.path)
        kind = "parquet" if all(f.endswith(".parquet") for f in files) else "json"
        return load_dataset(kind, data_files=files, split="train")
    return _hub_rows(*config.hub_dataset(), split)


@functools.lru_cache(maxsize=None)
def _hub_rows(name: str, revision: str | None, split: str):
    """A hub dataset's split, loaded (retried while the hub does not answer) once per process: every
    task and setting of a sweep that reads it shares the memory-mapped copy."""
    from datasets import load_dataset

    what = f"dataset {name}" + (f" at revision {revision}" if revision else "")
    try:
        return hub_call(lambda: load_dataset(name, revision=revision, split=split), what)
    except HubUnavailableError as err:
        raise HubUnavailableError(f"{err}\n{OFFLINE_PATHS}") from err.__cause__
    except Exception as err:  # datasets >= 4 raises RuntimeError for loading scripts, others for odd layouts
        raise HubUnavailableError(f"could not load {what}: {type(err).__name__}: {err}\n{OFFLINE_PATHS}") from err


def source_identity(config: DataConfig) -> list:
    """What a source's documents depend on, known without reading them (cache keys): local files by
    `file_id`; the embedded text (`pydoc_data.topics`) by its content; a hub dataset by name and
    revision, or the files of a local folder laid out as its export."""
    if config.path is not None:
        return [config.source, [file_id(f) for f in _local_files(config.path)]]
    if config.source == "text":
        from pydoc_data.topics import topics

        return ["text", hashlib.sha256(json.dumps(topics, sort_keys=True).encode()).hexdigest()]
    if config.source == LANGUAGE:
        return [LANGUAGE, language_identity(config.language), config.n_train, config.seed]
    name, revision = config.hub_dataset()
    if Path(name).is_dir():
        return [config.source, [file_id(f) for f in sorted(Path(name).rglob("*")) if f.is_file()]]
    return [config.source, name, revision]


def _stable_fraction_held_out(text: str) -> bool:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % TEXT_HELD_OUT_ONE_IN == 0


def _local_documents(pattern: str) -> list[str]:
    """Documents of local files: JSON/JSONL records with a `text` field, any other file one document."""
    docs: list[str] = []
    for name in _local_files(pattern):
        path = Path(name)
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


def owt_held_out_docs(n_documents: int) -> int:
    """OWT's held-out documents: the authors' last 100k of the 8M-document train split; a smaller corpus (local
    files, a tiny copy under the hub's id) holds out its last tenth instead."""
    return min(OWT_VALIDATION_DOCS, n_documents // 10)


def document_split(config: DataConfig) -> tuple[Sequence[str], Sequence[str]]:
    """(training documents, held-out documents) of a document source ("owt" or "text").

    "owt": the last 100k documents of the train split are held out (the authors' split of the
    hub's export; a smaller corpus, local or a tiny copy on a hub: its last tenth, `owt_held_out_docs`). "text": `pydoc_data.topics` in
    topic order (or local files); a document is held out when the SHA-256 of its text is 0 modulo 10,
    so the split is the same on every machine and in any order.
    """
    if config.source == "owt":
        if config.path is not None and not all(f.endswith(".parquet") for f in _local_files(config.path)):
            texts = _local_documents(config.path)
            cut = len(texts) - owt_held_out_docs(len(texts))
            return texts[:cut], texts[cut:]
        data = load_rows(config)
        cut = len(data) - owt_held_out_docs(len(data))
        return TextColumn(data, 0, cut), TextColumn(data, cut, len(data))  # read on demand, never one list
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
    if config.source == LANGUAGE:
        language = load_language(config.language)
        return documents(language, config.n_train, config.seed), documents(language, LANGUAGE_HELD_OUT_DOCS, TEST_SEED)
    raise ValueError(f"source {config.source!r} has no document split; document sources: {list(DOCUMENT_SOURCES)}")


def tinygsm_held_out(n_rows: int) -> np.ndarray:
    """Row indices of TinyGSM's held-out split: `Dataset.train_test_split(test_size=0.01, seed=42)`'s
    test rows (the first ceil(1 %) of a PCG64 permutation seeded 42), in the permutation's order."""
    n_test = math.ceil(TINYGSM_HELD_OUT_FRACTION * n_rows)
    return np.random.default_rng(TINYGSM_SPLIT_SEED).permutation(n_rows)[:n_test]
