"""The seven classes of issue 22, one test each: descriptors into the host tree, the evaluator's files,
keyrings, memory, CPU, the result channel and the kernel's surface. Each attack is contained, a benign
neighbour beside it still scores, and nothing is left behind (sandbox_helpers.contained)."""

from __future__ import annotations

import ast
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from blockgen.tasks.sandbox import MiB, Outcome, run_program
from limits import HANG_S
from sandbox_helpers import (
    FAST,
    GSM8K,
    NEIGHBOUR,
    NEIGHBOUR_VALUE,
    ROOT,
    TOKEN,
    contained,
    leftovers,
    program,
    sandbox_processes,
    settled,
    syscall_numbers,
)

# Sandbox runs with wall clocks of a second or two, or processes that take both cores: alone under xdist.
pytestmark = [pytest.mark.whole_machine, pytest.mark.runs_programs]


# --- the seven classes of issue 22: each attempt contained, the neighbour scores, nothing left ----


def fd_targets(pid: int) -> list[str]:
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return targets


ESCAPE = """
import os
fds = os.listdir('/proc/self/fd')
links = []
for fd in fds:
    try:
        links.append(os.readlink('/proc/self/fd/' + fd))
    except OSError:
        pass
print(sorted(links))
reached = []
for fd in fds + ['cwd', 'root']:  # walk `..` from every descriptor (and from pid 1's)
    for base in ('/proc/self/fd/', '/proc/1/fd/', '/proc/1/'):
        for up in range(1, 8):
            try:
                reached.append((base + fd + '/..' * up, os.listdir(base + fd + '/..' * up)))
            except OSError:
                pass
reached = [r for r in reached if not r[0].startswith(('/proc/self/fd/cwd', '/proc/self/fd/root'))]
for target in {targets!r}:
    if os.path.exists(target):
        reached.append(target)
for directory in ('/tmp', '/dev/shm', '/var/tmp', '/run', '/'):
    try:
        open(directory + '/{token}', 'w').write('x')
    except OSError:
        pass
print(reached[:5])
return len(reached)
"""


