"""The six classes of issue 33, what a run could still take from the machine outside its namespaces and
cgroups, one test each: socket buffers (no socket but Unix), the OOM killer's choice, the page cache,
the result pipe's parser, disk bandwidth, and an interpreter under /tmp with CPU priorities."""

from __future__ import annotations

import ast
import errno
import os
import resource
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from blockgen.tasks.sandbox import Outcome, SandboxConfig, SandboxResult, run_program
from limits import HANG_S
from sandbox_helpers import FAST, contained, program, run_cgroups, sandbox_processes, syscall_numbers

# Sandbox runs with wall clocks of a second or two, or processes that take both cores: alone under xdist.
pytestmark = [pytest.mark.whole_machine, pytest.mark.runs_programs]


# --- issue 33: what a run could still take from the machine outside its namespaces and cgroups -----


def watch(tmp_path: Path, cfg: SandboxConfig = FAST, body: str = "import time\nopen('ready', 'w').close()\ntime.sleep(2)\nreturn 1\n",
          look: Callable[[list[int]], object] = lambda pids: pids):
    """Run `body` (it writes `ready` in its scratch directory) and call `look(pids)` on the run's
    processes seen from the host (pid 1 and the program's), while they are alive; then its result."""
    cfg = replace(cfg, scratch_root=str(tmp_path), wall_timeout_s=10)
    result: list[SandboxResult] = []
    worker = threading.Thread(target=lambda: result.append(run_program(program(body), cfg)))
    worker.start()
    try:
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and worker.is_alive():
            found = sandbox_processes(tmp_path)
            if len(found) >= 2 and all(Path(f"/proc/{p}/cwd/ready").exists() for p in found):
                seen = look(found)
                break
            time.sleep(0.02)
        else:
            seen = None
    finally:
        worker.join()
    return seen, result[0]


CAP_SYS_RESOURCE = 24


def has_capability(cap: int) -> bool:
    """Whether this process holds `cap` (root in a container may lack some, e.g. CAP_SYS_RESOURCE)."""
    status = Path("/proc/self/status").read_text()
    return bool(int(next(l for l in status.splitlines() if l.startswith("CapEff:")).split()[1], 16) >> cap & 1)


KEPT = ("unix_pair", "multiprocessing_pipe", "asyncio")
SOCKETS_ATTACK = """
import errno, multiprocessing, socket
KEPT = ("unix_pair", "multiprocessing_pipe", "asyncio")  # as above
tried = {}
for name, family, kind in [("inet_stream", 2, 1), ("inet_dgram", 2, 2), ("inet6_stream", 10, 1),
                           ("inet6_dgram", 10, 2), ("inet_raw", 2, 3), ("netlink", 16, 3),
                           ("packet", 17, 3), ("tipc", 30, 2), ("vsock", 40, 1), ("xdp", 44, 3)]:
    try:
        socket.socket(family, kind).close()
        tried[name] = 0
    except OSError as exc:
        tried[name] = exc.errno
for name, family in [("inet_pair", 2), ("unix_pair", 1)]:
    try:
        a, b = socket.socketpair(family)
        a.sendall(b"x")
        tried[name] = 0 if b.recv(1) == b"x" else -1
    except OSError as exc:
        tried[name] = exc.errno
left, right = multiprocessing.Pipe()  # duplex: a Unix socket pair, kept for the stdlib
left.send(41)
tried["multiprocessing_pipe"] = 0 if right.recv() == 41 else -1
import asyncio  # its event loop wakes itself through a Unix socket pair
tried["asyncio"] = asyncio.run(asyncio.sleep(0, 0))
for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # Unix buffers stay at the default size
    try:
        socket.socket(socket.AF_UNIX).setsockopt(socket.SOL_SOCKET, option, 1 << 30)
        tried["grow_%d" % option] = 0
    except OSError as exc:
        tried["grow_%d" % option] = exc.errno
print(tried)
return sum(value == 0 for name, value in tried.items() if name not in KEPT)
"""


