"""What a run of the ``blockgen`` model type actually used, as the results JSON reports it under
``config.blockgen.tasks`` (`Usage`): requests and truncation, one record per sampler setting with its
cost (`merge_budgets` joins records that differ only in their generation budget),
and the Monte Carlo error of the log-likelihoods. Plain Python (no torch): leaderboards read it."""

from __future__ import annotations

import io
import json
import math
import pickle
import statistics
from collections import Counter, defaultdict
from typing import Any, Sequence

from blockgen.harness.evaluation.lm_eval_model.mc_error import RequestScore, seed_disagreement


# The request types lm-eval's --use_cache (its CachingLM) can answer without the model.
CACHED_REQUEST_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until")


class Usage:
    """What a run really did, per task: requests and truncation, generation settings and model calls,
    Monte Carlo error of the log-likelihoods. Merged across torchrun ranks and reported under
    ``config.blockgen.tasks`` of the results JSON (`report`; the key names are listed in docs/lm_eval.md).
    For answers lm-eval's --use_cache gave, the record stored by the run that computed them
    (`BlockGenLM._settle_cache`).
    """

    COUNTS = ("requests", "truncated_requests", "truncated_tokens")
    # Summed over a setting's batches; `row_calls` / `row_blocks`: the calls and blocks of each row, summed over rows
    # (an adaptive sampler's rows leave a block's calls when done). `max_calls_per_block`: a row's most, the largest.
    GENERATION = ("requests", "model_calls", "blocks", "generated_tokens", "generate_seconds", "row_calls", "row_blocks")
    LARGEST = ("max_calls_per_block",)

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], Counter] = defaultdict(Counter)  # (task, request type)
        self.generation: dict[tuple[str, str], Counter] = defaultdict(Counter)  # (task, settings as JSON)
        self.budgets: dict[tuple[str, str], int] = {}  # the same keys -> the largest max_gen_toks of their rows
        self.stderr: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(dict)  # doc -> per request
        self.disagreement: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)  # doc -> probability
        self.k_mc: int | None = None
        # lm-eval's --use_cache answers requests without calling the model (`BlockGenLM._settle_cache`)
        self.cached: Counter = Counter()  # (task, request type) -> requests answered from the cache
        self.stored: set[str] = set()  # tasks whose figures are the ones stored with their cached answers

    def request(self, task: str, kind: str, dropped: int) -> None:
        self.counts[task, kind].update(requests=1, truncated_requests=int(dropped > 0), truncated_tokens=dropped)

    def generated(self, task: str, settings: dict, result, requests: int, seconds: float) -> None:
        """One batch. Its rows may have their own budgets (gsm8k_code): the record of a setting is keyed
        without ``max_gen_toks`` and reports the largest budget its rows had (`report`), so one
        setting stays one record however its rows' budgets were batched."""
        key = task, json.dumps({k: v for k, v in settings.items() if k != "max_gen_toks"}, sort_keys=True)
        self.generation[key].update(
            requests=requests, model_calls=result.model_calls, blocks=result.n_blocks,
            generated_tokens=sum(map(len, result.tokens)), generate_seconds=seconds,
            row_calls=sum(result.row_calls), row_blocks=sum(result.row_blocks))
        counts = self.generation[key]
        counts["max_calls_per_block"] = max(counts["max_calls_per_block"], *result.row_max_calls_per_block, 0)
        if settings.get("max_gen_toks") is not None:
            self.budgets[key] = max(self.budgets.get(key, 0), settings["max_gen_toks"])

    def scored(self, task: str, kind: str, doc: Any, scores: list[tuple[int, RequestScore]], k_mc: int) -> None:
        self.k_mc = k_mc
        ordered = [score for _, score in sorted(scores, key=lambda item: item[0])]
        self.stderr[task, kind][str(doc)] = [_finite(s.mc_stderr) for s in ordered]
        if len(ordered) >= 2:
            self.disagreement[task, kind][str(doc)] = _finite(seed_disagreement(ordered))

    @staticmethod
    def merge(parts: Sequence["Usage"]) -> "Usage":
        out = Usage()
        for part in parts:
            for mine, theirs in ((out.counts, part.counts), (out.generation, part.generation)):
                for key, counter in theirs.items():
                    mine[key].update(counter)
            for key, budget in getattr(part, "budgets", {}).items():  # absent from a cache stored by older versions
                out.budgets[key] = max(out.budgets.get(key, 0), budget)
            for mine, theirs in ((out.stderr, part.stderr), (out.disagreement, part.disagreement)):
                for key, by_doc in theirs.items():
                    mine[key].update(by_doc)
            out.k_mc = part.k_mc or out.k_mc
            out.cached.update(part.cached)
            out.stored |= part.stored
        return out

    def only(self, task: str) -> "Usage":
        """The figures of one task (what `_settle_cache` stores beside lm-eval's cache)."""
        out = Usage()
        for name in ("counts", "generation", "budgets", "stderr", "disagreement"):
            getattr(out, name).update({key: value for key, value in getattr(self, name).items() if key[0] == task})
        out.k_mc = self.k_mc
        return out

    def report(self) -> dict[str, dict[str, dict]]:
        out: dict[str, dict[str, dict]] = defaultdict(dict)
        for (task, kind), counts in sorted(self.counts.items()):
            out[task][kind] = {name: counts[name] for name in self.COUNTS}
        for (task, key), counts in sorted(self.generation.items()):
            entry = out[task].setdefault("generate_until", {name: 0 for name in self.COUNTS})
            settings = json.loads(key)
            if (task, key) in self.budgets:
                settings = dict(sorted({**settings, "max_gen_toks": self.budgets[task, key]}.items()))
            row = per_row_figures({**settings, **{name: counts[name] for name in (*self.GENERATION, *self.LARGEST)}})
            entry.setdefault("settings", []).append(row)
            for name in ("model_calls", "generated_tokens", "generate_seconds"):
                entry[name] = entry.get(name, 0) + row[name]
        for (task, kind), by_doc in sorted(self.stderr.items()):
            stderrs = [se for ses in by_doc.values() for se in ses if se is not None]
            disagreement = [p for p in self.disagreement[task, kind].values() if p is not None]
            out[task][kind].update({
                "k_mc": self.k_mc,
                "mc_stderr_mean": statistics.fmean(stderrs) if stderrs else None,
                "mc_stderr_max": max(stderrs) if stderrs else None,
                "choice_docs": len(self.disagreement[task, kind]),
                "expected_seed_disagreement": statistics.fmean(disagreement) if disagreement else None,
                "mc_stderr_by_doc": dict(sorted(by_doc.items(), key=lambda item: _doc_order(item[0]))),
            })
        for (task, kind), n in sorted(self.cached.items()):
            entry = out[task].setdefault(kind, {name: 0 for name in self.COUNTS})
            entry.update(answered_from_cache=n, usage_from_cache=task in self.stored)
        return dict(out)


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def _doc_order(doc: str) -> tuple:
    return (0, int(doc), "") if doc.lstrip("-").isdigit() else (1, 0, doc)


