"""The 8 commonsense checks, in both modes (spec travelplanner.md §6.3).

Official functions read the raw day dicts exactly as the official evaluator does, quirks
included; an input on which the official code raises makes the corresponding Python
operation raise here too, and the caller turns that into a failed verdict. Strict functions
read the normalised `StrictDay`s and never raise.
"""

from __future__ import annotations

from services.reward.evaluator.context import Context, Verdict, short
from services.reward.evaluator.parsing import (
    FILLER_CITY,
    before_paren,
    from_to,
    leg_endpoints,
    name_city,
    official_transport_kind,
    present,
    run_lengths,
    strict_flight_number,
    strict_times,
    valid_city_sequence,
)
from services.reward.evaluator.plan import MEALS, PLAN_FIELDS, StrictDay

OK: Verdict = (True, "")

# key → paper name, in the order the official evaluator reports them
COMMONSENSE_CHECKS: dict[str, str] = {
    "is_reasonable_visiting_city": "Reasonable City Route",
    "is_valid_restaurants": "Diverse Restaurants",
    "is_valid_attractions": "Diverse Attractions",
    "is_valid_accommodation": "Minimum Nights Stay",
    "is_valid_transportation": "Non-conf. Transportation",
    "is_valid_information_in_current_city": "Within Current City",
    "is_valid_information_in_sandbox": "Within Sandbox",
    "is_not_absent": "Complete Information",
}


# =============================================================================================
# official mode
# =============================================================================================


def _official_route_cities(ctx: Context) -> tuple[list[str], Verdict | None]:
    """City list of §6.3-A (both cities of a travel day, the city of a stay day); a verdict
    when day 1 departs from somewhere other than the origin."""
    cities: list[str] = []
    for i in range(ctx.n):
        value = ctx.day(i)["current_city"]
        if "from" in value:
            a, b = from_to(value)
            a, b = before_paren(a), before_paren(b)
            if i == 0 and a != ctx.query.org:
                return cities, (False, f"day 1 departs from {a!r}, not from the origin {ctx.query.org!r}")
            cities += [a, b]
        else:
            cities.append(before_paren(value))
    return cities, None


def official_route(ctx: Context) -> Verdict:
    cities, verdict = _official_route_cities(ctx)
    if verdict:
        return verdict
    return route_shape(ctx, cities, exact_destination=False)


def route_shape(ctx: Context, cities: list[str], *, exact_destination: bool) -> Verdict:
    """A closed loop through known cities, inside the destination state on 5/7-day trips;
    with `exact_destination` (strict), a 3-day trip must visit the destination city itself."""
    q = ctx.query
    if cities[0] != cities[-1]:
        return False, f"the route starts in {cities[0]!r} but ends in {cities[-1]!r}, not a closed loop"
    if not valid_city_sequence(cities):
        return False, f"the city sequence {cities} revisits a city or stays in one for a single entry"
    state_of = ctx.index.city_state
    last = len(cities) - 1
    for idx, city in enumerate(cities):
        if city not in state_of:
            return False, f"{city!r} is not a city of the database"
        if 0 < idx < last:
            if q.days > 3 and state_of[city] != q.dest:
                return False, f"{city!r} is in {state_of[city]}, not in {q.dest}"
            if exact_destination and q.days == 3 and city != q.dest:
                return False, f"the trip visits {city!r}, but the destination is {q.dest!r}"
    return OK


def official_restaurants(ctx: Context) -> Verdict:
    seen: list = []
    for i in range(ctx.n):
        unit = ctx.day(i)
        for meal in MEALS:
            if meal in unit and present(unit[meal]):
                if unit[meal] in seen:
                    return False, f"day {i + 1} {meal} {short(unit[meal])} repeats an earlier meal"
                seen.append(unit[meal])
    return OK


def official_attractions(ctx: Context) -> Verdict:
    seen: list = []
    for i in range(ctx.n):
        unit = ctx.day(i)
        if "attraction" in unit and present(unit["attraction"]):
            for item in unit["attraction"].split(";")[:-1]:  # the last item is dropped (quirk §8.2-2)
                if item in seen:
                    return False, f"day {i + 1} attraction {short(item)} was already visited"
                seen.append(item)
    return OK


