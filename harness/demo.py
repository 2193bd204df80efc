"""The embedded default: train the demo models offline on CPU, sweep the samplers, write a leaderboard.

Data are generated word problems (`wordproblems`, level "easy" unless `--difficulty` says otherwise),
the tokenizer is trained locally, the models are tiny; nothing touches the network. The work is a set
of jobs (one training run per model, then one `lm_eval` run of `gsm8k_code_embedded` per sampler
setting and one likelihood pass per model) spread over `jobs` single-threaded worker processes, one
per usable core: small models use one core well, and a job that shares its core with another program
slows down in proportion instead of stalling a team of OpenMP threads (bench/README.md, "Sharing the machine").
The AR model trains first and alone, on every worker's core, since the mixtures start from its
weights (`WARM_STARTS`) and nothing else can run before it.

Nothing is lost on a crash: models are normal checkpoints under `out_dir/<preset>/checkpoint` (a
rerun resumes them; a finished one is kept by its record `demo-training.json`, its likelihood pass by
`demo-likelihood.json`) and each evaluation is a results file under `out_dir/results/` that a rerun
keeps while the checkpoint it scored is unchanged: a rerun with nothing left to do starts no worker. The demo ends with `out_dir/leaderboard.json`
(leaderboard schema), a printed table, PNG plots and the static page under `out_dir/page/`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

from tqdm.auto import tqdm

# The demo's grid lives with the other grids in harness/evaluation/grids.py (`blockgen sweep demo --dry-run`).
from blockgen.harness.evaluation.grids import DEMO_MAX_GEN_TOKS, DEMO_NFES
from blockgen.harness.evaluation.grids import DEMO_VARIANTS as DIFFUSION_VARIANTS
from blockgen.harness.evaluation.grids import demo_samplers as samplers_for
from blockgen.harness.evaluation.grids import LANGUAGE_NFES, LANGUAGE_TASK, language_samplers, sampler_label
from blockgen.harness.training.presets import DEMO_PRESETS, LANGUAGE_PRESETS, WARM_STARTS, preset
from blockgen.harness.training.train_config import TrainConfig
from blockgen.harness.data.wordproblems import DEFAULT_DIFFICULTY
from blockgen.models.sampler_config import SamplerConfig


@dataclass(frozen=True)
class DemoConfig:
    out_dir: str = "runs/demo"
    presets: tuple[str, ...] = DEMO_PRESETS + LANGUAGE_PRESETS
    max_steps: int | None = None  # override every preset's step count
    problems: int = 256  # held-out test problems per evaluation (400 and NFE 8 went for the 30 minutes: docs/demo.md)
    jobs: int = 0  # worker processes (one thread each); 0: one per usable core
    # 0.1: what tiny models need (docs/results.md: T = 1.0 costs the uniform mixture 5-8 points);
    # add 1.0, the paper's GSM8K temperature, for the full sweep (`make sweep`).
    temperatures: tuple[float, ...] = (0.1,)
    nfes: tuple[int, ...] = DEMO_NFES
    # The synthetic language's models (`lang-*` presets): held-out prompts per setting, and NFEs per block.
    language_prompts: int = 128
    language_nfes: tuple[int, ...] = LANGUAGE_NFES
    difficulty: str | None = None  # the generator's level; None: the presets' ("easy")
    batch_size: int = 32
    # Training seeds: one run of every model per seed (weights, batch order, noise; the same data).
    # Seed 0 lives in out_dir itself, seed s > 0 in out_dir/seed-s, so one seed's demo is reused.
    seeds: tuple[int, ...] = (0,)
    # Train every model and measure its held-out likelihood, without the sampler sweep: with several seeds,
    # whether training is robust to the seed (`training_spread`) at a third of the demo's time.
    train_only: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.nfes) - set(DIFFUSION_VARIANTS))
        if unknown:
            raise ValueError(f"no sampler variants for NFE {unknown}; choose from {sorted(DIFFUSION_VARIANTS)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds={self.seeds}: need distinct seeds >= 0")
        if not set(self.language_nfes) <= set(LANGUAGE_NFES):
            raise ValueError(f"language_nfes={self.language_nfes}: choose from {list(LANGUAGE_NFES)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps}: choose a whole number >= 1 (or leave it out: each preset's own)")
        if self.problems < 1 or self.jobs < 0 or self.language_prompts < 1:
            raise ValueError(f"problems={self.problems}, jobs={self.jobs}, language_prompts={self.language_prompts}: "
                             "need problems >= 1, jobs >= 0 and language_prompts >= 1")


def seed_dir(out_dir: str | Path, seed: int) -> Path:
    """Where the run of training seed `seed` lives: out_dir for seed 0, out_dir/seed-<seed> otherwise."""
    return Path(out_dir) if seed == 0 else Path(out_dir) / f"seed-{seed}"


def is_language(train_config: TrainConfig) -> bool:
    """A model of the synthetic language (scored by synthlang_gen), not of the word problems."""
    from blockgen.harness.data.sources import LANGUAGE

    return train_config.data.source == LANGUAGE


def model_config(config: DemoConfig, name: str, seed: int = 0) -> TrainConfig:
    base = preset(name)
    # One data cache for every seed: the seeds vary the training run, not the problems.
    data = replace(base.data, cache_dir=str(Path(config.out_dir) / "data"))
    if config.difficulty is not None and not is_language(base):
        data = replace(data, difficulty=config.difficulty)
    overrides = {"out_dir": str(seed_dir(config.out_dir, seed) / name), "data": data, "seed": seed}
    if config.max_steps is not None:
        overrides["max_steps"] = config.max_steps
    return replace(base, **overrides)


# ------------------------------------------------------------------------------ jobs (worker side)


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)
    _stop_with_parent(os.getppid())


def _stop_with_parent(parent: int) -> None:
    """A worker whose demo is gone (killed by a signal that runs no cleanup, e.g. `kill -9` or the OOM killer)
    would train or evaluate on for minutes unwatched: it sends itself SIGTERM instead, which a training answers by
    saving its checkpoint at the next step (rerunning the demo resumes it) and anything else by ending, then exits
    once its job has returned (the pool's loop would wait for the dead demo's next job forever)."""
    import signal

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        with _JOB_RUNNING:  # the training's save done
            os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="stop-with-parent", daemon=True).start()


_JOB_RUNNING = threading.Lock()  # held by a worker process while it runs a job (`_logged`)


def _logged(log: Path, fn, *args):
    """Run fn with its output (progress bars, lm-eval's log) in a file: workers run side by side."""
    import logging

    log.parent.mkdir(parents=True, exist_ok=True)
    with _JOB_RUNNING, open(log, "a") as f, redirect_stdout(f), redirect_stderr(f):
        handler = logging.StreamHandler(f)
        logging.getLogger().addHandler(handler)
        try:
            return fn(*args)
        finally:
            logging.getLogger().removeHandler(handler)


def _train_job(config: TrainConfig, threads: int) -> dict:
    """Train one model; `threads` > 1 only for a job that runs alone (nothing else can run yet)."""
    import torch

    from blockgen.harness.training.train import train

    start = time.perf_counter()
    torch.set_num_threads(threads)
    try:
        checkpoint = train(config)
    finally:
        torch.set_num_threads(1)
    return {"checkpoint": str(checkpoint), "train_seconds": round(time.perf_counter() - start, 1), "threads": threads,
            "init_from": config.init_from}


def _eval_job(checkpoint: str, sampler: SamplerConfig, config: DemoConfig, difficulty: str, out: str) -> dict:
    from blockgen.harness.evaluation.wordproblem_eval import evaluate_embedded

    return evaluate_embedded(checkpoint, sampler, config.problems, max_gen_toks=DEMO_MAX_GEN_TOKS,
                             batch_size=config.batch_size, difficulty=difficulty, results_path=out)


def _task_settings(config: DemoConfig, train_config: TrainConfig, difficulty: str) -> dict:
    """The task settings (lm-eval metadata) of a model's evaluations: what a kept results file must match."""
    if is_language(train_config):
        return {"language": train_config.data.language, "prompts": config.language_prompts}
    return {"embedded_problems": config.problems, "difficulty": difficulty}


def _language_eval_job(checkpoint: str, sampler: SamplerConfig, config: DemoConfig, language: str, out: str) -> dict:
    from blockgen.harness.evaluation.wordproblem_eval import evaluate_task

    results = evaluate_task(checkpoint, sampler, LANGUAGE_TASK, {"language": language, "prompts": config.language_prompts},
                            batch_size=config.batch_size, results_path=out)
    return {k.split(",")[0]: v for k, v in results["results"][LANGUAGE_TASK].items() if "," in k}


def _validation_examples(train_config: TrainConfig, tokenizer):
    """The likelihood pass's held-out examples: word problems (the question as a clean prompt, the
    program scored), or the language's held-out documents as `BOS words`, every word scored and one
    token (so an NLL per token is one per word, comparable with the exact NLL)."""
    from blockgen.harness.checkpoints.tokenizer import special_tokens
    from blockgen.harness.data.sources import Examples, encode_problems

    data = train_config.data
    special = special_tokens(tokenizer)
    if not is_language(train_config):
        from blockgen.harness.data.wordproblems import generate, to_records

        problems = to_records(generate("validation", data.n_val, data.seed, data.difficulty))
        return encode_problems(problems, tokenizer, special, train_config.seq_len)[0], None
    import torch

    from blockgen.harness.data.language import DOC_SYMBOLS, document_rows, load_language

    language = load_language(data.language)
    rows = document_rows(language, data.n_val)
    ids = [[special.bos, *tokenizer.encode(language.text(r), add_special_tokens=False)] for r in rows]
    if any(len(i) != 1 + DOC_SYMBOLS for i in ids):
        raise ValueError("the language's tokenizer splits a word into several tokens: NLL per token is not per word")
    tokens = torch.tensor(ids)
    n = len(ids)
    true_nll = -sum(language.log_prob(r) for r in rows)
    return Examples(tokens, torch.ones(n, dtype=torch.int32), torch.full((n,), tokens.shape[1], dtype=torch.int32)), \
        {"nll_true": true_nll / (n * DOC_SYMBOLS), "entropy_rate": language.entropy_rate}


def _likelihood_job(checkpoint: str, train_config: TrainConfig) -> dict:
    """Validation NLL per token under each trained block size alone and under the mixture's bounds; for the
    language also the exact NLL of the same documents (`nll_true`) and the entropy rate."""
    import torch

    from blockgen.harness.checkpoints.checkpoint import load_checkpoint
    from blockgen.harness.reports.findings import WORST_SEQUENCES
    from blockgen.models.objectives import jensen_bound, lse_bound

    model, tokenizer = load_checkpoint(checkpoint)
    val, exact = _validation_examples(train_config, tokenizer)
    gen = torch.Generator().manual_seed(0)
    sizes = model.mixture.sizes
    per_size = torch.zeros(len(sizes), len(val), dtype=torch.float64)
    with torch.inference_mode():
        for i in range(0, len(val), 32):
            b = val[i : i + 32]
            lm = b.loss_mask.float()
            per_size[:, i : i + 32] = model.nll_by_block_size(b.tokens, lm, train_config.k_mc, b.condition_mask, gen).double()
    tokens = float(val.loss_mask.sum())
    weights = model.mixture.weights
    out = {f"nll_block_{s}": float(per_size[j].sum()) / tokens for j, s in enumerate(sizes)}
    per_sequence = lse_bound(per_size, weights)
    out["nll_lse"] = float(per_sequence.sum()) / tokens
    # A near-deterministic task's NLL can be a handful of confidently wrong sequences: how much the worst carry.
    worst = per_sequence.topk(min(WORST_SEQUENCES, len(val))).values
    out |= {"worst_sequences": len(worst), "worst_sequences_share": float(worst.sum() / per_sequence.sum())}
    out["nll_jensen"] = float(jensen_bound(per_size, weights).sum()) / tokens
    out.update(tokens=int(tokens), sequences=len(val), k_mc=train_config.k_mc, **(exact or {}))
    return out


# ------------------------------------------------------------------------------ the run (main side)


def _provenance() -> dict:
    from blockgen.harness.reports.leaderboard import provenance

    return provenance(" ".join(["blockgen", *sys.argv[1:]]))


def _fresh(results_path: Path, checkpoint_sha: str, settings: dict) -> bool:
    """A results file from an earlier run that scored the checkpoint with this hash on the task's same
    `settings` (problems, level or language, prompts: its metadata) and kept its per-problem samples
    (older runs did not: they are rerun, so comparisons can be paired)."""
    from blockgen.harness.evaluation.wordproblem_eval import samples_path

    if not samples_path(results_path).is_file():
        return False
    try:
        results = json.loads(results_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    metadata = [task.get("metadata", {}) for task in results.get("configs", {}).values()]
    return results.get("config", {}).get("model_sha") == checkpoint_sha and len(metadata) == 1 and \
        all(metadata[0].get(k) == v for k, v in settings.items())


# A model's finished jobs other than its evaluations (those are results files, `_fresh`): the training run and the
# likelihood pass, each recorded beside the checkpoint with what it depended on, so a rerun reuses them as it
# reuses the results files, without starting a worker process.
def _training_record(train_config: TrainConfig) -> Path:
    return Path(train_config.out_dir) / "demo-training.json"


@functools.lru_cache(maxsize=None)
def _prepared_name(data, seq_len: int) -> str:
    from blockgen.harness.data.prepare import prepared_dir

    return prepared_dir(data, seq_len).name  # hashes the tokenizer (its rules and training text) and the data


def _training_key(train_config: TrainConfig) -> dict:
    """What a trained checkpoint depended on: its settings, the data as tokenized, and the weights it started from,
    so a changed tokenizer or a retrained warm-start parent trains it again instead of keeping a stale model."""
    key = {"config": train_config.to_dict(), "prepared": _prepared_name(train_config.data, train_config.seq_len)}
    if train_config.init_from is not None:
        key["init_from_sha"] = _checkpoint_sha(Path(train_config.init_from))
    return key


def _likelihood_record(train_config: TrainConfig) -> Path:
    return Path(train_config.out_dir) / "demo-likelihood.json"


def _likelihood_key(train_config: TrainConfig) -> dict:
    return {"data": train_config.to_dict()["data"], "seq_len": train_config.seq_len, "k_mc": train_config.k_mc}


def _write_record(path: Path, key: dict, checkpoint_sha: str, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "checkpoint_sha": checkpoint_sha, "result": result}, indent=2))
    tmp.replace(path)


