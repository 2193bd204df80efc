"""Drafting one problem: the random choices of an attempt (``Ctx``) and the problem under
construction (``Draft``), which writes the question's sentences and the code side by side.

The code always has the header ``def simple_math_problem() -> int:``, 4-space indentation, one
assignment per number taken from the question, then one computation line per reasoning step,
``result = ...`` and ``return result``::

    def simple_math_problem() -> int:
        apples = 12
        bags = 3
        per_bag = 5
        given = 7
        total = apples + bags * per_bag
        left = total - given
        result = left
        return result

Executing it returns ``answer`` exactly: divisions use ``//`` and the numbers are sampled so every
division is exact.
"""

from __future__ import annotations

import random
from typing import Callable, Optional, Sequence, TypeVar

from blockgen.harness.data.wordproblems.vocabulary import MEN, PEOPLE, WOMEN, Noun, Person

_T = TypeVar("_T")


class Ctx:
    """Random choices for one attempt; keeps people and nouns distinct within a problem."""

    __slots__ = ("rand", "_used", "lead")

    def __init__(self, rng: random.Random) -> None:
        self.rand = rng.random
        self._used: set[object] = set()
        self.lead: Optional[Person] = None  # first person drawn: the one pronouns refer to

    def ri(self, lo: int, hi: int) -> int:
        # Faster than Random.randint, and just as deterministic.
        return lo + int(self.rand() * (hi - lo + 1))

    def pick(self, seq: Sequence[_T]) -> _T:
        return seq[int(self.rand() * len(seq))]

    def fresh(self, pool: Sequence[_T]) -> _T:
        while True:
            x = pool[int(self.rand() * len(pool))]
            if x not in self._used:
                self._used.add(x)
                return x

    def person(self) -> Person:
        p = self.fresh(PEOPLE)
        if self.lead is None:
            self.lead = p
        return p

    def other(self, who: Optional[Person]) -> Person:
        """A new person of the other gender, so "she"/"he" keeps pointing at ``who``."""
        if who is None:
            return self.person()
        return self.fresh(MEN if who.he == "she" else WOMEN)

    def noun(self, pool: Sequence[Noun]) -> Noun:
        return self.fresh(pool)


class Draft:
    """A problem under construction: sentences, question, code lines and the result."""

    __slots__ = ("sents", "ask", "fact", "assign", "lines", "names", "value", "var", "kind", "who", "noun")

    def __init__(self) -> None:
        self.sents: list[str] = []
        self.ask = ""
        # Statement form of any numbers that only the question carries ("after 6 weeks");
        # a follow-up replaces the question, so this sentence keeps those numbers.
        self.fact = ""
        self.assign: list[str] = []
        self.lines: list[str] = []
        self.names: set[str] = set()
        self.value = 0
        self.var = ""
        # kind: what the result is, deciding which follow-ups may chain on it:
        # "count" (who owns value nouns), "money" (who has $value), "cost" (who pays $value).
        self.kind: Optional[str] = None
        self.who: Optional[Person] = None
        self.noun: Optional[Noun] = None

    def _fresh(self, name: str) -> str:
        if name in self.names:
            i = 2
            while f"{name}{i}" in self.names:
                i += 1
            name = f"{name}{i}"
        self.names.add(name)
        return name

    def num(self, name: str, value: int) -> str:
        """Assign a number from the question; returns the (de-duplicated) variable name."""
        name = self._fresh(name)
        self.assign.append(f"    {name} = {value}")
        return name

    def calc(self, name: str, expr: str) -> str:
        name = self._fresh(name)
        self.lines.append(f"    {name} = {expr}")
        return name

    def done(
        self,
        var: str,
        value: int,
        kind: Optional[str] = None,
        who: Optional[Person] = None,
        noun: Optional[Noun] = None,
    ) -> "Draft":
        self.var, self.value, self.kind, self.who, self.noun = var, value, kind, who, noun
        if kind is not None and who is None:
            self.kind = None  # follow-up sentences need someone to refer to
        return self

    def code(self) -> str:
        return "\n".join(
            ("def simple_math_problem() -> int:", *self.assign, *self.lines,
             f"    result = {self.var}", "    return result")
        )


# A base template draws its numbers so that every step is exact and non-negative, writes the
# question in phrasing ``ph`` and the matching code. Results that someone owns or pays are
# marked with a kind so follow-ups can chain on them.
TemplateFn = Callable[[Ctx, int], Draft]
# A follow-up extends a draft in place; False (draft untouched) when it cannot apply exactly.
FollowFn = Callable[[Ctx, Draft], bool]
_S = TypeVar("_S")
_F = TypeVar("_F")


def registry(table: dict[str, tuple[_S, _F]]) -> Callable[[str, _S], Callable[[_F], _F]]:
    """The decorator ``@entry(name, spec)`` that adds a function to ``table`` as ``(spec, fn)``.

    Entries keep their order of definition, which is part of the data (a level draws the first
    templates of the catalogue).
    """

    def entry(name: str, spec: _S) -> Callable[[_F], _F]:
        def register(fn: _F) -> _F:
            table[name] = (spec, fn)
            return fn

        return register

    return entry