def official_min_nights(ctx: Context) -> Verdict:
    values = []
    for i in range(ctx.n):
        unit = ctx.day(i)
        if "accommodation" not in unit:
            return False, f"day {i + 1} has no accommodation field"
        values.append(unit["accommodation"])
    ctx.cursor = None
    for value, nights in run_lengths(values):
        if value not in ("-", ""):
            name, city = name_city(value)
            rows = ctx.index.accommodations_containing(name, city)
            # checked only when exactly one row matches (quirk §8.2-8)
            if len(rows) == 1 and nights < rows[0].minimum_nights:
                return False, (
                    f"{short(value)} is booked for {nights} night(s) in a row but requires "
                    f"at least {rows[0].minimum_nights:g}"
                )
    return OK


def official_transport_conflict(ctx: Context) -> Verdict:
    first = ctx.day(0)["transportation"]
    if not present(first):
        return False, "day 1 has no transportation"
    kinds = [official_transport_kind(first)]
    for i in range(ctx.n):
        unit = ctx.day(i)
        if "transportation" in unit and present(unit["transportation"]):
            kinds.append(official_transport_kind(unit["transportation"]))
    if "Self-driving" in kinds and "Flight" in kinds:
        return False, "the trip mixes self-driving and flights"
    if "Self-driving" in kinds and "Taxi" in kinds:
        return False, "the trip mixes self-driving and taxis"
    return OK


def official_current_city(ctx: Context) -> Verdict:
    for i in range(ctx.n):
        unit = ctx.day(i)
        value = unit["current_city"]
        if "from" in value:
            a, b = from_to(value)
            cities = [before_paren(a), before_paren(b)]
        else:
            # a plain string: the loops below walk its characters (quirk §8.2-3)
            cities = before_paren(value)
        where = f"day {i + 1} ({short(value, 50)})"
        if "transportation" in unit and present(unit["transportation"]):
            for city in cities:
                if city not in unit["transportation"]:
                    return False, f"{where}: transportation {short(unit['transportation'])} does not mention {city!r}"
        for meal in MEALS:
            if meal in unit and present(unit[meal]) and not any(city in unit[meal] for city in cities):
                return False, f"{where}: {meal} {short(unit[meal])} is not in the day's cities"
        if "attraction" in unit and present(unit["attraction"]):
            for item in unit["attraction"].split(";")[:-1]:
                if not any(city in item for city in cities):
                    return False, f"{where}: attraction {short(item)} is not in the day's cities"
        if "accommodation" in unit and present(unit["accommodation"]) and cities[-1] not in unit["accommodation"]:
            return False, f"{where}: accommodation {short(unit['accommodation'])} is not in {cities[-1]!r}"
    return OK


def official_sandbox(ctx: Context) -> Verdict:
    idx = ctx.index
    for i in range(ctx.n):
        unit = ctx.day(i)
        value = unit["transportation"]
        if present(value):
            o, d = leg_endpoints(value, unit["current_city"])
            low = value.lower()
            if "flight number" in low:
                o, d = before_paren(o), before_paren(d)  # unparseable → TypeError (a crash)
                number = value.split("Flight Number: ")[1].split(",")[0]  # no literal → IndexError
                if not any(f.origin == o and f.dest == d for f in idx.flights_numbered(number)):
                    return False, f"day {i + 1}: no flight {number!r} from {o!r} to {d!r} in the sandbox"
            elif "self-driving" in low or "taxi" in low:
                try:
                    o, d = before_paren(o), before_paren(d)
                except TypeError:
                    o, d = "-", "-"
                mode = "self-driving" if "self-driving" in low else "taxi"
                if idx.leg_cost(before_paren(o), before_paren(d), mode) is None:
                    return False, f"day {i + 1}: the sandbox has no {mode} route from {o!r} to {d!r}"
        for meal in MEALS:
            if meal in unit and present(unit[meal]):
                name, city = name_city(unit[meal])
                if not idx.restaurants_containing(name, city):
                    return False, f"day {i + 1} {meal}: no restaurant {short(unit[meal])} in the sandbox"
        if "attraction" in unit and present(unit["attraction"]):
            for item in unit["attraction"].split(";")[:-1]:
                name, city = name_city(item)
                if not idx.attractions_containing(name, city):
                    return False, f"day {i + 1}: no attraction {short(item)} in the sandbox"
        if "accommodation" in unit and present(unit["accommodation"]):
            name, city = name_city(unit["accommodation"])
            if not idx.accommodations_containing(name, city):
                return False, f"day {i + 1}: no accommodation {short(unit['accommodation'])} in the sandbox"
    return OK


