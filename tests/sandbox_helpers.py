"""What the sandbox tests (tests/test_sandbox_*.py) share: a fast configuration, TinyGSM-style programs,
and what a run could leave on the host (processes, cgroups, keys, mounts, IPC objects, files), with
`contained`, which runs attacks beside a benign neighbour and checks that nothing is left behind."""

from __future__ import annotations

import os
import textwrap
import time
from dataclasses import replace
from pathlib import Path

from blockgen.tasks.sandbox import MAX_CONCURRENT, UID_BASE, MiB, Outcome, SandboxConfig, run_many


# the real GSM8K test split, in the shared/ folder laid beside the checkout (and beside CI's clone)
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.json"
FAST = SandboxConfig(
    wall_timeout_s=1.5, cpu_time_s=1, memory_bytes=128 * MiB, max_processes=8, max_open_files=32
)
# How far past its wall timeout a run may end (kill, reap, clean up). Generous, so a busy machine never
# reaches it; any bound this far below the hostile programs' 100 s sleeps still proves they were killed.
SLACK_S = 10.0
H = "def simple_math_problem():\n"
ROOT = os.geteuid() == 0


def program(body: str, prelude: str = "") -> str:
    """A TinyGSM-style program: optional module-level code, then the entry point."""
    return textwrap.dedent(prelude) + H + textwrap.indent(textwrap.dedent(body), "    ")


# --- the runs' processes and IPC objects, seen from the host ------------------------------------


def sandbox_processes(scratch_root: Path) -> list[int]:
    """Processes whose working directory is (or was) a scratch directory under scratch_root."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd.startswith(str(scratch_root)):
            found.append(int(pid))
    return found


def wait_until_gone(scratch_root: Path, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := sandbox_processes(scratch_root)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def sysv_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "msg", "sem"):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            keys.add(int(line.split()[0]))
    return keys


# --- attacks beside a neighbour (issues 22 and 33): it must score, and nothing may be left ------

NEIGHBOUR = program("total = 0\nfor i in range(200000):\n    total += i % 7\nreturn total\n")
NEIGHBOUR_VALUE = sum(i % 7 for i in range(200000))
TOKEN = "blockgen-issue22-" + os.urandom(6).hex()  # a file name attacks try to leave behind


def syscall_numbers(*names: str) -> dict[str, int]:
    import pyseccomp

    return {name: pyseccomp.resolve_syscall(pyseccomp.system_arch(), name) for name in names}


def run_uids(evaluator_pid: int) -> range:
    start = UID_BASE + evaluator_pid * MAX_CONCURRENT
    return range(start, start + MAX_CONCURRENT)


def run_cgroups(evaluator_pid: int | None = None) -> list[str]:
    """Cgroup directories of the runs of this (or another) evaluator process."""
    prefix = f"blockgen-sandbox-{evaluator_pid or os.getpid()}-"
    found = []
    for top, dirs, _ in os.walk("/sys/fs/cgroup"):
        found += [os.path.join(top, d) for d in dirs if d.startswith(prefix)]
    return found


def key_users() -> set[int]:
    return {int(line.split(":")[0]) for line in Path("/proc/key-users").read_text().splitlines()}


def processes_of(uids: range) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        real = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        found += [int(pid)] if real in uids else []
    return found


def leftovers(scratch_root: Path, evaluator_pid: int | None = None) -> dict:
    """What runs could leave on the host: processes, cgroups, keys, mounts, IPC, files."""
    uids = run_uids(evaluator_pid or os.getpid())
    return {
        "processes": sandbox_processes(scratch_root) + processes_of(uids),
        "cgroups": run_cgroups(evaluator_pid),
        "keys": sorted(key_users() & set(uids)),
        "mounts": sorted(line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()),
        "ipc": sysv_keys() if Path("/proc/sysvipc/shm").exists() else set(),
        "files": [d for d in ("/tmp", "/var/tmp", "/dev/shm", str(scratch_root)) if Path(d, TOKEN).exists()],
    }


def settled(before: dict, scratch_root: Path, evaluator_pid: int | None = None, timeout: float = 5.0) -> dict:
    """leftovers() once it equals `before` (keys and cgroups go a moment after the run), or at the timeout."""
    deadline = time.monotonic() + timeout
    while (now := leftovers(scratch_root, evaluator_pid)) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def contained(tmp_path: Path, *attacks: str, cfg: SandboxConfig = FAST, neighbour=(NEIGHBOUR, NEIGHBOUR_VALUE)):
    """Run the attacks beside a benign neighbour: it must score, and nothing may be left behind."""
    cfg = replace(cfg, scratch_root=str(tmp_path))
    before = settled({**leftovers(tmp_path), "keys": []}, tmp_path)  # earlier runs' keyrings gone
    assert not before["processes"] and not before["cgroups"] and not before["files"], before
    assert not before["keys"], before
    *attacked, fine = run_many([*attacks, neighbour[0]], cfg, max_workers=2)
    assert fine.outcome is Outcome.OK and fine.value == neighbour[1], fine
    assert settled(before, tmp_path) == before
    return attacked
