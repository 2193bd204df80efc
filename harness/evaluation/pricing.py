"""What a sweep will cost before it runs, and how several jobs share it.

Prices (`estimate`, harness/costs/eval_cost.py): offline grids in CPU-seconds from measured CPU rates; full-scale
grids in hours at the measured seconds per batched call of a rates file (harness/costs/rates.py: `--rates FILE`,
else `make gpu-check`'s RUNS/gpu-check/rates.json from a GPU, else the stored H100 rates), in each setting's
precision, with the FLOP bound (derived H200-hours) where the file has no rate and beside every line. The
dry run prints them (`dry_run`); the progress bar of a run is weighted by them (`priced`), so its ETA follows
the work rather than the count of settings.

Several jobs: `--shard I/N` runs job I's share of the grid (`split`: the settings priced as the dry run
prices them, an unpriced one at the median price, dealt longest first to the least loaded of N jobs, the
same split in every job: a sharded sweep prices with `--rates` or the stored rates, never with a gpu-check
rates file one machine happens to have).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from blockgen.harness.costs.eval_cost import CpuRates, Price
from blockgen.harness.costs.rates import Rates, RateSource, full_scale_price, precision_label
from blockgen.harness.evaluation.grids import Grid
from blockgen.harness.evaluation.evaluations import GENPPL_TASKS, LIKELIHOOD, Evaluation, likelihood_args, model_block_sizes
from blockgen.harness.training.presets import PRESETS, preset


def estimate(g: Grid, s: Evaluation, model: str, metadata: dict | None = None, rates: Rates | None = None,
             cpu_rates: CpuRates | None = None) -> Price:
    """One setting's price (`eval_cost.Price`). Full-scale grids (`eval_cost.plan_cost`: this project's presets
    are the paper's networks): GPU-seconds at the MEASURED rates of `rates` (harness/costs/rates.py) in the setting's
    precision, the FLOP bound (derived H200-seconds) where the file has no rate and beside it; without
    `rates`, the FLOP bound alone. Offline grids: CPU-seconds from MEASURED rates (`cpu_rates`, else the
    stored ones: `eval_cost.cpu_rates()`).
    `seconds` is None where no rate applies."""
    from blockgen.harness.costs import eval_cost
    from blockgen.harness.checkpoints.release_catalogue import RELEASES
    from blockgen.harness.costs.eval_cost import plan_cost

    name = f"{g.benchmark}-{model}"
    if not g.source.cpu_scale and name in RELEASES:
        plan = plan_cost(name, s.task, s.sampler, g.k_mc, g.limit, g.batch_size)
        if rates is None:
            return Price(plan.bound, f"{plan.what}; {plan.work.batched_calls} batched calls; no rates file: FLOP bound",
                         plan.bound, derived=plan.bound)
        extra = dict(s.extra)
        return full_scale_price(plan, precision_label(extra.get("dtype"), bool(extra.get("tf32"))), rates)
    preset_name = g.run_name(model)
    if preset_name not in PRESETS:  # a run trained under --runs with settings of its own: no rate applies
        return Price(None, "not a preset: no measured rate")
    config = preset(preset_name)
    sizes = model_block_sizes(g, model, s.checkpoint)
    rows = eval_cost.offline_rows(s.task, g.limit, metadata or {})
    batch = g.batch_size
    if s.sampler is None:
        kind, calls = "likelihood", eval_cost.likelihood_passes(sizes, g.k_mc)
    else:
        budget = eval_cost.new_tokens(s.task, config.seq_len, dict(g.model_args).get("max_gen_toks"))
        kind, calls = eval_cost.generation_calls(s.sampler, max(sizes), budget)
    if rows is None:
        return Price(None, f"all chunks x {calls} passes (count from the data: give --limit)")
    work = eval_cost.Work(kind, rows, batch, calls, scored=rows if s.task in GENPPL_TASKS else 0)
    rate, note = eval_cost.cpu_rate(preset_name, batch, cpu_rates)
    seconds = eval_cost.cpu_seconds(work, rate, s.task, cpu_rates) if rate else None
    adaptive = s.sampler is not None and s.sampler.sampler.adaptive
    return Price(seconds, work.describe() + (f"; {note}" if note else "") + (f"; {eval_cost.ADAPTIVE_NOTE}" if adaptive else ""))


def dry_run(g: Grid, todo: list[Evaluation], out=None, metadata: dict | None = None, source: RateSource | None = None) -> float:
    """One line per setting with its price, a subtotal per model and the total, the pricing's assumptions
    and (full scale) the rates file named in the header; returns the total headline seconds (CPU offline;
    full scale: at the measured rates of `source`, the FLOP bound where it has none)."""
    from blockgen.harness.costs.eval_cost import CPU_ASSUMPTIONS, cpu_rates, full_scale_assumptions

    out = out or sys.stdout
    rates = source.rates if source else None
    models = {g.run_name(m): m for m in g.models}
    loads = len({s.run for s in todo})  # the models with a setting to run (a shard's may be fewer)
    print(f"# blockgen sweep: {len(todo)} settings on {loads} models, each model loaded once", file=out)
    print("# cost: " + (CPU_ASSUMPTIONS.format(measured=cpu_rates().measured) if g.source.cpu_scale else full_scale_assumptions()), file=out)
    if source is not None:
        print(f"# rates: {source.describe()}", file=out)
    extra = dict(g.model_args)
    precision = extra.get("dtype", "float32") + (" + TF32" if extra.get("tf32") else "")
    if "dtype" not in extra and g.likelihood_task and dict(likelihood_args(g)).get("dtype"):
        precision += f", likelihoods {g.likelihood_dtype} (the grid's default)"
    print(f"# precision of this sweep: {precision} (--dtype, --tf32); "
          + ("rates measured in float32" if g.source.cpu_scale else "each setting priced at its own precision's rates; "
             "the FLOP bound assumes bf16 matmuls"), file=out)
    total, bound, derived, unpriced = 0.0, 0.0, 0.0, 0
    per_model: dict[str, list[float]] = {}
    for s in todo:
        price = estimate(g, s, models[s.run], metadata, rates)
        seconds = price.seconds or 0.0
        total, bound, derived = total + seconds, bound + (price.bound or 0.0), derived + price.derived
        unpriced += price.seconds is None
        sub = per_model.setdefault(s.run, [0, 0.0, 0.0])
        sub[0], sub[1], sub[2] = sub[0] + 1, sub[1] + seconds, sub[2] + (price.bound or 0.0)
        t = "" if s.temperature is None else f"T={s.temperature}"
        beside = "" if g.source.cpu_scale else f"  (bound {_hours(price.bound, 'H200')})"
        print(f"{s.run}  {s.task}  {s.label if s.sampler else LIKELIHOOD}  {t}  {headline_price(price.seconds, g.source.cpu_scale)}{beside}"
              f"  ({price.what})", file=out)
    for run, (n, sub, sub_bound) in per_model.items():
        beside = "" if g.source.cpu_scale else f" (bound {_hours(sub_bound, 'H200')})"
        print(f"# model {run}: {n} settings, {headline_price(sub, g.source.cpu_scale)}{beside}", file=out)
    head = f"total: {len(todo)} settings, {loads} model loads, {headline_price(total, g.source.cpu_scale)}"
    if g.source.cpu_scale:
        kind = "from measured CPU rates"
    else:
        device = rates.device if rates else "no rates file"
        kind = (f"{_hours(total - derived, 'GPU')} at measured rates ({device}) + {_hours(derived, 'H200')} "
                f"FLOP bound where no rate was measured; FLOP bound of all: {_hours(bound, 'H200')}, derived")
    print(f"{head} ({kind}" + (f"; {unpriced} settings not priced" if unpriced else "") + ")", file=out)
    return total


def headline_price(seconds: float | None, offline: bool) -> str:
    """A headline price: CPU-seconds offline; full scale, hours: GPU-hours at measured rates plus the FLOP
    bound's H200-hours where no rate was measured (the total says how much of each)."""
    if seconds is None:
        return "-"
    return f"{seconds:.1f} CPU-s" if offline else f"{seconds / 3600:.3f} h"