def _official_city_count(ctx: Context) -> bool:
    cities: set[str] = set()
    for i in range(ctx.n):
        value = ctx.day(i)["current_city"]
        if "from" in value:
            a, b = from_to(value)
            a, b = before_paren(a), before_paren(b)
            if i == 0 and a != ctx.query.org:
                return False
            cities.update((a, b))
        else:
            cities.add(before_paren(value))
    cities.discard(ctx.query.org)
    return len(cities) == ctx.query.visiting_city_number


def official_complete(ctx: Context) -> Verdict:
    q = ctx.query
    counted = sum(1 for i in range(ctx.n) if ctx.day(i) != {} and ctx.days[i]["current_city"] != FILLER_CITY)
    if counted != q.days:
        return False, f"the plan has {counted} filled day(s), the query asks for {q.days}"
    if not _official_city_count(ctx):
        return False, f"the plan does not visit exactly {q.visiting_city_number} city(ies) besides the origin"
    filled = 0
    for i in range(ctx.n):
        unit = ctx.day(i)
        for key in PLAN_FIELDS:
            if key not in unit:
                return False, f"day {i + 1} has no {key} field"
        cc = unit["current_city"]
        if ("from " in cc or "to " in cc) and unit["transportation"] in ("", "-"):
            return False, f"day {i + 1} is a travel day without transportation"
        if "from " not in cc and " to " not in cc and unit["attraction"] in ("", "-"):
            return False, f"day {i + 1} is a stay day without an attraction"
        if i != q.days - 1 and unit["accommodation"] in ("", "-"):
            return False, f"day {i + 1} has no accommodation"
        if "from " not in cc and any(unit[m] in ("", "-") for m in MEALS):
            return False, f"day {i + 1} is a stay day without all three meals"
        filled += sum(1 for key in unit if present(unit[key]))
    ctx.cursor = None
    if filled / (6 * q.days) < 0.5:
        return False, f"only {filled} of {6 * q.days} fields are filled (under 50%)"
    return OK


OFFICIAL = {
    "is_reasonable_visiting_city": official_route,
    "is_valid_restaurants": official_restaurants,
    "is_valid_attractions": official_attractions,
    "is_valid_accommodation": official_min_nights,
    "is_valid_transportation": official_transport_conflict,
    "is_valid_information_in_current_city": official_current_city,
    "is_valid_information_in_sandbox": official_sandbox,
    "is_not_absent": official_complete,
}


# =============================================================================================
# strict mode
# =============================================================================================


def strict_route(ctx: Context) -> Verdict:
    q, days = ctx.query, ctx.strict
    first = days[0]
    if not first.travel:
        return False, f"day 1 ({first.current_city!r}) is not a travel day from the origin {q.org!r}"
    if first.travel[0] != q.org:
        return False, f"day 1 departs from {first.travel[0]!r}, not from the origin {q.org!r}"
    cities: list[str] = []
    for day in days:
        if day.travel:
            cities += day.travel
        else:
            cities.append(day.city or "")
    return route_shape(ctx, cities, exact_destination=True)


def strict_restaurants(ctx: Context) -> Verdict:
    seen: dict[str, int] = {}
    for day in ctx.strict:
        for meal in MEALS:
            entry = day.meals.get(meal)
            if entry is None:
                continue
            if entry.key in seen:
                return False, f"day {day.number} {meal} {short(entry.raw)} repeats the meal of day {seen[entry.key]}"
            seen[entry.key] = day.number
    return OK


