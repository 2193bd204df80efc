"""The training loop: one process, or torchrun / torch.distributed (gloo on CPU, NCCL on CUDA).

Per optimizer step the global batch is split into D = world_size x grad_accum micro-batch slots of
`micro_batch` sequences (grad_accum = batch_size / (world_size x micro_batch)).
Each slot gets one block size by the stratified selection of Algorithm 1 (the same draw on every
rank, from the step's seed) and its slice of stratified diffusion times. AdamW with linear warm-up,
gradient clipping, an EMA of the weights (used for validation and saved in model.safetensors),
periodic validation with the log-sum-exp bound, and crash-safe checkpoints a restarted run resumes
from (two slots, `checkpoint` and `checkpoint.prev`: harness/checkpoints/checkpoint.py). SIGTERM or SIGUSR1 (what
SLURM sends before preemption or the time limit) stops the run at the next step boundary on every
rank with a checkpoint: `train` raises `TrainingStopped`, and the CLI exits with 128 + the signal's
number (143 for SIGTERM, 138 for SIGUSR1). `keep_steps`: copies kept at those steps, never overwritten.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from blockgen.harness.checkpoints.checkpoint import TRAINING_STATE, restore_latest_checkpoint, save_checkpoint
from blockgen.harness.data.sources import DataConfig, Examples, current_names
from blockgen.harness.runtime.distributed import DEFAULT_TIMEOUT_S, Distributed, ranks_from_env, resolve_device, setup_distributed
from blockgen.harness.runtime.precision import enable_tf32  # one home for TF32 (evaluation uses it too)
from blockgen.harness.data.prepare import ensure_prepared, load_prepared
from blockgen.harness.runtime.progress import Progress
from blockgen.harness.checkpoints.tokenizer import special_tokens
from blockgen.models.backbone import SIZES
from blockgen.models.diffusion import NELBO_CHUNK_TOKENS
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models.objectives import stratified_indices, stratified_times


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str = "runs/model"
    data: DataConfig = field(default_factory=DataConfig)
    prior: Literal["masked", "uniform"] = "masked"
    block_sizes: tuple[int, ...] = (16,)
    block_weights: tuple[float, ...] = (1.0,)
    causal_clean: bool = True
    # "blockgen": the [x0 ; xt] model (block size 1 included); "ar": the paper's AR baseline, a plain
    # causal transformer over the L tokens without adaLN (the authors' algo=ar; block_sizes (1,), masked).
    architecture: Literal["blockgen", "ar"] = "blockgen"
    size: Literal["micro", "tiny", "paper"] = "tiny"  # the network's shape: a name in backbone.SIZES
    seq_len: int = 128
    batch_size: int = 32  # global batch (sequences per optimizer step)
    # Sequences per process (GPU) in one forward/backward: what bounds memory. Gradient accumulation
    # follows from it: batch_size / (world_size x micro_batch) micro-batches per step. None: the
    # process's whole share of the batch at once (no accumulation).
    micro_batch: int | None = None
    lr: float = 1e-3
    warmup_steps: int = 50
    # After warm-up: constant, or cosine decay to 10 % of lr at max_steps (short runs end sharper).
    lr_schedule: Literal["constant", "cosine"] = "constant"
    max_steps: int = 1000
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    eval_every: int = 250
    k_mc: int = 8
    save_every: int = 250
    # Steps at which a copy of the checkpoint is kept as out_dir/checkpoint-step{N} (never overwritten),
    # e.g. (250_000,) for the paper's TinyGSM length inside a longer run.
    keep_steps: tuple[int, ...] = ()
    # When stderr is not a terminal (a cluster's log file): one progress line every this many steps
    # instead of tqdm's redrawn bar (harness/runtime/progress.py).
    log_every: int = 100
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu (distributed.py: the device policy)
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16 autocast (CUDA)
    # auto: SDPA's boolean mask on every device. Measured on an H200 (paper-size model, batch 8,
    # L = 1024, bf16): 0.094 s/step with SDPA, 0.113 s with compiled flex_attention, 0.660 s eager.
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    # Start from another checkpoint's weights (same tokenizer and shape; fresh optimizer and schedule),
    # e.g. a mixture warm-started from the AR model: the clean stream and the AR path are the same
    # computation, so what AR has learned (copying from the prompt) carries over. None: random init.
    init_from: str | None = None
    compile: bool = False  # torch.compile the training forward (one graph per block size, no break: `training_net`)
    peak_tflops: float | None = None  # the chip's dense bf16 peak for MFU; None: looked up by device name
    # Timeout of every collective (NCCL's own default is 10 minutes). Data preparation happens before
    # the process group exists (`prepare.ensure_prepared`), so this only bounds training's own waits.
    dist_timeout_s: int = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; choose one of {sorted(SIZES)}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision={self.precision!r}; choose 'fp32' or 'bf16'")
        if self.attention not in ("auto", "sdpa", "flex"):
            raise ValueError(f"attention={self.attention!r}; choose 'auto', 'sdpa' or 'flex'")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule={self.lr_schedule!r}; choose 'constant' or 'cosine'")
        if self.architecture not in ("blockgen", "ar"):
            raise ValueError(f"architecture={self.architecture!r}; choose 'blockgen' or 'ar'")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"micro_batch={self.micro_batch}; choose a positive number of sequences per GPU (or None)")
        if any(s < 1 for s in self.keep_steps) or len(set(self.keep_steps)) != len(self.keep_steps):
            raise ValueError(f"keep_steps={list(self.keep_steps)}; choose distinct optimizer steps >= 1 (--keep-steps 250000 500000)")

    def grad_accum(self, world: int) -> int:
        """Micro-batches per process per optimizer step: batch_size / (world x micro_batch)."""
        micro = self.micro_batch or self.batch_size // world
        if micro < 1 or self.batch_size % (world * micro):
            raise ValueError(
                f"batch_size={self.batch_size} (--batch-size / BATCH) is not divisible by world_size={world} (NGPU / NPROC) "
                f"x micro_batch={micro} (--micro-batch / MICRO_BATCH): the global batch must be world_size x micro_batch "
                f"x a whole number of accumulation steps"
            )
        return self.batch_size // (world * micro)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based): linear warm-up, then the schedule."""
        warm = min(1.0, (step + 1) / max(self.warmup_steps, 1))
        if self.lr_schedule == "constant" or step < self.warmup_steps:
            return self.lr * warm
        progress = (step - self.warmup_steps) / max(self.max_steps - self.warmup_steps, 1)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def model_config(self, vocab_size: int, special: dict, device: str) -> BlockGenConfig:
        attention = "sdpa" if self.attention == "auto" else self.attention
        return BlockGenConfig(
            vocab_size=vocab_size,
            seq_len=self.seq_len,
            prior=self.prior,
            block_sizes=tuple(self.block_sizes),
            block_weights=tuple(self.block_weights),
            causal_clean=self.causal_clean,
            attention=attention,
            special_tokens=special,
            architecture=self.architecture,
            adaln=self.architecture != "ar",
            shape=SIZES[self.size],
        )

    def to_dict(self) -> dict:
        return asdict(self)


