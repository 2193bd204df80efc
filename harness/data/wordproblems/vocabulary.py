"""The words problems are written with: people (with their pronouns), nouns by theme, fractions, bills."""

from __future__ import annotations

from typing import NamedTuple


class Person(NamedTuple):
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


class Noun(NamedTuple):
    one: str
    many: str


def _nouns(*pairs: str) -> tuple[Noun, ...]:
    return tuple(Noun(*p.split("/")) for p in pairs)


# Short names keep questions short; none of them lower-cases to a Python builtin.
WOMEN: tuple[Person, ...] = tuple(
    Person(n, "she", "her", "her")
    for n in "Mia Ava Emma Lily Zoe Nora Ella Ruby Anna Lucy Maya Sara Leah Rosa Ivy Jade Nina Amy Kate Eva".split()
)
MEN: tuple[Person, ...] = tuple(
    Person(n, "he", "him", "his")
    for n in "Tom Sam Ben Leo Jack Owen Liam Noah Ryan Omar Raj Eli Luis Jake Ali Dan Kai Hugo Finn Carl".split()
)
PEOPLE: tuple[Person, ...] = WOMEN + MEN
RELS = ("sister", "brother", "cousin", "friend", "neighbor")
ELDERS = ("mother", "father", "aunt", "uncle")
# Single words, so they double as variable names in the code.
ITEMS = _nouns(
    "sticker/stickers", "marble/marbles", "pencil/pencils", "crayon/crayons", "shell/shells",
    "stamp/stamps", "card/cards", "bead/beads", "button/buttons", "balloon/balloons",
    "rock/rocks", "feather/feathers",
)
FRUIT = _nouns(
    "apple/apples", "orange/oranges", "lemon/lemons", "peach/peaches", "plum/plums",
    "pear/pears", "mango/mangoes", "lime/limes",
)
BAKED = _nouns(
    "cookie/cookies", "muffin/muffins", "cupcake/cupcakes", "brownie/brownies",
    "roll/rolls", "bagel/bagels",
)
FOOD = _nouns("egg/eggs", "banana/bananas", "carrot/carrots", "cracker/crackers", "yogurt/yogurts")
VEG = _nouns(
    "carrot/carrots", "onion/onions", "pepper/peppers", "tomato/tomatoes", "beet/beets",
    "cabbage/cabbages",
)
GOODS = _nouns(
    "pen/pens", "mug/mugs", "notebook/notebooks", "candle/candles", "ball/balls",
    "towel/towels", "kite/kites", "cap/caps", "plate/plates", "folder/folders",
)
BIG_GOODS = _nouns(
    "jacket/jackets", "lamp/lamps", "chair/chairs", "watch/watches", "bike/bikes",
    "tent/tents", "guitar/guitars", "scooter/scooters",
)
# (numerator, denominator, words)
FRACS = (
    (1, 2, "half"), (1, 3, "a third"), (2, 3, "two thirds"), (1, 4, "a quarter"),
    (3, 4, "three quarters"), (1, 5, "a fifth"), (2, 5, "two fifths"), (3, 5, "three fifths"),
)
_BILLS = (10, 20, 50, 100)


def pl(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def next_bill(cost: int) -> int:
    """Smallest note strictly above ``cost`` (or the next hundred for large sums)."""
    for b in _BILLS:
        if b > cost:
            return b
    return (cost // 100 + 1) * 100
