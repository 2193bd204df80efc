"""CI regression: rerun something, compare it with a stored reference, exit 1 when it got worse.

One command, `blockgen regression check|update`; the reference decides the comparison:

- a leaderboard reference (a .json file, `leaderboards/ci_regression.json`): a leaderboard whose rows
  carry a `tolerance`, against which a rerun's leaderboard is compared row by row;
- an outcomes store (a folder, `leaderboards/ci_gsm8k/`: a checkpoint and `outcomes.json` of schema
  `blockgen-outcomes`): its settings are rerun and every problem's outcome is paired with the stored
  one.

    blockgen regression check --against leaderboards/ci_regression.json runs/ci-pipeline/leaderboard-owt-embedded.json
    blockgen regression update --to leaderboards/ci_regression.json NEW.json [RUN2.json ...]
    blockgen regression check --against leaderboards/ci_gsm8k [--out-dir DIR | --results DIR]
    blockgen regression update --to leaderboards/ci_gsm8k [--checkpoint DIR]

(`blockgen leaderboard check` is the same check.)

A leaderboard reference's tolerance is the largest move of `value` the check accepts. Tolerances follow
one rule, stored in the file's provenance and kept by every update:

    tolerance = max(k * relative_spread[task/metric] * |value|,  z * sqrt(2) * stderr)

`relative_spread` is the run-to-run range of the metric over repeated runs of the same pipeline,
measured (`update` with several leaderboards) and kept in the provenance; the stderr term covers a
legitimate change that draws new random numbers (the new value is then a fresh draw with the same
standard error, so stored - new has standard deviation sqrt(2) * stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from blockgen.harness.reports import outcomes
from blockgen.harness.reports.leaderboard import Leaderboard, LeaderboardError, Row, provenance, read, write

REFERENCE = "leaderboards/ci_regression.json"
# k: an observed range of 3 runs is about 1.69 standard deviations (d2(3)), a difference of two runs
# has standard deviation sqrt(2) = 1.41 of them: 3 x range is about z * sqrt(2) sigma with z = 3.5.
# z = 3.5: one-sided normal tail 2.3e-4 per row, below 1% for the whole file (up to ~40 rows).
DEFAULT_K = 3.0
DEFAULT_Z = 3.5
RULE = "tolerance = max(k * relative_spread[task/metric] * |value|, z * sqrt(2) * stderr)"


def match_key(row: Row) -> tuple:
    """The leaderboard's row key without the checkpoint hash: a change to training changes the
    checkpoint, and the check is about what that change does to the same measurement's numbers."""
    return replace(row, checkpoint_sha=None).key()


def metric_name(row: Row) -> str:
    """task/metric (and the filter when there is one): the unit the run-to-run spread is kept per."""
    name = f"{row.task}/{row.metric}"
    return name if row.filter == "none" else f"{name},{row.filter}"


def settings(row: Row) -> str:
    """The row's model and sampler settings in a few words (what the diff table shows)."""
    parts = [row.model]
    if row.sampler is not None:
        parts.append(f"{row.sampler} N={row.steps} GE={row.ge} w={row.warmup}")
    if row.temperature is not None:
        parts.append(f"T={row.temperature:g}")
    if row.block_size is not None:
        parts.append(f"L'={row.block_size}")
    if row.k_mc is not None:
        parts.append(f"K_MC={row.k_mc}")
    if row.train_steps is not None:
        parts.append(f"{row.train_steps} steps")
    return " ".join(parts)


def _by_key(board: Leaderboard, name: str, key=match_key) -> dict[tuple, Row]:
    out: dict[tuple, Row] = {}
    for row in board.rows:
        if key(row) in out:
            raise LeaderboardError(f"{name}: two rows for {metric_name(row)} of {settings(row)}; "
                                   "a regression check needs one row per measurement (rerun into an empty RUNS folder)")
        out[key(row)] = row
    return out


# ------------------------------------------------------------------------------ the check


