"""The embedded default: train the demo models offline on CPU and summarise them.

Data are generated word problems, the tokenizer is trained locally, the models are tiny; nothing
touches the network. Each model is a normal checkpoint under `out_dir/<preset>/checkpoint`, so a
rerun resumes (or skips) finished models.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from blockgen.harness.checkpoint import read_config
from blockgen.harness.train import preset, train
from blockgen.harness.wordproblem_eval import evaluate_embedded
from blockgen.models.sampling import SamplerConfig

# Low temperature matters for tiny diffusion models (../shared/REFERENCE.md calibration); NFE per
# block is about 8 for every diffusion sampler: ARPC (6, GE 3) makes 6 + 1 + 1 calls by appendix D.
DIFFUSION_SAMPLERS = (
    SamplerConfig("ancestral", steps=8, temperature=0.1),
    SamplerConfig("eipc", steps=8, ge=2, temperature=0.1),
)
MIXTURE_SAMPLERS = (
    SamplerConfig("ancestral", steps=8, temperature=0.1),
    SamplerConfig("arpc", steps=6, ge=3, temperature=0.1),
    SamplerConfig("ar_greedy"),
)
AR_SAMPLERS = (SamplerConfig("ar_greedy"),)
# Tokens each answer may take (5 blocks of 16), leaving 48 of the demo's 128 for the prompt
# (lm-eval's convention: a fixed generation budget, the prompt cut from the left to fit, counted).
# Of the first 500 test problems with the demo's tokenizer, 80 is the budget under which the most
# have both their question and their reference program fit: 362 (64: 330, 96: 100).
DEMO_MAX_GEN_TOKS = 80


def samplers_for(block_sizes: tuple[int, ...]) -> tuple[SamplerConfig, ...]:
    if block_sizes == (1,):
        return AR_SAMPLERS
    return MIXTURE_SAMPLERS if 1 in block_sizes else DIFFUSION_SAMPLERS


def sampler_label(s: SamplerConfig) -> str:
    if s.name.startswith("ar_"):
        return s.name
    extra = f",GE{s.ge}" if s.name in ("eipc", "arpc") else ""
    return f"{s.name}(N{s.steps}{extra},T{s.temperature:g})"


def last_validation(metrics_path: Path) -> dict:
    """The last record of a run's metrics.jsonl that holds validation numbers."""
    found: dict = {}
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)
        if "val_nll_lse" in record:
            found = record
    return found


def run_demo(out_dir: str, presets: list[str], max_steps: int | None = None, n_problems: int = 200) -> dict:
    out = Path(out_dir)
    summary: dict[str, dict] = {}
    for name in presets:
        overrides = {"out_dir": str(out / name), "data": replace(preset(name).data, cache_dir=str(out / "data"))}
        if max_steps is not None:
            overrides["max_steps"] = max_steps
        config = preset(name, **overrides)
        start = time.perf_counter()
        checkpoint = train(config)
        val = last_validation(Path(config.out_dir) / "metrics.jsonl")
        summary[name] = {
            "checkpoint": str(checkpoint),
            "prior": config.prior,
            "block_sizes": list(config.block_sizes),
            "block_weights": list(config.block_weights),
            "steps": config.max_steps,
            "train_seconds": round(time.perf_counter() - start, 1),
            "val_nll_per_token_lse": val.get("val_nll_lse"),
            "val_nll_per_token_jensen": val.get("val_nll_jensen"),
            "accuracy": evaluate_checkpoint(checkpoint, n_problems),
        }
    (out / "summary.json").write_text(json.dumps({"provenance": provenance(), "models": summary}, indent=2))
    print_table(summary)
    return summary


def provenance() -> dict:
    """How the numbers were obtained: command, commit, machine, versions, date."""
    import os
    import platform
    import subprocess
    import sys
    from datetime import datetime, timezone

    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    return {
        "command": " ".join(["blockgen", *sys.argv[1:]]),
        "commit": commit or None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads",
    }


def evaluate_checkpoint(checkpoint: Path, n_problems: int) -> dict[str, dict]:
    """Accuracy of each sampler that fits the model on generated held-out test problems, from the
    lm-eval task gsm8k_code_embedded (the same run as `lm_eval --tasks gsm8k_code_embedded`)."""
    reports = {}
    for sampler in samplers_for(read_config(checkpoint).block_sizes):
        report = evaluate_embedded(checkpoint, sampler, n_problems, max_gen_toks=DEMO_MAX_GEN_TOKS)
        reports[sampler_label(sampler)] = report
        print(f"  {sampler_label(sampler):<28} accuracy {_pct(report['accuracy'])} of {report['n']} "
              f"(in distribution {_pct(report['accuracy_in_distribution'])}, held-out structures "
              f"{_pct(report['accuracy_heldout'])}), model calls/block {report['model_calls_per_block']:.2f} "
              f"(paper NFE label {report['paper_nfe_per_block']}), prompts truncated {report['truncated_prompts']}")
    return reports


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.1%}"


def print_table(summary: dict[str, dict]) -> None:
    header = f"{'model':<18} {'prior':<8} {'block sizes':<12} {'steps':>6} {'train s':>8} {'val NLL/tok (LSE)':>18} {'(Jensen)':>9}"
    print(header)
    print("-" * len(header))
    for name, row in summary.items():
        sizes = ",".join(map(str, row["block_sizes"]))
        print(
            f"{name:<18} {row['prior']:<8} {sizes:<12} {row['steps']:>6} {row['train_seconds']:>8} "
            f"{row['val_nll_per_token_lse']:>18.4f} {row['val_nll_per_token_jensen']:>9.4f}"
        )
        for label, report in row["accuracy"].items():
            print(f"{'':<18}   {label:<30} accuracy {report['accuracy']:6.1%}  calls/block {report['model_calls_per_block']:.2f}")
