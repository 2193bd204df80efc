"""The settings of a training run (`TrainConfig`), and what follows from them: the gradient
accumulation per process, the learning rate of a step, and the model's configuration.

Its own module so that what only reads settings (presets, the CLI, the demo, cost estimates) does not
import the training loop (`train`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from blockgen.harness.runtime.flags import require_whole_numbers
from blockgen.harness.data.sources import DataConfig
from blockgen.harness.runtime.distributed import DEFAULT_TIMEOUT_S
from blockgen.models.backbone import SIZES
from blockgen.models.model import BlockGenConfig


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
    # AdamW's second-moment decay (beta1 0.9, no weight decay). 0.999 as the authors' code; the demo's tiny
    # models use 0.95: their plateau before they copy from their context ended sooner in four seeds of five
    # (docs/results.md, "Why a word-problem seed trains worse").
    adam_beta2: float = 0.999
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
        if not 0.0 <= self.adam_beta2 < 1.0:
            raise ValueError(f"adam_beta2={self.adam_beta2}; choose a decay in [0, 1)")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"micro_batch={self.micro_batch}; choose a positive number of sequences per GPU (or None)")
        require_whole_numbers(self, "max_steps", "batch_size", "seq_len", "k_mc", "eval_every", "save_every", "log_every",
                              "dist_timeout_s")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} (--warmup-steps); choose 0 (no warm-up) or more")
        if not self.grad_clip > 0:
            raise ValueError(f"grad_clip={self.grad_clip} (--grad-clip); choose a norm > 0 (clipping is always on: a large "
                             f"value such as 1e9 leaves the gradients as they are)")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay={self.ema_decay} (--ema-decay); choose a decay in [0, 1)")
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
