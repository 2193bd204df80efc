import os
import shutil
import tempfile

import pytest
import torch

from machine_share import WHOLE_MACHINE, MachineLock, shared_root

# Fixtures that several test files share, defined in their helper modules and registered here: the
# trained artefacts in tests/shared_fixtures.py, built once per run whichever xdist worker asks first.
from sampling_models import masked, uniform  # noqa: F401  tiny random models, one of each per test module
from shared_fixtures import ci_checkpoint, ckpts  # noqa: F401

_caches: list[str] = []


def pytest_configure(config):
    """Caches of the tests and of the commands they start, in folders of this run, not ~/.cache: MAUVE's
    (harness/evaluation/mauve_cache.py, one per process) and lm-eval's task index (blockgen/lm_eval/task_index.py,
    made by the controller and inherited by the xdist workers, so the run builds it once). Set before
    collection, so the modules' ENV copies carry them."""
    config.addinivalue_line("markers", f"{WHOLE_MACHINE}: runs with no other test beside it under xdist "
                            "(outcomes or run times that depend on the load: sandbox wall clocks, gloo timeouts, two-thread subprocesses)")
    config.addinivalue_line("markers", "runs_programs: executes programs in the sandbox (tasks/sandbox.py); "
                            "`make test-unprivileged` runs these again as uid nobody")
    _caches.append(tempfile.mkdtemp(prefix="blockgen-test-mauve-"))
    os.environ["BLOCKGEN_MAUVE_CACHE"] = _caches[-1]
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        _caches.append(tempfile.mkdtemp(prefix="blockgen-test-task-index-"))
        os.environ["BLOCKGEN_TASK_INDEX_CACHE"] = _caches[-1]


def pytest_unconfigure(config):
    for folder in _caches:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models: one thread each avoids OpenMP spin contention when other processes share the cores."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the subprocesses the tests start
    yield


# The modules that take longest (fixtures that train, vLLM servers), slowest first, measured one process at a time
# on the 2-core machine (2026-11-28, `--durations=0`, summed per module): under `--dist loadscope` a worker
# takes a module at a time in collection order, so starting these first keeps one long module from being last.
SLOW_MODULES_FIRST = (
    "test_owt_tasks.py", "test_train.py", "test_sweep.py", "test_lm_eval_command.py", "test_leaderboard.py",
    "test_gsm8k_code.py", "test_graphs.py", "test_restart.py", "test_prepare.py", "test_tasks_any_model.py",
    "test_scorers.py", "test_online_pipeline.py", "test_hub_faults.py", "test_sweep_shards.py", "test_gpu_check.py", "test_outcomes.py", "test_released.py",
    "test_synthlang.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


_machine: MachineLock | None = None


def _whole(item) -> bool:
    return item is not None and item.get_closest_marker(WHOLE_MACHINE) is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of a `whole_machine` test hold the machine alone; any other test holds it shared."""
    global _machine
    if _machine is None:
        _machine = MachineLock(shared_root(item.config._tmp_path_factory))
    _machine.acquire(_whole(item))
    try:
        return (yield)
    finally:
        _machine.release(keep_whole=_whole(item) and _whole(nextitem))
