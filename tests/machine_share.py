"""How the suite's pytest-xdist workers share the machine and what they build (`make test` runs two).

- `whole_machine`: a test so marked runs with no other test beside it, setup and teardown included:
  those whose outcome could depend on the machine's load (sandbox runs with wall clocks of a second or
  two, a 60 s gloo timeout), and subprocesses of two OpenMP threads (5x slower beside another test). The
  rest wait only for hangs (`limits.HANG_S`), so a busy core slows them and changes nothing else. Every other
  test holds the machine shared. A readers-writer lock on two files in the run's shared temporary
  folder, with the writer first in line, so a waiting whole-machine test is not starved.
- `built_once`: an artefact several test modules need (a trained checkpoint) is built by the first
  worker that asks, into the run's shared temporary folder, and read by every other. A build that
  fails is recorded: the other workers fail with its error instead of building again.

Without xdist (one process, `pytest tests/test_x.py`) the lock is a no-op and `built_once` builds
in the session's own temporary folder.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

WHOLE_MACHINE = "whole_machine"


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary folder of the whole run: every xdist worker's base folder lies in it."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


class MachineLock:
    """Shared for an ordinary test, exclusive for a whole-machine one; a writer queues at the gate first, so
    a whole-machine test waits only for the test in flight beside it. Consecutive whole-machine tests of one
    worker (a module's, under `--dist loadscope`) keep the machine between them: one wait per run of them,
    not one per test."""

    def __init__(self, root: Path) -> None:
        self.root, self.files, self.whole_held = root, None, False

    def acquire(self, whole: bool) -> None:
        if not os.environ.get("PYTEST_XDIST_WORKER") or (whole and self.whole_held):
            return
        if self.files is None:
            self.files = (open(self.root / "machine.gate", "a"), open(self.root / "machine.lock", "a"))
        gate, lock = self.files
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if whole else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        self.whole_held = whole

    def release(self, keep_whole: bool) -> None:
        """After a test: a whole-machine test followed by another keeps the machine."""
        if self.files is None or (self.whole_held and keep_whole):
            return
        fcntl.flock(self.files[1], fcntl.LOCK_UN)
        self.whole_held = False


def _to_json(value):
    if isinstance(value, Path):
        return {"path": str(value)}
    if isinstance(value, dict):
        return {"dict": {k: _to_json(v) for k, v in value.items()}}
    raise TypeError(f"built_once stores paths or dicts of paths, not {type(value).__name__}")


def _from_json(doc):
    return Path(doc["path"]) if "path" in doc else {k: _from_json(v) for k, v in doc["dict"].items()}


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]):
    """`build(folder)` once per run, whichever worker asks first; its result (a path or a dict of paths) to all.

    Tests read what it built and never change it: a test that would, takes a copy first."""
    root = shared_root(tmp_path_factory)
    folder, done, failed = root / name, root / f"{name}.built.json", root / f"{name}.failed.txt"
    with FileLock(root / f"{name}.lock"):
        if failed.exists():
            raise RuntimeError(f"the shared fixture {name!r} failed to build (in another worker):\n{failed.read_text()}")
        if not done.exists():
            folder.mkdir(parents=True, exist_ok=True)
            try:
                result = build(folder)
            except BaseException as error:
                failed.write_text(f"{type(error).__name__}: {error}")
                raise
            done.write_text(json.dumps(_to_json(result)))
        return _from_json(json.loads(done.read_text()))
