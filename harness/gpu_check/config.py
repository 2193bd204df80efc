"""What `blockgen gpu-check` runs, at what size and within what time: the stages in the order they run
(`STAGES`), each one's share of the budget, the sizes of the two modes (`GPU_SCALE`: the paper's model;
`CPU_SCALE`: micro, what CI runs), the command's options (`GpuCheckConfig`) and a stage's deadline
(`Budget`).

    blockgen gpu-check                      # cuda when there is one: paper size; else the same stages at micro size
    blockgen gpu-check --device cpu --stages train generate
    blockgen gpu-check --budget-s 900       # a longer check (default 480 s)

Time budget: the stages run in the order of `STAGES` under one budget (`budget_s`, default 480 s). Each
stage has a share of it (`STAGE_SHARES`, renormalised over the stages run) and its deadline is the end of
its share plus whatever the stages before it left unused. A stage looks at its deadline between its
runs and stops early there, never inside a measurement: it records `"truncated": why` and what it left
out (`"not_run"`). A subprocess (torchrun, `blockgen train`, `lm_eval`, the vLLM server's start-up) gets
the time left as its timeout; one that exceeds it is killed with its process group and the stage is an
error that says so. A truncated stage that measured something is not a failure; one that measured
nothing (it ran out of budget before its first measurement) fails the check on a GPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Literal

import torch

from blockgen.harness.costs.rates import gpu_check_rates
from blockgen.harness.evaluation.grids import GRIDS

STAGES = ("train", "ddp", "generate", "lm_eval", "scorers")  # the order they run in
# Each stage's share of the budget, sized from the H100 figures of docs/results.md (a training graph's first
# compilation 117 s, another shape 54 s; lm_eval 41 s; eager generate 22 s) and a vLLM CUDA server's
# start-up of about a minute (not measured there): training compiles two graphs per prior.
STAGE_SHARES = {"train": 0.40, "ddp": 0.08, "generate": 0.17, "lm_eval": 0.13, "scorers": 0.22}
DEFAULT_BUDGET_S = 480.0  # `make gpu-check` in under 8 minutes
# The OWT presets' mixture (harness/training/presets.py: VARIANTS["masked-mix"]): what full-scale training runs.
TRAIN_BLOCK_SIZES, TRAIN_BLOCK_WEIGHTS = (1, 16), (0.05, 0.95)
DDP_PRESET = "ci"  # the small preset the ddp stage trains over 2 processes (and lm_eval evaluates)


@dataclass(frozen=True)
class Scale:
    """Sizes of one mode: the paper's on a GPU, micro on a CPU (what CI runs)."""

    size: Literal["micro", "tiny", "paper"]
    seq_len: int
    vocab_size: int
    micro_batches: tuple[int, ...]
    steps: int  # timed steps per (prior, micro-batch), the block sizes in turn
    warmup_steps: int  # untimed steps first (compilation, allocator warm-up); at least one per block size
    compile: bool
    bf16: bool
    new_tokens: int  # generate(): tokens per row
    prompt_len: int
    generate_batches: tuple[int, ...]  # 1 and the sweep's batch (and 64 on a GPU)
    ddp_steps: int
    lm_eval_limit: int
    scorer_texts: int
    scorer_steps: int  # training steps of the small scorer compared (any weights do: both scorers load the same)


# GPU: micro-batch 32 only, the OWT presets' per-GPU micro-batch (what `blockgen train-cost` prices); each
# more micro-batch costs two more compilations per prior, which 8 minutes cannot hold (--micro-batches 8 32).
GPU_SCALE = Scale(size="paper", seq_len=1024, vocab_size=50_257, micro_batches=(32,), steps=12, warmup_steps=2,
                  compile=True, bf16=True, new_tokens=256, prompt_len=64, generate_batches=(1, GRIDS["owt"].batch_size, 64),
                  ddp_steps=20, lm_eval_limit=32, scorer_texts=256, scorer_steps=20)
CPU_SCALE = Scale(size="micro", seq_len=128, vocab_size=512, micro_batches=(2, 4), steps=2, warmup_steps=2,
                  compile=False, bf16=False, new_tokens=32, prompt_len=16, generate_batches=(1, GRIDS["owt-embedded"].batch_size),
                  ddp_steps=4, lm_eval_limit=4, scorer_texts=8, scorer_steps=2)


@dataclass(frozen=True)
class GpuCheckConfig:
    out_dir: str = str(gpu_check_rates().parent)  # runs/gpu-check: where `blockgen sweep` looks for rates.json
    device: str = "auto"  # auto: cuda if available (paper size), else cpu (micro size)
    stages: tuple[str, ...] = STAGES
    priors: tuple[str, ...] = ("masked", "uniform")
    micro_batches: tuple[int, ...] | None = None  # None: the mode's (GPU 32, CPU 2 and 4)
    steps: int | None = None  # timed training steps per run; None: the mode's
    compile: bool | None = None  # None: on GPU
    generate_batches: tuple[int, ...] | None = None  # None: the mode's (GPU 1, 32, 64; CPU 1, 8: the sweeps' batches)
    budget_s: float = DEFAULT_BUDGET_S  # the whole check's time budget (`STAGE_SHARES` split it)
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stages {unknown}; choose from {list(STAGES)}")
        bad = [p for p in self.priors if p not in ("masked", "uniform")]
        if bad:
            raise ValueError(f"unknown priors {bad}; choose from ['masked', 'uniform']")
        if not self.budget_s > 0:
            raise ValueError(f"budget_s={self.budget_s}; give the check's time budget in seconds (> 0)")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def scale(self) -> Scale:
        base = GPU_SCALE if self.resolved_device().startswith("cuda") else CPU_SCALE
        given = (("micro_batches", self.micro_batches), ("steps", self.steps), ("compile", self.compile),
                 ("generate_batches", self.generate_batches))
        return replace(base, **{k: v for k, v in given if v is not None})

    def shares(self) -> dict[str, float]:
        """The stages to run, in `STAGES` order, each with its fraction of the budget (summing to 1)."""
        run = [s for s in STAGES if s in self.stages]
        total = sum(STAGE_SHARES[s] for s in run)
        return {s: STAGE_SHARES[s] / total for s in run}


@dataclass(frozen=True)
class Budget:
    """A stage's deadline on the monotonic clock. `allows(expected_s)`: the next run (expected to take
    about `expected_s`) starts before the deadline and is expected to end by it."""

    deadline: float = math.inf

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, expected_s: float = 0.0) -> bool:
        return self.left() > expected_s


UNLIMITED = Budget()


def mark_truncated(result: dict, not_run: list[str], budget: Budget) -> dict:
    """Mark a stage that stopped at its deadline: why, and the runs it left out."""
    if not_run:
        result["truncated"] = (f"budget: {max(budget.left(), 0.0):.0f} s left before the stage's deadline, too little "
                               f"for its next run; {len(not_run)} runs not run")
        result["not_run"] = not_run
    return result
