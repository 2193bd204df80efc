"""Throughput of the gsm8k_code sandbox against a naive runner, measured side by side.

    python bench/bench_sandbox.py [--programs 200] [--rounds 3] [--workers N]

All runners execute the same TinyGSM-style programs with the same number of workers:
- sandbox: `blockgen.tasks.sandbox.run_many` (bwrap: namespaces and a minimal root, seccomp,
  rlimits, a uid per run, per-run memory/pids/cpu cgroups where the machine allows them); the
  same with `cgroups=False` shows what the cgroups cost;
- naive: a `multiprocessing` pool whose workers fork/exec `python -c` with a timeout and read
  the answer from stdout, with no isolation at all. The same runner with `python -I -S` is shown
  too, because interpreter start-up flags alone change the cost of a program a lot.
Rounds alternate the runners so that load from other processes hits them alike; the median
round is reported.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

from blockgen.tasks.gsm8k_code import is_correct
from blockgen.tasks.sandbox import SandboxConfig, isolation_report, run_many

# Ten programs in the TinyGSM format, with their answers.
PROGRAMS: list[tuple[str, int | float]] = [
    (
        '''def simple_math_problem() -> int:
    """Janet's ducks lay 16 eggs per day. She eats 3 and bakes with 4. She sells the rest
    for $2 each. How much does she make every day?"""
    eggs_per_day = 16
    eaten = 3
    baked = 4
    price = 2
    remaining = eggs_per_day - eaten - baked
    result = remaining * price
    return result
''',
        18,
    ),
    (
        '''import math

def simple_math_problem() -> int:
    """A class of 27 students goes on a trip. Each van holds 8 students. How many vans?"""
    students = 27
    per_van = 8
    vans = math.ceil(students / per_van)
    result = vans
    return result
''',
        4,
    ),
    (
        '''def simple_math_problem() -> float:
    """A $80 jacket is 15% off, then 8% sales tax is added. What is the final price?"""
    price = 80
    discount = price * 0.15
    discounted = price - discount
    tax = discounted * 0.08
    result = discounted + tax
    return result
''',
        73.44,
    ),
    (
        '''def simple_math_problem() -> int:
    """Tom saves $5 in week 1 and $3 more each week than the week before. Total after 10 weeks?"""
    total = 0
    saving = 5
    for week in range(10):
        total += saving
        saving += 3
    result = total
    return result
''',
        185,
    ),
    (
        '''from fractions import Fraction

def simple_math_problem() -> float:
    """A recipe uses 3/4 cup of sugar per batch. How many cups for 6 batches?"""
    per_batch = Fraction(3, 4)
    batches = 6
    result = float(per_batch * batches)
    return result
''',
        4.5,
    ),
    (
        '''def simple_math_problem() -> int:
    """A store sells pencils at $1, pens at $2 and markers at $3. Sam buys 4, 3 and 2.
    How much does he spend?"""
    prices = {"pencil": 1, "pen": 2, "marker": 3}
    counts = {"pencil": 4, "pen": 3, "marker": 2}
    result = sum(prices[item] * counts[item] for item in prices)
    return result
''',
        16,
    ),
    (
        '''def simple_math_problem() -> float:
    """A car travels 150 miles in 2.5 hours. What is its average speed?"""
    distance = 150
    hours = 2.5
    result = distance / hours
    return result
''',
        60.0,
    ),
    (
        '''def simple_math_problem() -> int:
    """Each of 4 shelves holds 12 books; 7 books are lent out. How many books remain?"""
    def books_on_shelves(shelves, per_shelf):
        return shelves * per_shelf

    total = books_on_shelves(4, 12)
    lent = 7
    result = total - lent
    return result
''',
        41,
    ),
    (
        '''def simple_math_problem() -> int:
    """A population of 100 bacteria doubles every hour. After how many hours is it over 5000?"""
    population = 100
    hours = 0
    while population <= 5000:
        population *= 2
        hours += 1
    result = hours
    return result
''',
        6,
    ),
    (
        '''def simple_math_problem() -> float:
    """Three friends split a $47.25 bill and a 20% tip equally. How much does each pay?"""
    bill = 47.25
    tip = bill * 0.20
    friends = 3
    result = round((bill + tip) / friends, 2)
    return result
''',
        18.9,
    ),
]

# The naive runner: execute the program in a fresh interpreter, print the answer.
_NAIVE_MAIN = (
    "import sys\n"
    "scope = {'__name__': '__main__'}\n"
    "exec(sys.stdin.read(), scope)\n"
    "print(repr(scope['simple_math_problem']()))\n"
)


def _naive_one(job: tuple[tuple[str, ...], str]) -> float | None:
    flags, code = job
    try:
        done = subprocess.run(
            [sys.executable, *flags, "-c", _NAIVE_MAIN],
            input=code,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return float(done.stdout.split()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def naive(programs: list[str], workers: int, flags: tuple[str, ...]) -> list[float | None]:
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_naive_one, [(flags, code) for code in programs], chunksize=1)


def sandbox(programs: list[str], workers: int, config: SandboxConfig) -> list[float | None]:
    return [r.value for r in run_many(programs, config, max_workers=workers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, default=200, help="programs per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    programs = [PROGRAMS[i % len(PROGRAMS)][0] for i in range(args.programs)]
    answers = [PROGRAMS[i % len(PROGRAMS)][1] for i in range(args.programs)]
    runners: dict[str, Callable[[], list[float | None]]] = {
        "sandbox (full isolation)": lambda: sandbox(programs, args.workers, SandboxConfig()),
        "sandbox, cgroups=False": lambda: sandbox(programs, args.workers, SandboxConfig(cgroups=False)),
        "naive fork/exec, python -c": lambda: naive(programs, args.workers, ()),
        "naive fork/exec, python -I -S -c": lambda: naive(programs, args.workers, ("-I", "-S")),
    }
    print(
        f"{args.programs} programs x {args.rounds} rounds, {args.workers} workers, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.2f} before"
    )
    print("sandbox isolation:", ", ".join(isolation_report()))
    for run in runners.values():  # warm-up: page cache, pyc files
        run()

    times: dict[str, list[float]] = {name: [] for name in runners}
    correct: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            values = run()
            times[name].append(time.perf_counter() - start)
            correct[name] = sum(is_correct(v, a) for v, a in zip(values, answers))

    print(f"{'runner':34s} {'programs/s':>10s} {'ms/program':>10s} {'correct':>9s}")
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in median.items():
        print(
            f"{name:34s} {args.programs / seconds:10.1f} {1000 * seconds / args.programs:10.2f}"
            f" {correct[name]:>5d}/{args.programs}"
        )
    print(f"load average {os.getloadavg()[0]:.2f} after (other processes share the CPUs)")
    box, _, plain, lean = median.values()
    print(f"time per program, sandbox / naive: {box / plain:.2f}x")
    print(f"time per program, sandbox / naive -I -S: {box / lean:.2f}x")


if __name__ == "__main__":
    main()