def per_row_figures(record: dict) -> dict:
    """A setting's record with its derived figures: model calls per block (batched), the mean calls per block of
    a row (an adaptive sampler's NFE) and generated tokens per forward pass of a row (prompts never count)."""
    record["model_calls_per_block"] = record["model_calls"] / record["blocks"] if record.get("blocks") else 0.0
    if record.get("row_blocks"):
        record["calls_per_block_per_row"] = record["row_calls"] / record["row_blocks"]
        record["tokens_per_forward"] = record["generated_tokens"] / record["row_calls"] if record["row_calls"] else 0.0
    return record


def merge_budgets(settings: list[dict]) -> list[dict]:
    """The adapter's per-setting records with those that differ only in their generation budget
    (``max_gen_toks``: gsm8k_code gives each row the room its prompt leaves) merged into one: counts
    summed, ``max_gen_toks`` the largest, calls per block recomputed. One setting stays one record."""
    merged: dict[str, dict] = {}
    for s in settings:
        key = json.dumps({k: v for k, v in s.items() if k not in (*Usage.GENERATION, *Usage.LARGEST, *DERIVED, "max_gen_toks")},
                         sort_keys=True)
        if key not in merged:
            merged[key] = dict(s)
            continue
        m = merged[key]
        for name in Usage.GENERATION:
            if name in s:
                m[name] = m.get(name, 0) + s[name]
        for name in Usage.LARGEST:
            if name in s:
                m[name] = max(m.get(name, 0), s[name])
        m["max_gen_toks"] = max(m.get("max_gen_toks") or 0, s.get("max_gen_toks") or 0)
        per_row_figures(m)
    return list(merged.values())


DERIVED = ("model_calls_per_block", "calls_per_block_per_row", "tokens_per_forward")


# Where `Usage` lived in earlier versions: lm-eval's --use_cache file keeps it pickled under that name
# (`BlockGenLM._settle_cache`), and a cache written then must still be read.
FORMER_HOMES = ("blockgen.harness.lm_eval_adapter", "blockgen.harness.evaluation.lm_eval_adapter")


class _UsageUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in FORMER_HOMES and name == "Usage":
            return Usage
        return super().find_class(module, name)


def load_stored_usage(blob: bytes) -> Any:
    """`SqliteDict`'s decoder for the stored usage table: pickle, with `Usage` found at its former homes."""
    return _UsageUnpickler(io.BytesIO(bytes(blob))).load()