def test_issue33_class1_no_socket_but_unix(tmp_path: Path) -> None:
    """Issue 33, class 1: loopback TCP inside the run's own network namespace filled ~650 MiB of
    socket buffers the run's v1 memory cgroup never charged. Every family but AF_UNIX (kept for
    multiprocessing.Pipe and asyncio) is refused, Unix buffers cannot grow past the default, and
    where the run has a v1 memory cgroup its TCP buffers are limited too (v2 charges socket memory
    to memory.max already)."""
    (r,) = contained(tmp_path / "scratch", program(SOCKETS_ATTACK))
    assert r.outcome is Outcome.OK and r.value == 0, (r, r.stdout)
    tried = ast.literal_eval(r.stdout.splitlines()[0])
    assert all(tried[name] in (0, None) for name in KEPT), tried
    grow = {n: e for n, e in tried.items() if n.startswith("grow_")}
    assert set(grow.values()) == {errno.EPERM}, tried
    assert {e for n, e in tried.items() if n not in (*KEPT, *grow, "inet_pair")} == {errno.EAFNOSUPPORT}, tried
    assert "sockets=unix" in r.isolation, r.isolation

    def tcp_limits(_pids):
        return {Path(c, "memory.kmem.tcp.limit_in_bytes").read_text().strip()
                for c in run_cgroups() if Path(c, "memory.kmem.tcp.limit_in_bytes").exists()}

    limits, run = watch(tmp_path / "watched", look=tcp_limits)
    assert run.ok, run
    if f"memory<={FAST.memory_bytes}:cgroup" in run.isolation and limits:  # a v1 memory cgroup
        assert limits == {str(FAST.memory_bytes)}, limits
        assert "tcp-kmem:cgroup" in run.isolation, run.isolation


LOWER_OOM = """
import ctypes, os
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self is the program's own again
for value in (0, -1000, 999):
    try:
        with open('/proc/self/oom_score_adj', 'w') as f:
            f.write(str(value))
    except OSError:
        pass
print(int(open('/proc/self/oom_score_adj').read()))
"""
OOM_ATTACK = f"""
import os, subprocess, sys
def adj():
    return int(open('/proc/self/oom_score_adj').read())
seen = [adj()]
exec({LOWER_OOM!r})  # in this process, then in a fresh one (exec makes it dumpable again)
seen.append(adj())
seen.append(int(subprocess.run([sys.executable, '-c', {LOWER_OOM!r}], capture_output=True, text=True).stdout))
r, w = os.pipe()
if os.fork() == 0:
    os.write(w, str(adj()).encode())
    os._exit(0)
os.wait()
seen.append(int(os.read(r, 16)))
print(seen)
return min(seen)
"""


def test_issue33_class2_runs_are_the_oom_killers_choice(tmp_path: Path) -> None:
    """Issue 33, class 2: every sandboxed process has oom_score_adj 1000, so the kernel's OOM
    killer takes a run before the evaluator. An evaluator with CAP_SYS_RESOURCE (root, unless a
    container took it away) sets it, which also makes it the floor: the program cannot lower it,
    not even from a fresh exec; without it, the kernel lets it go back to the evaluator's floor."""
    (r,) = contained(tmp_path / "scratch", program(OOM_ATTACK))
    assert r.ok, (r, r.stdout, r.stderr)
    if has_capability(CAP_SYS_RESOURCE):
        assert r.value == 1000, r.stdout
    assert ast.literal_eval(r.stdout.splitlines()[-1])[0] == 1000, r.stdout
    assert "oom_score_adj=1000" in r.isolation, r.isolation
    scores, run = watch(tmp_path / "watched",
                        look=lambda pids: {int(Path(f"/proc/{p}/oom_score_adj").read_text()) for p in pids})
    assert run.ok and scores == {1000}, (scores, run)
    assert int(Path("/proc/self/oom_score_adj").read_text()) != 1000  # the evaluator keeps its own


