"""`blockgen gpu-check` (`make gpu-check`): what a user with one GPU runs first, in under 8 minutes, one
JSON summary and one table.

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

Stages (each one's failure is recorded in the summary and the others still run):
- train: the training step of `blockgen train` (`training_net`: the compiled model, bf16 autocast,
  AdamW, clipping, EMA) on random tokens, per prior and micro-batch, on the OWT presets' block-size mixture
  (1, 16) with weights (0.05, 0.95): the block size alternates step by step, as it changes from step to
  step in training, so both graphs are compiled (warm-up) and timed. One model and one compiled network
  per prior serve all its micro-batches (dynamo is reset between priors only); `warmup_seconds` per prior
  holds its compilation. Per run: s/step per block size and their mixture-weighted mean, tokens/s, MFU,
  peak memory beside the start-up estimate of harness/training/flops_memory.py. Random tokens: the cost of a step does
  not depend on the text, and the check needs neither the hub nor a prepared corpus. GPU: the paper's
  model (12 x 768) at L = 1,024 with GPT-2's vocabulary size, micro-batch 32 (the OWT presets'); CPU: the
  micro model. Then, per run, the likelihood pass the sweep's owt_ppl makes (one NELBO draw at block size
  16 over [x0 ; xt], eager, no gradients) in the precision the sweep scores likelihoods in at that size
  (bf16 on the GPU, float32 on the CPU), TF32 off: `likelihood_pass_s` and `likelihood_seqs_per_s`.
- ddp: with 2 or more GPUs, `torchrun --standalone --nproc_per_node=2 -m blockgen.harness.cli train
  --preset ci` for 20 steps over NCCL; on a CPU the same command with 2 gloo processes and 4 steps; with
  one GPU it is skipped with the reason (not a failure: it does not apply). s/step and tokens/s (both
  processes) from the run's metrics.jsonl, the first step (start-up) left out. Not timed as a rate: the
  ci preset is a micro model, so the stage checks the launcher, the process group and the collectives.
- generate: `generate()` tokens/s and ms per model call for AR greedy (the plain AR baseline), ARPC and
  ancestral (a BlockGen mixture of block sizes 1 and 16) with random weights, at batch 1, at the sweep's
  batch (`Grid.batch_size`: 32 on the full-scale grids, 8 on the offline ones) and, on a GPU, at 64; no
  EOS, so every row makes all its tokens; float32 with TF32 off, the sweep's default. GPU: AR greedy and ARPC also with
  `compile=True` (the calls compiled and replayed as CUDA graphs), side by side with eager runs made just
  before (`graphs`: ms per call, tokens/s, speed-up, compile time, rows whose tokens match eager). CPU:
  not measured (compiling takes minutes there, and a CPU has no CUDA graphs).
- lm_eval: a small model trained by the real `blockgen train` (preset `ci`) on this device (the ddp
  stage's checkpoint when it ran in this check), then `lm_eval --model blockgen --device DEVICE --tasks
  gsm8k_code_embedded` on it (the score of a model this small is near 0: the stage checks the path, not
  the accuracy).
- scorers: the vLLM scorer against the transformers scorer on the same texts (the offline GPT-2 of
  `blockgen train-scorer`): Gen PPL of each, their relative difference, tokens/s, the server's start-up.
  On a CPU it is skipped, with the reason, when no vLLM environment is found (`make vllm-env`,
  $BLOCKGEN_VLLM_PYTHON). On CUDA a missing vLLM environment or a CPU build of vLLM fails the stage, with
  the fix (`vllm_server.CUDA_VLLM_FIX`): GPT-2 Large would be scored on the CPU, which is no check of the GPU;
  and any stage that skipped itself fails the check (`stage_failed`), except ddp on one GPU. Not yet done:
  running one `owt_genppl` setting through `blockgen sweep` with the scorer beside the model
  (docs/training.md, TODO).

The summary is printed as JSON and written to OUT_DIR/summary.json (`budget`: the budget, each stage's
share and the seconds it used), and `summary_table` (stage, status ok / failed / skipped / truncated,
seconds, share, key figure) goes to stderr; `ok` is true only when every stage that applies passed
(`failed` names the others; the command prints each with its fix and exits 1). The rates it measured
(generate's seconds per call, train's seconds per likelihood pass and tokens/s, each with the precision it
ran in) go to OUT_DIR/rates.json (harness/costs/rates.py), which `blockgen sweep GRID --dry-run` and `blockgen
train-cost` price full-scale runs with when it was measured at the paper's size.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Literal

import torch

from blockgen.harness.evaluation.grids import GRIDS
from blockgen.harness.costs.rates import (
    RATES_FILE,
    RATES_VERSION,
    CallRate,
    PassRate,
    Provenance,
    Rates,
    TrainRate,
    gpu_check_rates,
    precision_label,
    write_rates,
)

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


def _truncated(result: dict, not_run: list[str], budget: Budget) -> dict:
    """Mark a stage that stopped at its deadline: why, and the runs it left out."""
    if not_run:
        result["truncated"] = (f"budget: {max(budget.left(), 0.0):.0f} s left before the stage's deadline, too little "
                               f"for its next run; {len(not_run)} runs not run")
        result["not_run"] = not_run
    return result


def _sync(device: str) -> None:
    """Wait for queued kernels, so that wall-clock times cover the work (CUDA runs asynchronously)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- stages


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]  # robust to a stray slow step


