"""The evaluator's side of a run: `run_program`, `run_many`, and what goes on around one run.

bwrap execs `child.py` as pid 1 of the namespace; it forks the program's process, which lowers its
rlimits, drops to a uid of its own per concurrent run (evaluator as root; RLIMIT_NPROC counts per
uid), joins a fresh session keyring and runs the program. pid 1 reports how it ended and exits,
and the kernel then kills whatever is left. `SandboxResult.isolation` lists what was in force for
that run.

The evaluator enforces the wall clock and kills pid 1 (through a pidfd, so never a reused pid),
drains the program's stdout, stderr and result pipe, and decides the outcome (`results.py`).
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from .cgroups import _RunCgroups, _autogroup, _oom_first
from .config import _SCRATCH, ENTRY_POINT, MAX_CONCURRENT, NOBODY, KiB, SandboxConfig
from .isolation import _bwrap, _mount_args, _root, key_lists
from .results import Outcome, SandboxResult, _Channel, _decide
from .seccomp import _seccomp

_CHUNK = 64 * KiB
_RESULT_LIMIT = 16 * KiB  # the result pipe: the child's records take a few hundred bytes


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


@functools.cache
def _child_source() -> str:
    return (Path(__file__).parent / "child.py").read_text()


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
    empty_fds = []  # read ends of pipes already closed for writing: empty files for bwrap's --ro-bind-data
    for _ in key_lists():
        read, write = os.pipe()
        os.close(write)
        empty_fds.append(read)
    theirs += empty_fds
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
            "--seccomp", str(seccomp_r), *_mount_args(cfg, root, empty_fds), "--",
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
