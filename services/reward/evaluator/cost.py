"""Total cost of a plan for the Budget check (spec travelplanner.md §6.5).

P = people. Flights: price × P; self-driving: per-car cost × ceil(P/5); taxi: per-taxi cost ×
ceil(P/4); each meal: average cost × P; each day naming an accommodation: nightly price ×
ceil(P / maximum occupancy). Attractions are free; costs written in the plan are ignored.

Official: names match by substring (first row), a flight is priced by its number alone, a leg
without a parseable "from A to B" costs 0, and a transport text without the exact keywords
("Drive ...") costs 0. Strict: the rows the strict checks validated (exact names; the flight of
that number, route and date) and the normalised transport mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.reward.evaluator.commonsense import strict_leg
from services.reward.evaluator.context import Context
from services.reward.evaluator.parsing import before_paren as _bp, leg_endpoints, name_city, present
from services.reward.evaluator.plan import MEALS


@dataclass
class CostBreakdown:
    total: float = 0.0
    items: list[tuple[int, str, float]] = field(default_factory=list)  # (day, what, amount)

    def add(self, day: int, what: str, amount: float) -> None:
        self.total += amount
        self.items.append((day, what, amount))


def official_cost(ctx: Context) -> CostBreakdown:
    idx, people = ctx.index, ctx.query.people_number
    out = CostBreakdown()
    for i in range(ctx.n):
        unit = ctx.day(i)
        value = unit["transportation"]
        if present(value):
            o, d = leg_endpoints(value, unit["current_city"])
            if o is not None and d is not None:
                low = value.lower()
                if "flight number" in low:
                    rows = idx.flights_numbered(value.split("Flight Number: ")[1].split(",")[0])
                    if rows:
                        out.add(i + 1, f"flight {rows[0].flight_number}", rows[0].price * people)
                elif "self-driving" in low:
                    cost = idx.leg_cost(_bp(o), _bp(d), "self-driving")
                    out.add(i + 1, "self-driving", cost * math.ceil(people / 5))  # None → TypeError
                elif "taxi" in low:
                    cost = idx.leg_cost(_bp(o), _bp(d), "taxi")
                    out.add(i + 1, "taxi", cost * math.ceil(people / 4))
        for meal in MEALS:
            if present(unit[meal]):
                rows = idx.restaurants_containing(*name_city(unit[meal]))
                if rows:
                    out.add(i + 1, meal, rows[0].average_cost * people)
        if present(unit["accommodation"]):
            rows = idx.accommodations_containing(*name_city(unit["accommodation"]))
            if rows:
                out.add(i + 1, "accommodation", rows[0].price * math.ceil(people / rows[0].maximum_occupancy))
    ctx.cursor = None
    return out


def strict_cost(ctx: Context) -> CostBreakdown:
    idx, people = ctx.index, ctx.query.people_number
    out = CostBreakdown()
    for day in ctx.strict:
        if day.transportation:
            kind, problem, flight = strict_leg(ctx, day)
            if problem is None:
                if kind == "flight" and flight is not None:
                    out.add(day.number, f"flight {flight.flight_number}", flight.price * people)
                elif kind in ("self-driving", "taxi"):
                    o, d = day.leg or day.travel  # type: ignore[misc]
                    per = 5 if kind == "self-driving" else 4
                    out.add(day.number, kind, (idx.leg_cost(o, d, kind) or 0) * math.ceil(people / per))
        for meal in MEALS:
            entry = day.meals.get(meal)
            if entry is not None and entry.name:
                rows = idx.exact("restaurants", entry.name, entry.city)
                if rows:
                    out.add(day.number, meal, rows[0].average_cost * people)
        acc = day.accommodation
        if acc is not None and acc.name:
            rows = idx.exact("accommodations", acc.name, acc.city)
            if rows:
                out.add(day.number, "accommodation", rows[0].price * math.ceil(people / rows[0].maximum_occupancy))
    return out
