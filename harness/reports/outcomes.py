"""CI regression of `gsm8k_code` by per-problem outcomes: a stored checkpoint, a rerun, a paired test.

`leaderboards/ci_gsm8k/` keeps a small trained checkpoint (`gsm-masked-mix/checkpoint`: the demo's
masked mixture, weights and tokenizer only) and `outcomes.json`: for each setting of the sweep grid
`ci-gsm8k` (AR greedy, and ancestral, EIPC and ARPC at NFE 4 per block, T = 0.1) every problem's outcome
on `gsm8k_code_embedded` (right, or which way it failed) and a hash of the model's response, with the
provenance (command, commit, date, machine, checkpoint hash).

`check` reruns the settings on the stored checkpoint with `blockgen sweep` (harness/evaluation/sweep.py, into an
empty folder) and pairs each setting's new outcomes with the stored ones (harness/reports/compare.py). It lists
every problem whose outcome changed and counts responses whose text changed; it fails when a setting
is worse by the exact McNemar test at `alpha` (new - stored < 0 with p < alpha), when a stored setting
did not run, or when the problems are not the stored ones. Sampling is seeded per problem, so on one
machine a rerun is bitwise identical and any change to the samplers, the model code or the task shows
up in the list; a change that is not significantly worse (a few flips either way, e.g. another CPU's
float rounding) is listed but passes.

    blockgen regression check --against leaderboards/ci_gsm8k                  # rerun, compare with its outcomes.json
    blockgen regression check --against leaderboards/ci_gsm8k --results DIR    # compare a sweep's results already under DIR
    blockgen regression update --to leaderboards/ci_gsm8k                      # rerun on the stored checkpoint, rewrite outcomes.json
    blockgen regression update --to leaderboards/ci_gsm8k --checkpoint runs/demo/gsm-masked-mix/checkpoint   # store a new checkpoint first

(`blockgen regression` is the one command of CI's checks: harness/reports/regression.py tells an outcomes
store from a leaderboard reference and calls `check` or `update` here.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from blockgen.harness.reports.compare import Comparison, CompareError, compare_accuracy, load_samples

STORE = "leaderboards/ci_gsm8k"
OUTCOMES = "outcomes.json"
GRID = "ci-gsm8k"  # harness/evaluation/grids.py's GRIDS: the settings, the model's run name, the default limit
SCHEMA = "blockgen-outcomes"
VERSION = 1
ALPHA = 0.05
TRAINING_ONLY = ("training_state.pt",)  # what a checkpoint keeps for resuming; evaluation never reads it
DTYPES = ("float32", "float16", "bfloat16")


class OutcomesError(ValueError):
    """A stored outcomes file or a results folder that cannot be checked."""


@dataclass(frozen=True)
class Outcome:
    """One problem under one setting: 1 if answered right, the verdict (correct or how it failed) and
    a short hash of the model's response text."""

    exact_match: int
    verdict: str
    response: str

    def to_json(self) -> list:
        return [self.exact_match, self.verdict, self.response]


@dataclass
class SettingOutcomes:
    label: str  # the sweep's setting label (its results folder), e.g. "arpc-6-3-0-T0.1"
    model_args: dict
    problems: dict[int, Outcome]
    doc_hashes: dict[int, str]
    checkpoint_sha: str | None = None  # the checkpoint the results scored (a rerun's; not stored per setting)

    @property
    def accuracy(self) -> float:
        return sum(o.exact_match for o in self.problems.values()) / len(self.problems)


def _verdict(record: dict) -> str:
    if record.get("exact_match") == 1:
        return "correct"
    failed = [k.removeprefix("outcome_") for k, v in record.items() if k.startswith("outcome_") and v == 1]
    return failed[0] if len(failed) == 1 else "wrong"


def read_results(folder: Path, task: str, label: str, model_args: dict) -> SettingOutcomes:
    """A setting's per-problem outcomes from the lm-eval results and samples the sweep wrote under `folder`."""
    try:
        samples = load_samples(folder, task)
    except CompareError as err:
        raise OutcomesError(f"setting {label}: {err}") from None
    problems, hashes = {}, {}
    for doc_id, r in sorted(samples.records.items()):
        if r.get("exact_match") not in (0, 1):
            raise OutcomesError(f"setting {label}: problem {doc_id} has no 0/1 exact_match")
        response = hashlib.sha256(json.dumps(r["resps"], sort_keys=True).encode()).hexdigest()[:16]
        problems[doc_id] = Outcome(int(r["exact_match"]), _verdict(r), response)
        hashes[doc_id] = r["doc_hash"][:16]
    try:  # what the sweep recorded about the run (absent from a plain lm_eval output)
        sha = json.loads(Path(samples.path).read_text()).get("blockgen_sweep", {}).get("checkpoint_sha")
    except (OSError, ValueError):
        sha = None
    return SettingOutcomes(label, model_args, problems, hashes, sha)


