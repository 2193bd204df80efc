"""`blockgen sweep`: the paper's evaluation grids, each model loaded once, one scorer per sweep.

    blockgen sweep owt-embedded --runs runs/ci-pipeline --limit 8 --metadata '{"scorer_model": "runs/ci-pipeline/scorer-text"}'
    blockgen sweep gsm8k --dry-run                        # one line per setting and its price
    blockgen sweep owt --dry-run --rates runs/gpu-check/rates.json   # priced at the rates your GPU measured
    torchrun --nproc_per_node=8 -m blockgen.harness.cli sweep owt --runs runs --device cuda
    blockgen sweep owt --runs runs --device cuda --shard 3/8 --keep-going   # job 3 of 8 independent jobs

A grid (`GRIDS` in harness/evaluation/grids.py, the one home of the evaluation grids; the variants by NFE come
from `sampler_grid`) names the models, the tasks and the sampler x NFE x temperature settings. Per model:
the likelihood task once, then per sampler family (`families`: AR decoding for block size 1 alone,
ARPC for mixtures with block size 1, ancestral and EIPC otherwise) every variant at every
temperature. Settings that decode the same way are run once (`ar_greedy` does not read the
temperature: it runs at the grid's first one).

Per checkpoint the process loads the model once and evaluates every setting on it through lm-eval's
Python API (`lm_eval.simple_evaluate`), switching the sampler with `BlockGenLM.with_settings`; the torch
random state at each setting's start is the one a fresh `lm_eval` process would have, so a setting's
results equal the per-process command's; `--seed S` seeds as `lm_eval --seed S` does (recorded in the
results; another seed is another result, not skipped). Each setting writes its own lm-eval results and samples
(``--log_samples``: per-problem / per-sample outcomes) under ``<out-dir>/<model run>/<setting>/``,
the folders the per-process Makefile used; a rerun skips a setting whose results record the same
setting, checkpoint hash, limit, task metadata and seed. Under torchrun the settings run data parallel
(rank 0 writes); rank 0 alone decides what is done and broadcasts it (`decided_on_rank0`), so ranks
without a shared file system run the same settings. The demo's grid (`demo`) is in the same registry;
`blockgen demo` runs it on its own worker pool (harness/demo.py imports `demo_samplers`).

Prices (`estimate`, harness/costs/eval_cost.py): offline grids in CPU-seconds from measured CPU rates; full-scale
grids in hours at the measured seconds per batched call of a rates file (harness/costs/rates.py: `--rates FILE`,
else `make gpu-check`'s RUNS/gpu-check/rates.json from a GPU, else the stored H100 rates), in each setting's
precision, with the FLOP bound (derived H200-hours) where the file has no rate and beside every line. The
dry run prints them; the progress bar of a run is weighted by them (`_Progress`), so its ETA follows the
work rather than the count of settings.

Several jobs: `--shard I/N` runs job I's share of the grid (`split`: the settings priced as the dry run
prices them, `priced`, an unpriced one at the median price, dealt longest first to the least loaded of N
jobs, the same split in every job: a sharded sweep prices with `--rates` or the stored rates, never with
a gpu-check rates file one machine happens to have). The jobs need no process group with each other (each may be its own
torchrun group) and write into the same results folders a single sweep would, so any job's rerun skips
what another finished; `--dry-run --shard I/N` lists that job's settings and cost. `blockgen leaderboard
collect ROOT...` builds one leaderboard from their results. `--keep-going`: a setting that raises leaves
`error.json` (error, traceback, the setting's mark) in its results folder and the sweep goes on; the
summary lists the failed settings and the exit status is 1. A failed setting is not done: a rerun retries
it (and removes the record once it succeeds). Without it the sweep stops at the first failure, recorded.

Scorers: the `owt_genppl` settings of a sweep share one scorer: one vLLM server per process (per GPU
under torchrun), started before the first such setting and stopped at the end, handed to the task as
``scorer_url``; and one in-process copy of the scorer model for MAUVE's features (and for the scores
with the transformers backend): `scorers.shared_scorers`. MAUVE's reference passages and their features
are computed once and cached under ``<out-dir>/mauve-cache`` ($BLOCKGEN_MAUVE_CACHE or the metadata's
``mauve_cache`` instead), where the settings' sample features (the side files their samples point to)
go too: `harness.mauve_cache`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from blockgen.harness.runtime.distributed import decided_on_rank0, ranks_from_env, setup_distributed
from blockgen.harness.costs.eval_cost import Price
from blockgen.harness.evaluation.grids import AR_RUNS, GRIDS, Grid, demo_samplers, grid
from blockgen.harness.runtime.precision import DTYPES, check_dtype
from blockgen.harness.training.presets import PRESETS, preset
from blockgen.harness.costs.rates import Rates, RateSource, full_scale_price, gpu_check_rates, precision_label, rate_source
from blockgen.harness.evaluation.sampler_grid import Variant

LIKELIHOOD = "likelihood"
GENPPL_TASKS = ("owt_genppl", "owt_genppl_embedded")


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Setting:
    """One lm-eval run: a task on a checkpoint with one sampler variant and temperature (likelihood:
    no sampler)."""

    run: str  # the model's run name (Grid.run_name)
    checkpoint: str  # pretrained=
    task: str
    variant: Variant | None = None
    temperature: float | None = None
    extra: tuple[tuple[str, Any], ...] = ()  # the grid's further model arguments

    @property
    def label(self) -> str:
        """The setting's results folder: sampler-steps-ge-warmup-T<temperature>, or 'likelihood'."""
        extra = dict(self.extra)
        precision = "".join(f"-{x}" for x in (extra.get("dtype"), "tf32" if extra.get("tf32") else None) if x)
        if self.variant is None:
            return LIKELIHOOD + precision
        return f"{self.variant.sampler}-{self.variant.spec().replace(':', '-')}-T{self.temperature}{precision}"

    def model_args(self, k_mc: int) -> dict[str, Any]:
        """The blockgen `--model_args`, as the per-process Makefile command passed them."""
        args: dict[str, Any] = {"pretrained": self.checkpoint, "k_mc": k_mc}
        if self.variant is not None:
            v = self.variant
            args.update(sampler=v.sampler, steps=v.steps, ge=v.ge, warmup=v.warmup, temperature=self.temperature)
        return {**args, **dict(self.extra)}

    def key(self, k_mc: int) -> str:
        """What decides the results: greedy AR decoding does not read the temperature."""
        args = self.model_args(k_mc)
        if args.get("sampler") == "ar_greedy":
            args.pop("temperature")
        return json.dumps([self.task, args], sort_keys=True)


