"""Which device a process computes on, and where it stands among torchrun's processes.

Training and the lm-eval adapter call `setup_distributed` once: it resolves the device, joins
torchrun's process group when there is one (NCCL on CUDA, gloo otherwise) and gives each process
its own GPU. Code that only needs its rank (data preparation, a scorer's GPU, progress bars) calls
`ranks_from_env`, which reads torchrun's variables and joins nothing. A decision read from files (a
sweep's "is this setting done?") is made on rank 0 and broadcast: `decided_on_rank0`.

Device policy, the same for every caller:
- "auto" (or None): CUDA when torch sees a GPU, else the CPU;
- "cpu", "cuda", "cuda:N", "mps": that device. One this machine lacks is an error that names the
  choices, never a silent fallback: a run meant for a GPU must not train for hours on the CPU;
- under torchrun (more than one process) on CUDA, each process takes GPU LOCAL_RANK, whatever
  index was asked for.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch

AUTO = "auto"
DEVICE_CHOICES = (AUTO, "cpu", "cuda", "cuda:N", "mps")
# Bounds every collective and the group's start-up; NCCL's own default (10 minutes) is too short for
# ranks that wait while rank 0 writes a checkpoint or evaluates.
DEFAULT_TIMEOUT_S = 1800
T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """A process's place among torchrun's: its global rank, its rank on this machine, how many in all."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    launched: bool = False  # torchrun's variables are set (also for a single process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ranks_from_env(env: Mapping[str, str] | None = None) -> Ranks:
    """The ranks torchrun (or an equivalent launcher) put in the environment; a lone process is rank 0 of 1."""
    env = os.environ if env is None else env
    return Ranks(rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
                 world_size=int(env.get("WORLD_SIZE", "1")), launched="LOCAL_RANK" in env)


@dataclass(frozen=True)
class Distributed(Ranks):
    """What `setup_distributed` returns: the ranks and the device this process computes on."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def resolve_device(requested: str | None, ranks: Ranks = Ranks()) -> torch.device:
    """The device of the policy above for `requested` (no side effects: nothing is initialised)."""
    name = AUTO if requested is None else requested
    if name == AUTO:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    choices = f"choose one of {list(DEVICE_CHOICES)}"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"device={requested!r} is not a device; {choices}") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device={requested!r}, but torch sees no GPU here (torch {torch.__version__}, {build}); "
                             f"use 'cpu', or 'auto' (the GPU when there is one)")
        count = torch.cuda.device_count()
        if ranks.world_size > 1:  # one GPU per process
            if ranks.local_rank >= count:
                raise ValueError(f"torchrun process LOCAL_RANK={ranks.local_rank} has no GPU: this machine has {count}; "
                                 f"start at most {count} processes per machine (--nproc_per_node)")
            return torch.device("cuda", ranks.local_rank)
        if (device.index or 0) >= count:
            raise ValueError(f"device={requested!r}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device={requested!r}, but MPS is not available here; use 'cpu' or 'auto'")
        return device
    if device.type != "cpu":
        raise ValueError(f"device={requested!r}: {device.type} is not supported; {choices}")
    return device


def setup_distributed(device: str | None = AUTO, timeout_s: float = DEFAULT_TIMEOUT_S) -> Distributed:
    """Resolve the device; under torchrun with more than one process, also set this process's GPU and
    join the process group (unless already joined), with `timeout_s` on every collective."""
    ranks = ranks_from_env()
    resolved = resolve_device(device, ranks)
    if ranks.world_size > 1:
        import torch.distributed as dist

        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
        if not dist.is_initialized():
            backend = "nccl" if resolved.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
            # Left to the interpreter's teardown, the group's threads may outlive it and abort the process
            # ("terminate called without an active exception", exit -6) after an error was already reported.
            atexit.register(leave_process_group)
            if ranks.is_main:
                print(f"blockgen: process group {backend}, {ranks.world_size} processes, timeout {timeout_s:g} s", flush=True)
    return Distributed(rank=ranks.rank, local_rank=ranks.local_rank, world_size=ranks.world_size,
                       launched=ranks.launched, device=resolved)


def leave_process_group() -> None:
    """Destroy the joined process group (nothing when none is joined): at exit, or earlier where every rank
    is known to be at the same point (after a barrier), so no rank tears its group down while a peer still
    sends to it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def decided_on_rank0(decide: Callable[[], T]) -> T:
    """`decide()` computed on rank 0 alone and broadcast to every rank of the joined process group (any
    picklable value); without a group, computed here. For answers read from files: ranks on machines
    without a shared file system would otherwise decide differently and wait in different collectives."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decide()
    box = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
