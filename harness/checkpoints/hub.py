"""Calls to the Hugging Face hub, failing loudly (never silently falling back) when it is unreachable.

`hub_call` retries a load a few times with exponential backoff when the hub could not be reached (a
dropped connection or a busy hub should not end a sweep of hours), never when retrying cannot help:
offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), a hub whose host name does not resolve (no network),
a bad name, a repository, revision or file the hub says does not exist, a local folder that is not a model. (huggingface_hub also retries each HTTP
request itself, about 20 s, so an unreachable hub is declared after about a minute.)
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

OFFLINE_HINT = (
    "The Hugging Face hub is unreachable from this machine (or the name is wrong). "
    "Use a local path, or the embedded offline default: `make demo` "
    "(procedurally generated word problems, a locally trained tokenizer, tiny models)."
)


class HubUnavailableError(RuntimeError):
    pass


HUB_TRIES = 3  # attempts of one load
HUB_BACKOFF_S = 2.0  # wait before the second attempt, doubled before each later one


def hub_offline() -> bool:
    """Offline mode is set: no attempt reaches the hub, so none is repeated."""
    return any(os.environ.get(v, "0") not in ("0", "", "false", "False") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _transient(err: BaseException | None) -> bool:
    """The hub could not be reached (connection, timeout, its own 5xx or 429), as opposed to an answer
    (no such repository, revision or file; a bad name) or a local folder that is not a model."""
    import socket

    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    seen = set()
    while err is not None and id(err) not in seen:  # the exception and what it was raised from
        if isinstance(err, HfHubHTTPError):
            status = getattr(err.response, "status_code", None)
            return status is None or status >= 500 or status == 429
        if isinstance(err, (ConnectionError, TimeoutError, socket.gaierror, LocalEntryNotFoundError)):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _endpoint_resolves() -> bool:
    """The hub's host name resolves: without it (no network, no DNS) no retry can reach the hub."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def answered_busy(err: BaseException | None) -> bool:
    """The hub answered, with a server error or "too many requests" (5xx, 429): worth asking again. Narrower than
    `_transient`, for calls whose client has already retried a connection that failed (huggingface_hub's downloads)."""
    from huggingface_hub.errors import HfHubHTTPError

    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, HfHubHTTPError):
            status = getattr(err.response, "status_code", None)
            return status is not None and (status >= 500 or status == 429)
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def hub_call(load: Callable[[], T], what: str, hint: str = OFFLINE_HINT, tries: int = HUB_TRIES,
             retry_if: Callable[[BaseException], bool] | None = None) -> T:
    """Run a loader that may touch the hub, up to `tries` times with exponential backoff while the
    failure may be transient (`retry_if`, default `_transient`); each retry is one warning line; then one clear
    error ending with `hint` (the offline alternative)."""
    retry_if = retry_if or _transient
    attempt = 1
    while True:
        try:
            return load()
        except (OSError, ConnectionError, TimeoutError, ValueError) as err:
            # transformers/datasets raise OSError (or subclasses) for "not found locally and offline".
            if attempt >= tries or hub_offline() or not retry_if(err) or not _endpoint_resolves():
                after = f" (the hub did not answer in {attempt} tries)" if attempt > 1 else ""
                raise HubUnavailableError(f"could not load {what}{after}: {err}\n{hint}") from err
            wait = HUB_BACKOFF_S * 2 ** (attempt - 1)
            reason = " ".join(str(err).split())[:200]
            logging.getLogger(__name__).warning(f"{what}: {type(err).__name__}: {reason}; trying again in {wait:g} s "
                                                f"(try {attempt + 1} of {tries})")
        time.sleep(wait)
        attempt += 1


_DATA_FILE = re.compile(r"\.(parquet|arrow|jsonl?|csv|txt)(\.(gz|bz2|xz|zst))?$")
_SPLIT_WORDS = ("train", "training", "validation", "valid", "dev", "val", "test", "testing", "eval", "evaluation")


