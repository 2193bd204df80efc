"""The sandbox's hostile corpus, as data: each case a program (or a function of the `World` it runs in:
paths, ports, a secret) and the outcomes it may have. tests/test_sandbox_corpus.py runs them all once."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from blockgen.tasks.sandbox import Outcome, SandboxResult
from sandbox_helpers import FAST, H, ROOT, program


Code = str | bytes | Callable[["World"], str]


@dataclass(frozen=True)
class Case:
    name: str
    code: Code  # or a function of the test world (paths, ports, secret)
    expect: frozenset[Outcome]
    check: Callable[[SandboxResult], bool] | None = None
    destructive: bool = False  # would hurt the test process if isolation were missing

    def source(self, world: World) -> str | bytes:
        return self.code(world) if callable(self.code) else self.code


def case(
    name: str, code: Code, *expect: Outcome, check=None, destructive=False
) -> Case:
    return Case(name, code, frozenset(expect), check, destructive)


# --- the world the cases run in (tests/test_sandbox_corpus.py builds it) ----------------------


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


# --- the cases ----------------------------------------------------------------------------------

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
            E,  # EPERM in both modes: the filter refuses signals to pid 1 (as root, so would its uid)
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
