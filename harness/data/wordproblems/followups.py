"""What is added to a base problem: follow-up steps that chain on its result, and distractors.

A problem is a base template optionally chained with one or two follow-up steps that reuse the base
result, e.g. "... She then sells all of them for $3 each. How much money does Mia make?". Some
problems get a distractor sentence carrying an irrelevant number that the code must ignore.
"""

from __future__ import annotations

from typing import Optional

from blockgen.harness.data.wordproblems.drafting import Ctx, Draft, FollowFn, registry
from blockgen.harness.data.wordproblems.problems import MAX_ANSWER
from blockgen.harness.data.wordproblems.vocabulary import BIG_GOODS, FRACS, GOODS, ITEMS, next_bill

# A follow-up appends one sentence, replaces the question and adds one or two code
# lines that use the previous result. It returns False (leaving the draft untouched)
# when it cannot apply exactly to the current value.
TABLE: dict[str, tuple[str, FollowFn]] = {}  # name -> (kind of result it chains on, follow-up)
followup = registry(TABLE)


def _divisor(c: Ctx, x: int, lo: int, hi: int) -> int:
    """A random divisor of ``x`` in [lo, hi] leaving a quotient >= 2, or 0 if none."""
    ks = [k for k in range(lo, hi + 1) if x % k == 0 and x // k >= 2]
    return c.pick(ks) if ks else 0


def _frac_of(c: Ctx, x: int) -> Optional[tuple[int, int, str]]:
    fs = [f for f in FRACS if x % f[1] == 0]
    return c.pick(fs) if fs else None


def _pct_of(c: Ctx, x: int, options: tuple[int, ...]) -> int:
    ps = [q for q in options if x * q % 100 == 0]
    return c.pick(ps) if ps else 0


@followup("give", "count")
def _fu_give(c: Ctx, d: Draft) -> bool:
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


@followup("share", "count")
def _fu_share(c: Ctx, d: Draft) -> bool:
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


@followup("sell", "count")
def _fu_sell(c: Ctx, d: Draft) -> bool:
    p, it = d.who, d.noun
    assert p is not None and it is not None
    price = c.ri(2, 9)
    if d.value * price >= MAX_ANSWER:
        return False
    if c.rand() < 0.5:
        d.sents.append(f"{p.He} sells all {p.his} {it.many} for ${price} each.")
    else:
        d.sents.append(f"{p.He} then sells each {it.one} {p.he} has for ${price}.")
    d.ask = f"How much money does {p.name} make?"
    pv = d.num("price", price)
    d.done(d.calc("money", f"{d.var} * {pv}"), d.value * price, "money", p)
    return True


@followup("together", "count")
def _fu_together(c: Ctx, d: Draft) -> bool:
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


@followup("lose_frac", "count")
def _fu_lose_frac(c: Ctx, d: Draft) -> bool:
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


@followup("pack", "count")
def _fu_pack(c: Ctx, d: Draft) -> bool:
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


@followup("spend", "money")
def _fu_spend(c: Ctx, d: Draft) -> bool:
    p, x = d.who, d.value
    assert p is not None
    if x < 3:
        return False
    a = c.ri(1, min(x - 1, 200))
    g = c.noun(GOODS if a <= 20 else BIG_GOODS)  # no $6 guitars
    d.sents.append(f"{p.He} then spends ${a} on a {g.one}.")
    d.ask = f"How much money does {p.name} have left?"
    av = d.num(f"{g.one}_cost", a)
    d.done(d.calc("left", f"{d.var} - {av}"), x - a, "money", p)
    return True


@followup("buy", "money")
def _fu_buy(c: Ctx, d: Draft) -> bool:
    p = d.who
    assert p is not None
    price = _divisor(c, d.value, 2, 25)
    if not price:
        return False
    g = c.noun(GOODS)
    d.sents.append(f"{p.He} spends all of {p.his} money on {g.many} that cost ${price} each.")
    d.ask = f"How many {g.many} does {p.he} buy?"
    pv = d.num(f"{g.one}_price", price)
    d.done(d.calc(g.many, f"{d.var} // {pv}"), d.value // price, "count", p, g)
    return True


@followup("save_pct", "money")
def _fu_save_pct(c: Ctx, d: Draft) -> bool:
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


@followup("split", "money")
def _fu_split(c: Ctx, d: Draft) -> bool:
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


@followup("spend_frac", "money")
def _fu_spend_frac(c: Ctx, d: Draft) -> bool:
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


@followup("change", "cost")
def _fu_change(c: Ctx, d: Draft) -> bool:
    p = d.who
    assert p is not None
    bill = next_bill(d.value)
    if bill >= MAX_ANSWER:
        return False
    d.sents.append(f"{p.He} pays with a ${bill} bill." if bill <= 100 else f"{p.He} pays with ${bill}.")
    d.ask = f"How much change does {p.he} get?"
    bv = d.num("paid", bill)
    d.done(d.calc("change", f"{bv} - {d.var}"), bill - d.value, "money", p)
    return True


@followup("split_cost", "cost")
def _fu_split_cost(c: Ctx, d: Draft) -> bool:
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


@followup("fee", "cost")
def _fu_fee(c: Ctx, d: Draft) -> bool:
    p = d.who
    assert p is not None
    fee = c.ri(2, 15)
    what = c.pick(("delivery", "service", "booking"))
    d.sents.append(f"There is also a ${fee} {what} fee.")
    d.ask = f"How much does {p.name} pay in total?"
    fv = d.num("fee", fee)
    d.done(d.calc("total", f"{d.var} + {fv}"), d.value + fee, "cost", p)
    return True


@followup("tax", "cost")
def _fu_tax(c: Ctx, d: Draft) -> bool:
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


def distractor(c: Ctx, d: Draft) -> str:
    r = int(c.rand() * 8)
    if r == 0:
        return f"{c.other(c.lead).name} is {c.ri(5, 70)} years old."
    if r == 1:
        return f"It is {c.ri(40, 95)} degrees outside."
    if r == 2:
        return f"The store opened {c.ri(2, 60)} years ago."
    if r == 3:
        return f"{c.other(c.lead).name} has {c.ri(2, 40)} {c.noun(ITEMS).many}."
    if r == 4:
        return f"The park is {c.ri(2, 30)} km away."
    if r == 5:
        return f"{c.other(c.lead).name} read {c.ri(5, 90)} pages yesterday."
    if r == 6 and d.who is not None:
        other = c.noun(ITEMS)  # distinct from the draft's own noun: nouns are unique per problem
        return f"{d.who.name} also has {c.ri(2, 40)} {other.many}."
    return f"There are {c.ri(2, 40)} days left until the holidays."
