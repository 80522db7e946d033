"""The 5 hard constraints, in both modes (spec travelplanner.md §6.4).

Each returns (None, reason) when the query does not ask for it; Budget always applies. They are
run only when Complete Information and Within Sandbox passed (the caller gates them).
"""

from __future__ import annotations

from services.reward.evaluator.context import Context, Verdict, short
from services.reward.evaluator.cost import official_cost, strict_cost
from services.reward.evaluator.parsing import name_city, present
from services.reward.evaluator.plan import MEALS

OK: Verdict = (True, "")
NOT_ASKED: Verdict = (None, "the query does not ask for it")

# key → paper name, in the order the official evaluator reports them
HARD_CHECKS: dict[str, str] = {
    "valid_cuisine": "Cuisine",
    "valid_room_rule": "Room Rule",
    "valid_transportation": "Transportation",
    "valid_room_type": "Room Type",
    "valid_cost": "Budget",
}

_RULE_TEXT = {
    "smoking": "No smoking",
    "parties": "No parties",
    "children under 10": "No children under 10",
    "visitors": "No visitors",
    "pets": "No pets",
}
_ROOM_OK = {
    "not shared room": lambda t: t != "Shared room",
    "shared room": lambda t: t == "Shared room",
    "private room": lambda t: t == "Private room",
    "entire room": lambda t: t == "Entire home/apt",
}


def applicable(ctx: Context) -> dict[str, bool]:
    """Which hard constraints the query asks for (the per-query hard-micro denominator)."""
    lc = ctx.query.local_constraint
    return {
        "valid_cuisine": bool(lc.cuisine),
        "valid_room_rule": lc.house_rule is not None,
        "valid_transportation": lc.transportation is not None,
        "valid_room_type": lc.room_type is not None,
        "valid_cost": True,
    }


def _missing_cuisine(required: list[str], covered: set[str]) -> Verdict:
    for cuisine in required:
        if cuisine not in covered:
            found = ", ".join(sorted(covered)) or "none of them"
            return False, f"no meal outside the origin serves {cuisine} (covered: {found})"
    return OK


def _rule_verdict(rule: str, house_rules: str, day: int, acc: str, typo: bool) -> Verdict | None:
    if rule == "parties" and typo:
        return None  # the historic 'parities' typo: the parties rule never fails
    if _RULE_TEXT[rule] in house_rules:
        return False, f"day {day} accommodation {short(acc)} has the rule '{_RULE_TEXT[rule]}'"
    return None


# --- official -----------------------------------------------------------------------------------


def official_cuisine(ctx: Context) -> Verdict:
    required = ctx.query.local_constraint.cuisine
    if not required:
        return NOT_ASKED
    covered: set[str] = set()
    for i in range(ctx.n):
        unit = ctx.day(i)
        for meal in MEALS:
            if present(unit[meal]):
                name, city = name_city(unit[meal])
                if city == ctx.query.org:
                    break  # the official `continue` skips the rest of the day's meals (quirk §8.2-7)
                rows = ctx.index.restaurants_containing(name, city)
                if rows:
                    covered.update(c for c in required if c in rows[0].cuisines)
    ctx.cursor = None
    return _missing_cuisine(required, covered)


def official_room_rule(ctx: Context) -> Verdict:
    rule = ctx.query.local_constraint.house_rule
    if rule is None:
        return NOT_ASKED
    for i in range(ctx.n):
        unit = ctx.day(i)
        if present(unit["accommodation"]):
            rows = ctx.index.accommodations_containing(*name_city(unit["accommodation"]))
            if rows and (
                v := _rule_verdict(rule, str(rows[0].house_rules), i + 1, unit["accommodation"], ctx.parties_typo)
            ):
                return v
    return OK


def official_transport_pref(ctx: Context) -> Verdict:
    pref = ctx.query.local_constraint.transportation
    if pref is None:
        return NOT_ASKED
    word = {"no flight": "Flight", "no self-driving": "Self-driving"}[pref]
    for i in range(ctx.n):
        value = ctx.day(i)["transportation"]
        if present(value) and word in value:  # case-sensitive (quirk §8.2-6)
            return False, f"day {i + 1} uses {word.lower()} ({short(value)}), but the query says {pref}"
    return OK


