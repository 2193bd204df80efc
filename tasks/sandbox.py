"""Run model-written Python (TinyGSM style) in an isolated, resource-limited child process.

Each program gets a fresh interpreter (`python -I -S -B`, exec'd, never a fork of the evaluator)
with an empty environment, only its own pipes, a new session and a fresh scratch directory. A
small trusted bootstrap in that interpreter sets up the isolation before any model code runs:

    B  the exec'd bootstrap: new network, PID and IPC namespaces (a user namespace owns them
       when the evaluator is not root); dies with the evaluator (PR_SET_PDEATHSIG). System V
       and POSIX IPC objects live in the IPC namespace (and the private /dev/shm) and die with it
    C  pid 1 of the new PID namespace: reaps and reports how D ended. When C dies the kernel
       kills whatever is left in the namespace, even processes that left the process group
    D  a mount namespace with private, size-bounded tmpfs on the scratch directory and on
       /tmp, /var/tmp, /dev/shm; empty ones over the directories where host daemons keep
       Unix-domain sockets and state (/run, /var/run, /var/lib, /var/spool, /home, /srv, /mnt,
       /media); a /proc showing only its PID namespace; rlimits (CPU, address space, file
       size, processes, open files, no core); when the evaluator is root, a uid of its own per
       concurrent run (RLIMIT_NPROC counts per uid, so one program's fork bomb cannot starve
       its neighbour); no_new_privs. Then it runs the program and calls `simple_math_problem()`.

The setup runs after exec rather than in a `preexec_fn`, which is unsafe in a multithreaded
evaluator (CPython docs) and would fork a possibly huge process. The evaluator enforces the
wall clock and then SIGKILLs the whole process group.

Namespaces the kernel refuses are skipped (without a network namespace `socket` cannot be
imported instead) and `SandboxResult.isolation` lists what was actually in force. A failed uid
drop is never skipped: the run ends as SANDBOX_ERROR before any model code runs as root.
The return value travels on its own pipe, so printing an answer never counts as returning it. A
program that deliberately writes to that pipe can forge its own answer: this guards against
accidents and hostile side effects, not against a model that cheats on purpose. The value is
serialised in the child by exact type (never through the value's own methods, which a subclass
can override) and parsed in the evaluator with size limits, so every `SandboxResult` prints.
"""

from __future__ import annotations

import ast
import enum
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
from typing import Callable, Iterable

KiB = 1024
MiB = 1024 * KiB
ENTRY_POINT = "simple_math_problem"
NOBODY = 65534
# Run uids (evaluator as root): UID_BASE + evaluator pid * MAX_CONCURRENT + slot, unique among
# the runs alive on the host (a pid is at most 2**22), above the usual account and subuid ranges.
UID_BASE = 1 << 30
MAX_CONCURRENT = 256  # programs one evaluator process runs at the same time
MAX_INT_BITS = 4096  # larger integers come back as +-inf: str() of them raises

_CHUNK = 64 * KiB
_RESULT_LIMIT = 16 * KiB

