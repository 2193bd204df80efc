"""`blockgen leaderboard ACTION`: its arguments and runners, assembled from leaderboard.py (rows, tables) and the
modules above it (page, plots, compare, regression), so that leaderboard.py imports none of them. Mounted by
harness/cli.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from blockgen.harness.reports import leaderboard, regression
from blockgen.harness.reports.compare import CompareError, compare, format_comparison
from blockgen.harness.reports.leaderboard import LeaderboardError
from blockgen.harness.reports.page import build_page
from blockgen.harness.reports.plots import plot_all

COMMAND_HELP = leaderboard.__doc__  # `blockgen leaderboard --help`: what a leaderboard is


def build_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="turn lm-eval results JSON into rows of a leaderboard file (created if missing)")
    add.add_argument("results", nargs="+", help="results_*.json files written by `lm_eval --output_path`")
    add.add_argument("--to", default="runs/leaderboard.json", help="leaderboard file (default: %(default)s)")
    add.add_argument("--model", default=None, help="model name (default: the checkpoint's run folder)")
    add.add_argument("--description", default=None, help="set the file's description")
    col = sub.add_parser("collect", help="rows of every results file under one or more results roots (a sharded "
                         "sweep's), into a leaderboard file; fails on a measurement found twice with other values")
    col.add_argument("roots", nargs="+", help="results roots (`blockgen sweep --out-dir`, default RUNS/results) or run folders in them")
    col.add_argument("--to", default="runs/leaderboard.json", help="leaderboard file (default: %(default)s)")
    col.add_argument("--description", default=None, help="set the file's description")
    for name, helptext in (("show", "print rows as a table"), ("plot", "write PNG plots"),
                           ("page", "write a static HTML page (sortable tables, filters, plots) that opens from disk")):
        p = sub.add_parser(name, help=helptext)
        if name == "page":
            p.add_argument("files", nargs="*", help="leaderboard JSON files (default: every leaderboards/*.json)")
        else:
            p.add_argument("files", nargs="+", help="leaderboard JSON files")
        p.add_argument("--task", nargs="+", default=None, help="only these tasks")
        p.add_argument("--metric", nargs="+", default=None, help="only these metrics")
        p.add_argument("--model", nargs="+", default=None, help="only these models")
        p.add_argument("--published", action=argparse.BooleanOptionalAction, default=True, help="include the paper's rows")
    show = sub.choices["show"]
    show.add_argument("--best", action="store_true", help="the best variant (N_step, GE, warm-up) per NFE only, of each "
                      "task's headline metric (exact_match, gen_ppl, perplexity; --metric picks others)")
    show.add_argument("--compact", action="store_true", help="the README's table: model, task, metric, sampler, T, NFE, "
                      "N/GE/W, value, calls/block, tok/s (with --best: one row per setting)")
    show.add_argument("--columns", nargs="+", default=leaderboard.SHOW_COLUMNS, help="columns to print (default: %(default)s)")
    sub.choices["plot"].add_argument("--out-dir", default="runs/plots", help="folder for the PNGs (default: %(default)s)")
    sub.choices["page"].add_argument("--out-dir", default="runs/leaderboard-page", help="folder for index.html and its PNGs (default: %(default)s)")
    comp = sub.add_parser("compare", help="A - B on the same problems: paired 95%% interval and test (needs per-sample logs)")
    comp.add_argument("a", help="lm-eval output of setting A: results_*.json (with --log_samples), its folder, or a demo results file")
    comp.add_argument("b", help="the same for setting B (same task, same problems)")
    comp.add_argument("--metric", default=None, help="per-sample metric (default: exact_match, or gen_ppl for owt_genppl)")
    comp.add_argument("--task", default=None, help="the task, when an output holds several")
    comp.add_argument("--json", action="store_true", help="print the comparison as JSON")
    regression.add_check_arguments(sub.add_parser("check", help="= blockgen regression check (the older name): compare a "
                                                  "rerun with a stored reference; exit 1 when it is worse"))


def _selected(args) -> list[leaderboard.Row]:
    rows = [row for path in args.files for row in leaderboard.read(path).rows]
    return [
        r for r in rows
        if (args.published or not r.published)
        and (args.task is None or r.task in args.task)
        and (args.metric is None or r.metric in args.metric)
        and (args.model is None or r.model in args.model)
    ]


def _board_add(args: argparse.Namespace) -> int:
    board = leaderboard.read(args.to) if Path(args.to).exists() else leaderboard.Leaderboard([])
    if args.description is not None:
        board.description = args.description
    count, replaced = leaderboard.add_results(args.results, board, args.model)
    leaderboard.write(board, args.to)
    print(f"{args.to}: {count} rows from {len(args.results)} results file(s) ({replaced} replaced older rows)")
    return 0


def _board_collect(args: argparse.Namespace) -> int:
    rows, files = leaderboard.collect(args.roots)
    board = leaderboard.read(args.to) if Path(args.to).exists() else leaderboard.Leaderboard([])
    if args.description is not None:
        board.description = args.description
    replaced = board.add(rows)
    leaderboard.write(board, args.to)
    print(f"{args.to}: {len(rows)} rows from {files} results file(s) under {len(args.roots)} root(s) "
          f"({replaced} replaced older rows)")
    return 0


def _board_show(args: argparse.Namespace) -> int:
    rows = _selected(args)
    if args.best and args.metric is None:  # as the page does: each task's headline metric
        rows = leaderboard.headline_rows(rows)
    print(leaderboard.show_table(rows, args.columns, args.best, args.compact))
    return 0


def _board_compare(args: argparse.Namespace) -> int:
    try:
        result = compare(args.a, args.b, args.metric, args.task)
    except CompareError as err:
        raise LeaderboardError(str(err)) from None
    print(json.dumps(result.to_json(), indent=1) if args.json else format_comparison(result))
    return 0


def _board_page(args: argparse.Namespace) -> int:
    args.files = args.files or sorted(str(p) for p in Path("leaderboards").glob("*.json"))
    if not args.files:
        raise LeaderboardError("no leaderboard files given and none in ./leaderboards/*.json")
    print(build_page(_selected(args), args.out_dir, sources=args.files))
    return 0


def _board_plot(args: argparse.Namespace) -> int:
    for path in plot_all(_selected(args), args.out_dir) or []:
        print(path)
    return 0


# `blockgen leaderboard ACTION`'s runners (`check` is `blockgen regression check` under its older name).
LEADERBOARD_ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "add": _board_add, "collect": _board_collect, "show": _board_show, "compare": _board_compare,
    "page": _board_page, "plot": _board_plot, "check": regression.run,
}


def run(args: argparse.Namespace) -> int:
    try:
        return LEADERBOARD_ACTIONS[args.action](args)
    except LeaderboardError as err:
        print(f"blockgen leaderboard: error: {err}", file=sys.stderr)
        return 2
