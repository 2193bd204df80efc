"""The verdict of `blockgen gpu-check` and what it leaves behind. The summary is printed as JSON and written
to OUT_DIR/summary.json (`budget`: the budget, each stage's share and the seconds it used), and
`summary_table` (stage, status ok / failed / skipped / truncated, seconds, share, key figure) goes to
stderr; `ok` is true only when every stage that applies passed (`failed` names the others; the command
prints each with its fix and exits 1). A truncated stage that measured something is not a failure; one
that measured nothing (it ran out of budget before its first measurement) fails the check on a GPU, and
so does any stage that skipped itself there, except ddp on one GPU. The rates it measured (generate's
seconds per call, train's seconds per likelihood pass and tokens/s, each with the precision it ran in)
go to OUT_DIR/rates.json (harness/costs/rates.py), which `blockgen sweep GRID --dry-run` and `blockgen
train-cost` price full-scale runs with when it was measured at the paper's size.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from blockgen.harness.costs.rates import RATES_VERSION, CallRate, PassRate, Provenance, Rates, TrainRate
from blockgen.harness.gpu_check.config import TRAIN_BLOCK_SIZES


def stage_failed(result: dict, cuda: bool) -> bool:
    """An error in the stage or in one of its runs; on a GPU also a stage that skipped itself where it applies
    (the scorer without a CUDA build of vLLM: the check is of the GPU, and a part left out of it is not
    checked; ddp on one GPU does not apply), and a stage the budget stopped before it measured anything."""
    if "error" in result or any("error" in run for run in result.get("runs", ())):
        return True
    if not cuda:
        return False
    return ("skipped" in result and result.get("applies", True)) or ("truncated" in result and not _measured(result))


def _measured(result: dict) -> bool:
    """A truncated stage measured something: a run (train, generate) or a figure (scorers' transformers side)."""
    return bool(result.get("runs")) or "tokens" in result


def stage_status(result: dict, cuda: bool) -> str:
    """ok, failed, truncated (stopped by the budget, not failed) or skipped (not failed)."""
    if stage_failed(result, cuda):
        return "failed"
    return "truncated" if "truncated" in result else "skipped" if "skipped" in result else "ok"


def _key_figure(name: str, r: dict) -> str:
    """The one number a reader looks for first in a stage's result; else why there is none."""
    why = r.get("error") or r.get("skipped") or r.get("truncated") or ""
    figure = ""
    if name == "train":
        best = {}
        for run in r.get("runs", ()):  # per prior, its largest micro-batch measured
            if "tokens_per_s" in run and run["micro_batch"] >= best.get(run["prior"], {}).get("micro_batch", 0):
                best[run["prior"]] = run
        figure = ", ".join(f"{p} {run['tokens_per_s']:,.0f} tokens/s at {run['micro_batch']} x {run['seq_len']}" for p, run in best.items())
    elif name == "ddp" and "tokens_per_s" in r:
        figure = f"{r['world_size']} x {r['backend']}: {r['s_per_step']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s"
    elif name == "generate":
        rows = [x for x in r.get("runs", ()) if x["sampler"] == "arpc" and "tokens_per_s" in x]
        figure = ", ".join(f"arpc batch {x['batch']}: {x['tokens_per_s']:,.0f} tokens/s" for x in rows[-2:])
    elif name == "lm_eval" and "metrics" in r:
        figure = f"exact_match {r['metrics'].get('exact_match,sandbox', float('nan')):.2f} on {r['limit']} problems"
    elif name == "scorers" and "relative_difference" in r:
        figure = f"Gen PPL vLLM vs transformers: {r['relative_difference']:.1e} relative"
    if "error" in r or not figure:
        figure = why.splitlines()[0][:90] if why else ""
    return figure


def summary_table(summary: dict) -> str:
    """One line per stage: stage, status, seconds, share of the budget, key figure; then the verdict."""
    cuda = summary["mode"] == "gpu"
    header = ("stage", "status", "seconds", "share", "key figure")
    rows = [(name, stage_status(r, cuda), f"{r['stage_seconds']:.1f}", f"{r['share']:.0%} ({r['share_s']:.0f} s)", _key_figure(name, r))
            for name, r in summary["stages"].items()]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() for row in (header, *rows)]
    verdict = "ok" if summary["ok"] else f"FAILED: {', '.join(summary['failed'])}"
    lines.append(f"total {summary['total_seconds']:.1f} s of a {summary['budget']['budget_s']:.0f} s budget: {verdict}")
    return "\n".join(lines)


def measured_rates(summary: dict, out: Path) -> Rates | None:
    """The rates file of this check (harness/costs/rates.py): the generate stage's seconds per sampler call per
    sampler, block size and batch, the train stage's seconds per likelihood pass per prior and micro-batch,
    and its training tokens/s per prior and micro-batch, each in the precision it ran; None when neither
    stage measured anything."""
    stages = summary["stages"]
    generate, train = stages.get("generate", {}), stages.get("train", {})
    calls = tuple(CallRate(generate["precision"], r["sampler"], r["block_size"], r["batch"], r["ms_per_call"] / 1e3)
                  for r in generate.get("runs", ()) if "ms_per_call" in r)
    passes = tuple(PassRate(train["likelihood_precision"], "blockgen", r["prior"], r["micro_batch"], r["seq_len"], r["likelihood_pass_s"])
                   for r in train.get("runs", ()) if "likelihood_pass_s" in r)
    training = tuple(TrainRate(train["precision"], r["prior"], tuple(r["block_sizes"]), r["micro_batch"], r["seq_len"], r["tokens_per_s"],
                               r["peak_memory_gb"]) for r in train.get("runs", ()) if "tokens_per_s" in r)
    if not calls and not passes and not training:
        return None
    scale = summary["scale"]
    provenance = Provenance(
        command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), date=summary["date_utc"] + " UTC", commit=_commit(),
        source=str(out / "summary.json"),
        notes=f"blockgen gpu-check on {summary['name']} ({summary['device']}), {scale['size']} size, random weights: "
              f"generate() with prompts of {scale['prompt_len']} and {scale['new_tokens']} new tokens, eager, TF32 off; "
              "likelihood passes: one NELBO draw at block size 16 over [x0 ; xt], eager, after the training runs; "
              f"training: one process, the {'/'.join(map(str, TRAIN_BLOCK_SIZES))} mixture's weighted step, "
              f"{'compiled' if scale['compile'] else 'eager'}, no data loading, no DDP")
    return Rates(RATES_VERSION, summary["name"], scale["size"], provenance, calls, passes, training)


def _commit() -> str:
    """The checkout's commit (with -dirty for uncommitted changes), or why there is none."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({type(err).__name__})"
    return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"
