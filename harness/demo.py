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

from blockgen.harness.train import preset, train


def last_validation(metrics_path: Path) -> dict:
    """The last record of a run's metrics.jsonl that holds validation numbers."""
    found: dict = {}
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)
        if "val_nll_lse" in record:
            found = record
    return found


def run_demo(out_dir: str, presets: list[str], max_steps: int | None = None) -> dict:
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
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_table(summary)
    return summary


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
