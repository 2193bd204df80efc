import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models: one thread each avoids OpenMP spin contention when other processes share the cores."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the subprocesses the tests start
    yield