# The trusted bootstrap, run as `python -I -S -B -X utf8 -c _CHILD <args>` with the program on
# stdin. Kept small: start-up time is most of the cost of a GSM8K-sized program.
_CHILD = r"""
import os, sys, resource

FD, WRITE = int(sys.argv[1]), os.write  # bound now: the program may replace os.write
NEWNS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x08000000, 0x10000000, 0x20000000, 0x40000000
PDEATHSIG, NO_NEW_PRIVS, SIGKILL = 1, 38, 9
NOSUID, NODEV, NOEXEC, REC, PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
# Where host daemons keep Unix-domain sockets and state: hidden under empty tmpfs. (Abstract
# sockets belong to the network namespace.)
HOST_DIRS = ("/run", "/var/run", "/var/lib", "/var/spool", "/home", "/srv", "/mnt", "/media")
MAX_INT_BITS = 4096

def say(*words):
    line = " ".join(words).replace("\n", " ")
    WRITE(FD, line.encode("utf-8", "backslashreplace") + b"\n")

def typename(obj):
    # type.__name__ read through `type` itself: a metaclass cannot make it lie or raise
    name = type.__dict__["__name__"].__get__(type(obj))
    return str.replace(name, " ", "_")[:100]

def load_libc():
    # Calls into libc through _ctypes directly: importing the ctypes package would cost
    # more than a tenth of the whole run.
    try:
        import _ctypes

        class Int(_ctypes._SimpleCData):
            _type_ = "i"

        class ULong(_ctypes._SimpleCData):
            _type_ = "L"

        class Fn(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL
            _restype_ = Int

        class Libc:
            _handle = _ctypes.dlopen(None, 0)

        Fn(("prctl", Libc))
        return lambda name: Fn((name, Libc)), ULong
    except Exception:
        try:
            import ctypes
            return ctypes.CDLL(None).__getitem__, ctypes.c_ulong
        except Exception:
            return None, None

LIBC, ULONG = load_libc()

def unshare(flags):
    try:
        if hasattr(os, "unshare"):
            os.unshare(flags)
            return True
        return LIBC is not None and LIBC("unshare")(flags) == 0
    except OSError:
        return False

def prctl(option, arg):
    return LIBC is not None and LIBC("prctl")(option, arg, 0, 0, 0) == 0

def mount(target, fstype, flags, options):
    if LIBC("mount")(fstype, target.encode(), fstype, ULONG(flags), options) != 0:
        raise OSError("cannot mount %s on %s" % (fstype, target))

def private_mounts(size, uid, gid, own_pids):
    # Own tmpfs for the scratch directory and every world-writable directory: writes are
    # bounded, invisible to other programs, and vanish with the namespace.
    cwd = os.getcwd()
    if LIBC is None or not unshare(NEWNS):
        return []
    mount("/", None, REC | PRIVATE, None)
    for path in HOST_DIRS:
        if os.path.isdir(path) and not os.path.islink(path):
            mount(path, b"tmpfs", NOSUID | NODEV | NOEXEC, b"size=%d,mode=755" % (1024 * 1024))
    for path in WORLD_WRITABLE:
        if os.path.isdir(path):
            mount(path, b"tmpfs", NOSUID | NODEV | NOEXEC, b"size=%d,mode=1777" % size)
    os.makedirs(cwd, exist_ok=True)  # inside the new /tmp if that is where it was
    options = b"size=%d,mode=700,uid=%d,gid=%d" % (size, uid, gid)
    mount(cwd, b"tmpfs", NOSUID | NODEV | NOEXEC, options)
    os.chdir(cwd)
    done = ["mountns", "hostdirs-hidden"]
    if not own_pids:
        return done
    try:  # a /proc that shows only this PID namespace, not the evaluator's command lines
        mount("/proc", b"proc", NOSUID | NODEV | NOEXEC, None)
        return done + ["procfs"]
    except OSError:
        return done

def hold_sys_path():
    # The stdlib may end up out of reach: under a directory the sandbox uid cannot enter
    # (/root/.pyenv) or under a directory that gets a fresh tmpfs. Directory fds opened now
    # keep it importable through /proc/self/fd, which a process may always use.
    held = []
    for i, path in enumerate(sys.path):
        try:
            held.append((i, path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
        except OSError:
            pass
    return held

def reach_sys_path(held):
    remap = {}
    for i, path, fd in held:
        if os.access(path, os.R_OK | os.X_OK):
            os.close(fd)
        else:
            sys.path[i] = remap[path] = "/proc/self/fd/%d" % fd
    # Packages imported at start-up (encodings) search their own __path__, not sys.path.
    olds = sorted(remap, key=len, reverse=True)
    for module in list(sys.modules.values()) if remap else ():
        paths = getattr(module, "__path__", None)
        for j, p in enumerate(paths if isinstance(paths, list) else ()):
            old = next((o for o in olds if p == o or p.startswith(o + "/")), None)
            if old is not None:
                paths[j] = remap[old] + p[len(old):]
    return bool(remap)

def drop_privileges(uid, gid):
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise OSError("uid/gid did not change")

def main():
    cpu, mem, fsize, nproc, nofile, uid, gid, tmpfs = (int(x) for x in sys.argv[2:10])
    want, entry = sys.argv[10], sys.argv[11]
    del sys.argv[1:]
    code = sys.stdin.buffer.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)

    # B: new network, PID and IPC namespaces (a user namespace owns them when not root).
    root = os.geteuid() == 0
    iso = []
    kinds = [(f, n) for f, n in ((NEWNET, "netns"), (NEWPID, "pidns"), (NEWIPC, "ipcns")) if "n" in want]
    if root:
        iso += [n for f, n in kinds if unshare(f)]
    elif kinds and unshare(NEWUSER | sum(f for f, n in kinds)):
        iso += ["userns"] + [n for f, n in kinds]
    prctl(PDEATHSIG, SIGKILL)  # if the evaluator dies, so does everything below it
    if os.fork():
        os.wait()
        os._exit(0)

    # C: pid 1 of the new PID namespace; reaps, and says how D ended. Its death kills
    # every process left in the namespace.
    prctl(PDEATHSIG, SIGKILL)
    child = os.fork()
    if child:
        while True:
            try:
                pid, status, usage = os.wait3(0)
            except ChildProcessError:
                os._exit(1)
            if pid == child:
                say("wait", str(status), repr(usage.ru_utime + usage.ru_stime))
                os._exit(0)

    # D: private mounts, limits, an unprivileged uid; then the program.
    held = hold_sys_path()
    owner = (uid, gid) if "u" in want else (os.getuid(), os.getgid())
    if "n" in want and root:
        iso += private_mounts(tmpfs, *owner, "pidns" in iso)
    R = resource
    for res, soft, hard in (
        (R.RLIMIT_CPU, cpu, cpu + 1), (R.RLIMIT_AS, mem, mem), (R.RLIMIT_FSIZE, fsize, fsize),
        (R.RLIMIT_NPROC, nproc, nproc), (R.RLIMIT_NOFILE, nofile, nofile), (R.RLIMIT_CORE, 0, 0),
    ):
        R.setrlimit(res, (soft, hard))
    iso.append("rlimits")
    if "u" in want:
        drop_privileges(uid, gid)
        iso.append("uid=%d" % uid)
    if reach_sys_path(held):
        iso.append("stdlib-via-fd")
    if prctl(NO_NEW_PRIVS, 1):
        iso.append("no_new_privs")
    prctl(PDEATHSIG, SIGKILL)  # a uid change clears it
    if "netns" not in iso:
        for name in ("_socket", "socket", "_ssl", "ssl"):
            sys.modules[name] = None
        iso.append("socket-import-blocked")
    say("iso", ",".join(iso))
    run(code, entry)

def serialise(value):
    # By exact type, through int's and float's own methods: a subclass may override any of
    # its methods (bit_length, __repr__, __format__, ...) to lie about what it holds.
    if type(value) is bool:
        return ("nan", "bool")
    if isinstance(value, int):
        value = int.__int__(value)  # the stored integer, whatever the subclass says
        if int.bit_length(value) <= MAX_INT_BITS:
            return ("ok", "i", int.__format__(value, "x"))
        return ("ok", "f", "inf" if value > 0 else "-inf")  # no answer; too large to print
    if isinstance(value, float):
        return ("ok", "f", float.__repr__(float.__float__(value)))
    if not isinstance(value, (str, bytes, complex)) and hasattr(type(value), "__float__"):
        number = float(value)  # Decimal, Fraction: their own conversion, run here in the child
        return ("ok", "f", float.__repr__(float.__float__(number)))
    return ("nan", typename(value))

def run(code, entry):
    try:
        program = compile(code, "<program>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        say("syntax", typename(exc))
        os._exit(0)
    except BaseException as exc:
        say("exc", typename(exc))
        os._exit(0)
    me = os.getpid()
    try:
        scope = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(program, scope)
        fn = scope.get(entry)
        if not callable(fn):
            raise NameError("name %r is not defined" % entry)
        value = fn()
        if os.getpid() != me:  # a fork of the program returned: only D reports
            os._exit(0)
        record = serialise(value)
    except BaseException as exc:
        if os.getpid() != me:
            os._exit(1)
        record = ("exc", typename(exc))
        try:
            sys.stderr.write("%s: %s\n" % (typename(exc), exc))
        except BaseException:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    say(*record)
    os._exit(0)

try:
    main()
except BaseException as exc:  # a bug or a missing feature here, never the program's fault
    say("setup", "bootstrap-" + typename(exc))
    os._exit(1)
"""


