"""The loss-spike rule of training (`LossSpikeMonitor`), without training: quiet on healthy curves, a
warning exactly at an injected spike. The loop's side (records, warnings, a non-finite loss): tests/test_train.py."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from blockgen.harness.training.train import LossSpikeMonitor, json_number

REPO = Path(__file__).resolve().parents[1]
DEMO_RUNS = ("gsm-ar", "gsm-masked-mix", "gsm-uniform-mix")  # `make demo`'s healthy curves, where it has run


def healthy_curve(steps: int = 800, seed: int = 0) -> list[float]:
    """The shape of the demo's AR run: from ln(V) ~ 6.7 down to ~1e-4 (a memorised training set), with
    multiplicative batch-to-batch noise and, late, the hard batches that lift a near-zero loss by up to
    0.3 nats per token (gsm-ar's step 580: 0.072 against a running average of 0.006)."""
    rng = random.Random(seed)
    curve = [6.7 * (1e-4 / 6.7) ** (k / steps) * math.exp(rng.gauss(0, 0.25)) for k in range(steps)]
    for k in range(steps // 2, steps, 97):
        curve[k] = rng.uniform(0.05, 0.3)
    return curve


def flagged(losses: list[float]) -> list[int]:
    """The 1-based steps the monitor flags."""
    monitor = LossSpikeMonitor()
    return [step for step, loss in enumerate(losses, 1) if monitor.update(loss)]


def test_a_healthy_curve_gives_no_warning():
    assert flagged(healthy_curve()) == []
    assert flagged([1e-4, 3e-4] * 100) == []  # a tiny loss tripling is under the absolute margin
    assert flagged([2.0] * 60 + [5.9]) == []  # half a nat more, but under 3x the average


def test_the_injected_spike_is_flagged_there_only():
    curve = healthy_curve()
    curve[299] = 2.0  # step 300, where the running average is about 0.3
    assert flagged(curve) == [300]
    monitor = LossSpikeMonitor()
    for loss in curve[:299]:
        monitor.update(loss)
    avg = monitor.average
    assert 0.05 < avg < 0.5 and monitor.update(curve[299])  # what the record's loss_avg holds
    # At a high loss the ratio decides: 3x an average of 2 and more.
    assert flagged([2.0] * 60 + [6.5]) == [61]


def test_the_first_steps_never_warn():
    """An erratic start (a warm-started run's first steps jump by 2x) is not a spike: the first 10 steps
    never count, and the average they leave keeps later steps quiet."""
    start = [6.6, 5.7, 6.9, 2.3, 5.6, 12.2, 5.3, 4.9, 6.8, 4.2]  # gsm-uniform-mix's first ten steps
    assert flagged(start + [4.4, 3.8, 3.1]) == []
    assert flagged([0.1] * 5 + [9.0]) == []  # 90x, but at step 6


def test_non_finite_values_are_written_as_strings():
    assert [json_number(x) for x in (1.5, math.nan, math.inf, -math.inf)] == [1.5, "nan", "inf", "-inf"]
    assert json.loads(json.dumps({"loss": json_number(math.nan)})) == {"loss": "nan"}  # valid JSON, read back by float()


@pytest.mark.parametrize("run", DEMO_RUNS)
def test_the_demo_runs_curves_give_no_warning(run):
    path = REPO / "runs" / "demo" / run / "metrics.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not there (`make demo` writes it)")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert flagged([r["loss"] for r in records]) == []