def official_room_type(ctx: Context) -> Verdict:
    wanted = ctx.query.local_constraint.room_type
    if wanted is None:
        return NOT_ASKED
    for i in range(ctx.n):
        unit = ctx.day(i)
        if present(unit["accommodation"]):
            rows = ctx.index.accommodations_containing(*name_city(unit["accommodation"]))
            if rows and not _ROOM_OK[wanted](rows[0].room_type):
                return (
                    False,
                    f"day {i + 1} accommodation {short(unit['accommodation'])} is a {rows[0].room_type}, not a {wanted}",
                )
    return OK


def official_budget(ctx: Context) -> Verdict:
    ctx.cost = official_cost(ctx).total
    return _budget_verdict(ctx.cost, ctx.query.budget)


def _budget_verdict(total: float, budget: int) -> Verdict:
    if total <= budget:
        return True, f"total cost {total:g} is within the budget of {budget}"
    return False, f"total cost {total:g} exceeds the budget of {budget}"


OFFICIAL = {
    "valid_cuisine": official_cuisine,
    "valid_room_rule": official_room_rule,
    "valid_transportation": official_transport_pref,
    "valid_room_type": official_room_type,
    "valid_cost": official_budget,
}


# --- strict -------------------------------------------------------------------------------------


def _strict_accommodations(ctx: Context):
    for day in ctx.strict:
        acc = day.accommodation
        if acc is not None and acc.name:
            rows = ctx.index.exact("accommodations", acc.name, acc.city)
            if rows:
                yield day.number, acc.raw, rows[0]


def strict_cuisine(ctx: Context) -> Verdict:
    required = ctx.query.local_constraint.cuisine
    if not required:
        return NOT_ASKED
    covered: set[str] = set()
    for day in ctx.strict:
        for meal in MEALS:
            entry = day.meals.get(meal)
            if entry is None or entry.name is None or entry.city == ctx.query.org:
                continue  # only this meal: origin-city meals do not count
            rows = ctx.index.exact("restaurants", entry.name, entry.city)
            if rows:
                labels = {c.strip() for c in rows[0].cuisines.split(",")}
                covered.update(c for c in required if c in labels)
    return _missing_cuisine(required, covered)


def strict_room_rule(ctx: Context) -> Verdict:
    rule = ctx.query.local_constraint.house_rule
    if rule is None:
        return NOT_ASKED
    for number, raw, row in _strict_accommodations(ctx):
        if v := _rule_verdict(rule, row.house_rules, number, raw, False):
            return v
    return OK


def strict_transport_pref(ctx: Context) -> Verdict:
    pref = ctx.query.local_constraint.transportation
    if pref is None:
        return NOT_ASKED
    banned = {"no flight": "flight", "no self-driving": "self-driving"}[pref]
    for day in ctx.strict:
        if banned in day.kinds:
            return False, f"day {day.number} uses {banned} ({short(day.transportation)}), but the query says {pref}"
    return OK


def strict_room_type(ctx: Context) -> Verdict:
    wanted = ctx.query.local_constraint.room_type
    if wanted is None:
        return NOT_ASKED
    for number, raw, row in _strict_accommodations(ctx):
        if not _ROOM_OK[wanted](row.room_type):
            return False, f"day {number} accommodation {short(raw)} is a {row.room_type}, not a {wanted}"
    return OK


def strict_budget(ctx: Context) -> Verdict:
    ctx.cost = strict_cost(ctx).total
    return _budget_verdict(ctx.cost, ctx.query.budget)


STRICT = {
    "valid_cuisine": strict_cuisine,
    "valid_room_rule": strict_room_rule,
    "valid_transportation": strict_transport_pref,
    "valid_room_type": strict_room_type,
    "valid_cost": strict_budget,
}
