"""Drawing problems: ``generate`` (a split, a count, a seed, a level) and ``to_records``.

The seed only changes which problems are drawn, never the split rule.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

from blockgen.harness.data.wordproblems.drafting import Ctx, Draft
from blockgen.harness.data.wordproblems.followups import distractor
from blockgen.harness.data.wordproblems.problems import (
    DEFAULT_DIFFICULTY,
    MAX_ANSWER,
    SPLITS,
    Difficulty,
    WordProblem,
    difficulty,
)
from blockgen.harness.data.wordproblems.split import (
    BY_KIND,
    FOLLOWUP_TABLE,
    HELDOUT_NAMES,
    HELDOUT_PAIRS,
    HELDOUT_PHRASING,
    SEEN_PHRASINGS,
    TEMPLATES,
    TEMPLATE_TABLE,
    is_heldout,
    question_split,
)

# Fraction of test problems drawn with a held-out structure.
_TEST_HELDOUT_FRAC = 0.3


def _choose_followup(c: Ctx, d: Draft, prev: str, policy: str) -> Optional[str]:
    """Apply one follow-up allowed by ``policy`` ("seen", "any" or "heldout")."""
    assert d.kind is not None
    cands = tuple(f for f in BY_KIND[d.kind] if f != prev)  # "then spends ... then spends" reads badly
    if policy == "seen":
        cands = tuple(f for f in cands if (prev, f) not in HELDOUT_PAIRS)
    elif policy == "heldout":
        cands = tuple(f for f in cands if (prev, f) in HELDOUT_PAIRS)
    if not cands:
        return None
    start = int(c.rand() * len(cands))
    for i in range(len(cands)):
        f = cands[(start + i) % len(cands)]
        if FOLLOWUP_TABLE[f][1](c, d):
            if d.fact:  # goes before the sentence the follow-up just added
                d.sents.insert(len(d.sents) - 1, d.fact)
                d.fact = ""
            return f
    return None


def _attempt(rng: random.Random, route: Optional[str], level: Difficulty) -> Optional[WordProblem]:
    """Draw one problem; None when the draw is not usable (caller retries).

    ``route`` is None for seen structures only, "phrasing" for a held-out phrasing, or
    "pair" for a held-out chaining pair right after the base template.
    """
    c = Ctx(rng)
    r = c.rand()
    weights = level.depth_weights
    depth = 0 if r < weights[0] else (1 if r < weights[0] + weights[1] else 2)
    heldout = route is not None
    pair_route = route == "pair"
    templates = TEMPLATES[: level.templates]
    if route == "phrasing":
        name = c.pick(tuple(n for n in HELDOUT_NAMES if n in templates))
        ph = HELDOUT_PHRASING[name]
    else:
        name = c.pick(templates)
        if pair_route:
            depth = max(depth, 1)
            ph = c.ri(0, TEMPLATE_TABLE[name][0] - 1)
        else:
            ph = c.pick(SEEN_PHRASINGS[name])
    d = TEMPLATE_TABLE[name][1](c, ph)
    followups: list[str] = []
    prev = name
    for i in range(depth):
        if d.kind is None:
            break
        policy = "heldout" if pair_route and i == 0 else ("any" if heldout else "seen")
        f = _choose_followup(c, d, prev, policy)
        if f is None:
            break
        followups.append(f)
        prev = f
    if pair_route and not followups:
        return None
    n_distract = 0
    if c.rand() < level.distractor_prob:
        d.sents.insert(c.ri(1, len(d.sents)), distractor(c, d))
        n_distract = 1
    if not 0 <= d.value < MAX_ANSWER:
        return None
    return WordProblem(
        question=" ".join(d.sents) + " " + d.ask,
        code=d.code(),
        answer=d.value,
        template=name,
        phrasing=ph,
        followups=tuple(followups),
        distractors=n_distract,
    )


def generate(split: str, n: int, seed: int = 0, level: str | Difficulty = DEFAULT_DIFFICULTY) -> list[WordProblem]:
    """Draw ``n`` problems of ``split`` ("train", "validation" or "test") at a difficulty ``level``.

    Deterministic in (split, n, seed, level), and a shorter list is a prefix of a longer one.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of: {', '.join(SPLITS)}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    level = difficulty(level)
    routes = ["phrasing"] if any(name in HELDOUT_PHRASING for name in TEMPLATES[: level.templates]) else []
    routes += ["pair"] if level.depth_weights[0] < 1 else []  # a held-out chaining needs a follow-up
    if split == "test" and not routes:
        raise ValueError(f"{level} leaves no structure to hold out: allow follow-ups or a template with a held-out phrasing")
    # A string seed is hashed with SHA-512 by random.Random: stable across runs and platforms.
    rng = random.Random(f"blockgen.wordproblems/{split}/{seed}")
    out: list[WordProblem] = []
    while len(out) < n:
        route = None
        if split == "test" and rng.random() < _TEST_HELDOUT_FRAC:
            # Decided per slot, not per attempt, so the harder route keeps its share.
            route = routes[0] if rng.random() < 0.5 or len(routes) == 1 else routes[-1]
        while True:
            p = _attempt(rng, route, level)
            if p is None or question_split(p.question) != split:
                continue
            if is_heldout(p) == (route is not None):
                break
        out.append(p)
    return out


def to_records(problems: Sequence[WordProblem]) -> list[dict[str, object]]:
    """Plain dicts with the TinyGSM/TinyGSM column names (``question``, ``code``) plus ``answer``."""
    return [{"question": p.question, "code": p.code, "answer": p.answer} for p in problems]