PAGE_CACHE_ATTACK = """
import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
n = {numbers!r}
fd = os.open(os.__file__, os.O_RDONLY)  # the bound, read-only stdlib: shared with every run and the host
size = os.fstat(fd).st_size
page = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
address = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(page)))
with open("scratch.bin", "wb") as f:
    f.write(b"x" * 4096)
out = os.open("scratch.bin", os.O_RDWR)
own = mmap.mmap(-1, 4096)
tried = {{}}
def attempt(name, call):
    try:
        call()
        tried[name] = 0
    except OSError as exc:
        tried[name] = exc.errno
def syscall(*args):
    if libc.syscall(*args) < 0:
        raise OSError(ctypes.get_errno(), "")
vec = ctypes.create_string_buffer((size + 4095) // 4096)
stat = ctypes.create_string_buffer(64)
whole = (ctypes.c_uint64 * 2)(0, 0)
attempt("fadvise_dontneed", lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))
attempt("fadvise_willneed", lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED))
attempt("readahead", lambda: syscall(n["readahead"], fd, ctypes.c_long(0), ctypes.c_size_t(size)))
attempt("mincore", lambda: syscall(n["mincore"], address, ctypes.c_size_t(size), vec))
attempt("cachestat", lambda: syscall(n["cachestat"], fd, whole, stat, 0))
attempt("preadv2_nowait", lambda: os.preadv(fd, [bytearray(64)], 0, os.RWF_NOWAIT))
attempt("pwritev2_nowait", lambda: os.pwritev(out, [b"y"], 0, os.RWF_NOWAIT))
attempt("madvise_pageout", lambda: page.madvise(21))  # MADV_PAGEOUT (not in every build's mmap)
attempt("madvise_cold", lambda: page.madvise(20))  # MADV_COLD
refused, tried = tried, {{}}
# what ordinary code does still works: reads, other flags, madvise of its own memory
attempt("preadv", lambda: os.preadv(fd, [bytearray(64)], 0))
attempt("preadv2_hipri", lambda: os.preadv(fd, [bytearray(64)], 0, os.RWF_HIPRI))
attempt("pwritev2_dsync", lambda: os.pwritev(out, [b"z"], 0, os.RWF_DSYNC))
attempt("madvise_dontneed", lambda: own.madvise(mmap.MADV_DONTNEED))
attempt("madvise_willneed", lambda: page.madvise(mmap.MADV_WILLNEED))
print(refused)
print(tried)
return sum(v == 0 for v in refused.values()) + 100 * sum(v != 0 for v in tried.values())
"""


def test_issue33_class3_no_page_cache_probe_or_eviction(tmp_path: Path) -> None:
    """Issue 33, class 3: the host's page cache as a channel between runs. Evicting pages of the
    bound files (posix_fadvise, madvise PAGEOUT/COLD) and reading residency (mincore, cachestat,
    preadv2 with RWF_NOWAIT) are refused (EPERM), and readahead with them; reads with other
    flags and madvise of the program's own memory still work."""
    numbers = syscall_numbers("readahead", "mincore", "cachestat")
    (r,) = contained(tmp_path, program(PAGE_CACHE_ATTACK.format(numbers=numbers)))
    assert r.ok, (r, r.stdout)
    refused, allowed = (ast.literal_eval(line) for line in r.stdout.splitlines()[:2])
    assert set(refused.values()) == {errno.EPERM}, refused
    assert set(allowed.values()) == {0}, allowed
    assert r.value == 0, r.stdout


RECORD_FLOOD = """
import os, time
fds = [int(fd) for fd in os.listdir('/proc/self/fd') if int(fd) > 2]
sent = 0
while sent < {total}:
    for fd in fds:
        try:
            sent += os.write(fd, b'["x"]\\n')
        except OSError:
            pass
    time.sleep({pause})
return 12
"""


