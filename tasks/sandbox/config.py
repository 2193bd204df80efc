"""What a sandboxed run may use: `SandboxConfig`, its limits, and the constants they are counted in."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 * KiB
ENTRY_POINT = "simple_math_problem"
NOBODY = 65534
# Run uids (evaluator as root): UID_BASE + evaluator pid * MAX_CONCURRENT + slot, unique among
# the runs alive on the host (a pid is at most 2**22), above the usual account and subuid ranges.
UID_BASE = 1 << 30
MAX_CONCURRENT = 256  # programs one evaluator process runs at the same time
# The child sends larger integers as +-inf (child.MAX_INT_BITS; a test keeps the two equal).
# Not imported: the evaluator never loads the child's module, it hands bwrap the child's text.
MAX_INT_BITS = 4096

_SCRATCH = "blockgen-sandbox"  # the scratch directory's name, under scratch_root inside the sandbox


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one program; the defaults fit GSM8K-sized programs with a wide margin."""

    wall_timeout_s: float = 5.0
    cpu_time_s: int = 5
    # Address space of each process (RLIMIT_AS), and all the run's memory together where it gets
    # a memory cgroup; otherwise the run holds at most max_processes x memory_bytes.
    memory_bytes: int = 512 * MiB
    file_size_bytes: int = 1 * MiB
    # Processes and threads of the run: its pids cgroup, and RLIMIT_NPROC, which counts per uid
    # (each concurrent run gets its own when the evaluator is root; see `uid`) and, without root,
    # per user namespace (each run has its own).
    max_processes: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64 * KiB  # kept per stream; the rest is read and discarded
    tmpfs_bytes: int = 16 * MiB  # size of each private tmpfs (scratch, /tmp, /dev/shm)
    entry_point: str = ENTRY_POINT
    # Used only when the evaluator runs as root; None keeps uid 0 (without capabilities; not
    # recommended: RLIMIT_NPROC does not hold for uid 0). With uid_per_run, `uid` is the base of a
    # range and each concurrent run gets uid + an offset unique on the host; otherwise every run
    # uses `uid` itself.
    uid: int | None = UID_BASE
    gid: int | None = NOBODY
    uid_per_run: bool = True
    cgroups: bool = True  # memory, pids and cpu cgroups per run where the evaluator may create them
    python: str = field(default_factory=lambda: sys.executable)
    scratch_root: str = "/tmp"  # parent of the program's scratch directory, inside the sandbox
    # The run's nice value is at least this and at least the evaluator's (never lower); with
    # RLIMIT_NICE 0 the program cannot lower it either.
    nice: int = 0

    def __post_init__(self) -> None:
        if self.wall_timeout_s <= 0 or self.cpu_time_s < 1:
            raise ValueError("timeouts must be positive (cpu_time_s is whole seconds, >= 1)")
        for name in (
            "memory_bytes", "file_size_bytes", "max_processes", "max_open_files", "tmpfs_bytes"
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if not self.entry_point.isidentifier():
            raise ValueError(f"entry_point {self.entry_point!r} is not an identifier")
        if not self.python:
            raise ValueError("no Python interpreter to run programs with")
        if not os.path.isabs(self.scratch_root):
            raise ValueError(f"scratch_root {self.scratch_root!r} must be an absolute path")
        if not -20 <= self.nice <= 19:
            raise ValueError(f"nice {self.nice} is not a nice value (-20 to 19)")