class Outcome(enum.Enum):
    OK = "ok"  # returned a number (int or float)
    NOT_A_NUMBER = "not_a_number"  # returned something else (None, str, bool, ...)
    EXCEPTION = "exception"  # raised, exited, or never defined the entry point
    SYNTAX_ERROR = "syntax_error"
    TIMEOUT = "timeout"  # wall clock or CPU limit
    MEMORY = "memory"  # address-space limit (MemoryError)
    KILLED = "killed"  # died from a signal
    SANDBOX_ERROR = "sandbox_error"  # the sandbox itself failed; not the program's fault


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one program; the defaults fit GSM8K-sized programs with a wide margin."""

    wall_timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_bytes: int = 512 * MiB  # address space, not resident memory
    file_size_bytes: int = 1 * MiB
    # RLIMIT_NPROC counts every process and thread of a uid: each concurrent run gets its own
    # uid when the evaluator is root (see `uid`); otherwise they share the evaluator's.
    max_processes: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64 * KiB  # kept per stream; the rest is read and discarded
    tmpfs_bytes: int = 16 * MiB  # size of each private tmpfs (scratch, /tmp, /dev/shm, ...)
    entry_point: str = ENTRY_POINT
    # Used only when the evaluator runs as root; None keeps root (not recommended). With
    # uid_per_run, `uid` is the base of a range and each concurrent run gets uid + an offset
    # unique on the host; otherwise every run uses `uid` itself.
    uid: int | None = UID_BASE
    gid: int | None = NOBODY
    uid_per_run: bool = True
    namespaces: bool = True  # new network, PID and mount namespaces where the kernel allows
    python: str = field(default_factory=lambda: sys.executable)
    scratch_root: str | None = None  # parent of the per-program scratch directories

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


@dataclass(frozen=True)
class SandboxResult:
    outcome: Outcome
    value: int | float | None = None  # set only when outcome is OK
    error: str | None = None  # exception type, signal name, returned type or failure reason
    stdout: str = ""  # first max_output_bytes bytes, decoded with replacement
    stderr: str = ""
    elapsed_s: float = 0.0
    isolation: tuple[str, ...] = ()  # mechanisms the child confirmed, e.g. ("netns", "uid=1073741824")

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


def _argv(cfg: SandboxConfig, result_fd: int, drop: bool, uid: int) -> list[str]:
    want = ("n" if cfg.namespaces else "") + ("u" if drop else "")
    gid = cfg.gid if cfg.gid is not None else uid
    limits = (
        cfg.cpu_time_s, cfg.memory_bytes, cfg.file_size_bytes, cfg.max_processes,
        cfg.max_open_files, uid, gid, cfg.tmpfs_bytes,
    )
    return [
        cfg.python, "-I", "-S", "-B", "-X", "utf8", "-c", _CHILD,
        str(result_fd), *map(str, limits), want or "-", cfg.entry_point,
    ]


def _run(code: str | bytes, cfg: SandboxConfig, start: float) -> SandboxResult:
    # Lone surrogates survive encoding and then fail to compile in the child, as they should.
    source = code.encode("utf-8", "surrogatepass") if isinstance(code, str) else bytes(code)
    drop = os.geteuid() == 0 and cfg.uid is not None
    slot = _SLOTS.take()
    try:
        return _run_in_slot(source, cfg, start, drop, _run_uid(cfg, slot))
    finally:
        _SLOTS.give(slot)


def _run_in_slot(source: bytes, cfg: SandboxConfig, start: float, drop: bool, uid: int) -> SandboxResult:
    scratch = tempfile.mkdtemp(prefix="blockgen-sandbox-", dir=cfg.scratch_root)
    try:
        if drop:
            os.chown(scratch, uid, cfg.gid if cfg.gid is not None else uid)
        result_r, result_w = os.pipe()
        try:
            proc = subprocess.Popen(
                _argv(cfg, result_w, drop, uid),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=scratch,
                env={},
                close_fds=True,
                pass_fds=(result_w,),
                start_new_session=True,
            )
        except BaseException:
            os.close(result_r)
            raise
        finally:
            os.close(result_w)
        try:
            with proc:
                out, err, channel, timed_out = _communicate(
                    proc, result_r, source, cfg.max_output_bytes, start + cfg.wall_timeout_s
                )
        finally:
            os.close(result_r)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _decide(cfg, proc.returncode, out, err, channel, timed_out, time.monotonic() - start)


def _communicate(
    proc: subprocess.Popen[bytes], result_fd: int, source: bytes, limit: int, deadline: float
) -> tuple[bytes, bytes, bytes, bool]:
    """Feed the program, drain all pipes until EOF or the deadline, then kill the whole group."""
    assert proc.stdin and proc.stdout and proc.stderr
    out, err, channel = _Capped(limit), _Capped(limit), _Capped(_RESULT_LIMIT)
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
                    if key.fd == result_fd and not reported and _reported(channel.value()):
                        # The program is done and stdout flushed: don't wait for three
                        # processes to wind down one after another.
                        reported = True
                        _kill_group(proc.pid)
        if not timed_out:
            timed_out = not _exited(proc.pid, deadline)
    finally:
        _kill_group(proc.pid)
        proc.wait()
    return out.value(), err.value(), channel.value(), timed_out


def _kill_group(pid: int) -> None:
    # Only called before the bootstrap is reaped, so its pid (= the group id) is still ours.
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_RECORDS = (b"ok", b"nan", b"exc", b"syntax", b"setup")


def _reported(channel: bytes) -> bool:
    """Whether the bootstrap has written its final record (a whole line)."""
    return any(line.split(b" ", 1)[0] in _RECORDS for line in channel.split(b"\n")[:-1])


def _exited(pid: int, deadline: float) -> bool:
    """Wait (without reaping) until the bootstrap exits; all pipes at EOF means it is exiting."""
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


def _decide(
    cfg: SandboxConfig,
    returncode: int | None,
    out: bytes,
    err: bytes,
    channel: bytes,
    timed_out: bool,
    elapsed: float,
) -> SandboxResult:
    isolation: tuple[str, ...] | None = None
    record: tuple[str, str] | None = None
    wait: str | None = None
    for line in channel.decode("utf-8", "replace").splitlines():
        word, _, rest = line.partition(" ")
        if word == "iso" and isolation is None:
            isolation = tuple(rest.split(",")) if rest else ()
        elif word.encode() in _RECORDS:
            record = (word, rest)  # the bootstrap writes last, after the program is done
        elif word == "wait":
            wait = rest

    def result(outcome: Outcome, error: str | None = None, value: int | float | None = None):
        return SandboxResult(
            outcome,
            value=value,
            error=error,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            elapsed_s=elapsed,
            isolation=isolation or (),
        )

    if record is not None:
        kind, rest = record
        if kind == "ok":
            value = _parse_number(rest)
            if value is None:
                return result(Outcome.NOT_A_NUMBER, "unreadable")
            return result(Outcome.OK, value=value)
        if kind == "nan":
            return result(Outcome.NOT_A_NUMBER, rest)
        if kind == "syntax":
            return result(Outcome.SYNTAX_ERROR, rest)
        if kind == "exc":
            return result(Outcome.MEMORY if rest == "MemoryError" else Outcome.EXCEPTION, rest)
        return result(Outcome.SANDBOX_ERROR, rest)
    if timed_out:
        return result(Outcome.TIMEOUT, "wall")
    if wait is not None:
        status_text, _, cpu_text = wait.partition(" ")
        try:
            status, cpu = int(status_text), float(cpu_text)
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
    if returncode is not None and returncode < 0:
        return result(Outcome.KILLED, _signal_name(-returncode))
    tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no report"]
    return result(Outcome.SANDBOX_ERROR, tail[0][:200])


_HEX = re.compile(r"-?[0-9a-f]{1,%d}" % (MAX_INT_BITS // 4))
_FLOAT = re.compile(r"-?(?:inf|nan|[0-9]+\.[0-9]+(?:e[-+][0-9]+)?|[0-9]+e[-+][0-9]+)")


def _parse_number(text: str) -> int | float | None:
    """`i <hex>` or `f <float repr>` as the child writes them; None for anything else."""
    typ, _, number = text.partition(" ")
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


_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def parse_gsm8k_answer(text: str) -> int | float | None:
    """The number after the last `####` (or the first number in `text`): '1,000' -> 1000."""
    tail = text.rsplit("####", 1)[-1].replace("$", "")
    match = _NUMBER.search(tail)
    if match is None:
        return None
    number = match.group().replace(",", "")
    try:
        return float(number) if "." in number else int(number)
    except ValueError:
        return None


def is_correct(
    result: SandboxResult | int | float | None, reference: str | int | float
) -> bool:
    """Integers must match exactly; anything involving a float must be within 1e-3."""
    value = result.value if isinstance(result, SandboxResult) else result
    ref = parse_gsm8k_answer(reference) if isinstance(reference, str) else reference
    if value is None or ref is None or isinstance(value, bool) or isinstance(ref, bool):
        return False
    if isinstance(value, int) and isinstance(ref, int):
        return value == ref
    try:
        return abs(float(value) - float(ref)) <= 1e-3
    except OverflowError:
        return False
