"""What batch invariance costs: the fastest batched path, the invariant path and row by row, side by side in one run.

    .venv/bin/python bench/bench_batch_invariant.py
    .venv/bin/python bench/bench_batch_invariant.py --sizes micro --batch-sizes 1 8 --repeats 1
    .venv/bin/python bench/bench_batch_invariant.py --model-len 512   # the same work in a model of 512 positions
    .venv/bin/python bench/bench_batch_invariant.py --prior uniform   # a uniform-state model (default: masked)

For the micro and tiny shapes (random weights: timing only; by default a model exactly as long as the longest
generation): `generate()` tokens/s of every registered sampler kind (ARPC, ancestral, low-confidence remasking, EIPC, confidence threshold, entropy bounded, AR greedy) and `score_windows` windows/s (K_MC = 8 draws per block size, block sizes 1 and 16) at batch 1, 8 and 32, each
- batched: `batch_invariant=False`, the fastest;
- invariant: `batch_invariant=True` (likelihoods: windows grouped by width and batched in the network's row-invariant
  mode; generation: the batch in that mode with a KV cache);
- row by row: every row as a batch of one;
and the ratios of their times to the batched one's. The variants run round-robin, best of --repeats, so load from
other processes hits each alike. It checks that the invariant path's row 0 is its batch-1 result bit for bit.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from blockgen.harness.evaluation.lm_eval_model.scoring import Window, score_windows
from blockgen.models.sampler_config import SamplerConfig
from blockgen.models.sampling import generate

from bench_sampling import tiny_model  # bench/ is on sys.path when the script runs

NEW_TOKENS, PROMPT_LENGTHS, WINDOW_LENGTHS = 64, (32, 64), (48, 128)


def _pool(n: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def best_of(repeats: int, runs: dict) -> dict:
    """{key: best seconds}; the runs alternate round-robin."""
    best = {key: float("inf") for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["micro", "tiny"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prior", choices=["masked", "uniform"], default="masked")
    parser.add_argument("--model-len", type=int, default=PROMPT_LENGTHS[1] + NEW_TOKENS,
                        help="the model's positions (default: the longest prompt and its new tokens)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches, top = args.batch_sizes, max(args.batch_sizes)
    prompts, texts = _pool(top, PROMPT_LENGTHS, 0), _pool(top, WINDOW_LENGTHS, 1)
    samplers = {"arpc(3,3,0)": SamplerConfig("arpc", steps=3, ge=3, max_new_tokens=NEW_TOKENS),
                "ancestral N4": SamplerConfig("ancestral", steps=4, max_new_tokens=NEW_TOKENS),
                "low_confidence N4": SamplerConfig("low_confidence", steps=4, max_new_tokens=NEW_TOKENS),
                "eipc N4 GE2": SamplerConfig("eipc", steps=4, ge=2, max_new_tokens=NEW_TOKENS),
                "confidence_threshold": SamplerConfig("confidence_threshold", steps=16, max_new_tokens=NEW_TOKENS),
                "entropy_bounded": SamplerConfig("entropy_bounded", steps=16, max_new_tokens=NEW_TOKENS),
                "ar_greedy": SamplerConfig("ar_greedy", max_new_tokens=NEW_TOKENS)}
    print(f"batch invariance: batched, invariant and row by row; prompts {PROMPT_LENGTHS[0]}-{PROMPT_LENGTHS[1]} tokens, "
          f"{NEW_TOKENS} new, L' = 16, model length {args.model_len}; windows {WINDOW_LENGTHS[0]}-{WINDOW_LENGTHS[1]} tokens, K_MC 8; "
          f"{args.prior} prior; {torch.get_num_threads()} threads, best of {args.repeats}; load {os.getloadavg()[0]:.2f}")
    modes = ("batched", "invariant", "row by row")
    header = ["model", "work", *(f"b{b} {m}" for m in modes for b in batches),
              *(f"b{b} {m[:3]}/bat" for m in modes[1:] for b in batches)]
    print(" | ".join(f"{h:>14}" for h in header))
    with torch.inference_mode():
        for size in args.sizes:
            model = tiny_model(args.model_len, args.prior, size)
            generate(model, prompts[:2], SamplerConfig("ancestral", steps=2, max_new_tokens=16), -1, 0)  # warm-up
            # run(first row, rows, invariant): row i always has seed i
            work = {name: (lambda i, b, inv, c=config: generate(model, prompts[i : i + b], c, -1, 0, seeds=list(range(i, i + b)),
                                                                batch_invariant=inv), True, "tok/s")
                    for name, config in samplers.items()}
            windows = [Window(tuple(t), 1) for t in texts]
            work["likelihood"] = (lambda i, b, inv: score_windows(model, windows[i : i + b], list(range(i, i + b)), 8, 0, inv),
                                  False, "win/s")
            for name, (run, tokens, unit) in work.items():
                runs = {(b, mode): (lambda b=b, mode=mode: _run_mode(run, b, mode)) for b in batches for mode in modes}
                best = best_of(args.repeats, runs)
                per_row = NEW_TOKENS if tokens else 1  # tokens per row, or one window
                rate = {key: key[0] * per_row / seconds for key, seconds in best.items()}
                cells = [size, f"{name} {unit}", *(f"{rate[b, m]:.0f}" for m in modes for b in batches),
                         *(f"{rate[b, 'batched'] / rate[b, m]:.2f}" for m in modes[1:] for b in batches)]
                print(" | ".join(f"{c:>14}" for c in cells))
                # the invariant path reproduces its batch 1 bit for bit
                alone, together = run(0, 1, True), run(0, top, True)
                first = together.tokens[0] if tokens else together[0]
                assert first == (alone.tokens[0] if tokens else alone[0]), f"{size} {name}: row 0 differs from batch 1"


def _run_mode(run, batch: int, mode: str) -> None:
    """One timed run of rows 0..batch-1: batched, invariant, or row by row (each row alone, invariant)."""
    if mode == "row by row":
        for i in range(batch):
            run(i, 1, True)
    else:
        run(0, batch, mode == "invariant")


if __name__ == "__main__":
    main()
