"""The synthetic language's exact quantities against brute-force enumeration, its sampler against them,
and the refusal of parameters that make no process (harness/data/language.py)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from blockgen.harness.data.language import (
    LANGUAGES, LanguageConfig, LanguageError, MarkovLanguage, generate_language, load_language,
)


def enumerate_sequences(language: MarkovLanguage, n: int) -> dict[tuple[int, ...], float]:
    """Every sequence of n symbols with its probability, by the chain rule written out."""
    v = len(language.words)
    out = {}
    for seq in itertools.product(range(v), repeat=n):
        p = language.stationary[seq[0]]
        for a, b in zip(seq, seq[1:]):
            p *= language.transitions[a, b]
        out[seq] = p
    return out


@pytest.fixture(scope="module")
def tiny() -> MarkovLanguage:
    return load_language("tiny")


def test_tiny_language_is_sparse_and_enumerable(tiny):
    v = len(tiny.words)
    assert v == LANGUAGES["tiny"].symbols
    assert ((tiny.transitions > 0).sum(1) == LANGUAGES["tiny"].successors).all()  # impossible pairs exist
    assert np.allclose(tiny.stationary @ tiny.transitions, tiny.stationary, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_probabilities_sum_to_one_and_log_prob_matches_enumeration(tiny, n):
    table = enumerate_sequences(tiny, n)
    assert math.isclose(sum(table.values()), 1.0, abs_tol=1e-12)
    for seq, p in table.items():
        lp = tiny.log_prob(seq)
        assert (lp == -math.inf) if p == 0 else math.isclose(lp, math.log(p), rel_tol=1e-12, abs_tol=1e-12)
    assert sum(p == 0 for p in table.values()) > 0 or n == 1  # some sequences are invalid


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_entropy_of_n_symbols_is_marginal_entropy_plus_rate(tiny, n):
    table = enumerate_sequences(tiny, n)
    entropy = -sum(p * math.log(p) for p in table.values() if p > 0)
    assert math.isclose(entropy, tiny.marginal_entropy + (n - 1) * tiny.entropy_rate, rel_tol=1e-10)


def test_entropy_rate_is_the_limit_of_block_entropy_differences(tiny):
    h = [-sum(p * math.log(p) for p in enumerate_sequences(tiny, n).values() if p > 0) for n in (3, 4)]
    assert math.isclose(h[1] - h[0], tiny.entropy_rate, rel_tol=1e-10)
    assert tiny.dependence > 0


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ngram_marginals_equal_enumeration_at_every_position(tiny, n):
    length = 5
    table = enumerate_sequences(tiny, length)
    exact = tiny.ngram_marginals(n)
    for start in range(length - n + 1):
        counted = np.zeros_like(exact)
        for seq, p in table.items():
            counted[seq[start : start + n]] += p
        assert np.allclose(counted, exact, atol=1e-13), start


def test_conditional_log_prob_sums_to_one_given_any_symbol(tiny):
    v = len(tiny.words)
    for before in range(v):
        total = sum(math.exp(tiny.log_prob(seq, before=before)) for seq in itertools.product(range(v), repeat=3))
        assert math.isclose(total, 1.0, abs_tol=1e-12)


def test_samples_follow_the_exact_marginals(tiny):
    """Bigram frequencies of 400,000 sampled pairs within 5 standard errors of the exact marginals; no
    sampled sequence is impossible; continuations given a symbol start from its row."""
    rows = tiny.sample(20_000, 21, np.random.default_rng(0))
    assert all(math.isfinite(tiny.log_prob(r)) for r in rows[:2000])
    pairs = np.stack([rows[:, :-1].ravel(), rows[:, 1:].ravel()], 1)
    v = len(tiny.words)
    counts = np.zeros((v, v))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    freq, exact = counts / len(pairs), tiny.ngram_marginals(2)
    # pairs of one sequence are dependent: the bound allows for it (5 sigma of 20,000 independent rows)
    assert np.all(np.abs(freq - exact) <= 5 * np.sqrt(exact * (1 - exact) / 20_000) + 1e-12)
    nxt = tiny.sample(50_000, 1, np.random.default_rng(1), before=np.full(50_000, 2))[:, 0]
    assert np.allclose(np.bincount(nxt, minlength=v) / 50_000, tiny.transitions[2], atol=0.01)


def test_default_language_entropy_rate_by_sampling():
    """The mean NLL per symbol of sampled documents approaches (H(pi) + (n - 1) h) / n."""
    language = load_language("default")
    rows = language.sample(4000, 30, np.random.default_rng(3))
    mean = np.mean([language.log_prob(r) for r in rows]) / 30
    expected = (language.marginal_entropy + 29 * language.entropy_rate) / 30
    assert abs(-mean - expected) < 0.02
    assert language.entropy_rate < math.log(LANGUAGES["default"].successors) < language.marginal_entropy


def test_text_round_trip_and_unknown_words(tiny):
    seq = [0, 1, 4, 2]
    assert tiny.parse(tiny.text(seq)) == seq
    with pytest.raises(LanguageError, match="'zzz' is not a word"):
        tiny.parse(tiny.text(seq) + " zzz")


def _valid_rows(v=3):
    return np.full((v, v), 1 / v)


@pytest.mark.parametrize("rows, message", [
    (np.array([[0.5, 0.5, 0.0], [0.2, 0.2, 0.2], [0.0, 0.0, 1.0]]), r"row 1 \('b'\) sums to 0.6"),
    (np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]), r"row 1 \('b'\) sums to 0, not 1: no valid continuation"),
    (np.array([[1.5, -0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]), r"row 0 \('a'\) has a negative"),
    (np.array([[np.nan, 0.5, 0.5], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]), r"row 0 \('a'\) has a negative or non-finite"),
    (np.ones((2, 3)) / 3, r"shape \(2, 3\)"),
])
def test_invalid_processes_are_refused_naming_the_row(rows, message):
    with pytest.raises(LanguageError, match=message):
        MarkovLanguage(("a", "b", "c"), rows)


def test_a_chain_without_a_unique_stationary_distribution_is_refused():
    two_islands = MarkovLanguage(("a", "b", "c", "d"), np.array([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]], float))
    with pytest.raises(LanguageError, match="no unique stationary distribution"):
        two_islands.entropy_rate


def test_words_must_be_distinct_and_single():
    with pytest.raises(LanguageError, match="distinct"):
        MarkovLanguage(("a", "a", "c"), _valid_rows())
    with pytest.raises(LanguageError, match="whitespace"):
        MarkovLanguage(("a", "b c", "d"), _valid_rows())


def test_language_from_a_json_file_and_unknown_names(tmp_path):
    spec = tmp_path / "lang.json"
    spec.write_text(json.dumps({"words": ["x", "y"], "transitions": [[0.0, 1.0], [0.5, 0.5]]}))
    language = load_language(str(spec))
    assert np.allclose(language.stationary, [1 / 3, 2 / 3])
    assert math.isclose(language.entropy_rate, 2 / 3 * math.log(2))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"words": ["x", "y"], "transitions": [[0.0, 0.9], [0.5, 0.5]]}))
    with pytest.raises(LanguageError, match=r"row 0 \('x'\) sums to 0.9"):
        load_language(str(bad))
    with pytest.raises(LanguageError, match=r"unknown language 'nope': choose one of \['default', 'tiny'\]"):
        load_language("nope")


def test_config_bounds_and_determinism():
    with pytest.raises(ValueError, match="successors=9"):
        LanguageConfig(symbols=8, successors=9)
    a, b = generate_language(LanguageConfig(symbols=40, seed=5)), generate_language(LanguageConfig(symbols=40, seed=5))
    assert a.words == b.words and np.array_equal(a.transitions, b.transitions)