# Settings a resumed run may change (e.g. extending the step budget); anything else must match.
# micro_batch too (a run resumed on smaller GPUs): it splits the same global batch into other slots,
# so the block-size and noise draws differ from the uninterrupted run's, the objective does not.
RESUMABLE_CHANGES = frozenset(
    {"init_from", "max_steps", "eval_every", "save_every", "device", "out_dir", "attention", "compile", "peak_tflops",
     "micro_batch", "dist_timeout_s", "keep_steps", "log_every"}
)


# ---------------------------------------------------------------------------------------------
# distributed plumbing


def all_reduce_sum(x: torch.Tensor, d: Distributed) -> torch.Tensor:
    if d.world_size > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


class MetricsLog:
    """Rank 0's record of every step: `metrics.jsonl` (one JSON object per line) and TensorBoard event
    files beside it in `tensorboard/` (the numeric fields as scalars, `train/...` and `val/...`). A resumed
    run first drops what a killed run logged after its last checkpoint: the lines (`keep_records_up_to`),
    and the events, hidden by TensorBoard's purge of the steps after it."""

    def __init__(self, out: Path, step: int, enabled: bool) -> None:
        self.path, self.board = out / "metrics.jsonl", None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where a run writes

        keep_records_up_to(self.path, step)
        self.board = SummaryWriter(str(out / "tensorboard"), purge_step=step + 1 if step else None)

    def write(self, record: dict) -> None:
        if self.board is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self.board.add_scalar(f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}", value, record["step"])

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def keep_dir(out_dir: str | Path, step: int) -> Path:
    """Where the copy kept at `step` (`keep_steps`) lives."""
    return Path(out_dir) / f"checkpoint-step{step}"


