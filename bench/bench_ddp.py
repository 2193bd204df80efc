"""Training throughput: 2 torchrun processes (gloo, CPU) against 1 process, on the same global batch.

Runs the real trainer (`blockgen train` under torchrun) for each variant, interleaved over
`--rounds` so machine noise hits every variant alike, and reads the per-step times the trainer
logs in metrics.jsonl (the first `--skip` steps of each run, start-up included, are left out):

- 1 process x 1 thread, 1 process x 2 threads: the single-process baselines on the same cores;
- 2 processes x 1 thread: DistributedDataParallel over gloo, each rank half of the global batch.

    python bench/bench_ddp.py [--preset tinygsm-embedded-masked-mix] [--size tiny] [--steps 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {  # name: (processes, threads per process)
    "1 process x 1 thread": (1, 1),
    "1 process x 2 threads": (1, 2),
    "2 processes x 1 thread (gloo)": (2, 1),
}


def run(variant: tuple[int, int], args, work: Path, index: int) -> list[float]:
    procs, threads = variant
    out = work / f"run{index}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
        "-m", "blockgen.harness.cli", "train", "--preset", args.preset, "--out-dir", str(out), "--device", "cpu",
        "--max-steps", str(args.steps), "--eval-every", str(10**9), "--save-every", str(10**9), "--size", args.size,
        "--batch-size", str(args.batch), "--data.cache-dir", str(work / "data-cache"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_seconds"] for r in records[args.skip :]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tinygsm-embedded-masked-mix")
    parser.add_argument("--size", default="tiny", choices=["micro", "tiny"])
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences per optimizer step)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="leading steps of each run left out")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run((1, 1), argparse.Namespace(**{**vars(args), "steps": 2, "skip": 0}), work, -1)  # tokenizer and data cache
        index = 0
        for _ in range(args.rounds):
            for name, variant in VARIANTS.items():
                times[name] += run(variant, args, work, index)
                index += 1
    load = os.getloadavg()
    print(f"preset {args.preset}, size {args.size}, global batch {args.batch}, {args.steps} steps x {args.rounds} rounds "
          f"(first {args.skip} of each run left out); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    ref = statistics.median(times["1 process x 1 thread"])
    print(f"{'variant':<32} {'median s/step':>14} {'steps/s':>8} {'x 1 process x 1 thread':>24}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<32} {med:>14.4f} {1 / med:>8.2f} {ref / med:>24.2f}")


if __name__ == "__main__":
    main()
