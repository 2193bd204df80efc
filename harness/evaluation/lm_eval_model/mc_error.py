"""The Monte Carlo error of a log-likelihood bound: per request from its K_MC draws by the delta
method (`mc_variance`, `RequestScore.mc_stderr`), paired between the choices of one question that
share their draws (`paired_mc_stderr`), and the chance that another seed picks another answer
(`seed_disagreement`). Plain Python (no torch): the results' readers use it too."""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple, Sequence


class WindowScore(NamedTuple):
    lse: float  # log-sum-exp NLL bound (the reported one)
    jensen: float  # the looser mixture bound sum_i gamma_i NLL_i
    greedy: bool  # every scored token is the AR argmax (False without block size 1)
    # Per block size, its K draws linearised around the bound: pi_i * NLL_{i,k}, with pi_i = dLSE/dNLL_i
    # the posterior weight of size i. Their sample variances give the MC variance (`mc_variance`).
    terms: tuple[tuple[float, ...], ...] = ()


def mc_variance(terms: Sequence[Sequence[float]]) -> float:
    """Delta-method MC variance of a bound from its linearised draws: sum_i var_k(terms_i) / K_i.

    Exact sizes (block size 1: no draws listed) add nothing. The K draws of a size are stratified in
    t, so their sample variance somewhat overstates the estimator's: the error bar is conservative.
    NaN when a size has a single draw (k_mc = 1): nothing to estimate the spread from.
    """
    total = 0.0
    for draws in terms:
        if len(draws) == 1:
            return math.nan
        if draws:
            total += statistics.variance(draws) / len(draws)
    return total


class RequestScore(NamedTuple):
    logp: float
    greedy: bool
    windows: tuple[WindowScore, ...]

    @property
    def mc_stderr(self) -> float:
        return math.sqrt(sum(mc_variance(w.terms) for w in self.windows))


def paired_mc_stderr(a: RequestScore, b: RequestScore) -> float:
    """MC standard error of logp(a) - logp(b). Single windows of one context share their draws
    (common random numbers): the variance comes from the paired differences; otherwise they add."""
    if len(a.windows) == len(b.windows) == 1 and len(a.windows[0].terms) == len(b.windows[0].terms):
        diff = [tuple(x - y for x, y in zip(ta, tb)) for ta, tb in zip(a.windows[0].terms, b.windows[0].terms)]
        return math.sqrt(mc_variance(diff))
    return math.hypot(a.mc_stderr, b.mc_stderr)


def seed_disagreement(scores: Sequence[RequestScore]) -> float:
    """Probability that a run with another seed picks another winner among one doc's choices.

    Normal approximation on the top two: their margin m and its paired MC standard error s, with m
    taken as the true margin; two independent runs disagree with probability 2 Phi(m/s) Phi(-m/s).
    """
    top, second = sorted(scores, key=lambda s: -s.logp)[:2]
    s = paired_mc_stderr(top, second)
    if s == 0 or math.isnan(s):
        return 0.0 if s == 0 else math.nan
    phi = statistics.NormalDist().cdf((top.logp - second.logp) / s)
    return 2 * phi * (1 - phi)
