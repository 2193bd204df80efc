"""A static HTML leaderboard page: one file that opens from disk (file://) with no server and no network.

`build_page` writes `index.html` and the PNG plots of `harness/plots.py` into one folder. The rows are
embedded in the page as JSON; the page's own script (in `templates/leaderboard.html`, no CDN) draws
one sortable table per task (click a column header; again to reverse) with filters by prior,
sampler and NFE per block, and a switch for the paper's published rows.

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

from blockgen.harness.leaderboard import Row

TEMPLATE = "templates/leaderboard.html"
DATA_PLACEHOLDER = "{{LEADERBOARD_DATA}}"
# The fields a row carries into the page: the table's columns (the template names their headers),
# plus what the filters and tooltips need.
PAGE_FIELDS = ("model", "task", "metric", "filter", "value", "stderr", "n", "higher_is_better", "published", "source",
               "prior", "sampler", "steps", "ge", "warmup", "temperature", "block_size", "nfe_per_block",
               "model_calls_per_block", "train_steps")


def page_data(rows: Iterable[Row], plots: Iterable[str], sources: Iterable[str]) -> dict:
    """What the page's script reads: rows (page fields only, nulls dropped), plot file names, provenance."""
    return {
        "generated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "sources": [str(s) for s in sources],
        "plots": [str(p) for p in plots],
        "rows": [{k: v for k, v in asdict(r).items() if k in PAGE_FIELDS and v is not None} for r in rows],
    }


def render(data: dict) -> str:
    """The template with the data embedded as a JSON script element (`</` escaped so no row can end it)."""
    template = resources.files("blockgen.harness").joinpath(TEMPLATE).read_text(encoding="utf-8")
    if template.count(DATA_PLACEHOLDER) != 1:
        raise RuntimeError(f"{TEMPLATE}: expected exactly one {DATA_PLACEHOLDER}")
    return template.replace(DATA_PLACEHOLDER, json.dumps(data, separators=(",", ":")).replace("</", "<\\/"))


def build_page(rows: list[Row], out_dir: str | Path, sources: Iterable[str] = ()) -> Path:
    """Write `index.html` and the plots (harness/plots.py) into `out_dir`; returns the page's path."""
    from blockgen.harness.plots import plot_all

    out_dir = Path(out_dir)
    plots = plot_all(rows, out_dir)  # creates out_dir
    page = out_dir / "index.html"
    page.write_text(render(page_data(rows, [p.name for p in plots], sources)), encoding="utf-8")
    return page
