"""Measuring on a device, for every stage that times runs: wait for the queued kernels before reading the
clock, free memory between runs, the median of repeated runs, and TF32 off as the sweep runs."""

from __future__ import annotations

import contextlib
import gc

import torch


def sync(device: str) -> None:
    """Wait for queued kernels, so that wall-clock times cover the work (CUDA runs asynchronously)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]  # robust to a stray slow step


@contextlib.contextmanager
def sweep_tf32(device: str):
    """TF32 off, as the sweep runs by default (training turned it on for the whole process), restored after."""
    from blockgen.harness.runtime.precision import enable_tf32

    previous = enable_tf32(False) if device.startswith("cuda") else None
    try:
        yield
    finally:
        if previous is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