def families(block_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The samplers the paper runs on a model: AR decoding (block size 1 alone), ARPC (a mixture with
    block size 1), else ancestral and EIPC (single block sizes, MDLM, Duo)."""
    if tuple(block_sizes) == (1,):
        return ("ar",)
    if 1 in block_sizes:
        return ("arpc",)
    return ("ancestral", "eipc")


def variants(g: Grid, block_sizes: tuple[int, ...]) -> tuple[Variant, ...]:
    if g.demo:
        return tuple(dict.fromkeys(Variant(s.name, 1) if s.is_ar else Variant(s.name, s.steps, s.ge, s.warmup)
                                   for s in demo_samplers(block_sizes, g.temperatures[:1], g.ancestral_nfe)))
    out: list[Variant] = []
    for family in families(block_sizes):
        out += {"ar": AR_RUNS, "arpc": g.arpc, "eipc": g.eipc,
                "ancestral": tuple(Variant("ancestral", n) for n in g.ancestral_nfe)}[family]
    return tuple(out)


def model_block_sizes(g: Grid, model: str, checkpoint: str) -> tuple[int, ...]:
    """From the checkpoint when it exists, else from the preset (or the release's path) it will come from."""
    if not g.released and (Path(checkpoint) / "config.json").is_file():
        from blockgen.harness.checkpoints.checkpoint import read_config

        return tuple(read_config(checkpoint).block_sizes)
    if g.released:
        from blockgen.harness.checkpoints.released import DATASETS, RELEASES, parse_release_path

        setting = parse_release_path(RELEASES[f"{g.benchmark}-{model}"])
        if setting.block_sizes:
            return tuple(setting.block_sizes)
        return (1,) if setting.algo == "ar" else (DATASETS[setting.dataset].seq_len,)
    return tuple(preset(model if g.demo else g.run_name(model)).block_sizes)


def checkpoint_of(g: Grid, model: str, runs: str) -> str:
    if g.released:
        from blockgen.harness.checkpoints.released import release_spec

        return release_spec(f"{g.benchmark}-{model}")
    return str(Path(runs) / g.run_name(model) / "checkpoint")


def likelihood_args(g: Grid) -> tuple[tuple[str, Any], ...]:
    """The likelihood setting's model arguments: the grid's, with its likelihood precision unless they
    name a dtype (a sweep's --dtype) or it is float32 (no dtype argument: the float32 code path)."""
    if "dtype" in dict(g.model_args) or DTYPES[check_dtype(g.likelihood_dtype)] == DTYPES["float32"]:
        return g.model_args
    return (*g.model_args, ("dtype", g.likelihood_dtype))


def settings(g: Grid, runs: str = "runs") -> list[Setting]:
    """Every setting of a grid, deduplicated (the first of equal settings is kept), per model:
    likelihood first, then variant by variant, each at every temperature."""
    out: dict[str, Setting] = {}
    for model in g.models:
        run, ckpt = g.run_name(model), checkpoint_of(g, model, runs)
        todo = [Setting(run, ckpt, g.likelihood_task, extra=likelihood_args(g))] if g.likelihood_task else []
        todo += [Setting(run, ckpt, g.generation_task, v, t, g.model_args)
                 for v in variants(g, model_block_sizes(g, model, ckpt)) for t in g.temperatures]
        for s in todo:
            out.setdefault(s.key(g.k_mc), s)
    return list(out.values())


# ------------------------------------------------------------------------------ cost


def estimate(g: Grid, s: Setting, model: str, metadata: dict | None = None, rates: Rates | None = None) -> Price:
    """One setting's price (`eval_cost.Price`). Full-scale grids (`eval_cost.plan_cost`: this project's presets
    are the paper's networks): GPU-seconds at the MEASURED rates of `rates` (harness/costs/rates.py) in the setting's
    precision, the FLOP bound (derived H200-seconds) where the file has no rate and beside it; without
    `rates`, the FLOP bound alone. Offline grids: CPU-seconds from MEASURED rates (`eval_cost.CPU_RATES`).
    `seconds` is None where no rate applies."""
    from blockgen.harness.costs import eval_cost
    from blockgen.harness.checkpoints.released import RELEASES
    from blockgen.harness.costs.eval_cost import plan_cost

    run = LIKELIHOOD if s.variant is None else f"{s.variant.sampler}:{s.variant.spec()}"
    name = f"{g.benchmark}-{model}"
    if not g.offline and name in RELEASES:
        plan = plan_cost(name, s.task, run, g.k_mc, g.limit, g.batch_size)
        if rates is None:
            return Price(plan.bound, f"{plan.what}; {plan.work.batched_calls} batched calls; no rates file: FLOP bound",
                         plan.bound, derived=plan.bound)
        extra = dict(s.extra)
        return full_scale_price(plan, precision_label(extra.get("dtype"), bool(extra.get("tf32"))), rates)
    preset_name = model if g.demo else g.run_name(model)
    if preset_name not in PRESETS:  # a run trained under --runs with settings of its own: no rate applies
        return Price(None, "not a preset: no measured rate")
    config = preset(preset_name)
    sizes = model_block_sizes(g, model, s.checkpoint)
    rows = eval_cost.offline_rows(s.task, g.limit, metadata or {})
    batch = g.batch_size
    if s.variant is None:
        kind, calls = "likelihood", eval_cost.likelihood_passes(sizes, g.k_mc)
    else:
        v, cap = s.variant, dict(g.model_args).get("max_gen_toks")
        budget = eval_cost.new_tokens(s.task, config.seq_len, cap)
        kind, calls = eval_cost.generation_calls(v.sampler, v.steps, v.ge, v.warmup, max(sizes), budget)
    if rows is None:
        return Price(None, f"all chunks x {calls} passes (count from the data: give --limit)")
    work = eval_cost.Work(kind, rows, batch, calls, scored=rows if s.task in GENPPL_TASKS else 0)
    rate, note = eval_cost.cpu_rate(preset_name, batch)
    seconds = eval_cost.cpu_seconds(work, rate, s.task) if rate else None
    return Price(seconds, work.describe() + (f"; {note}" if note else ""))


def dry_run(g: Grid, todo: list[Setting], out=None, metadata: dict | None = None, source: RateSource | None = None) -> float:
    """One line per setting with its price, a subtotal per model and the total, the pricing's assumptions
    and (full scale) the rates file named in the header; returns the total headline seconds (CPU offline;
    full scale: at the measured rates of `source`, the FLOP bound where it has none)."""
    from blockgen.harness.costs.eval_cost import CPU_ASSUMPTIONS, CPU_RATES_MEASURED, FULL_SCALE_ASSUMPTIONS

    out = out or sys.stdout
    rates = source.rates if source else None
    models = {g.run_name(m): m for m in g.models}
    loads = len({s.run for s in todo})  # the models with a setting to run (a shard's may be fewer)
    print(f"# blockgen sweep: {len(todo)} settings on {loads} models, each model loaded once", file=out)
    print("# cost: " + (CPU_ASSUMPTIONS.format(measured=CPU_RATES_MEASURED) if g.offline else FULL_SCALE_ASSUMPTIONS), file=out)
    if source is not None:
        print(f"# rates: {source.describe()}", file=out)
    extra = dict(g.model_args)
    precision = extra.get("dtype", "float32") + (" + TF32" if extra.get("tf32") else "")
    if "dtype" not in extra and g.likelihood_task and dict(likelihood_args(g)).get("dtype"):
        precision += f", likelihoods {g.likelihood_dtype} (the grid's default)"
    print(f"# precision of this sweep: {precision} (--dtype, --tf32); "
          + ("rates measured in float32" if g.offline else "each setting priced at its own precision's rates; "
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
        beside = "" if g.offline else f"  (bound {_hours(price.bound, 'H200')})"
        print(f"{s.run}  {s.task}  {s.label if s.variant else LIKELIHOOD}  {t}  {_cost(price.seconds, g.offline)}{beside}"
              f"  ({price.what})", file=out)
    for run, (n, sub, sub_bound) in per_model.items():
        beside = "" if g.offline else f" (bound {_hours(sub_bound, 'H200')})"
        print(f"# model {run}: {n} settings, {_cost(sub, g.offline)}{beside}", file=out)
    head = f"total: {len(todo)} settings, {loads} model loads, {_cost(total, g.offline)}"
    if g.offline:
        kind = "from measured CPU rates"
    else:
        device = rates.device if rates else "no rates file"
        kind = (f"{_hours(total - derived, 'GPU')} at measured rates ({device}) + {_hours(derived, 'H200')} "
                f"FLOP bound where no rate was measured; FLOP bound of all: {_hours(bound, 'H200')}, derived")
    print(f"{head} ({kind}" + (f"; {unpriced} settings not priced" if unpriced else "") + ")", file=out)
    return total


def _cost(seconds: float | None, offline: bool) -> str:
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


def priced(g: Grid, todo: list[Setting], metadata: dict | None = None, rates: Rates | None = None) -> list[float]:
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


# ------------------------------------------------------------------------------ running


@dataclass
class SweepConfig:
    grid: str
    runs: str = "runs"  # the models' run folders (this project's checkpoints)
    out_dir: str | None = None  # results root (default: <runs>/results, the Makefile's)
    models: tuple[str, ...] | None = None  # a subset of the grid's models
    temperatures: tuple[float, ...] | None = None
    limit: int | None = None
    k_mc: int | None = None
    batch_size: int | None = None
    device: str = "cpu"
    metadata: dict = field(default_factory=dict)  # task metadata for every setting (e.g. scorer_model)
    dry_run: bool = False
    progress: bool = True
    # the adapter's precision for every setting (harness/runtime/precision.py); other than float32, results go
    # to folders named with it (`Setting.label`), so they never mix with float32 results. None: the
    # grid's (float32, likelihoods of full-scale grids bfloat16: `Grid.likelihood_dtype`)
    dtype: str | None = None
    tf32: bool = False
    seed: int | None = None  # lm_eval's --seed (`lm_eval_seeds`); None: lm-eval's defaults
    shard: Shard | None = None  # run only this job's share of the settings (`split`); None: all
    keep_going: bool = False  # a failed setting is recorded (`error.json`) and the sweep goes on
    rates: str | None = None  # full-scale grids: the rates file pricing them (None: `rates.rate_source`'s choice)

    def resolved_grid(self) -> Grid:
        g = grid(self.grid)
        if self.models is not None:
            def runnable(m: str) -> bool:  # outside the grid: a preset (owt's blockgen-b1) or a run trained under --runs
                return not g.released and (g.run_name(m) in PRESETS or (Path(checkpoint_of(g, m, self.runs)) / "config.json").is_file())

            unknown = sorted(m for m in self.models if m not in g.models and not runnable(m))
            if unknown:
                others = "" if g.released else f"; or a preset or a run under {self.runs} named {g.run_name('MODEL')}"
                raise ValueError(f"grid {self.grid} has no models {unknown}; choose from {list(g.models)}{others}")
            g = replace(g, models=tuple(self.models))
        for name in ("temperatures", "limit", "k_mc", "batch_size"):
            if getattr(self, name) is not None:
                g = replace(g, **{name: getattr(self, name)})
        if self.dtype is not None:  # every setting, likelihoods included
            g = replace(g, likelihood_dtype=check_dtype(self.dtype))
        other_dtype = self.dtype is not None and DTYPES[check_dtype(self.dtype)] != DTYPES["float32"]
        precision = ((("dtype", self.dtype),) if other_dtype else ()) + ((("tf32", True),) if self.tf32 else ())
        g = replace(g, model_args=(*g.model_args, *precision))
        return g

    def results_root(self) -> Path:
        return Path(self.out_dir or Path(self.runs) / "results")

    def rate_source(self, g: Grid) -> RateSource | None:
        """The rates file of a full-scale grid (`rates.rate_source`: --rates, else RUNS/gpu-check/rates.json of
        a GPU run, else the stored rates); offline grids keep their CPU rates. A sharded sweep never picks up
        gpu-check's file by itself: every job must split alike."""
        if g.offline:
            if self.rates:
                raise ValueError(f"--rates prices full-scale grids; grid {self.grid} is priced from the measured CPU "
                                 "rates of harness/costs/eval_cost.py (CPU_RATES)")
            return None
        return rate_source(self.rates, None if self.shard else gpu_check_rates(self.runs))


@dataclass
class SweepReport:
    settings: int = 0
    ran: int = 0
    skipped: int = 0
    model_loads: int = 0
    vllm_starts: int = 0
    scorer_loads: int = 0  # in-process scorer models (MAUVE's features; scores with the transformers backend)
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)  # <run>/<setting> of each setting that raised
    shard: str | None = None  # I/N of a sharded sweep


def _results_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/results_*.json")) if folder.is_dir() else []


def _mark(s: Setting, g: Grid, sha: str, metadata: dict, seed: int | None = None) -> dict:
    """What a results file must record to stand for a setting: the setting (model arguments and task),
    the checkpoint's hash, the limit, the sweep's task metadata (scorer, sample count, ...) and seed."""
    return {"setting": s.key(g.k_mc), "checkpoint_sha": sha, "limit": g.limit,
            "metadata": json.loads(json.dumps(metadata, sort_keys=True)), "seed": seed}


def lm_eval_seeds(seed: int | None) -> dict[str, int]:
    """`simple_evaluate`'s seeds as `lm_eval --seed` sets them: one integer for python's random, numpy,
    torch and few-shot sampling, or (None) lm-eval's defaults."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    names = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
    if seed is None:
        return dict(zip(names, (DEFAULT_RANDOM_SEED, DEFAULT_OTHER_SEED, DEFAULT_OTHER_SEED, DEFAULT_OTHER_SEED)))
    return dict.fromkeys(names, seed)


ERROR_FILE = "error.json"


def _record_failure(folder: Path, mark: dict, err: BaseException) -> None:
    """The setting's error, its traceback and its mark in `error.json` in its results folder (rank 0).
    `_done` reads results files only, so a failed setting runs again on the next sweep."""
    if not ranks_from_env().is_main:
        return
    folder.mkdir(parents=True, exist_ok=True)
    record = {"blockgen_sweep": mark, "error": f"{type(err).__name__}: {err}",
              "traceback": "".join(traceback.format_exception(err)),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    (folder / ERROR_FILE).write_text(json.dumps(record, indent=1) + "\n")


def _clear_failure(folder: Path, mark: dict) -> None:
    """Remove the error record of this very setting (same mark) once it has succeeded."""
    path = folder / ERROR_FILE
    try:
        recorded = json.loads(path.read_text()).get("blockgen_sweep")
    except (OSError, ValueError, AttributeError):
        return
    if recorded == mark:
        path.unlink(missing_ok=True)


def _done(folder: Path, mark: dict) -> bool:
    """A results file of this setting on this checkpoint (hash), with this limit and metadata, exists."""
    for path in _results_files(folder):
        try:
            found = json.loads(path.read_text()).get("blockgen_sweep", {})
        except (OSError, ValueError):
            continue
        if {k: found.get(k) for k in mark} == mark:
            return True
    return False


class _Scorers:
    """The sweep's scorers: the shared in-process copy (`scorers.shared_scorers`) and, when a genppl
    setting wants vLLM, one server for the whole sweep (per process), started at the first such setting;
    and MAUVE's cache folder (`harness.mauve_cache`): $BLOCKGEN_MAUVE_CACHE, else <results root>/mauve-cache."""

    def __init__(self, metadata: dict, device: str, root: Path) -> None:
        import os
        from contextlib import ExitStack

        from blockgen.harness.evaluation.mauve_cache import CACHE_ENV
        from blockgen.harness.evaluation.scorers import shared_scorers

        self.metadata, self.device = metadata, device
        self.mauve_cache = os.environ.get(CACHE_ENV) or str(root / "mauve-cache")
        self.server = None
        self._server_config: dict[str, Any] = {}  # task -> the ScorerConfig of the server it wants (None: none)
        self._stack = ExitStack()
        self._stack.enter_context(shared_scorers())

    def metadata_for(self, task_name: str, task_metadata: dict) -> dict:
        """The metadata of a genppl setting: the sweep's MAUVE cache folder (unless the metadata names one),
        and the sweep's server as scorer_url when the task scores with vLLM (its scorer settings come from
        the task's YAML and the sweep's metadata, the same for every setting)."""
        from blockgen.harness.evaluation.mauve_cache import METADATA_KEY
        from blockgen.harness.evaluation.vllm_server import VLLMServer, require_cuda_build, vllm_build, vllm_python

        task_metadata = {METADATA_KEY: self.mauve_cache, **task_metadata}
        if task_name not in self._server_config:  # build the task once to read its scorer settings
            config = _task_manager(task_metadata).load([task_name])["tasks"][task_name].scorer_config
            self._server_config[task_name] = config if config.backend == "vllm" and not config.url else None
        config = self._server_config[task_name]
        if config is None:
            return task_metadata
        if self.server is None:
            if self.device.startswith("cuda"):
                require_cuda_build(vllm_build(vllm_python(config.vllm_python)))
            self.server = VLLMServer(config)
            self._stack.callback(self.server.stop)
            self.server.start()
        return {**task_metadata, "scorer_url": self.server.url}

    def close(self) -> None:
        self._stack.close()


def _task_manager(metadata: dict):
    """The tasks with a setting's metadata. Only this project's folder is indexed: milliseconds, where
    lm-eval's few thousand tasks take seconds per setting."""
    from lm_eval.tasks import TaskManager

    from blockgen.lm_eval import tasks_dir

    return TaskManager(include_path=str(tasks_dir()), include_defaults=False, metadata=metadata)


def _load_model(setting: Setting, g: Grid, device: str, seed: int | None = None):
    """The model as a fresh `lm_eval` process builds it (seeded first), and the torch random state after."""
    import torch

    from blockgen.harness.evaluation.lm_eval_adapter import BlockGenLM

    # what a fresh `lm_eval --seed` process seeds torch with before building it (the adapter's seed)
    torch.manual_seed(lm_eval_seeds(seed)["torch_random_seed"])
    lm = BlockGenLM(pretrained=setting.checkpoint, k_mc=g.k_mc, batch_size=g.batch_size, device=device)
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return lm, (torch.get_rng_state(), cuda)


def _restore(state) -> None:
    import torch

    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def run_sweep(config: SweepConfig) -> SweepReport:
    g = config.resolved_grid()
    todo = settings(g, config.runs)
    shard = str(config.shard) if config.shard else None
    source = config.rate_source(g)
    rates = source.rates if source else None
    costs = priced(g, todo, config.metadata, rates)
    if config.shard is not None:
        owner = split(costs, config.shard.count)
        mine = [i for i, k in enumerate(owner) if k == config.shard.index]
        if config.dry_run:
            print(f"# shard {config.shard}: {len(mine)} of the grid's {len(todo)} settings, "
                  f"{_cost(sum(costs[i] for i in mine), g.offline)} of {_cost(sum(costs), g.offline)} "
                  "(split by priced cost, longest first; an unpriced setting counts as the median price)")
        todo, costs = [todo[i] for i in mine], [costs[i] for i in mine]
    if config.dry_run:
        dry_run(g, todo, metadata=config.metadata, source=source)
        return SweepReport(settings=len(todo), shard=shard)
    _require_checkpoints(g, todo)
    if ranks_from_env().world_size > 1:
        setup_distributed(config.device)  # the process group, before rank 0's first skip decision
    import blockgen.lm_eval
    from blockgen.harness.evaluation.scorer_config import STARTS
    from blockgen.harness.checkpoints.checkpoint import checkpoint_hash

    blockgen.lm_eval.register()
    begin, starts = time.perf_counter(), dict(STARTS)
    report = SweepReport(settings=len(todo), shard=shard)
    root = config.results_root()
    pool = _Scorers(config.metadata, config.device, root)
    by_checkpoint: dict[str, list[Setting]] = {}
    for s in todo:
        by_checkpoint.setdefault(s.checkpoint, []).append(s)
    bar = _Progress(todo, costs, enabled=config.progress and ranks_from_env().is_main)

    def failed(s: Setting, mark: dict, err: Exception) -> None:
        _record_failure(root / s.run / s.label, mark, err)
        report.failed.append(f"{s.run}/{s.label}")
        bar.finished(s)
        if not config.keep_going:  # today's behaviour: stop at the first failure (now recorded)
            raise err

    try:
        for checkpoint, group in by_checkpoint.items():
            group = [replace(s, checkpoint=str(_resolved(s.checkpoint, g))) for s in group]
            sha = checkpoint_hash(group[0].checkpoint)
            marks = [_mark(s, g, sha, config.metadata, config.seed) for s in group]
            # rank 0 reads its results folders and every rank follows: ranks without a shared file
            # system run the same settings (the collectives inside lm-eval match)
            done = decided_on_rank0(lambda: [_done(root / s.run / s.label, m) for s, m in zip(group, marks)])
            pending = [(s, m) for s, m, d in zip(group, marks, done) if not d]
            report.skipped += len(group) - len(pending)
            for s, d in zip(group, done):
                if d:
                    bar.skipped(s)
            if not pending:
                continue
            try:
                lm, rng = _load_model(group[0], g, config.device, config.seed)
            except Exception as err:  # a checkpoint that does not load fails each of its settings
                for s, mark in pending:
                    failed(s, mark, err)
                continue
            report.model_loads += 1
            for s, mark in pending:
                bar.started(s)
                try:
                    _evaluate(s, g, lm, rng, pool, root / s.run / s.label, config.device, config.seed)
                except Exception as err:
                    failed(s, mark, err)
                    continue
                report.ran += 1
                bar.finished(s)
            del lm
    finally:
        bar.close()
        pool.close()
    report.vllm_starts = STARTS["vllm"] - starts.get("vllm", 0)
    report.scorer_loads = STARTS["transformers"] - starts.get("transformers", 0)
    report.seconds = time.perf_counter() - begin
    return report


class _Progress:
    """The sweep's progress bar, weighted by each setting's priced cost (`priced`, as the dry run prices
    it), so that its rate and ETA follow the work rather than the count of settings (one full-scale
    likelihood weighs as much as dozens of generation settings). A skipped setting (done before) leaves
    the total: no work of this run, which would otherwise make the rate look faster than it is."""

    def __init__(self, todo: list[Setting], costs: list[float], enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        self.weights = {(s.run, s.label): cost for s, cost in zip(todo, costs)}
        self.count, self.ended = len(todo), 0
        self.bar = tqdm(total=sum(costs), desc="blockgen sweep", disable=not enabled,
                        bar_format="{desc}: {percentage:3.0f}% of the priced work |{bar}| [{elapsed}<{remaining}]{postfix}")

    def skipped(self, s: Setting) -> None:
        self.ended += 1
        self.bar.total -= self.weights[s.run, s.label]
        self.bar.refresh()

    def started(self, s: Setting) -> None:
        self.bar.set_postfix_str(f"{self.ended}/{self.count} settings; {s.run} {s.label}", refresh=True)

    def finished(self, s: Setting) -> None:
        self.ended += 1
        self.bar.update(self.weights[s.run, s.label])

    def close(self) -> None:
        self.bar.close()


def _require_checkpoints(g: Grid, todo: list[Setting]) -> None:
    """Every checkpoint of the sweep is there before the first model loads: a missing one is a model
    not trained yet, said in one line with the command that trains it."""
    if g.released:  # releases are fetched and converted when they load
        return
    missing = list(dict.fromkeys(s.checkpoint for s in todo if not (Path(s.checkpoint) / "config.json").is_file()))
    if not missing:
        return
    first = next(s for s in todo if s.checkpoint == missing[0])
    more = f" (and {len(missing) - 1} more of the grid's models)" if len(missing) > 1 else ""
    make = "make demo, which trains them into runs/demo" if g.demo else \
        f"make train-{g.benchmark}{' OFFLINE=1' if g.offline else ''}, which trains the grid's models"
    raise ValueError(f"no checkpoint in {missing[0]}{more}: train first: blockgen train --preset {first.run} "
                     f"--out-dir {Path(missing[0]).parent} (or {make})")


def _resolved(checkpoint: str, g: Grid) -> Path | str:
    """A release converted once into a checkpoint folder (the tasks read `pretrained` from their metadata)."""
    if not g.released:
        return checkpoint
    from blockgen.harness.checkpoints.released import resolve

    return resolve(checkpoint)


def _evaluate(s: Setting, g: Grid, lm, rng, pool: _Scorers, folder: Path, device: str, seed: int | None = None) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker

    args = s.model_args(g.k_mc)
    metadata = {**args, **pool.metadata}  # as lm_eval's CLI: --model_args, then --metadata over them
    if s.task in GENPPL_TASKS:
        metadata = pool.metadata_for(s.task, metadata)
    tracker = EvaluationTracker(output_path=str(folder))
    _restore(rng)  # the random state a fresh process has when it starts evaluating
    seeds = lm_eval_seeds(seed)
    results = simple_evaluate(
        model=lm.with_settings(**args), model_args=args, tasks=[s.task], batch_size=g.batch_size, device=device,
        limit=g.limit, log_samples=True, evaluation_tracker=tracker, task_manager=_task_manager(metadata),
        **{**seeds, "torch_random_seed": None}, metadata=None)  # torch: seeded before the model was built
    if results is None:  # ranks other than 0
        return
    # What the `lm_eval` command records for the same run (it names the model type, not the class).
    results["config"].update(model="blockgen", torch_seed=seeds["torch_random_seed"])
    tracker.general_config_tracker.model_source = "blockgen"
    mark = _mark(s, g, lm.checkpoint_hash, pool.metadata, seed)
    results["blockgen_sweep"] = {**mark, "label": s.label}
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for name in results["configs"]:
        tracker.save_results_samples(task_name=name, samples=samples[name])
    _clear_failure(folder, mark)


# ------------------------------------------------------------------------------ command line


def build_parser(parser: argparse.ArgumentParser) -> None:
    """`blockgen sweep` (mounted by harness/cli.py)."""
    parser.add_argument("grid", choices=sorted(GRIDS), help="the benchmark's grid")
    parser.add_argument("--runs", default="runs", help="folder of the models' run folders (<benchmark>[-embedded]-<model>/checkpoint)")
    parser.add_argument("--out-dir", default=None, help="results root (default: RUNS/results)")
    parser.add_argument("--models", nargs="+", default=None, help="a subset of the grid's models (default: all)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=None)
    parser.add_argument("--limit", type=int, default=None, help="problems / samples / chunks per setting (default: the grid's)")
    parser.add_argument("--k-mc", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per torchrun rank)")
    parser.add_argument("--metadata", type=json.loads, default={}, help="task metadata (JSON) for every setting, as lm_eval's")
    parser.add_argument("--dry-run", action="store_true", help="print one line per setting and the estimated cost; run nothing")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="matmul precision of every setting (bfloat16: autocast); default: float32, but "
                             "bfloat16 for the likelihoods of full-scale grids (owt, released-owt)")
    parser.add_argument("--tf32", action="store_true", help="TF32 matmuls on CUDA (opt-in: not measured on a GPU)")
    parser.add_argument("--seed", type=int, default=None,
                        help="as lm_eval's --seed: python, numpy, torch and few-shot seeds (default: lm-eval's 0,1234,1234,1234)")
    parser.add_argument("--shard", type=parse_shard, default=None, metavar="I/N",
                        help="run job I's share of N independent jobs (settings split by priced cost); "
                             "results go to the folders the whole sweep uses")
    parser.add_argument("--rates", default=None, metavar="FILE",
                        help="full-scale grids: the rates file (JSON) the dry run, the shard split and the progress bar "
                             "price with (default: RUNS/gpu-check/rates.json from `make gpu-check` on a GPU, else the "
                             "stored H100 rates; a sharded sweep: the stored ones)")
    parser.add_argument("--keep-going", action="store_true",
                        help=f"record a failing setting ({ERROR_FILE} in its results folder) and go on; "
                             "exit 1 when any failed")


def parse_shard(text: str) -> Shard:
    """`--shard I/N` (argparse's type: a bad value is one line naming the valid form)."""
    index, slash, count = text.partition("/")
    try:
        if not slash:
            raise ValueError
        return Shard(int(index), int(count))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {SHARD_FORM}") from None


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    def tup(x):
        return None if x is None else tuple(x)

    return SweepConfig(grid=args.grid, runs=args.runs, out_dir=args.out_dir, models=tup(args.models),
                       temperatures=tup(args.temperatures), limit=args.limit, k_mc=args.k_mc, batch_size=args.batch_size,
                       device=args.device, metadata=args.metadata, dry_run=args.dry_run, progress=args.progress,
                       dtype=args.dtype, tf32=args.tf32, seed=args.seed, shard=args.shard, keep_going=args.keep_going,
                       rates=args.rates)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        report = run_sweep(config)
    except ValueError as err:
        print(f"blockgen sweep: {err}", file=sys.stderr)
        return 2
    main = ranks_from_env().is_main
    if not config.dry_run and main:
        print("sweep: " + json.dumps(report.__dict__))
    if report.failed and main:
        print(f"blockgen sweep: {len(report.failed)} of {report.settings} settings failed ({ERROR_FILE} in each one's folder "
              f"under {config.results_root()}; a rerun retries them): {', '.join(report.failed)}", file=sys.stderr)
    return 1 if report.failed else 0
