"""One distributed setup (harness/runtime/distributed.py): the device policy, the ranks torchrun puts in the
environment, joining the process group, and that training and the lm-eval adapter both go through it.

No process group is started here (the 2-rank gloo runs are in test_train, test_lm_eval_command, test_sweep,
test_gsm8k_code, test_prepare and test_restart): CUDA and `torch.distributed` are monkeypatched.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from blockgen.harness.runtime import distributed
from blockgen.harness.evaluation.lm_eval_model import arguments, model as lm_eval_model
from blockgen.harness.training import train
from blockgen.harness.training.train_config import TrainConfig
from blockgen.harness.runtime.distributed import Distributed, Ranks, ranks_from_env, resolve_device, setup_distributed

REPO = Path(__file__).resolve().parents[1]
STORED_CHECKPOINT = REPO / "leaderboards" / "ci_gsm8k" / "gsm-masked-mix" / "checkpoint"
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def torchrun_env(monkeypatch, rank: int, local_rank: int, world_size: int) -> None:
    for name, value in zip(TORCHRUN_VARS, (rank, local_rank, world_size)):
        monkeypatch.setenv(name, str(value))


def gpus(monkeypatch, count: int) -> None:
    """Pretend torch sees `count` GPUs (0: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_ranks_from_the_environment(no_torchrun, monkeypatch):
    assert ranks_from_env() == Ranks(rank=0, local_rank=0, world_size=1, launched=False)
    assert ranks_from_env().is_main
    torchrun_env(monkeypatch, rank=5, local_rank=1, world_size=8)
    ranks = ranks_from_env()
    assert (ranks.rank, ranks.local_rank, ranks.world_size, ranks.launched, ranks.is_main) == (5, 1, 8, True, False)
    # a given mapping (a child process's environment) instead of os.environ
    assert ranks_from_env({"LOCAL_RANK": "3"}) == Ranks(rank=0, local_rank=3, world_size=1, launched=True)
    assert ranks_from_env({}) == Ranks()


def test_auto_is_the_gpu_when_there_is_one(monkeypatch):
    gpus(monkeypatch, 0)
    assert resolve_device("auto") == resolve_device(None) == torch.device("cpu")
    gpus(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_device_the_machine_lacks_is_an_error_naming_the_choices(monkeypatch):
    gpus(monkeypatch, 0)
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=r"sees no GPU.*'cpu'.*'auto'"):
            resolve_device(name)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="MPS is not available.*'cpu'"):
        resolve_device("mps")
    for name in ("gpu", "meta"):
        with pytest.raises(ValueError, match=r"choose one of \['auto', 'cpu', 'cuda', 'cuda:N', 'mps'\]"):
            resolve_device(name)
    gpus(monkeypatch, 2)
    with pytest.raises(ValueError, match="has 2 GPU"):
        resolve_device("cuda:2")


def test_each_torchrun_process_takes_the_gpu_of_its_local_rank(monkeypatch):
    gpus(monkeypatch, 4)
    for asked in ("cuda", "cuda:0", "cuda:3", "auto"):
        assert resolve_device(asked, Ranks(rank=6, local_rank=2, world_size=8)) == torch.device("cuda", 2)
    assert resolve_device("cpu", Ranks(rank=6, local_rank=2, world_size=8)) == torch.device("cpu")
    with pytest.raises(ValueError, match="LOCAL_RANK=4 has no GPU: this machine has 4"):
        resolve_device("cuda", Ranks(rank=4, local_rank=4, world_size=8))


class FakeProcessGroup:
    """Stands in for torch.distributed: records init_process_group instead of connecting."""

    def __init__(self, monkeypatch) -> None:
        import torch.distributed as dist

        self.calls: list[tuple] = []
        self.devices: list[torch.device] = []
        monkeypatch.setattr(dist, "is_initialized", lambda: bool(self.calls))
        monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: self.calls.append((backend, timeout)))
        monkeypatch.setattr(torch.cuda, "set_device", self.devices.append)