def strict_attractions(ctx: Context) -> Verdict:
    seen: dict[str, int] = {}
    for day in ctx.strict:
        for entry in day.attractions:
            if entry.key in seen:
                return (
                    False,
                    f"day {day.number} attraction {short(entry.raw)} was already visited on day {seen[entry.key]}",
                )
            seen[entry.key] = day.number
    return OK


def strict_min_nights(ctx: Context) -> Verdict:
    keys = [day.accommodation.key if day.accommodation else None for day in ctx.strict]
    entries = {day.accommodation.key: day.accommodation for day in ctx.strict if day.accommodation}
    for key, nights in run_lengths(keys):
        if key is None:
            continue
        entry = entries[key]
        if entry.name is None:
            continue  # unreadable: Within Sandbox reports it
        rows = ctx.index.exact("accommodations", entry.name, entry.city)
        if rows and all(nights < r.minimum_nights for r in rows):
            need = min(r.minimum_nights for r in rows)
            return False, f"{short(entry.raw)} is booked for {nights} night(s) in a row but requires at least {need:g}"
    return OK


def strict_transport_conflict(ctx: Context) -> Verdict:
    if not ctx.strict[0].transportation:
        return False, "day 1 has no transportation"
    kinds: set[str] = set()
    for day in ctx.strict:
        kinds |= day.kinds
    if "self-driving" in kinds and "flight" in kinds:
        return False, "the trip mixes self-driving and flights"
    if "self-driving" in kinds and "taxi" in kinds:
        return False, "the trip mixes self-driving and taxis"
    return OK


def _entry_city_problem(day: StrictDay, label: str, entry, allowed: tuple[str, ...]) -> str | None:
    if entry.city is None:
        return f"day {day.number} {label} {short(entry.raw)} does not name its city"
    if entry.city not in allowed:
        where = " or ".join(repr(c) for c in allowed) or "no readable city"
        return f"day {day.number} {label} {short(entry.raw)} is in {entry.city!r}, not in {where}"
    return None


def strict_current_city(ctx: Context) -> Verdict:
    for day in ctx.strict:
        allowed = day.cities
        if day.travel:
            if day.transportation and day.leg and day.leg != day.travel:
                return False, (
                    f"day {day.number} travels from {day.travel[0]!r} to {day.travel[1]!r} but its "
                    f"transportation goes from {day.leg[0]!r} to {day.leg[1]!r}"
                )
        elif day.transportation:
            return False, f"day {day.number} stays in {day.city!r} but lists transportation {short(day.transportation)}"
        for meal in MEALS:
            entry = day.meals.get(meal)
            if entry is not None and (problem := _entry_city_problem(day, meal, entry, allowed)):
                return False, problem
        state_of = ctx.index.city_state
        for entry in day.attractions:
            if (
                not day.travel
                and day.city in state_of
                and entry.city in state_of
                and state_of[entry.city] == state_of[day.city]
            ):
                continue  # a day trip to another city of the same state (as gold plan train #41 does)
            if problem := _entry_city_problem(day, "attraction", entry, allowed):
                return False, problem
        if day.accommodation is not None and (
            problem := _entry_city_problem(day, "accommodation", day.accommodation, allowed[-1:])
        ):
            return False, problem
    return OK


