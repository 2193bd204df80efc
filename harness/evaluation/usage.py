"""The adapter's usage records (`config.blockgen.tasks.<task>.<request type>.settings` of a results file):
one record per sampler setting, with what it cost (requests, model calls, blocks, tokens, seconds)."""

from __future__ import annotations

import json

_COUNTS = ("requests", "model_calls", "blocks", "generated_tokens", "generate_seconds")


def merge_budgets(settings: list[dict]) -> list[dict]:
    """The adapter's per-setting records with those that differ only in their generation budget
    (``max_gen_toks``: gsm8k_code gives each row the room its prompt leaves) merged into one: counts
    summed, ``max_gen_toks`` the largest, calls per block recomputed. One setting stays one record."""
    merged: dict[str, dict] = {}
    for s in settings:
        key = json.dumps({k: v for k, v in s.items() if k not in (*_COUNTS, "max_gen_toks", "model_calls_per_block")},
                         sort_keys=True)
        if key not in merged:
            merged[key] = dict(s)
            continue
        m = merged[key]
        for name in _COUNTS:
            if name in s:
                m[name] = m.get(name, 0) + s[name]
        m["max_gen_toks"] = max(m.get("max_gen_toks") or 0, s.get("max_gen_toks") or 0)
        if m.get("blocks"):
            m["model_calls_per_block"] = m["model_calls"] / m["blocks"]
    return list(merged.values())
