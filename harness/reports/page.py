"""A static HTML leaderboard page: one file that opens from disk (file://) with no server and no network.

`build_page` writes `index.html` and the PNG plots of `harness/reports/plots.py` into one folder. The rows are
embedded in the page as JSON; the page's own script (in `templates/leaderboard.html`, no CDN) shows the
plots first, then one sortable table per task (click a column header; again to reverse) with one row
per setting: the headline metric (accuracy, Gen PPL, perplexity; the metric selector picks another)
with the metrics that belong beside it folded into the same row (outcome shares; entropy and MAUVE),
filters by prior, sampler and NFE per block, a switch for the paper's published rows, and, for the
row chosen as reference, every other row's paired difference with its 95 % interval (computed here
by `harness/reports/compare.py` from the per-problem outcomes the results files kept).

    blockgen leaderboard page                      # every leaderboards/*.json -> runs/leaderboard-page/
    blockgen leaderboard page runs/leaderboard-tinygsm.json leaderboards/paper.json --out-dir runs/page
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Iterable

from blockgen.harness.reports.leaderboard import HEADLINE_METRICS, Row

TEMPLATE = "templates/leaderboard.html"
DATA_PLACEHOLDER = "{{LEADERBOARD_DATA}}"
# The fields a row carries into the page: the table's columns (the template names their headers),
# plus what the filters and tooltips need.
PAGE_FIELDS = ("model", "task", "metric", "filter", "value", "stderr", "n", "higher_is_better", "published", "source",
               "prior", "sampler", "steps", "ge", "warmup", "temperature", "block_size", "nfe_per_block",
               "model_calls_per_block", "train_steps")


# The metrics folded beside a task's headline metric (leaderboard.HEADLINE_METRICS; others are one click away in
# the metric selector) in the same row: a prefix ends with "_".
FOLDED = {"exact_match": ("outcome_",), "gen_ppl": ("unigram_entropy", "mauve")}


def paired(rows: list[Row]) -> dict[str, dict[str, dict]]:
    """Row index -> row index -> paired difference (`compare.paired_differences`), for this project's
    rows of a 0/1 metric whose results file kept per-problem outcomes (lm_eval --log_samples, the demo)."""
    from blockgen.harness.reports.compare import doc_outcomes, paired_differences

    groups: dict[tuple, dict[int, dict[int, float]]] = {}
    cache: dict[tuple, dict | None] = {}
    for i, r in enumerate(rows):
        if r.published or not r.source or r.metric.startswith("outcome_"):
            continue
        key = (r.source, r.task, r.metric)
        if key not in cache:
            cache[key] = doc_outcomes(*key)
        if cache[key] is not None:
            groups.setdefault((r.task, r.metric), {})[i] = cache[key]
    out: dict[str, dict[str, dict]] = {}
    for outcomes in groups.values():
        for i, by_j in paired_differences(outcomes).items():
            out[str(i)] = {str(j): v for j, v in by_j.items()}
    return out


def page_data(rows: Iterable[Row], plots: Iterable[str], sources: Iterable[str]) -> dict:
    """What the page's script reads: rows (page fields only, nulls dropped; a row's id is its index),
    plot file names, provenance, the headline and folded metrics, and the paired differences."""
    rows = list(rows)
    return {
        "generated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "sources": [str(s) for s in sources],
        "plots": [str(p) for p in plots],
        "headline": list(HEADLINE_METRICS),
        "folded": {k: list(v) for k, v in FOLDED.items()},
        "paired": paired(rows),
        "rows": [{k: v for k, v in asdict(r).items() if k in PAGE_FIELDS and v is not None} for r in rows],
    }


def render(data: dict) -> str:
    """The template with the data embedded as a JSON script element (`</` escaped so no row can end it)."""
    template = resources.files("blockgen.harness.reports").joinpath(TEMPLATE).read_text(encoding="utf-8")
    if template.count(DATA_PLACEHOLDER) != 1:
        raise RuntimeError(f"{TEMPLATE}: expected exactly one {DATA_PLACEHOLDER}")
    return template.replace(DATA_PLACEHOLDER, json.dumps(data, separators=(",", ":")).replace("</", "<\\/"))


def build_page(rows: list[Row], out_dir: str | Path, sources: Iterable[str] = ()) -> Path:
    """Write `index.html` and the plots (harness/reports/plots.py) into `out_dir`; returns the page's path."""
    from blockgen.harness.reports.plots import plot_all

    out_dir = Path(out_dir)
    plots = plot_all(rows, out_dir)  # creates out_dir
    page = out_dir / "index.html"
    page.write_text(render(page_data(rows, [p.name for p in plots], sources)), encoding="utf-8")
    return page
