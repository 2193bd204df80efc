"""How the demo's training degrades when another program wants a core.

The demo runs one single-threaded worker per usable core, except for its first model (the AR parent,
which nothing else can run beside) which gets every core as OpenMP threads. Three layouts are measured
on a quiet machine and beside one busy single-threaded competitor (a Python spin loop, like a user's
other job), in the same run: single-threaded workers; one process with `cores` threads whose idle
threads spin (OpenMP's default); the same with `OMP_WAIT_POLICY=PASSIVE` (idle threads sleep, what
the demo sets):

    python bench/bench_contention.py [--steps 15] [--preset gsm-masked-mix]

Printed: training steps per second of all workers together (median step times), and each layout's
slowdown beside the competitor (quiet rate / contended rate; 1.5x is the fair cost of sharing two
cores with a third busy process).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

def spin() -> None:
    while True:
        pass


def run_layout(workers: int, threads: int, wait_policy: str | None, steps: int, preset_name: str, cache: str) -> float:
    """Steps per second of `workers` training processes with `threads` threads each, together: the
    sum of each worker's 1 / median step time (from its metrics.jsonl; start-up excluded)."""
    cmd = [sys.executable, "-m", "blockgen.harness.cli", "train", "--preset", preset_name, "--max-steps", str(steps),
           "--save-every", "100000", "--data.cache-dir", cache, "--data.n-train", "2000"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(OMP_NUM_THREADS=str(threads), **({"OMP_WAIT_POLICY": wait_policy} if wait_policy else {}))
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([*cmd, "--out-dir", f"{tmp}/w{i}"], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for i in range(workers)]
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError(f"a training worker failed: {' '.join(cmd)}")
        rate = 0.0
        for i in range(workers):
            records = [json.loads(line) for line in open(f"{tmp}/w{i}/metrics.jsonl")]
            seconds = [r["step_seconds"] for r in records if "step_seconds" in r][2:]  # skip warm-up steps
            rate += 1 / statistics.median(seconds)
        return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--preset", default="gsm-masked-mix")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="bench-contention-")
    layouts = {f"{args.cores} workers x 1 thread": (args.cores, 1, None),
               f"1 worker x {args.cores} threads, spinning": (1, args.cores, None),
               f"1 worker x {args.cores} threads, PASSIVE": (1, args.cores, "PASSIVE")}
    run_layout(1, 1, None, 3, args.preset, cache)  # builds the tokenizer once, outside the timings
    rates: dict[tuple[str, bool], float] = {}
    for competitor in (False, True, False, True):  # interleaved: machine noise hits both alike
        busy = mp.Process(target=spin, daemon=True) if competitor else None
        if busy:
            busy.start()
        try:
            for label, (workers, threads, policy) in layouts.items():
                rate = run_layout(workers, threads, policy, args.steps, args.preset, cache)
                rates.setdefault((label, competitor), [])
                rates[label, competitor].append(rate)
        finally:
            if busy:
                busy.terminate()
    print(f"load average at the end: {os.getloadavg()}; {args.steps} steps of {args.preset} per worker, "
          "median step times (start-up and the first two steps left out)")
    for label in layouts:
        quiet = statistics.median(rates[label, False])
        busy = statistics.median(rates[label, True])
        print(f"{label:<36} quiet {quiet:.3f} steps/s, beside a busy process {busy:.3f} steps/s, slowdown {quiet / busy:.2f}x")


if __name__ == "__main__":
    main()
