"""The offline, procedural stand-in for TinyGSM-style training data and a GSM8K-like test set: a data
catalogue of grade-school word problems (``question``), each answered by a short TinyGSM-style Python
function (``code``) that returns ``answer`` exactly, an ``int`` in ``[0, 10000)``. A problem is a base
template (``TEMPLATES``, 2-3 phrasings each, in catalogue order: templates), optionally chained with one or two follow-ups (``FOLLOWUPS``) and a distractor
(followups), written with the words of vocabulary and drafted question and code side by side (drafting);
problems defines ``WordProblem`` and the difficulty levels, split the catalogue's order and the
deterministic train/validation/test rule with its held-out structures, generation the draw
(``generate``, ``to_records``). The public API is what this file imports.
"""

from blockgen.harness.data.wordproblems.generation import generate, to_records
from blockgen.harness.data.wordproblems.problems import (
    DEFAULT_DIFFICULTY,
    DIFFICULTIES,
    SPLITS,
    Difficulty,
    WordProblem,
    difficulty,
)
from blockgen.harness.data.wordproblems.split import FOLLOWUPS, TEMPLATES, is_heldout, question_split

__all__ = [
    "DEFAULT_DIFFICULTY",
    "DIFFICULTIES",
    "FOLLOWUPS",
    "SPLITS",
    "TEMPLATES",
    "Difficulty",
    "WordProblem",
    "difficulty",
    "generate",
    "is_heldout",
    "question_split",
    "to_records",
]