# ------------------------------------------------------------------------------ running the settings


def _grid(limit: int | None):
    from dataclasses import replace

    from blockgen.harness.evaluation.grids import grid

    g = grid(GRID)
    return g if limit is None else replace(g, limit=limit)


def _stored_args(args: dict) -> dict:
    """A setting's model arguments without the checkpoint path (the store may move)."""
    return {k: v for k, v in args.items() if k != "pretrained"}


def run_settings(runs: str | Path, out_dir: str | Path, limit: int, progress: bool = True) -> None:
    """The grid's settings on `runs/<model>/checkpoint`, one lm-eval results folder each under `out_dir`,
    which must be empty: the sweep skips settings whose results are there, and a check must rerun all."""
    from blockgen.harness.evaluation.sweep import SweepConfig, run_sweep

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise OutcomesError(f"{out} is not empty: a rerun needs an empty folder (the sweep keeps results it finds)")
    run_sweep(SweepConfig(grid=GRID, runs=str(runs), out_dir=str(out), limit=limit, progress=progress))


def collect(runs: str | Path, results: str | Path, limit: int | None) -> dict[str, SettingOutcomes]:
    """label -> outcomes of every grid setting found under a results root (settings not run are absent)."""
    from blockgen.harness.evaluation.evaluations import evaluations

    g = _grid(limit)
    out = {}
    for s in evaluations(g, str(runs)):
        folder = Path(results) / s.run / s.label
        if folder.is_dir():
            out[s.label] = read_results(folder, s.task, s.label, _stored_args(s.model_args(g.k_mc)))
    return out


# ------------------------------------------------------------------------------ the stored file


def checkpoint_dir(runs: str | Path) -> Path:
    g = _grid(None)
    (model,) = g.models
    return Path(runs) / g.run_name(model) / "checkpoint"


def write_outcomes(path: Path, found: dict[str, SettingOutcomes], limit: int, sha: str, command: str,
                   checkpoint_note: str | None) -> None:
    from blockgen.harness.reports.leaderboard import provenance

    if not found:
        raise OutcomesError("no setting's results to store")
    hashes = next(iter(found.values())).doc_hashes
    if any(s.doc_hashes != hashes for s in found.values()):
        raise OutcomesError("the settings did not answer the same problems")
    g = _grid(limit)
    doc = {
        "schema": SCHEMA, "version": VERSION,
        "description": (f"CI regression of {g.generation_task}: per-problem outcomes of the checkpoint beside this file "
                        f"under each setting of `blockgen sweep {GRID}` (harness/reports/outcomes.py; docs/testing.md \"CI regression\"). "
                        "Per problem: [exact_match, verdict, sha256 of the response (16 hex)]."),
        "provenance": {**provenance(command), "checkpoint": str(checkpoint_dir(".")), "checkpoint_sha": sha,
                       **({"checkpoint_note": checkpoint_note} if checkpoint_note else {})},
        "task": g.generation_task, "grid": GRID, "limit": limit, "k_mc": g.k_mc,
        "problems": {str(i): h for i, h in sorted(hashes.items())},
        "settings": [{"label": s.label, "model_args": s.model_args, "n": len(s.problems), "accuracy": s.accuracy,
                      "outcomes": {str(i): o.to_json() for i, o in sorted(s.problems.items())}}
                     for s in found.values()],
    }
    text = json.dumps(doc, indent=1)
    # one line per problem: a changed outcome is a one-line diff
    text = text.replace("[\n     ", "[").replace(",\n     ", ", ").replace("\n    ]", "]")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


def read_outcomes(path: str | Path) -> tuple[dict, dict[str, SettingOutcomes]]:
    path = Path(path)
    if not path.is_file():
        raise OutcomesError(f"{path}: no stored outcomes (write them with `blockgen regression update --to {path.parent}`)")
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA or doc.get("version") != VERSION:
        raise OutcomesError(f"{path}: not a {SCHEMA} file of version {VERSION}")
    hashes = {int(i): h for i, h in doc["problems"].items()}
    found = {s["label"]: SettingOutcomes(s["label"], s["model_args"],
                                         {int(i): Outcome(*o) for i, o in s["outcomes"].items()}, hashes)
             for s in doc["settings"]}
    return doc, found