def test_issue33_class4_result_pipe_parsed_once_and_capped(tmp_path: Path, monkeypatch) -> None:
    """Issue 33, class 4: record-like lines written to the result pipe every 0.5 ms made the
    evaluator re-parse the whole buffer after each read, and past 16 KiB dropped the real record
    (a `sandbox_error`). Each line is parsed once as it arrives; past the limit the run is the
    program's failure, `output_limit`, and a program under the limit still scores."""
    from blockgen.tasks.sandbox import results, runner

    parsed: list[int] = []  # bytes handed to the parser (a line and its end)
    real = results._parse_line
    monkeypatch.setattr(results, "_parse_line", lambda line: parsed.append(len(line) + 1) or real(line))
    channels: list = []  # every result pipe, to count what reached the evaluator

    class Channel(results._Channel):
        def __init__(self, limit: int) -> None:
            super().__init__(limit)
            channels.append(self)

    monkeypatch.setattr(runner, "_Channel", Channel)
    under = program(RECORD_FLOOD.format(total=4 * 1024, pause=0.0005))  # a read per line, about
    over = program(RECORD_FLOOD.format(total=64 * 1024, pause=0))
    small, flood = contained(tmp_path, under, over, cfg=replace(FAST, wall_timeout_s=5))
    assert small.outcome is Outcome.OK and small.value == 12, small
    assert flood.outcome is Outcome.OUTPUT_LIMIT and flood.value is None, flood
    assert flood.error == "result pipe", flood
    # each byte that reached the evaluator parsed at most once (the flood's only up to the limit)
    assert len(channels) == 3 and sum(c.overflow for c in channels) == 1
    assert 4 * 1024 < sum(parsed) <= sum(min(c.size, c.limit) for c in channels), sum(parsed)


DISK_ATTACK = """
import ctypes, fcntl, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
n = {numbers!r}
IDLE, BE, RT = 3 << 13, 2 << 13 | 4, 1 << 13 | 4
def call(*args):
    ret = libc.syscall(*args)
    return ret if ret >= 0 else -ctypes.get_errno()
found = {{"ioprio": call(n["ioprio_get"], 1, 0)}}
found["ioprio_be"] = call(n["ioprio_set"], 1, 0, BE)
found["ioprio_rt"] = call(n["ioprio_set"], 1, 0, RT)
found["ioprio_none"] = call(n["ioprio_set"], 1, 0, 0)
found["ioprio_idle"] = call(n["ioprio_set"], 1, 0, IDLE)  # staying idle is fine
for name, flags in (("open_direct", os.O_RDONLY | os.O_DIRECT), ("open", os.O_RDONLY)):
    try:
        os.close(os.open(os.__file__, flags))
        found[name] = 0
    except OSError as exc:
        found[name] = -exc.errno
fd = os.open(os.__file__, os.O_RDONLY)
try:
    fcntl.fcntl(fd, fcntl.F_SETFL, os.O_DIRECT)
    found["setfl_direct"] = 0
except OSError as exc:
    found["setfl_direct"] = -exc.errno
how = ctypes.create_string_buffer(24)
found["openat2"] = call(n["openat2"], -100, os.__file__.encode(), how, 24)
# the flushes: answered 0 without running (a kernel would say EBADF / EINVAL for these arguments)
for name in ("syncfs", "fsync", "fdatasync"):
    found[name] = call(n[name], 9999)
found["sync_file_range"] = call(n["sync_file_range"], 9999, 0, 0, 0)
found["msync"] = call(n["msync"], 1, 4096, 4)
found["sync"] = call(n["sync"])
with open("kept.txt", "w") as f:  # and code that syncs its own files still works
    f.write("x")
    f.flush()
    os.fsync(f.fileno())
print(found)
return 0
"""


def test_issue33_class5_disk_bandwidth(tmp_path: Path) -> None:
    """Issue 33, class 5: a run's I/O is of the idle class (the program cannot leave it), O_DIRECT
    reads that bypass the page cache are refused, and sync/syncfs/fsync/fdatasync/sync_file_range/
    msync, which flush the host's file systems and device caches from any descriptor, do nothing:
    everything a run can write is tmpfs, which has nothing to flush."""
    numbers = syscall_numbers("ioprio_get", "ioprio_set", "openat2", "syncfs", "fsync", "fdatasync",
                              "sync_file_range", "msync", "sync")
    (r,) = contained(tmp_path, program(DISK_ATTACK.format(numbers=numbers)))
    assert r.ok, (r, r.stdout, r.stderr)
    found = ast.literal_eval(r.stdout.splitlines()[0])
    assert found["ioprio"] >> 13 == 3, found  # IOPRIO_CLASS_IDLE
    assert [found[k] for k in ("ioprio_be", "ioprio_rt", "ioprio_none", "ioprio_idle")] == [-errno.EPERM] * 3 + [0], found
    assert found["open_direct"] == found["setfl_direct"] == -errno.EPERM and found["open"] == 0, found
    assert found["openat2"] == -errno.ENOSYS, found
    assert {found[k] for k in ("syncfs", "fsync", "fdatasync", "sync_file_range", "msync", "sync")} == {0}, found
    assert "ioprio=idle" in r.isolation, r.isolation


