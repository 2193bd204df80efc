"""The 40 base templates of the catalogue, in its order, which is part of the data: a level draws the
first k of them (``Difficulty.templates``: 'easy' the first five, 'medium' the first ten, 'hard' all).
A data catalogue: each template draws its numbers and words from a `Ctx` and writes its question and
code into a `Draft` (harness/data/wordproblems/drafting.py)."""

from __future__ import annotations

import math

from blockgen.harness.data.wordproblems.drafting import Ctx, Draft, TemplateFn, registry
from blockgen.harness.data.wordproblems.vocabulary import (
    BAKED,
    BIG_GOODS,
    ELDERS,
    FOOD,
    FRACS,
    FRUIT,
    GOODS,
    ITEMS,
    RELS,
    VEG,
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


# ------------------------------------------------------------------ templates 11-25 (level 'hard')

_GROUPS = (  # (whole, part, rest) variable names per phrasing
    ("students", "girls", "boys"),
    ("animals", "sheep", "others"),
    ("guests", "left_early", "stayed"),
)


@template("pct_group", 3)
def _pct_group(c: Ctx, ph: int) -> Draft:
    pct = c.pick((10, 20, 25, 30, 40, 50, 60, 75, 80))
    unit = 100 // math.gcd(pct, 100)  # smallest class size giving a whole number of people
    total = unit * c.ri(-(-12 // unit), 200 // unit)
    d = Draft()
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


@template("bake_share", 2)
def _bake_share(c: Ctx, ph: int) -> Draft:
    p = c.person()
    k, each = c.ri(2, 8), c.ri(2, 12)
    total = k * each
    have = c.ri(2, total - 2)
    more = total - have
    d = Draft()
    if ph == 0:
        it = c.noun(BAKED)
        d.sents.append(f"{p.name} has {have} {it.many} and bakes {more} more. "
                       f"{p.He} shares them equally among {k} friends.")
        d.ask = "How many does each friend get?"
        a, b, e = d.num(it.many, have), d.num("baked", more), d.num("friends", k)
    else:
        it = c.noun(FRUIT)
        d.sents.append(f"{p.name} picks {have} {it.many} in the morning and {more} in the afternoon. "
                       f"{p.He} puts them equally into {k} baskets.")
        d.ask = f"How many {it.many} go in each basket?"
        a, b, e = d.num("morning", have), d.num("afternoon", more), d.num("baskets", k)
    t = d.calc("total", f"{a} + {b}")
    return d.done(d.calc("each", f"{t} // {e}"), each)


@template("wage", 2)
def _wage(c: Ctx, ph: int) -> Draft:
    p = c.person()
    rate, hours, days = c.ri(8, 25), c.ri(2, 8), c.ri(2, 6)
    d = Draft()
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


@template("savings", 2)
def _savings(c: Ctx, ph: int) -> Draft:
    p = c.person()
    start, weekly, weeks = c.ri(5, 60), c.ri(2, 25), c.ri(2, 12)
    d = Draft()
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


@template("weeks_goal", 2)
def _weeks_goal(c: Ctx, ph: int) -> Draft:
    p, g = c.person(), c.noun(BIG_GOODS)
    weekly, weeks, have = c.ri(3, 25), c.ri(2, 15), c.ri(5, 80)
    cost = have + weekly * weeks
    d = Draft()
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


@template("times_more", 2)
def _times_more(c: Ctx, ph: int) -> Draft:
    pa, pb, it = c.person(), c.person(), c.noun(ITEMS)
    x, k = c.ri(2, 30), c.ri(2, 6)
    d = Draft()
    if ph == 0:
        d.sents.append(f"{pa.name} has {x} {it.many}. {pb.name} has {k} times as many {it.many} as {pa.name}.")
        d.ask = f"How many more {it.many} does {pb.name} have than {pa.name}?"
    else:
        d.sents.append(f"{pb.name} collected {k} times as many {it.many} as {pa.name}, who collected {x}.")
        d.ask = f"How many more {it.many} did {pb.name} collect?"
    a, b = d.num(pa.name.lower(), x), d.num("times", k)
    e = d.calc(pb.name.lower(), f"{a} * {b}")
    return d.done(d.calc("more", f"{e} - {a}"), x * k - x)


@template("friends_total", 2)
def _friends_total(c: Ctx, ph: int) -> Draft:
    pa, pb, pc, it = c.person(), c.person(), c.person(), c.noun(ITEMS)
    x, more = c.ri(3, 30), c.ri(2, 15)
    d = Draft()
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


@template("fence", 2)
def _fence(c: Ctx, ph: int) -> Draft:
    p = c.person()
    length, width, per_m = c.ri(5, 40), c.ri(3, 30), c.ri(2, 12)
    d = Draft()
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


@template("bed_plants", 2)
def _bed_plants(c: Ctx, ph: int) -> Draft:
    p = c.person()
    length, width, k = c.ri(2, 10), c.ri(2, 8), c.ri(2, 6)
    d = Draft()
    if ph == 0:
        it = Noun("tulip", "tulips")
        d.sents.append(f"{p.name} has a flower bed {length} meters long and {width} meters wide. "
                       f"{p.He} plants {k} tulips in each square meter.")
        d.ask = f"How many tulips does {p.name} plant?"
    else:
        it = Noun("seed", "seeds")
        d.sents.append(f"A garden plot is {length} m by {width} m, and {p.name} puts {k} seeds "
                       f"in every square meter.")
        d.ask = f"How many seeds does {p.he} use?"
    a, b, e = d.num("length", length), d.num("width", width), d.num("per_sq_m", k)
    area = d.calc("area", f"{a} * {b}")
    total = length * width * k
    if ph == 0:  # the planted tulips are Mia's to give away or sell
        return d.done(d.calc(it.many, f"{area} * {e}"), total, "count", p, it)
    return d.done(d.calc(it.many, f"{area} * {e}"), total)


@template("uncovered", 2)
def _uncovered(c: Ctx, ph: int) -> Draft:
    p = c.person()
    big_l, big_w = c.ri(6, 20), c.ri(5, 15)
    small_l, small_w = c.ri(2, big_l - 1), c.ri(2, big_w - 1)
    d = Draft()
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


@template("recipe", 2)
def _recipe(c: Ctx, ph: int) -> Draft:
    p = c.person()
    x, y, m = c.ri(2, 6), c.ri(2, 12) * 2, c.ri(2, 6)
    z = y * m
    d = Draft()
    if ph == 0:
        it = c.noun(BAKED)
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


@template("pages_left", 2)
def _pages_left(c: Ctx, ph: int) -> Draft:
    p = c.person()
    per, days = c.ri(5, 30), c.ri(2, 10)
    pages = per * days + c.ri(5, 200)
    d = Draft()
    if ph == 0:
        d.sents.append(f"{p.name}'s book has {pages} pages. {p.He} reads {per} pages a day for {days} days.")
        d.ask = "How many pages are left to read?"
    else:
        d.sents.append(f"A novel has {pages} pages and {p.name} reads {per} pages every day.")
        d.ask = f"How many pages are left after {days} days?"
    a, b, e = d.num("pages", pages), d.num("per_day", per), d.num("days", days)
    r = d.calc("read", f"{b} * {e}")
    return d.done(d.calc("left", f"{a} - {r}"), pages - per * days)


@template("bus", 2)
def _bus(c: Ctx, ph: int) -> Draft:
    start = c.ri(10, 50)
    off1, on1 = c.ri(2, start - 2), c.ri(2, 20)
    mid = start - off1 + on1
    off2 = c.ri(2, mid - 1)
    d = Draft()
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


@template("pack_sell", 2)
def _pack_sell(c: Ctx, ph: int) -> Draft:
    p = c.person()
    k, boxes, price = c.ri(4, 12), c.ri(2, 15), c.ri(3, 20)
    total = k * boxes
    d = Draft()
    if ph == 0:
        it = c.noun(FRUIT)
        d.sents.append(f"{p.name} picks {total} {it.many} and packs them in boxes of {k}. "
                       f"{p.He} sells each box for ${price}.")
        d.ask = f"How much money does {p.name} make?"
        names = ("per_box", "boxes")
    else:
        it = c.noun(BAKED)
        d.sents.append(f"{p.name} bakes {total} {it.many} and puts {k} in each bag. Each bag sells for ${price}.")
        d.ask = f"How much does {p.he} earn by selling every bag?"
        d.fact = f"{p.He} sells every bag."
        names = ("per_bag", "bags")
    a, b, e = d.num(it.many, total), d.num(names[0], k), d.num("price", price)
    n = d.calc(names[1], f"{a} // {b}")
    return d.done(d.calc("money", f"{n} * {e}"), boxes * price, "money", p)


@template("ribbon", 2)
def _ribbon(c: Ctx, ph: int) -> Draft:
    p = c.person()
    meters, piece = c.ri(2, 12), c.pick((10, 20, 25, 50))
    pieces = meters * 100 // piece
    d = Draft()
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


# ------------------------------------------------------------------ templates 26-40 (level 'hard')

@template("practice", 2)
def _practice(c: Ctx, ph: int) -> Draft:
    p = c.person()
    while True:  # total minutes must be whole hours; most draws succeed quickly
        minutes, days, weeks = c.pick((10, 15, 20, 30, 45, 60, 90)), c.ri(2, 7), c.ri(2, 8)
        if minutes * days * weeks % 60 == 0:
            break
    d = Draft()
    if ph == 0:
        d.sents.append(f"{p.name} practices the piano for {minutes} minutes a day, {days} days a week.")
        d.ask = f"How many hours does {p.he} practice in {weeks} weeks?"
    else:
        d.sents.append(f"{p.name} jogs for {minutes} minutes a day on {days} days of each week.")
        d.ask = f"How many hours does {p.he} jog over {weeks} weeks?"
    a, b, e = d.num("minutes", minutes), d.num("days", days), d.num("weeks", weeks)
    t = d.calc("total_min", f"{a} * {b} * {e}")
    return d.done(d.calc("hours", f"{t} // 60"), minutes * days * weeks // 60)


@template("tank", 2)
def _tank(c: Ctx, ph: int) -> Draft:
    rate, minutes, have = c.ri(2, 20), c.ri(2, 30), c.ri(0, 100)
    cap = have + rate * minutes
    d = Draft()
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


@template("use_daily", 2)
def _use_daily(c: Ctx, ph: int) -> Draft:
    p, it = c.person(), c.noun(FOOD)
    per, days, more = c.ri(2, 6), c.ri(2, 7), c.ri(2, 12)
    have = per * days + c.ri(1, 30)
    d = Draft()
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


@template("profit", 2)
def _profit(c: Ctx, ph: int) -> Draft:
    p, g = c.person(), c.noun(GOODS)
    n, cost = c.ri(3, 20), c.ri(2, 15)
    price = cost + c.ri(1, 10)
    d = Draft()
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


@template("average", 2)
def _average(c: Ctx, ph: int) -> Draft:
    p = c.person()
    lo, hi = (50, 98) if ph == 0 else (2, 40)
    a, b, e = c.ri(lo, hi), c.ri(lo, hi), c.ri(lo, hi)
    e += -(a + b + e) % 3  # make the sum divisible by three
    d = Draft()
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


@template("coins", 2)
def _coins(c: Ctx, ph: int) -> Draft:
    p = c.person()
    q, dm, nk = c.ri(2, 12), c.ri(2, 15), c.ri(2, 15)
    d = Draft()
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


@template("legs", 3)
def _legs(c: Ctx, ph: int) -> Draft:
    p = c.person()
    x, y = c.ri(2, 30), c.ri(2, 30)
    two, four = _LEGS[ph]
    d = Draft()
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


@template("rows_eaten", 2)
def _rows_eaten(c: Ctx, ph: int) -> Draft:
    p, it = c.person(), c.noun(VEG)
    rows, per = c.ri(2, 10), c.ri(3, 15)
    lost = c.ri(1, rows * per - 1)
    d = Draft()
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


@template("budget", 2)
def _budget(c: Ctx, ph: int) -> Draft:
    p = c.person()
    income, pct = 100 * c.ri(10, 50), c.pick((10, 20, 25, 30, 40, 50))
    rest = income - income * pct // 100
    food = 10 * c.ri(5, min(50, rest // 10))
    d = Draft()
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


@template("growth", 2)
def _growth(c: Ctx, ph: int) -> Draft:
    p = c.person()
    height, per, n = c.ri(10, 200), c.ri(2, 30), c.ri(2, 10)
    d = Draft()
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


@template("tickets", 2)
def _tickets(c: Ctx, ph: int) -> Draft:
    p = c.person()
    adult = c.ri(8, 20)
    child, na, nc = c.ri(3, adult - 1), c.ri(2, 4), c.ri(2, 6)
    d = Draft()
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


@template("trip_days", 2)
def _trip_days(c: Ctx, ph: int) -> Draft:
    p = c.person()
    weeks, days, per = c.ri(1, 3), c.ri(1, 6), 5 * c.ri(4, 30)
    d = Draft()
    if ph == 0:
        d.sents.append(f"{p.name} goes on a trip for {pl(weeks, 'week')} and {pl(days, 'day')}. "
                       f"{p.He} spends ${per} each day.")
        d.ask = f"How much does the trip cost {p.him}?"
    else:
        d.sents.append(f"A hotel charges ${per} per night. {p.name} stays {pl(weeks, 'week')} "
                       f"and {pl(days, 'night')}.")
        d.ask = "How much does the stay cost?"
    b, e = d.num("weeks", weeks), d.num("days", days)
    a = d.num("per_day", per)
    t = d.calc("total_days", f"{b} * 7 + {e}")
    return d.done(d.calc("cost", f"{t} * {a}"), (weeks * 7 + days) * per, "cost", p)


@template("factory", 2)
def _factory(c: Ctx, ph: int) -> Draft:
    per, hours = c.ri(5, 50), c.ri(2, 10)
    bad = c.ri(1, per * hours - 1)
    d = Draft()
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


@template("allowance", 2)
def _allowance(c: Ctx, ph: int) -> Draft:
    p = c.person()
    weekly, weeks = c.ri(5, 30), c.ri(2, 10)
    spent = c.ri(1, weekly - 1)
    d = Draft()
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


@template("unit_price", 2)
def _unit_price(c: Ctx, ph: int) -> Draft:
    p, g = c.person(), c.noun(GOODS)
    pack, unit, want = c.ri(2, 12), c.ri(1, 9), c.ri(2, 30)
    cost = pack * unit
    d = Draft()
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
