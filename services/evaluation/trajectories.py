"""Trajectory-level diagnostics from the messages: tool-call parsing, tool-selection accuracy,
and backtracking (did an earlier choice become a dead end, and did the agent revise it?).

The paper names backtracking as the open problem: an agent commits to a city or a leg, a later
search shows the choice cannot work (no accommodation there, no flight that day, no road), and
a good agent goes back and changes it. Definitions used here:

- a *choice* is a city or a leg (A → B, with the date for flights) the agent commits to by
  searching for it (accommodation/restaurants/attractions in a city, a flight or a distance);
- a *dead end* is a search that comes back empty: no accommodation in a city (the night cannot
  be spent there), no flight on a leg and date, no driving route on a leg;
- it is a dead end *of an earlier choice* when that city/leg was committed at an earlier step
  than the empty answer (a first-sight miss needs no backtracking);
- it is *revised* when the final plan no longer uses it (the city is not visited; the leg is not
  flown / driven), or, with no plan, when later calls turned to another city or mode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from services.common.schemas import TravelQuery

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_RESPONSE = re.compile(r"^<tool_response>\n?(.*?)</tool_response>\s*$", re.DOTALL)
_PAREN = re.compile(r"\(.*?\)")

REQUIRED = {
    "SearchFlight": ("departure", "destination", "date"),
    "GoogleDistanceMatrix": ("departure", "destination"),
    "SearchAccommodation": ("city",),
    "SearchRestaurant": ("city",),
    "SearchAttraction": ("city",),
    "SearchCity": ("state",),
}
CITY_TOOLS = ("SearchAccommodation", "SearchRestaurant", "SearchAttraction")

# "nothing found" texts of both tool dialects (spec travelplanner.md §3.3; services/sandbox/tools)
_NO_FLIGHT = ("There is no available flight", "There is no flight from")
_NO_STAY = ("There is no accommodation in",)
_NO_ROUTE = ("No valid information", "no valid information", "cannot find the distance", "exceeds a single day")


@dataclass
class Call:
    step: int  # 1-based model turn that made the call
    name: str | None  # None: the JSON did not parse
    arguments: dict[str, Any]
    response: str | None = None
    error: str | None = None


def tool_calls(messages: Sequence[dict[str, Any]]) -> list[Call]:
    """Every tool call of a trajectory with the response that followed it."""
    calls: list[Call] = []
    step = 0
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        step += 1
        structured = message.get("tool_calls")  # families whose templates render calls from it (Llama, Mistral)
        match = _TOOL_CALL.search(message.get("content") or "")
        if not match and not structured:
            continue
        call = Call(step=step, name=None, arguments={})
        try:
            payload = structured[0]["function"] if structured else json.loads(match.group(1).strip())
            call.name = str(payload["name"])
            args = payload.get("arguments", {})
            call.arguments = args if isinstance(args, dict) else {}
            if not isinstance(args, dict):
                call.error = "arguments are not an object"
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            call.error = f"unreadable tool call: {exc}"
        if i + 1 < len(messages) and messages[i + 1].get("role") in ("user", "tool"):
            found = _RESPONSE.match(messages[i + 1].get("content") or "")
            call.response = found.group(1) if found else messages[i + 1].get("content")
        calls.append(call)
    return calls


def _city(value: Any) -> str:
    return _PAREN.sub("", str(value)).strip()


# ---- tool selection --------------------------------------------------------------------------


def tool_selection(
    query: TravelQuery, calls: Sequence[Call], city_state: dict[str, str] | None = None
) -> dict[str, Any]:
    """Per-call accuracy against what a plan for this query needs (what the oracle planner looks
    up): well-formed (known tool, required arguments) and needed (not a repeat of an earlier
    identical call; a flight's date is one of the trip's dates; every city is the origin or the
    destination, or on a 5/7-day trip a city of the destination state per `city_state`; SearchCity
    asks for the destination state). Without `city_state`, cities of 5/7-day trips pass."""
    seen: set[str] = set()
    well_formed = needed = 0
    for call in calls:
        ok = (
            call.error is None
            and call.name in REQUIRED
            and all(isinstance(call.arguments.get(p), str) and call.arguments[p].strip() for p in REQUIRED[call.name])
        )
        well_formed += ok
        if not ok:
            continue
        key = json.dumps([call.name, call.arguments], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        args = call.arguments
        useful = True
        if call.name == "SearchFlight" and args["date"].strip() not in query.date:
            useful = False
        cities = [_city(args[p]) for p in ("departure", "destination", "city") if p in args]
        if query.days == 3:
            useful = useful and all(c in (query.org, query.dest) for c in cities)
        elif city_state is not None:
            useful = useful and all(c == query.org or city_state.get(c) == query.dest for c in cities)
        if call.name == "SearchCity" and query.days != 3:
            useful = useful and args["state"].strip() == query.dest
        needed += useful
    n = len(calls)
    return {
        "calls": n,
        "well_formed": well_formed,
        "needed": needed,
        "well_formed_rate": 100.0 * well_formed / n if n else None,
        "accuracy": 100.0 * needed / n if n else None,
    }


# ---- backtracking ----------------------------------------------------------------------------


@dataclass
class DeadEnd:
    kind: str  # "city" (no accommodation) | "flight" (no flight that day) | "driving" (no route)
    key: str  # the city, or "A -> B [date]"
    observed_step: int
    committed_step: int | None  # first earlier step that committed to it; None: first sight
    revised: bool

    @property
    def earlier_choice(self) -> bool:
        return self.committed_step is not None and self.committed_step < self.observed_step


@dataclass
class PlanShape:
    cities: set[str] = field(default_factory=set)
    # (A, B) → [(date of that day or None, "flight" | "driving" | "other")]
    legs: dict[tuple[str, str], list[tuple[str | None, str]]] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: Sequence[dict[str, Any]] | None, dates: Sequence[str] = ()) -> PlanShape | None:
        if plan is None:
            return None
        shape = cls()
        for i, day in enumerate(plan):
            if not isinstance(day, dict) or not day:
                continue
            current = str(day.get("current_city") or "")
            match = re.search(r"from\s+(.+?)\s+to\s+([^,]+)", current)
            if match:
                a, b = _city(match.group(1)), _city(match.group(2))
                shape.cities |= {a, b}
                text = str(day.get("transportation") or "").lower()
                mode = "flight" if "flight" in text else "driving" if ("driv" in text or "taxi" in text) else "other"
                shape.legs.setdefault((a, b), []).append((dates[i] if i < len(dates) else None, mode))
            elif current.strip() and current.strip() != "-":
                shape.cities.add(_city(current))
        return shape

    def uses(self, a: str, b: str, mode: str, date: str | None = None) -> bool:
        """Does the plan travel A → B by `mode` (on `date`, when given)?"""
        return any(m == mode and (date is None or d is None or d == date) for d, m in self.legs.get((a, b), []))


def _committed(calls: Sequence[Call]) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """First step at which each city and each leg was searched."""
    cities: dict[str, int] = {}
    legs: dict[tuple[str, str], int] = {}
    for call in calls:
        args = call.arguments
        if call.name in CITY_TOOLS and isinstance(args.get("city"), str):
            cities.setdefault(_city(args["city"]), call.step)
        elif (
            call.name in ("SearchFlight", "GoogleDistanceMatrix")
            and isinstance(args.get("destination"), str)
            and isinstance(args.get("departure"), str)
        ):
            a, b = _city(args["departure"]), _city(args["destination"])
            cities.setdefault(b, call.step)
            legs.setdefault((a, b), call.step)
    return cities, legs


def dead_ends(query: TravelQuery, calls: Sequence[Call], plan: Sequence[dict[str, Any]] | None) -> list[DeadEnd]:
    shape = PlanShape.of(plan, query.date)
    committed_cities, committed_legs = _committed(calls)
    out: list[DeadEnd] = []
    seen: set[tuple[str, str]] = set()
    for call in calls:
        text = call.response or ""
        args = call.arguments
        if call.name == "SearchAccommodation" and text.startswith(_NO_STAY):
            city = _city(args.get("city", ""))
            if ("city", city) in seen or city == query.org:
                continue
            seen.add(("city", city))
            first = committed_cities.get(city)
            later = [
                c
                for c in calls
                if c.step > call.step
                and c.name in CITY_TOOLS
                and _city(c.arguments.get("city", "")) not in (city, query.org)
            ]
            revised = (city not in shape.cities) if shape is not None else bool(later)
            out.append(
                DeadEnd("city", city, call.step, first if first is not None and first < call.step else None, revised)
            )
        elif call.name in ("SearchFlight", "GoogleDistanceMatrix"):
            empty = text.startswith(_NO_FLIGHT) if call.name == "SearchFlight" else text.startswith(_NO_ROUTE)
            if not empty:
                continue
            a, b = _city(args.get("departure", "")), _city(args.get("destination", ""))
            kind = "flight" if call.name == "SearchFlight" else "driving"
            key = f"{a} -> {b}" + (f" {args.get('date', '')}" if kind == "flight" else "")
            if (kind, key) in seen:
                continue
            seen.add((kind, key))
            first = min(
                (s for s in (committed_legs.get((a, b)), committed_cities.get(b)) if s is not None and s < call.step),
                default=None,
            )
            if shape is not None:
                revised = not shape.uses(a, b, kind, str(args.get("date", "")).strip() if kind == "flight" else None)
            else:
                revised = any(
                    c.step > call.step
                    and c.name in ("SearchFlight", "GoogleDistanceMatrix")
                    and (c.name != call.name or c.arguments != call.arguments)
                    for c in calls
                )
            out.append(DeadEnd(kind, key, call.step, first, revised))
    return out


def backtracking_summary(items: Sequence[tuple[bool, list[DeadEnd]]]) -> dict[str, Any]:
    """(succeeded, dead ends) per trajectory → the rates the report shows."""
    n = len(items)
    failed = [d for ok, d in items if not ok]
    earlier = [e for _, d in items for e in d if e.earlier_choice]
    all_ends = [e for _, d in items for e in d]
    return {
        "trajectories": n,
        "with_dead_end": sum(bool(d) for _, d in items),
        "dead_ends": len(all_ends),
        "dead_ends_of_earlier_choices": len(earlier),
        "revised_rate": 100.0 * sum(e.revised for e in earlier) / len(earlier) if earlier else None,
        "first_sight_revised_rate": (
            100.0
            * sum(e.revised for e in all_ends if not e.earlier_choice)
            / max(1, sum(not e.earlier_choice for e in all_ends))
        )
        if all_ends
        else None,
        "failed_trajectories": len(failed),
        "failed_with_earlier_dead_end": sum(any(e.earlier_choice for e in d) for d in failed),
        "failed_with_unrevised_dead_end": sum(any(not e.revised for e in d) for d in failed),
        "by_kind": {k: sum(e.kind == k for e in earlier) for k in ("city", "flight", "driving")},
    }


def dead_end_dicts(ends: Sequence[DeadEnd]) -> list[dict[str, Any]]:
    return [asdict(e) | {"earlier_choice": e.earlier_choice} for e in ends]