def _fresh_record(path: Path, key: dict, checkpoint_sha: str | None) -> dict | None:
    """The recorded result when it was made under `key` from the checkpoint with this hash; None when any of
    it differs or is missing (no checkpoint: `checkpoint_sha` None)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    fresh = checkpoint_sha is not None and record.get("checkpoint_sha") == checkpoint_sha
    # compared as stored: tuples are lists there
    return record.get("result") if fresh and record.get("key") == json.loads(json.dumps(key)) else None


def _checkpoint_sha(directory: Path) -> str | None:
    from blockgen.harness.checkpoints.checkpoint import checkpoint_hash

    try:
        return checkpoint_hash(directory)
    except OSError:  # not trained yet, or an incomplete directory
        return None


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_demo(config: DemoConfig) -> dict:
    """Every seed's run in turn (each trains, evaluates and writes its leaderboard); with several
    seeds, the findings across the runs (harness/reports/findings.py) in out_dir/findings.json."""
    summaries = {}
    for i, seed in enumerate(config.seeds):
        if len(config.seeds) > 1:
            print(f"demo: training seed {seed} ({i + 1} of {len(config.seeds)}) -> {seed_dir(config.out_dir, seed)}", flush=True)
        summaries[seed] = _run_seed(config, seed)
    if len(config.seeds) == 1:
        return summaries[config.seeds[0]]
    from blockgen.harness.reports.findings import write_findings, write_training_spread

    run_dirs = [seed_dir(config.out_dir, seed) for seed in config.seeds]
    write_training_spread(config, run_dirs)
    if not config.train_only:
        write_findings(config, run_dirs)
    return {"seeds": summaries}


def _run_seed(config: DemoConfig, seed: int) -> dict:
    from blockgen.harness.data.sources import get_tokenizer

    out = seed_dir(config.out_dir, seed)
    out.mkdir(parents=True, exist_ok=True)
    models = {name: model_config(config, name, seed) for name in config.presets}
    levels = {m.data.difficulty for m in models.values() if not is_language(m)}
    if len(levels) > 1:
        raise ValueError(f"the demo's models train on different generator levels {sorted(levels)}; pass --difficulty")
    difficulty = next(iter(levels), DEFAULT_DIFFICULTY)
    for train_config in models.values():  # once, here: workers must not race to build the shared tokenizer
        get_tokenizer(train_config.data)
    jobs = config.jobs or usable_cores()
    print(f"demo: {len(models)} models on {jobs} worker process(es), one thread each (a training run that nothing else can run beside gets all {jobs}); "
          + (f"generator level {difficulty!r}{'' if difficulty == DEFAULT_DIFFICULTY else ' (not the default)'}; " if levels else "")
          + f"logs under {out / 'logs'}", flush=True)
    # A model whose warm-start parent is in the demo trains after it, from its weights.
    children: dict[str, list[str]] = {name: [] for name in models}
    for name in models:
        parent = WARM_STARTS.get(name)
        if parent in models:
            models[name] = replace(models[name], init_from=str(Path(models[parent].out_dir) / "checkpoint"))
            children[parent].append(name)
            print(f"demo: {name} starts from the weights of {parent}", flush=True)
        elif parent is not None:
            print(f"demo: {name} trains from random weights ({parent}, its usual starting point, is not in this run)", flush=True)
    first = [name for name in models if models[name].init_from is None]
    # Idle OpenMP threads sleep instead of spinning: a multi-threaded stage beside another busy program
    # then slows down about in proportion instead of several-fold (bench/bench_contention.py). Same
    # arithmetic, so the same numbers. The workers are spawned processes: they read it at start-up.
    saved_policy = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        return _run_jobs(config, out, models, children, first, jobs, difficulty)
    finally:
        if saved_policy is None:
            os.environ.pop("OMP_WAIT_POLICY", None)


def _training_progress(models: dict[str, TrainConfig], training: list[str]) -> str:
    """'gsm-ar step 340/1200' for the running training jobs, from their metrics.jsonl (the jobs run in
    other processes; the job bar would otherwise sit still through the longest stage)."""
    parts = []
    for name in training:
        path = Path(models[name].out_dir) / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 4096))
                last = f.read().splitlines()[-1]
            step = json.loads(last)["step"]
        except (OSError, IndexError, ValueError, KeyError):
            step = 0
        parts.append(f"{name} step {step}/{models[name].max_steps}")
    return ", ".join(parts)


def _run_jobs(config: DemoConfig, out: Path, models: dict[str, TrainConfig], children: dict[str, list[str]],
              first: list[str], jobs: int, difficulty: str) -> dict:
    from blockgen.harness.checkpoints.checkpoint import checkpoint_hash

    start = time.perf_counter()
    summary: dict[str, dict] = {name: {} for name in models}
    results_files: dict[str, list[Path]] = {name: [] for name in models}
    bar = tqdm(desc="demo jobs", unit="job", total=len(models))
    # Worker processes start at the first job submitted: a rerun with everything fresh starts none.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_worker_init) as pool:
        pending: dict[Future, tuple] = {}
        waiting: list[str] = []  # first models held back until the lead ones are trained

        def submit_training(name: str, threads: int) -> None:
            sha = _checkpoint_sha(Path(models[name].out_dir) / "checkpoint")
            if (record := _fresh_record(_training_record(models[name]), _training_key(models[name]), sha)) is not None:
                bar.write(f"{name}: trained earlier ({record['train_seconds']:.0f} s), checkpoint unchanged: kept")
                trained(name, record, sha)
                return
            log = out / "logs" / f"train-{name}.log"
            pending[pool.submit(_logged, log, _train_job, models[name], threads)] = ("train", name)

        def trained(name: str, result: dict, sha: str) -> None:
            summary[name].update(result)
            checkpoint = result["checkpoint"]
            released, waiting[:] = list(waiting), []
            for child in children[name] + released:  # before this model's evaluations: the longer jobs first
                submit_training(child, 1)
            nll_key = _likelihood_key(models[name])
            if (nll := _fresh_record(_likelihood_record(models[name]), nll_key, sha)) is not None:
                summary[name]["likelihood"] = nll
            else:
                pending[pool.submit(_logged, out / "logs" / f"nll-{name}.log", _likelihood_job, checkpoint, models[name])] = (
                    "nll", name, sha)
                bar.total += 1
            language = is_language(models[name])
            samplers = [] if config.train_only else (language_samplers(models[name].block_sizes, config.language_nfes) if language
                        else samplers_for(models[name].block_sizes, config.temperatures, config.nfes))
            settings = _task_settings(config, models[name], difficulty)
            for sampler in samplers:
                label = sampler_label(sampler)
                path = out / "results" / name / f"{label}.json"
                results_files[name].append(path)
                if _fresh(path, sha, settings):
                    continue
                log = out / "logs" / f"eval-{name}-{label}.log"
                job = (_language_eval_job, checkpoint, sampler, config, models[name].data.language, str(path)) if language \
                    else (_eval_job, checkpoint, sampler, config, difficulty, str(path))
                pending[pool.submit(_logged, log, *job)] = ("eval", name, label)
                bar.total += 1
            bar.update()
            bar.refresh()

        # The models others start from go first and alone (the word problems' AR parent on every core: it is the
        # critical path, and one thread beside another training ran 1.76 s/step against 0.8 s/step on two);
        # the other first models (the language's) start when it is done.
        lead = [name for name in first if children[name]] or first
        waiting.extend(name for name in first if name not in lead)
        for name in lead:
            submit_training(name, jobs if len(lead) == 1 else 1)
        while pending:
            done, _ = wait(pending, timeout=15, return_when=FIRST_COMPLETED)
            training = [job[1] for job in pending.values() if job[0] == "train"]
            bar.set_postfix_str(_training_progress(models, training) if training else "", refresh=True)
            for future in done:
                kind, name, *rest = pending.pop(future)
                result = future.result()  # a failed job stops the demo with its error (its log says more)
                if kind == "train":
                    bar.write(f"trained {name} in {result['train_seconds']:.0f} s -> {result['checkpoint']}")
                    sha = checkpoint_hash(result["checkpoint"])  # once per model: it reads the weights
                    _write_record(_training_record(models[name]), _training_key(models[name]), sha, result)
                    trained(name, result, sha)
                    continue
                bar.update()
                if kind == "nll":
                    summary[name]["likelihood"] = result
                    _write_record(_likelihood_record(models[name]), _likelihood_key(models[name]), rest[0], result)
                elif "invalid_pairs" in result:
                    bar.write(f"{name:<16} {rest[0]:<30} broken pairs {_pct(result['invalid_pairs'])}, "
                              f"true NLL/word {result['true_nll']:.3f}")
                else:
                    bar.write(f"{name:<16} {rest[0]:<30} accuracy {_pct(result['accuracy'])} ± {_pct(result['accuracy_stderr'])}")
    bar.close()
    summary_doc = {"provenance": _provenance(), "wall_seconds": round(time.perf_counter() - start, 1), "models": summary}
    (out / "summary.json").write_text(json.dumps(summary_doc, indent=2))
    if config.train_only:  # no sweep: no leaderboard to write, the likelihoods are in summary.json
        print(f"demo: trained in {summary_doc['wall_seconds'] / 60:.1f} min (--train-only: no sampler sweep); {out / 'summary.json'}")
        return summary_doc
    _finish(_leaderboard(config, out, models, summary, results_files, difficulty), out)
    print(f"demo: done in {summary_doc['wall_seconds'] / 60:.1f} min; {out / 'leaderboard.json'}, {out / 'page' / 'index.html'}")
    return summary_doc


def _leaderboard(config: DemoConfig, out: Path, models: dict[str, TrainConfig], summary: dict, results_files: dict, difficulty: str):
    from blockgen.harness.reports.leaderboard import Leaderboard, Row, rows_from_results, write

    rows: list[Row] = []
    for name, paths in results_files.items():
        train_config = models[name]
        parent = WARM_STARTS[name] if train_config.init_from else None  # train_steps counts this model's own steps
        note = f"warm-started from {parent} ({models[parent].max_steps} steps)" if parent else None
        for path in paths:
            rows += [replace(r, note=note) for r in rows_from_results(json.loads(path.read_text()), str(path), model=name)]
        nll = summary[name].get("likelihood", {})
        common = dict(model=name, task=likelihood_task(train_config), higher_is_better=False, n=nll.get("sequences"),
                      prior=train_config.prior if train_config.block_sizes != (1,) else None,
                      block_sizes=list(train_config.block_sizes), block_weights=list(train_config.block_weights),
                      train_steps=train_config.max_steps, k_mc=nll.get("k_mc"), source=str(out / "summary.json"),
                      note=note)
        rows += [Row(metric=metric, value=value, **common) for metric, value in nll.items()
                 if metric.startswith("nll_") or metric == "entropy_rate"]
    board = Leaderboard(rows=rows, description=(
        f"make demo: tiny models trained on CPU (training seed {next(iter(models.values())).seed}) on the embedded word "
        f"problems (level {difficulty!r}: gsm8k_code_embedded accuracy on {config.problems} held-out problems per sampler "
        f"setting) and on the synthetic language (synthlang_gen on {config.language_prompts} held-out prompts per "
        "setting, scored exactly); validation NLL per token per block size and under the mixture bounds (the "
        "language's: per word, beside its exact NLL)"), provenance=_provenance())
    write(board, out / "leaderboard.json")
    return board


def likelihood_task(train_config: TrainConfig) -> str:
    """The leaderboard task name of a model's likelihood pass."""
    return "synthlang_validation_nll" if is_language(train_config) else "wordproblems_validation_nll"


