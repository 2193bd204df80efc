"""PNG plots of leaderboard rows (matplotlib, headless).

- accuracy vs NFE per block, one line per sampler and prior with +-1 standard error, one panel per
  temperature, the accuracy axis scaled to the data (not from 0), one figure per (task, generation
  block size): the paper's figures 1-2 (best variant per NFE; the AR model as horizontal lines with a
  +-1 s.e. band, since it has no NFE per block: greedy, and sampled at the panel's temperature);
- generative perplexity vs unigram entropy, one curve per model and sampler setting across
  temperatures: the paper's figure 3;
- the speed-quality frontier, one figure per (task, model) with measured decoding speed: accuracy
  against decoded tokens/s for every sampler setting, AR greedy on the same model as the reference
  (and a line at 95% of its accuracy), the Pareto frontier joined by a thin line. This project's rows
  only: the paper publishes no tokens/s.
Published rows are drawn thin and faded beside this project's rows, labelled "(paper)".
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from blockgen.harness.reports.leaderboard import Row, best_per_nfe, nfe_text, table
from blockgen.models import samplers

ACCURACY_METRICS = ("exact_match",)
GENPPL_METRICS = ("gen_ppl",)  # generative perplexity under the scorer model
ENTROPY_METRICS = ("unigram_entropy",)  # mean per-sample unigram entropy
MODEL_MARKERS = ("o", "s", "^", "D", "v", "P", "X")  # Gen PPL plot: one per model, in name order
MIN_ACCURACY_SPAN = 10.0  # accuracy plot: the y axis spans at least this many points
OTHER_COLOR = "tab:purple"  # a sampler name no registered sampler has (rows of another project's results)


def color(sampler: str) -> str:
    """A sampler's plot colour, as it declares it (models/samplers/)."""
    found = samplers.load().get(sampler)
    return found.color if found is not None else OTHER_COLOR


def is_ar(sampler: str) -> bool:
    found = samplers.load().get(sampler)
    return found is not None and found.autoregressive


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def accuracy_vs_nfe(rows: Iterable[Row], out_dir: str | Path) -> list[Path]:
    df = table(rows)
    df = df[df.metric.isin(ACCURACY_METRICS)]
    if df.empty:
        return []
    import pandas as pd

    plt = _pyplot()
    from matplotlib.ticker import ScalarFormatter

    written = []
    diffusion = best_per_nfe(df[~df.sampler.map(is_ar) & df.nfe_per_block.notna()])
    # The AR reference is the AR model's (trained on block size 1 alone; unrecorded: another lm-eval
    # model type), not a mixture decoded at block size 1.
    ar = df[df.sampler.map(is_ar) & df.block_sizes.map(lambda b: not isinstance(b, (list, tuple)) or list(b) == [1])]
    for (task, block), group in diffusion.groupby(["task", "block_size"], dropna=False):
        temps = sorted(group.temperature.dropna().unique(), reverse=True) or [None]
        fig, axes = plt.subplots(1, len(temps), figsize=(max(5.2 * len(temps), 7.5), 4.2), squeeze=False, sharey=True)
        for ax, temp in zip(axes[0], temps):
            panel = group[group.temperature == temp] if temp is not None else group
            for (published, model, sampler, prior), line in panel.groupby(["published", "model", "sampler", "prior"], dropna=False):
                line = line.sort_values("nfe_per_block")
                # +- one standard error (the paper's rows carry none)
                ax.errorbar(line.nfe_per_block, 100 * line.value, yerr=100 * line.stderr.astype(float).fillna(0.0),
                            marker="o", color=color(sampler), capsize=2, elinewidth=0.8,
                            linestyle="-" if prior == "masked" else "--", linewidth=1 if published else 2,
                            alpha=0.45 if published else 1.0, markersize=3 if published else 5,
                            label=f"{model} {sampler} {prior}" + (" (paper)" if published else ""))
            # at the panel's temperature; greedy reads none, and the paper states none for its AR rows
            same_t = (ar.sampler == "ar_greedy") | ar.temperature.isna() | (temp is None) | (ar.temperature == temp)
            for (published, model, sampler), line in ar[(ar.task == task) & same_t].groupby(["published", "model", "sampler"]):
                best = line.loc[line.value.idxmax()]
                ax.axhline(100 * best.value, color=color(sampler), linestyle=":", linewidth=1,
                           alpha=0.45 if published else 1.0, label=f"{model} {sampler}" + (" (paper)" if published else ""))
                if not published and pd.notna(best.stderr):  # a band of +- 1 s.e.
                    ax.axhspan(100 * (best.value - best.stderr), 100 * (best.value + best.stderr), color=color(sampler), alpha=0.08)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())  # 4, 8, 16 rather than 2^2, 2^3, 2^4
            ax.set_xlabel("NFE per block (paper's label; adaptive samplers: mean calls per row)")
            ax.set_title(f"T = {temp:g}" if temp is not None else "")
            ax.margins(y=0.15)  # scaled to the data: a few points apart must look apart, not flat at 0-65 %
            low, high = ax.get_ylim()
            if high - low < MIN_ACCURACY_SPAN:  # one point (or equal ones): a readable span around it, within 0-100 %
                middle = min(max((low + high) / 2, MIN_ACCURACY_SPAN / 2), 100 - MIN_ACCURACY_SPAN / 2)
                ax.set_ylim(middle - MIN_ACCURACY_SPAN / 2, middle + MIN_ACCURACY_SPAN / 2)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(f"{task} accuracy (%)")
        # beside the panels, not over the points (a dozen sampler lines once the field's samplers run)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
        fig.suptitle(f"{task}: accuracy vs NFE, block size {block}, best variant per NFE (bars: +-1 s.e.)", fontsize=11)
        written.append(_save(plt, fig, Path(out_dir) / f"accuracy_vs_nfe_{_slug(task)}_b{block}.png"))
    return written


