"""Base templates 1-10 of the catalogue, the ones every level draws from ('easy' the first five).

The order of the templates across templates_core, templates_more and templates_rest is part of the
data: a level draws the first k of them (``Difficulty.templates``)."""

from __future__ import annotations

from blockgen.harness.data.wordproblems.drafting import Ctx, Draft, TemplateFn, registry
from blockgen.harness.data.wordproblems.vocabulary import (
    BIG_GOODS,
    ELDERS,
    FRACS,
    GOODS,
    ITEMS,
    RELS,
    Noun,
    Person,
    next_bill,
    pl,
)

TABLE: dict[str, tuple[int, TemplateFn]] = {}  # name -> (number of phrasings, template), in catalogue order
template = registry(TABLE)


@template("bags_give", 3)
def _bags_give(c: Ctx, ph: int) -> Draft:
    p, it, rel = c.person(), c.noun(ITEMS), c.pick(RELS)
    start, bags, per = c.ri(3, 30), c.ri(2, 6), c.ri(2, 12)
    total = start + bags * per
    given = c.ri(2, total - 1)
    d = Draft()
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


@template("buy_change", 3)
def _buy_change(c: Ctx, ph: int) -> Draft:
    p, g = c.person(), c.noun(GOODS)
    n, price = c.ri(2, 8), c.ri(2, 12)
    bill = next_bill(n * price)
    d = Draft()
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


def _two_goods(c: Ctx) -> tuple[Person, Noun, Noun, int, int, int, int]:
    return c.person(), c.noun(GOODS), c.noun(GOODS), c.ri(2, 6), c.ri(2, 15), c.ri(2, 6), c.ri(2, 15)


@template("two_items", 2)
def _two_items(c: Ctx, ph: int) -> Draft:
    p, g1, g2, n1, p1, n2, p2 = _two_goods(c)
    d = Draft()
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


@template("two_items_change", 2)
def _two_items_change(c: Ctx, ph: int) -> Draft:
    p, g1, g2, n1, p1, n2, p2 = _two_goods(c)
    cost = n1 * p1 + n2 * p2
    bill = next_bill(cost)
    d = Draft()
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


@template("two_legs", 3)
def _two_legs(c: Ctx, ph: int) -> Draft:
    p = c.person()
    if ph == 2:
        s1, s2 = c.ri(6, 20), c.ri(6, 20)
    else:
        s1, s2 = 5 * c.ri(6, 18), 5 * c.ri(6, 18)
    t1, t2 = c.ri(2, 5), c.ri(2, 5)
    d = Draft()
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


@template("trip_time", 2)
def _trip_time(c: Ctx, ph: int) -> Draft:
    p = c.person()
    speed, hours, stop = 5 * c.ri(4, 16), c.ri(2, 8), c.ri(1, 3)
    dist = speed * hours
    d = Draft()
    if ph == 0:
        d.sents.append(f"{p.name} drives {dist} km at {speed} km per hour and takes a {stop}-hour break.")
        d.ask = "How many hours does the whole trip take?"
    else:
        d.sents.append(f"A boat sails {dist} miles at {speed} miles per hour, then waits at the dock "
                       f"for {pl(stop, 'hour')}.")
        d.ask = "How many hours pass in total?"
    a, b, e = d.num("distance", dist), d.num("speed", speed), d.num("stop", stop)
    h = d.calc("hours", f"{a} // {b}")
    return d.done(d.calc("total", f"{h} + {e}"), hours + stop)


@template("age_times", 2)
def _age_times(c: Ctx, ph: int) -> Draft:
    p, rel = c.person(), c.pick(ELDERS)
    age = c.ri(3, 14)
    k, years = c.ri(2, min(5, 75 // age)), c.ri(2, 20)
    d = Draft()
    if ph == 0:
        d.sents.append(f"{p.name} is {age} years old. {p.His} {rel} is {k} times as old as {p.him}.")
        d.ask = f"How old will {p.his} {rel} be in {years} years?"
    else:
        d.sents.append(f"{p.name}'s {rel} is {k} times as old as {p.name}, who is {age}.")
        d.ask = f"How old will the {rel} be {years} years from now?"
    a, b, e = d.num("age", age), d.num("times", k), d.num("years", years)
    now = d.calc(f"{rel}_now", f"{a} * {b}")
    return d.done(d.calc(f"{rel}_then", f"{now} + {e}"), age * k + years)


@template("age_sum", 2)
def _age_sum(c: Ctx, ph: int) -> Draft:
    pa, pb, pc = c.person(), c.person(), c.person()
    x, gap = c.ri(4, 30), c.ri(2, 20)
    gap += (x + gap) % 2  # the third age is half the second one
    d = Draft()
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


@template("frac_left", 2)
def _frac_left(c: Ctx, ph: int) -> Draft:
    p, it = c.person(), c.noun(ITEMS)
    num, den, words = c.pick(FRACS)
    total = den * c.ri(2, 20)
    part = total * num // den
    d = Draft()
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


@template("discount", 2)
def _discount(c: Ctx, ph: int) -> Draft:
    p, g = c.person(), c.noun(BIG_GOODS)
    price, pct, n = 20 * c.ri(1, 10), c.pick((10, 20, 25, 50)), c.ri(2, 4)
    d = Draft()
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
