"""Base templates 26-40 of the catalogue (only level 'hard' and custom levels draw them)."""

from __future__ import annotations

from blockgen.harness.data.wordproblems.drafting import Ctx, Draft, TemplateFn, registry
from blockgen.harness.data.wordproblems.vocabulary import FOOD, GOODS, VEG, pl

TABLE: dict[str, tuple[int, TemplateFn]] = {}  # name -> (number of phrasings, template), in catalogue order
template = registry(TABLE)


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
