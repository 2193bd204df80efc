"""The train stage of `blockgen gpu-check`: the training step of `blockgen train` (`training_net`: the
compiled model, bf16 autocast, AdamW, clipping, EMA) on random tokens, per prior and micro-batch, on the
OWT presets' block-size mixture (1, 16) with weights (0.05, 0.95): the block size alternates step by step,
as it changes from step to step in training, so both graphs are compiled (warm-up) and timed. One model
and one compiled network per prior serve all its micro-batches (dynamo is reset between priors only);
`warmup_seconds` per prior holds its compilation. Per run: s/step per block size and their
mixture-weighted mean, tokens/s, MFU, peak memory beside the start-up estimate of
harness/training/flops_memory.py. Random tokens: the cost of a step does not depend on the text, and the check
needs neither the hub nor a prepared corpus. GPU: the paper's model (12 x 768) at L = 1,024 with GPT-2's
vocabulary size, micro-batch 32 (the OWT presets'); CPU: the micro model. Then, per run, the likelihood
pass the sweep's owt_ppl makes (one NELBO draw at block size 16 over [x0 ; xt], eager, no gradients) in
the precision the sweep scores likelihoods in at that size (bf16 on the GPU, float32 on the CPU), TF32
off: `likelihood_pass_s` and `likelihood_seqs_per_s`.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from blockgen.harness.costs.rates import precision_label
from blockgen.harness.gpu_check.config import TRAIN_BLOCK_SIZES, TRAIN_BLOCK_WEIGHTS, UNLIMITED, Budget, GpuCheckConfig, Scale, mark_truncated
from blockgen.harness.gpu_check.timing import free_memory, median, sweep_tf32, sync


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
                sync(device)
                start = time.perf_counter()
                with autocast:
                    total, count = self.net(x, loss_mask, block, t)
                    (total / count.clamp_min(1)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.ema.update(model, self.step)
                self.step += 1
                sync(device)
                if i >= warmup:
                    seconds[block].append(time.perf_counter() - start)
                elif i == warmup - 1:
                    warmup_seconds = time.perf_counter() - begin  # includes compilation of this shape
                loss = float((total / count.clamp_min(1)).detach())
        finally:
            self.optimizer.zero_grad(set_to_none=True)  # a failed step (out of memory) leaves no gradients behind
        by_block = {b: median(s) for b, s in seconds.items()}
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

def _likelihood_pass_seconds(model, x: torch.Tensor, loss_mask: torch.Tensor, device: str, dtype: str, scale: Scale) -> float:
    """Median seconds of one batched likelihood pass as the sweep's owt_ppl makes them (`score_windows`:
    one NELBO draw at block size 16 over [x0 ; xt], eager, no gradients, per-row streams), in `dtype`."""
    from blockgen.harness.runtime.precision import compute_precision
    from blockgen.models.diffusion import RowStreams

    seconds = []
    with torch.no_grad(), sweep_tf32(device), compute_precision(device, dtype):
        for i in range(scale.warmup_steps + scale.steps):
            streams = RowStreams(list(range(x.shape[0])))
            sync(device)
            start = time.perf_counter()
            model.sequence_nll_draws(x, loss_mask, 16, 1, generator=streams)
            sync(device)
            if i >= scale.warmup_steps:
                seconds.append(time.perf_counter() - start)
    return median(seconds)


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
            free_memory(device)
        del trainer
        if scale.compile:
            torch._dynamo.reset()  # between priors only: the next prior compiles its own model
        free_memory(device)
    result = {"compile": scale.compile, "bf16": scale.bf16 and device.startswith("cuda"), "precision": training_precision(device, scale),
              "size": scale.size, "vocab_size": scale.vocab_size, "block_sizes": list(TRAIN_BLOCK_SIZES),
              "block_weights": list(TRAIN_BLOCK_WEIGHTS), "peak_tflops": None if peak is None else peak / 1e12,
              "likelihood_precision": likelihood_dtype(device, scale), "warmup_seconds": warmup, "runs": runs}
    return mark_truncated(result, not_run, budget)