def hardlink_or_copy(source: str, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


RT_ATTACK = """
import os, resource
found = {"rtprio": resource.getrlimit(resource.RLIMIT_RTPRIO), "nice_limit": resource.getrlimit(resource.RLIMIT_NICE),
         "nice": os.getpriority(os.PRIO_PROCESS, 0)}
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    found["fifo"] = 0
except OSError as exc:
    found["fifo"] = exc.errno
try:
    os.setpriority(os.PRIO_PROCESS, 0, found["nice"] - 1)
    found["lower_nice"] = 0
except OSError as exc:
    found["lower_nice"] = exc.errno
print(found)
return found["nice"]
"""


def test_issue33_class6_interpreter_under_tmp_and_priorities(tmp_path: Path) -> None:
    """Issue 33, class 6: an interpreter under /tmp or /dev/shm was hidden by the run's private
    tmpfs (every run a sandbox_error); it is bound on top of them now, and one inside the scratch
    directory is refused by name. Runs get RLIMIT_RTPRIO 0 and RLIMIT_NICE 0 whatever the
    evaluator has, and a nice value of at least max(evaluator's, SandboxConfig.nice)."""
    real = os.path.realpath(FAST.python)
    under_tmp = tmp_path / "interpreter"
    under_tmp.mkdir(mode=0o755)
    hardlink_or_copy(real, under_tmp / "python3")
    shm = Path(tempfile.mkdtemp(prefix="blockgen-interpreter-", dir="/dev/shm"))
    inside = tmp_path / "scratch-root" / "blockgen-sandbox"
    inside.mkdir(parents=True)
    try:
        os.chmod(shm, 0o755)
        shutil.copy2(real, shm / "python3")
        hardlink_or_copy(real, inside / "python3")
        for python in (under_tmp / "python3", shm / "python3"):
            (r,) = contained(tmp_path / "scratch", program("import os\nreturn 7\n"), cfg=replace(FAST, python=str(python)))
            assert r.outcome is Outcome.OK and r.value == 7, (python, r)
        r = run_program(program("return 7\n"), replace(FAST, python=str(inside / "python3"), scratch_root=str(inside.parent)))
        assert r.outcome is Outcome.SANDBOX_ERROR and str(inside / "python3") in (r.error or ""), r
    finally:
        shutil.rmtree(shm)
    # priorities: where it may (CAP_SYS_RESOURCE), the evaluator raises its own limits so that they
    # would allow real-time scheduling and a lower nice value, had the runs inherited them
    saved = [resource.getrlimit(resource.RLIMIT_RTPRIO), resource.getrlimit(resource.RLIMIT_NICE)]
    if has_capability(CAP_SYS_RESOURCE):
        resource.setrlimit(resource.RLIMIT_RTPRIO, (10, 10))
        resource.setrlimit(resource.RLIMIT_NICE, (30, 30))
    try:
        (plain,) = contained(tmp_path / "scratch", program(RT_ATTACK))
        (floor,) = contained(tmp_path / "scratch", program(RT_ATTACK), cfg=replace(FAST, nice=5))
    finally:
        if has_capability(CAP_SYS_RESOURCE):
            resource.setrlimit(resource.RLIMIT_RTPRIO, saved[0])
            resource.setrlimit(resource.RLIMIT_NICE, saved[1])
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for r in (plain, floor):
        assert r.ok, (r, r.stderr)
        found = ast.literal_eval(r.stdout.splitlines()[0])
        assert found["rtprio"] == (0, 0) and found["nice_limit"] == (0, 0), found
        assert found["fifo"] == errno.EPERM and found["lower_nice"] in (errno.EPERM, errno.EACCES), found
    assert plain.value == max(own, 0) and floor.value == max(own, 5), (plain.value, floor.value)
    assert "rtprio=0" in plain.isolation and f"nice>={max(own, 5)}" in floor.isolation, floor.isolation