def training_precision(device: str, scale: Scale) -> str:
    """The train stage's precision as rates files name it: bf16 autocast with TF32 on (as `blockgen train`
    on a GPU), float32 on a CPU."""
    cuda = device.startswith("cuda")
    return precision_label("bfloat16" if scale.bf16 and cuda else "float32", tf32=cuda)


class _PriorTrainer:
    """One prior's model, AdamW, EMA and network (`training_net`: compiled, as `blockgen train --compile`),
    shared by all its micro-batch runs: compiled once per prior, a new micro-batch only adds its shapes."""

    def __init__(self, config: GpuCheckConfig, device: str, scale: Scale, prior: str) -> None:
        from blockgen.harness.training.train import EMA, training_net
        from blockgen.harness.training.train_config import TrainConfig
        from blockgen.models.model import BlockGen

        self.device, self.scale, self.seed = device, scale, config.seed
        train_config = TrainConfig(prior=prior, block_sizes=TRAIN_BLOCK_SIZES, block_weights=TRAIN_BLOCK_WEIGHTS, size=scale.size,
                                   seq_len=scale.seq_len, precision="bf16" if scale.bf16 else "fp32", compile=scale.compile)
        self.model_config = train_config.model_config(scale.vocab_size, {}, device)
        torch.manual_seed(config.seed)
        self.model = BlockGen(self.model_config).to(device).train()
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.0)
        self.ema = EMA(self.model, 0.9999)
        self.net, _ = training_net(self.model, distributed=False, compile=scale.compile)
        self.step = 0  # across runs: the EMA's step count

    def run(self, micro: int, peak: float | None) -> dict:
        """Warm-up steps (each block size's graph compiled for this shape), then timed steps, the block size
        alternating; then the likelihood passes on the same batch. Its tensors are freed when it returns."""
        from blockgen.harness.training.flops_memory import memory_estimate, training_flops_per_step
        from blockgen.models.objectives import stratified_times

        device, scale, model = self.device, self.scale, self.model
        cuda = device.startswith("cuda")
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if scale.bf16 and cuda else contextlib.nullcontext()
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randint(0, scale.vocab_size, (micro, scale.seq_len), generator=gen).to(device)
        loss_mask = torch.ones(micro, scale.seq_len, device=device)
        t = stratified_times(micro, 0.5, model.schedule).to(device)
        sizes = TRAIN_BLOCK_SIZES
        warmup, timed = max(scale.warmup_steps, len(sizes)), max(scale.steps, len(sizes))  # every block size both
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        seconds: dict[int, list[float]] = {b: [] for b in sizes}
        loss, warmup_seconds = float("nan"), 0.0
        begin = time.perf_counter()
        try:
            for i in range(warmup + timed):
                block = sizes[i % len(sizes)]
                _sync(device)
                start = time.perf_counter()
                with autocast:
                    total, count = self.net(x, loss_mask, block, t)
                    (total / count.clamp_min(1)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.ema.update(model, self.step)
                self.step += 1
                _sync(device)
                if i >= warmup:
                    seconds[block].append(time.perf_counter() - start)
                elif i == warmup - 1:
                    warmup_seconds = time.perf_counter() - begin  # includes compilation of this shape
                loss = float((total / count.clamp_min(1)).detach())
        finally:
            self.optimizer.zero_grad(set_to_none=True)  # a failed step (out of memory) leaves no gradients behind
        by_block = {b: _median(s) for b, s in seconds.items()}
        s_step = sum(w * by_block[b] for b, w in zip(sizes, TRAIN_BLOCK_WEIGHTS))  # the mixture's expected step
        result = {
            "params": self.n_params, "warmup_seconds": warmup_seconds, "steps": timed, "s_per_step": s_step,
            "s_per_step_by_block": {str(b): s for b, s in by_block.items()}, "tokens_per_s": micro * scale.seq_len / s_step,
            "mfu": None if peak is None else training_flops_per_step(self.model_config, micro) / s_step / peak,
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
            "estimate_gb": memory_estimate(self.model_config, self.n_params, micro, scale.bf16 and cuda, 1).total / 1e9, "loss": loss,
        }
        try:
            model.eval()
            passed = _likelihood_pass_seconds(model, x, loss_mask, device, likelihood_dtype(device, scale), scale)
            result.update(likelihood_pass_s=passed, likelihood_seqs_per_s=micro / passed)
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: the training figures above still stand
            result["error"] = f"likelihood pass: {type(err).__name__}: {str(err)[:500]}"
        finally:
            model.train()
        return result


def likelihood_dtype(device: str, scale: Scale) -> str:
    """The precision the sweep scores likelihoods in at this scale: bf16 at paper size on a GPU (the full-scale
    grids' default), float32 otherwise (the offline grids')."""
    return "bfloat16" if scale.bf16 and device.startswith("cuda") else "float32"


@contextlib.contextmanager
def _sweep_tf32(device: str):
    """TF32 off, as the sweep runs by default (training turned it on for the whole process), restored after."""
    from blockgen.harness.runtime.precision import enable_tf32

    previous = enable_tf32(False) if device.startswith("cuda") else None
    try:
        yield
    finally:
        if previous is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def _likelihood_pass_seconds(model, x: torch.Tensor, loss_mask: torch.Tensor, device: str, dtype: str, scale: Scale) -> float:
    """Median seconds of one batched likelihood pass as the sweep's owt_ppl makes them (`score_windows`:
    one NELBO draw at block size 16 over [x0 ; xt], eager, no gradients, per-row streams), in `dtype`."""
    from blockgen.harness.runtime.precision import compute_precision
    from blockgen.models.diffusion import RowStreams

    seconds = []
    with torch.no_grad(), _sweep_tf32(device), compute_precision(device, dtype):
        for i in range(scale.warmup_steps + scale.steps):
            streams = RowStreams(list(range(x.shape[0])))
            _sync(device)
            start = time.perf_counter()
            model.sequence_nll_draws(x, loss_mask, 16, 1, generator=streams)
            _sync(device)
            if i >= scale.warmup_steps:
                seconds.append(time.perf_counter() - start)
    return _median(seconds)


def stage_train(config: GpuCheckConfig, device: str, scale: Scale, out: Path, budget: Budget = UNLIMITED) -> dict:
    from blockgen.harness.runtime.precision import enable_tf32
    from blockgen.harness.training.flops_memory import peak_flops

    if device.startswith("cuda"):
        enable_tf32()
    peak = peak_flops(device)
    runs: list[dict] = []
    not_run: list[str] = []
    warmup: dict[str, float] = {}
    expected: dict[int, float] = {}  # seconds of the last run per micro-batch (a prior's first includes its compilation)
    for prior in config.priors:
        trainer = None
        for micro in scale.micro_batches:
            if not budget.allows(expected.get(micro, 0.0)):
                not_run.append(f"{prior} x {micro}")
                continue
            start = time.monotonic()
            run: dict = {"prior": prior, "micro_batch": micro, "seq_len": scale.seq_len, "block_sizes": list(TRAIN_BLOCK_SIZES)}
            try:
                trainer = trainer or _PriorTrainer(config, device, scale, prior)
                run.update(trainer.run(micro, peak))
            except Exception as err:  # noqa: BLE001 - an out-of-memory run is a finding, not the end of the check
                run["error"] = f"{type(err).__name__}: {str(err)[:500]}"
            runs.append(run)
            expected[micro] = time.monotonic() - start
            warmup[prior] = warmup.get(prior, 0.0) + run.get("warmup_seconds", 0.0)
            _free(device)
        del trainer
        if scale.compile:
            torch._dynamo.reset()  # between priors only: the next prior compiles its own model
        _free(device)
    result = {"compile": scale.compile, "bf16": scale.bf16 and device.startswith("cuda"), "precision": training_precision(device, scale),
              "size": scale.size, "vocab_size": scale.vocab_size, "block_sizes": list(TRAIN_BLOCK_SIZES),
              "block_weights": list(TRAIN_BLOCK_WEIGHTS), "peak_tflops": None if peak is None else peak / 1e12,
              "likelihood_precision": likelihood_dtype(device, scale), "warmup_seconds": warmup, "runs": runs}
    return _truncated(result, not_run, budget)


GRAPH_SAMPLERS = ("ar_greedy", "arpc")  # the samplers timed with compile=True as well (GPU)


def _timed_generate(model, prompts: list[list[int]], sampler_config, device: str, compile: bool = False):
    """(result, seconds) of one `generate` call; no EOS (-1), so every row makes all its tokens."""
    from blockgen.models.sampling import generate

    _sync(device)
    start = time.perf_counter()
    result = generate(model, prompts, sampler_config, eos_id=-1, pad_id=0, compile=compile)
    _sync(device)
    return result, time.perf_counter() - start


def _graph_run(model, prompts: list[list[int]], sampler_config, device: str) -> dict:
    """Eager against compile=True (CUDA graphs) on the same prompts: the first compiled run compiles
    and records the graphs (`compile_seconds`, generation included); the next one is timed, after a
    warm eager run."""
    eager, eager_s = _timed_generate(model, prompts, sampler_config, device)
    _, compile_s = _timed_generate(model, prompts, sampler_config, device, compile=True)
    compiled, compiled_s = _timed_generate(model, prompts, sampler_config, device, compile=True)
    tokens = sum(len(t) for t in eager.tokens)
    return {
        "model_calls": eager.model_calls, "compile_seconds": compile_s,
        "eager_ms_per_call": eager_s / eager.model_calls * 1e3, "compiled_ms_per_call": compiled_s / compiled.model_calls * 1e3,
        "eager_tokens_per_s": tokens / eager_s, "compiled_tokens_per_s": tokens / compiled_s, "speedup": eager_s / compiled_s,
        "rows_same_tokens": sum(a == b for a, b in zip(eager.tokens, compiled.tokens)),
    }


def _row_streams_match(device: str) -> bool:
    """The sampler's random words on `device` are those of the CPU, bit for bit (exact int64 arithmetic)."""
    from blockgen.models.diffusion import RowStreams

    seeds = [0, 1, 2**62 + 3, -5]
    on_device = RowStreams(seeds).bits((len(seeds), 64, 16), device).cpu()
    return bool(torch.equal(on_device, RowStreams(seeds).bits((len(seeds), 64, 16))))


def stage_generate(config: GpuCheckConfig, device: str, scale: Scale, out: Path, budget: Budget = UNLIMITED) -> dict:
    from blockgen.harness.training.train_config import TrainConfig
    from blockgen.models.model import BlockGen
    from blockgen.models.sampling import SamplerConfig

    cuda = device.startswith("cuda")
    base = TrainConfig(size=scale.size, seq_len=scale.seq_len)
    models = {  # (train config, block size of its sampler's calls)
        "ar": (replace(base, block_sizes=(1,), block_weights=(1.0,), architecture="ar"), 1),
        "mixture": (replace(base, block_sizes=TRAIN_BLOCK_SIZES, block_weights=TRAIN_BLOCK_WEIGHTS), 16),
    }
    samplers = {  # (model, sampler): the OWT grids' settings (Makefile)
        "ar_greedy": ("ar", SamplerConfig("ar_greedy")),
        "arpc": ("mixture", SamplerConfig("arpc", steps=6, ge=3, warmup=0)),
        "ancestral": ("mixture", SamplerConfig("ancestral", steps=16)),
    }
    built = {}
    for name, (train_config, _) in models.items():
        torch.manual_seed(config.seed)
        built[name] = BlockGen(train_config.model_config(scale.vocab_size, {}, device)).to(device).eval()
    rows, graph_rows, not_run = [], [], []
    batches = config.generate_batches or scale.generate_batches  # a caller's own scale still takes the config's batches
    graph_batches = (min(batches), max(batches))
    gen = torch.Generator().manual_seed(config.seed)
    with _sweep_tf32(device):  # float32 without TF32: what the sweep's generation runs by default
        for sampler, (model_name, sampler_config) in samplers.items():
            for batch in batches:
                if not budget.allows():
                    not_run.append(f"{sampler} batch {batch}")
                    continue
                row: dict = {"sampler": sampler, "model": model_name, "block_size": models[model_name][1], "batch": batch,
                             "new_tokens": scale.new_tokens}
                rows.append(row)
                try:
                    prompts = torch.randint(0, scale.vocab_size, (batch, scale.prompt_len), generator=gen).tolist()
                    sampler_config = replace(sampler_config, max_new_tokens=scale.new_tokens)
                    result, seconds = _timed_generate(built[model_name], prompts, sampler_config, device)
                    tokens = sum(len(t) for t in result.tokens)
                    row.update(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, model_calls=result.model_calls,
                               ms_per_call=seconds / result.model_calls * 1e3, paper_nfe_per_block=result.paper_nfe_per_block)
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {str(err)[:500]}"
                    continue
                if cuda and sampler in GRAPH_SAMPLERS and batch in graph_batches:
                    if not budget.allows():
                        not_run.append(f"{sampler} batch {batch} compile=True")
                        continue
                    graph_row: dict = {"sampler": sampler, "batch": batch}
                    graph_rows.append(graph_row)
                    try:
                        graph_row.update(_graph_run(built[model_name], prompts, sampler_config, device))
                    except Exception as err:  # noqa: BLE001 - a failing compile is a finding: the row says so
                        graph_row["error"] = row["error"] = f"compile=True: {type(err).__name__}: {str(err)[:500]}"
    if cuda:
        graphs: dict = {"measured": True, "mode": "reduce-overhead (CUDA graphs)", "runs": graph_rows}
        torch._dynamo.reset()  # the graphs and their memory pools go with the models
    else:
        graphs = {"measured": False, "why": "CPU mode: generate(compile=True) is not timed (compiling takes minutes on "
                  "a CPU, which has no CUDA graphs); `make gpu-check` on a GPU measures it"}
    del built
    _free(device)
    result = {"size": scale.size, "prompt_len": scale.prompt_len, "precision": "float32", "runs": rows, "graphs": graphs}
    if cuda:
        result["row_streams_same_as_cpu"] = _row_streams_match(device)
        if not result["row_streams_same_as_cpu"]:
            result["error"] = "the samplers' random words (RowStreams) on the GPU differ from the CPU's"
    return _truncated(result, not_run, budget)


def _bin(name: str) -> str:
    """A console script of this environment (lm_eval, blockgen, torchrun), next to the running interpreter."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


class StageTimeout(RuntimeError):
    """A subprocess that ran past its stage's deadline (killed, with its process group)."""


def _run(cmd: list[str], log: Path, budget: Budget = UNLIMITED) -> float:
    """Run a command with its output in `log`, within the stage's deadline; raise with the log's tail when it
    fails, `StageTimeout` when it runs past the deadline. Returns seconds."""
    timeout = budget.left()
    if timeout <= 0:
        raise StageTimeout(f"`{' '.join(cmd[:4])} ...` not started: the stage's budget share was spent")
    start = time.perf_counter()
    with open(log, "w") as f:
        # its own session: on a timeout the whole group goes (torchrun's workers, lm_eval's children)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=None if math.isinf(timeout) else timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise StageTimeout(f"`{' '.join(cmd[:4])} ...` ran past the stage's deadline ({timeout:.0f} s left when it "
                               f"started; --budget-s gives the check more time); killed; log {log}") from None
        except BaseException:  # e.g. Ctrl-C: no orphaned workers
            _kill_group(proc)
            raise
    if code != 0:
        tail = log.read_text()[-1500:]
        raise RuntimeError(f"`{' '.join(cmd[:4])} ...` exited with {code}; log {log}:\n{tail}")
    return time.perf_counter() - start


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group this check started, SIGKILL after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _train_cmd(device: str, out_dir: Path, data_dir: Path, steps: int | None = None) -> list[str]:
    """`blockgen train --preset ci` on this device (bf16 on CUDA), the arguments after the launcher."""
    cmd = ["train", "--preset", DDP_PRESET, "--out-dir", str(out_dir), "--device", device, "--data.cache-dir", str(data_dir)]
    if steps is not None:  # one checkpoint and one validation, at the end
        cmd += ["--max-steps", str(steps), "--save-every", str(steps), "--eval-every", str(steps)]
    if device.startswith("cuda"):
        cmd += ["--precision", "bf16"]
    return cmd


