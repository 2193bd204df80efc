"""What training will cost, said before it starts (`blockgen train-cost`, the first line of `make
train-owt` / `make train-tinygsm`): per model, the steps still to run x the tokens per step at the
training rate measured on a GPU (`make gpu-check`'s rates file, else the stored H100 figures:
harness/costs/rates.py), and the GPU-hours; then the total.

    blockgen train-cost --presets owt-ar owt-masked-mix --gpus 8 --device cuda
    blockgen train-cost --presets owt-masked-mix --gpus 32 --max-steps 250000 --rates runs/gpu-check/rates.json

Measured: tokens/s of one GPU for a prior at a sequence length. Derived, and said so on the line: a
prior, length or architecture without its own measurement, from the nearest measured one by the FLOPs
per token of both (`training_flops_per_step`). Assumed: that rate times the number of GPUs (data
parallel scales about linearly while the micro-batch per GPU stays the same; a cluster's interconnect
may cost more, `make gpu-check`'s ddp stage measures 2 GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from blockgen.harness.costs.rates import RateSource, gpu_check_rates, rate_source, training_tokens_per_s
from blockgen.harness.training.flops_memory import training_flops_per_step
from blockgen.harness.training.run_directory import checkpoint_step
from blockgen.harness.training.train_config import TrainConfig

MEASURED_VOCAB = 50_257  # GPT-2's, what `make gpu-check` trains at paper size


@dataclass(frozen=True)
class RunCost:
    name: str
    steps: int  # still to run: max_steps less the step of the run's checkpoint
    tokens: float  # steps x batch x seq_len
    tokens_per_s: float | None  # all GPUs together; None: no rate to price it with
    how: str  # where the rate comes from, or why there is none

    @property
    def hours(self) -> float | None:
        return None if self.tokens_per_s is None else self.tokens / self.tokens_per_s / 3600


def flops_per_token(config: TrainConfig) -> float:
    """Training FLOPs per token of the sequences (`training_flops_per_step`) at the measured vocabulary
    size: the ratio between two configs is what converts a measured rate (the vocabulary's share, the
    output head, changes it by well under 1 % between GPT-2's and SmolLM's)."""
    return training_flops_per_step(config.model_config(MEASURED_VOCAB, {}, "cpu"), 1) / config.seq_len


def run_cost(name: str, config: TrainConfig, gpus: int, source: RateSource, done_steps: int = 0) -> RunCost:
    """Measured: the file's tokens/s for this prior at this length (`training_tokens_per_s`). Otherwise
    derived from the nearest measurement (this prior first, then this length) by the FLOPs per token of
    the two (another length, or the AR baseline's L tokens through the network instead of 2L)."""
    steps = max(config.max_steps - done_steps, 0)
    tokens = float(steps) * config.batch_size * config.seq_len
    rates = source.rates
    measured = sorted({(r.prior, r.seq_len) for r in rates.training},
                      key=lambda m: (m[0] != config.prior, m[1] != config.seq_len, abs(m[1] - config.seq_len)))
    if not measured:
        return RunCost(name, steps, tokens, None, f"no training rate in {source.path.name}: `make gpu-check` on the GPU measures one")
    prior, seq_len = measured[0]
    per_gpu = training_tokens_per_s(rates, prior, seq_len, config.micro_batch)
    how = f"{per_gpu:,.0f} tokens/s per GPU measured on {rates.device} for the {prior} prior at L = {seq_len:,}"
    like_measured = replace(config, seq_len=seq_len, architecture="blockgen")  # (the prior: priced as measured)
    ratio = flops_per_token(like_measured) / flops_per_token(config)
    if (prior, seq_len, config.architecture) != (config.prior, config.seq_len, "blockgen"):
        per_gpu *= ratio
        what = [f"the {config.prior} prior not measured"] if prior != config.prior else []
        what += ["the AR baseline's L tokens through the network, not 2L"] if config.architecture == "ar" else []
        what += [f"L = {config.seq_len:,}"] if seq_len != config.seq_len else []
        how += f", derived by FLOPs per token ({ratio:.2f}x: {', '.join(what)})"
    return RunCost(name, steps, tokens, per_gpu * gpus, how + f" x {gpus} GPUs")


def _days(hours: float) -> str:
    return f"{hours / 24:.1f} days" if hours >= 48 else f"{hours:.1f} h"


def describe(costs: list[RunCost], gpus: int, device: str) -> str:
    """One line per model and a total line: what `make train-*` prints before its first model starts."""
    if not device.startswith("cuda"):
        return (f"training cost: {_count(len(costs), 'model')} on {device}: not priced (the rates are GPU measurements); "
                "each run's progress line shows its own rate and time left")
    lines = []
    for c in costs:
        if c.hours is None:
            lines.append(f"  {c.name}: {c.steps:,} steps ({c.tokens:.3g} tokens): {c.how}")
        else:
            lines.append(f"  {c.name}: {c.steps:,} steps ({c.tokens:.3g} tokens) -> {_days(c.hours)} on {gpus} GPUs, "
                         f"{c.hours * gpus:,.0f} GPU-hours ({c.how})")
    priced = [c.hours for c in costs if c.hours is not None]
    total = (f"training cost: {_count(len(costs), 'model')}, {_days(sum(priced))} on {gpus} GPUs one after another, "
             f"{sum(priced) * gpus:,.0f} GPU-hours" + (f" ({len(costs) - len(priced)} not priced)" if len(priced) < len(costs) else ""))
    return "\n".join([total, *lines])


CPU_SIZES = ("micro", "tiny")  # the embedded presets' sizes, made to train on a CPU


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def report(configs: dict[str, TrainConfig], gpus: int, runs: str | Path = "runs", rates: str | None = None) -> str:
    """`blockgen train-cost`: the cost of each named run (less the steps its checkpoint in `runs` has
    done) and the total, priced with `rates` (--rates), else gpu-check's file in `runs` when measured on
    the GPU, else the stored H100 figures."""
    if gpus < 1:
        raise ValueError(f"gpus={gpus}; give the GPUs of each run (nodes x GPUs per node), at least 1")
    source = rate_source(rates, gpu_check_rates(runs))
    costs = [run_cost(name, config, gpus, source, checkpoint_step(Path(runs) / name / "checkpoint")) for name, config in configs.items()]
    # CPU runs, or the embedded CPU presets (micro, tiny) left on device auto: a GPU's rate would price nothing real
    on_cpu = all(c.device == "cpu" or (c.device == "auto" and c.size in CPU_SIZES) for c in configs.values())
    device = "cpu" if on_cpu else "cuda"
    text = describe(costs, gpus, device)
    return text + (f"\n  rates: {source.describe()}" if device == "cuda" else "")