@dataclass(frozen=True)
class Comparison:
    """One row of the diff table: a stored row, its rerun, and the verdict."""

    stored: Row | None
    new: Row | None
    verdict: str  # "same", "ok", "WORSE", "MOVED" (no direction known), "better", "MISSING", "extra"

    @property
    def fails(self) -> bool:
        return self.verdict in ("WORSE", "MOVED", "MISSING")

    @property
    def row(self) -> Row:
        return self.stored or self.new  # type: ignore[return-value]


def _verdict(stored: Row, new: Row) -> str:
    a, b = stored.value, new.value
    if a == b or (math.isnan(a) and math.isnan(b)):
        return "same"
    if math.isnan(b) or math.isnan(a):
        return "WORSE" if math.isnan(b) else "better"
    if stored.tolerance is None:
        raise LeaderboardError(f"reference row {metric_name(stored)} of {settings(stored)} has no tolerance "
                               "(write the reference with `blockgen regression update`)")
    if abs(b - a) <= stored.tolerance:
        return "ok"
    if stored.higher_is_better is None:
        return "MOVED"
    return "better" if (b > a) == stored.higher_is_better else "WORSE"


def compare(reference: Leaderboard, new: Leaderboard) -> list[Comparison]:
    """Every reference row against the new row with the same match key, then the new rows left over."""
    stored, fresh = _by_key(reference, "reference"), _by_key(new, "new leaderboard")
    out = [Comparison(row, fresh.get(key), _verdict(row, fresh[key]) if key in fresh else "MISSING")
           for key, row in stored.items()]
    out += [Comparison(None, row, "extra") for key, row in fresh.items() if key not in stored]
    return out


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _change(c: Comparison) -> str:
    if c.stored is None or c.new is None:
        return "-"
    a, b = c.stored.value, c.new.value
    if a == b or math.isnan(a) or math.isnan(b):
        return "0" if a == b else "nan"
    rel = f" ({(b - a) / abs(a):+.1%})" if a else ""
    return f"{b - a:+.4g}{rel}"