def _hours(seconds: float | None, unit: str) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.3f} {unit}-h"


# ------------------------------------------------------------------------------ shards

SHARD_FORM = "I/N: job I of N independent jobs, 0 <= I < N (e.g. 0/8 ... 7/8)"


@dataclass(frozen=True)
class Shard:
    """Job `index` of `count` independent jobs that split a grid's settings between them (`--shard I/N`)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: expected {SHARD_FORM}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def priced(g: Grid, todo: list[Evaluation], metadata: dict | None = None, rates: Rates | None = None) -> list[float]:
    """Each setting's cost as the dry run prices it (`estimate`): what the shards are split by and the
    progress bar is weighted by. A setting without a price counts as the median of the priced ones (1 when
    none is): unknown work is spread over the shards like typical work, where 0 would pile every unpriced
    setting onto one shard."""
    models = {g.run_name(m): m for m in g.models}
    seconds = [estimate(g, s, models[s.run], metadata, rates).seconds for s in todo]
    known = [x for x in seconds if x is not None]
    fill = statistics.median(known) if known else 1.0
    return [fill if x is None else x for x in seconds]


def split(costs: Sequence[float], count: int) -> list[int]:
    """The shard of each setting, balanced by cost: longest processing time first (costliest first, equal
    costs in grid order), each to the shard with the least cost so far (the lowest index among equals).
    Deterministic, so every job computes the same split on its own and no job talks to another."""
    loads = [0.0] * count
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):  # sorted is stable: grid order among equals
        k = min(range(count), key=loads.__getitem__)  # min keeps the first: the lowest index
        owner[i] = k
        loads[k] += costs[i]
    return owner