def genppl_vs_entropy(rows: Iterable[Row], out_dir: str | Path) -> list[Path]:
    df = table(rows)
    keys = ["published", "model", "task", "sampler", "steps", "ge", "warmup", "block_size", "nfe_per_block", "temperature", "seed"]
    ppl = df[df.metric.isin(GENPPL_METRICS)].set_index(keys, drop=False)
    ent = df[df.metric.isin(ENTROPY_METRICS)].set_index(keys)["value"].rename("entropy")
    if ppl.empty or ent.empty:
        return []
    both = ppl.join(ent, how="inner").reset_index(drop=True)
    plt = _pyplot()
    written = []
    for task, group in both.groupby("task"):
        fig, ax = plt.subplots(figsize=(6.4, 4.6))
        curve_keys = ["published", "model", "sampler", "steps", "ge", "warmup", "nfe_per_block"]
        # colour: the sampler; marker: the model, so two models' curves of one sampler stay apart
        marker_of = {m: MODEL_MARKERS[i % len(MODEL_MARKERS)] for i, m in enumerate(sorted(group.model.unique()))}
        for key, curve in group.groupby(curve_keys, dropna=False):
            published, model, sampler, steps, ge, warmup, nfe = key
            curve = curve.sort_values("temperature")
            label = f"{model} {sampler}" + ("" if is_ar(sampler) else f" NFE {nfe_text(nfe)}") + (" (paper)" if published else "")
            ax.plot(curve.entropy, curve.value, marker=marker_of[model], color=color(sampler),
                    alpha=0.45 if published else 1.0, label=label)
            for _, point in curve.iterrows():  # beside the point, not on it
                ax.annotate(f"T{point.temperature:g}", (point.entropy, point.value), xytext=(5, 4),
                            textcoords="offset points", fontsize=6, alpha=0.7)
        ax.set_yscale("log")
        ax.set_xlabel("unigram entropy (nats, mean per sample)")
        ax.set_ylabel("generative perplexity")
        ax.set_title(f"{task}: Gen PPL vs entropy (lower right is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(plt, fig, Path(out_dir) / f"genppl_vs_entropy_{_slug(task)}.png"))
    return written


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (higher is better on both).

    A point is beaten when another is at least as good on both coordinates and better on one; equal
    points do not beat each other. The indices come in increasing order of the first coordinate.
    """
    def beaten(i: int) -> bool:
        (x, y) = points[i]
        return any(ox >= x and oy >= y and (ox > x or oy > y) for ox, oy in points)

    return sorted((i for i in range(len(points)) if not beaten(i)), key=lambda i: (points[i][0], -points[i][1]))


FRONTIER_TEMPERATURE_MARKERS = ("o", "s", "^", "D", "v", "P")  # one per temperature, in decreasing order
AR_REFERENCE_FRACTION = 0.95  # the goal: keep at least 95% of AR greedy's accuracy


def speed_quality_frontier(rows: Iterable[Row], out_dir: str | Path) -> list[Path]:
    """Accuracy vs decoded tokens/s, one figure per (task, model) that has rows with a measured speed."""
    df = table(rows)
    df = df[df.metric.isin(ACCURACY_METRICS) & ~df.published.astype(bool)]
    df = df.assign(tokens_per_s=df.tokens_per_s.astype(float))
    timed = df[df.tokens_per_s > 0]  # a log axis; NaN (no speed measured) compares False
    if timed.empty:
        return []
    import pandas as pd

    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    written = []
    for (task, model), group in timed.groupby(["task", "model"]):
        fig, ax = plt.subplots(figsize=(7.8, 5.0))
        handles = []
        others = group[group.sampler != "ar_greedy"]
        temps = sorted(others.temperature.dropna().unique(), reverse=True)
        marker_of = {t: FRONTIER_TEMPERATURE_MARKERS[i % len(FRONTIER_TEMPERATURE_MARKERS)] for i, t in enumerate(temps)}
        several_blocks = others[~others.sampler.map(is_ar)].block_size.nunique() > 1
        for (sampler, temp), points in others.groupby(["sampler", "temperature"], dropna=False):
            ax.errorbar(points.tokens_per_s, 100 * points.value, yerr=100 * points.stderr.astype(float).fillna(0.0),
                        fmt=marker_of.get(temp, "o"), color=color(sampler), markersize=6,
                        elinewidth=0.8, capsize=2, zorder=3)
            for _, point in points.iterrows():
                if pd.notna(point.nfe_per_block):
                    label = nfe_text(point.nfe_per_block) + (f"/b{point.block_size}" if several_blocks else "")
                    ax.annotate(label, (point.tokens_per_s, 100 * point.value), xytext=(4, 3),
                                textcoords="offset points", fontsize=7, color="0.25")
        present = set(others.sampler.dropna())
        for sampler in [s for s in samplers.names() if s in present] + sorted(present - set(samplers.names())):
            handles.append(Patch(color=color(sampler), label=sampler))
        for temp in temps:  # marker = temperature
            handles.append(Line2D([], [], color="0.35", marker=marker_of[temp], linestyle="none", label=f"T = {temp:g}"))

        # AR greedy on the same model: its own point, and the goal line (drawn even when its speed was not measured)
        greedy = df[(df.task == task) & (df.model == model) & (df.sampler == "ar_greedy")]
        if not greedy.empty:
            reference = 100 * greedy.value.max()
            ax.axhline(AR_REFERENCE_FRACTION * reference, color=color("ar_greedy"), linestyle="--", linewidth=1, zorder=1)
            handles.append(Line2D([], [], color=color("ar_greedy"), linestyle="--", linewidth=1,
                                  label=f"{AR_REFERENCE_FRACTION:.0%} of AR greedy"))
        greedy_timed = group[group.sampler == "ar_greedy"]
        if not greedy_timed.empty:
            ax.errorbar(greedy_timed.tokens_per_s, 100 * greedy_timed.value,
                        yerr=100 * greedy_timed.stderr.astype(float).fillna(0.0), fmt="*", color=color("ar_greedy"),
                        markersize=12, elinewidth=0.8, capsize=2, zorder=4)
            for _, point in greedy_timed.iterrows():
                ax.annotate("AR greedy", (point.tokens_per_s, 100 * point.value), xytext=(7, -10),
                            textcoords="offset points", fontsize=7, bbox=dict(boxstyle="square,pad=0.1", fc="white",
                                                                               ec="none", alpha=0.8))
            handles.append(Line2D([], [], color=color("ar_greedy"), marker="*", markersize=10, linestyle="none",
                                  label="AR greedy (reference)"))

        speed_accuracy = list(zip(group.tokens_per_s, 100 * group.value))
        front = [speed_accuracy[i] for i in pareto_front(speed_accuracy)]
        if len(front) > 1:  # one point alone is no line
            ax.plot(*zip(*front), color="0.4", linewidth=0.8, zorder=2)
            handles.append(Line2D([], [], color="0.4", linewidth=0.8, label="Pareto frontier"))

        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 20, 50, 100 rather than 10^2
        ax.xaxis.set_minor_formatter(NullFormatter())
        if not greedy_timed.empty:  # the issue states speed as a multiple of AR greedy's; after set_xscale, which
            ar_speed = greedy_timed.tokens_per_s.median()  # would reset this axis's ticks
            top = ax.secondary_xaxis("top", functions=(lambda x: x / ar_speed, lambda r: r * ar_speed))
            top.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0)))
            top.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
            top.xaxis.set_minor_formatter(NullFormatter())
            top.set_xlabel("speed-up over AR greedy", fontsize=8)
            top.tick_params(labelsize=8)
        ax.margins(x=0.12, y=0.08)
        ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1.0))  # all-zero accuracies: a 0-1 % axis, not 1e-18
        ax.set_xlabel("decoded tokens/s (log scale)")
        ax.set_ylabel(f"{task} accuracy (%)")
        ax.grid(alpha=0.3, which="both")
        hardware = sorted(set(group.hardware.dropna()))
        ax.set_title(f"{task}, {model}: speed vs accuracy (upper right is better)\n"
                     f"labels: NFE per block (paper's label); {', '.join(hardware) or 'hardware not recorded'}", fontsize=9)
        ax.legend(handles=handles, fontsize=7, loc="best")
        written.append(_save(plt, fig, Path(out_dir) / f"frontier_{_slug(task)}_{_slug(model)}.png"))
    return written


def _save(plt, fig, path: Path) -> Path:
    """Lay out, write and close a figure (closing frees it: pyplot keeps every open figure)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(rows: list[Row], out_dir: str | Path) -> list[Path]:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return accuracy_vs_nfe(rows, out_dir) + genppl_vs_entropy(rows, out_dir) + speed_quality_frontier(rows, out_dir)


LANGUAGE_QUALITY = (("invalid_pairs", "broken word pairs (share)"), ("true_nll", "exact NLL per word of the valid pairs"),
                    ("bigram_tv", "word-pair TV from the exact marginals"))


def plot_language_quality(rows: Iterable[Row], path: str | Path) -> Path | None:
    """The synthetic language (synthlang_gen): exact sample quality against NFE per block, one line per
    (model, sampler), one panel per score; the process's entropy rate and the pair TV of its own samples
    as dashed lines. Adaptive samplers (no NFE until they run) are drawn at their measured mean calls per
    block; AR decoding at NFE 1 of a block-1 step (one call per token) is left out. None: no such rows."""
    from blockgen.harness.evaluation.grids import LANGUAGE_TASK  # the grids import the presets, and torch: the demo's plot only

    rows = [r for r in rows if r.task == LANGUAGE_TASK and r.nfe_per_block is not None and not is_ar(r.sampler or "")]
    if not rows:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(LANGUAGE_QUALITY), figsize=(5 * len(LANGUAGE_QUALITY), 4.2))
    models = sorted({r.model for r in rows})
    styles = dict(zip(models, ("-", "--", ":", "-.")))
    refs = {r.metric: r.value for r in rows if r.metric in ("entropy_rate", "bigram_tv_true")}
    for ax, (metric, title) in zip(axes, LANGUAGE_QUALITY):
        lines: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in rows:
            if r.metric == metric and r.value == r.value:  # NaN: no valid continuation to score
                lines.setdefault((r.model, r.sampler), []).append((r.nfe_per_block, r.value))
        for (model, sampler), points in sorted(lines.items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, styles.get(model, "-"), marker="o", ms=3, color=color(sampler), label=f"{model} {sampler}")
        reference = {"true_nll": refs.get("entropy_rate"), "bigram_tv": refs.get("bigram_tv_true")}.get(metric)
        if reference is not None:
            ax.axhline(reference, color="black", lw=0.8, ls="--", label="the process itself")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("NFE per block of 16")
        ax.set_title(title, fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    more = axes[1].get_legend_handles_labels()
    by_label = dict(zip(labels + more[1], handles + more[0]))
    fig.legend(by_label.values(), by_label.keys(), loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle("Synthetic language: exact sample quality against NFE (line style: model, colour: sampler)", fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * (len(by_label) // 4 + 1), 1, 0.95))  # room for the legend below
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