def report(comparisons: list[Comparison], everything: bool = False, hint: bool = True) -> str:
    """A table of the rows that did not stay within tolerance (all rows with `everything`), and a summary."""
    shown = [c for c in comparisons if everything or c.verdict not in ("same", "ok")]
    lines = []
    if shown:
        header = ("verdict", "metric", "settings", "stored", "new", "change", "tolerance")
        cells = [(c.verdict, metric_name(c.row), settings(c.row), _number(c.stored and c.stored.value),
                  _number(c.new and c.new.value), _change(c), "±" + _number(c.stored and c.stored.tolerance))
                 for c in shown]
        widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *cells]]
    counts = {v: sum(c.verdict == v for c in comparisons) for v in ("same", "ok", "better", "WORSE", "MOVED", "MISSING", "extra")}
    lines.append(", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" (of {len(comparisons)} rows)")
    if counts["WORSE"] or counts["MOVED"]:
        lines.append("WORSE/MOVED: a metric moved past its tolerance (in the worse direction, or one whose direction is unknown).")
    if counts["ok"]:
        lines.append("ok: moved, but within tolerance (the CI pipeline reruns bitwise identically on one machine, so a move "
                     "there means the code or the machine changed the numbers; `--all` lists every row).")
    if counts["MISSING"]:
        lines.append("MISSING: a stored row has no counterpart in the new leaderboard (a setting no longer runs, or the run failed).")
    if hint and (counts["better"] or counts["extra"] or any(c.fails for c in comparisons)):
        lines.append("If the change is intended, store the new numbers with `make regression-update` and commit the diff of "
                     f"{REFERENCE}.")
    return "\n".join(lines)


def check(new_path: str | Path, reference_path: str | Path, everything: bool = False) -> tuple[bool, str]:
    """(passed, report) for a new leaderboard file against a reference file."""
    comparisons = compare(read(reference_path), read(new_path))
    passed = not any(c.fails for c in comparisons)
    head = f"{new_path} against {reference_path}: {'passed' if passed else 'FAILED'}"
    return passed, head + "\n" + report(comparisons, everything)


# ------------------------------------------------------------------------------ the reference


def relative_spread(boards: list[Leaderboard]) -> dict[str, float]:
    """Per task/metric: the largest (max - min) / |mean| over rows of the value across the runs.

    Rows match without their seed: runs with other training and evaluation seeds are what a change
    that draws other random numbers looks like."""
    keyed = [_by_key(board, f"run {i + 1}", lambda r: match_key(replace(r, seed=None))) for i, board in enumerate(boards)]
    spread: dict[str, float] = {}
    for key, row in keyed[0].items():
        values = [k[key].value for k in keyed if key in k]
        if len(values) < len(keyed):
            raise LeaderboardError(f"{metric_name(row)} of {settings(row)} is missing from some of the runs")
        mean = sum(values) / len(values)
        rel = (max(values) - min(values)) / abs(mean) if mean else 0.0
        spread[metric_name(row)] = max(spread.get(metric_name(row), 0.0), rel)
    return spread


def tolerance(row: Row, rel_spread: float, k: float, z: float) -> float:
    """The rule of the module docstring for one row (a row without stderr keeps the spread term only)."""
    return max(k * rel_spread * abs(row.value), z * math.sqrt(2) * (row.stderr or 0.0))


def build_reference(new: Leaderboard, policy: dict[str, Any], command: str, spread_runs: list[Leaderboard] | None = None,
                    spread_note: str | None = None) -> Leaderboard:
    """`new`'s rows with tolerances by `policy` (k, z, relative_spread); with `spread_runs` (two or
    more leaderboards of the same pipeline) the spread is measured anew from them."""
    policy = dict(policy)
    if spread_runs:
        if len(spread_runs) < 2:
            raise LeaderboardError("measuring the run-to-run spread needs at least two runs")
        policy["relative_spread"] = relative_spread(spread_runs)
        policy["spread_runs"] = len(spread_runs)
        if spread_note:
            policy["spread_measured"] = spread_note
    spread = policy.get("relative_spread", {})
    missing = sorted({metric_name(r) for r in new.rows} - set(spread))
    if missing:
        raise LeaderboardError(f"no measured run-to-run spread for {missing}: measure it by passing several runs' leaderboards")
    _by_key(new, "new leaderboard")
    rows = [replace(r, tolerance=tolerance(r, spread[metric_name(r)], policy["k"], policy["z"])) for r in new.rows]
    how = {**provenance(command), "tolerance": policy}
    description = ("CI regression reference: the offline pipeline of .ci/run (three micro OWT models, owt_ppl and "
                   "owt_genppl over a small grid). `blockgen regression check` compares a rerun against these rows; "
                   "each row's `tolerance` follows provenance.tolerance.rule.")
    return Leaderboard(rows, description, how)


def update(boards: list[str | Path], to: str | Path = REFERENCE, command: str = "make regression-update",
           k: float | None = None, z: float | None = None, spread_note: str | None = None) -> str:
    """Rewrite the reference `to` from the leaderboard `boards[0]` (more boards: measure the spread anew),
    the stored policy kept unless `k` or `z` is given; returns a summary, with the new rows against the
    old reference when there was one."""
    stored = read(to) if Path(to).exists() else None
    policy = dict((stored.provenance or {}).get("tolerance", {})) if stored else {}
    policy.update(rule=RULE, k=k if k is not None else policy.get("k", DEFAULT_K),
                  z=z if z is not None else policy.get("z", DEFAULT_Z))
    new = [read(path) for path in boards]
    reference = build_reference(new[0], policy, command, new if len(new) > 1 else None, spread_note)
    write(reference, to)
    lines = [f"{to}: the new rows against the old reference:\n{report(compare(stored, reference), hint=False)}"] if stored else []
    return "\n".join([*lines, f"{to}: {len(reference.rows)} rows written; review and commit its diff"])


# ------------------------------------------------------------------------------ command line: one for both kinds

LEADERBOARD, OUTCOMES = "a leaderboard reference", "an outcomes store"
EXAMPLE = {LEADERBOARD: REFERENCE, OUTCOMES: outcomes.STORE}
KIND_HELP = (f"the reference: {LEADERBOARD} (a .json file, e.g. {REFERENCE}) or {OUTCOMES} (a folder, "
             f"e.g. {outcomes.STORE}, or its {outcomes.OUTCOMES}); it decides which arguments apply")


def reference_kind(path: str | Path) -> tuple[str, Path]:
    """What the reference at `path` is, and what its comparison reads. A folder, or a file of schema
    blockgen-outcomes (its outcomes.json), is an outcomes store; any other file a leaderboard reference.
    A path not there yet (`update` writes it) is a leaderboard reference when it ends in .json."""
    p = Path(path)
    if p.is_dir() or (not p.exists() and p.suffix != ".json"):
        return OUTCOMES, p
    if p.is_file() and _schema(p) == outcomes.SCHEMA:
        if p.name != outcomes.OUTCOMES:
            raise outcomes.OutcomesError(f"{p}: an outcomes store keeps its outcomes as {outcomes.OUTCOMES}; "
                                         "give the store's folder")
        return OUTCOMES, p.parent
    return LEADERBOARD, p


def _schema(path: Path) -> Any:
    try:
        return json.loads(path.read_text()).get("schema")
    except (OSError, ValueError, AttributeError):
        return None  # not JSON (or not an object): the leaderboard reader says what is wrong with it


def _section(parser: argparse.ArgumentParser, kind: str, title: str) -> Callable[..., argparse.Action]:
    """`add_argument` for the arguments only `kind` of reference takes, in their own section of --help.
    They stay out of the namespace unless given (SUPPRESS: their defaults are those of the function that
    takes them) and their names go into `args.takes[kind]`, so that `run` can name what does not fit."""
    group = parser.add_argument_group(f"against {kind} ({title})", argument_default=argparse.SUPPRESS)
    takes = parser.get_default("takes") or {}
    parser.set_defaults(takes=takes)
    names = takes.setdefault(kind, {})

    def add(*flags: str, **kwargs: Any) -> argparse.Action:
        action = group.add_argument(*flags, **kwargs)
        names[action.dest] = "/".join(action.option_strings) or action.metavar
        return action
    return add


def _rerun_arguments(add: Callable[..., argparse.Action]) -> None:
    add("--results", metavar="DIR", help=f"an existing results root of `blockgen sweep {outcomes.GRID}` to read "
        "instead of rerunning")
    add("--out-dir", metavar="DIR", help="empty folder for the rerun's lm-eval results (default: a temporary one)")
    add("--no-progress", dest="progress", action="store_false", help="no progress bars")


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """`blockgen regression check` and its older name `blockgen leaderboard check`."""
    parser.description = "Compare a rerun with a stored reference; exit 1 when it is worse (2: arguments or files that do not fit)."
    parser.add_argument("--against", metavar="REF", default=REFERENCE, help=KIND_HELP + " (default: %(default)s)")
    board = _section(parser, LEADERBOARD, "rows with tolerances")
    board("new", nargs="?", metavar="NEW.json", help="the rerun's leaderboard (required)")
    board("--all", dest="everything", action="store_true", help="list every row, not only those past their tolerance")
    store = _section(parser, OUTCOMES, f"a checkpoint and {outcomes.OUTCOMES}; its settings are rerun")
    _rerun_arguments(store)
    store("--runs", metavar="DIR", help="folder holding <model>/checkpoint to evaluate instead of the store's "
          "(e.g. a candidate checkpoint against the stored outcomes)")
    store("--alpha", metavar="P", type=float, help=f"McNemar level for WORSE (default: {outcomes.ALPHA})")


def add_update_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Rewrite a stored reference from new numbers (a leaderboard, or the store's settings rerun)."
    parser.add_argument("--to", metavar="REF", default=REFERENCE,
                        help=KIND_HELP + "; rewritten, or created (default: %(default)s)")
    parser.add_argument("--command", metavar="TEXT", default=argparse.SUPPRESS, help="how the new numbers were made, stored "
                        "in the provenance (default: make regression-update; for a store, blockgen regression update --to REF)")
    board = _section(parser, LEADERBOARD, "rows with tolerances")
    board("new", nargs="*", metavar="NEW.json", help="the new leaderboard (required); more files (other runs of the same "
          "pipeline, the first included) measure the run-to-run spread anew")
    board("--k", type=float, help=f"spread factor (default: the stored one, else {DEFAULT_K})")
    board("--z", type=float, help=f"stderr factor (default: the stored one, else {DEFAULT_Z})")
    board("--spread-note", metavar="TEXT", help="how the spread runs were made (commands, dates, load)")
    store = _section(parser, OUTCOMES, f"a checkpoint and {outcomes.OUTCOMES}; its settings are rerun")
    _rerun_arguments(store)
    store("--limit", metavar="N", type=int, help="problems per setting (default: the stored file's, else the grid's)")
    store("--checkpoint", metavar="DIR", help="copy this checkpoint into the store first")
    store("--dtype", choices=outcomes.DTYPES, help="weights' dtype in the stored copy (default: float32)")


def build_parser(parser: argparse.ArgumentParser) -> None:
    """`blockgen regression check|update` (mounted by harness/cli.py)."""
    sub = parser.add_subparsers(dest="action", required=True)
    add_check_arguments(sub.add_parser("check", help="compare a rerun with the reference; exit 1 when it is worse"))
    add_update_arguments(sub.add_parser("update", help="rewrite the reference from new numbers"))


def run(args: argparse.Namespace) -> int:
    """The reference's kind picks the comparison: `check` and `update` here, or those of outcomes.py."""
    try:
        kind, path = reference_kind(args.against if args.action == "check" else args.to)
        given = _given(args, kind, path)
        if args.action == "check":
            passed, text = check(_new(given, path), path, **given) if kind == LEADERBOARD else outcomes.check(path, **given)
            print(text)
            return 0 if passed else 1
        if "command" in args:
            given["command"] = args.command
        print(update(_new(given, path), path, **given) if kind == LEADERBOARD else outcomes.update(path, **given))
    except ValueError as err:  # LeaderboardError, OutcomesError: references and reruns that cannot be compared
        print(f"blockgen regression: error: {err}", file=sys.stderr)
        return 2
    return 0


def _given(args: argparse.Namespace, kind: str, path: Path) -> dict[str, Any]:
    """The arguments given for `kind` of reference, by the names its functions take; any of the other
    kind's is an error that names the arguments this reference takes."""
    misfits = [name for other, names in args.takes.items() if other != kind for dest, name in names.items() if dest in args]
    if misfits:
        other = OUTCOMES if kind == LEADERBOARD else LEADERBOARD
        option = "--against" if args.action == "check" else "--to"
        raise ValueError(f"{path} is {kind}, which takes {', '.join(args.takes[kind].values())}; "
                         f"{', '.join(misfits)} {'is' if len(misfits) == 1 else 'are'} for {other} (e.g. {option} {EXAMPLE[other]})")
    return {dest: getattr(args, dest) for dest in args.takes[kind] if dest in args}


def _new(given: dict[str, Any], path: Path) -> Any:
    """The new leaderboard (`update`: one or more) that a leaderboard reference is compared with."""
    new = given.pop("new", None)
    if not new:
        raise ValueError(f"{path} is {LEADERBOARD}: give the new leaderboard, NEW.json")
    return new