def test_a_lone_process_joins_nothing(no_torchrun, monkeypatch, capsys):
    group = FakeProcessGroup(monkeypatch)
    gpus(monkeypatch, 0)
    assert setup_distributed() == Distributed(device=torch.device("cpu"))
    assert setup_distributed("cpu", timeout_s=5) == Distributed(device=torch.device("cpu"))
    assert group.calls == [] and group.devices == [] and capsys.readouterr().out == ""


def test_torchrun_joins_gloo_on_cpu_nccl_on_cuda_with_the_timeout(monkeypatch, capsys):
    gpus(monkeypatch, 0)
    torchrun_env(monkeypatch, rank=0, local_rank=0, world_size=2)
    group = FakeProcessGroup(monkeypatch)
    d = setup_distributed("auto", timeout_s=15)
    assert (d.rank, d.local_rank, d.world_size, d.is_main, d.device) == (0, 0, 2, True, torch.device("cpu"))
    assert group.calls == [("gloo", timedelta(seconds=15))] and group.devices == []
    assert capsys.readouterr().out == "blockgen: process group gloo, 2 processes, timeout 15 s\n"
    setup_distributed("cpu")  # a second caller in the same process (a sweep's next model) joins nothing more
    assert len(group.calls) == 1

    gpus(monkeypatch, 2)
    torchrun_env(monkeypatch, rank=3, local_rank=1, world_size=4)
    group = FakeProcessGroup(monkeypatch)
    d = setup_distributed("cuda")
    assert (d.rank, d.local_rank, d.world_size, d.is_main, d.device) == (3, 1, 4, False, torch.device("cuda", 1))
    assert group.calls == [("nccl", timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))]
    assert group.devices == [torch.device("cuda", 1)]
    assert capsys.readouterr().out == ""  # only rank 0 says it


def test_training_sets_up_through_the_one_function(monkeypatch):
    """train() asks setup_distributed for the configured device and timeout (after preparing the data)."""
    seen = []

    class Stop(Exception):
        pass

    def spy(device, timeout_s):
        seen.append((device, timeout_s))
        raise Stop

    monkeypatch.setattr(train, "ensure_prepared", lambda data, seq_len: Path("unused"))
    monkeypatch.setattr(train, "setup_distributed", spy)
    with pytest.raises(Stop):
        train.train(TrainConfig(device="cpu", dist_timeout_s=77))
    assert seen == [("cpu", 77)]
    assert TrainConfig().dist_timeout_s == distributed.DEFAULT_TIMEOUT_S


def test_the_adapter_sets_up_through_the_one_function(no_torchrun, monkeypatch, caplog):
    """BlockGenLM asks setup_distributed for its device; lm-eval's own default (cuda:0, sent when
    --device is not given) means the CPU on a machine without a GPU, with a warning, as before."""
    seen = []

    def spy(device):
        seen.append(device)
        return setup_distributed(device)

    monkeypatch.setattr(lm_eval_model, "setup_distributed", spy)
    gpus(monkeypatch, 0)
    lm = lm_eval_model.BlockGenLM(pretrained=str(STORED_CHECKPOINT), device="cpu")
    assert seen == ["cpu"] and lm.device == torch.device("cpu") and (lm.rank, lm.world_size) == (0, 1)
    with caplog.at_level(logging.WARNING):
        lm = lm_eval_model.BlockGenLM(pretrained=str(STORED_CHECKPOINT), device=arguments.LM_EVAL_DEFAULT_DEVICE)
    assert seen[-1] == "cpu" and lm.device == torch.device("cpu")
    assert "CUDA is not available; using the CPU" in caplog.text
    with pytest.raises(ValueError, match="sees no GPU"):  # asked for by name: no silent fallback
        lm_eval_model.BlockGenLM(pretrained=str(STORED_CHECKPOINT), device="cuda")
    assert seen[-1] == "cuda"