def store_checkpoint(source: str | Path, dest: Path, dtype: str = "float32") -> None:
    """Copy what evaluation reads (config, weights, tokenizer; not the resumable training state), the
    floating-point weights cast to `dtype` (loading casts them back to the model's float32)."""
    if dtype not in DTYPES:
        raise OutcomesError(f"dtype {dtype!r}; choose one of {list(DTYPES)}")
    source = Path(source)
    from blockgen.harness.checkpoints.checkpoint import WEIGHTS, read_config

    read_config(source)  # a BlockGen checkpoint, or a clear error
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name not in TRAINING_ONLY and f.name != WEIGHTS:
            shutil.copy2(f, tmp / f.name)
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(source / WEIGHTS))
    cast = getattr(torch, dtype)
    save_file({k: v.to(cast) if v.is_floating_point() else v for k, v in weights.items()}, str(tmp / WEIGHTS))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)


# ------------------------------------------------------------------------------ the check


@dataclass
class SettingDiff:
    label: str
    verdict: str  # "same", "changed" (outcomes or responses, not significantly worse), "WORSE", "MISSING", "extra"
    stored: SettingOutcomes | None = None
    new: SettingOutcomes | None = None
    changed: list[tuple[int, Outcome, Outcome]] = field(default_factory=list)  # outcome (exact_match or verdict) changed
    responses_changed: int = 0  # response text changed (outcome or not)
    comparison: Comparison | None = None  # new - stored, paired

    @property
    def fails(self) -> bool:
        return self.verdict in ("WORSE", "MISSING")


def diff_setting(stored: SettingOutcomes, new: SettingOutcomes, alpha: float = ALPHA) -> SettingDiff:
    if set(new.problems) != set(stored.problems) or any(new.doc_hashes[i] != stored.doc_hashes[i] for i in stored.problems):
        raise OutcomesError(f"setting {stored.label}: the rerun did not answer the stored problems (another task version, "
                            "generator or limit); store new outcomes with `blockgen regression update --to <store>`")
    ids = sorted(stored.problems)
    changed = [(i, stored.problems[i], new.problems[i]) for i in ids
               if (stored.problems[i].exact_match, stored.problems[i].verdict) != (new.problems[i].exact_match, new.problems[i].verdict)]
    responses = sum(stored.problems[i].response != new.problems[i].response for i in ids)
    c = compare_accuracy([new.problems[i].exact_match for i in ids], [stored.problems[i].exact_match for i in ids],
                         metric="exact_match", names=("new", "stored"))
    verdict = "WORSE" if c.difference < 0 and c.p_value < alpha else "changed" if changed or responses else "same"
    return SettingDiff(stored.label, verdict, stored, new, changed, responses, c)


