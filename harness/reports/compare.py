"""Paired comparison of two settings evaluated on the same problems: `blockgen leaderboard compare A B`.

Every setting of a sweep answers the same problems, so the difference of two accuracies is measured
far more precisely from the per-problem outcomes than from the two standard errors: problems both
settings solve (or both miss) carry no information about the difference. A and B are lm-eval outputs
with per-sample logs (``--log_samples``: a ``results_*.json`` and its ``samples_<task>_*.jsonl``, or
their folder) or the demo's results files (its ``X.samples.jsonl`` beside ``X.json``).

- Accuracy (any 0/1 metric, e.g. ``exact_match``): the difference A - B on the problems both logged,
  the exact McNemar test (two-sided binomial test of the discordant problems, in integers)
  and a 95 % interval by Newcombe's hybrid score method for paired proportions (his method 10:
  Wilson intervals of both accuracies combined with the phi correlation of the pairs); deterministic,
  and sound with few discordant problems.
- Gen PPL (``owt_genppl``): the difference of the token-weighted perplexities, with a paired bootstrap
  over samples (the same resampled indices for A and B; percentile interval, seeded) and the bootstrap's
  two-sided p-value. Unconditional samples are not matched by content, so pairing gains little there.
- NLL (``owt_ppl``, the paper's table 1): the difference of the NLLs per token (``nll``, or
  ``nll_jensen``; = log(PPL_A / PPL_B)) on the same held-out chunks, with a paired t-interval over
  documents (Student's t, the difference's standard error by the delta method for a ratio of sums)
  and its two-sided p-value; deterministic. The chunks are identical in A and B, so the documents'
  own difficulty cancels.
- A mean of a per-document score (e.g. ``invalid_pairs`` of ``synthlang_gen``): the difference of the
  means with a paired t-interval over documents (`compare_means`).
- Beside each: the unpaired 95 % interval, +-1.96 sqrt(se_A^2 + se_B^2), as if the runs were independent.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

Z95 = 1.959963984540054
BOOTSTRAP_ITERS = 10_000


class CompareError(ValueError):
    """Outputs that cannot be paired: no per-sample logs, other problems, another task or metric."""


# ------------------------------------------------------------------------------ per-sample outcomes


@dataclass(frozen=True)
class Samples:
    path: str  # the results file (or samples file) named
    task: str
    records: dict[int, dict]  # doc_id -> lm-eval's logged sample


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_samples(path: str | Path, task: str | None = None) -> Samples:
    """The logged samples of one lm-eval output: a results JSON, a samples JSONL, or a folder with one
    results file. lm-eval's layout pairs results_<time>.json with samples_<task>_<time>.jsonl; the
    demo's keeps X.samples.jsonl beside X.json."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob("results_*.json"))
        if not found:
            raise CompareError(f"{path}: no results_*.json inside")
        path = found[-1]  # the latest run
    if not path.is_file():
        raise CompareError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        files = {path}
    else:
        files = set()
        stamp = re.fullmatch(r"results_(.+)\.json", path.name)
        if stamp:
            files = set(path.parent.glob(f"samples_*_{stamp.group(1)}.jsonl"))
        demo = path.with_name(f"{path.stem}.samples.jsonl")
        if demo.is_file():
            files.add(demo)
    by_task: dict[str, list[dict]] = {}
    for f in sorted(files):
        rows = _read_jsonl(f)
        name = re.fullmatch(r"samples_(.+)_[^_]+\.jsonl", f.name)
        key = name.group(1) if name else _task_of_results(path)
        by_task.setdefault(key, []).extend(rows)
    if not by_task:
        raise CompareError(f"{path}: no per-sample log beside it; rerun lm_eval with --log_samples "
                           "(the demo keeps X.samples.jsonl beside each X.json since issue 21: rerun `make demo`)")
    if task is None:
        if len(by_task) > 1:
            raise CompareError(f"{path}: samples of several tasks {sorted(by_task)}; choose one with --task")
        (task,) = by_task
    if task not in by_task:
        raise CompareError(f"{path}: no samples of task {task!r}; it has {sorted(by_task)}")
    return Samples(str(path), task, {int(r["doc_id"]): r for r in by_task[task]})


def _task_of_results(path: Path) -> str:
    try:
        tasks = list(json.loads(path.read_text()).get("results", {}))
    except (OSError, json.JSONDecodeError):
        tasks = []
    return tasks[0] if len(tasks) == 1 else "?"


# What identifies a document, the first field a task's docs have: its own id, else the question or text it
# poses. Never lm-eval's doc_hash alone: it hashes the whole doc, in which a task may keep fields derived from
# the model's tokenizer (gsm8k_code's prompt_tokens), so two checkpoints' runs of one problem would not pair.
IDENTITY_FIELDS = ("id", "question", "text", "context", "reference")


