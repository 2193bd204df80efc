"""Paired comparisons (`blockgen.harness.compare`): the exact McNemar test against a hand computation,
Newcombe's paired interval against a paired bootstrap of the same outcomes and narrower than the
unpaired one, Gen PPL's paired bootstrap, and the command on lm-eval-format logs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from blockgen.harness.compare import (
    CompareError,
    compare,
    compare_accuracy,
    compare_gen_ppl,
    mcnemar_exact,
    newcombe_paired,
    wilson,
)

BIN = Path(sys.executable).parent


def outcomes(both: int, a_only: int, b_only: int, neither: int, seed: int = 0) -> tuple[list[float], list[float]]:
    pairs = [(1, 1)] * both + [(1, 0)] * a_only + [(0, 1)] * b_only + [(0, 0)] * neither
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [float(pairs[i][0]) for i in order], [float(pairs[i][1]) for i in order]


def test_mcnemar_exact_against_a_hand_computation():
    # 7 vs 2 discordant: P(X <= 2) for X ~ Bin(9, 1/2) is (1 + 9 + 36) / 512; two-sided doubles it
    assert mcnemar_exact(7, 2) == pytest.approx(2 * (1 + 9 + 36) / 512, rel=1e-12)
    assert mcnemar_exact(2, 7) == mcnemar_exact(7, 2)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 2**10, rel=1e-12)


def test_wilson_interval_by_its_definition():
    # the Wilson interval's ends are the p0 where |p - p0| = z sqrt(p0 (1 - p0) / n)
    low, high = wilson(17, 40)
    for p0 in (low, high):
        assert abs(17 / 40 - p0) == pytest.approx(1.959963984540054 * math.sqrt(p0 * (1 - p0) / 40), rel=1e-9)


def test_paired_interval_is_narrower_than_unpaired_and_agrees_with_a_bootstrap():
    """500 problems, two correlated settings (the issue's case: -3.4 points, 12 vs 29 discordant)."""
    a, b = outcomes(both=300, a_only=12, b_only=29, neither=159)
    c = compare_accuracy(a, b)
    assert c.counts == {"both": 300, "a_only": 12, "b_only": 29, "neither": 159}
    assert c.difference == pytest.approx(-17 / 500)
    assert c.low < c.difference < c.high
    assert (c.high - c.low) < 0.5 * (c.unpaired_high - c.unpaired_low)  # paired: far narrower
    assert c.resolved and c.p_value == pytest.approx(mcnemar_exact(12, 29))
    assert not (c.unpaired_low > 0 or c.unpaired_high < 0)  # unpaired, the same outcomes look unresolved
    # a paired bootstrap of the same outcomes gives nearly the same interval
    x, y = np.array(a), np.array(b)
    idx = np.random.default_rng(1).integers(0, 500, (20000, 500))
    boot = np.quantile(x[idx].mean(1) - y[idx].mean(1), [0.025, 0.975])
    assert c.low == pytest.approx(boot[0], abs=0.004) and c.high == pytest.approx(boot[1], abs=0.004)


def test_newcombe_edge_cases():
    low, high = newcombe_paired(both=2, a_only=2, b_only=2, neither=494)  # the "2 and 2 discordant"
    assert low < 0 < high and high == pytest.approx(-low, rel=1e-9)
    assert 0.004 < high < 0.012
    low, high = newcombe_paired(0, 0, 0, 10)  # nothing solved by either: still an interval around 0
    assert low < 0 < high
    with pytest.raises(CompareError, match="0/1 outcome"):
        compare_accuracy([0.5, 1.0], [1.0, 1.0])


def test_gen_ppl_paired_bootstrap():
    """Samples whose log-likelihoods move together (B = A, slightly better): the paired interval is
    far narrower than the unpaired spread and excludes zero; the values are token-weighted."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(50, 200, 200)
    lp_a = -tokens * rng.uniform(3.0, 5.0, 200)
    lp_b = lp_a + tokens * 0.02
    a = [(float(l), int(t)) for l, t in zip(lp_a, tokens)]
    b = [(float(l), int(t)) for l, t in zip(lp_b, tokens)]
    c = compare_gen_ppl(a, b, iters=4000)
    assert c.value_a == pytest.approx(math.exp(-lp_a.sum() / tokens.sum()))
    assert c.value_b == pytest.approx(math.exp(-lp_b.sum() / tokens.sum()))
    assert c.low < c.difference < c.high and c.resolved and c.low > 0
    assert (c.high - c.low) < 0.2 * (c.unpaired_high - c.unpaired_low)
    assert compare_gen_ppl(a, b, iters=4000) == c  # seeded


def _write_run(out: Path, task: str, a: list[float], hashes: list[str], stamp: str) -> Path:
    """An lm-eval output folder (results_<time>.json + samples_<task>_<time>.jsonl) with these outcomes."""
    out.mkdir(parents=True)
    results = out / f"results_{stamp}.json"
    results.write_text(json.dumps({"results": {task: {"exact_match,sandbox": sum(a) / len(a)}}}))
    (out / f"samples_{task}_{stamp}.jsonl").write_text("".join(
        json.dumps({"doc_id": i, "doc_hash": h, "filter": "sandbox", "metrics": ["exact_match"], "exact_match": v}) + "\n"
        for i, (v, h) in enumerate(zip(a, hashes))))
    return results


def test_compare_command_on_lm_eval_logs(tmp_path):
    a, b = outcomes(both=40, a_only=9, b_only=1, neither=50)
    hashes = [f"h{i}" for i in range(100)]
    _write_run(tmp_path / "a", "gsm8k_code_embedded", a, hashes, "2026-11-26T10-00-00.0")
    _write_run(tmp_path / "b", "gsm8k_code_embedded", b, hashes, "2026-11-26T11-00-00.0")
    c = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert (c.n, c.counts["a_only"], c.counts["b_only"]) == (100, 9, 1) and c.difference == pytest.approx(0.08)
    assert c.p_value == pytest.approx(2 * (1 + 10) / 2**10)
    r = subprocess.run([str(BIN / "blockgen"), "leaderboard", "compare", str(tmp_path / "a"), str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "both right 40, A only 9, B only 1, both wrong 50" in r.stdout and "A - B = +8.0 points" in r.stdout
    assert f"p = {c.p_value:.2g}" in r.stdout and "resolved at 95%" in r.stdout
    # other problems, or no per-sample log: a clear error
    _write_run(tmp_path / "c", "gsm8k_code_embedded", b, [f"x{i}" for i in range(100)], "2026-11-26T12-00-00.0")
    with pytest.raises(CompareError, match="did not see the same documents"):
        compare(str(tmp_path / "a"), str(tmp_path / "c"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "results_2026-11-26T13-00-00.0.json").write_text(json.dumps({"results": {"gsm8k_code_embedded": {}}}))
    r = subprocess.run([str(BIN / "blockgen"), "leaderboard", "compare", str(tmp_path / "a"), str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--log_samples" in r.stderr
