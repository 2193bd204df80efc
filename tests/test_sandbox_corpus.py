"""The gsm8k_code sandbox against the hostile corpus (tests/hostile_programs.py): every program run once,
in parallel like an evaluation, each with an outcome it may have; then what the corpus must not have
done: touched files outside its scratch directory, reached a socket, seen a secret, left processes or
cgroups behind, or changed anything in this (the evaluator's) process."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from blockgen.tasks.sandbox import Outcome, SandboxResult, isolation_report, run_many, run_program
from blockgen.tasks.gsm8k_code import is_correct  # the task's, on the sandbox's results
from hostile_programs import CASES, Case, World, bombs, corpus
from sandbox_helpers import FAST, SLACK_S, program, run_cgroups, wait_until_gone

# Sandbox runs with wall clocks of a second or two, or processes that take both cores: alone under xdist.
pytestmark = [pytest.mark.whole_machine, pytest.mark.runs_programs]


# --- the hostile environment -------------------------------------------------------------------


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


@pytest.fixture(scope="module")
def outcomes(world: World) -> dict[str, SandboxResult]:
    """Every case run once, in parallel like an evaluation (bombs in a batch of their own)."""
    cfg = replace(FAST, scratch_root=str(world.scratch_root))
    results: dict[str, SandboxResult] = {}
    for group in (corpus(), bombs()):
        runnable = [
            c
            for c in group
            if strongly_isolated(world) or not c.destructive
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
        pytest.skip("destructive without a PID namespace or a uid of its own: not run")
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


def test_no_processes_left_behind(world: World, outcomes) -> None:
    assert wait_until_gone(world.scratch_root) == []


def test_evaluator_unchanged(world: World, outcomes) -> None:
    assert evaluator_state() == world.before


def test_normal_program_after_the_corpus(outcomes) -> None:
    r = run_program(program("eggs = 16 - 3 - 4\nreturn eggs * 2\n"), FAST)
    assert r.outcome is Outcome.OK and r.value == 18 and is_correct(r, "#### 18")
