"""Data preparation: every source tokenized once into a memory-mapped cache that training only reads.

`blockgen prepare-data` (the same `--preset` and `--data.*` flags as `blockgen train`) builds it; the
Makefile runs it in one process before `torchrun`. A cache holds fixed-length examples, so nothing
about it depends on the model but the tokenizer and seq_len:

    <cache_dir>/prepared-<source>-<key>/   (source and key in the spelling before the rename: data.cache_spelling)
        tokenizer/                  the tokenizer that made the tokens (training loads this one)
        {train,val}.tokens          int32 (N, seq_len), row-major
        {train,val}.prompt          int32 (N,): prompt length (0 for documents)
        {train,val}.length          int32 (N,): tokens before the padding (seq_len for documents)
        meta.json                   counts and provenance; written last, its presence marks the cache complete

Memory does not grow with the data: rows are read from Arrow (memory-mapped) a batch at a time,
tokenized, and appended to the files; nothing of size N but TinyGSM's held-out mask (one byte per
row) is kept. The cache is built in `<dir>.tmp-<host>-<pid>` and renamed into place, so a killed
attempt never leaves a cache that looks complete; the next attempt removes such a leftover when its
process is gone.

`ensure_prepared` is what `blockgen train` calls before it joins the process group: rank 0 builds a
missing cache, once per run however many machines train (the cache is on the file system they
share), and the others wait for its meta.json by looking at the file system, so no rank waits in a
collective (NCCL's default timeout is 10 minutes) for work of unbounded length.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from blockgen.harness.data.sources import (
    DOCUMENT_SOURCES, LANGUAGE, LOCAL_TOKENIZER, RENAMED, WORDPROBLEMS, DataConfig, Examples, cache_spelling, current_names,
    document_batches, document_split, encode_problem_batch, frame_documents, get_tokenizer, load_rows, local_tokenizer_dir,
    tinygsm_held_out,
)
from blockgen.harness.data.language import language_identity
from blockgen.harness.runtime.distributed import ranks_from_env
from blockgen.harness.runtime.progress import Progress
from blockgen.harness.checkpoints.tokenizer import special_tokens

FORMAT_VERSION = 1  # bump when the cache's layout or framing changes: older caches are then ignored
PROBLEMS_PER_BATCH = 10_000  # word problems tokenized per call (the fast tokenizer parallelises a batch)
SPLITS = ("train", "val")
META = "meta.json"
PROGRESS_EVERY_S = 30.0  # prepare-data's progress line in a log file (not a terminal)


class DataNotPreparedError(RuntimeError):
    pass


def _tokenizer_identity(config: DataConfig, tokenizer) -> str:
    if tokenizer is not None:
        return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    if config.tokenizer == LOCAL_TOKENIZER:
        return local_tokenizer_dir(config)[0].name  # hashes the text it trains on
    return config.tokenizer  # a hub name or directory: the cache keeps the copy it used


def prepared_dir(config: DataConfig, seq_len: int, tokenizer=None) -> Path:
    """Where the prepared data of (config, seq_len) lives: keyed by everything that changes its tokens.

    n_val only selects a prefix of the held-out examples (except for generated problems, where it is
    how many are generated), so changing it never re-tokenizes a corpus. Renamed values enter the key
    in their old spelling, so a cache prepared before the rename keeps its key.
    """
    fields = {k: v for k, v in asdict(config).items() if k not in ("cache_dir", "n_val")}
    fields.update({k: cache_spelling(k, fields[k]) for k in RENAMED})
    # Each source's key holds only the fields it reads (caches prepared before a field existed keep their key).
    if config.source == LANGUAGE:
        fields.pop("difficulty")
        fields["language"] = language_identity(config.language)
    elif config.source != WORDPROBLEMS:
        for k in ("n_train", "difficulty", "seed"):
            fields.pop(k)
    if config.source == WORDPROBLEMS:
        fields["n_val"] = config.n_val
    if config.source != LANGUAGE:
        fields.pop("language")
    if config.source in ("owt", "tinygsm") and config.path is None:
        fields["hub_name"], fields["hub_revision"] = config.hub_dataset()
    key = json.dumps([FORMAT_VERSION, seq_len, fields, _tokenizer_identity(config, tokenizer)], sort_keys=True)
    return Path(config.cache_dir) / f"prepared-{fields['source']}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def is_prepared(directory: Path) -> bool:
    return (directory / META).is_file()


@dataclass
class _SplitWriter:
    """Appends fixed-length rows to a split's three files."""

    directory: Path
    split: str
    seq_len: int

    def __post_init__(self) -> None:
        self.files = {part: open(self.directory / f"{self.split}.{part}", "wb") for part in ("tokens", "prompt", "length")}
        self.count = 0

    def add(self, rows: np.ndarray, prompt_len: np.ndarray, length: np.ndarray) -> None:
        assert rows.dtype == np.int32 and rows.shape[1:] == (self.seq_len,)
        self.files["tokens"].write(rows.tobytes())
        self.files["prompt"].write(prompt_len.astype(np.int32).tobytes())
        self.files["length"].write(length.astype(np.int32).tobytes())
        self.count += len(rows)

    def close(self) -> None:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()


