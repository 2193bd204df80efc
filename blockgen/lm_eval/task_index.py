"""lm-eval's index of its own tasks, built once and kept on disk, so ``lm_eval`` starts in seconds.

Every ``TaskManager`` that includes lm-eval's tasks parses all of their YAML files (about 14,000 in
0.4.13) before it looks at ``--tasks``: 9-16 s of every ``lm_eval`` command on the 2-core machine,
whatever model or task it runs. That index depends only on those files, so it is kept in a cache
folder, keyed by lm-eval's version and every YAML file's path, size and modification time (a walk of
0.1 s); any change to the folder (an upgrade, an edited task) builds it anew. Other folders
(``--include_path``, this project's tasks) are indexed as lm-eval does, every time, and merged after
lm-eval's own in lm-eval's order, so the result is the index lm-eval would build.

``BLOCKGEN_TASK_INDEX_CACHE``: unset = ``$XDG_CACHE_HOME/blockgen`` (``~/.cache/blockgen``); a folder =
that folder; ``0`` = off. A folder that cannot be written only means no cache (never an error). The
start-up hook installs it when lm-eval imports ``lm_eval.tasks._index`` (`cache_builtin_index`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Callable

CACHE_ENV = "BLOCKGEN_TASK_INDEX_CACHE"
PREFIX = "lm-eval-task-index-"
_SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # the folders lm-eval's index skips

log = logging.getLogger(__name__)
_MEMORY: dict[str, bytes] = {}  # file name -> pickled index: later TaskManagers of this process skip the disk


def cache_folder() -> Path | None:
    value = os.environ.get(CACHE_ENV)
    if value == "0":
        return None
    if value:
        return Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blockgen"


def fingerprint(root: Path, version: str) -> str:
    """Digest of lm-eval's version and each YAML file under `root`: path, size, modification time."""
    digest = hashlib.sha256(f"{version}\0{root}\n".encode())
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in _SKIPPED_DIRS)
        for name in sorted(files):
            if name.endswith(".yaml"):
                stat = os.stat(os.path.join(folder, name))
                digest.update(f"{folder}/{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def cached_index(root: Path, version: str, build: Callable[[Path], dict]) -> dict:
    """`build(root)`, or the copy kept under the cache folder for the same fingerprint (a fresh object each call)."""
    folder = cache_folder()
    if folder is None:
        return build(root)
    name = f"{PREFIX}{fingerprint(root, version)}.pickle"
    data = _MEMORY.get(name)
    if data is None:
        try:
            data = (folder / name).read_bytes()
        except OSError:
            data = pickle.dumps(build(root), protocol=pickle.HIGHEST_PROTOCOL)
            _store(folder, name, data)
        _MEMORY[name] = data
    return pickle.loads(data)


def _store(folder: Path, name: str, data: bytes) -> None:
    """Write under a temporary name and rename (a concurrent reader sees a whole file or none); drop older indexes."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, folder / name)
        for old in folder.glob(f"{PREFIX}*.pickle"):
            if old.name != name:
                old.unlink(missing_ok=True)
    except OSError as err:
        log.debug("lm-eval's task index not cached in %s (%s)", folder, err)


def cache_builtin_index(index_module) -> None:
    """Wrap `lm_eval.tasks._index.TaskIndex.build` so that lm-eval's own folder comes from `cached_index`."""
    task_index = index_module.TaskIndex
    original = task_index.build
    if getattr(original, "_blockgen_cached", False):
        return
    from importlib.metadata import version

    builtin = Path(index_module.__file__).parent.resolve()
    lm_eval_version = version("lm_eval")
    lm_eval_log = logging.getLogger(index_module.__name__)

    @functools.wraps(original)
    def build(paths, *, resolve_includes=True):
        paths = [Path(p) for p in paths]
        if not (paths and resolve_includes and paths[0].resolve() == builtin and cache_folder() is not None):
            return original(paths, resolve_includes=resolve_includes)
        index = cached_index(builtin, lm_eval_version, lambda root: original([root]))
        for name, entry in (original(paths[1:]) if paths[1:] else {}).items():
            if name in index:  # lm-eval's own warning when a later folder overrides a task
                lm_eval_log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                            index[name].yaml_path)
            index[name] = entry
        return index

    build._blockgen_cached = True
    task_index.build = staticmethod(build)
