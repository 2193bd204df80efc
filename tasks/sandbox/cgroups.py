"""Per-run budgets and the run's place in the host's queues: cgroups, autogroups, the OOM score.

- **what the host owes the evaluator first**: every run's processes have oom_score_adj 1000, the
  idle I/O class, RLIMIT_RTPRIO and RLIMIT_NICE 0 and a nice value of at least the evaluator's
  (the child sets what it can; the evaluator writes the OOM score here).
- **per-run budgets**: where the evaluator may create cgroups (root with cgroup v1 hierarchies, or a
  v2 subtree with the controllers enabled) each run gets a memory cgroup (the whole run, swap
  included) and a pids cgroup; otherwise memory is bounded by max_processes x memory_bytes
  (RLIMIT_NPROC x RLIMIT_AS). For CPU each run is one scheduling entity, however many processes
  it forks: one session, so one autogroup, where the evaluator sits in the root cpu cgroup
  (setsid is refused), else a cpu cgroup of its own where allowed. Rlimits apply in all cases
  (CPU, address space, file size, processes, open files, no core). On cgroup v1 the memory cgroup
  also limits TCP buffers (memory.kmem.tcp.limit_in_bytes; v2 charges them to memory.max).
"""

from __future__ import annotations

import errno
import functools
import os
import time
from pathlib import Path

from .config import SandboxConfig


@functools.cache
def _autogroup() -> bool:
    """Whether a new session gets an autogroup of its own: only for tasks in the root cpu cgroup."""
    try:
        if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() != "1":
            return False
        own = [line.rstrip("\n").split(":", 2) for line in open("/proc/self/cgroup")]
    except OSError:
        return False
    v1 = [path for _, names, path in own if "cpu" in names.split(",")]
    return (v1 or [path for hid, names, path in own if hid == "0" and not names] or ["?"])[0] == "/"


_CONTROLLERS = ("memory", "pids", "cpu")


@functools.cache
def _cgroup_parents() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per hierarchy: (the evaluator's own cgroup directory, what a child made there controls)."""
    try:
        own = [line.rstrip("\n").split(":", 2) for line in open("/proc/self/cgroup")]
        mounts = [line.split(" - ", 1) for line in open("/proc/self/mountinfo")]
    except OSError:
        return ()
    found: list[tuple[str, tuple[str, ...]]] = []
    taken: set[str] = set()
    for left, right in (m for m in mounts if len(m) == 2):
        fields, (fstype, _, options) = left.split(), right.split()[:3]
        mount_root, point = fields[3], fields[4]
        if fstype == "cgroup":  # v1: one hierarchy per mount, named by its options
            names = [c for c in _CONTROLLERS if c in options.split(",") and c not in taken]
            path = next((p for _, cs, p in own if names and names[0] in cs.split(",")), None)
        elif fstype == "cgroup2":
            path = next((p for hid, cs, p in own if hid == "0" and not cs), None)
            names = []
        else:
            continue
        if path is None:
            continue
        if mount_root != "/" and path.startswith(mount_root):
            path = path[len(mount_root):]
        directory = os.path.normpath(point + "/" + path)
        if fstype == "cgroup2":  # a child gets what this cgroup hands down
            try:
                enabled = Path(directory, "cgroup.subtree_control").read_text().split()
            except OSError:
                continue
            names = [c for c in _CONTROLLERS if c in enabled and c not in taken]
        if names:
            found.append((directory, tuple(names)))
            taken.update(names)
    return tuple(found)


def _write(path: str, value: int | str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


class _RunCgroups:
    """The run's cgroup in each hierarchy that allows one; `controllers`: those in force."""

    def __init__(self, name: str, cfg: SandboxConfig) -> None:
        self.dirs: list[tuple[str, tuple[str, ...]]] = []
        for parent, names in _cgroup_parents() if cfg.cgroups else ():
            if _autogroup():  # the run's session is its own scheduling entity already, and
                # moving a task between cpu cgroups costs milliseconds (memory, pids: microseconds)
                names = tuple(c for c in names if c != "cpu")
            if not names:
                continue
            path = os.path.join(parent, name)
            try:
                try:
                    os.mkdir(path)
                except FileExistsError:  # left by an evaluator of the same pid that was killed
                    os.rmdir(path)
                    os.mkdir(path)
            except OSError:
                continue
            try:
                for controller in names:
                    self._limit(path, controller, cfg)
                tcp = os.path.join(path, "memory.kmem.tcp.limit_in_bytes")
                if "memory" in names and os.path.exists(tcp):
                    # v1 charges TCP buffers (a separate counter) only once this limit is set; v2
                    # charges socket memory to memory.max. The filter refuses TCP sockets anyway.
                    _write(tcp, cfg.memory_bytes)
                    names += ("tcp-kmem",)
            except OSError:
                self._rmdir(path)
                continue
            self.dirs.append((path, names))

    @staticmethod
    def _limit(path: str, controller: str, cfg: SandboxConfig) -> None:
        v2 = os.path.exists(os.path.join(path, "cgroup.controllers"))
        if controller == "memory":
            limit = "memory.max" if v2 else "memory.limit_in_bytes"
            _write(os.path.join(path, limit), cfg.memory_bytes)
            swap = os.path.join(path, "memory.swap.max" if v2 else "memory.memsw.limit_in_bytes")
            if os.path.exists(swap):  # with swap accounting: no swapping past the limit either
                _write(swap, 0 if v2 else cfg.memory_bytes)
        elif controller == "pids":
            _write(os.path.join(path, "pids.max"), cfg.max_processes + 1)  # + the child's pid 1

    @property
    def controllers(self) -> set[str]:
        return {c for _, names in self.dirs for c in names}

    def join(self, pid: int) -> None:
        for entry in list(self.dirs):
            try:
                _write(os.path.join(entry[0], "cgroup.procs"), pid)
            except OSError:  # not in force for this run (v2: a cgroup with processes inside, ...)
                self.dirs.remove(entry)
                self._rmdir(entry[0])

    def oom_kills(self) -> int:
        for path, names in self.dirs:
            if "memory" in names:
                for name in ("memory.events", "memory.oom_control"):  # v2, v1
                    try:
                        lines = Path(path, name).read_text().splitlines()
                    except OSError:
                        continue
                    counts = dict(line.split(" ", 1) for line in lines if " " in line)
                    return int(counts.get("oom_kill", "0"))
        return 0

    def remove(self) -> None:
        for path, _ in self.dirs:
            self._rmdir(path)
        self.dirs = []

    @staticmethod
    def _rmdir(path: str) -> None:
        # The namespace is gone when bwrap has exited; the cgroup may lag a moment behind.
        for delay in (0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5):
            time.sleep(delay)
            try:
                os.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    return


def _oom_first(pid: int) -> None:
    """oom_score_adj 1000 for the run's pid 1 (its processes inherit it), so the kernel's OOM
    killer takes a run before the evaluator. Written by an evaluator with CAP_SYS_RESOURCE (root),
    it is also the floor: the program cannot lower it. Without that capability the child raises
    it itself, and the program may lower it back to the evaluator's own value."""
    try:
        _write(f"/proc/{pid}/oom_score_adj", 1000)
    except OSError:
        pass
