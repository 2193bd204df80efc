"""Leaderboards: a versioned JSON file of result rows, validated on read and written atomically.

One row per (model, checkpoint, task, metric, sampler settings); the schema is documented in
`leaderboards/SCHEMA.md`. Rows come from lm-eval results JSON (`rows_from_results`, the one place
that knows where lm-eval and the blockgen adapter put things) or are the paper's published numbers
(`published: true`). `table` turns rows into a pandas DataFrame; `best_per_nfe` keeps the best
sampler variant per NFE, as the paper's figures do.

    blockgen leaderboard add results/.../results_*.json --to leaderboards/owt.json
    blockgen leaderboard collect runs/results --to runs/leaderboard-owt.json   # every results file under the roots
    blockgen leaderboard show leaderboards/paper.json --task gsm8k_code --best
    blockgen leaderboard page                     # every leaderboards/*.json -> runs/leaderboard-page/index.html
    blockgen leaderboard check runs/ci-pipeline/leaderboard-owt-embedded.json   # = blockgen regression check: exit 1 past a tolerance
    blockgen leaderboard compare out/A out/B      # A - B on the same problems (lm_eval --log_samples outputs)
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import tempfile
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

from blockgen.harness.evaluation.lm_eval_model.usage import merge_budgets

SCHEMA = "blockgen-leaderboard"
VERSION = 1


class LeaderboardError(ValueError):
    """A leaderboard file or a results file that does not follow the schema."""


@dataclass(frozen=True)
class Row:
    """One number: a metric of a model on a task under one set of sampler settings."""

    model: str  # the training preset / run name ("owt-masked-mix"), or a published model's name
    task: str  # lm-eval task name ("gsm8k_code", "owt_ppl", ...)
    metric: str  # lm-eval metric name ("exact_match", ...)
    value: float
    published: bool = False  # a number printed in the paper, not one this project ran
    source: str = ""  # results file, or "paper: <table label>"
    filter: str = "none"  # lm-eval filter name
    stderr: float | None = None
    n: int | None = None  # examples scored
    higher_is_better: bool | None = None
    # the model
    prior: str | None = None  # "masked" or "uniform"
    block_sizes: list[int] | None = None  # training mixture: block sizes ...
    block_weights: list[float] | None = None  # ... and their weights gamma
    train_steps: int | None = None
    checkpoint_sha: str | None = None
    # the sampler (generation tasks); None for likelihood tasks
    sampler: str | None = None
    steps: int | None = None  # N_step
    ge: int | None = None
    warmup: int | None = None
    temperature: float | None = None
    block_size: int | None = None  # block size used for generation
    nfe_per_block: float | None = None  # the paper's label (ARPC counts its AR passes); adaptive: measured per row
    model_calls_per_block: float | None = None  # calls really made (batched)
    options: dict[str, float] | None = None  # the sampler's own settings (models/samplers/), e.g. a threshold
    calls_per_block_per_row: float | None = None  # a row's mean calls per block (rows done sit out adaptive calls)
    max_calls_per_block: int | None = None  # a row's most calls in one block
    tokens_per_forward: float | None = None  # generated tokens per model call of a row
    total_calls: int | None = None  # model calls over the whole task
    k_mc: int | None = None  # Monte Carlo draws of the likelihood bound
    seed: int | None = None
    sample_length: str | None = None  # owt_genppl: 'fixed' (L tokens, EOS kept) or 'eos' (stopped at EOS)
    # the run
    lm_eval_version: str | None = None
    commit: str | None = None
    date: str | None = None  # ISO 8601
    hardware: str | None = None
    wall_seconds: float | None = None  # the whole lm_eval run
    tokens_per_s: float | None = None  # generated tokens / wall_seconds (None for likelihood tasks)
    note: str | None = None
    tolerance: float | None = None  # regression reference only: the largest move of value the check accepts

    def key(self) -> tuple:
        """Rows with the same key describe the same measurement: a newer one replaces the older."""
        return (self.model, self.checkpoint_sha, self.task, self.metric, self.filter, self.sampler, self.steps,
                self.ge, self.warmup, self.temperature, tuple(sorted((self.options or {}).items())), self.block_size, self.k_mc, self.seed, self.train_steps, self.sample_length,
                self.published, self.source if self.published else None)


@dataclass
class Leaderboard:
    rows: list[Row]
    description: str = ""
    provenance: dict[str, Any] | None = None  # how the file's numbers were obtained (free-form)

    def add(self, new: Iterable[Row]) -> int:
        """Add rows, replacing rows with the same key; returns how many were replaced."""
        by_key = {row.key(): i for i, row in enumerate(self.rows)}
        replaced = 0
        for row in new:
            if row.key() in by_key:
                self.rows[by_key[row.key()]] = row
                replaced += 1
            else:
                by_key[row.key()] = len(self.rows)
                self.rows.append(row)
        return replaced

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA, "version": VERSION, "description": self.description}
        if self.provenance is not None:
            out["provenance"] = self.provenance
        out["rows"] = [{k: v for k, v in asdict(r).items() if v is not None} for r in self.rows]
        return out


# ------------------------------------------------------------------------------ validation

_HINTS = typing.get_type_hints(Row)
_REQUIRED = {f.name for f in fields(Row) if f.default is f.default_factory}  # no default


def _type_error(where: str, expected: str, value: Any) -> LeaderboardError:
    return LeaderboardError(f"{where}: expected {expected}, got {value!r}")


def _check_value(where: str, tp: Any, value: Any) -> Any:
    args = typing.get_args(tp)
    if type(None) in args:
        if value is None:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        if not isinstance(value, bool):
            raise _type_error(where, "true or false", value)
    elif tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _type_error(where, "an integer", value)
    elif tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _type_error(where, "a number", value)
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise _type_error(where, "a string", value)
    elif typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise _type_error(where, "a list", value)
        (item,) = typing.get_args(tp)
        value = [_check_value(f"{where}[{i}]", item, v) for i, v in enumerate(value)]
    return value


def row_from_dict(raw: Any, where: str) -> Row:
    if not isinstance(raw, dict):
        raise _type_error(where, "an object", raw)
    unknown = sorted(set(raw) - set(_HINTS))
    if unknown:
        raise LeaderboardError(f"{where}: unknown field(s) {unknown}; valid fields: {sorted(_HINTS)}")
    missing = sorted(_REQUIRED - set(raw))
    if missing:
        raise LeaderboardError(f"{where}: missing required field(s) {missing}")
    return Row(**{k: _check_value(f"{where}.{k}", _HINTS[k], v) for k, v in raw.items()})


def parse(data: Any, where: str = "leaderboard") -> Leaderboard:
    """A Leaderboard from decoded JSON, or a LeaderboardError that says what is wrong and where."""
    if not isinstance(data, dict):
        raise _type_error(where, "a JSON object", type(data).__name__)
    if data.get("schema") != SCHEMA:
        raise LeaderboardError(f"{where}: \"schema\" is {data.get('schema')!r}, expected {SCHEMA!r} (see leaderboards/SCHEMA.md)")
    if data.get("version") != VERSION:
        raise LeaderboardError(f"{where}: schema version {data.get('version')!r} is not supported; this blockgen reads version {VERSION}")
    unknown = sorted(set(data) - {"schema", "version", "description", "provenance", "rows"})
    if unknown:
        raise LeaderboardError(f"{where}: unknown top-level field(s) {unknown}")
    if not isinstance(data.get("rows"), list):
        raise _type_error(f"{where}.rows", "a list of rows", data.get("rows"))
    if not isinstance(data.get("description", ""), str):
        raise _type_error(f"{where}.description", "a string", data.get("description"))
    if data.get("provenance") is not None and not isinstance(data["provenance"], dict):
        raise _type_error(f"{where}.provenance", "an object", data["provenance"])
    rows = [row_from_dict(r, f"{where}.rows[{i}]") for i, r in enumerate(data["rows"])]
    return Leaderboard(rows, data.get("description", ""), data.get("provenance"))


def read(path: str | Path) -> Leaderboard:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise LeaderboardError(f"cannot read leaderboard {path}: {err.strerror}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise LeaderboardError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from err
    return parse(data, str(path))


def provenance(command: str) -> dict[str, str]:
    """How a file's numbers were obtained: the command, the commit (marked when the tracked tree had
    uncommitted changes), the date and the machine."""
    import platform
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD") + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), platform.processor())
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "command": command,
        "commit": commit,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu}, {os.cpu_count()} CPUs ({usable} usable), {platform.system()} {platform.release()}",
    }


def write(board: Leaderboard, path: str | Path) -> None:
    """Write atomically: a temporary file in the same folder, flushed, then renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parse(json.loads(json.dumps(board.to_json())), str(path))  # never write what cannot be read back
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(board.to_json(), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------ from lm-eval results


def _hardware(env_info: str | None) -> str | None:
    """The GPU line of lm-eval's environment report, else the CPU model name."""
    if not env_info:
        return None
    gpu = re.search(r"^GPU models and configuration:\s*(.+)$", env_info, re.M)
    if gpu and "Could not collect" not in gpu.group(1):
        return gpu.group(1).strip()
    cpu = re.search(r"^Model name:\s*(.+)$", env_info, re.M)
    return f"CPU: {cpu.group(1).strip()}" if cpu else None


def _model_name(checkpoint: str) -> str:
    """runs/owt-masked-mix/checkpoint -> owt-masked-mix (a training run's folder names the model)."""
    path = Path(checkpoint.rstrip("/"))
    return path.parent.name if path.name == "checkpoint" else path.name


def _training_step(checkpoint: str) -> int | None:
    """The step a checkpoint was saved at (config.json's training metadata), if it is still there."""
    try:
        step = json.loads((Path(checkpoint) / "config.json").read_text())["training"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def rows_from_results(results: dict[str, Any], source: str = "", model: str | None = None) -> list[Row]:
    """Leaderboard rows from one lm-eval results JSON written with `--model blockgen`, or with another
    model type (hf, vllm, ...: an AR baseline, its sampler read from the task's generation kwargs).

    The generation settings of a task come from the adapter's per-task report
    (`config.blockgen.tasks[task].generate_until.settings`: sampler, steps, GE, warm-up, temperature,
    block size, the paper's NFE label and the calls made); likelihood tasks carry no sampler.
    """
    config = results.get("config", {})
    info = config.get("blockgen")
    external = not isinstance(info, dict)  # another lm-eval model type (hf, vllm, ...): an AR baseline row
    if external and not config.get("model"):
        raise LeaderboardError(f"{source or 'results'}: not an lm-eval results file (no config.model)")
    info = {} if external else info
    wall = _float_or_none(results.get("total_evaluation_time_seconds"))  # lm-eval writes it as a string
    model_args = config.get("model_args", {})
    if isinstance(model_args, str):
        from lm_eval.utils import simple_parse_args_string

        model_args = simple_parse_args_string(model_args)
    checkpoint = config.get("model_checkpoint") or str(model_args.get("pretrained", "?"))
    date = results.get("date")
    common = dict(
        model=model or _model_name(checkpoint), train_steps=_training_step(checkpoint),
        # an AR checkpoint (block size 1 only) has no noise prior, whatever its config records
        source=source, prior=None if info.get("block_sizes") == [1] else info.get("prior"),
        block_sizes=info.get("block_sizes"), block_weights=info.get("block_weights"),
        checkpoint_sha=config.get("model_sha") or None, seed=info.get("seed"), lm_eval_version=results.get("lm_eval_version"),
        commit=results.get("git_hash"), hardware=_hardware(results.get("pretty_env_info")), wall_seconds=wall,
        date=dt.datetime.fromtimestamp(date, dt.timezone.utc).isoformat(timespec="seconds") if _number(date) else None,
        note=f"lm-eval model {config['model']}" if external else None,
    )
    rows = []
    for task, metrics in results.get("results", {}).items():
        report = info.get("tasks", {}).get(task, {})
        output_type = results.get("configs", {}).get(task, {}).get("output_type")
        if external:
            gen_kwargs = {**(results.get("configs", {}).get(task, {}).get("generation_kwargs") or {}), **(config.get("gen_kwargs") or {})}
            settings = _external_settings(gen_kwargs, output_type)
        else:
            settings = _task_settings(info, report, output_type, wall)
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        task_metadata = results.get("configs", {}).get(task, {}).get("metadata") or {}
        settings = {**settings, "sample_length": task_metadata.get("sample_length")}
        better = results.get("higher_is_better", {}).get(task, {})
        for name, value in metrics.items():
            if "," not in name or "_stderr," in name or _number(value) is None:
                continue
            metric, filt = name.split(",", 1)
            stderr = _number(metrics.get(f"{metric}_stderr,{filt}"))
            rows.append(Row(task=task, metric=metric, filter=filt, value=float(value), stderr=stderr, n=n,
                            higher_is_better=better.get(metric), **settings, **common))
    return rows


def _float_or_none(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


# Per-setting counts of the adapter's report (`Usage.GENERATION`): summed when settings are merged.
def _external_settings(gen_kwargs: dict, output_type: str | None) -> dict[str, Any]:
    """Sampler fields of another model type's generation task, read as lm-eval's hf backend reads
    them: sampling when do_sample is set or the temperature is > 0, else greedy; one call per token."""
    if output_type != "generate_until":
        return {}
    temperature = _number(gen_kwargs.get("temperature")) or 0.0
    sample = gen_kwargs.get("do_sample") is True or (gen_kwargs.get("do_sample") is None and temperature > 0)
    return dict(sampler="ar_sample" if sample else "ar_greedy", temperature=temperature if sample else None,
                block_size=1, nfe_per_block=1)


def sampler_options(record: dict) -> dict[str, float] | None:
    """The sampler's own settings a record names (the registry's declarations; None if it has none)."""
    from blockgen.models import samplers

    if record.get("sampler") not in samplers.names():
        return None
    return {o.name: record[o.name] for o in samplers.get(record["sampler"]).options if o.name in record} or None


def _task_settings(info: dict, report: dict, output_type: str | None, wall: float | None) -> dict[str, Any]:
    """Sampler fields of one task's rows (generation), or K_MC (likelihood)."""
    if output_type != "generate_until":
        return {"k_mc": report.get("loglikelihood", report.get("loglikelihood_rolling", {})).get("k_mc", info.get("k_mc"))}
    gen = report.get("generate_until", {})
    settings = merge_budgets(gen.get("settings") or [])
    if len(settings) == 1:
        s = settings[0]
        nfe, calls = s.get("paper_nfe_per_block"), s.get("model_calls_per_block")
    else:  # an adapter without the per-task report: the model arguments' sampler
        s = dict(info.get("sampler", {}))
        s["sampler"] = s.get("name")
        nfe, calls = s.get("paper_nfe_per_block"), None
        if len(settings) > 1:
            raise LeaderboardError(f"one task ran {len(settings)} sampler settings; run one setting per lm_eval call")
    options = sampler_options(s)
    if nfe is None and s.get("calls_per_block_per_row") is not None:  # adaptive: the NFE its rows really took
        nfe = _number(s["calls_per_block_per_row"])
    tokens = gen.get("generated_tokens")
    # Decoding speed: the time inside the sampler when the adapter measured it, else the whole run.
    seconds = _number(gen.get("generate_seconds")) or wall
    # Some answers came from lm-eval's --use_cache without the usage stored with them: the count covers
    # only the requests that reached the model (calls per block and tokens/s, rates, still hold).
    partial = gen.get("answered_from_cache") and not gen.get("usage_from_cache")
    return dict(
        sampler=s.get("sampler"), steps=s.get("steps"), ge=s.get("ge"), warmup=s.get("warmup"),
        temperature=_number(s.get("temperature")), block_size=s.get("block_size"), nfe_per_block=nfe,
        model_calls_per_block=_number(calls), total_calls=None if partial else gen.get("model_calls"), options=options,
        calls_per_block_per_row=_number(s.get("calls_per_block_per_row")), max_calls_per_block=s.get("max_calls_per_block"),
        tokens_per_forward=_number(s.get("tokens_per_forward")),
        tokens_per_s=tokens / seconds if tokens is not None and seconds else None,
    )


def results_file_rows(path: str | Path, model: str | None = None) -> list[Row]:
    """The rows of one lm-eval results file (`rows_from_results`), its path as their source."""
    path = Path(path)
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise LeaderboardError(f"cannot read lm-eval results {path}: {err}") from err
    return rows_from_results(results, str(path), model)


def add_results(paths: Iterable[str | Path], board: Leaderboard, model: str | None = None) -> tuple[int, int]:
    """Read lm-eval results files into `board`; returns (rows added or updated, rows replaced)."""
    count = replaced = 0
    for path in paths:
        rows = results_file_rows(path, model)
        replaced += board.add(rows)
        count += len(rows)
    return count, replaced


def collect(roots: Sequence[str | Path]) -> tuple[list[Row], int]:
    """The rows of every lm-eval results file under `roots` (the results folders of a sweep's shards, or
    one root they all wrote into), one per key, and the number of files read. The same measurement
    found twice (a setting run by two jobs) must agree in value, stderr and n: else a LeaderboardError
    names both files, where `add` would keep the later one silently."""
    missing = [str(r) for r in roots if not Path(r).is_dir()]
    if missing:
        raise LeaderboardError(f"no results folder {missing}")
    paths = sorted({p for root in roots for p in Path(root).rglob("results_*.json")})
    if not paths:
        raise LeaderboardError(f"no lm-eval results (results_*.json) under {[str(r) for r in roots]}")
    found: dict[tuple, Row] = {}
    for path in paths:
        for row in results_file_rows(path):
            first = found.setdefault(row.key(), row)
            if _measured(first) != _measured(row):
                raise LeaderboardError(
                    f"{row.model} {row.task} {row.metric} ({row.sampler or 'likelihood'}, T={row.temperature}) disagrees: "
                    f"{first.value} (stderr {first.stderr}, n {first.n}) in {first.source}, {row.value} (stderr {row.stderr}, "
                    f"n {row.n}) in {row.source}; remove the one that is wrong")
    return list(found.values()), len(paths)


def _measured(row: Row) -> str:
    return json.dumps([row.value, row.stderr, row.n])  # as text: NaN equals NaN


# ------------------------------------------------------------------------------ tables


def table(rows: Iterable[Row]):
    """A pandas DataFrame with one column per Row field."""
    import pandas as pd

    df = pd.DataFrame([asdict(r) for r in rows], columns=[f.name for f in fields(Row)])
    ints = [name for name, tp in _HINTS.items() if int in typing.get_args(tp)]
    return df.astype({name: "Int64" for name in ints})  # nullable: a missing step count stays an integer column


def best_per_nfe(df):
    """Keep the best sampler variant (N_step, GE, warm-up) per NFE, as the paper's figures do.

    Groups by model, task, metric, prior, sampler, block size, temperature and NFE label; the best
    is the highest value where higher is better, else the lowest.
    """
    if df.empty:
        return df
    keys = ["published", "model", "task", "metric", "filter", "prior", "sampler", "block_size", "temperature", "nfe_per_block"]
    lower = df["higher_is_better"].eq(False)
    score = df["value"].where(~lower, -df["value"])
    order = score.sort_values(ascending=False, kind="stable").index
    return df.loc[order].drop_duplicates(subset=keys, keep="first").sort_index()


SHOW_COLUMNS = ["model", "task", "metric", "sampler", "steps", "ge", "warmup", "temperature", "nfe_per_block",
                "model_calls_per_block", "value", "stderr", "n", "published"]
# The README's compact table: header -> how a row fills it.
COMPACT_COLUMNS = {
    "model": lambda r: r.model, "task": lambda r: r.task, "metric": lambda r: r.metric, "sampler": lambda r: r.sampler or "",
    "T": lambda r: "" if r.temperature is None else f"{r.temperature:g}",
    "NFE": lambda r: nfe_text(r.nfe_per_block),
    "N/GE/W": lambda r: "" if r.steps is None else f"{r.steps}/{r.ge or 0}/{r.warmup or 0}",
    "value": lambda r: _value_text(r),
    "calls/block": lambda r: "" if r.model_calls_per_block is None else f"{r.model_calls_per_block:.2f}",
    "tok/s": lambda r: "" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}",
}
# The metric a task's table leads with (as the leaderboard page does); a task with none of these leads
# with its first metric.
HEADLINE_METRICS = ("exact_match", "gen_ppl", "perplexity")


def nfe_text(nfe: float | None) -> str:
    """An NFE as tables and plots print it: the paper's labels are whole, an adaptive sampler's measured mean is not."""
    if nfe is None or nfe != nfe:  # None or NaN
        return ""
    return f"{nfe:.0f}" if float(nfe).is_integer() else f"{nfe:.2f}"


def _value_text(row: Row) -> str:
    percent = row.metric.startswith(("exact_match", "acc"))
    value = f"{100 * row.value:.1f}%" if percent else f"{row.value:.4g}"
    return value + (f" +-{100 * row.stderr if percent else row.stderr:.2g}" if row.stderr is not None and math.isfinite(row.stderr) else "")


def headline_rows(rows: Iterable[Row]) -> list[Row]:
    """Each task's rows of its headline metric (`HEADLINE_METRICS`, else the task's first metric)."""
    rows = list(rows)
    by_task: dict[str, list[str]] = {}
    for r in rows:
        by_task.setdefault(r.task, [])
        if r.metric not in by_task[r.task]:
            by_task[r.task].append(r.metric)
    lead = {task: next((m for m in HEADLINE_METRICS if m in metrics), metrics[0]) for task, metrics in by_task.items()}
    return [r for r in rows if r.metric == lead[r.task]]


def show_table(rows: Iterable[Row], columns: Sequence[str] = SHOW_COLUMNS, best: bool = False, compact: bool = False) -> str:
    """The rows as `blockgen leaderboard show` prints them, missing values as empty cells; `best`: the best
    variant per NFE only; `compact`: the README's table (COMPACT_COLUMNS)."""
    import pandas as pd

    unknown = sorted(set(columns) - set(_HINTS))
    if unknown:
        raise LeaderboardError(f"unknown column(s) {unknown}; valid: {sorted(_HINTS)}")
    rows = list(rows)
    df = table(rows)
    if best:
        df = best_per_nfe(df)
    if df.empty:
        return "(no rows)"
    if compact:
        kept = [rows[i] for i in df.index]
        df = pd.DataFrame([{name: cell(r) for name, cell in COMPACT_COLUMNS.items()} for r in kept])
        columns = list(COMPACT_COLUMNS)
    with pd.option_context("display.max_rows", None, "display.width", 200, "display.max_colwidth", 40):
        shown = df[list(columns)].astype(object)
        return shown.where(shown.notna(), "").to_string(index=False)  # a missing value is an empty cell
