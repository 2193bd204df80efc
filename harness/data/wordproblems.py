"""Offline, procedural stand-in for TinyGSM-style training data and a GSM8K-like test set.

Each example is a grade-school word problem (``question``) answered by a short Python
function (``code``) in the TinyGSM style::

    def simple_math_problem() -> int:
        apples = 12
        bags = 3
        per_bag = 5
        given = 7
        total = apples + bags * per_bag
        left = total - given
        result = left
        return result

The code always has the header ``def simple_math_problem() -> int:``, 4-space
indentation, one assignment per number taken from the question, then one computation
line per reasoning step, ``result = ...`` and ``return result``. Executing it returns
``answer`` exactly (an ``int`` in ``[0, 10000)``): divisions use ``//`` and the numbers
are sampled so every division is exact.

Variety: a problem is a *base template* (one of ``TEMPLATES``, 2-3 surface phrasings
each) optionally chained with one or two *follow-up* steps (``FOLLOWUPS``) that reuse
the base result, e.g. "... She then sells all of them for $3 each. How much money does
Mia make?". About a third of the problems get a distractor sentence carrying an
irrelevant number that the code must ignore. Names, objects and units vary.

Difficulty (``DIFFICULTIES``): "hard" draws from every template, chains up to two follow-ups
and adds a distractor to 30 % of the problems; "easy" (the default) keeps the first 5 templates,
single-step, with no distractor (its held-out test structures are the held-out phrasings);
"medium" keeps 10 templates, one follow-up in half the problems and 10 % distractors. A
``Difficulty`` sets the three knobs directly.

Public API: ``generate``, ``to_records``, ``WordProblem``, ``question_split``,
``is_heldout``, ``SPLITS``, ``TEMPLATES``, ``FOLLOWUPS``.

Split rule (deterministic, independent of the seed):

1. Numbers. Every question is assigned a bucket by a CRC32 hash of the sequence of all
   numbers written in it (``question_split``): 10 % "test", 5 % "validation", 85 %
   "train". A split only keeps questions of its own bucket. The bucket is a function of
   the question string, so no question string can occur in two splits, and a test
   question's number combination is never produced in train.
2. Structures. Some (template, phrasing) pairs and some chaining pairs (base template
   or follow-up, next follow-up) are held out (fixed CRC32 rule on their names, see
   ``_HELDOUT_PHRASING`` and ``_HELDOUT_PAIRS``). "train" and "validation" never use a
   held-out structure. "test" draws 30 % of its problems with a held-out structure
   (``is_heldout`` is true); the other 70 % are in distribution but unseen: seen
   structures with number combinations that train never produces.

The seed only changes which problems are drawn, never the split rule.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, TypeVar

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

SPLITS: tuple[str, ...] = ("train", "validation", "test")

# Fraction of test problems drawn with a held-out structure.
_TEST_HELDOUT_FRAC = 0.3
_MAX_ANSWER = 10_000


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

_T = TypeVar("_T")


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


# --------------------------------------------------------------------------- vocabulary


class _Person(NamedTuple):
    name: str
    he: str
    him: str
    his: str

    @property
    def He(self) -> str:  # noqa: N802 - reads like the text it produces
        return self.he.capitalize()

    @property
    def His(self) -> str:  # noqa: N802
        return self.his.capitalize()


class _Noun(NamedTuple):
    one: str
    many: str


def _nouns(*pairs: str) -> tuple[_Noun, ...]:
    return tuple(_Noun(*p.split("/")) for p in pairs)


# Short names keep questions short; none of them lower-cases to a Python builtin.
_WOMEN: tuple[_Person, ...] = tuple(
    _Person(n, "she", "her", "her")
    for n in "Mia Ava Emma Lily Zoe Nora Ella Ruby Anna Lucy Maya Sara Leah Rosa Ivy Jade Nina Amy Kate Eva".split()
)
_MEN: tuple[_Person, ...] = tuple(
    _Person(n, "he", "him", "his")
    for n in "Tom Sam Ben Leo Jack Owen Liam Noah Ryan Omar Raj Eli Luis Jake Ali Dan Kai Hugo Finn Carl".split()
)
_PEOPLE: tuple[_Person, ...] = _WOMEN + _MEN
_RELS = ("sister", "brother", "cousin", "friend", "neighbor")
_ELDERS = ("mother", "father", "aunt", "uncle")
# Single words, so they double as variable names in the code.
_ITEMS = _nouns(
    "sticker/stickers", "marble/marbles", "pencil/pencils", "crayon/crayons", "shell/shells",
    "stamp/stamps", "card/cards", "bead/beads", "button/buttons", "balloon/balloons",
    "rock/rocks", "feather/feathers",
)
_FRUIT = _nouns(
    "apple/apples", "orange/oranges", "lemon/lemons", "peach/peaches", "plum/plums",
    "pear/pears", "mango/mangoes", "lime/limes",
)
_BAKED = _nouns(
    "cookie/cookies", "muffin/muffins", "cupcake/cupcakes", "brownie/brownies",
    "roll/rolls", "bagel/bagels",
)
_FOOD = _nouns("egg/eggs", "banana/bananas", "carrot/carrots", "cracker/crackers", "yogurt/yogurts")
_VEG = _nouns(
    "carrot/carrots", "onion/onions", "pepper/peppers", "tomato/tomatoes", "beet/beets",
    "cabbage/cabbages",
)
_GOODS = _nouns(
    "pen/pens", "mug/mugs", "notebook/notebooks", "candle/candles", "ball/balls",
    "towel/towels", "kite/kites", "cap/caps", "plate/plates", "folder/folders",
)
_BIG_GOODS = _nouns(
    "jacket/jackets", "lamp/lamps", "chair/chairs", "watch/watches", "bike/bikes",
    "tent/tents", "guitar/guitars", "scooter/scooters",
)
# (numerator, denominator, words)
_FRACS = (
    (1, 2, "half"), (1, 3, "a third"), (2, 3, "two thirds"), (1, 4, "a quarter"),
    (3, 4, "three quarters"), (1, 5, "a fifth"), (2, 5, "two fifths"), (3, 5, "three fifths"),
)
_BILLS = (10, 20, 50, 100)


def _pl(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _next_bill(cost: int) -> int:
    """Smallest note strictly above ``cost`` (or the next hundred for large sums)."""
    for b in _BILLS:
        if b > cost:
            return b
    return (cost // 100 + 1) * 100


# --------------------------------------------------------------------------- drafting


class _Ctx:
    """Random choices for one attempt; keeps people and nouns distinct within a problem."""

    __slots__ = ("rand", "_used", "lead")

    def __init__(self, rng: random.Random) -> None:
        self.rand = rng.random
        self._used: set[object] = set()
        self.lead: Optional[_Person] = None  # first person drawn: the one pronouns refer to

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

    def person(self) -> _Person:
        p = self.fresh(_PEOPLE)
        if self.lead is None:
            self.lead = p
        return p

    def other(self, who: Optional[_Person]) -> _Person:
        """A new person of the other gender, so "she"/"he" keeps pointing at ``who``."""
        if who is None:
            return self.person()
        return self.fresh(_MEN if who.he == "she" else _WOMEN)

    def noun(self, pool: Sequence[_Noun]) -> _Noun:
        return self.fresh(pool)


class _Draft:
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
        self.who: Optional[_Person] = None
        self.noun: Optional[_Noun] = None

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
        who: Optional[_Person] = None,
        noun: Optional[_Noun] = None,
    ) -> "_Draft":
        self.var, self.value, self.kind, self.who, self.noun = var, value, kind, who, noun
        if kind is not None and who is None:
            self.kind = None  # follow-up sentences need someone to refer to
        return self

    def code(self) -> str:
        return "\n".join(
            ("def simple_math_problem() -> int:", *self.assign, *self.lines,
             f"    result = {self.var}", "    return result")
        )


_TemplateFn = Callable[[_Ctx, int], _Draft]
_TEMPLATES: dict[str, tuple[int, _TemplateFn]] = {}


def _template(name: str, phrasings: int) -> Callable[[_TemplateFn], _TemplateFn]:
    def register(fn: _TemplateFn) -> _TemplateFn:
        _TEMPLATES[name] = (phrasings, fn)
        return fn

    return register


# --------------------------------------------------------------------------- base templates
# Each template draws its numbers so that every step is exact and non-negative, writes
# the question in phrasing ``ph`` and the matching code. Results that someone owns or
# pays are marked with a kind so follow-ups can chain on them.


@_template("bags_give", 3)
def _bags_give(c: _Ctx, ph: int) -> _Draft:
    p, it, rel = c.person(), c.noun(_ITEMS), c.pick(_RELS)
    start, bags, per = c.ri(3, 30), c.ri(2, 6), c.ri(2, 12)
    total = start + bags * per
    given = c.ri(2, total - 1)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} has {start} {it.many}. {p.He} buys {bags} bags with {per} {it.many} "
                       f"in each bag, then gives {given} {it.many} to {p.his} {rel}.")
        d.ask = f"How many {it.many} does {p.name} have now?"
    elif ph == 1:
        d.sents.append(f"{p.name} starts with {start} {it.many} and buys {bags} packs of {per} {it.many}. "
                       f"Later {p.he} gives away {given} of them.")
        d.ask = f"How many {it.many} does {p.name} have left?"
    else:
        d.sents.append(f"{p.name} had {start} {it.many}. {p.He} bought {bags} boxes of {per} and gave "
                       f"{given} to {p.his} {rel}.")
        d.ask = f"How many {it.many} does {p.name} have now?"
    a, b, e, g = d.num(it.many, start), d.num("bags", bags), d.num("per_bag", per), d.num("given", given)
    t = d.calc("total", f"{a} + {b} * {e}")
    return d.done(d.calc("left", f"{t} - {g}"), total - given, "count", p, it)


@_template("buy_change", 3)
def _buy_change(c: _Ctx, ph: int) -> _Draft:
    p, g = c.person(), c.noun(_GOODS)
    n, price = c.ri(2, 8), c.ri(2, 12)
    bill = _next_bill(n * price)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} buys {n} {g.many} for ${price} each and pays with a ${bill} bill.")
        d.ask = f"How much change does {p.he} get?"
    elif ph == 1:
        d.sents.append(f"Each {g.one} costs ${price}. {p.name} buys {n} of them and gives the cashier ${bill}.")
        d.ask = f"How much change should {p.name} get back?"
    else:
        d.sents.append(f"{p.name} has ${bill}. {p.He} buys {n} {g.many} that cost ${price} each.")
        d.ask = f"How much money does {p.name} have left?"
    a, b, e = d.num(g.many, n), d.num("price", price), d.num("paid", bill)
    cost = d.calc("cost", f"{a} * {b}")
    return d.done(d.calc("change", f"{e} - {cost}"), bill - n * price, "money", p)


def _two_goods(c: _Ctx) -> tuple[_Person, _Noun, _Noun, int, int, int, int]:
    return c.person(), c.noun(_GOODS), c.noun(_GOODS), c.ri(2, 6), c.ri(2, 15), c.ri(2, 6), c.ri(2, 15)


@_template("two_items", 2)
def _two_items(c: _Ctx, ph: int) -> _Draft:
    p, g1, g2, n1, p1, n2, p2 = _two_goods(c)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} buys {n1} {g1.many} at ${p1} each and {n2} {g2.many} at ${p2} each.")
        d.ask = f"How much does {p.name} spend in total?"
    else:
        d.sents.append(f"{g1.many.capitalize()} cost ${p1} each and {g2.many} cost ${p2} each. "
                       f"{p.name} buys {n1} {g1.many} and {n2} {g2.many}.")
        d.ask = f"How much does {p.he} pay?"
    a, b = d.num(g1.many, n1), d.num(f"{g1.one}_price", p1)
    e, f = d.num(g2.many, n2), d.num(f"{g2.one}_price", p2)
    c1, c2 = d.calc(f"{g1.one}_cost", f"{a} * {b}"), d.calc(f"{g2.one}_cost", f"{e} * {f}")
    return d.done(d.calc("total", f"{c1} + {c2}"), n1 * p1 + n2 * p2, "cost", p)


@_template("two_items_change", 2)
def _two_items_change(c: _Ctx, ph: int) -> _Draft:
    p, g1, g2, n1, p1, n2, p2 = _two_goods(c)
    cost = n1 * p1 + n2 * p2
    bill = _next_bill(cost)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} buys {n1} {g1.many} for ${p1} each and {n2} {g2.many} for ${p2} each. "
                       f"{p.He} pays with ${bill}.")
        d.ask = f"How much change does {p.he} get?"
    else:
        d.sents.append(f"{p.name} has ${bill}. {p.He} buys {n1} {g1.many} at ${p1} each and "
                       f"{n2} {g2.many} at ${p2} each.")
        d.ask = "How much money is left?"
    a, b = d.num(g1.many, n1), d.num(f"{g1.one}_price", p1)
    e, f = d.num(g2.many, n2), d.num(f"{g2.one}_price", p2)
    paid = d.num("paid", bill)
    t = d.calc("cost", f"{a} * {b} + {e} * {f}")
    return d.done(d.calc("change", f"{paid} - {t}"), bill - cost, "money", p)


@_template("two_legs", 3)
def _two_legs(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    if ph == 2:
        s1, s2 = c.ri(6, 20), c.ri(6, 20)
    else:
        s1, s2 = 5 * c.ri(6, 18), 5 * c.ri(6, 18)
    t1, t2 = c.ri(2, 5), c.ri(2, 5)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} drives at {s1} km per hour for {t1} hours, then at {s2} km per hour "
                       f"for {t2} hours.")
        d.ask = f"How many km does {p.he} drive in total?"
    elif ph == 1:
        d.sents.append(f"A train travels for {t1} hours at {s1} km/h and then for {t2} more hours at {s2} km/h.")
        d.ask = "How far does the train go in km?"
    else:
        d.sents.append(f"{p.name} cycles for {t1} hours at {s1} miles per hour and then {t2} hours at "
                       f"{s2} miles per hour.")
        d.ask = f"How many miles does {p.he} cycle?"
    if ph == 1:
        a, b, e, f = d.num("hours1", t1), d.num("speed1", s1), d.num("hours2", t2), d.num("speed2", s2)
    else:
        b, a, f, e = d.num("speed1", s1), d.num("hours1", t1), d.num("speed2", s2), d.num("hours2", t2)
    d1, d2 = d.calc("dist1", f"{b} * {a}"), d.calc("dist2", f"{f} * {e}")
    return d.done(d.calc("total", f"{d1} + {d2}"), s1 * t1 + s2 * t2)


@_template("trip_time", 2)
def _trip_time(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    speed, hours, stop = 5 * c.ri(4, 16), c.ri(2, 8), c.ri(1, 3)
    dist = speed * hours
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} drives {dist} km at {speed} km per hour and takes a {stop}-hour break.")
        d.ask = "How many hours does the whole trip take?"
    else:
        d.sents.append(f"A boat sails {dist} miles at {speed} miles per hour, then waits at the dock "
                       f"for {_pl(stop, 'hour')}.")
        d.ask = "How many hours pass in total?"
    a, b, e = d.num("distance", dist), d.num("speed", speed), d.num("stop", stop)
    h = d.calc("hours", f"{a} // {b}")
    return d.done(d.calc("total", f"{h} + {e}"), hours + stop)


@_template("age_times", 2)
def _age_times(c: _Ctx, ph: int) -> _Draft:
    p, rel = c.person(), c.pick(_ELDERS)
    age = c.ri(3, 14)
    k, years = c.ri(2, min(5, 75 // age)), c.ri(2, 20)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} is {age} years old. {p.His} {rel} is {k} times as old as {p.him}.")
        d.ask = f"How old will {p.his} {rel} be in {years} years?"
    else:
        d.sents.append(f"{p.name}'s {rel} is {k} times as old as {p.name}, who is {age}.")
        d.ask = f"How old will the {rel} be {years} years from now?"
    a, b, e = d.num("age", age), d.num("times", k), d.num("years", years)
    now = d.calc(f"{rel}_now", f"{a} * {b}")
    return d.done(d.calc(f"{rel}_then", f"{now} + {e}"), age * k + years)


@_template("age_sum", 2)
def _age_sum(c: _Ctx, ph: int) -> _Draft:
    pa, pb, pc = c.person(), c.person(), c.person()
    x, gap = c.ri(4, 30), c.ri(2, 20)
    gap += (x + gap) % 2  # the third age is half the second one
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{pa.name} is {x} years old. {pb.name} is {gap} years older than {pa.name}, "
                       f"and {pc.name} is half as old as {pb.name}.")
        d.ask = "What is the sum of their three ages?"
    else:
        d.sents.append(f"{pb.name} is {gap} years older than {pa.name}, who is {x}. "
                       f"{pc.name} is half {pb.name}'s age.")
        d.ask = f"How old are {pa.name}, {pb.name} and {pc.name} altogether?"
    a, g = d.num(f"{pa.name.lower()}_age", x), d.num("older", gap)
    b = d.calc(f"{pb.name.lower()}_age", f"{a} + {g}")
    e = d.calc(f"{pc.name.lower()}_age", f"{b} // 2")
    y = x + gap
    return d.done(d.calc("total", f"{a} + {b} + {e}"), x + y + y // 2)


@_template("frac_left", 2)
def _frac_left(c: _Ctx, ph: int) -> _Draft:
    p, it = c.person(), c.noun(_ITEMS)
    num, den, words = c.pick(_FRACS)
    total = den * c.ri(2, 20)
    part = total * num // den
    d = _Draft()
    a = d.num(it.many, total)
    if ph == 0:
        f = c.person()
        d.sents.append(f"{p.name} has {total} {it.many} and gives {words} of them to {f.name}.")
        d.ask = f"How many {it.many} does {p.name} have left?"
        g = d.calc("given", f"{a} * {num} // {den}")
        return d.done(d.calc("left", f"{a} - {g}"), total - part, "count", p, it)
    found = c.ri(2, 15)
    d.sents.append(f"{p.name} collected {total} {it.many}, but {words} of them got lost. "
                   f"Then {p.he} found {found} more.")
    d.ask = f"How many {it.many} does {p.he} have now?"
    fv = d.num("found", found)
    lost = d.calc("lost", f"{a} * {num} // {den}")
    return d.done(d.calc("left", f"{a} - {lost} + {fv}"), total - part + found, "count", p, it)


@_template("discount", 2)
def _discount(c: _Ctx, ph: int) -> _Draft:
    p, g = c.person(), c.noun(_BIG_GOODS)
    price, pct, n = 20 * c.ri(1, 10), c.pick((10, 20, 25, 50)), c.ri(2, 4)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"A {g.one} costs ${price}, but it is on sale for {pct}% off. {p.name} buys {n} of them.")
        d.ask = f"How much does {p.name} pay?"
    else:
        d.sents.append(f"{p.name} buys {n} {g.many} that usually cost ${price} each. "
                       f"The store takes {pct}% off the price.")
        d.ask = f"How much does {p.he} spend?"
    a, b, e = d.num("price", price), d.num("discount", pct), d.num(g.many, n)
    off = d.calc("off", f"{a} * {b} // 100")
    sale = d.calc("sale", f"{a} - {off}")
    return d.done(d.calc("total", f"{sale} * {e}"), (price - price * pct // 100) * n, "cost", p)


_GROUPS = (  # (whole, part, rest) variable names per phrasing
    ("students", "girls", "boys"),
    ("animals", "sheep", "others"),
    ("guests", "left_early", "stayed"),
)


@_template("pct_group", 3)
def _pct_group(c: _Ctx, ph: int) -> _Draft:
    pct = c.pick((10, 20, 25, 30, 40, 50, 60, 75, 80))
    unit = 100 // math.gcd(pct, 100)  # smallest class size giving a whole number of people
    total = unit * c.ri(-(-12 // unit), 200 // unit)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"There are {total} students in a class and {pct}% of them are girls.")
        d.ask = "How many boys are in the class?"
    elif ph == 1:
        d.sents.append(f"A farm has {total} animals. {pct}% of them are sheep.")
        d.ask = "How many of the animals are not sheep?"
    else:
        d.sents.append(f"{total} people came to a party, and {pct}% of them left before dinner.")
        d.ask = "How many people stayed for dinner?"
    whole, part, rest = _GROUPS[ph]
    a, b = d.num(whole, total), d.num("percent", pct)
    e = d.calc(part, f"{a} * {b} // 100")
    return d.done(d.calc(rest, f"{a} - {e}"), total - total * pct // 100)


@_template("bake_share", 2)
def _bake_share(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    k, each = c.ri(2, 8), c.ri(2, 12)
    total = k * each
    have = c.ri(2, total - 2)
    more = total - have
    d = _Draft()
    if ph == 0:
        it = c.noun(_BAKED)
        d.sents.append(f"{p.name} has {have} {it.many} and bakes {more} more. "
                       f"{p.He} shares them equally among {k} friends.")
        d.ask = "How many does each friend get?"
        a, b, e = d.num(it.many, have), d.num("baked", more), d.num("friends", k)
    else:
        it = c.noun(_FRUIT)
        d.sents.append(f"{p.name} picks {have} {it.many} in the morning and {more} in the afternoon. "
                       f"{p.He} puts them equally into {k} baskets.")
        d.ask = f"How many {it.many} go in each basket?"
        a, b, e = d.num("morning", have), d.num("afternoon", more), d.num("baskets", k)
    t = d.calc("total", f"{a} + {b}")
    return d.done(d.calc("each", f"{t} // {e}"), each)


@_template("wage", 2)
def _wage(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    rate, hours, days = c.ri(8, 25), c.ri(2, 8), c.ri(2, 6)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} earns ${rate} an hour. {p.He} works {hours} hours a day for {days} days.")
        d.ask = f"How much does {p.name} earn?"
        a, b, e = d.num("rate", rate), d.num("hours", hours), d.num("days", days)
    else:
        d.sents.append(f"{p.name} works {hours} hours each day for {days} days and is paid ${rate} per hour.")
        d.ask = f"How much money does {p.he} make?"
        b, e, a = d.num("hours", hours), d.num("days", days), d.num("rate", rate)
    per_day = d.calc("per_day", f"{a} * {b}")
    return d.done(d.calc("total", f"{per_day} * {e}"), rate * hours * days, "money", p)


@_template("savings", 2)
def _savings(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    start, weekly, weeks = c.ri(5, 60), c.ri(2, 25), c.ri(2, 12)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} has ${start} in a piggy bank and saves ${weekly} every week.")
        d.ask = f"How much will {p.he} have after {weeks} weeks?"
        d.fact = f"{p.He} does this for {weeks} weeks."
    else:
        d.sents.append(f"{p.name} starts with ${start}. For {weeks} weeks, {p.he} adds ${weekly} "
                       f"to {p.his} savings each week.")
        d.ask = f"How much money does {p.he} have now?"
    a, b, e = d.num("start", start), d.num("weekly", weekly), d.num("weeks", weeks)
    s = d.calc("saved", f"{b} * {e}")
    return d.done(d.calc("total", f"{a} + {s}"), start + weekly * weeks, "money", p)


@_template("weeks_goal", 2)
def _weeks_goal(c: _Ctx, ph: int) -> _Draft:
    p, g = c.person(), c.noun(_BIG_GOODS)
    weekly, weeks, have = c.ri(3, 25), c.ri(2, 15), c.ri(5, 80)
    cost = have + weekly * weeks
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} wants a {g.one} that costs ${cost}. {p.He} has ${have} "
                       f"and saves ${weekly} each week.")
        d.ask = "How many weeks will it take to have enough?"
    else:
        d.sents.append(f"A {g.one} costs ${cost}. {p.name} has already saved ${have} "
                       f"and saves ${weekly} more every week.")
        d.ask = f"How many more weeks does {p.he} need to save?"
    a, b, e = d.num("cost", cost), d.num("saved", have), d.num("weekly", weekly)
    need = d.calc("needed", f"{a} - {b}")
    return d.done(d.calc("weeks", f"{need} // {e}"), weeks)


@_template("times_more", 2)
def _times_more(c: _Ctx, ph: int) -> _Draft:
    pa, pb, it = c.person(), c.person(), c.noun(_ITEMS)
    x, k = c.ri(2, 30), c.ri(2, 6)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{pa.name} has {x} {it.many}. {pb.name} has {k} times as many {it.many} as {pa.name}.")
        d.ask = f"How many more {it.many} does {pb.name} have than {pa.name}?"
    else:
        d.sents.append(f"{pb.name} collected {k} times as many {it.many} as {pa.name}, who collected {x}.")
        d.ask = f"How many more {it.many} did {pb.name} collect?"
    a, b = d.num(pa.name.lower(), x), d.num("times", k)
    e = d.calc(pb.name.lower(), f"{a} * {b}")
    return d.done(d.calc("more", f"{e} - {a}"), x * k - x)


@_template("friends_total", 2)
def _friends_total(c: _Ctx, ph: int) -> _Draft:
    pa, pb, pc, it = c.person(), c.person(), c.person(), c.noun(_ITEMS)
    x, more = c.ri(3, 30), c.ri(2, 15)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{pa.name} has {x} {it.many}. {pb.name} has {more} more than {pa.name}, "
                       f"and {pc.name} has twice as many as {pb.name}.")
        d.ask = f"How many {it.many} do they have altogether?"
        third, op = 2 * (x + more), "* 2"
    else:
        more += (x + more) % 2  # "half as many" must be whole
        d.sents.append(f"{pa.name} has {x} {it.many} and {pb.name} has {more} more than that. "
                       f"{pc.name} has half as many as {pb.name}.")
        d.ask = f"How many {it.many} do the three of them have?"
        third, op = (x + more) // 2, "// 2"
    a, m = d.num(pa.name.lower(), x), d.num("more", more)
    b = d.calc(pb.name.lower(), f"{a} + {m}")
    e = d.calc(pc.name.lower(), f"{b} {op}")
    return d.done(d.calc("total", f"{a} + {b} + {e}"), x + x + more + third)


@_template("fence", 2)
def _fence(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    length, width, per_m = c.ri(5, 40), c.ri(3, 30), c.ri(2, 12)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name}'s garden is {length} meters long and {width} meters wide. "
                       f"Fencing costs ${per_m} per meter.")
        d.ask = f"How much will it cost {p.name} to fence the whole garden?"
    else:
        d.sents.append(f"{p.name} puts a fence around a yard that is {length} m by {width} m. "
                       f"The fence costs ${per_m} per meter.")
        d.ask = "How much does the fence cost?"
    a, b, e = d.num("length", length), d.num("width", width), d.num("per_meter", per_m)
    per = d.calc("perimeter", f"2 * ({a} + {b})")
    return d.done(d.calc("cost", f"{per} * {e}"), 2 * (length + width) * per_m, "cost", p)


@_template("bed_plants", 2)
def _bed_plants(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    length, width, k = c.ri(2, 10), c.ri(2, 8), c.ri(2, 6)
    d = _Draft()
    if ph == 0:
        it = _Noun("tulip", "tulips")
        d.sents.append(f"{p.name} has a flower bed {length} meters long and {width} meters wide. "
                       f"{p.He} plants {k} tulips in each square meter.")
        d.ask = f"How many tulips does {p.name} plant?"
    else:
        it = _Noun("seed", "seeds")
        d.sents.append(f"A garden plot is {length} m by {width} m, and {p.name} puts {k} seeds "
                       f"in every square meter.")
        d.ask = f"How many seeds does {p.he} use?"
    a, b, e = d.num("length", length), d.num("width", width), d.num("per_sq_m", k)
    area = d.calc("area", f"{a} * {b}")
    total = length * width * k
    if ph == 0:  # the planted tulips are Mia's to give away or sell
        return d.done(d.calc(it.many, f"{area} * {e}"), total, "count", p, it)
    return d.done(d.calc(it.many, f"{area} * {e}"), total)


@_template("uncovered", 2)
def _uncovered(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    big_l, big_w = c.ri(6, 20), c.ri(5, 15)
    small_l, small_w = c.ri(2, big_l - 1), c.ri(2, big_w - 1)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"A room is {big_l} feet by {big_w} feet. A rug that is {small_l} feet by "
                       f"{small_w} feet covers part of the floor.")
        d.ask = "How many square feet of floor are not covered?"
        names = ("room_l", "room_w", "rug_l", "rug_w", "room", "rug", "uncovered")
    else:
        d.sents.append(f"{p.name} paints a wall {big_l} m wide and {big_w} m tall. It has a window "
                       f"{small_l} m by {small_w} m that is not painted.")
        d.ask = f"How many square meters does {p.he} paint?"
        names = ("wall_w", "wall_h", "win_w", "win_h", "wall", "window", "painted")
    a, b = d.num(names[0], big_l), d.num(names[1], big_w)
    e, f = d.num(names[2], small_l), d.num(names[3], small_w)
    big, small = d.calc(names[4], f"{a} * {b}"), d.calc(names[5], f"{e} * {f}")
    return d.done(d.calc(names[6], f"{big} - {small}"), big_l * big_w - small_l * small_w)


@_template("recipe", 2)
def _recipe(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    x, y, m = c.ri(2, 6), c.ri(2, 12) * 2, c.ri(2, 6)
    z = y * m
    d = _Draft()
    if ph == 0:
        it = c.noun(_BAKED)
        d.sents.append(f"A recipe needs {x} cups of flour to make {y} {it.many}. "
                       f"{p.name} wants to make {z} {it.many}.")
        d.ask = f"How many cups of flour does {p.he} need?"
        a = d.num("flour", x)
    else:
        d.sents.append(f"{p.name} uses {x} eggs for every {y} pancakes.")
        d.ask = f"How many eggs does {p.he} need to make {z} pancakes?"
        a = d.num("eggs", x)
    b, e = d.num("per_batch", y), d.num("wanted", z)
    batches = d.calc("batches", f"{e} // {b}")
    return d.done(d.calc("needed", f"{batches} * {a}"), m * x)


@_template("pages_left", 2)
def _pages_left(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    per, days = c.ri(5, 30), c.ri(2, 10)
    pages = per * days + c.ri(5, 200)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name}'s book has {pages} pages. {p.He} reads {per} pages a day for {days} days.")
        d.ask = "How many pages are left to read?"
    else:
        d.sents.append(f"A novel has {pages} pages and {p.name} reads {per} pages every day.")
        d.ask = f"How many pages are left after {days} days?"
    a, b, e = d.num("pages", pages), d.num("per_day", per), d.num("days", days)
    r = d.calc("read", f"{b} * {e}")
    return d.done(d.calc("left", f"{a} - {r}"), pages - per * days)


@_template("bus", 2)
def _bus(c: _Ctx, ph: int) -> _Draft:
    start = c.ri(10, 50)
    off1, on1 = c.ri(2, start - 2), c.ri(2, 20)
    mid = start - off1 + on1
    off2 = c.ri(2, mid - 1)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"A bus has {start} passengers. At the first stop {off1} get off and {on1} get on, "
                       f"and at the second stop {off2} get off.")
        d.ask = "How many passengers are on the bus now?"
    else:
        d.sents.append(f"There are {start} people on a train. At one station {off1} leave and {on1} board. "
                       f"At the next station {off2} more leave.")
        d.ask = "How many people are still on the train?"
    a, b, e, f = d.num("start", start), d.num("off1", off1), d.num("on1", on1), d.num("off2", off2)
    m = d.calc("after1", f"{a} - {b} + {e}")
    return d.done(d.calc("now", f"{m} - {f}"), mid - off2)


@_template("pack_sell", 2)
def _pack_sell(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    k, boxes, price = c.ri(4, 12), c.ri(2, 15), c.ri(3, 20)
    total = k * boxes
    d = _Draft()
    if ph == 0:
        it = c.noun(_FRUIT)
        d.sents.append(f"{p.name} picks {total} {it.many} and packs them in boxes of {k}. "
                       f"{p.He} sells each box for ${price}.")
        d.ask = f"How much money does {p.name} make?"
        names = ("per_box", "boxes")
    else:
        it = c.noun(_BAKED)
        d.sents.append(f"{p.name} bakes {total} {it.many} and puts {k} in each bag. Each bag sells for ${price}.")
        d.ask = f"How much does {p.he} earn by selling every bag?"
        d.fact = f"{p.He} sells every bag."
        names = ("per_bag", "bags")
    a, b, e = d.num(it.many, total), d.num(names[0], k), d.num("price", price)
    n = d.calc(names[1], f"{a} // {b}")
    return d.done(d.calc("money", f"{n} * {e}"), boxes * price, "money", p)


@_template("ribbon", 2)
def _ribbon(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    meters, piece = c.ri(2, 12), c.pick((10, 20, 25, 50))
    pieces = meters * 100 // piece
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} has a ribbon {meters} meters long and cuts it into pieces {piece} cm long.")
        d.ask = f"How many pieces does {p.he} get?"
    else:
        used = c.ri(1, pieces - 1)
        d.sents.append(f"A rope is {meters} m long. {p.name} cuts it into {piece}-centimeter pieces "
                       f"and uses {used} of them.")
        d.ask = "How many pieces are left?"
    a, b = d.num("meters", meters), d.num("piece_cm", piece)
    length = d.calc("length_cm", f"{a} * 100")
    n = d.calc("pieces", f"{length} // {b}")
    if ph == 0:
        return d.done(n, pieces)
    u = d.num("used", used)
    return d.done(d.calc("left", f"{n} - {u}"), pieces - used)


@_template("practice", 2)
def _practice(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    while True:  # total minutes must be whole hours; most draws succeed quickly
        minutes, days, weeks = c.pick((10, 15, 20, 30, 45, 60, 90)), c.ri(2, 7), c.ri(2, 8)
        if minutes * days * weeks % 60 == 0:
            break
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} practices the piano for {minutes} minutes a day, {days} days a week.")
        d.ask = f"How many hours does {p.he} practice in {weeks} weeks?"
    else:
        d.sents.append(f"{p.name} jogs for {minutes} minutes a day on {days} days of each week.")
        d.ask = f"How many hours does {p.he} jog over {weeks} weeks?"
    a, b, e = d.num("minutes", minutes), d.num("days", days), d.num("weeks", weeks)
    t = d.calc("total_min", f"{a} * {b} * {e}")
    return d.done(d.calc("hours", f"{t} // 60"), minutes * days * weeks // 60)


@_template("tank", 2)
def _tank(c: _Ctx, ph: int) -> _Draft:
    rate, minutes, have = c.ri(2, 20), c.ri(2, 30), c.ri(0, 100)
    cap = have + rate * minutes
    d = _Draft()
    if ph == 0:
        d.sents.append(f"A tank holds {cap} liters and already has {have} liters in it. "
                       f"Water flows in at {rate} liters per minute.")
        d.ask = "How many minutes until the tank is full?"
    else:
        d.sents.append(f"A pool needs {cap} gallons of water. It has {have} gallons, "
                       f"and a hose adds {rate} gallons each minute.")
        d.ask = "How many minutes will it take to fill?"
    a, b, e = d.num("capacity", cap), d.num("current", have), d.num("rate", rate)
    need = d.calc("needed", f"{a} - {b}")
    return d.done(d.calc("minutes", f"{need} // {e}"), minutes)


@_template("use_daily", 2)
def _use_daily(c: _Ctx, ph: int) -> _Draft:
    p, it = c.person(), c.noun(_FOOD)
    per, days, more = c.ri(2, 6), c.ri(2, 7), c.ri(2, 12)
    have = per * days + c.ri(1, 30)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} has {have} {it.many}. {p.He} uses {per} {it.many} every day for "
                       f"{days} days and then buys {more} more.")
        d.ask = f"How many {it.many} does {p.name} have now?"
    else:
        d.sents.append(f"{p.name} bought {have} {it.many}. {p.He} eats {per} a day for {days} days, "
                       f"then gets {more} more from a friend.")
        d.ask = f"How many {it.many} does {p.he} have now?"
    a, b, e, f = d.num(it.many, have), d.num("per_day", per), d.num("days", days), d.num("more", more)
    u = d.calc("used", f"{b} * {e}")
    return d.done(d.calc("left", f"{a} - {u} + {f}"), have - per * days + more, "count", p, it)


@_template("profit", 2)
def _profit(c: _Ctx, ph: int) -> _Draft:
    p, g = c.person(), c.noun(_GOODS)
    n, cost = c.ri(3, 20), c.ri(2, 15)
    price = cost + c.ri(1, 10)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} buys {n} {g.many} for ${cost} each and sells them for ${price} each.")
        d.ask = f"How much profit does {p.name} make?"
        a, b, e = d.num(g.many, n), d.num("cost", cost), d.num("price", price)
    else:
        d.sents.append(f"A shop pays ${cost} for each {g.one} and sells it for ${price}. "
                       f"Last week it sold {n} {g.many}.")
        d.ask = "How much profit did the shop make?"
        b, e, a = d.num("cost", cost), d.num("price", price), d.num(g.many, n)
    spent, earned = d.calc("spent", f"{a} * {b}"), d.calc("earned", f"{a} * {e}")
    return d.done(d.calc("profit", f"{earned} - {spent}"), n * (price - cost), "money" if ph == 0 else None, p)


@_template("average", 2)
def _average(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    lo, hi = (50, 98) if ph == 0 else (2, 40)
    a, b, e = c.ri(lo, hi), c.ri(lo, hi), c.ri(lo, hi)
    e += -(a + b + e) % 3  # make the sum divisible by three
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} scored {a}, {b} and {e} on three tests.")
        d.ask = f"What is {p.his} average score?"
        names = ("test1", "test2", "test3")
    else:
        d.sents.append(f"Three bags weigh {a} kg, {b} kg and {e} kg.")
        d.ask = "What is their average weight in kg?"
        names = ("bag1", "bag2", "bag3")
    x, y, z = d.num(names[0], a), d.num(names[1], b), d.num(names[2], e)
    t = d.calc("total", f"{x} + {y} + {z}")
    return d.done(d.calc("average", f"{t} // 3"), (a + b + e) // 3)


@_template("coins", 2)
def _coins(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    q, dm, nk = c.ri(2, 12), c.ri(2, 15), c.ri(2, 15)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} has {q} quarters, {dm} dimes and {nk} nickels.")
        d.ask = f"How many cents does {p.he} have?"
    else:
        d.sents.append(f"In {p.his} pocket {p.name} finds {q} quarters, {dm} dimes and {nk} nickels.")
        d.ask = "What is their total value in cents?"
    a, b, e = d.num("quarters", q), d.num("dimes", dm), d.num("nickels", nk)
    big = d.calc("cents_q", f"{a} * 25")
    return d.done(d.calc("cents", f"{big} + {b} * 10 + {e} * 5"), 25 * q + 10 * dm + 5 * nk)


_LEGS = (("chickens", "cows"), ("ducks", "dogs"), ("ostriches", "zebras"))


@_template("legs", 3)
def _legs(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    x, y = c.ri(2, 30), c.ri(2, 30)
    two, four = _LEGS[ph]
    d = _Draft()
    if ph == 0:
        d.sents.append(f"A farm has {x} chickens and {y} cows.")
        d.ask = "How many legs do the animals have in total?"
    elif ph == 1:
        d.sents.append(f"{p.name} has {x} ducks and {y} dogs.")
        d.ask = f"How many legs do {p.his} animals have altogether?"
    else:
        d.sents.append(f"In a zoo there are {x} ostriches and {y} zebras.")
        d.ask = "How many legs are there in all?"
    a, b = d.num(two, x), d.num(four, y)
    l2 = d.calc(f"{two}_legs", f"{a} * 2")
    l4 = d.calc(f"{four}_legs", f"{b} * 4")
    return d.done(d.calc("legs", f"{l2} + {l4}"), 2 * x + 4 * y)


@_template("rows_eaten", 2)
def _rows_eaten(c: _Ctx, ph: int) -> _Draft:
    p, it = c.person(), c.noun(_VEG)
    rows, per = c.ri(2, 10), c.ri(3, 15)
    lost = c.ri(1, rows * per - 1)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} plants {rows} rows of {it.many} with {per} in each row. "
                       f"Rabbits eat {lost} of them.")
        d.ask = f"How many {it.many} does {p.name} have left?"
    else:
        d.sents.append(f"{p.name} grows {rows} rows of {per} {it.many} each, and {lost} of the {it.many} go bad.")
        d.ask = f"How many good {it.many} does {p.he} have?"
    a, b, e = d.num("rows", rows), d.num("per_row", per), d.num("lost", lost)
    t = d.calc("total", f"{a} * {b}")
    return d.done(d.calc("left", f"{t} - {e}"), rows * per - lost, "count", p, it)


@_template("budget", 2)
def _budget(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    income, pct = 100 * c.ri(10, 50), c.pick((10, 20, 25, 30, 40, 50))
    rest = income - income * pct // 100
    food = 10 * c.ri(5, min(50, rest // 10))
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} earns ${income} a month. {p.He} pays {pct}% of it for rent "
                       f"and spends ${food} on food.")
        d.ask = f"How much money does {p.he} have left each month?"
    else:
        d.sents.append(f"Every month {p.name} gets ${income}, spends {pct}% on rent and ${food} on groceries.")
        d.ask = "How much is left?"
    a, b, e = d.num("income", income), d.num("rent_pct", pct), d.num("food", food)
    rent = d.calc("rent", f"{a} * {b} // 100")
    return d.done(d.calc("left", f"{a} - {rent} - {e}"), rest - food, "money", p)


@_template("growth", 2)
def _growth(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    height, per, n = c.ri(10, 200), c.ri(2, 30), c.ri(2, 10)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"A tree is {height} cm tall and grows {per} cm every year.")
        d.ask = f"How many cm tall will it be in {n} years?"
        names = ("per_year", "years")
    else:
        d.sents.append(f"{p.name}'s sunflower is {height} cm tall. It grows {per} cm each week.")
        d.ask = f"How tall will it be after {n} weeks, in cm?"
        names = ("per_week", "weeks")
    a, b, e = d.num("height", height), d.num(names[0], per), d.num(names[1], n)
    g = d.calc("growth", f"{b} * {e}")
    return d.done(d.calc("final", f"{a} + {g}"), height + per * n)


@_template("tickets", 2)
def _tickets(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    adult = c.ri(8, 20)
    child, na, nc = c.ri(3, adult - 1), c.ri(2, 4), c.ri(2, 6)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"Movie tickets cost ${adult} for adults and ${child} for kids. "
                       f"{p.name} buys {na} adult tickets and {nc} kid tickets.")
        d.ask = f"How much does {p.he} pay?"
    else:
        d.sents.append(f"At the zoo, an adult ticket is ${adult} and a child ticket is ${child}. "
                       f"{p.name} pays for {na} adults and {nc} children.")
        d.ask = "How much do the tickets cost?"
    a, b = d.num("adult_price", adult), d.num("kid_price", child)
    e, f = d.num("adults", na), d.num("kids", nc)
    ca, ck = d.calc("adult_cost", f"{a} * {e}"), d.calc("kid_cost", f"{b} * {f}")
    return d.done(d.calc("total", f"{ca} + {ck}"), adult * na + child * nc, "cost", p)


@_template("trip_days", 2)
def _trip_days(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    weeks, days, per = c.ri(1, 3), c.ri(1, 6), 5 * c.ri(4, 30)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} goes on a trip for {_pl(weeks, 'week')} and {_pl(days, 'day')}. "
                       f"{p.He} spends ${per} each day.")
        d.ask = f"How much does the trip cost {p.him}?"
    else:
        d.sents.append(f"A hotel charges ${per} per night. {p.name} stays {_pl(weeks, 'week')} "
                       f"and {_pl(days, 'night')}.")
        d.ask = "How much does the stay cost?"
    b, e = d.num("weeks", weeks), d.num("days", days)
    a = d.num("per_day", per)
    t = d.calc("total_days", f"{b} * 7 + {e}")
    return d.done(d.calc("cost", f"{t} * {a}"), (weeks * 7 + days) * per, "cost", p)


@_template("factory", 2)
def _factory(c: _Ctx, ph: int) -> _Draft:
    per, hours = c.ri(5, 50), c.ri(2, 10)
    bad = c.ri(1, per * hours - 1)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"A machine makes {per} toys an hour and runs for {hours} hours. {bad} of the toys are broken.")
        d.ask = "How many good toys does it make?"
        names = ("broken", "good")
    else:
        d.sents.append(f"A bakery bakes {per} loaves an hour for {hours} hours, and {bad} loaves "
                       f"are sold before noon.")
        d.ask = "How many loaves are left after noon?"
        names = ("sold", "left")
    a, b, e = d.num("per_hour", per), d.num("hours", hours), d.num(names[0], bad)
    m = d.calc("made", f"{a} * {b}")
    return d.done(d.calc(names[1], f"{m} - {e}"), per * hours - bad)


@_template("allowance", 2)
def _allowance(c: _Ctx, ph: int) -> _Draft:
    p = c.person()
    weekly, weeks = c.ri(5, 30), c.ri(2, 10)
    spent = c.ri(1, weekly - 1)
    d = _Draft()
    if ph == 0:
        d.sents.append(f"{p.name} gets ${weekly} of allowance each week and spends ${spent} of it.")
        d.ask = f"How much does {p.he} save in {weeks} weeks?"
        d.fact = f"{p.He} saves the rest for {weeks} weeks."
    else:
        d.sents.append(f"Every week {p.name} earns ${weekly} and spends ${spent} on snacks.")
        d.ask = f"How much money will {p.he} have saved after {weeks} weeks?"
        d.fact = f"{p.He} does this for {weeks} weeks."
    a, b, e = d.num("allowance", weekly), d.num("spent", spent), d.num("weeks", weeks)
    s = d.calc("saved_week", f"{a} - {b}")
    return d.done(d.calc("total", f"{s} * {e}"), (weekly - spent) * weeks, "money", p)


@_template("unit_price", 2)
def _unit_price(c: _Ctx, ph: int) -> _Draft:
    p, g = c.person(), c.noun(_GOODS)
    pack, unit, want = c.ri(2, 12), c.ri(1, 9), c.ri(2, 30)
    cost = pack * unit
    d = _Draft()
    if ph == 0:
        d.sents.append(f"A box of {pack} {g.many} costs ${cost}.")
        d.ask = f"At the same price per {g.one}, how much would {p.name} pay for {want} {g.many}?"
        d.fact = f"{p.name} buys {want} {g.many} at that price per {g.one}."
    else:
        d.sents.append(f"{p.name} paid ${cost} for {pack} {g.many}.")
        d.ask = f"How much would {want} {g.many} cost at that price?"
        d.fact = f"{p.He} then buys {want} {g.many} at the same price."
    if ph == 0:
        a, b = d.num("pack", pack), d.num("pack_cost", cost)
    else:
        b, a = d.num("pack_cost", cost), d.num("pack", pack)
    e = d.num("wanted", want)
    each = d.calc("each", f"{b} // {a}")
    return d.done(d.calc("total", f"{each} * {e}"), unit * want, "cost", p)


# --------------------------------------------------------------------------- follow-ups
# A follow-up appends one sentence, replaces the question and adds one or two code
# lines that use the previous result. It returns False (leaving the draft untouched)
# when it cannot apply exactly to the current value.

_FollowFn = Callable[[_Ctx, _Draft], bool]
_FOLLOWUPS: dict[str, tuple[str, _FollowFn]] = {}


def _followup(name: str, kind: str) -> Callable[[_FollowFn], _FollowFn]:
    def register(fn: _FollowFn) -> _FollowFn:
        _FOLLOWUPS[name] = (kind, fn)
        return fn

    return register


def _divisor(c: _Ctx, x: int, lo: int, hi: int) -> int:
    """A random divisor of ``x`` in [lo, hi] leaving a quotient >= 2, or 0 if none."""
    ks = [k for k in range(lo, hi + 1) if x % k == 0 and x // k >= 2]
    return c.pick(ks) if ks else 0


def _frac_of(c: _Ctx, x: int) -> Optional[tuple[int, int, str]]:
    fs = [f for f in _FRACS if x % f[1] == 0]
    return c.pick(fs) if fs else None


def _pct_of(c: _Ctx, x: int, options: tuple[int, ...]) -> int:
    ps = [q for q in options if x * q % 100 == 0]
    return c.pick(ps) if ps else 0


@_followup("give", "count")
def _fu_give(c: _Ctx, d: _Draft) -> bool:
    p, it, x = d.who, d.noun, d.value
    assert p is not None and it is not None
    if x < 3:
        return False
    k, f = c.ri(1, min(x - 1, 30)), c.other(p)
    lead = c.pick(("Then", "After that,", "Later"))
    d.sents.append(f"{lead} {p.he} gives {k} of {p.his} {it.many} to {f.name}.")
    d.ask = f"How many {it.many} does {p.name} have left?"
    kv = d.num("gave", k)
    d.done(d.calc("left", f"{d.var} - {kv}"), x - k, "count", p, it)
    return True


@_followup("share", "count")
def _fu_share(c: _Ctx, d: _Draft) -> bool:
    p, it = d.who, d.noun
    assert p is not None and it is not None
    k = _divisor(c, d.value, 2, 9)
    if not k:
        return False
    d.sents.append(f"{p.He} shares {p.his} {it.many} equally among {k} friends.")
    d.ask = f"How many {it.many} does each friend get?"
    kv = d.num("friends", k)
    d.done(d.calc("each", f"{d.var} // {kv}"), d.value // k)
    return True


@_followup("sell", "count")
def _fu_sell(c: _Ctx, d: _Draft) -> bool:
    p, it = d.who, d.noun
    assert p is not None and it is not None
    price = c.ri(2, 9)
    if d.value * price >= _MAX_ANSWER:
        return False
    if c.rand() < 0.5:
        d.sents.append(f"{p.He} sells all {p.his} {it.many} for ${price} each.")
    else:
        d.sents.append(f"{p.He} then sells each {it.one} {p.he} has for ${price}.")
    d.ask = f"How much money does {p.name} make?"
    pv = d.num("price", price)
    d.done(d.calc("money", f"{d.var} * {pv}"), d.value * price, "money", p)
    return True


@_followup("together", "count")
def _fu_together(c: _Ctx, d: _Draft) -> bool:
    p, it = d.who, d.noun
    assert p is not None and it is not None
    k, f = c.ri(2, 20), c.other(p)
    if c.rand() < 0.5:
        d.sents.append(f"{f.name} has {k} more {it.many} than {p.name} does.")
        d.ask = f"How many {it.many} do they have together?"
        kv = d.num("more", k)
        fv = d.calc(f.name.lower(), f"{d.var} + {kv}")
        d.done(d.calc("together", f"{d.var} + {fv}"), 2 * d.value + k)
    else:
        if d.value <= k:
            return False
        d.sents.append(f"{f.name} has {k} fewer {it.many} than {p.name}.")
        d.ask = f"How many {it.many} do the two of them have in all?"
        kv = d.num("fewer", k)
        fv = d.calc(f.name.lower(), f"{d.var} - {kv}")
        d.done(d.calc("together", f"{d.var} + {fv}"), 2 * d.value - k)
    return True


@_followup("lose_frac", "count")
def _fu_lose_frac(c: _Ctx, d: _Draft) -> bool:
    p, it = d.who, d.noun
    assert p is not None and it is not None
    fr = _frac_of(c, d.value)
    if fr is None:
        return False
    num, den, words = fr
    d.sents.append(f"{p.He} then loses {words} of {p.his} {it.many}.")
    d.ask = f"How many {it.many} does {p.name} have left?"
    lost = d.calc("lost", f"{d.var} * {num} // {den}")
    d.done(d.calc("left", f"{d.var} - {lost}"), d.value - d.value * num // den, "count", p, it)
    return True


@_followup("pack", "count")
def _fu_pack(c: _Ctx, d: _Draft) -> bool:
    p, it = d.who, d.noun
    assert p is not None and it is not None
    k = _divisor(c, d.value, 2, 12)
    if not k:
        return False
    box = c.pick(("bags", "boxes", "jars"))
    d.sents.append(f"{p.He} packs all the {it.many} into {box} of {k}.")
    d.ask = f"How many {box} does {p.he} fill?"
    kv = d.num("per_" + box[:-2 if box == "boxes" else -1], k)
    d.done(d.calc(box, f"{d.var} // {kv}"), d.value // k)
    return True


@_followup("spend", "money")
def _fu_spend(c: _Ctx, d: _Draft) -> bool:
    p, x = d.who, d.value
    assert p is not None
    if x < 3:
        return False
    a = c.ri(1, min(x - 1, 200))
    g = c.noun(_GOODS if a <= 20 else _BIG_GOODS)  # no $6 guitars
    d.sents.append(f"{p.He} then spends ${a} on a {g.one}.")
    d.ask = f"How much money does {p.name} have left?"
    av = d.num(f"{g.one}_cost", a)
    d.done(d.calc("left", f"{d.var} - {av}"), x - a, "money", p)
    return True


@_followup("buy", "money")
def _fu_buy(c: _Ctx, d: _Draft) -> bool:
    p = d.who
    assert p is not None
    price = _divisor(c, d.value, 2, 25)
    if not price:
        return False
    g = c.noun(_GOODS)
    d.sents.append(f"{p.He} spends all of {p.his} money on {g.many} that cost ${price} each.")
    d.ask = f"How many {g.many} does {p.he} buy?"
    pv = d.num(f"{g.one}_price", price)
    d.done(d.calc(g.many, f"{d.var} // {pv}"), d.value // price, "count", p, g)
    return True


@_followup("save_pct", "money")
def _fu_save_pct(c: _Ctx, d: _Draft) -> bool:
    p = d.who
    assert p is not None
    pct = _pct_of(c, d.value, (10, 20, 25, 30, 40, 50, 60, 75))
    if not pct:
        return False
    d.sents.append(f"{p.He} puts {pct}% of {p.his} money into savings.")
    d.ask = f"How much money does {p.he} save?"
    pv = d.num("save_pct", pct)
    d.done(d.calc("saved", f"{d.var} * {pv} // 100"), d.value * pct // 100)
    return True


@_followup("split", "money")
def _fu_split(c: _Ctx, d: _Draft) -> bool:
    p = d.who
    assert p is not None
    k = _divisor(c, d.value, 2, 6)
    if not k:
        return False
    d.sents.append(f"{p.He} shares {p.his} money equally with {k - 1} {'friend' if k == 2 else 'friends'}.")
    d.ask = "How much money does each person get?"
    fv = d.num("friends", k - 1)
    people = d.calc("people", f"{fv} + 1")
    d.done(d.calc("each", f"{d.var} // {people}"), d.value // k)
    return True


@_followup("spend_frac", "money")
def _fu_spend_frac(c: _Ctx, d: _Draft) -> bool:
    p = d.who
    assert p is not None
    fr = _frac_of(c, d.value)
    if fr is None:
        return False
    num, den, words = fr
    what = c.pick(("clothes", "books", "games", "a gift", "food"))
    d.sents.append(f"{p.He} spends {words} of {p.his} money on {what}.")
    d.ask = f"How much money does {p.he} have left?"
    spent = d.calc("spent", f"{d.var} * {num} // {den}")
    d.done(d.calc("left", f"{d.var} - {spent}"), d.value - d.value * num // den, "money", p)
    return True


@_followup("change", "cost")
def _fu_change(c: _Ctx, d: _Draft) -> bool:
    p = d.who
    assert p is not None
    bill = _next_bill(d.value)
    if bill >= _MAX_ANSWER:
        return False
    d.sents.append(f"{p.He} pays with a ${bill} bill." if bill <= 100 else f"{p.He} pays with ${bill}.")
    d.ask = f"How much change does {p.he} get?"
    bv = d.num("paid", bill)
    d.done(d.calc("change", f"{bv} - {d.var}"), bill - d.value, "money", p)
    return True


@_followup("split_cost", "cost")
def _fu_split_cost(c: _Ctx, d: _Draft) -> bool:
    p = d.who
    assert p is not None
    k = _divisor(c, d.value, 2, 6)
    if not k:
        return False
    d.sents.append(f"{p.He} splits the cost equally with {k - 1} {'friend' if k == 2 else 'friends'}.")
    d.ask = "How much does each person pay?"
    fv = d.num("friends", k - 1)
    people = d.calc("people", f"{fv} + 1")
    d.done(d.calc("share", f"{d.var} // {people}"), d.value // k)
    return True


@_followup("fee", "cost")
def _fu_fee(c: _Ctx, d: _Draft) -> bool:
    p = d.who
    assert p is not None
    fee = c.ri(2, 15)
    what = c.pick(("delivery", "service", "booking"))
    d.sents.append(f"There is also a ${fee} {what} fee.")
    d.ask = f"How much does {p.name} pay in total?"
    fv = d.num("fee", fee)
    d.done(d.calc("total", f"{d.var} + {fv}"), d.value + fee, "cost", p)
    return True


@_followup("tax", "cost")
def _fu_tax(c: _Ctx, d: _Draft) -> bool:
    p = d.who
    assert p is not None
    pct = _pct_of(c, d.value, (5, 10, 15, 20, 25))
    if not pct:
        return False
    d.sents.append(f"There is a {pct}% sales tax on top of that.")
    d.ask = f"How much does {p.name} pay in total?"
    pv = d.num("tax_pct", pct)
    tax = d.calc("tax", f"{d.var} * {pv} // 100")
    d.done(d.calc("total", f"{d.var} + {tax}"), d.value + d.value * pct // 100, "cost", p)
    return True


# --------------------------------------------------------------------------- distractors
# One sentence with a number the code must not use. Names only (no pronouns), so the
# sentence reads fine wherever it is inserted.


def _distractor(c: _Ctx, d: _Draft) -> str:
    r = int(c.rand() * 8)
    if r == 0:
        return f"{c.other(c.lead).name} is {c.ri(5, 70)} years old."
    if r == 1:
        return f"It is {c.ri(40, 95)} degrees outside."
    if r == 2:
        return f"The store opened {c.ri(2, 60)} years ago."
    if r == 3:
        return f"{c.other(c.lead).name} has {c.ri(2, 40)} {c.noun(_ITEMS).many}."
    if r == 4:
        return f"The park is {c.ri(2, 30)} km away."
    if r == 5:
        return f"{c.other(c.lead).name} read {c.ri(5, 90)} pages yesterday."
    if r == 6 and d.who is not None:
        other = c.noun(_ITEMS)  # distinct from the draft's own noun: nouns are unique per problem
        return f"{d.who.name} also has {c.ri(2, 40)} {other.many}."
    return f"There are {c.ri(2, 40)} days left until the holidays."


# --------------------------------------------------------------------------- split rule

TEMPLATES: tuple[str, ...] = tuple(_TEMPLATES)
FOLLOWUPS: tuple[str, ...] = tuple(_FOLLOWUPS)


def _crc(s: str) -> int:
    return zlib.crc32(s.encode())


def _held_phrasing() -> dict[str, int]:
    # About a third of the templates lose one phrasing to test.
    out = {}
    for name, (n_ph, _) in _TEMPLATES.items():
        h = _crc(f"phrasing:{name}")
        if n_ph >= 2 and h % 3 == 0:
            out[name] = (h // 3) % n_ph
    return out


_HELDOUT_PHRASING: dict[str, int] = _held_phrasing()
# About one in six (previous step, follow-up) pairs is only ever composed in test.
_HELDOUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    (a, b) for a in TEMPLATES + FOLLOWUPS for b in FOLLOWUPS if _crc(f"pair:{a}>{b}") % 6 == 0
)
_HELDOUT_NAMES: tuple[str, ...] = tuple(sorted(_HELDOUT_PHRASING))
_SEEN_PHRASINGS: dict[str, tuple[int, ...]] = {
    name: tuple(i for i in range(n_ph) if _HELDOUT_PHRASING.get(name) != i)
    for name, (n_ph, _) in _TEMPLATES.items()
}
_BY_KIND: dict[str, tuple[str, ...]] = {
    k: tuple(f for f, (kind, _) in _FOLLOWUPS.items() if kind == k) for k in ("count", "money", "cost")
}

_NUMBER = re.compile(r"\d+")


def question_split(question: str) -> str:
    """The split a question's numbers belong to (hash of all numbers in order)."""
    h = _crc(" ".join(_NUMBER.findall(question))) % 20
    return "test" if h < 2 else ("validation" if h == 2 else "train")


