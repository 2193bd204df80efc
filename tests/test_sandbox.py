"""The gsm8k_code sandbox against a hostile corpus, plus its helpers on real GSM8K records.

The corpus runs once (in parallel, like an evaluation) and later tests check what it must not
have done: touched files outside its scratch directory, reached a socket, seen a secret, left
processes behind, or changed anything in this (the evaluator's) process.
"""

from __future__ import annotations

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
import time
from dataclasses import FrozenInstanceError, dataclass, replace
from pathlib import Path
from typing import Callable

import pytest

from blockgen.tasks.sandbox import (
    MAX_CONCURRENT,
    MiB,
    Outcome,
    SandboxConfig,
    SandboxResult,
    extract_code,
    is_correct,
    isolation_report,
    parse_gsm8k_answer,
    run_many,
    run_program,
)

# the real GSM8K test split, in the shared/ folder laid beside the checkout (and beside CI's clone)
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.json"
FAST = SandboxConfig(
    wall_timeout_s=1.5, cpu_time_s=1, memory_bytes=128 * MiB, max_processes=8, max_open_files=32
)
SLACK_S = 1.0  # how far past its wall timeout a run may end (kill, reap, clean up)
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
    needs_root: bool = False  # the expectation rests on the uid drop or the mount namespace

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
    cases = [
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
    return [replace(c, needs_root=True) for c in cases]


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
            needs_root=True,  # writes the real /tmp otherwise
        ),
        case(
            "disk_fill",
            program("for i in range(10**6):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)\n"),
            E,
            needs_root=True,  # bounded by the private tmpfs only
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
            needs_root=True,  # otherwise /proc shows this process, of the same user
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
            needs_root=True,  # a fresh /proc needs the mount namespace
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
        case(
            "udp_loopback",
            lambda w: program(
                "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"return s.sendto(b'leak', ('127.0.0.1', {w.udp_port}))\n"
            ),
            E,
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
            needs_root=True,  # otherwise the parent is of the same user
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
        case(
            "subprocess_whoami",
            program(
                "import subprocess\n"
                "return int(subprocess.run(['id', '-u'], capture_output=True).stdout)\n"
            ),
            OK,
            check=lambda r: not ROOT or f"uid={r.value}" in r.isolation and r.value >= FAST.uid,
        ),
        case(
            "subprocess_background",
            program(
                "import subprocess\n"
                "subprocess.Popen(['sleep', '4321'], start_new_session=True)\n"
                "return 0\n"
            ),
            OK,
        ),
        case(
            "setsid_escape",
            program(
                """
                import os
                if os.fork() == 0:
                    os.setsid()
                    os.execv('/bin/sleep', ['sleep', '4322'])
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


@pytest.mark.skipif(not ROOT, reason="file protection needs the uid drop or the mount namespace")
def test_files_outside_scratch_untouched(world: World, outcomes) -> None:
    assert snapshot(world.outside) == world.before_files
    assert not (world.outside / "pwned").exists()
    for directory in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not Path(directory, world.token).exists()


@pytest.mark.skipif(not ROOT, reason="the uid drop needs root")
def test_uid_alone_protects_files(world: World) -> None:
    """Without the mount namespace the files are visible: the unprivileged uid must hold."""
    cfg = replace(FAST, namespaces=False, scratch_root=str(world.scratch_root))
    cases = filesystem_cases()
    for c, r in zip(cases, run_many([c.source(world) for c in cases], cfg, max_workers=2)):
        assert "mountns" not in r.isolation
        assert r.outcome in c.expect and (c.check is None or c.check(r)), (c.name, r)
        assert r.outcome is not Outcome.EXCEPTION or r.error == "PermissionError", (c.name, r)
    assert snapshot(world.outside) == world.before_files
    assert not (world.outside / "pwned").exists()
    assert wait_until_gone(world.scratch_root) == []
    assert os.listdir(world.scratch_root) == []


def test_scratch_directories_removed(world: World, outcomes) -> None:
    assert os.listdir(world.scratch_root) == []


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
    iso = isolation_report(FAST)
    assert "rlimits" in iso
    assert "netns" in iso or "socket-import-blocked" in iso
    if ROOT:
        expected = {"netns", "pidns", "ipcns", "mountns", "hostdirs-hidden", "procfs", "no_new_privs"}
        assert expected <= set(iso)
        (uid,) = [int(i[4:]) for i in iso if i.startswith("uid=")]
        assert FAST.uid <= uid < FAST.uid + (1 << 22) * MAX_CONCURRENT


@pytest.mark.skipif(not ROOT, reason="emulates an unprivileged evaluator from root")
def test_unprivileged_evaluator_gets_a_user_namespace(monkeypatch) -> None:
    import blockgen.tasks.sandbox as sandbox

    child = sandbox._CHILD.replace("root = os.geteuid() == 0", "root = False")
    assert child != sandbox._CHILD
    monkeypatch.setattr(sandbox, "_CHILD", child)
    r = run_program(
        program("import socket, os\nsocket.create_connection(('127.0.0.1', 22), 1)\n"),
        replace(FAST, uid=None),
    )
    assert {"userns", "netns", "pidns", "ipcns"} <= set(r.isolation), r
    assert r.outcome is Outcome.EXCEPTION and r.error == "OSError", r


@pytest.mark.skipif(not ROOT, reason="the uid drop needs root")
def test_failed_uid_drop_fails_closed(monkeypatch) -> None:
    import blockgen.tasks.sandbox as sandbox

    child = sandbox._CHILD.replace("    os.setuid(uid)\n", "    pass\n")
    assert child != sandbox._CHILD
    monkeypatch.setattr(sandbox, "_CHILD", child)
    r = run_program(program("open('ran', 'w')\nreturn 1\n"), FAST)
    assert r.outcome is Outcome.SANDBOX_ERROR and r.value is None, r


def test_fallback_without_namespaces_blocks_sockets() -> None:
    cfg = replace(FAST, namespaces=False)
    r = run_program(program("import socket\nreturn 1\n"), cfg)
    assert "socket-import-blocked" in r.isolation and "netns" not in r.isolation
    assert r.outcome is Outcome.EXCEPTION and r.error in ("ImportError", "ModuleNotFoundError")


def test_run_many_keeps_order_and_bounds_time() -> None:
    cfg = replace(FAST, wall_timeout_s=1.0)
    codes = [program(f"return {i}\n") for i in range(6)]
    codes += [program("import time\ntime.sleep(100)\n")] * 4
    start = time.monotonic()
    results = run_many(codes, cfg, max_workers=2)
    elapsed = time.monotonic() - start
    assert [r.value for r in results[:6]] == list(range(6))
    assert all(r.outcome is Outcome.TIMEOUT for r in results[6:])
    assert 1.9 < elapsed < 2.0 + 2 * SLACK_S  # 4 timeouts on 2 workers, nothing more
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


@pytest.mark.skipif(not ROOT, reason="hiding host directories needs the mount namespace")
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
        for cfg in (FAST, replace(FAST, uid=None)):  # the mount namespace alone, even as root
            r = run_program(code, cfg)
            assert r.outcome is Outcome.OK and r.value == 0, r
            assert "hostdirs-hidden" in r.isolation
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
        import os, subprocess, time
        time.sleep(0.4)  # the bomb has filled its process limit by now
        done = 0
        for _ in range(4):
            done += subprocess.run(['true']).returncode == 0
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


def test_forged_result_records_are_bounded() -> None:
    """Whatever a program writes on the result pipe, the evaluator parses it within limits."""
    forged = {
        "huge_hex": "ok i " + "f" * 3000,  # 12,000 bits: past the 4,096-bit limit
        "float_junk": "ok f 1e999999999999",
        "not_hex": "ok i 0x12",
        "words": "ok i 12 34",
    }
    write = """
    import os
    for fd in os.listdir('/proc/self/fd'):
        try:
            os.write(int(fd), b'{line}\\n') if int(fd) > 2 else None
        except OSError:
            pass
    os._exit(0)
    """
    codes = [program(write.format(line=line)) for line in forged.values()]
    for name, r in zip(forged, run_many(codes, FAST, max_workers=2)):
        assert r.outcome is Outcome.NOT_A_NUMBER and r.error == "unreadable", (name, r)
        assert r.value is None and str(r)

# --- helpers: answers and code extraction on real GSM8K records ---------------------------------


@pytest.fixture(scope="module")
def gsm8k() -> list[dict[str, str]]:
    if not GSM8K.exists():
        pytest.skip(f"{GSM8K} not found")
    return json.loads(GSM8K.read_text())


def test_parse_gsm8k_answer_on_every_record(gsm8k) -> None:
    answers = [parse_gsm8k_answer(r["response_ground_truth"]) for r in gsm8k]
    assert all(isinstance(a, int) for a in answers)
    raw = [r["response_ground_truth"].rsplit("####", 1)[1].strip() for r in gsm8k]
    assert answers == [int(a.replace(",", "")) for a in raw]
    with_commas = [a for a, text in zip(answers, raw) if "," in text]
    assert with_commas and all(a >= 1000 for a in with_commas)


def test_parse_gsm8k_answer_formats() -> None:
    assert parse_gsm8k_answer("so 3 + 4 = 7\n#### 1,000") == 1000
    assert parse_gsm8k_answer("#### $1,450,000") == 1450000
    assert parse_gsm8k_answer("#### -3") == -3
    assert parse_gsm8k_answer("#### 2.5") == 2.5
    assert parse_gsm8k_answer("42") == 42
    assert parse_gsm8k_answer("#### none") is None


def test_is_correct() -> None:
    assert is_correct(18, "#### 18")
    assert is_correct(18.0, "#### 18")
    assert is_correct(17.9995, "#### 18")
    assert not is_correct(18.002, "#### 18")
    assert not is_correct(17, "#### 18")
    assert is_correct(1000, "#### 1,000")
    assert is_correct(2.5, 2.5004)
    assert not is_correct(10**20 + 1, 10**20)  # integers compare exactly
    assert not is_correct(None, "#### 18")
    assert not is_correct(True, "#### 1")
    assert not is_correct(float("nan"), "#### 18")
    assert not is_correct(10**400, "#### 18")  # too large for a float, no exception
    assert not is_correct(SandboxResult(Outcome.NOT_A_NUMBER, error="str"), "#### 18")
    assert is_correct(SandboxResult(Outcome.OK, value=18), "#### 18")


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