def _finish(board, out: Path) -> None:
    from blockgen.harness.reports.page import build_page
    from blockgen.harness.reports.plots import plot_language_quality

    print_table(board.rows)
    if plot_language_quality(board.rows, out / "language.png"):
        print(f"the language's exact sample quality against NFE: {out / 'language.png'}")
    page = build_page(board.rows, out / "page", sources=[str(out / "leaderboard.json")])
    print(f"plots and page: {page.parent}")


def _pct(share: float | None) -> str:
    return "n/a" if share is None or (isinstance(share, float) and math.isnan(share)) else f"{share:.1%}"


def print_table(rows) -> None:
    """Accuracy (± standard error), NFE, speed and calls per model and sampler setting; NLL per model. NFE: the
    paper's label, or an adaptive sampler's mean calls per block of a row; calls/blk: a row's mean and most;
    tok/fwd: generated tokens per model call of a row; tok/s: generated tokens per second."""
    from blockgen.harness.reports.leaderboard import nfe_text

    acc = sorted((r for r in rows if r.metric == "exact_match"),
                 key=lambda r: (r.model, r.temperature or 0, r.nfe_per_block or 0, r.sampler or ""))
    header = (f"{'model':<16} {'sampler':<20} {'T':>4} {'NFE':>5} {'setting':>12} {'accuracy':>16} {'calls/blk':>10} "
              f"{'tok/fwd':>7} {'tok/s':>7}")
    print(header)
    print("-" * len(header))
    for r in acc:
        own = ",".join(f"{k}={v:g}" for k, v in (r.options or {}).items())
        settings = "" if r.sampler.startswith("ar_") else own or f"{r.steps},{r.ge},{r.warmup}"
        temp = "" if r.sampler == "ar_greedy" else f"{r.temperature:g}"
        mean = r.calls_per_block_per_row if r.calls_per_block_per_row is not None else r.model_calls_per_block or 0
        calls = f"{mean:.2f}/{r.max_calls_per_block}" if r.max_calls_per_block is not None else f"{mean:.2f}"
        print(f"{r.model:<16} {r.sampler:<20} {temp:>4} {nfe_text(r.nfe_per_block):>5} {settings:>12} "
              f"{_pct(r.value):>7} ± {_pct(r.stderr):>6} {calls:>10} {r.tokens_per_forward or 0:>7.2f} {r.tokens_per_s or 0:>7.0f}")
    print_language_table(rows)
    nll = [r for r in rows if r.task in ("wordproblems_validation_nll", "synthlang_validation_nll")]
    for model in dict.fromkeys(r.model for r in nll):
        parts = ", ".join(f"{r.metric.removeprefix('nll_')} {r.value:.4f}" for r in nll if r.model == model)
        print(f"{model:<16} validation NLL/token: {parts}")


