"""Decoding speed of each sampler against AR greedy on the same trained checkpoint, by batch size.

    .venv/bin/python bench/bench_sampler_speed.py runs/demo/gsm-masked-mix/checkpoint --batch-sizes 1 32

Every setting runs `gsm8k_code_embedded` through lm-eval (`wordproblem_eval.evaluate_embedded`, the
demo's code path, one thread) on the same problems; tokens/s is the adapter's generated tokens over
its generation time (prompt encoding, sandbox and lm-eval's bookkeeping excluded). The settings run
round-robin, best of `--repeats`, so load from other processes hits every one alike; the table gives
each sampler's tokens/s as a multiple of AR greedy's at the same batch size, and its accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from blockgen.harness.demo import DEMO_MAX_GEN_TOKS, DIFFUSION_VARIANTS
from blockgen.harness.evaluation.grids import sampler_label
from blockgen.models.sampler_config import SamplerConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--nfes", type=int, nargs="+", default=[4], choices=sorted(DIFFUSION_VARIANTS))
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from blockgen.harness.reports.leaderboard import rows_from_results
    from blockgen.harness.evaluation.wordproblem_eval import evaluate_embedded

    samplers = [SamplerConfig("ar_greedy")] + [
        replace(v, temperature=args.temperature) for nfe in args.nfes for v in DIFFUSION_VARIANTS[nfe]
    ]
    best: dict[tuple[int, str], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for batch in args.batch_sizes:
                for sampler in samplers:
                    path = Path(tmp) / "results.json"
                    evaluate_embedded(args.checkpoint, sampler, args.problems, max_gen_toks=DEMO_MAX_GEN_TOKS,
                                      batch_size=batch, results_path=path)
                    (row,) = [r for r in rows_from_results(json.loads(path.read_text()), str(path)) if r.metric == "exact_match"]
                    key = (batch, sampler_label(sampler))
                    best[key] = max(best.get(key, (0.0, 0.0)), (row.tokens_per_s, row.value))
    print(f"{args.checkpoint}: {args.problems} problems, 1 thread, best of {args.repeats}, load {os.getloadavg()[0]:.2f}")
    print(f"{'batch':>5} {'sampler':<28} {'tok/s':>8} {'x AR greedy':>11} {'accuracy':>9}")
    for batch in args.batch_sizes:
        ar = best[(batch, "ar_greedy")][0]
        for sampler in samplers:
            speed, accuracy = best[(batch, sampler_label(sampler))]
            print(f"{batch:>5} {sampler_label(sampler):<28} {speed:>8.0f} {speed / ar:>11.2f} {accuracy:>9.1%}")


if __name__ == "__main__":
    main()