def strict_leg(ctx: Context, day: StrictDay) -> tuple[str | None, str | None, object | None]:
    """(kind, problem, matched flight row) of a day's transportation in the sandbox."""
    text = day.transportation or ""
    if len(day.kinds) != 1:
        what = "names no known transport mode" if not day.kinds else f"mixes {sorted(day.kinds)}"
        return None, f"day {day.number} transportation {short(text)} {what}", None
    kind = next(iter(day.kinds))
    route = day.leg or day.travel
    if route is None:
        return kind, f"day {day.number} transportation {short(text)} has no 'from A to B'", None
    o, d = route
    if kind == "flight":
        number = strict_flight_number(text)
        if number is None:
            return kind, f"day {day.number} flight {short(text)} has no flight number", None
        rows = [f for f in ctx.index.flights_numbered(number) if f.origin == o and f.dest == d]
        if not rows:
            return kind, f"day {day.number}: no flight {number} from {o!r} to {d!r} in the sandbox", None
        date = ctx.query.date[day.number - 1] if day.number <= len(ctx.query.date) else None
        dated = [f for f in rows if f.flight_date == date]
        if not dated:
            return kind, f"day {day.number}: flight {number} flies on {rows[0].flight_date}, not on {date}", None
        dep, arr = strict_times(text)
        timed = [f for f in dated if (dep is None or f.dep_time == dep) and (arr is None or f.arr_time == arr)]
        if not timed:
            f = dated[0]
            return (
                kind,
                (
                    f"day {day.number}: flight {number} departs {f.dep_time} and arrives {f.arr_time}, "
                    f"not {dep or '-'} / {arr or '-'} as written"
                ),
                None,
            )
        return kind, None, timed[0]
    if ctx.index.leg_cost(o, d, kind) is None:
        return kind, f"day {day.number}: the sandbox has no {kind} route from {o!r} to {d!r}", None
    return kind, None, None


def strict_sandbox(ctx: Context) -> Verdict:
    idx = ctx.index
    for day in ctx.strict:
        if day.transportation:
            _, problem, _ = strict_leg(ctx, day)
            if problem:
                return False, problem
        for meal in MEALS:
            entry = day.meals.get(meal)
            if entry is not None and not (entry.name and idx.exact("restaurants", entry.name, entry.city)):
                return False, f"day {day.number} {meal}: no restaurant named exactly {short(entry.raw)} in the sandbox"
        for entry in day.attractions:
            if not (entry.name and idx.exact("attractions", entry.name, entry.city)):
                return False, f"day {day.number}: no attraction named exactly {short(entry.raw)} in the sandbox"
        acc = day.accommodation
        if acc is not None and not (acc.name and idx.exact("accommodations", acc.name, acc.city)):
            return False, f"day {day.number}: no accommodation named exactly {short(acc.raw)} in the sandbox"
    return OK


def strict_complete(ctx: Context) -> Verdict:
    q, days = ctx.query, ctx.strict
    for day in days:
        if day.problems:
            return False, day.problems[0]
    counted = sum(1 for d in days if not d.empty)
    if counted != q.days:
        return False, f"the plan has {counted} filled day(s), the query asks for {q.days}"
    if ctx.extra:
        return False, f"the plan has content after its last day (day {ctx.extra[0]})"
    cities: set[str] = set()
    for day in days:
        cities.update(day.cities or ("",))
    cities.discard(q.org)
    if len(cities) != q.visiting_city_number:
        return (
            False,
            f"the plan visits {len(cities)} city(ies) besides the origin, the query asks for {q.visiting_city_number}",
        )
    filled = 0
    for i, day in enumerate(days):
        if day.travel and not day.transportation:
            return False, f"day {day.number} is a travel day without transportation"
        if not day.travel and not day.attractions:
            return False, f"day {day.number} is a stay day without an attraction"
        if i != q.days - 1 and day.accommodation is None:
            return False, f"day {day.number} has no accommodation"
        if not day.travel and any(day.meals.get(m) is None for m in MEALS):
            return False, f"day {day.number} is a stay day without all three meals"
        filled += day.present_fields
    if filled / (6 * q.days) < 0.5:
        return False, f"only {filled} of {6 * q.days} plan fields are filled (under 50%)"
    return OK


STRICT = {
    "is_reasonable_visiting_city": strict_route,
    "is_valid_restaurants": strict_restaurants,
    "is_valid_attractions": strict_attractions,
    "is_valid_accommodation": strict_min_nights,
    "is_valid_transportation": strict_transport_conflict,
    "is_valid_information_in_current_city": strict_current_city,
    "is_valid_information_in_sandbox": strict_sandbox,
    "is_not_absent": strict_complete,
}