def document_key(records: list[dict]) -> str:
    """The field that pairs these logged samples: `doc.<field>` of IDENTITY_FIELDS that every doc has, else
    `doc_hash` (lm-eval's hash of the whole doc)."""
    docs = [r.get("doc") for r in records]
    for field in IDENTITY_FIELDS:
        if docs and all(isinstance(d, dict) and field in d for d in docs):
            return f"doc.{field}"
    return "doc_hash"


def _identity(record: dict, key: str) -> Any:
    return record["doc"][key[4:]] if key.startswith("doc.") else record.get(key)


def paired(a: Samples, b: Samples, metric: str) -> tuple[list[int], list[Any], list[Any], str]:
    """(doc ids, A's values, B's values, the key they were paired on) of the documents both logged the
    metric for; A's and B's document of each id must be the same one by that key (`document_key`)."""
    if a.task != b.task:
        raise CompareError(f"A is task {a.task!r}, B is {b.task!r}: compare runs of one task")
    common = sorted(i for i in set(a.records) & set(b.records) if metric in a.records[i] and metric in b.records[i])
    if not common:
        have = sorted({k for r in a.records.values() for k in r.get("metrics", [])})
        raise CompareError(f"no document has metric {metric!r} in both runs (A's metrics: {have})")
    key = document_key([a.records[i] for i in common] + [b.records[i] for i in common])
    other = [i for i in common if _identity(a.records[i], key) != _identity(b.records[i], key)]
    if other:
        raise CompareError(f"A and B did not see the same documents ({len(other)} of {len(common)} differ by {key}, "
                           f"first doc_id {other[0]}): compare runs of one task with the same data and --limit")
    return common, [a.records[i][metric] for i in common], [b.records[i][metric] for i in common], key