def is_heldout(problem: WordProblem) -> bool:
    """True when the problem uses a structure that train and validation never use."""
    if _HELDOUT_PHRASING.get(problem.template) == problem.phrasing:
        return True
    prev = problem.template
    for f in problem.followups:
        if (prev, f) in _HELDOUT_PAIRS:
            return True
        prev = f
    return False


# --------------------------------------------------------------------------- generation


def _choose_followup(c: _Ctx, d: _Draft, prev: str, policy: str) -> Optional[str]:
    """Apply one follow-up allowed by ``policy`` ("seen", "any" or "heldout")."""
    assert d.kind is not None
    cands = tuple(f for f in _BY_KIND[d.kind] if f != prev)  # "then spends ... then spends" reads badly
    if policy == "seen":
        cands = tuple(f for f in cands if (prev, f) not in _HELDOUT_PAIRS)
    elif policy == "heldout":
        cands = tuple(f for f in cands if (prev, f) in _HELDOUT_PAIRS)
    if not cands:
        return None
    start = int(c.rand() * len(cands))
    for i in range(len(cands)):
        f = cands[(start + i) % len(cands)]
        if _FOLLOWUPS[f][1](c, d):
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
    c = _Ctx(rng)
    r = c.rand()
    weights = level.depth_weights
    depth = 0 if r < weights[0] else (1 if r < weights[0] + weights[1] else 2)
    heldout = route is not None
    pair_route = route == "pair"
    templates = TEMPLATES[: level.templates]
    if route == "phrasing":
        name = c.pick(tuple(n for n in _HELDOUT_NAMES if n in templates))
        ph = _HELDOUT_PHRASING[name]
    else:
        name = c.pick(templates)
        if pair_route:
            depth = max(depth, 1)
            ph = c.ri(0, _TEMPLATES[name][0] - 1)
        else:
            ph = c.pick(_SEEN_PHRASINGS[name])
    d = _TEMPLATES[name][1](c, ph)
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
        d.sents.insert(c.ri(1, len(d.sents)), _distractor(c, d))
        n_distract = 1
    if not 0 <= d.value < _MAX_ANSWER:
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
    routes = ["phrasing"] if any(name in _HELDOUT_PHRASING for name in TEMPLATES[: level.templates]) else []
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
