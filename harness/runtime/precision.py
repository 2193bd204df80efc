"""Numerical precision of the network's matmuls: bf16 autocast and TF32, for training and evaluation.

Evaluation's ``dtype`` model argument takes lm-eval's `hf` backend's names ("auto", "float32",
"bfloat16"). The weights stay float32 and the matmuls run under autocast (what training's
``precision="bf16"`` does, and what `hf` calls ``mixed_precision_dtype``), because the network keeps
its LayerNorm and its output logits in float32 (models/backbone.py) and the bounds and posteriors
are computed from those in float32/float64 (models/diffusion.py, models/objectives.py): casting the
weights would put the LayerNorm weights and the time embedding in bf16 as well. The weights being
unchanged, a sweep can switch precision per setting on one loaded model.

TF32 (CUDA only) rounds float32 matmul inputs to 10 mantissa bits; the flags are process-wide, so
evaluation sets them only around its own model calls (`compute_precision`), leaving e.g. an
in-process scorer untouched; training sets them for the whole run (`enable_tf32`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# lm-eval's names (`hf`'s dtype). "auto" is the checkpoint's own dtype: float32 for every checkpoint
# this project writes or imports (EMA weights are saved in float32).
DTYPES: dict[str, torch.dtype] = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


def check_dtype(value: object) -> str:
    """A dtype name of `DTYPES` (also given as a torch.dtype); the error names the choices."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if not isinstance(value, str) or value not in DTYPES:
        raise ValueError(f"dtype={value!r}; choose one of {sorted(DTYPES)} (bfloat16: matmuls under autocast, "
                         "weights, LayerNorm, logits and the bounds stay float32/float64)")
    return value


def enable_tf32(enabled: bool = True) -> tuple[bool, bool]:
    """TF32 tensor cores for float32 matmuls and convolutions on CUDA, as the authors train (bf16
    autocast regions are unaffected; float32 outside them, e.g. the loss, gets 10-bit mantissas in
    matmuls only). Process-wide; returns the previous (matmul, cudnn) flags."""
    previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return previous


def cpu_kernels_have_avx512() -> bool:
    """Whether ATen runs its AVX-512 kernels. torch 2.13's CPU flash attention in bf16 packs its
    matrices with an AVX-512 routine whenever the hardware has AVX-512, and raises "pack_vnni2 is only
    supported when avx512 is supported" when ATen's kernels are not the AVX-512 ones
    (``ATEN_CPU_CAPABILITY=avx2`` or ``default`` on such a machine); bf16 attention then takes
    SDPA's math kernel (same result up to rounding)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@contextlib.contextmanager
def compute_precision(device: torch.device | str, dtype: str = "float32", tf32: bool = False) -> Iterator[None]:
    """Model calls inside run their matmuls in `dtype` (autocast; float32: no autocast at all, so the
    default is bit for bit the code without this context) and, with `tf32` on CUDA, with TF32 (the
    flags are restored on exit). bf16 on a CPU whose ATen kernels are not AVX-512 attends with SDPA's
    math kernel (`cpu_kernels_have_avx512`)."""
    device = torch.device(device)
    target = DTYPES[check_dtype(dtype)]
    autocast = (torch.autocast(device.type, dtype=target) if target != torch.float32 else contextlib.nullcontext())
    attention = (sdpa_kernel([SDPBackend.MATH]) if device.type == "cpu" and target == torch.bfloat16
                 and not cpu_kernels_have_avx512() else contextlib.nullcontext())
    previous = enable_tf32(True) if tf32 and device.type == "cuda" else None  # False: the process's flags, untouched
    try:
        with autocast, attention:
            yield
    finally:
        if previous is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