def _ddp_checkpoint(out: Path) -> Path:
    return out / "ddp" / "model" / "checkpoint"


def stage_ddp(config: GpuCheckConfig, device: str, scale: Scale, out: Path, budget: Budget = UNLIMITED) -> dict:
    """Two processes of `blockgen train` under torchrun: NCCL on 2 GPUs, gloo on the CPU."""
    work = out / "ddp"
    shutil.rmtree(work, ignore_errors=True)  # a fresh run: an old checkpoint would be resumed (and evaluated by lm_eval)
    cuda = device.startswith("cuda")
    if cuda and torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU visible: the DDP run needs 2", "applies": False}
    if not budget.allows():
        return {"truncated": "budget: no time left for the DDP run", "not_run": [f"{DDP_PRESET} x 2 processes"]}
    work.mkdir(parents=True)
    model_dir = work / "model"
    cmd = [_bin("torchrun"), "--standalone", "--nproc_per_node=2", "-m", "blockgen.harness.cli",
           *_train_cmd("cuda" if cuda else "cpu", model_dir, out / "data", scale.ddp_steps)]
    seconds = _run(cmd, work / "train.log", budget)
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:]  # the first step includes start-up (and the process group's first collectives)
    s_step = _median([r["step_seconds"] for r in timed])
    return {"world_size": 2, "backend": "nccl" if cuda else "gloo", "preset": DDP_PRESET, "steps": len(records),
            "timed_steps": len(timed), "s_per_step": s_step, "tokens_per_s": _median([r["tokens_per_s"] for r in timed]),
            "seconds": seconds, "checkpoint": str(model_dir / "checkpoint")}