def _write_documents(config, tokenizer, special, seq_len, writers, info, bar: Progress) -> None:
    train_docs, held_out = document_split(config)
    bar.set_total(len(train_docs) + len(held_out))
    for split, docs in (("train", train_docs), ("val", held_out)):
        for batch in document_batches(docs):
            rows = frame_documents(batch, tokenizer, special, seq_len)
            writers[split].add(rows, np.zeros(len(rows), np.int32), np.full(len(rows), seq_len, np.int32))
            bar.update(len(batch))
    info["validation_documents"] = len(held_out)
    info["training_documents"] = len(train_docs)


def _write_problems(config, tokenizer, special, seq_len, writers, info, bar: Progress) -> None:
    dropped = {"train": 0, "val": 0}

    def add(split, questions, codes):
        batch = encode_problem_batch(questions, codes, tokenizer, special, seq_len)
        writers[split].add(batch.rows, batch.prompt_len, batch.length)
        dropped[split] += batch.dropped
        bar.update(len(questions))

    if config.source == WORDPROBLEMS:
        from blockgen.harness.data.wordproblems import generate

        bar.set_total(config.n_train + config.n_val)
        for split, name, n in (("train", "train", config.n_train), ("val", "validation", config.n_val)):
            problems = generate(name, n, config.seed, config.difficulty)
            for start in range(0, len(problems), PROBLEMS_PER_BATCH):
                part = problems[start : start + PROBLEMS_PER_BATCH]
                add(split, [p.question for p in part], [p.code for p in part])
    else:  # TinyGSM: stream the rows; the authors' random 1 % (seed 42) is held out
        data = load_rows(config).select_columns(["question", "code"])
        bar.set_total(len(data))
        held = np.zeros(len(data), dtype=bool)
        held[tinygsm_held_out(len(data))] = True
        for start in range(0, len(data), PROBLEMS_PER_BATCH):
            rows = data[start : start + PROBLEMS_PER_BATCH]
            mask = held[start : start + len(rows["question"])]
            for split, keep in (("train", ~mask), ("val", mask)):
                idx = np.flatnonzero(keep)
                if len(idx):
                    add(split, [rows["question"][i] for i in idx], [rows["code"][i] for i in idx])
        info["source_rows"] = len(data)
    info["dropped_too_long"] = dropped["train"]
    info["dropped_too_long_validation"] = dropped["val"]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_attempts(directory: Path) -> list[Path]:
    """Remove `<directory>.tmp-<host>-<pid>` left by a killed attempt on this machine (its process is gone)."""
    removed = []
    host = socket.gethostname()
    for tmp in directory.parent.glob(f"{directory.name}.tmp-*"):
        owner_host, _, pid = tmp.name[len(directory.name) + len(".tmp-") :].rpartition("-")
        if owner_host == host and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def prepare_data(config: DataConfig, seq_len: int, tokenizer=None, log=print, progress: bool = True) -> Path:
    """Build the prepared cache of (config, seq_len) unless it exists; returns its directory.

    `tokenizer`: the one to use (default: the config's, `get_tokenizer`). `progress`: a bar of the
    source's rows and rows/s on stderr (a line every PROGRESS_EVERY_S seconds when it is not a terminal)."""
    directory = prepared_dir(config, seq_len, tokenizer)
    if is_prepared(directory):
        return directory
    for stale in remove_stale_attempts(directory):
        log(f"blockgen: removed {stale}, left by a killed preparation")
    start = time.perf_counter()
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer(config)
    special = special_tokens(tokenizer)
    tmp = directory.with_name(f"{directory.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        writers = {split: _SplitWriter(tmp, split, seq_len) for split in SPLITS}
        info: dict = {"source": config.source}
        # the source's rows (documents or problems) read, and their rate: OWT takes about an hour
        bar = Progress(f"prepare-data {config.source}", unit="rows", every_s=PROGRESS_EVERY_S, enabled=progress)
        try:
            if config.source in DOCUMENT_SOURCES:
                _write_documents(config, tokenizer, special, seq_len, writers, info, bar)
            else:
                _write_problems(config, tokenizer, special, seq_len, writers, info, bar)
        finally:
            bar.close()
            for w in writers.values():
                w.close()
        for split in SPLITS:
            if writers[split].count == 0:
                raise ValueError(f"source {config.source!r}: no {split} example fits in seq_len={seq_len}")
        meta = {
            "format": FORMAT_VERSION, "seq_len": seq_len, "data": asdict(config), "train_on_pad": config.train_on_pad,
            "train_examples": writers["train"].count, "validation_examples": writers["val"].count, "info": info,
            "seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(directory)
        except OSError:  # another process finished the same cache first: keep theirs
            if not is_prepared(directory):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"blockgen: prepared {directory} ({meta['train_examples']} training and {meta['validation_examples']} "
        f"validation examples of {seq_len} tokens, {meta['seconds']} s)")
    return directory


def _memmap(path: Path, shape: tuple[int, ...]) -> torch.Tensor:
    # copy-on-write: a writable view for torch.from_numpy, read lazily, never written back
    return torch.from_numpy(np.memmap(path, dtype=np.int32, mode="c", shape=shape))


def load_prepared(directory: Path, n_val: int) -> tuple:
    """(tokenizer, train, validation[:n_val], info) of a prepared cache; reads only."""
    from transformers import PreTrainedTokenizerFast

    if not is_prepared(directory):
        raise DataNotPreparedError(f"no prepared data at {directory}: run `blockgen prepare-data` with the same "
                                   f"--preset and --data.* options as the training run first")
    meta = json.loads((directory / META).read_text())
    seq_len = meta["seq_len"]
    splits = {}
    for split, n in (("train", meta["train_examples"]), ("val", meta["validation_examples"])):
        tokens = _memmap(directory / f"{split}.tokens", (n, seq_len))
        prompt = _memmap(directory / f"{split}.prompt", (n,))
        length = _memmap(directory / f"{split}.length", (n,))
        loss_len = torch.full((), seq_len, dtype=torch.int32).expand(n) if meta["train_on_pad"] else length
        splits[split] = Examples(tokens, prompt, loss_len)
    val = splits["val"][: max(n_val, 0)]
    info = {**current_names(meta["info"]), "train_examples": len(splits["train"]), "validation_examples": len(val), "prepared": str(directory)}
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory / "tokenizer"))
    return tokenizer, splits["train"], val, info


