"""Sandbox hardening: System V and POSIX IPC objects die with the run, host Unix sockets are out of reach,
a fork bomb does not starve its neighbour (a uid per run), and returned values (lying int and float
subclasses, huge ints) and forged result records are read by exact type and within limits."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from blockgen.tasks.sandbox import Outcome, run_many, run_program
from sandbox_helpers import FAST, ROOT, program, sysv_keys

# Sandbox runs with wall clocks of a second or two, or processes that take both cores: alone under xdist.
pytestmark = [pytest.mark.whole_machine, pytest.mark.runs_programs]


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
    """A world-writable Unix-domain socket under /run (where daemons keep theirs) cannot be reached; as an
    ordinary user, one in each place of the host the evaluator may write (its runtime folder, /tmp, home)."""
    listeners, paths = [], []
    places = ("/run", "/var/lib", f"/run/user/{os.getuid()}", tempfile.gettempdir(), os.path.expanduser("~"))
    for directory in dict.fromkeys(places):
        if not (os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)):
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