# ---------------------------------------------------------------------------------------------
# one run directory for every rank

RUN_TOKEN = ".run-token"  # rank 0's fresh token in the run directory, read back by every rank at start
SHARED_STORAGE = ("a run's directory (RUNS) and data cache must be on a file system every node shares (NFS, Lustre, "
                  "GPFS; not a node's local disk): docs/training.md, \"Multi-node\"")


class RunDirectoryMismatch(ValueError):
    """A rank sees another run directory than rank 0's: machines without a shared file system."""


def checkpoint_step(ckpt_dir: Path) -> int:
    """The step of the checkpoint at `ckpt_dir` (0: none)."""
    try:
        return int(json.loads((ckpt_dir / "config.json").read_text())["training"]["step"])
    except (OSError, KeyError, ValueError):
        return 0


def check_same_run_directory(out: Path, ckpt_dir: Path, d: Distributed) -> None:
    """Fail at start unless every rank sees rank 0's run directory: the token rank 0 has just written there
    and the same checkpoint step. A rank on a machine without the shared file system would otherwise
    start at step 0 while the others resume (two models, or a hang in mismatched collectives)."""
    if d.world_size == 1:
        return
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"{RUN_TOKEN}.tmp"
        tmp.write_text(os.urandom(16).hex())
        os.replace(tmp, out / RUN_TOKEN)
    dist.barrier()
    try:
        token = (out / RUN_TOKEN).read_text()
    except OSError:
        token = "(none)"
    seen = {"host": socket.gethostname(), "dir": str(out.resolve()), "token": token, "step": checkpoint_step(ckpt_dir)}
    everyone: list = [None] * d.world_size
    dist.all_gather_object(everyone, seen)
    reference = everyone[0]
    differ = [(rank, s) for rank, s in enumerate(everyone) if (s["token"], s["step"]) != (reference["token"], reference["step"])]
    if differ:
        lines = [f"rank {rank} on {s['host']} sees {s['dir']} with checkpoint step {s['step']} "
                 f"({'another run token' if s['token'] != '(none)' else 'no run token'})" for rank, s in differ[:4]]
        raise RunDirectoryMismatch(
            f"the ranks do not share one run directory: rank 0 on {reference['host']} sees {reference['dir']} with "
            f"checkpoint step {reference['step']}, but {'; '.join(lines)}{' ...' if len(differ) > 4 else ''}. "
            f"Training on several machines needs a shared file system: {SHARED_STORAGE}")


# ---------------------------------------------------------------------------------------------
# stopping on a signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # SLURM: preemption, `--signal=USR1@SECONDS` before the time limit


class TrainingStopped(Exception):
    """The run stopped on a signal after writing a checkpoint at `step`; rerunning the command resumes."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint {checkpoint} written; "
                         f"run the same command again to resume")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "ended by this signal"


@contextlib.contextmanager
def stop_requests():
    """While training: STOP_SIGNALS set a flag (a box holding the signal's number) instead of killing the
    process, so the loop can finish its step and save. The previous handlers come back afterwards."""
    box = [0]
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield box
        return

    def handler(signum, frame):
        box[0] = signum

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield box
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def agreed_stop(signum: int, d: Distributed) -> int:
    """The signal any rank received (0: none), the same on every rank: all must save and stop at the
    same step, or those still training wait in a collective for the ones that left."""
    if d.world_size == 1:
        return signum
    flag = torch.tensor([signum], device=d.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


# ---------------------------------------------------------------------------------------------
# training


class EMA:
    """Exponential moving average of the weights, with the usual warm-up (decay grows with steps)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone().float() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(decay).add_(v.float(), alpha=1 - decay)
            else:
                self.shadow[k].copy_(v)

    def copy_to(self, model: torch.nn.Module) -> None:
        model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in self.shadow.items()})


