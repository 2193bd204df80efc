"""What a training step takes: its model FLOPs (for MFU, and costs/train_cost.py's estimates), the
chip's peak they are divided by, and the memory per process (the estimate printed at start, and the
out-of-memory error that names the setting to lower).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from blockgen.models.diffusion import NELBO_CHUNK_TOKENS
from blockgen.models.model import BlockGenConfig


# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) from NVIDIA's data sheets, matched
# against torch.cuda.get_device_name(); the longest matching key wins ("H100 PCIe" before "H100").
PEAK_BF16_TFLOPS = {
    "H200": 989.0, "H100": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0,
    "A100": 312.0, "L40S": 362.0, "L4": 121.0,
}


def peak_flops(device: str, override_tflops: float | None = None) -> float | None:
    """The chip's peak FLOP/s for MFU: the override, else the table above, else None (CPU, unknown)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    matches = [key for key in PEAK_BF16_TFLOPS if key in name]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] * 1e12 if matches else None


def network_tokens(config: BlockGenConfig) -> int:
    """Tokens one training sequence puts through the network: 2L (`[x0 ; xt]`), L for the plain AR."""
    return config.seq_len if config.architecture == "ar" else 2 * config.seq_len


def training_flops_per_step(config: BlockGenConfig, batch_size: int) -> float:
    """Model FLOPs of one optimizer step: 3x the forward matmuls (forward + backward).

    Each sequence puts N = 2L tokens (`[x0 ; xt]`; the plain AR baseline: N = L) through n_layers
    blocks of width d:
      weights      2 N * 12 d^2 per layer (qkv 3d^2, output d^2, MLP 8d^2)
      attention    2 * 2 N^2 d per layer (scores and values over all N keys, as SDPA computes them)
      output head  2 L d V (noisy half only)
    Embedding lookups, norms, adaLN (once per sequence) and softmax are left out.
    """
    n, d, L = network_tokens(config), config.shape.d_model, config.seq_len
    vocab = config.backbone().vocab_size
    forward = config.shape.n_layers * (2 * n * 12 * d * d + 4 * n * n * d) + 2 * L * d * vocab
    return 3.0 * forward * batch_size


# Activation elements autograd keeps per layer, per token through the network (`network_tokens`), per
# unit of width d: measured 24.3-25.8 with torch.autograd.graph.saved_tensors_hooks on CPU (fp32, eager,
# dropout 0; tests/test_memory.py pins it), about 20 without adaLN (the plain AR baseline); dropout adds
# two boolean masks. SDPA's fused kernels (CPU flash, CUDA memory-efficient) keep no N x N attention
# matrix. Bytes per element: 4 in fp32; 2.5 under bf16 autocast (matmul inputs in bf16, LayerNorm
# inputs and the residual stream in fp32) is inferred from the 56.5 GB eager peak measured on an H200
# at 32 x 1,024 (reference H200 measurements, docs/training.md), not measured here.
ACTIVATION_ELEMENTS_PER_LAYER = {True: 25.0, False: 20.0}  # by adaLN
GB = 1e9


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process at the start of training (eager; torch.compile measured ~9 % lower on an H200)."""

    weights: float
    gradients: float
    optimizer: float  # AdamW's two moments
    ema: float
    other_states: float  # DDP gradient buckets, bf16 weight copies under autocast
    activations: float  # kept for backward by one micro-batch: the layers and the float32 logits
    backward_transient: float  # the logits' gradient (and its bf16 copy), alive at the start of backward
    micro_batch: int

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.ema + self.other_states + self.activations + self.backward_transient

    def describe(self) -> str:
        def size(n: float) -> str:
            return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"

        return (
            f"memory estimate per process (derived, eager): weights {size(self.weights)}, gradients {size(self.gradients)}, "
            f"AdamW {size(self.optimizer)}, EMA {size(self.ema)}, other {size(self.other_states)}, "
            f"activations {size(self.activations)} per micro-batch of {self.micro_batch} "
            f"(+{size(self.backward_transient)} in backward): about {size(self.total)} in all; "
            f"lower it with --micro-batch / MICRO_BATCH"
        )


def memory_estimate(config: BlockGenConfig, n_params: int, micro_batch: int, bf16: bool, world: int) -> MemoryEstimate:
    """The terms of `MemoryEstimate` from the model's shape (formula in the comment above)."""
    tokens = network_tokens(config)
    vocab = config.backbone().vocab_size
    per_element = 2.5 if bf16 else 4.0
    shape = config.shape
    per_layer = ACTIVATION_ELEMENTS_PER_LAYER[config.adaln] + (0.5 if shape.dropout > 0 else 0.0)  # bool masks: 1 byte
    layers = micro_batch * shape.n_layers * tokens * shape.d_model * per_layer * per_element
    logits = micro_batch * config.seq_len * vocab * 4.0  # float32, kept by the loss's logsumexp / log_softmax
    return MemoryEstimate(
        weights=4.0 * n_params,
        gradients=4.0 * n_params,
        optimizer=8.0 * n_params,
        ema=4.0 * n_params,
        other_states=(4.0 * n_params if world > 1 else 0.0) + (2.0 * n_params if bf16 else 0.0),
        activations=layers + logits,
        # the uniform prior's float64 NELBO chunk, recomputed in backward: about 6 (chunk, V) float64 tensors
        backward_transient=logits * (1.5 if bf16 else 1.0) + (6 * 8.0 * NELBO_CHUNK_TOKENS * vocab if config.prior == "uniform" else 0.0),
        micro_batch=micro_batch,
    )


@contextlib.contextmanager
def names_the_knob(micro: int, grad_accum: int):
    """Re-raise an out-of-memory error with the setting that fixes it."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        raise torch.OutOfMemoryError(
            f"out of memory at {micro} sequences per process and micro-batch ({grad_accum} micro-batches per step): "
            f"lower --micro-batch (Makefile: MICRO_BATCH), e.g. to {max(micro // 2, 1)}; the global batch and the "
            f"results stay the same, gradient accumulation grows. ({err})"
        ) from err
