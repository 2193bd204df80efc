"""Training curves side by side: `blockgen curves RUN [RUN ...] --out curves.png`.

Each run is a training folder with its `metrics.jsonl` (`blockgen train`'s record of every step): the loss
(log scale, so a plateau and the drop after it show at any size) with the validation NLL where the run
measured it (`--eval-every`), the gradient norm before clipping, and the steps the run flagged as loss spikes
(`loss_spike` in its records). Runs of one recipe with other
seeds, drawn together, show where one run leaves the others.
"""

from __future__ import annotations

import sys
from pathlib import Path

from blockgen.harness.training.metrics_log import read_records


def plot_curves(runs: dict[str, str | Path], out: str | Path) -> Path:
    """One figure: loss and gradient norm against step, one line per run (label -> folder or metrics.jsonl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, grad_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for label, run in runs.items():
        records = [r for r in read_records(run) if isinstance(r.get("loss"), (int, float))]
        steps = [r["step"] for r in records]
        line, = loss_ax.plot(steps, [r["loss"] for r in records], lw=0.8, label=label)
        grad_ax.plot(steps, [r.get("grad_norm", float("nan")) for r in records], lw=0.8, color=line.get_color(), label=label)
        # Validation (`--eval-every`), on the loss's axis: the held-out NLL per token of the EMA weights.
        evals = [r for r in records if isinstance(r.get("val_nll_lse"), (int, float))]
        loss_ax.plot([r["step"] for r in evals], [r["val_nll_lse"] for r in evals], "o--", ms=5, lw=1.2, mec="black",
                     zorder=4, color=line.get_color())
        spikes = [r for r in records if r.get("loss_spike")]
        loss_ax.scatter([r["step"] for r in spikes], [r["loss"] for r in spikes], color=line.get_color(), marker="x", zorder=3)
    loss_ax.set(yscale="log", xlabel="step", ylabel="training loss (nats per token)", title="loss (o: validation NLL, x: flagged spikes)")
    grad_ax.set(yscale="log", xlabel="step", ylabel="gradient norm before clipping", title="gradient norm")
    loss_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def build_parser(parser) -> None:
    parser.add_argument("runs", nargs="+", help="training folders (or metrics.jsonl files); LABEL=PATH names a line")
    parser.add_argument("--out", default="curves.png", help="the PNG to write (default: %(default)s)")


def main(args) -> int:
    runs = dict(r.split("=", 1) if "=" in r else (Path(r).name, r) for r in args.runs)
    try:
        print(plot_curves(runs, args.out))
    except (OSError, ValueError) as err:  # a folder without metrics.jsonl, a corrupt line, an --out that cannot be written
        print(f"blockgen curves: error: {err}", file=sys.stderr)
        return 2
    return 0