def ensure_prepared(config: DataConfig, seq_len: int, poll_seconds: float = 2.0, log=print) -> Path:
    """The prepared cache for a training process, before it joins any process group: rank 0 (or a lone
    process) builds a missing cache; the others, on every machine, wait for it on the file system (no
    collective, so no process-group timeout applies to the preparation)."""
    directory = prepared_dir(config, seq_len)
    if is_prepared(directory):
        return directory
    ranks = ranks_from_env()
    if ranks.is_main:
        log(f"blockgen: {directory} is not prepared; preparing it now (`blockgen prepare-data` does this "
            f"outside training, as `make train-owt` / `make train-tinygsm` do)")
        return prepare_data(config, seq_len, log=log)
    waited = 0.0
    while not is_prepared(directory):
        time.sleep(poll_seconds)
        waited += poll_seconds
        if waited % 300 < poll_seconds:
            log(f"blockgen: rank {ranks.rank} waiting for rank 0 to prepare {directory} ({waited:.0f} s; a machine "
                "that does not share rank 0's file system waits forever: docs/training.md, Multi-node)")
    return directory


def load_examples(config: DataConfig, tokenizer, seq_len: int) -> tuple[Examples, Examples, dict]:
    """(train, validation, info) for a data config and tokenizer: prepared into the cache once, then memory-mapped."""
    _, train, val, info = load_prepared(prepare_data(config, seq_len, tokenizer=tokenizer), config.n_val)
    return train, val, info