@torch.no_grad()
def warm_start(model: BlockGen, checkpoint: str | Path, tokenizer) -> None:
    """Copy a checkpoint's weights into `model`. The priors may differ: the masked prior's extra
    [MASK] row of the embedding and output layer is the only shape difference allowed (the rows
    of the real vocabulary are copied, a row only one side has keeps its initialisation).
    A released checkpoint (hf:jdeschena/blockgen/<subfolder> or its folder) is imported first."""
    from safetensors.torch import load_file

    from blockgen.harness.checkpoints.checkpoint import WEIGHTS, CheckpointError, read_config
    from blockgen.harness.checkpoints.release_import import resolve_with_tokenizer

    checkpoint = resolve_with_tokenizer(checkpoint, tokenizer)
    source = read_config(Path(checkpoint))
    if source.vocab_size != model.config.vocab_size or source.seq_len != model.config.seq_len:
        raise ValueError(f"init_from={checkpoint}: vocabulary {source.vocab_size} / seq_len {source.seq_len} "
                         f"differ from this run's {model.config.vocab_size} / {model.config.seq_len}")
    from transformers import PreTrainedTokenizerFast

    def real(vocab: dict) -> dict:  # ids past the real vocabulary (a release's added [PAD]) are no token of the model
        return {k: v for k, v in vocab.items() if v < source.vocab_size}

    if real(PreTrainedTokenizerFast.from_pretrained(str(checkpoint)).get_vocab()) != real(tokenizer.get_vocab()):
        raise ValueError(f"init_from={checkpoint} was trained with another tokenizer")
    weights = load_file(str(Path(checkpoint) / WEIGHTS))
    own = model.state_dict()
    if weights.keys() != own.keys():
        raise CheckpointError(f"init_from={checkpoint}: another architecture (parameters {sorted(weights.keys() ^ own.keys())[:5]})")
    vocab = model.config.vocab_size
    for name, target in own.items():
        value = weights[name]
        if value.shape == target.shape:
            target.copy_(value)
        elif value.shape[1:] == target.shape[1:] and {value.shape[0], target.shape[0]} == {vocab, vocab + 1}:
            target[:vocab].copy_(value[:vocab])
        else:
            raise CheckpointError(f"init_from={checkpoint}: {name} has shape {tuple(value.shape)}, this model {tuple(target.shape)}")