def print_language_table(rows) -> None:
    """The language's settings: share of broken word pairs and of continuations with any (invalid), exact NLL
    per word of the valid pairs (the process's entropy rate above the table), word-pair distance from the exact
    marginals (the floor of the process's own samples above the table)."""
    from blockgen.harness.reports.leaderboard import nfe_text

    by_setting: dict[tuple, dict] = {}
    for r in rows:
        if r.task == LANGUAGE_TASK:
            key = (r.model, r.sampler, r.nfe_per_block, json.dumps(r.options or {}), r.steps, r.ge, r.warmup)
            by_setting.setdefault(key, {})[r.metric] = r.value
    if not by_setting:
        return
    rate = next(iter(by_setting.values())).get("entropy_rate", math.nan)
    floor = next(iter(by_setting.values())).get("bigram_tv_true", math.nan)
    header = (f"{'model':<16} {'sampler':<20} {'NFE':>5} {'setting':>20} {'broken pairs':>12} {'invalid':>8} {'NLL/word':>9} "
              f"{'pair TV':>8}")
    print(f"\n{LANGUAGE_TASK} (entropy rate {rate:.3f} nats/word; pair TV of the process's own samples {floor:.3f})")
    print(header)
    print("-" * len(header))
    for (model, sampler, nfe, options, steps, ge, warmup), m in sorted(by_setting.items(), key=lambda kv: (kv[0][0], kv[0][2] or 0, kv[0][1])):
        own = ",".join(f"{k}={v:g}" for k, v in json.loads(options).items())
        setting = "" if sampler.startswith("ar_") else own or f"{steps},{ge},{warmup}"
        print(f"{model:<16} {sampler:<20} {nfe_text(nfe):>5} {setting:>20} {_pct(m.get('invalid_pairs')):>12} "
              f"{_pct(m.get('invalid')):>8} {m.get('true_nll', math.nan):>9.3f} {m.get('bigram_tv', math.nan):>8.3f}")