# ------------------------------------------------------------------------------ accuracy


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value: the discordant pairs against Binomial(a_only + b_only, 1/2)."""
    # Bin(n, 1/2) is symmetric: twice the smaller tail, in exact integers (scipy's binomtest gives the same
    # value at about 3 ms a call; a page pairs hundreds of rows).
    n, k = a_only + b_only, min(a_only, b_only)
    if 2 * k >= n:
        return 1.0
    tail, term = 0, 1  # term = C(n, i)
    for i in range(k + 1):
        tail += term
        term = term * (n - i) // (i + 1)
    return min(1.0, 2 * tail / 2**n)


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    p = successes / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return center - half, center + half


def newcombe_paired(both: int, a_only: int, b_only: int, neither: int, z: float = Z95) -> tuple[float, float]:
    """95 % interval of p_A - p_B for paired 0/1 outcomes: Newcombe (1998), method 10."""
    n = both + a_only + b_only + neither
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    (l1, u1), (l2, u2) = wilson(both + a_only, n, z), wilson(both + b_only, n, z)
    margins = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    phi = (both * neither - a_only * b_only) / math.sqrt(margins) if margins else 0.0
    lower = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    upper = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return p1 - p2 - lower, p1 - p2 + upper


def mean_stderr(values: list[float]) -> float:
    """Standard error of a mean as lm-eval reports it (sample standard deviation / sqrt(n))."""
    n = len(values)
    if n < 2:
        return math.nan
    m = sum(values) / n
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)


@dataclass(frozen=True)
class Comparison:
    task: str
    metric: str
    a: str
    b: str
    n: int  # documents paired
    value_a: float
    value_b: float
    difference: float  # A - B
    low: float  # paired 95 % interval of the difference
    high: float
    p_value: float
    method: str  # how the interval and p-value were obtained
    unpaired_low: float
    unpaired_high: float
    counts: dict[str, int] | None = None  # accuracy: both, a_only, b_only, neither
    paired_on: str = ""  # what identified a document in both runs (`document_key`); set by `compare`

    @property
    def resolved(self) -> bool:
        """The paired 95 % interval excludes zero."""
        return self.low > 0 or self.high < 0

    def to_json(self) -> dict:
        return {**asdict(self), "resolved": self.resolved}


def compare_accuracy(a: list[float], b: list[float], task: str = "", metric: str = "", names: tuple[str, str] = ("A", "B")) -> Comparison:
    if any(v not in (0, 1) for v in (*a, *b)):
        raise CompareError(f"metric {metric!r} is not a 0/1 outcome per document; paired accuracy needs one")
    counts = {"both": 0, "a_only": 0, "b_only": 0, "neither": 0}
    for x, y in zip(a, b):
        counts["both" if x and y else "a_only" if x else "b_only" if y else "neither"] += 1
    n = len(a)
    pa, pb = sum(a) / n, sum(b) / n
    low, high = newcombe_paired(counts["both"], counts["a_only"], counts["b_only"], counts["neither"])
    half = Z95 * math.hypot(mean_stderr(a), mean_stderr(b))
    return Comparison(task, metric, names[0], names[1], n, pa, pb, pa - pb, low, high,
                      mcnemar_exact(counts["a_only"], counts["b_only"]),
                      "Newcombe hybrid score interval (paired); exact McNemar test", pa - pb - half, pa - pb + half, counts)


def compare_means(a: list[float], b: list[float], task: str = "", metric: str = "", names: tuple[str, str] = ("A", "B")) -> Comparison:
    """A's mean minus B's of a per-document score (e.g. synthlang_gen's ``invalid_pairs``) on the same
    documents, with a paired t-interval over documents and its two-sided p-value; deterministic."""
    from scipy.stats import t

    m = len(a)
    if m < 2:
        raise CompareError(f"metric {metric!r}: a paired interval needs at least 2 documents, got {m}")
    value_a, value_b = sum(a) / m, sum(b) / m
    diff = value_a - value_b
    se = mean_stderr([x - y for x, y in zip(a, b)])
    half = float(t.ppf(0.975, m - 1)) * se
    p = float(2 * t.sf(abs(diff) / se, m - 1)) if se > 0 else float(diff == 0)
    unpaired = Z95 * math.hypot(mean_stderr(a), mean_stderr(b))
    return Comparison(task, metric, names[0], names[1], m, value_a, value_b, diff, diff - half, diff + half, p,
                      f"paired t-interval over documents, {m - 1} degrees of freedom", diff - unpaired, diff + unpaired)


# ------------------------------------------------------------------------------ Gen PPL


def compare_gen_ppl(a: list, b: list, task: str = "", names: tuple[str, str] = ("A", "B"),
                    iters: int = BOOTSTRAP_ITERS, seed: int = 0) -> Comparison:
    """A's Gen PPL minus B's from per-sample (logprob, tokens), with a paired bootstrap over samples."""
    import numpy as np

    la, ta = (np.array([x[k] for x in a], dtype=np.float64) for k in (0, 1))
    lb, tb = (np.array([x[k] for x in b], dtype=np.float64) for k in (0, 1))
    n = len(la)
    rng = np.random.default_rng(seed)
    diffs, single_a, single_b = [], [], []
    for start in range(0, iters, 1000):  # chunks bound the (iters, n) index array
        idx = rng.integers(0, n, (min(1000, iters - start), n))
        pa = np.exp(-la[idx].sum(1) / ta[idx].sum(1))
        pb = np.exp(-lb[idx].sum(1) / tb[idx].sum(1))
        diffs.append(pa - pb)
        single_a.append(pa)
        # B resampled on its own indices: the spread of an unpaired comparison
        idx_b = rng.integers(0, n, idx.shape)
        single_b.append(np.exp(-lb[idx_b].sum(1) / tb[idx_b].sum(1)))
    d = np.concatenate(diffs)
    value_a, value_b = float(np.exp(-la.sum() / ta.sum())), float(np.exp(-lb.sum() / tb.sum()))
    diff = value_a - value_b
    low, high = (float(q) for q in np.quantile(d, [0.025, 0.975]))
    p = float(min(1.0, 2 * min((d <= 0).mean(), (d >= 0).mean())))
    half = Z95 * math.hypot(float(np.concatenate(single_a).std(ddof=1)), float(np.concatenate(single_b).std(ddof=1)))
    return Comparison(task, "gen_ppl", names[0], names[1], n, value_a, value_b, diff, low, high, p,
                      f"paired bootstrap over samples ({iters} resamples, percentile interval, seed {seed})",
                      diff - half, diff + half)


# ------------------------------------------------------------------------------ NLL (owt_ppl)

# owt_ppl's per-document (log-likelihood, tokens) metrics: each compared as NLL per token (log perplexity).
NLL_METRICS = ("nll", "nll_jensen", "perplexity", "perplexity_jensen")


def ratio_stderr(x: list[float], n: list[int]) -> float:
    """Standard error of sum(x) / sum(n) over documents (delta method); with equal n, `mean_stderr` of x / n."""
    ratio, mean_n = sum(x) / sum(n), sum(n) / len(n)
    return mean_stderr([(xi - ratio * ni) / mean_n for xi, ni in zip(x, n)])


def compare_nll(a: list, b: list, task: str = "", metric: str = "nll", names: tuple[str, str] = ("A", "B")) -> Comparison:
    """A's NLL per token minus B's (= log(PPL_A / PPL_B)) from per-document (log-likelihood, tokens)
    of the same documents, with a paired t-interval over documents."""
    from scipy.stats import t

    tokens = [n for _, n in a]
    if tokens != [n for _, n in b]:
        raise CompareError(f"metric {metric!r}: A and B scored other tokens in the same documents; compare runs of one tokenizer and length")
    m = len(tokens)
    if m < 2:
        raise CompareError(f"metric {metric!r}: a paired interval needs at least 2 documents, got {m}")
    nll_a, nll_b = [-ll for ll, _ in a], [-ll for ll, _ in b]
    value_a, value_b = sum(nll_a) / sum(tokens), sum(nll_b) / sum(tokens)
    diff = value_a - value_b
    se = ratio_stderr([x - y for x, y in zip(nll_a, nll_b)], tokens)
    half = float(t.ppf(0.975, m - 1)) * se
    p = float(2 * t.sf(abs(diff) / se, m - 1)) if se > 0 else float(diff == 0)
    unpaired = Z95 * math.hypot(ratio_stderr(nll_a, tokens), ratio_stderr(nll_b, tokens))
    return Comparison(task, metric, names[0], names[1], m, value_a, value_b, diff, diff - half, diff + half, p,
                      f"paired t-interval over documents, {m - 1} degrees of freedom", diff - unpaired, diff + unpaired)


# ------------------------------------------------------------------------------ the command


def compare(path_a: str, path_b: str, metric: str | None = None, task: str | None = None) -> Comparison:
    a = load_samples(path_a, task)
    b = load_samples(path_b, task or a.task)
    if metric is None:
        first = next(iter(a.records.values()))
        metric = next((m for m in ("gen_ppl", "nll") if m in first), "exact_match")
    _, va, vb, key = paired(a, b, metric)
    if metric == "gen_ppl":
        comparison = compare_gen_ppl(va, vb, a.task, (a.path, b.path))
    elif metric in NLL_METRICS:
        comparison = compare_nll(va, vb, a.task, metric, (a.path, b.path))
    else:
        comparison = compare_accuracy(va, vb, a.task, metric, (a.path, b.path))
    return replace(comparison, paired_on=key)


def format_comparison(c: Comparison) -> str:
    nll = c.metric in NLL_METRICS
    pct = c.metric != "gen_ppl" and not nll
    digits = 4 if nll else 3

    def v(x: float) -> str:
        return f"{100 * x:.1f}%" if pct else f"{x:.{digits}f}"

    def d(x: float) -> str:
        return f"{100 * x:+.1f}" if pct else f"{x:+.{digits}f}"

    unit = " points" if pct else " nats/token" if nll else ""
    noun = "problems" if pct else "documents" if nll else "samples"
    lines = [f"{c.task} {c.metric}, {c.n} {noun} paired (on {c.paired_on})",
             f"  A  {v(c.value_a):>8}  {c.a}", f"  B  {v(c.value_b):>8}  {c.b}"]
    if c.counts:
        k = c.counts
        lines.append(f"  both right {k['both']}, A only {k['a_only']}, B only {k['b_only']}, both wrong {k['neither']}")
    lines.append(f"  A - B = {d(c.difference)}{unit}, 95% interval {d(c.low)}..{d(c.high)} (paired), p = {c.p_value:.2g}")
    if nll:
        ratio = "..".join(f"{math.exp(x):.4f}" for x in (c.low, c.high))
        lines.append(f"  perplexity A {math.exp(c.value_a):.3f}, B {math.exp(c.value_b):.3f}: "
                     f"A / B = {math.exp(c.difference):.4f}, 95% interval {ratio}")
    lines.append(f"  unpaired 95% interval, as if independent: {d(c.unpaired_low)}..{d(c.unpaired_high)}")
    lines.append(f"  {'resolved' if c.resolved else 'not resolved'} at 95% ({c.method})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ for the page


def doc_outcomes(source: str, task: str, metric: str) -> dict[int, float] | None:
    """doc_id -> 0/1 outcome of one leaderboard row, from the per-sample log beside its results file;
    None when there is none (published rows, runs without --log_samples) or the metric is not 0/1."""
    try:
        samples = load_samples(source, task)
    except (CompareError, OSError, ValueError):
        return None
    values = {i: r[metric] for i, r in samples.records.items() if metric in r}
    if not values or any(v not in (0, 1) for v in values.values()):
        return None
    return values


def paired_differences(outcomes: dict[int, dict[int, float]]) -> dict[int, dict[int, dict]]:
    """Every pair of rows (ids -> per-document outcomes) that share documents: A - B with the paired
    interval and McNemar p of `compare_accuracy`, for the page's "difference vs a reference row"."""
    out: dict[int, dict[int, dict]] = {}
    for i, a in outcomes.items():
        for j, b in outcomes.items():
            common = sorted(set(a) & set(b))
            if i == j or not common:
                continue
            c = compare_accuracy([a[d] for d in common], [b[d] for d in common])
            out.setdefault(i, {})[j] = {"difference": c.difference, "low": c.low, "high": c.high, "p": c.p_value,
                                        "n": c.n, "resolved": c.resolved}
    return out