def dataset_layout_problem(files: list[str], split: str | None = "train") -> str | None:
    """Why `datasets` >= 4 cannot load `split` completely from a repository holding `files` (None: it can).

    Checked on the listing itself: a loading script (refused since datasets 4), no data files for the
    split, or the hub's *partial* parquet export (`<config>/partial-train/`: the converter stops at
    about 5 GB, and `datasets` would load the truncated part as the whole train split)."""
    scripts = [f for f in files if f.endswith(".py") and "/" not in f]
    if scripts:
        return (f"it ships a loading script ({scripts[0]}), which datasets >= 4 refuses; use its parquet export "
                f"(revision refs/convert/parquet) or a parquet mirror")
    data = [f for f in files if _DATA_FILE.search(f)]
    if split is None:
        return None if data else f"no data files among its {len(files)} files"
    named = re.compile(rf"(^|/|[-._ ])(partial-)?{split}([-._ /0-9]|$)")
    of_split = [f for f in data if named.search(f)]
    partial = [f for f in of_split if f"partial-{split}" in f]
    if partial:
        return (f"its {split} split is a partial export ({partial[0]}: the hub converts only the first ~5 GB of "
                f"large datasets); use a complete parquet mirror (--data.hub-name)")
    unnamed = split == "train" and data and not any(re.search(rf"(^|/|[-._ ]){w}([-._ /0-9]|$)", f) for f in data for w in _SPLIT_WORDS)
    if not of_split and not unnamed:  # files named for no split at all are all "train" to `datasets`
        return f"no data files of split {split!r} among its {len(files)} files"
    return None


def repo_files(name: str, revision: str | None = None, kind: str = "dataset") -> list[str]:
    """The files of a hub repository at a revision, or of a local folder (relative paths). With HF_HUB_OFFLINE set:
    the files of the revision's snapshot in the hub cache (what an earlier online run downloaded), as a cluster's
    compute nodes run after the login node filled the cache."""
    import os

    if Path(name).is_dir():
        return sorted(str(p.relative_to(name)) for p in Path(name).rglob("*") if p.is_file())
    at = f" at revision {revision}" if revision else ""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        from huggingface_hub import snapshot_download

        try:
            return repo_files(snapshot_download(name, repo_type=kind, revision=revision, local_files_only=True))
        except Exception as err:
            raise HubUnavailableError(f"HF_HUB_OFFLINE is set and the hub cache holds no {kind} {name}{at}") from err
    from huggingface_hub import HfApi

    try:
        return HfApi().list_repo_files(name, repo_type=kind, revision=revision)
    except Exception as err:  # network errors, DNS, 404, a missing revision: all mean "cannot use it from here"
        raise HubUnavailableError(f"{kind} {name}{at} is not reachable on the Hugging Face hub ({type(err).__name__})") from err


def model_files_problem(files: list[str], weights: bool) -> str | None:
    """What a model repository lacks for loading its tokenizer (and, with `weights`, the model)."""
    names = {f.rsplit("/", 1)[-1] for f in files if "/" not in f}
    if not ({"tokenizer.json"} <= names or {"vocab.json", "merges.txt"} <= names or "tokenizer.model" in names):
        return "no tokenizer files (tokenizer.json, vocab.json + merges.txt or tokenizer.model)"
    if weights and not any(n.endswith(".safetensors") or n in ("pytorch_model.bin", "pytorch_model.bin.index.json") for n in names):
        return "no weights (*.safetensors or pytorch_model.bin)"
    return None


def check_files(datasets: list[tuple[str, str | None, str | None]], tokenizers: list[str], models: list[str]) -> None:
    """Raise HubUnavailableError unless what training and evaluation load is there: each dataset
    (name, revision, split) loadable by today's `datasets`, each tokenizer's files, each model's
    weights and tokenizer. Local folders are checked the same way, without the hub."""
    for name, revision, split in datasets:
        problem = dataset_layout_problem(repo_files(name, revision, "dataset"), split)
        if problem:
            at = f" at revision {revision}" if revision else ""
            raise HubUnavailableError(f"dataset {name}{at} cannot be loaded: {problem}")
    for name, weights in [(t, False) for t in tokenizers] + [(m, True) for m in models]:
        problem = model_files_problem(repo_files(name, None, "model"), weights)
        if problem:
            raise HubUnavailableError(f"model {name}: {problem}")


def file_id(path: str | Path) -> list:
    """A file's identity in cache keys without reading it: real path, size, modification time."""
    real = Path(path).resolve()
    stat = real.stat()
    return [str(real), stat.st_size, stat.st_mtime_ns]
