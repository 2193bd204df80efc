import os
import shutil
import tempfile

import pytest
import torch

# Fixtures that several test files share, defined in their helper modules and registered here (a
# session fixture defined in one place is built once a session, however many files ask for it):
from lm_eval_checkpoints import ckpts  # noqa: F401  the lm-eval tests' tiny checkpoints
from sampling_models import masked, uniform  # noqa: F401  tiny random models, one of each per test module

_mauve_cache: str | None = None


def pytest_configure(config):
    """MAUVE's cache (harness/evaluation/mauve_cache.py) of the tests and of the commands they start: a folder of
    this session, not ~/.cache. Set before collection, so the modules' ENV copies carry it."""
    global _mauve_cache
    _mauve_cache = tempfile.mkdtemp(prefix="blockgen-test-mauve-")
    os.environ["BLOCKGEN_MAUVE_CACHE"] = _mauve_cache


def pytest_unconfigure(config):
    if _mauve_cache:
        shutil.rmtree(_mauve_cache, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models: one thread each avoids OpenMP spin contention when other processes share the cores."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the subprocesses the tests start
    yield
