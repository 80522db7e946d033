"""What a plan may be on input, and the strict mode's normalised view of it.

`coerce_plan` accepts a `Plan`, a JSON array of day objects, `{"days": [...]}` (the JSON form of
`Plan`), or nothing. A falsy value (None, [], {}, "") is an undelivered plan, as the official
`eval.py` reads it. Anything else that is not an array of days is a `PlanError`: the official
evaluator would crash on it. Elements of the array are kept as they are (the official checks
read raw dicts; odd elements make individual checks fail, see `checks`).

`strict_days` turns the raw list into typed `StrictDay`s, recording each structural problem
(a day that is not an object, a missing key, a value that is not text) instead of failing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.schemas import Plan
from services.reward.evaluator.parsing import (
    FILLER_CITY,
    norm_ws,
    strict_city,
    strict_leg_route,
    strict_name_city,
    strict_transport_kinds,
    strict_travel,
)

PLAN_FIELDS = ("transportation", "breakfast", "attraction", "lunch", "dinner", "accommodation")
MEALS = ("breakfast", "lunch", "dinner")
MAX_FIELD_CHARS = 4000  # far above any real value; bounds the cost of the official regexes
MAX_DAYS = 64


class PlanError(ValueError):
    """The input cannot be read as a plan at all (a clear message for a 4xx)."""


def coerce_plan(plan: Any) -> list | None:
    """The raw day list of a plan, or None when nothing was delivered."""
    if isinstance(plan, Plan):
        return [d.model_dump() for d in plan.days] or None
    if not plan:
        return None
    if isinstance(plan, dict) and set(plan) == {"days"} and isinstance(plan["days"], list):
        plan = plan["days"]
        if not plan:
            return None
    if isinstance(plan, tuple):
        plan = list(plan)
    if not isinstance(plan, list):
        raise PlanError(f"a plan must be a JSON array of day objects, not {type(plan).__name__}")
    return plan


def check_sizes(days: list, n: int) -> None:
    """Reject values too large to be plan text (bounded work per plan)."""
    for i, day in enumerate(days[:n]):
        if isinstance(day, dict):
            for key in ("current_city", *PLAN_FIELDS):
                value = day.get(key)
                if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
                    raise PlanError(f"day {i + 1} {key} has {len(value)} characters (limit {MAX_FIELD_CHARS})")


# --- strict view --------------------------------------------------------------------------------


@dataclass
class Entry:
    """One "Name, City" value (a meal, an attraction item, an accommodation)."""

    raw: str
    name: str | None
    city: str | None

    @property
    def key(self) -> str:
        """Identity for repetition checks: the parsed (name, city), else the raw text."""
        return f"{self.name}\x00{self.city}" if self.name is not None else self.raw


@dataclass
class StrictDay:
    number: int  # 1-based
    empty: bool  # {} padding or the official "You don't need to fill ..." filler
    current_city: str  # whitespace-normalised text ('' when missing)
    travel: tuple[str, str] | None  # (A, B) of "from A to B"
    city: str | None  # the stay city of a non-travel day
    transportation: str | None  # None when absent ('-', '', None)
    kinds: set[str] = field(default_factory=set)
    leg: tuple[str, str] | None = None  # "from A to B" written in the transportation text
    meals: dict[str, Entry | None] = field(default_factory=dict)
    attractions: list[Entry] = field(default_factory=list)
    accommodation: Entry | None = None
    problems: list[str] = field(default_factory=list)
    present_fields: int = 0  # of the six plan fields

    @property
    def cities(self) -> tuple[str, ...]:
        if self.travel:
            return self.travel
        return (self.city,) if self.city else ()


def _text(day: dict, key: str, number: int, problems: list[str]) -> str | None:
    """The value as text; None when absent. Records a problem for a missing key or a non-text."""
    if key not in day:
        problems.append(f"day {number} has no {key}")
        return None
    value = day[key]
    if value is None:
        return None
    if not isinstance(value, str):
        problems.append(f"day {number} {key} is a {type(value).__name__}, not text")
        return None
    value = norm_ws(value)
    return None if value in ("", "-") else value


def _entry(text: str) -> Entry:
    parsed = strict_name_city(text)
    return Entry(text, *(parsed or (None, None)))


def strict_day(raw: Any, number: int) -> StrictDay:
    problems: list[str] = []
    if isinstance(raw, dict):
        empty = raw == {} or (isinstance(raw.get("current_city"), str) and raw["current_city"].strip() == FILLER_CITY)
    else:
        problems.append(f"day {number} is a {type(raw).__name__}, not an object")
        raw, empty = {}, False
    cc = raw.get("current_city")
    if not empty:
        if "current_city" not in raw:
            problems.append(f"day {number} has no current_city")
        elif not isinstance(cc, str):
            problems.append(f"day {number} current_city is a {type(cc).__name__}, not text")
    cc = norm_ws(cc) if isinstance(cc, str) else ""
    travel = strict_travel(cc)
    day = StrictDay(
        number=number,
        empty=empty,
        current_city=cc,
        travel=travel,
        city=None if travel else (strict_city(cc) or None),
        transportation=None,
        problems=problems,
    )
    if empty:
        return day
    day.transportation = _text(raw, "transportation", number, problems)
    if day.transportation:
        day.kinds = strict_transport_kinds(day.transportation)
        day.leg = strict_leg_route(day.transportation)
    for meal in MEALS:
        text = _text(raw, meal, number, problems)
        day.meals[meal] = _entry(text) if text else None
    attraction = _text(raw, "attraction", number, problems)
    if attraction:
        day.attractions = [_entry(item) for item in (norm_ws(x) for x in attraction.split(";")) if item]
    acc = _text(raw, "accommodation", number, problems)
    day.accommodation = _entry(acc) if acc else None
    day.present_fields = sum(x is not None for x in (day.transportation, attraction, acc, *day.meals.values()))
    return day


def _has_content(raw: Any) -> bool:
    """A day after the last one that says something (not padding, filler or all '-')."""
    if not raw:
        return False
    if not isinstance(raw, dict):
        return True
    for key, value in raw.items():
        if key in ("day", "days"):
            continue
        if isinstance(value, str):
            text = value.strip()
            if text and text != "-" and text != FILLER_CITY:
                return True
        elif value:
            return True
    return False


def strict_days(days: Sequence[Any], n_days: int) -> tuple[list[StrictDay], list[int]]:
    """(the first `n_days` days, normalised; the 1-based numbers of later days with content)."""
    evaluated = [strict_day(d, i + 1) for i, d in enumerate(days[:n_days])]
    extra = [n_days + 1 + i for i, raw in enumerate(days[n_days:MAX_DAYS]) if _has_content(raw)]
    return evaluated, extra
