"""The catalogue in order (``TEMPLATES``, ``FOLLOWUPS``) and the split rule, deterministic and
independent of the seed.

1. Numbers. Every question is assigned a bucket by a CRC32 hash of the sequence of all
   numbers written in it (``question_split``): 10 % "test", 5 % "validation", 85 %
   "train". A split only keeps questions of its own bucket. The bucket is a function of
   the question string, so no question string can occur in two splits, and a test
   question's number combination is never produced in train.
2. Structures. Some (template, phrasing) pairs and some chaining pairs (base template
   or follow-up, next follow-up) are held out (fixed CRC32 rule on their names, see
   ``HELDOUT_PHRASING`` and ``HELDOUT_PAIRS``). "train" and "validation" never use a
   held-out structure. "test" draws 30 % of its problems with a held-out structure
   (``is_heldout`` is true); the other 70 % are in distribution but unseen: seen
   structures with number combinations that train never produces.
"""

from __future__ import annotations

import re
import zlib

from blockgen.harness.data.wordproblems import followups, templates
from blockgen.harness.data.wordproblems.drafting import FollowFn, TemplateFn
from blockgen.harness.data.wordproblems.problems import WordProblem

# The catalogue in its order, which is part of the data (a level draws the first k templates).
TEMPLATE_TABLE: dict[str, tuple[int, TemplateFn]] = templates.TABLE
FOLLOWUP_TABLE: dict[str, tuple[str, FollowFn]] = followups.TABLE
TEMPLATES: tuple[str, ...] = tuple(TEMPLATE_TABLE)
FOLLOWUPS: tuple[str, ...] = tuple(FOLLOWUP_TABLE)


def _crc(s: str) -> int:
    return zlib.crc32(s.encode())


def _held_phrasing() -> dict[str, int]:
    # About a third of the templates lose one phrasing to test.
    out = {}
    for name, (n_ph, _) in TEMPLATE_TABLE.items():
        h = _crc(f"phrasing:{name}")
        if n_ph >= 2 and h % 3 == 0:
            out[name] = (h // 3) % n_ph
    return out


HELDOUT_PHRASING: dict[str, int] = _held_phrasing()
# About one in six (previous step, follow-up) pairs is only ever composed in test.
HELDOUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    (a, b) for a in TEMPLATES + FOLLOWUPS for b in FOLLOWUPS if _crc(f"pair:{a}>{b}") % 6 == 0
)
HELDOUT_NAMES: tuple[str, ...] = tuple(sorted(HELDOUT_PHRASING))
SEEN_PHRASINGS: dict[str, tuple[int, ...]] = {
    name: tuple(i for i in range(n_ph) if HELDOUT_PHRASING.get(name) != i)
    for name, (n_ph, _) in TEMPLATE_TABLE.items()
}
BY_KIND: dict[str, tuple[str, ...]] = {
    k: tuple(f for f, (kind, _) in FOLLOWUP_TABLE.items() if kind == k) for k in ("count", "money", "cost")
}

_NUMBER = re.compile(r"\d+")


def question_split(question: str) -> str:
    """The split a question's numbers belong to (hash of all numbers in order)."""
    h = _crc(" ".join(_NUMBER.findall(question))) % 20
    return "test" if h < 2 else ("validation" if h == 2 else "train")


def is_heldout(problem: WordProblem) -> bool:
    """True when the problem uses a structure that train and validation never use."""
    if HELDOUT_PHRASING.get(problem.template) == problem.phrasing:
        return True
    prev = problem.template
    for f in problem.followups:
        if (prev, f) in HELDOUT_PAIRS:
            return True
        prev = f
    return False