def diff_all(stored: dict[str, SettingOutcomes], new: dict[str, SettingOutcomes], alpha: float = ALPHA) -> list[SettingDiff]:
    out = [diff_setting(s, new[label], alpha) if label in new else SettingDiff(label, "MISSING", stored=s)
           for label, s in stored.items()]
    return out + [SettingDiff(label, "extra", new=n) for label, n in new.items() if label not in stored]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def report(diffs: list[SettingDiff], alpha: float = ALPHA) -> str:
    header = ("verdict", "setting", "stored", "new", "new-stored", "outcomes changed", "responses changed", "McNemar p")
    cells = []
    for d in diffs:
        c = d.comparison
        cells.append((d.verdict, d.label, _pct(d.stored.accuracy) if d.stored else "-", _pct(d.new.accuracy) if d.new else "-",
                      f"{100 * c.difference:+.1f} pts" if c else "-",
                      f"{len(d.changed)} (+{c.counts['a_only']} -{c.counts['b_only']})" if c else "-",
                      str(d.responses_changed) if c else "-", f"{c.p_value:.2g}" if c else "-"))
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *cells]]
    for d in diffs:
        if d.changed:
            lines.append(f"{d.label}: {len(d.changed)} problem(s) changed outcome (doc_id: stored -> new):")
            lines += [f"  {i}: {a.verdict} -> {b.verdict}" for i, a, b in d.changed]
    counts = {v: sum(d.verdict == v for d in diffs) for v in ("same", "changed", "WORSE", "MISSING", "extra")}
    lines.append(", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" (of {len(diffs)} settings)")
    if counts["WORSE"]:
        lines.append(f"WORSE: fewer problems right than stored, by the exact McNemar test at p < {alpha:g}.")
    if counts["changed"]:
        lines.append("changed: outcomes or responses differ from the stored ones but not significantly for the worse; on the "
                     "machine that stored them a rerun is bitwise identical, so this means the code (or the CPU) changed them.")
    if counts["MISSING"]:
        lines.append("MISSING: a stored setting did not run (or its results are not under the results folder).")
    if any(d.verdict != "same" for d in diffs):
        lines.append("If the change is intended, store the new outcomes with `make regression-gsm8k-update` and commit the "
                     f"diff of {STORE}/{OUTCOMES}.")
    return "\n".join(lines)


def check(store: str | Path = STORE, runs: str | Path | None = None, results: str | Path | None = None,
          out_dir: str | Path | None = None, alpha: float = ALPHA, progress: bool = True) -> tuple[bool, str]:
    """(passed, report): the stored settings rerun on `runs`' checkpoint (default: the store's) into
    `out_dir` (default: a temporary folder), or read from an existing `results` root, against the store."""
    from blockgen.harness.checkpoints.checkpoint import checkpoint_hash

    store = Path(store)
    doc, stored = read_outcomes(store / OUTCOMES)
    runs = Path(runs or store)
    sha = checkpoint_hash(checkpoint_dir(runs))
    notes = []
    own = runs.resolve() == store.resolve()
    if sha != doc["provenance"]["checkpoint_sha"]:
        notes.append(f"the checkpoint {checkpoint_dir(runs)} is not the one the outcomes were stored for "
                     f"(sha256 {sha[:12]} vs {doc['provenance']['checkpoint_sha'][:12]})"
                     + ("; store outcomes for it with `make regression-gsm8k-update`" if own else ""))
    with tempfile.TemporaryDirectory(prefix="blockgen-outcomes-") as tmp:
        if results is None:
            results = out_dir or tmp
            run_settings(runs, results, doc["limit"], progress)
        new = collect(runs, results, doc["limit"])
    scored = sorted({s.checkpoint_sha for s in new.values()} - {sha})
    if scored:
        notes.append(f"the results read scored another checkpoint than {checkpoint_dir(runs)} (sha256 {', '.join(x[:12] for x in scored if x)})")
    diffs = diff_all(stored, new, alpha)
    passed = not any(d.fails for d in diffs) and not (own and notes)
    head = (f"{doc['task']} outcomes on {doc['limit']} problems against {store / OUTCOMES} "
            f"(stored {doc['provenance']['date']}): {'passed' if passed else 'FAILED'}")
    return passed, "\n".join([head, *notes, report(diffs, alpha)])


def update(store: str | Path = STORE, limit: int | None = None, results: str | Path | None = None,
           out_dir: str | Path | None = None, checkpoint: str | Path | None = None, dtype: str = "float32",
           command: str | None = None, progress: bool = True) -> str:
    """Rerun the grid on the store's checkpoint (first copied from `checkpoint` when given) and rewrite
    the stored outcomes; returns a summary, with the new outcomes against the old ones when there were any."""
    from blockgen.harness.checkpoints.checkpoint import checkpoint_hash

    store = Path(store)
    path = store / OUTCOMES
    old = read_outcomes(path) if path.is_file() else None
    note = None
    if checkpoint is not None:
        store_checkpoint(checkpoint, checkpoint_dir(store), dtype)
        note = f"copied from {checkpoint} (weights as {dtype}; config, weights and tokenizer only)"
    elif old is not None:
        note = old[0]["provenance"].get("checkpoint_note")
    limit = limit or (old[0]["limit"] if old else _grid(None).limit)
    with tempfile.TemporaryDirectory(prefix="blockgen-outcomes-") as tmp:
        if results is None:
            results = out_dir or tmp
            run_settings(store, results, limit, progress)
        new = collect(store, results, limit)
    sha = checkpoint_hash(checkpoint_dir(store))
    other = sorted(s.label for s in new.values() if s.checkpoint_sha != sha)
    if other:
        raise OutcomesError(f"the results of {other} did not score the stored checkpoint {checkpoint_dir(store)} "
                            f"(sha256 {sha[:12]}); rerun them on it")
    write_outcomes(path, new, limit, sha, command or f"blockgen regression update --to {store}", note)
    lines = [f"{path}: {len(new)} settings x {limit} problems written; review and commit its diff"]
    lines += [f"  {s.label}: {_pct(s.accuracy)}" for s in new.values()]
    if old is not None and old[0]["limit"] == limit:
        try:
            lines.append("against the previous outcomes:\n" + report(diff_all(old[1], new)))
        except OutcomesError as err:
            lines.append(f"(not compared with the previous outcomes: {err})")
    return "\n".join(lines)
