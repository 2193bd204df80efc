"""MAUVE's inputs computed once and kept by reference (the `owt_genppl` tasks, tasks/owt.py).

One cache folder (`cache_dir`) holds two kinds of files:

- ``references/``: a reference set's passages (``<key>.json``, keyed by `ReferenceSet`: the source and
  its files' identity, the sample count, the passage length), so no later run walks the held-out
  documents again, and their MAUVE features (``<key>.npy``);
- ``samples/``: each setting's sample features (``<key>.npy``), the side file its logged samples point
  to (`FeatureRow`: file and row) instead of carrying the vectors inline.

A features file is keyed by the featurizer (`scorers.FeatureIdentity`: the scorer model's files,
device, dtype, batch size, feature rule) and the texts themselves, so a reference set's features are
computed once per scorer, and equal samples share a file. Files are written under a temporary name and
renamed (`os.replace`): a reader (another torchrun rank, a concurrent sweep) sees a whole file or
none. Within a process, reference passages and features are also kept in memory.

Deleting ``references/`` (or the whole folder) only costs recomputation; ``samples/`` holds what logged
samples point to (their MAUVE score stays in the results file; their features can be recomputed from
the texts in the samples file).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Callable, NamedTuple, Sequence

CACHE_ENV = "BLOCKGEN_MAUVE_CACHE"
METADATA_KEY = "mauve_cache"  # the task metadata key that names the folder
REFERENCES = "references"
SAMPLES = "samples"

# Reference passages and features this process has read or computed, by file: the later settings of
# a sweep reuse them without reading the disk. Sample features are not kept (one file per setting).
_MEMORY: dict[Path, Any] = {}


@dataclass(frozen=True)
class ReferenceSet:
    """What a task's MAUVE reference passages depend on, known without reading a document: their key."""

    source: str
    data_path: str | None
    data: str  # digest of `data.source_identity`: the documents' files, text or hub revision
    num_samples: int
    reference_chars: int
    rule: int  # the version of the task's passage rule

    @classmethod
    def of(cls, source: str, data_path: str | None, num_samples: int, reference_chars: int, rule: int) -> "ReferenceSet":
        from blockgen.harness.data.sources import DataConfig, source_identity

        identity = digest(source_identity(DataConfig(source=source, path=data_path)))
        return cls(source, data_path, identity, int(num_samples), int(reference_chars), rule)


class FeatureRow(NamedTuple):
    """One text's MAUVE features: row `row` of the float32 matrix saved in `file` (a JSON list when logged)."""

    file: str
    row: int


class MauvePair(NamedTuple):
    """A sample's features and those of its reference passage: a document's `mauve` item."""

    sample: FeatureRow
    reference: FeatureRow


def cache_dir(explicit: str | None = None) -> Path:
    """The task metadata's `mauve_cache`, else $BLOCKGEN_MAUVE_CACHE, else ~/.cache/blockgen/mauve
    (under $XDG_CACHE_HOME when set). `blockgen sweep` names <results root>/mauve-cache."""
    if explicit:
        return Path(explicit)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blockgen" / "mauve"


def digest(key: Any) -> str:
    """A cache key: the SHA-256 of the JSON of a dataclass (or any JSON value)."""
    value = asdict(key) if hasattr(key, "__dataclass_fields__") else key
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:24]


def _write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_texts(folder: Path, key: Any, build: Callable[[], list[str]]) -> list[str]:
    """Texts that depend only on `key` (a dataclass): from memory, else from ``folder/<digest>.json``,
    else built and written there."""
    path = (folder / f"{digest(key)}.json").resolve()
    if path not in _MEMORY:
        if path.is_file():
            _MEMORY[path] = json.loads(path.read_text(encoding="utf-8"))
        else:
            texts = list(build())
            _write_atomically(path, lambda f: f.write(json.dumps(texts, ensure_ascii=False).encode()))
            _MEMORY[path] = texts
    return _MEMORY[path]


def features_file(folder: Path, identity: Any, texts: Sequence[str], featurize: Callable[[Sequence[str]], Any],
                  keep: bool = False) -> Path:
    """The file of the features of `texts` under the featurizer `identity` (``folder/<digest>.npy``),
    computed with `featurize` only when neither memory nor the folder has it; `keep`: also in memory."""
    import numpy as np

    path = (folder / f"{digest([asdict(identity), list(texts)])}.npy").resolve()
    if path in _MEMORY or path.is_file():
        if keep and path not in _MEMORY:
            _MEMORY[path] = np.load(path)
        return path
    features = np.asarray(featurize(texts), dtype=np.float32)
    _write_atomically(path, lambda f: np.save(f, features))
    if keep:
        _MEMORY[path] = features
    return path


def read_rows(rows: Sequence[FeatureRow]):
    """The (n, d) float32 matrix of the rows, in order; each file read once (or taken from memory)."""
    import numpy as np

    files = {}
    for file in dict.fromkeys(r.file for r in rows):
        path = Path(file)
        files[file] = _MEMORY[path] if path in _MEMORY else np.load(path, mmap_mode="r")
    return np.stack([files[r.file][r.row] for r in rows]).astype(np.float32, copy=False)


def mauve_of(pairs: Sequence[MauvePair]) -> float:
    """MAUVE (mauve-text) of the samples against their reference passages, from the features files."""
    import mauve

    samples = read_rows([FeatureRow(*p[0]) for p in pairs])
    references = read_rows([FeatureRow(*p[1]) for p in pairs])
    return float(mauve.compute_mauve(p_features=references, q_features=samples, device_id=-1, verbose=False).mauve)
