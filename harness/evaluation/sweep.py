"""`blockgen sweep`: the paper's evaluation grids, each model loaded once, one scorer per sweep.

    blockgen sweep owt-embedded --runs runs/ci-pipeline --limit 8 --metadata '{"scorer_model": "runs/ci-pipeline/scorer-text"}'
    blockgen sweep gsm8k --dry-run                        # one line per setting and its price
    blockgen sweep owt --dry-run --rates runs/gpu-check/rates.json   # priced at the rates your GPU measured
    torchrun --nproc_per_node=8 -m blockgen.harness.cli sweep owt --runs runs --device cuda
    blockgen sweep owt --runs runs --device cuda --shard 3/8 --keep-going   # job 3 of 8 independent jobs

A grid (`GRIDS` in harness/evaluation/grids.py, the one home of the evaluation grids; the variants by NFE come
from `paper_variants`) names the models, the tasks and the sampler x NFE x temperature settings; its settings
are listed by harness/evaluation/evaluations.py and priced by harness/evaluation/pricing.py (the dry run,
`--shard I/N`, the progress bar's weights).

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
`blockgen demo` schedules it on its own worker pool, because it trains and evaluates side by side, one
job per core (a sweep loads trained models); each of its evaluations is one `run_task`, the same call of lm-eval.

Several jobs: `--shard I/N` runs job I's share of the grid (split by price: harness/evaluation/pricing.py).
The jobs need no process group with each other (each may be its own
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
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from blockgen.harness.runtime.flags import require_whole_numbers
from blockgen.harness.costs.rates import RateSource, gpu_check_rates, rate_source
from blockgen.harness.evaluation.grids import FULL_FIELD, GRIDS, Grid, ModelSource, grid
from blockgen.harness.evaluation.pricing import SHARD_FORM, Shard, dry_run, headline_price, priced, split
from blockgen.harness.evaluation.evaluations import GENPPL_TASKS, Evaluation, checkpoint_of, evaluations
from blockgen.harness.runtime.distributed import decided_on_rank0, ranks_from_env, setup_distributed
from blockgen.harness.runtime.precision import DTYPES, check_dtype
from blockgen.harness.training.presets import PRESETS
from blockgen.models.sampler_config import SamplerConfig

# What `blockgen sweep --help` says: what the user controls (the module's docstring above is for developers).
COMMAND_HELP = """Evaluate models over a grid of sampler settings (sampler x NFE x temperature) with lm-eval, each model
loaded once. `blockgen sweep GRID --dry-run` lists a grid's models, settings and estimated cost and runs nothing.

    blockgen sweep gsm8k --dry-run                        # one line per setting and its price
    blockgen sweep owt-embedded --runs runs/ci-pipeline --limit 8 --metadata '{"scorer_model": "runs/ci-pipeline/scorer-text"}'
    torchrun --nproc_per_node=8 -m blockgen.harness.cli sweep owt --runs runs --device cuda
    blockgen sweep owt --runs runs --device cuda --shard 3/8 --keep-going   # job 3 of 8 independent jobs

