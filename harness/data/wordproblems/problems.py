"""What a generated problem is (``WordProblem``), the splits, and the difficulty levels.

Difficulty (``DIFFICULTIES``): "hard" draws from every template, chains up to two follow-ups
and adds a distractor to 30 % of the problems; "easy" (the default) keeps the first 5 templates,
single-step, with no distractor (its held-out test structures are the held-out phrasings);
"medium" keeps 10 templates, one follow-up in half the problems and 10 % distractors. A
``Difficulty`` sets the three knobs directly.
"""

from __future__ import annotations

from dataclasses import dataclass

SPLITS: tuple[str, ...] = ("train", "validation", "test")

MAX_ANSWER = 10_000  # every answer lies in [0, MAX_ANSWER)


@dataclass(frozen=True)
class Difficulty:
    """How varied the problems are. Every level keeps the split rule and the held-out structures."""

    templates: int | None = None  # the first k base templates of TEMPLATES (None: all of them)
    # Probability of 0, 1 or 2 follow-up steps (bases whose result cannot be chained stay single).
    depth_weights: tuple[float, float, float] = (0.3, 0.45, 0.25)
    distractor_prob: float = 0.3  # chance of one sentence with an irrelevant number

    def __post_init__(self) -> None:
        if self.templates is not None and not 1 <= self.templates:
            raise ValueError(f"templates={self.templates}; must be a positive number of base templates or None (all)")
        if len(self.depth_weights) != 3 or min(self.depth_weights) < 0 or abs(sum(self.depth_weights) - 1) > 1e-9:
            raise ValueError(f"depth_weights={self.depth_weights}; three non-negative weights summing to 1")
        if not 0 <= self.distractor_prob <= 1:
            raise ValueError(f"distractor_prob={self.distractor_prob}; must lie in [0, 1]")


# "hard" is the full variety (40 templates, up to two follow-ups, a distractor in 30 % of the
# problems). "easy" is the embedded default: the first 5 templates, single-step, no distractor; a
# tiny model trained for minutes on 2 CPU cores learns it well enough that samplers and priors
# separate, while "medium" (10 templates, one follow-up in half the problems) left them all near 0 %
# at the same budget (docs/results.md, "Why the demo's mixtures start from the AR model").
DIFFICULTIES: dict[str, Difficulty] = {
    "easy": Difficulty(templates=5, depth_weights=(1.0, 0.0, 0.0), distractor_prob=0.0),
    "medium": Difficulty(templates=10, depth_weights=(0.5, 0.5, 0.0), distractor_prob=0.1),
    "hard": Difficulty(),
}
DEFAULT_DIFFICULTY = "easy"


def difficulty(level: str | Difficulty) -> Difficulty:
    """A named level (one of DIFFICULTIES) or a Difficulty as it is."""
    if isinstance(level, Difficulty):
        return level
    if level not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {level!r}; choose one of {sorted(DIFFICULTIES)}")
    return DIFFICULTIES[level]


@dataclass(frozen=True)
class WordProblem:
    """One generated problem; ``code`` run as a function returns ``answer``."""

    question: str
    code: str
    answer: int
    template: str
    phrasing: int = 0
    followups: tuple[str, ...] = ()
    distractors: int = 0

    @property
    def structure(self) -> str:
        """Template, phrasing and follow-up chain, e.g. ``bags_give#1+sell+spend``."""
        return f"{self.template}#{self.phrasing}" + "".join(f"+{f}" for f in self.followups)
