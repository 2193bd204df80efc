"""Base templates 11-25 of the catalogue (only level 'hard' and custom levels draw them)."""

from __future__ import annotations

import math

from blockgen.harness.data.wordproblems.drafting import Ctx, Draft, TemplateFn, registry
from blockgen.harness.data.wordproblems.vocabulary import BAKED, BIG_GOODS, FRUIT, ITEMS, Noun

TABLE: dict[str, tuple[int, TemplateFn]] = {}  # name -> (number of phrasings, template), in catalogue order
template = registry(TABLE)

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