def stage_lm_eval(config: GpuCheckConfig, device: str, scale: Scale, out: Path, budget: Budget = UNLIMITED) -> dict:
    work = out / "lm_eval"
    shutil.rmtree(work, ignore_errors=True)  # a fresh run: `blockgen train` would resume an old checkpoint
    if not budget.allows():
        return {"truncated": "budget: no time left for training and lm_eval", "not_run": ["train", "lm_eval"]}
    work.mkdir(parents=True)
    result: dict = {}
    checkpoint = _ddp_checkpoint(out)
    if "ddp" in config.stages and (checkpoint / "config.json").is_file():  # trained by this check's ddp stage
        result["model"] = f"the ddp stage's checkpoint ({checkpoint})"
    else:
        model_dir = work / "model"
        result["train_seconds"] = _run([_bin("blockgen"), *_train_cmd(device, model_dir, out / "data")], work / "train.log", budget)
        checkpoint = model_dir / "checkpoint"
        result["model"] = f"trained here ({checkpoint})"
    results = work / "results"
    eval_cmd = [_bin("lm_eval"), "--model", "blockgen", "--device", device, "--tasks", "gsm8k_code_embedded",
                "--limit", str(scale.lm_eval_limit), "--batch_size", "8", "--output_path", str(results),
                "--model_args", f"pretrained={checkpoint},sampler=arpc,steps=4,ge=2,temperature=0.5,max_gen_toks=32"]
    result["lm_eval_seconds"] = _run(eval_cmd, work / "lm_eval.log", budget)
    (path,) = sorted(results.rglob("results_*.json"))[-1:]
    metrics = json.loads(path.read_text())["results"]["gsm8k_code_embedded"]
    return {**result, "limit": scale.lm_eval_limit, "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "results": str(path)}


def stage_scorers(config: GpuCheckConfig, device: str, scale: Scale, out: Path, budget: Budget = UNLIMITED) -> dict:
    from blockgen.harness.data.sources import DataConfig, document_split
    from blockgen.harness.evaluation.scorer_config import ScorerConfig, ScorerError
    from blockgen.harness.evaluation.scorers import TransformersScorer, VLLMScorer, gen_ppl, score_texts
    from blockgen.harness.evaluation.vllm_server import (
        CUDA_VLLM_FIX,
        check_vllm_installed,
        require_cuda_build,
        vllm_build,
        vllm_python,
    )
    from blockgen.harness.training.train_scorer import ScorerTrainConfig, train_scorer

    python = vllm_python()
    try:
        if device.startswith("cuda"):  # a CPU build would score on the CPU: not a check of the GPU
            require_cuda_build(vllm_build(python))
        else:
            check_vllm_installed(python)
    except ScorerError as err:
        if device.startswith("cuda"):
            return {"error": str(err), "fix": CUDA_VLLM_FIX}
        return {"skipped": f"no vLLM environment: {err}"}
    if not budget.allows():
        return {"truncated": "budget: no time left for the scorers", "not_run": ["transformers", "vllm"]}
    work = out / "scorers"
    data = DataConfig(source="text", cache_dir=str(work / "data"))
    scorer_config = ScorerTrainConfig(out_dir=str(work / "scorer"), max_steps=scale.scorer_steps, data=data)
    scorer_dir = str(train_scorer(scorer_config, progress=False))
    texts = [doc[:1200] for doc in document_split(data)[1]][: scale.scorer_texts]
    result: dict = {"texts": len(texts), "vllm_python": python}
    scorer_device = device if device.startswith("cuda") else "cpu"
    start = time.perf_counter()
    tf_scores = score_texts(TransformersScorer(ScorerConfig(model=scorer_dir, device=scorer_device)), texts, progress=False)
    tf_seconds = time.perf_counter() - start
    tokens = sum(s.tokens for s in tf_scores)
    if not budget.allows():  # the transformers side measured; the server's start-up would run past the deadline
        result.update(tokens=tokens, transformers_tokens_per_s=tokens / tf_seconds)
        return {**result, "truncated": "budget: no time left to start the vLLM server", "not_run": ["vllm"]}
    start = time.perf_counter()
    # the server's start-up waits no longer than the stage's deadline (ScorerError past it: the stage's error)
    with VLLMScorer(ScorerConfig(backend="vllm", model=scorer_dir, start_timeout=budget.left())) as vllm:
        started = time.perf_counter()
        vllm_scores = score_texts(vllm, texts, progress=False)
        vllm_seconds = time.perf_counter() - started
    a, b = gen_ppl(tf_scores), gen_ppl(vllm_scores)
    result.update(tokens=tokens, transformers_gen_ppl=a, vllm_gen_ppl=b, relative_difference=abs(a - b) / a,
                  transformers_tokens_per_s=tokens / tf_seconds, vllm_tokens_per_s=tokens / vllm_seconds,
                  vllm_start_seconds=started - start)
    return result


STAGE_FUNCTIONS: dict[str, Callable[..., dict]] = {  # (config, device, scale, out, budget) -> the stage's result
    "train": stage_train, "ddp": stage_ddp, "generate": stage_generate, "lm_eval": stage_lm_eval, "scorers": stage_scorers,
}


def _device_info(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(name=props.name, memory_gb=props.total_memory / 1e9, cuda=torch.version.cuda,
                    visible_gpus=torch.cuda.device_count())
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def run_gpu_check(config: GpuCheckConfig) -> dict:
    """Run the stages in `STAGES` order, each by its deadline (`GpuCheckConfig.shares`); each stage's result
    or error goes into the summary (written as JSON)."""
    device = config.resolved_device()
    scale = config.scale()
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shares = config.shares()
    summary: dict = {"mode": "gpu" if device.startswith("cuda") else "cpu", **_device_info(device),
                     "config": asdict(config), "scale": asdict(scale), "stages": {}}
    begin = time.monotonic()
    end_of_share = begin
    for name, share in shares.items():
        end_of_share += share * config.budget_s  # this share, plus what the stages before left unused
        start = time.monotonic()
        try:
            result = STAGE_FUNCTIONS[name](config, device, scale, out, Budget(end_of_share))
        except Exception as err:  # noqa: BLE001 - one failing stage must not lose the others
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        result.update(stage_seconds=time.monotonic() - start, share=share, share_s=share * config.budget_s)
        summary["stages"][name] = result
        _free(device)
    summary["total_seconds"] = time.monotonic() - begin
    summary["budget"] = {"budget_s": config.budget_s, "shares": shares,
                         "used_s": {name: r["stage_seconds"] for name, r in summary["stages"].items()}}
    cuda = device.startswith("cuda")
    summary["status"] = {name: stage_status(r, cuda) for name, r in summary["stages"].items()}
    summary["failed"] = [name for name, status in summary["status"].items() if status == "failed"]
    summary["ok"] = not summary["failed"]
    rates = measured_rates(summary, out)
    summary["rates"] = str(write_rates(rates, out / RATES_FILE)) if rates else None
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")
    return summary


def stage_failed(result: dict, cuda: bool) -> bool:
    """An error in the stage or in one of its runs; on a GPU also a stage that skipped itself where it applies
    (the scorer without a CUDA build of vLLM: the check is of the GPU, and a part left out of it is not
    checked; ddp on one GPU does not apply), and a stage the budget stopped before it measured anything."""
    if "error" in result or any("error" in run for run in result.get("runs", ())):
        return True
    if not cuda:
        return False
    return ("skipped" in result and result.get("applies", True)) or ("truncated" in result and not _measured(result))


def _measured(result: dict) -> bool:
    """A truncated stage measured something: a run (train, generate) or a figure (scorers' transformers side)."""
    return bool(result.get("runs")) or "tokens" in result


def stage_status(result: dict, cuda: bool) -> str:
    """ok, failed, truncated (stopped by the budget, not failed) or skipped (not failed)."""
    if stage_failed(result, cuda):
        return "failed"
    return "truncated" if "truncated" in result else "skipped" if "skipped" in result else "ok"


def _key_figure(name: str, r: dict) -> str:
    """The one number a reader looks for first in a stage's result; else why there is none."""
    why = r.get("error") or r.get("skipped") or r.get("truncated") or ""
    figure = ""
    if name == "train":
        best = {}
        for run in r.get("runs", ()):  # per prior, its largest micro-batch measured
            if "tokens_per_s" in run and run["micro_batch"] >= best.get(run["prior"], {}).get("micro_batch", 0):
                best[run["prior"]] = run
        figure = ", ".join(f"{p} {run['tokens_per_s']:,.0f} tokens/s at {run['micro_batch']} x {run['seq_len']}" for p, run in best.items())
    elif name == "ddp" and "tokens_per_s" in r:
        figure = f"{r['world_size']} x {r['backend']}: {r['s_per_step']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s"
    elif name == "generate":
        rows = [x for x in r.get("runs", ()) if x["sampler"] == "arpc" and "tokens_per_s" in x]
        figure = ", ".join(f"arpc batch {x['batch']}: {x['tokens_per_s']:,.0f} tokens/s" for x in rows[-2:])
    elif name == "lm_eval" and "metrics" in r:
        figure = f"exact_match {r['metrics'].get('exact_match,sandbox', float('nan')):.2f} on {r['limit']} problems"
    elif name == "scorers" and "relative_difference" in r:
        figure = f"Gen PPL vLLM vs transformers: {r['relative_difference']:.1e} relative"
    if "error" in r or not figure:
        figure = why.splitlines()[0][:90] if why else ""
    return figure


def summary_table(summary: dict) -> str:
    """One line per stage: stage, status, seconds, share of the budget, key figure; then the verdict."""
    cuda = summary["mode"] == "gpu"
    header = ("stage", "status", "seconds", "share", "key figure")
    rows = [(name, stage_status(r, cuda), f"{r['stage_seconds']:.1f}", f"{r['share']:.0%} ({r['share_s']:.0f} s)", _key_figure(name, r))
            for name, r in summary["stages"].items()]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() for row in (header, *rows)]
    verdict = "ok" if summary["ok"] else f"FAILED: {', '.join(summary['failed'])}"
    lines.append(f"total {summary['total_seconds']:.1f} s of a {summary['budget']['budget_s']:.0f} s budget: {verdict}")
    return "\n".join(lines)


def measured_rates(summary: dict, out: Path) -> Rates | None:
    """The rates file of this check (harness/costs/rates.py): the generate stage's seconds per sampler call per
    sampler, block size and batch, the train stage's seconds per likelihood pass per prior and micro-batch,
    and its training tokens/s per prior and micro-batch, each in the precision it ran; None when neither
    stage measured anything."""
    stages = summary["stages"]
    generate, train = stages.get("generate", {}), stages.get("train", {})
    calls = tuple(CallRate(generate["precision"], r["sampler"], r["block_size"], r["batch"], r["ms_per_call"] / 1e3)
                  for r in generate.get("runs", ()) if "ms_per_call" in r)
    passes = tuple(PassRate(train["likelihood_precision"], "blockgen", r["prior"], r["micro_batch"], r["seq_len"], r["likelihood_pass_s"])
                   for r in train.get("runs", ()) if "likelihood_pass_s" in r)
    training = tuple(TrainRate(train["precision"], r["prior"], tuple(r["block_sizes"]), r["micro_batch"], r["seq_len"], r["tokens_per_s"],
                               r["peak_memory_gb"]) for r in train.get("runs", ()) if "tokens_per_s" in r)
    if not calls and not passes and not training:
        return None
    scale = summary["scale"]
    provenance = Provenance(
        command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), date=summary["date_utc"] + " UTC", commit=_commit(),
        source=str(out / "summary.json"),
        notes=f"blockgen gpu-check on {summary['name']} ({summary['device']}), {scale['size']} size, random weights: "
              f"generate() with prompts of {scale['prompt_len']} and {scale['new_tokens']} new tokens, eager, TF32 off; "
              "likelihood passes: one NELBO draw at block size 16 over [x0 ; xt], eager, after the training runs; "
              f"training: one process, the {'/'.join(map(str, TRAIN_BLOCK_SIZES))} mixture's weighted step, "
              f"{'compiled' if scale['compile'] else 'eager'}, no data loading, no DDP")
    return Rates(RATES_VERSION, summary["name"], scale["size"], provenance, calls, passes, training)


def _commit() -> str:
    """The checkout's commit (with -dirty for uncommitted changes), or why there is none."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({type(err).__name__})"
    return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"