def test_class1_no_descriptor_into_the_host_tree(tmp_path: Path) -> None:
    """Class 1: nothing opened before the sandbox reaches the program; walking `..` from any
    descriptor (its own or pid 1's) ends inside the sandbox. The interpreter here sits under
    root's 0700 home (pyenv), the case that leaked before."""
    marker = Path(tempfile.mkdtemp(prefix="blockgen-host-")) / "marker"
    marker.write_text("host")
    base = Path(sys.base_prefix)
    targets = [str(marker), str(base / "bin" / "pip"), str(Path(__file__).resolve()), sys.prefix,
               *[p for p in sys.path if p.endswith("site-packages")]]
    assert all(os.path.exists(t) for t in targets)
    try:
        (r,) = contained(tmp_path, program(ESCAPE.format(targets=targets, token=TOKEN)))
    finally:
        shutil.rmtree(marker.parent)
    assert r.outcome is Outcome.OK and r.value == 0, (r, r.stdout)
    links = ast.literal_eval(r.stdout.splitlines()[0])
    assert all(link == "/dev/null" or link.startswith("pipe:[") for link in links), links
    # From outside: the sandbox's processes (pid 1, the program) hold no descriptor into the host
    cfg = replace(FAST, scratch_root=str(tmp_path), wall_timeout_s=5)
    before = leftovers(tmp_path)
    sleeper = program("import time\nopen('ready', 'w').close()\ntime.sleep(1)\n")
    worker = threading.Thread(target=run_program, args=(sleeper, cfg))
    worker.start()

    def ready() -> list[int]:  # pid 1 and the program's process, once the program runs
        found = sandbox_processes(tmp_path)
        return found if len(found) >= 2 and all(Path(f"/proc/{p}/cwd/ready").exists() for p in found) else []

    try:
        deadline = time.monotonic() + 4
        while not (found := ready()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert found, sandbox_processes(tmp_path)
        if ROOT:
            targets = [t for pid in found for t in fd_targets(pid)]
        else:  # the run's processes are not dumpable: their descriptors are root's to list, not ours
            for pid in found:
                with pytest.raises(PermissionError):
                    fd_targets(pid)
            targets = ["/dev/null"]
    finally:
        worker.join()
    assert targets and all(t == "/dev/null" or t.startswith("pipe:[") for t in targets), targets
    assert settled(before, tmp_path) == before


READ_FILES = """
import os
found = []
for path in {paths!r}:
    try:
        open(path, 'rb').read(1)
        found.append(path)
    except OSError:
        pass
outside = []
for top, dirs, files in os.walk('/'):
    if top.startswith({inside!r}) or top in ('/proc', '/dev'):
        dirs[:] = []  # the bound directories themselves, and the kernel's views
        continue
    outside += [p for p in (os.path.join(top, name) for name in files) if p not in {inside!r}]
print(found, outside[:20])
return 1000 * len(found) + len(outside)
"""


def test_class2_evaluator_files_are_not_in_the_root(tmp_path: Path) -> None:
    """Class 2: the root holds the interpreter, its stdlib and the shared libraries, nothing else:
    not the reference answers, not the checkout, not /etc, not a file the evaluator just wrote."""
    from blockgen.tasks.sandbox import isolation

    secret = tmp_path / "evaluation" / "answers.json"
    secret.parent.mkdir()
    secret.write_text('{"answer": 18}')
    os.chmod(tmp_path, 0o755)
    os.chmod(secret.parent, 0o755)
    repo = Path(__file__).resolve().parents[1]
    paths = [str(GSM8K), str(repo / "README.md"), str(secret), "/etc/passwd", "/etc/hostname",
             "/etc/shadow", f"/proc/{os.getpid()}/environ", str(repo / "tests" / "conftest.py")]
    binds = isolation._root(FAST.python).binds
    for path in paths[:3]:  # nothing of the evaluator's lies under what is bound
        assert not any(path.startswith(b + "/") for b in binds), (path, binds)
    (r,) = contained(tmp_path / "scratch", program(READ_FILES.format(paths=paths, inside=tuple(binds))))
    assert r.outcome is Outcome.OK and r.value == 0, (r, r.stdout)


KEYRING_EVALUATOR = """
import ctypes, json, os, sys
from blockgen.tasks.sandbox import SandboxConfig, run_many
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
n = {numbers!r}
# A session keyring of its own with a secret in it, as a service (pam_keyinit, systemd) has
assert libc.syscall(n["keyctl"], 1, b"blockgen-evaluator") >= 0
key = libc.syscall(n["add_key"], b"user", b"blockgen-secret", b"the answer key", 14, ctypes.c_long(-3))
assert key > 0
codes = [code.replace("KEY_ID", str(key)) for code in json.load(sys.stdin)]
results = run_many(codes, SandboxConfig(scratch_root={scratch!r}), max_workers=2)
print(json.dumps({{"pid": os.getpid(), "results": [
    {{"outcome": r.outcome.value, "value": r.value, "stdout": r.stdout, "isolation": r.isolation}}
    for r in results]}}))
"""
KEYRING_ATTACK = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
n = {numbers!r}
L = ctypes.c_long
buf = ctypes.create_string_buffer(64)
attempts = {{
    "read_secret": (n["keyctl"], 11, KEY_ID, buf, 64),  # KEYCTL_READ
    "search_session": (n["keyctl"], 10, L(-3), b"user", b"blockgen-secret", 0),  # KEYCTL_SEARCH @s
    "request_key": (n["request_key"], b"user", b"blockgen-secret", None, 0),
    "plant_user_key": (n["add_key"], b"user", b"{token}", b"x", 1, L(-4)),  # @u outlives the run
    "plant_session_key": (n["add_key"], b"user", b"{token}", b"x", 1, L(-3)),
    "join_named": (n["keyctl"], 1, b"blockgen-evaluator"),
    "user_keyring": (n["keyctl"], 0, L(-4), 1),  # KEYCTL_GET_KEYRING_ID, create
}}
worked = {{}}
for name, args in attempts.items():
    ret = libc.syscall(*args)
    worked[name] = (ret, ctypes.get_errno())
print(worked)
seen = open("/proc/keys").read()
return sum(ret >= 0 for ret, _ in worked.values()) + 100 * ("blockgen" in seen)
"""


@pytest.mark.skipif(not Path("/proc/key-users").exists(), reason="no kernel keyrings")
def test_class3_keyrings(tmp_path: Path) -> None:
    """Class 3: an evaluator with a secret in its session keyring: the program neither possesses
    nor finds it, cannot make keys that outlive it, and its own keyring dies with it."""
    numbers = syscall_numbers("keyctl", "add_key", "request_key")
    script = KEYRING_EVALUATOR.format(numbers=numbers, scratch=str(tmp_path))
    codes = [program(KEYRING_ATTACK.format(numbers=numbers, token=TOKEN)), NEIGHBOUR]
    before = leftovers(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(codes),
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    attack, neighbour = report["results"]
    assert neighbour["outcome"] == "ok" and neighbour["value"] == NEIGHBOUR_VALUE, neighbour
    assert attack["outcome"] == "ok" and attack["value"] == 0, attack
    errnos = {e for _, e in ast.literal_eval(attack["stdout"].splitlines()[0]).values()}
    assert errnos == {errno.EPERM}, attack["stdout"]
    assert "session-keyring" in attack["isolation"]
    expected = {**before, "processes": [], "cgroups": [], "keys": []}  # of that evaluator's runs
    assert settled(expected, tmp_path, report["pid"]) == expected


MEMORY_ATTACK = """
import os, select, time
r, w = os.pipe()
children = 6
for _ in range(children):
    if os.fork() == 0:
        block = b'x' * (40 << 20)  # resident: every page written
        os.write(w, b'1')
        time.sleep(30)
        os._exit(0)
held, deadline = 0, time.monotonic() + 0.6
while held < children and time.monotonic() < deadline:
    if select.select([r], [], [], 0.05)[0]:
        held += len(os.read(r, children))
dead = 0
while True:  # children the run's memory cgroup killed no longer hold theirs
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid == 0:
        break
    dead += 1
return held - dead
"""


def test_class4_memory_is_bounded_per_run(tmp_path: Path) -> None:
    """Class 4: six children of 40 MiB each against memory_bytes = 128 MiB. With a memory cgroup
    the run holds at most 128 MiB in all (the kernel kills past it); without one, the honest bound
    is max_processes x memory_bytes, and SandboxResult.isolation says which holds."""
    cfg = replace(FAST, wall_timeout_s=3)
    (r,) = contained(tmp_path, program(MEMORY_ATTACK), cfg=cfg)
    if f"memory<={cfg.memory_bytes}:cgroup" in r.isolation:
        assert r.outcome is Outcome.MEMORY or (r.ok and r.value * 40 * MiB <= cfg.memory_bytes), r
    else:
        assert f"memory<={cfg.max_processes * cfg.memory_bytes}:nproc*as" in r.isolation, r.isolation
        assert r.ok and r.value * 40 * MiB <= cfg.max_processes * cfg.memory_bytes, r
    (bare,) = contained(tmp_path, program(MEMORY_ATTACK), cfg=replace(cfg, cgroups=False))
    assert f"memory<={cfg.max_processes * cfg.memory_bytes}:nproc*as" in bare.isolation
    assert bare.ok and bare.value * 40 * MiB <= cfg.max_processes * cfg.memory_bytes, bare


SESSIONS_ATTACK = """
import os, time
r, w = os.pipe()
for _ in range(6):
    if os.fork() == 0:
        try:
            os.setsid()  # an autogroup of its own: a full share of the CPU each
            os.write(w, b'1')
        except OSError:
            os.write(w, b'0')
        while True:
            pass
sessions = sum(os.read(r, 1) == b'1' for _ in range(6))
end = time.monotonic() + 1.0
while time.monotonic() < end:
    pass
return sessions
"""
BUSY = 2_400_000  # about a third of a second of CPU for the neighbour
BUSY_NEIGHBOUR = program(f"total = 0\nfor i in range({BUSY}):\n    total += i & 7\nreturn total\n")


def test_class5_a_run_cannot_starve_its_neighbour(tmp_path: Path, monkeypatch) -> None:
    """Class 5: children that each call setsid() to get an autogroup (and so most of the CPU)
    beside a neighbour that needs a third of a second of CPU. setsid is refused: each run is one
    session (one autogroup), or, where autogroups do not apply, one cpu cgroup of its own."""
    from blockgen.tasks.sandbox import cgroups, runner

    cfg = replace(FAST, wall_timeout_s=4, cpu_time_s=3)
    for autogroup in {cgroups._autogroup(), False}:  # as this machine has it; then without
        for module in (cgroups, runner):  # the run's cgroups, and what it reports in force
            monkeypatch.setattr(module, "_autogroup", lambda: autogroup)
        (r,) = contained(tmp_path, program(SESSIONS_ATTACK), cfg=cfg,
                         neighbour=(BUSY_NEIGHBOUR, BUSY // 8 * 28))
        assert r.outcome is Outcome.OK and r.value == 0, r  # not one setsid went through
        # a cpu cgroup where this evaluator may make one (root, or a delegated subtree): an ordinary user
        # usually may not, and then runs compete process by process (docs/sandbox.md, the modes' table)
        cpu_cgroups = any("cpu" in names and os.access(parent, os.W_OK) for parent, names in cgroups._cgroup_parents())
        expected = "cpu:autogroup" if autogroup else "cpu:cgroup" if cpu_cgroups else None
        assert expected is None or expected in r.isolation, r.isolation


NAMES = ["a\nb", "a\rb", "a\x0bb", "a\x0cb", "a\x1cb", "a\x1db", "a\x1eb", "a\x85b", "a\u2028b",
         "a\u2029b", 'a"b', "a\\b", ']\n["ok", "i", "12"]\n[']
GARBAGE_THEN_RETURN = """
import os
for fd in os.listdir('/proc/self/fd'):
    if int(fd) > 2:
        try:
            os.write(int(fd), b'["ok", "i", "99"')  # no end of line: the real record follows
        except OSError:
            pass
return 12
"""
FORGED_SURROGATE = """
import os
for fd in os.listdir('/proc/self/fd'):
    if int(fd) > 2:
        try:
            os.write(int(fd), b'\\n["nan", "\\\\ud800"]\\n')  # JSON may carry a lone surrogate
        except OSError:
            pass
os._exit(0)
"""


def test_class6_no_value_breaks_the_result_channel(tmp_path: Path) -> None:
    """Class 6: type names with every character str.splitlines() breaks on (and JSON's own
    specials) come back whole, as the program's outcome, never as a sandbox error."""
    returns = [program("return T()\n", f"T = type({name!r}, (), {{}})\n") for name in NAMES]
    raises = [program("raise E()\n", f"E = type({name!r}, (Exception,), {{}})\n") for name in NAMES]
    record_in_a_str = program("return '\\n[\"ok\", \"i\", \"12\"]\\n'\n")
    others = [record_in_a_str, program(GARBAGE_THEN_RETURN), program(FORGED_SURROGATE)]
    results = contained(tmp_path, *returns, *raises, *others)
    for name, r in zip(NAMES, results[: len(NAMES)]):
        assert r.outcome is Outcome.NOT_A_NUMBER and r.error == name, (name, r)
    for name, r in zip(NAMES, results[len(NAMES) : 2 * len(NAMES)]):
        assert r.outcome is Outcome.EXCEPTION and r.error == name, (name, r)
    in_str, garbage, surrogate = results[2 * len(NAMES) :]
    assert in_str.outcome is Outcome.NOT_A_NUMBER and in_str.error == "str", in_str
    assert garbage.outcome is Outcome.OK and garbage.value == 12, garbage
    assert surrogate.outcome is Outcome.NOT_A_NUMBER and surrogate.error == "\\ud800", surrogate
    for r in results:
        assert str(r) and json.dumps({"error": r.error}) and (r.error or "").encode("utf-8") is not None


SURFACE_ATTACK = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
n = {numbers!r}
buf = ctypes.create_string_buffer(256)
perf = ctypes.create_string_buffer(128)
perf[0:8] = (1).to_bytes(4, 'little') + (128).to_bytes(4, 'little')  # software clock, on itself
attempts = {{
    "io_uring": (n["io_uring_setup"], 8, buf),
    "userfaultfd": (n["userfaultfd"], 0),
    "perf_event_open": (n["perf_event_open"], perf, 0, -1, -1, 0),
    "fanotify": (n["fanotify_init"], 0, 0),
    "bpf": (n["bpf"], 0, buf, 72),
    "vsock": (n["socket"], 40, 1, 0),
    "netlink": (n["socket"], 16, 3, 0),
    "packet": (n["socket"], 17, 3, 0),
    "alg": (n["socket"], 38, 5, 0),
    "mount": (n["mount"], b"none", b"/tmp", b"tmpfs", 0, None),
    "unshare_user": (n["unshare"], 0x10000000),
    "setns": (n["setns"], 0, 0),
    "ptrace": (n["ptrace"], 0, 0, 0, 0),
    "process_vm_readv": (n["process_vm_readv"], 1, buf, 1, buf, 1, 0),
    "setsid": (n["setsid"],),
    "keyring": (n["keyctl"], 0, ctypes.c_long(-4), 1),
    "clone_newuser": (n["clone"], 0x10000000 | 17, 0, 0, 0, 0),
}}
worked = {{}}
for name, args in attempts.items():
    ret = libc.syscall(*args)
    if ret == 0 and name == "clone_newuser":
        os._exit(0)  # the child, had it been made
    worked[name] = (ret, ctypes.get_errno())
print(worked)
return sum(ret >= 0 for ret, _ in worked.values())
"""
I386_GETPID = """
import ctypes, mmap
code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (i386 getpid); int 0x80; ret
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
address = ctypes.addressof(ctypes.c_char.from_buffer(page))
return ctypes.CFUNCTYPE(ctypes.c_int)(address)()
"""


def test_class7_kernel_surface_is_refused(tmp_path: Path) -> None:
    """Class 7: io_uring, userfaultfd, perf_event_open on itself, fanotify, bpf, vsock, netlink and
    other socket families, mount, namespaces, ptrace, setsid, keyrings: each refused (EPERM, or
    EAFNOSUPPORT for sockets). A syscall through another ABI (i386 `int 0x80`) kills the process."""
    numbers = syscall_numbers(
        "io_uring_setup", "userfaultfd", "perf_event_open", "fanotify_init", "bpf", "socket", "mount",
        "unshare", "setns", "ptrace", "process_vm_readv", "setsid", "keyctl", "clone",
    )
    attacks = [program(SURFACE_ATTACK.format(numbers=numbers))]
    if os.uname().machine == "x86_64":
        attacks.append(program(I386_GETPID))
    surface, *i386 = contained(tmp_path, *attacks)
    assert surface.outcome is Outcome.OK and surface.value == 0, (surface, surface.stdout)
    worked = ast.literal_eval(surface.stdout.splitlines()[0])
    assert {name for name, (_, e) in worked.items() if e != errno.EPERM} == {"vsock", "netlink", "packet", "alg"}
    assert {e for name, (_, e) in worked.items() if name in ("vsock", "netlink", "packet", "alg")} == {errno.EAFNOSUPPORT}
    for r in i386:
        assert r.outcome is Outcome.KILLED and r.error == "SIGSYS", r