@torch.no_grad()
def validate(model: BlockGen, val: Examples, k_mc: int, batch_size: int, d: Distributed, seed: int) -> dict:
    """Token-level NLL (log-sum-exp and Jensen bounds) of the validation set; sharded over ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    gen = torch.Generator(device=d.device).manual_seed(seed)
    shard = val[d.rank :: d.world_size]
    for i in range(0, len(shard), batch_size):
        b = shard[i : i + batch_size]
        x, lm, cm = (t.to(d.device) for t in (b.tokens, b.loss_mask, b.condition_mask))
        lse, jensen = model.nll_bounds(x, lm.float(), k_mc, cm, gen)
        totals += torch.stack([lse.sum().cpu(), jensen.sum().cpu(), lm.sum().double().cpu()])
    totals = all_reduce_sum(totals.to(d.device), d).cpu()
    model.train()
    lse, jensen, tokens = totals.tolist()
    return {"val_nll_lse": lse / tokens, "val_nll_jensen": jensen / tokens, "val_ppl_lse": math.exp(lse / tokens), "val_tokens": int(tokens)}


def slot_seed(seed: int, step: int, slot: int) -> int:
    """Seed of the random draws (noise, dropout) of one micro-batch slot of one optimizer step."""
    return (seed * 1_000_003 + step) * 65_537 + slot


def keep_records_up_to(log_path: Path, step: int) -> None:
    """Drop metrics.jsonl records after `step` (logged by a run killed after its last checkpoint)."""
    if not log_path.is_file():
        return
    lines = log_path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        tmp = log_path.with_suffix(".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, log_path)


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


def training_net(
    model: BlockGen, distributed: bool, compile: bool, backend: str = "inductor"
) -> tuple[torch.nn.Module, torch.nn.parallel.DistributedDataParallel | None]:
    """(what the training step calls, the DDP wrapper or None). Distributed: calls go through DDP's
    __call__, so that backward all-reduces gradients.

    `compile`: the model is compiled inside DDP, not DDP around it. Compiling the DDP wrapper makes
    dynamo trace DDP's own forward, which breaks the graph (its logger, `_inside_ddp_forward`: 3
    breaks per process on CPU gloo); inside it, dynamo still splits the graph at DDP's gradient
    buckets (DDPOptimizer finds the active DDP module). `backend`: "eager" in tests (dynamo's capture,
    no code generation).
    """
    # static shapes: block_size is a Python int, one graph per block size
    net = torch.compile(model, dynamic=False, backend=backend) if compile else model
    ddp = torch.nn.parallel.DistributedDataParallel(net) if distributed else None
    return (net if ddp is None else ddp), ddp


@functools.lru_cache(maxsize=1)
def _epoch_permutation(n_examples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of an epoch, from (seed, epoch) alone: a resumed run draws the uninterrupted run's.
    Cached: drawn once per epoch (a full randperm takes 0.35-0.6 s at TinyGSM/OWT sizes), never per step."""
    return torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def _slot_batches(n_examples: int, step: int, batch: int, seed: int) -> torch.Tensor:
    """Global batch indices for a step: a fresh permutation per epoch (same on every rank)."""
    per_epoch = max(n_examples // batch, 1)
    epoch, offset = divmod(step, per_epoch)
    return _epoch_permutation(n_examples, seed, epoch)[offset * batch : (offset + 1) * batch]


def train(config: TrainConfig, progress: bool = True) -> Path:
    """Train (or resume) a model; returns the checkpoint directory."""
    # Settings that cannot run here fail now, before hours of data preparation and before out_dir exists.
    ranks = ranks_from_env()
    resolve_device(config.device, ranks)
    config.grad_accum(ranks.world_size)
    # The data cache first, before any process group: preparing it may take hours (`ensure_prepared`).
    prepared = ensure_prepared(config.data, config.seq_len)
    d = setup_distributed(config.device, config.dist_timeout_s)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    out = Path(config.out_dir)
    ckpt_dir = out / "checkpoint"
    # Every rank reads the prepared cache (memory-mapped) and the tokenizer saved with it: no hub access.
    tokenizer, train_data, val_data, data_info = load_prepared(prepared, config.data.n_val)
    special = special_tokens(tokenizer).to_dict()
    model_config = config.model_config(len(tokenizer), special, d.device)
    model = BlockGen(model_config).to(d.device)
    if d.is_main:  # the newest complete slot back at `checkpoint`, torn ones moved aside
        restore_latest_checkpoint(ckpt_dir)
    check_same_run_directory(out, ckpt_dir, d)  # (its barrier: every rank reads the restored slot)
    resuming = (ckpt_dir / TRAINING_STATE).is_file()
    if config.init_from is not None and not resuming:
        warm_start(model, config.init_from, tokenizer)
    ema = EMA(model, config.ema_decay)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.999), weight_decay=0.0)
    step = 0
    if resuming:
        state = torch.load(ckpt_dir / TRAINING_STATE, map_location=d.device, weights_only=False)
        # a setting added after the checkpoint was written had its default then
        saved = {**TrainConfig().to_dict(), **state["config"]}
        saved["data"] = current_names(saved["data"])  # renamed values ("embedded") in today's spelling
        changed = sorted(k for k, v in config.to_dict().items() if saved.get(k) != v and k not in RESUMABLE_CHANGES)
        if changed:
            raise ValueError(f"{ckpt_dir} was written with different {changed}; use another out_dir")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        ema.shadow = {k: v.to(d.device) for k, v in state["ema"].items()}
        step = state["step"]
        if d.is_main:
            print(f"resuming from step {step} of {ckpt_dir}", flush=True)
    net, ddp = training_net(model, d.world_size > 1, config.compile)

    grad_accum = config.grad_accum(d.world_size)
    slots = d.world_size * grad_accum
    micro = config.batch_size // slots
    bf16 = config.precision == "bf16" and d.device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    if d.device.type == "cuda":
        enable_tf32()
    if d.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{micro} sequences per process and micro-batch, {grad_accum} micro-batches per step; "
              + memory_estimate(model_config, n_params, micro, bf16, d.world_size).describe(), flush=True)
    flops_per_step = training_flops_per_step(model_config, config.batch_size)
    peak = peak_flops(str(d.device), config.peak_tflops)
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)  # only now: a run that failed before this leaves no empty folder
        (out / "train_config.json").write_text(json.dumps({**config.to_dict(), "data_info": data_info}, indent=2))
    metrics = MetricsLog(out, step, enabled=d.is_main)
    bar = Progress(out.name, total=config.max_steps, unit="steps", initial=step, enabled=progress and d.is_main,
                   every_steps=config.log_every, every_s=None)
    tokens_per_step = config.batch_size * config.seq_len  # the L tokens of each sequence, as bench/ counts them
    train_seconds, steps_timed, first_step = 0.0, 0, step + 1

    def ema_model() -> BlockGen:
        """A copy of the model holding the EMA weights (what validation and checkpoints use)."""
        copied = copy.deepcopy(model)
        ema.copy_to(copied)
        return copied

    def checkpoint(final: bool) -> None:
        if not d.is_main:
            return
        state = {
            "config": config.to_dict(),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "ema": ema.shadow,
            "step": step,
        }
        keep = keep_dir(out, step) if step in config.keep_steps else None
        save_checkpoint(ckpt_dir, ema_model(), tokenizer, state, extra={"step": step, "final": final, "data": data_info},
                        keep_previous=True, keep_copy=keep)

    model.train()
    with stop_requests() as signalled:
        while step < config.max_steps:
            step_start = time.perf_counter()
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
            u_block, u_time = torch.rand(2, generator=step_gen).tolist()
            block_idx = stratified_indices(model_config.block_weights, slots, u_block)
            times = stratified_times(config.batch_size, u_time, model.schedule)
            batch_idx = _slot_batches(len(train_data), step, config.batch_size, config.seed)
            loss_sum = torch.zeros((), device=d.device)
            for a in range(grad_accum):
                slot = d.rank * grad_accum + a
                sl = slice(slot * micro, (slot + 1) * micro)
                b = train_data[batch_idx[sl]]
                x, lm, cm = (t.to(d.device) for t in (b.tokens, b.loss_mask, b.condition_mask))
                block_size = model_config.block_sizes[block_idx[slot]]
                sync = contextlib.nullcontext() if ddp is None or a == grad_accum - 1 else ddp.no_sync()
                # Noise and dropout of a micro-batch derive from (seed, step, slot) alone: a resumed run
                # draws what the uninterrupted run drew, on every rank, with no RNG state to save.
                torch.manual_seed(slot_seed(config.seed, step, slot))
                with sync, autocast, names_the_knob(micro, grad_accum):
                    total, count = net(x, lm.float(), block_size, times[sl].to(d.device), cm)
                    loss = total / count.clamp_min(1)
                    (loss / grad_accum).backward()
                loss_sum += loss.detach() / grad_accum
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model, step)
            step += 1
            loss_val = all_reduce_sum(loss_sum, d).item() / d.world_size  # .item() waits for the device
            seconds = time.perf_counter() - step_start
            if step > first_step:  # a process's first step includes start-up (and compilation)
                train_seconds, steps_timed = train_seconds + seconds, steps_timed + 1
            record = {
                "step": step, "loss": loss_val, "lr": lr, "grad_norm": float(grad_norm),
                "block_sizes": [model_config.block_sizes[i] for i in block_idx],
                "step_seconds": seconds, "tokens_per_s": tokens_per_step / seconds,
                "mfu": None if peak is None else flops_per_step / seconds / (peak * d.world_size),
            }
            bar.update(1)
            if steps_timed:  # running means over the timed steps
                rate = tokens_per_step * steps_timed / train_seconds
                mfu = "" if peak is None else f"{flops_per_step * steps_timed / train_seconds / (peak * d.world_size):.1%}"
                bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{rate:.0f}", **({"mfu": mfu} if mfu else {}))
            if step % config.eval_every == 0 or step == config.max_steps:
                with names_the_knob(micro, grad_accum):
                    record.update(validate(ema_model(), val_data, config.k_mc, max(micro, 8), d, config.seed))
                if d.is_main:
                    bar.write(f"step {step}: val NLL/token {record['val_nll_lse']:.4f} (LSE) {record['val_nll_jensen']:.4f} (Jensen)")
            metrics.write(record)
            saved = step % config.save_every == 0 or step == config.max_steps or step in config.keep_steps
            if saved:
                checkpoint(final=step == config.max_steps)
            signum = agreed_stop(signalled[0], d)
            if signum and step < config.max_steps:
                if not saved:
                    checkpoint(final=False)
                bar.close()
                metrics.close()
                stopped = TrainingStopped(signum, step, ckpt_dir)
                if d.is_main:  # said before any rank exits: torchrun stops the others when the first one does
                    print(f"blockgen train: {stopped}", file=sys.stderr, flush=True)
                if d.world_size > 1:
                    dist.barrier()  # no rank leaves before rank 0 has saved
                raise stopped
    bar.close()
    metrics.close()
    if d.world_size > 1:
        dist.barrier()
    return ckpt_dir
