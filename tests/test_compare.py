"""Paired comparisons (`blockgen.harness.reports.compare`): the exact McNemar test against a hand computation,
Newcombe's paired interval against a paired bootstrap of the same outcomes and narrower than the
unpaired one, Gen PPL's paired bootstrap, owt_ppl's paired t-interval of NLL per token against a hand
computation and a bootstrap, and the command on lm-eval-format logs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from blockgen.harness.reports.compare import (
    CompareError,
    compare,
    compare_accuracy,
    compare_gen_ppl,
    compare_means,
    compare_nll,
    format_comparison,
    mcnemar_exact,
    newcombe_paired,
    wilson,
)
from limits import HANG_S

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


def test_mcnemar_exact_equals_scipys_binomial_test():
    from scipy.stats import binomtest

    for a in range(0, 41, 3):
        for b in range(0, 41, 4):
            want = 1.0 if a + b == 0 else binomtest(a, a + b, 0.5).pvalue
            assert mcnemar_exact(a, b) == pytest.approx(want, rel=1e-9, abs=1e-300), (a, b)
    assert mcnemar_exact(900, 700) == pytest.approx(binomtest(900, 1600, 0.5).pvalue, rel=1e-6)


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


# owt_ppl: 4 chunks of 10 tokens; per-token NLLs A 3.0 2.5 4.0 3.5, B 3.2 2.6 4.1 3.8
NLL_A = [(-30.0, 10), (-25.0, 10), (-40.0, 10), (-35.0, 10)]
NLL_B = [(-32.0, 10), (-26.0, 10), (-41.0, 10), (-38.0, 10)]


def test_nll_paired_t_interval_against_a_hand_computation():
    # differences A - B per document: -0.2 -0.1 -0.1 -0.3; mean -0.175, squared deviations sum 0.0275
    se = math.sqrt(0.0275 / 3 / 4)
    t975 = 3.182446305284  # Student's t, 3 degrees of freedom, 97.5 %
    c = compare_nll(NLL_A, NLL_B, "owt_ppl", "nll")
    assert (c.n, c.value_a, c.value_b) == (4, pytest.approx(3.25), pytest.approx(3.425))
    assert c.difference == pytest.approx(-0.175)
    assert (c.low, c.high) == (pytest.approx(-0.175 - t975 * se, rel=1e-9), pytest.approx(-0.175 + t975 * se, rel=1e-9))
    # two-sided p from the t distribution's closed form at 3 degrees of freedom
    t = 0.175 / se
    cdf = 0.5 + (t / (math.sqrt(3) * (1 + t * t / 3)) + math.atan(t / math.sqrt(3))) / math.pi
    assert c.p_value == pytest.approx(2 * (1 - cdf), rel=1e-9) and c.resolved
    # unpaired: A's and B's own standard errors (squared deviations 1.25 and 1.3275), as if independent
    half = 1.959963984540054 * math.hypot(math.sqrt(1.25 / 12), math.sqrt(1.3275 / 12))
    assert (c.unpaired_low, c.unpaired_high) == (pytest.approx(-0.175 - half), pytest.approx(-0.175 + half))
    assert c.unpaired_low < 0 < c.unpaired_high  # the documents' own spread hides the difference unpaired
    text = format_comparison(c)
    assert "A - B = -0.1750 nats/token" in text and "perplexity A 25.790, B 30.723: A / B = 0.8395" in text
    same = compare_nll(NLL_A, NLL_A)
    assert (same.difference, same.low, same.high, same.p_value, same.resolved) == (0, 0, 0, 1.0, False)


def test_nll_interval_weights_tokens_and_agrees_with_a_bootstrap():
    """Chunks of unequal length: the value is the token-weighted NLL (exp of it lm-eval's perplexity),
    and the delta-method interval matches a paired bootstrap of the ratio over documents."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(20, 200, 300)
    nll_a = tokens * rng.uniform(3.0, 5.0, 300)
    nll_b = nll_a + tokens * rng.normal(0.03, 0.05, 300)
    c = compare_nll([(-x, int(n)) for x, n in zip(nll_a, tokens)], [(-x, int(n)) for x, n in zip(nll_b, tokens)])
    assert c.value_a == pytest.approx(nll_a.sum() / tokens.sum()) and c.value_b == pytest.approx(nll_b.sum() / tokens.sum())
    idx = rng.integers(0, 300, (20000, 300))
    boot = np.quantile((nll_a[idx].sum(1) - nll_b[idx].sum(1)) / tokens[idx].sum(1), [0.025, 0.975])
    width = c.high - c.low
    assert c.low == pytest.approx(boot[0], abs=0.05 * width) and c.high == pytest.approx(boot[1], abs=0.05 * width)
    assert c.resolved and (c.high - c.low) < 0.2 * (c.unpaired_high - c.unpaired_low)
    with pytest.raises(CompareError, match="other tokens"):
        compare_nll(NLL_A, [(-32.0, 10), (-26.0, 10), (-41.0, 10), (-38.0, 11)])
    with pytest.raises(CompareError, match="at least 2 documents"):
        compare_nll(NLL_A[:1], NLL_B[:1])


def _write_run(out: Path, task: str, values: list[dict], hashes: list[str], stamp: str, docs: list[dict] | None = None) -> Path:
    """An lm-eval output folder (results_<time>.json + samples_<task>_<time>.jsonl) with these
    per-document metric values (and docs, where given)."""
    out.mkdir(parents=True)
    results = out / f"results_{stamp}.json"
    results.write_text(json.dumps({"results": {task: {}}}))
    docs = docs or [None] * len(values)
    (out / f"samples_{task}_{stamp}.jsonl").write_text("".join(
        json.dumps({"doc_id": i, **({"doc": d} if d else {}), "doc_hash": h, "filter": "none", "metrics": sorted(v), **v}) + "\n"
        for i, (v, h, d) in enumerate(zip(values, hashes, docs))))
    return results


def test_runs_of_two_tokenizers_pair_on_the_question(tmp_path):
    """gsm8k_code keeps the prompt's length in tokens in each doc, so lm-eval's doc_hash differs between two
    checkpoints with other tokenizers; the problems are the same, and pair on their question."""
    questions = [f"Tom has {i} apples. How many?" for i in range(10)]
    a, b = [1.0] * 6 + [0.0] * 4, [1.0] * 3 + [0.0] * 7
    for name, tokens, values, stamp in (("a", 14, a, "2026-11-28T10-00-00.0"), ("b", 19, b, "2026-11-28T11-00-00.0")):
        docs = [{"question": q, "answer": "#### 1", "prompt_tokens": tokens + i} for i, q in enumerate(questions)]
        _write_run(tmp_path / name, "gsm8k_code_embedded", _outcomes(values), [f"{name}{i}" for i in range(10)], stamp, docs)
    c = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert (c.n, c.counts["a_only"], c.paired_on) == (10, 3, "doc.question")
    r = subprocess.run([str(BIN / "blockgen"), "leaderboard", "compare", str(tmp_path / "a"), str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0 and "10 problems paired (on doc.question)" in r.stdout, r.stdout + r.stderr
    # another problem under one doc_id: refused, naming the key
    docs = [{"question": q, "prompt_tokens": 3} for q in questions[:9] + ["Another question?"]]
    _write_run(tmp_path / "c", "gsm8k_code_embedded", _outcomes(b), [f"a{i}" for i in range(10)], "2026-11-28T12-00-00.0", docs)
    with pytest.raises(CompareError, match="1 of 10 differ by doc.question, first doc_id 9"):
        compare(str(tmp_path / "a"), str(tmp_path / "c"))


def _outcomes(values: list[float]) -> list[dict]:
    return [{"exact_match": v} for v in values]


def test_compare_command_on_lm_eval_logs(tmp_path):
    a, b = outcomes(both=40, a_only=9, b_only=1, neither=50)
    hashes = [f"h{i}" for i in range(100)]
    _write_run(tmp_path / "a", "gsm8k_code_embedded", _outcomes(a), hashes, "2026-11-26T10-00-00.0")
    _write_run(tmp_path / "b", "gsm8k_code_embedded", _outcomes(b), hashes, "2026-11-26T11-00-00.0")
    c = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert (c.n, c.counts["a_only"], c.counts["b_only"]) == (100, 9, 1) and c.difference == pytest.approx(0.08)
    assert c.p_value == pytest.approx(2 * (1 + 10) / 2**10)
    r = subprocess.run([str(BIN / "blockgen"), "leaderboard", "compare", str(tmp_path / "a"), str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert "both right 40, A only 9, B only 1, both wrong 50" in r.stdout and "A - B = +8.0 points" in r.stdout
    assert f"p = {c.p_value:.2g}" in r.stdout and "resolved at 95%" in r.stdout
    # other problems, or no per-sample log: a clear error
    _write_run(tmp_path / "c", "gsm8k_code_embedded", _outcomes(b), [f"x{i}" for i in range(100)], "2026-11-26T12-00-00.0")
    with pytest.raises(CompareError, match="did not see the same documents"):
        compare(str(tmp_path / "a"), str(tmp_path / "c"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "results_2026-11-26T13-00-00.0.json").write_text(json.dumps({"results": {"gsm8k_code_embedded": {}}}))
    r = subprocess.run([str(BIN / "blockgen"), "leaderboard", "compare", str(tmp_path / "a"), str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 2 and "--log_samples" in r.stderr


def test_compare_command_on_owt_ppl_logs(tmp_path):
    """owt_ppl's log holds each chunk's (log-likelihood, tokens) per metric (lm-eval writes the pair as a
    list): the command compares NLL per token by default, or the Jensen bound's with --metric."""
    hashes = [f"chunk{i}" for i in range(4)]
    for name, values, stamp in (("a", NLL_A, "2026-11-27T10-00-00.0"), ("b", NLL_B, "2026-11-27T11-00-00.0")):
        _write_run(tmp_path / name, "owt_ppl", [{"nll": [ll, n], "nll_jensen": [ll - 1, n]} for ll, n in values], hashes, stamp)
    cmd = [str(BIN / "blockgen"), "leaderboard", "compare", str(tmp_path / "a"), str(tmp_path / "b")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert "owt_ppl nll, 4 documents paired (on doc_hash)" in r.stdout
    assert "A - B = -0.1750 nats/token, 95% interval -0.3273..-0.0227 (paired), p = 0.035" in r.stdout
    assert "resolved at 95% (paired t-interval over documents, 3 degrees of freedom)" in r.stdout
    r = subprocess.run([*cmd, "--metric", "nll_jensen", "--json"], capture_output=True, text=True, timeout=HANG_S)
    c = json.loads(r.stdout)
    assert c["metric"] == "nll_jensen" and c["value_a"] == pytest.approx(3.35) and c["difference"] == pytest.approx(-0.175)
    jensen = compare_nll(*([(ll - 1, n) for ll, n in v] for v in (NLL_A, NLL_B)), "owt_ppl", "nll_jensen", (c["a"], c["b"]))
    assert c == {**jensen.to_json(), "paired_on": "doc_hash"}  # these docs carry no identifying field


def test_paired_means_equal_scipys_paired_t_test():
    """`compare_means` (per-document scores, e.g. synthlang_gen's invalid_pairs): the paired t-test of scipy."""
    from scipy.stats import t, ttest_rel

    rng = np.random.default_rng(4)
    a = rng.uniform(0, 1, 60).round(3).tolist()
    b = (np.array(a) + rng.normal(0.05, 0.1, 60)).clip(0, 1).tolist()
    c = compare_means(a, b, "synthlang_gen", "invalid_pairs")
    ref = ttest_rel(a, b)
    assert math.isclose(c.difference, float(np.mean(a) - np.mean(b)), abs_tol=1e-12)
    assert math.isclose(c.p_value, float(ref.pvalue), rel_tol=1e-9)
    half = float(t.ppf(0.975, 59)) * float(np.std(np.array(a) - np.array(b), ddof=1)) / math.sqrt(60)
    assert math.isclose(c.high - c.low, 2 * half, rel_tol=1e-9) and c.n == 60 and c.counts is None
    with pytest.raises(CompareError, match="at least 2 documents"):
        compare_means([0.1], [0.2])
