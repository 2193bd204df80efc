"""PNG plots of leaderboard rows (matplotlib, headless).

- accuracy vs NFE per block, one line per sampler and prior, one panel per temperature, one figure
  per (task, generation block size): the paper's figures 1-2 (best variant per NFE; AR as
  horizontal lines, since it has no NFE per block);
- generative perplexity vs unigram entropy, one curve per model and sampler setting across
  temperatures: the paper's figure 3.
Published rows are drawn thin and faded beside this project's rows, labelled "(paper)".
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from blockgen.harness.leaderboard import Row, best_per_nfe, table

ACCURACY_METRICS = ("exact_match",)
GENPPL_METRICS = ("gen_ppl",)  # generative perplexity under the scorer model
ENTROPY_METRICS = ("unigram_entropy",)  # mean per-sample unigram entropy
AR_SAMPLERS = ("ar_greedy", "ar_sample")
COLORS = {"ancestral": "tab:blue", "eipc": "tab:green", "arpc": "tab:red", "ar_greedy": "black", "ar_sample": "tab:gray"}


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
    plt = _pyplot()
    from matplotlib.ticker import ScalarFormatter

    written = []
    diffusion = best_per_nfe(df[~df.sampler.isin(AR_SAMPLERS) & df.nfe_per_block.notna()])
    ar = df[df.sampler.isin(AR_SAMPLERS)]
    for (task, block), group in diffusion.groupby(["task", "block_size"], dropna=False):
        temps = sorted(group.temperature.dropna().unique(), reverse=True) or [None]
        fig, axes = plt.subplots(1, len(temps), figsize=(max(5.2 * len(temps), 7.5), 4.2), squeeze=False, sharey=True)
        for ax, temp in zip(axes[0], temps):
            panel = group[group.temperature == temp] if temp is not None else group
            for (published, sampler, prior), line in panel.groupby(["published", "sampler", "prior"], dropna=False):
                line = line.sort_values("nfe_per_block")
                ax.plot(line.nfe_per_block, 100 * line.value, marker="o", color=COLORS.get(sampler, "tab:purple"),
                        linestyle="-" if prior == "masked" else "--", linewidth=1 if published else 2,
                        alpha=0.45 if published else 1.0, markersize=3 if published else 5,
                        label=f"{sampler} {prior}" + (" (paper)" if published else ""))
            for (published, sampler), line in ar[ar.task == task].groupby(["published", "sampler"]):
                ax.axhline(100 * line.value.max(), color=COLORS[sampler], linestyle=":", linewidth=1,
                           alpha=0.45 if published else 1.0, label=f"AR {sampler.removeprefix('ar_')}" + (" (paper)" if published else ""))
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())  # 4, 8, 16 rather than 2^2, 2^3, 2^4
            ax.set_xlabel("NFE per block (paper's label)")
            ax.set_title(f"T = {temp:g}" if temp is not None else "")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(f"{task} accuracy (%)")
        axes[0][-1].legend(fontsize=7, loc="lower right")
        fig.suptitle(f"{task}: accuracy vs NFE, block size {block}, best variant per NFE", fontsize=11)
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
        for key, curve in group.groupby(curve_keys, dropna=False):
            published, model, sampler, steps, ge, warmup, nfe = key
            curve = curve.sort_values("temperature")
            label = f"{model} {sampler}" + ("" if sampler in AR_SAMPLERS else f" NFE {nfe}") + (" (paper)" if published else "")
            ax.plot(curve.entropy, curve.value, marker="o", color=COLORS.get(sampler, "tab:purple"),
                    alpha=0.45 if published else 1.0, label=label)
            for _, point in curve.iterrows():
                ax.annotate(f"T{point.temperature:g}", (point.entropy, point.value), fontsize=6, alpha=0.7)
        ax.set_yscale("log")
        ax.set_xlabel("unigram entropy (nats, mean per sample)")
        ax.set_ylabel("generative perplexity")
        ax.set_title(f"{task}: Gen PPL vs entropy (lower right is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(plt, fig, Path(out_dir) / f"genppl_vs_entropy_{_slug(task)}.png"))
    return written


def _save(plt, fig, path: Path) -> Path:
    """Lay out, write and close a figure (closing frees it: pyplot keeps every open figure)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(rows: list[Row], out_dir: str | Path) -> list[Path]:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return accuracy_vs_nfe(rows, out_dir) + genppl_vs_entropy(rows, out_dir)