Each setting writes lm-eval's results and per-sample logs under <out-dir>/<model>/<setting>/, the same numbers a
separate `lm_eval` run of that setting gives. A rerun skips the settings already done with the same checkpoint,
limit, task options and seed (--seed S seeds as `lm_eval --seed S` does), and retries failed ones. Under torchrun
the settings run data parallel (the ranks need no shared file system). --shard I/N runs job I of N independent
jobs, split by estimated cost; `blockgen leaderboard collect ROOT...` joins their results into one leaderboard.
--keep-going: a failed setting leaves error.json in its folder, the sweep goes on and exits 1 at the end.
"""


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
    # to folders named with it (`Evaluation.label`), so they never mix with float32 results. None: the
    # grid's (float32, likelihoods of full-scale grids bfloat16: `Grid.likelihood_dtype`)
    dtype: str | None = None
    tf32: bool = False
    seed: int | None = None  # lm_eval's --seed (`lm_eval_seeds`); None: lm-eval's defaults
    shard: Shard | None = None  # run only this job's share of the settings (`split`); None: all
    keep_going: bool = False  # a failed setting is recorded (`error.json`) and the sweep goes on
    rates: str | None = None  # full-scale grids: the rates file pricing them (None: `rates.rate_source`'s choice)
    field_samplers: bool = False  # add the field's samplers (grids.FULL_FIELD) to a grid that has none
    added_samplers: tuple[SamplerConfig, ...] = ()  # more sampler settings on every diffusion model (`--add-sampler`)

    def __post_init__(self) -> None:
        require_whole_numbers(self, "limit", "k_mc", "batch_size")

    def resolved_grid(self) -> Grid:
        g = grid(self.grid)
        if self.models is not None:
            def runnable(m: str) -> bool:  # outside the grid: a preset (owt's blockgen-b1) or a run trained under --runs
                return g.source is not ModelSource.RELEASED and (g.run_name(m) in PRESETS or (Path(checkpoint_of(g, m, self.runs)) / "config.json").is_file())

            unknown = sorted(m for m in self.models if m not in g.models and not runnable(m))
            if unknown:
                others = "" if g.source is ModelSource.RELEASED else f"; or a preset or a run under {self.runs} named {g.run_name('MODEL')}"
                raise ValueError(f"grid {self.grid} has no models {unknown}; choose from {list(g.models)}{others}")
            g = replace(g, models=tuple(self.models))
        for name in ("temperatures", "limit", "k_mc", "batch_size"):
            if getattr(self, name) is not None:
                g = replace(g, **{name: getattr(self, name)})
        if self.field_samplers and not g.field:
            g = replace(g, field=FULL_FIELD)
        if self.added_samplers:
            g = replace(g, field=(*g.field, *self.added_samplers))
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
        if g.source.cpu_scale:
            if self.rates:
                raise ValueError(f"--rates prices full-scale grids; grid {self.grid} is priced from the measured CPU "
                                 "rates of harness/costs/measured_rates/cpu-2-core.json")
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


def _mark(s: Evaluation, g: Grid, sha: str | None, metadata: dict, seed: int | None = None) -> dict:
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
    """Remove the error record of this very setting (same mark) once it has succeeded; or of a try whose checkpoint
    could not be fetched (no hash recorded: its mark names the release, not the folder it converts to)."""
    path = folder / ERROR_FILE
    try:
        recorded = json.loads(path.read_text()).get("blockgen_sweep")
    except (OSError, ValueError, AttributeError):
        return
    if recorded == mark or (isinstance(recorded, dict) and recorded.get("checkpoint_sha", "") is None):
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


def _load_model(setting: Evaluation, g: Grid, device: str, seed: int | None = None):
    """The model as a fresh `lm_eval` process builds it (seeded first), and the torch random state after."""
    import torch

    from blockgen.harness.evaluation.lm_eval_model.model import BlockGenLM

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
    todo = evaluations(g, config.runs)
    shard = str(config.shard) if config.shard else None
    source = config.rate_source(g)
    rates = source.rates if source else None
    costs = priced(g, todo, config.metadata, rates)
    if config.shard is not None:
        owner = split(costs, config.shard.count)
        mine = [i for i, k in enumerate(owner) if k == config.shard.index]
        if config.dry_run:
            print(f"# shard {config.shard}: {len(mine)} of the grid's {len(todo)} settings, "
                  f"{headline_price(sum(costs[i] for i in mine), g.source.cpu_scale)} of {headline_price(sum(costs), g.source.cpu_scale)} "
                  "(split by priced cost, longest first; an unpriced setting counts as the median price)")
        todo, costs = [todo[i] for i in mine], [costs[i] for i in mine]
    if config.dry_run:
        dry_run(g, todo, metadata=config.metadata, source=source)
        return SweepReport(settings=len(todo), shard=shard)
    _require_checkpoints(g, todo)
    if ranks_from_env().world_size > 1:
        setup_distributed(config.device)  # the process group, before rank 0's first skip decision
    from blockgen.harness.evaluation.scorer_config import STARTS
    from blockgen.harness.checkpoints.checkpoint import checkpoint_hash

    begin, starts = time.perf_counter(), dict(STARTS)
    report = SweepReport(settings=len(todo), shard=shard)
    root = config.results_root()
    pool = _Scorers(config.metadata, config.device, root)
    by_checkpoint: dict[str, list[Evaluation]] = {}
    for s in todo:
        by_checkpoint.setdefault(s.checkpoint, []).append(s)
    bar = _Progress(todo, costs, enabled=config.progress and ranks_from_env().is_main)

    def failed(s: Evaluation, mark: dict, err: Exception) -> None:
        _record_failure(root / s.run / s.label, mark, err)
        report.failed.append(f"{s.run}/{s.label}")
        bar.finished(s)
        if not config.keep_going:  # today's behaviour: stop at the first failure (now recorded)
            raise err

    try:
        for checkpoint, group in by_checkpoint.items():
            try:  # a release fetched now (the hub gone mid-sweep, a missing file) fails its settings, not the sweep
                group = [replace(s, checkpoint=str(_resolved(s.checkpoint, g))) for s in group]
                sha = checkpoint_hash(group[0].checkpoint)
            except Exception as err:
                for s in group:  # marked without a hash: no results file can match it, so a rerun runs them
                    failed(s, _mark(s, g, None, config.metadata, config.seed), err)
                continue
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

    def __init__(self, todo: list[Evaluation], costs: list[float], enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        self.weights = {(s.run, s.label): cost for s, cost in zip(todo, costs)}
        self.count, self.ended = len(todo), 0
        self.bar = tqdm(total=sum(costs), desc="blockgen sweep", disable=not enabled,
                        bar_format="{desc}: {percentage:3.0f}% of the priced work |{bar}| [{elapsed}<{remaining}]{postfix}")

    def skipped(self, s: Evaluation) -> None:
        self.ended += 1
        self.bar.total -= self.weights[s.run, s.label]
        self.bar.refresh()

    def started(self, s: Evaluation) -> None:
        self.bar.set_postfix_str(f"{self.ended}/{self.count} settings; {s.run} {s.label}", refresh=True)

    def finished(self, s: Evaluation) -> None:
        self.ended += 1
        self.bar.update(self.weights[s.run, s.label])

    def close(self) -> None:
        self.bar.close()


def _require_checkpoints(g: Grid, todo: list[Evaluation]) -> None:
    """Every checkpoint of the sweep is there before the first model loads: a missing one is a model
    not trained yet, said in one line with the command that trains it."""
    if g.source is ModelSource.RELEASED:  # releases are fetched and converted when they load
        return
    missing = list(dict.fromkeys(s.checkpoint for s in todo if not (Path(s.checkpoint) / "config.json").is_file()))
    if not missing:
        return
    first = next(s for s in todo if s.checkpoint == missing[0])
    more = f" (and {len(missing) - 1} more of the grid's models)" if len(missing) > 1 else ""
    make = "make demo, which trains them into runs/demo" if g.source is ModelSource.DEMO else \
        f"make train-{g.benchmark}{' OFFLINE=1' if g.source is ModelSource.EMBEDDED else ''}, which trains the grid's models"
    raise ValueError(f"no checkpoint in {missing[0]}{more}: train first: blockgen train --preset {first.run} "
                     f"--out-dir {Path(missing[0]).parent} (or {make})")


def _resolved(checkpoint: str, g: Grid) -> Path | str:
    """A release converted once into a checkpoint folder (the tasks read `pretrained` from their metadata)."""
    if g.source is not ModelSource.RELEASED:
        return checkpoint
    from blockgen.harness.checkpoints.release_import import resolve

    return resolve(checkpoint)


def run_task(model: Any, model_args: dict, task: str, metadata: dict, *, batch_size: int | str, device: str,
             limit: int | None, log_samples: bool, tracker: Any = None, seed: int | None = None,
             torch_seeded: bool = False) -> dict | None:
    """The one call of lm-eval's `simple_evaluate` in this project (`blockgen sweep`, CI's checks through it,
    and the demo's word problems): `task` on `model` (the model type's name, built from `model_args`, or a
    loaded `BlockGenLM`), with the task metadata `metadata` (as `lm_eval --model_args ... --metadata ...`),
    seeded as `lm_eval --seed seed` (`torch_seeded`: torch was seeded before the model was built, as a fresh
    process would have it). None on torchrun ranks other than 0."""
    from lm_eval import simple_evaluate

    import blockgen.lm_eval

    blockgen.lm_eval.register()  # idempotent; this process may not have the start-up hook
    seeds = lm_eval_seeds(seed)
    if torch_seeded:
        seeds["torch_random_seed"] = None
    return simple_evaluate(model=model, model_args=model_args, tasks=[task], batch_size=batch_size, device=device,
                           limit=limit, log_samples=log_samples, evaluation_tracker=tracker,
                           task_manager=_task_manager(metadata), metadata=None, **seeds)


def _evaluate(s: Evaluation, g: Grid, lm, rng, pool: _Scorers, folder: Path, device: str, seed: int | None = None) -> None:
    from lm_eval.loggers import EvaluationTracker

    args = s.model_args(g.k_mc)
    metadata = {**args, **pool.metadata}  # as lm_eval's CLI: --model_args, then --metadata over them
    if s.task in GENPPL_TASKS:
        metadata = pool.metadata_for(s.task, metadata)
    tracker = EvaluationTracker(output_path=str(folder))
    _restore(rng)  # the random state a fresh process has when it starts evaluating
    results = run_task(lm.with_settings(**args), args, s.task, metadata, batch_size=g.batch_size, device=device,
                       limit=g.limit, log_samples=True, tracker=tracker, seed=seed, torch_seeded=True)
    if results is None:  # ranks other than 0
        return
    # What the `lm_eval` command records for the same run (it names the model type, not the class).
    results["config"].update(model="blockgen", torch_seed=lm_eval_seeds(seed)["torch_random_seed"])
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
    parser.add_argument("--list-models", action="store_true",
                        help="print the grid's models (space-separated, as the Makefile reads them) and exit")
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
    parser.add_argument("--field-samplers", action="store_true",
                        help="also run the field's samplers (confidence threshold, entropy bound, low-confidence "
                             "remasking; three settings each) on every diffusion model of a grid that has none")
    parser.add_argument("--add-sampler", dest="added_samplers", type=sampler_spec, action="append", default=[],
                        metavar="MODEL_ARGS", help="one more sampler setting on every diffusion model, in --model_args' "
                                                   "spelling, e.g. 'sampler=confidence_threshold,threshold=0.8' (repeatable)")
    parser.add_argument("--keep-going", action="store_true",
                        help=f"record a failing setting ({ERROR_FILE} in its results folder) and go on; "
                             "exit 1 when any failed")


def sampler_spec(text: str) -> SamplerConfig:
    """`--add-sampler`'s value, in `--model_args`' spelling: "sampler=NAME[,steps=N,ge=G,warmup=W,block_size=B]" and
    the sampler's own settings (e.g. "sampler=confidence_threshold,threshold=0.8"); the grid sets the temperature."""
    from lm_eval.utils import simple_parse_args_string

    from blockgen.harness.evaluation.lm_eval_model.arguments import BlockGenLMArgs

    try:
        a = BlockGenLMArgs.parse({"pretrained": "-", **simple_parse_args_string(text)})
        if not a.sampler:
            raise ValueError("name the sampler: sampler=NAME")
        given = {k: getattr(a, k) for k in ("steps", "ge", "warmup", "block_size") if getattr(a, k) is not None}
        return SamplerConfig(a.sampler, **given, options=a.sampler_options)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None


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
                       rates=args.rates, field_samplers=args.field_samplers, added_samplers=tuple(args.added_samplers))


def run(args: argparse.Namespace) -> int:
    if args.list_models:  # the Makefile's model lists (train-owt, eval-owt, ...): the grid is their one home
        print(" ".join(grid(args.grid).models))
        return 0
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
