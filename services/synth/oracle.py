"""The oracle planner: the cheapest plan of a query that passes the strict evaluator, or why none does.

Shape of a plan (what the strict checks accept, spec travelplanner.md §6.3): a closed loop
origin → c1 → … → ck → origin with k = 1, 2, 3 cities for 3, 5, 7 days (c1 = the destination
city on a 3-day trip, cities of the destination state otherwise). The trip moves on k + 1
travel days; between them city i gets n_i ≥ 1 nights (Σ n_i = days − 1) and n_i − 1 stay days,
each with three distinct meals and at least one attraction in that city. Travel days may carry
meals too, which only matters to cover cuisines.

Search. The cost splits into legs (which depend on the day a leg is driven or flown) and city
blocks (accommodation for n nights plus the cheapest 3(n − 1) meals). For every night split and
transport family (all self-driving; all taxi; flights mixed with taxis — the non-conflict rule
allows nothing else) the legs and blocks are arrays over the candidate cities, and numpy adds
them into a lower bound for every route at once. Without a cuisine constraint the bound is
exact and the oracle takes the minimum. With one, candidates are scored exactly in increasing
bound order (meal choice with `meals.coverage`/`combine`) until the next bound is no better
than the best exact cost found: cheapest-first branch and bound, still exact.

When nothing fits, the constraints are added back one at a time (route and venues, then
transport, room type, house rule, cuisine, budget) and the first one that leaves no plan is
reported with a message.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from services.common.schemas import Plan, PlanDay, TravelQuery
from services.sandbox.world.rows import Flight
from services.synth import meals as meal_choice
from services.synth.index import Eatery, Road, Stay, SynthIndex

INF = float("inf")
Mode = Literal["flight", "self-driving", "taxi"]
Family = Literal["self-driving", "taxi", "flight+taxi"]
MEAL_SLOTS = ("breakfast", "lunch", "dinner")
ROOM_OK = {
    "not shared room": lambda t: t != "Shared room",
    "shared room": lambda t: t == "Shared room",
    "private room": lambda t: t == "Private room",
    "entire room": lambda t: t == "Entire home/apt",
}
RULE_TEXT = {
    "smoking": "No smoking",
    "parties": "No parties",
    "children under 10": "No children under 10",
    "visitors": "No visitors",
    "pets": "No pets",
}
# The constraint names an infeasibility reason can carry, in the order they are added back.
CONSTRAINTS = (
    "route",
    "accommodation",
    "attractions",
    "restaurants",
    "transportation",
    "room type",
    "house rule",
    "cuisine",
    "budget",
)


# =============================================================================================
# results
# =============================================================================================


@dataclass
class Leg:
    day: int  # 0-based day index
    origin: str
    dest: str
    date: str
    mode: Mode
    cost: float  # for the whole group
    flight: Flight | None = None
    road: Road | None = None

    def text(self) -> str:
        """The transportation value, in the benchmark's conventions (spec §5)."""
        if self.mode == "flight":
            f = self.flight
            return (
                f"Flight Number: {f.flight_number}, from {self.origin} to {self.dest}, "
                f"Departure Time: {f.dep_time}, Arrival Time: {f.arr_time}"
            )
        label, cost = ("Self-driving", self.road.drive) if self.mode == "self-driving" else ("Taxi", self.road.taxi)
        return (
            f"{label}, from {self.origin} to {self.dest}, duration: {self.road.duration}, "
            f"distance: {self.road.distance}, cost: {cost}"
        )


@dataclass
class CityStop:
    city: str
    arrive: int  # 0-based day index of the travel day that brings the group here
    nights: int
    stay: Stay
    meals: list[Eatery]  # three per stay day, in day order
    extras: list[Eatery]  # meals placed on travel days (cuisine coverage)
    sights: list[list[str]]  # attractions per stay day

    @property
    def stay_days(self) -> int:
        return self.nights - 1


@dataclass
class Solution:
    query: TravelQuery
    legs: list[Leg]
    stops: list[CityStop]
    cost: float
    breakdown: dict[str, float]
    travel_meals: dict[int, list[Eatery]] = field(default_factory=dict)  # day index → meals on that travel day
    travel_sights: dict[int, list[tuple[str, str]]] = field(default_factory=dict)  # day → (name, city)

    @property
    def route(self) -> list[str]:
        return [s.city for s in self.stops]

    def day_dicts(self) -> list[dict[str, Any]]:
        """The plan as the benchmark's day dicts."""
        q = self.query
        by_day = {leg.day: leg for leg in self.legs}
        days: list[dict[str, Any]] = []
        for t in range(q.days):
            stop = self._stop_on(t)
            day = {
                "day": t + 1,
                "current_city": "",
                "transportation": "-",
                "breakfast": "-",
                "attraction": "-",
                "lunch": "-",
                "dinner": "-",
                "accommodation": "-",
            }
            if t in by_day:
                leg = by_day[t]
                day["current_city"] = f"from {leg.origin} to {leg.dest}"
                day["transportation"] = leg.text()
                # arrival-day meals read best late in the day, home-day meals early
                slots = MEAL_SLOTS if t == q.days - 1 else tuple(reversed(MEAL_SLOTS))
                for slot, e in zip(slots, self.travel_meals.get(t, [])):
                    day[slot] = f"{e.name}, {e.city}"
                sights = self.travel_sights.get(t)
                if sights:
                    day["attraction"] = "".join(f"{name}, {city};" for name, city in sights)
            else:
                k = t - stop.arrive - 1  # the k-th stay day in this city
                day["current_city"] = stop.city
                for slot, e in zip(MEAL_SLOTS, stop.meals[3 * k : 3 * k + 3]):
                    day[slot] = f"{e.name}, {e.city}"
                day["attraction"] = "".join(f"{name}, {stop.city};" for name in stop.sights[k])
            if stop is not None and t < q.days - 1:
                day["accommodation"] = f"{stop.stay.name}, {stop.city}"
            days.append(day)
        return days

    def _stop_on(self, t: int) -> CityStop | None:
        """The city whose accommodation the night after day t belongs to."""
        for stop in self.stops:
            if stop.arrive <= t < stop.arrive + stop.nights:
                return stop
        return None

    def plan(self) -> Plan:
        return Plan(days=[PlanDay(**d) for d in self.day_dicts()])


@dataclass
class OracleResult:
    query: TravelQuery
    feasible: bool
    solution: Solution | None = None
    constraint: str | None = None  # which constraint has no solution (one of CONSTRAINTS)
    reason: str | None = None
    routes: int = 0  # route × night-split × transport-family candidates with a finite bound
    evaluated: int = 0  # candidates scored exactly (cuisine constraint)
    seconds: float = 0.0

    @property
    def cost(self) -> float | None:
        return self.solution.cost if self.solution else None

    def summary(self) -> dict[str, Any]:
        return {
            "feasible": self.feasible,
            "cost": self.cost,
            "constraint": self.constraint,
            "reason": self.reason,
            "route": self.solution.route if self.solution else None,
            "routes": self.routes,
            "evaluated": self.evaluated,
            "seconds": round(self.seconds, 4),
        }


class NoPlan(Exception):
    """Raised inside the search with the constraint that left nothing and why."""

    def __init__(self, constraint: str, reason: str) -> None:
        super().__init__(reason)
        self.constraint = constraint
        self.reason = reason


@dataclass(frozen=True)
class Active:
    """Which of the query's constraints a search honours (for finding the one that fails)."""

    transportation: bool = True
    room_type: bool = True
    house_rule: bool = True
    cuisine: bool = True


ALL = Active()
RELAXATIONS: tuple[tuple[str, Active], ...] = (
    ("route", Active(False, False, False, False)),
    ("transportation", Active(True, False, False, False)),
    ("room type", Active(True, True, False, False)),
    ("house rule", Active(True, True, True, False)),
    ("cuisine", ALL),
)


# =============================================================================================
# the solver
# =============================================================================================


def night_splits(days: int, cities: int, even_only: bool = False) -> list[tuple[int, ...]]:
    """Nights per city: compositions of days − 1 into `cities` parts ≥ 1 (the gold plans' even
    two-nights-each split first)."""
    total = days - 1
    even = tuple([total // cities] * cities) if total % cities == 0 else None
    if even_only:
        return [even] if even else []
    out = [c for c in _compositions(total, cities)]
    if even in out:
        out.remove(even)
        out.insert(0, even)
    return out


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


class Oracle:
    """Cheapest strict-valid plans over a `SynthIndex`.

    even_nights: only the gold plans' split (2 nights per city) instead of every split.
    single_unit: require one unit to house the whole group (max occupancy ≥ people) instead of
    the evaluator's cost model (ceil(people / occupancy) units at the nightly price).
    sights_per_day: attractions listed per stay day (at least one is required; more when the
    city has enough).
    """

    def __init__(
        self, index: SynthIndex, *, even_nights: bool = False, single_unit: bool = False, sights_per_day: int = 2
    ) -> None:
        self.index = index
        self.even_nights = even_nights
        self.single_unit = single_unit
        self.sights_per_day = max(1, sights_per_day)
        self._coverage_cache: dict[tuple, dict[int, meal_choice.Choice]] = {}

    # --- public -------------------------------------------------------------------------------
    def solve(self, query: TravelQuery, *, budget: float | None = None) -> OracleResult:
        """The cheapest plan of `query` (within `budget`, default the query's own)."""
        t0 = time.perf_counter()
        budget = query.budget if budget is None else budget
        result = OracleResult(query=query, feasible=False)
        try:
            solution = self._search(query, ALL, result)
        except NoPlan:
            solution = None
        if solution is None:
            result.constraint, result.reason = self._diagnose(query)
        elif solution.cost > budget:
            result.solution = solution
            result.constraint = "budget"
            result.reason = f"the cheapest plan costs {solution.cost:g}, over the budget of {budget:g}"
        else:
            result.solution, result.feasible = solution, True
        result.seconds = time.perf_counter() - t0
        return result

    def cheapest(self, query: TravelQuery) -> OracleResult:
        """The cheapest plan ignoring the budget (what synthesis sets budgets from)."""
        return self.solve(query, budget=INF)

    # --- diagnosis ----------------------------------------------------------------------------
    def _diagnose(self, query: TravelQuery) -> tuple[str, str]:
        """Add the constraints back one at a time; the first that leaves no plan is the answer.
        The first step (no local constraints) names what is missing itself: the route,
        accommodation, attractions, restaurants or transportation."""
        previous: str | None = None
        for name, active in RELAXATIONS:
            if not self._applies(query, name):
                continue
            try:
                if self._search(query, active, OracleResult(query=query, feasible=False)) is not None:
                    previous = name
                    continue
                constraint, reason = name, "no combination of route, nights, transport and venues satisfies it"
            except NoPlan as exc:
                constraint, reason = (exc.constraint, exc.reason) if name == "route" else (name, exc.reason)
            if name != "route" and previous not in (None, "route"):
                reason += f" (together with the {previous} constraint)"
            return constraint, reason
        return "route", "no plan found"  # unreachable: the full search failed, so some step fails

    @staticmethod
    def _applies(query: TravelQuery, name: str) -> bool:
        lc = query.local_constraint
        return {
            "route": True,
            "transportation": lc.transportation is not None,
            "room type": lc.room_type is not None,
            "house rule": lc.house_rule is not None,
            "cuisine": bool(lc.cuisine),
        }[name]

    # --- search -------------------------------------------------------------------------------
    def _route_cities(self, q: TravelQuery) -> list[str]:
        ix = self.index
        k = q.visiting_city_number
        if q.days == 3:
            if q.dest not in ix.cities:
                raise NoPlan("route", f"the destination {q.dest!r} is not a city of the database")
            if q.dest == q.org:
                raise NoPlan("route", "the destination is the origin")
            return [q.dest]
        if q.dest not in ix.state_cities:
            raise NoPlan("route", f"the destination {q.dest!r} is not a state of the database")
        cities = [c for c in ix.state_cities[q.dest] if c != q.org]
        if len(cities) < k:
            raise NoPlan("route", f"{q.dest} has {len(cities)} cities to visit, the trip needs {k}")
        return cities

    def _families(self, q: TravelQuery, active: Active) -> list[Family]:
        pref = q.local_constraint.transportation if active.transportation else None
        if pref == "no flight":
            return ["self-driving", "taxi"]
        if pref == "no self-driving":
            return ["flight+taxi"]
        return ["self-driving", "flight+taxi"]

    def _leg(self, family: Family, o: str, d: str, date: str, people: int) -> tuple[float, Mode | None]:
        ix = self.index
        road = ix.road(o, d)
        if family == "self-driving":
            return (road.drive * math.ceil(people / 5), "self-driving") if road else (INF, None)
        taxi = road.taxi * math.ceil(people / 4) if road else INF
        if family == "taxi":
            return (taxi, "taxi") if road else (INF, None)
        flight = ix.flight(o, d, date)
        fly = flight.price * people if flight else INF
        if fly <= taxi:
            return (fly, "flight") if flight else (INF, None)
        return taxi, "taxi"

    def _stays(self, q: TravelQuery, city: str, active: Active) -> list[Stay]:
        lc = q.local_constraint
        room = ROOM_OK[lc.room_type] if active.room_type and lc.room_type else None
        rule = RULE_TEXT[lc.house_rule] if active.house_rule and lc.house_rule else None
        out = []
        for s in self.index.cities[city].stays:
            if room and not room(s.room_type):
                continue
            if rule and rule in s.house_rules:
                continue
            if self.single_unit and s.occupancy < q.people_number:
                continue
            out.append(s)
        return out

    def _best_stay(self, stays: Sequence[Stay], nights: int, people: int) -> Stay | None:
        best, best_cost = None, INF
        for s in stays:
            if s.min_nights <= nights:
                c = s.night_cost(people)
                if c < best_cost:
                    best, best_cost = s, c
        return best

    def _search(self, q: TravelQuery, active: Active, result: OracleResult) -> Solution | None:
        cities = self._route_cities(q)
        k, P = q.visiting_city_number, q.people_number
        splits = night_splits(q.days, k, self.even_nights)
        nights_needed = sorted({n for s in splits for n in s})
        m = len(cities)

        # city blocks: accommodation for n nights + the cheapest 3(n-1) meals; inf when impossible
        block = {n: np.full(m, INF) for n in nights_needed}
        stay_of: dict[tuple[int, int], Stay] = {}
        why = {"accommodation": 0, "attractions": 0, "restaurants": 0}
        for j, city in enumerate(cities):
            info = self.index.cities[city]
            stays = self._stays(q, city, active)
            for n in nights_needed:
                stay = self._best_stay(stays, n, P)
                if stay is None:
                    why["accommodation"] += 1
                    continue
                if len(info.sights) < n - 1:
                    why["attractions"] += 1
                    continue
                if len(info.eateries) < 3 * (n - 1):
                    why["restaurants"] += 1
                    continue
                stay_of[(j, n)] = stay
                block[n][j] = n * stay.night_cost(P) + P * info.meal_prefix[3 * (n - 1)]
        usable = sum(1 for j in range(m) if any(np.isfinite(block[n][j]) for n in nights_needed))
        if usable < k:
            raise NoPlan(*self._venue_reason(q, cities, usable, why, active))

        # legs per transport family, as arrays over the candidate cities
        dates = q.date
        last = q.days - 1
        inner_days = sorted({sum(s[:i]) for s in splits for i in range(1, k)})
        candidates: list[tuple[np.ndarray, Family, tuple[int, ...]]] = []
        for family in self._families(q, active):
            out_leg = np.array([self._leg(family, q.org, c, dates[0], P)[0] for c in cities])
            home_leg = np.array([self._leg(family, c, q.org, dates[last], P)[0] for c in cities])
            mid = {t: self._mid_legs(family, cities, dates[t], P) for t in inner_days}
            for split in splits:
                total = self._route_bounds(split, out_leg, home_leg, mid, block)
                candidates.append((total, family, split))
        flat = np.concatenate([c[0].ravel() for c in candidates]) if candidates else np.array([])
        finite = np.isfinite(flat)
        result.routes += int(finite.sum())
        if not finite.any():
            raise NoPlan("transportation", self._transport_reason(q, cities, active))
        sizes = [c[0].size for c in candidates]
        offsets = np.cumsum([0] + sizes)

        def decode(pos: int) -> tuple[Family, tuple[int, ...], tuple[int, ...]]:
            ci = int(np.searchsorted(offsets, pos, side="right") - 1)
            total, family, split = candidates[ci]
            route = np.unravel_index(pos - offsets[ci], total.shape)
            return family, split, tuple(int(r) for r in route)

        cuisines = list(q.local_constraint.cuisine or []) if active.cuisine else []
        if not cuisines:
            pos = int(np.argmin(flat))
            family, split, route = decode(pos)
            return self._build(q, cities, family, split, route, stay_of, None)

        order = np.argsort(flat, kind="stable")
        best: tuple[float, Any] | None = None
        for pos in order:
            bound = flat[pos]
            if not np.isfinite(bound) or (best is not None and bound >= best[0]):
                break
            family, split, route = decode(int(pos))
            result.evaluated += 1
            picks = self._meal_picks(q, cities, split, route, cuisines)
            if picks is None:
                continue
            extra_cost, choice = picks
            exact = bound + P * extra_cost
            if best is None or exact < best[0]:
                best = (exact, (family, split, route, choice))
        if best is None:
            raise NoPlan("cuisine", f"no route's restaurants cover {', '.join(cuisines)}")
        family, split, route, choice = best[1]
        return self._build(q, cities, family, split, route, stay_of, choice)

    def _mid_legs(self, family: Family, cities: list[str], date: str, people: int) -> np.ndarray:
        m = len(cities)
        out = np.full((m, m), INF)
        for a, o in enumerate(cities):
            for b, d in enumerate(cities):
                if a != b:
                    out[a, b] = self._leg(family, o, d, date, people)[0]
        return out

    @staticmethod
    def _route_bounds(
        split: tuple[int, ...],
        out_leg: np.ndarray,
        home_leg: np.ndarray,
        mid: dict[int, np.ndarray],
        block: dict[int, np.ndarray],
    ) -> np.ndarray:
        """Lower bound (exact without cuisines) of every route for one split, as an array with
        one axis per city of the route; routes repeating a city are inf."""
        k = len(split)
        if k == 1:
            return out_leg + block[split[0]] + home_leg
        t1 = split[0]
        first = out_leg + block[split[0]]
        if k == 2:
            return first[:, None] + mid[t1] + (block[split[1]] + home_leg)[None, :]
        t2 = split[0] + split[1]
        total = (
            first[:, None, None]
            + mid[t1][:, :, None]
            + block[split[1]][None, :, None]
            + mid[t2][None, :, :]
            + (block[split[2]] + home_leg)[None, None, :]
        )
        m = out_leg.size
        eye = np.eye(m, dtype=bool)
        total[eye[:, None, :].repeat(m, axis=1)] = INF  # c1 == c3 (c1 == c2 and c2 == c3 are inf legs)
        return total

    def _extra_slots(self, split: tuple[int, ...]) -> list[int]:
        """Travel-day meal slots per city: its arrival day, and the trip home for the last one."""
        return [3 + (3 if i == len(split) - 1 else 0) for i in range(len(split))]

    def _city_coverage(
        self, city: str, required: int, extra: int, cuisines: Sequence[str]
    ) -> dict[int, meal_choice.Choice]:
        key = (city, required, extra, tuple(cuisines))
        table = self._coverage_cache.get(key)
        if table is None:
            if len(self._coverage_cache) > 200_000:
                self._coverage_cache.clear()
            table = meal_choice.coverage(self.index.cities[city].eateries, required, extra, cuisines)
            self._coverage_cache[key] = table
        return table

    def _meal_picks(
        self, q: TravelQuery, cities: list[str], split: tuple[int, ...], route: tuple[int, ...], cuisines: list[str]
    ) -> tuple[float, list[meal_choice.Choice]] | None:
        """(extra cost per person over the cheapest meals, one choice per city) covering the
        cuisines; None when this route cannot cover them."""
        need = [3 * (n - 1) for n in split]
        infos = [self.index.cities[cities[j]] for j in route]
        # fast path: the cheapest meals already cover every cuisine
        covered = set()
        for info, r in zip(infos, need):
            for e in info.eateries[:r]:
                covered |= e.cuisines
        if all(c in covered for c in cuisines):
            return 0.0, [meal_choice.cheapest(info.eateries, r) for info, r in zip(infos, need)]
        tables = [
            self._city_coverage(info.city, r, x, cuisines) for info, r, x in zip(infos, need, self._extra_slots(split))
        ]
        combined = meal_choice.combine(tables, len(cuisines))
        if combined is None:
            return None
        cost, choice = combined
        base = sum(info.meal_prefix[r] for info, r in zip(infos, need))
        return cost - base, choice

    # --- building the solution ----------------------------------------------------------------
    def _build(
        self,
        q: TravelQuery,
        cities: list[str],
        family: Family,
        split: tuple[int, ...],
        route: tuple[int, ...],
        stay_of: dict[tuple[int, int], Stay],
        choice: list[meal_choice.Choice] | None,
    ) -> Solution:
        P = q.people_number
        names = [cities[j] for j in route]
        days_of_legs = [0] + list(itertools.accumulate(split))
        stops_seq = [q.org, *names, q.org]
        legs: list[Leg] = []
        for i, t in enumerate(days_of_legs):
            o, d = stops_seq[i], stops_seq[i + 1]
            cost, mode = self._leg(family, o, d, q.date[t], P)
            legs.append(
                Leg(
                    day=t,
                    origin=o,
                    dest=d,
                    date=q.date[t],
                    mode=mode,
                    cost=cost,
                    flight=self.index.flight(o, d, q.date[t]) if mode == "flight" else None,
                    road=self.index.road(o, d) if mode != "flight" else None,
                )
            )
        stops: list[CityStop] = []
        for i, (j, n) in enumerate(zip(route, split)):
            info = self.index.cities[cities[j]]
            need = 3 * (n - 1)
            picked = choice[i][1] if choice else tuple(range(need))
            chosen = [info.eateries[x] for x in picked]
            stay_meals, extras = chosen[:need], chosen[need:]
            stay_days = n - 1
            per_day = min(self.sights_per_day, len(info.sights) // stay_days) if stay_days else 0
            sights = [info.sights[d * per_day : (d + 1) * per_day] for d in range(stay_days)]
            stops.append(
                CityStop(
                    city=info.city,
                    arrive=days_of_legs[i],
                    nights=n,
                    stay=stay_of[(j, n)],
                    meals=stay_meals,
                    extras=extras,
                    sights=sights,
                )
            )
        travel_meals: dict[int, list[Eatery]] = {}
        for i, stop in enumerate(stops):
            travel_meals.setdefault(stop.arrive, []).extend(stop.extras[:3])
            if stop.extras[3:]:  # the last city also eats on the way home
                travel_meals.setdefault(q.days - 1, []).extend(stop.extras[3:])
        solution = Solution(query=q, legs=legs, stops=stops, cost=0.0, breakdown={}, travel_meals=travel_meals)
        self._fill_half(solution)
        solution.breakdown = {
            "transport": sum(leg.cost for leg in legs),
            "accommodation": sum(s.nights * s.stay.night_cost(P) for s in stops),
            "meals": P * sum(e.cost for s in stops for e in s.meals)
            + P * sum(e.cost for day in solution.travel_meals.values() for e in day),
        }
        solution.cost = sum(solution.breakdown.values())
        return solution

    def _fill_half(self, sol: Solution) -> None:
        """Complete Information wants half of the 6 × days plan fields filled. Stay days fill 5,
        travel days 2 (1 the last), which falls one short on a 3-day trip: put a free attraction
        on a travel day, else the cheapest meal left in one of its cities."""
        q = sol.query
        filled = 5 * sum(s.stay_days for s in sol.stops) + 2 * len(sol.legs) - 1
        filled += sum(len(m) for m in sol.travel_meals.values())
        filled += sum(1 for v in sol.travel_sights.values() if v)
        for leg in sol.legs:
            if filled >= 3 * q.days:
                return
            if sol.travel_sights.get(leg.day):
                continue
            for stop in sol.stops:
                if stop.city not in (leg.origin, leg.dest):
                    continue
                used = {n for day in stop.sights for n in day}
                spare = [n for n in self.index.cities[stop.city].sights if n not in used]
                if not spare:
                    donor = next((day for day in stop.sights if len(day) > 1), None)
                    spare = [donor.pop()] if donor else []
                if spare:
                    sol.travel_sights[leg.day] = [(spare[0], stop.city)]
                    filled += 1
                    break
        while filled < 3 * q.days:
            meal = self._spare_meal(sol)
            if meal is None:
                return  # cannot happen on real data: every city has more restaurants than meals
            day, eatery = meal
            sol.travel_meals.setdefault(day, []).append(eatery)
            filled += 1

    def _spare_meal(self, sol: Solution) -> tuple[int, Eatery] | None:
        used = {(e.city, e.name) for s in sol.stops for e in s.meals}
        used |= {(e.city, e.name) for day in sol.travel_meals.values() for e in day}
        best: tuple[int, Eatery] | None = None
        for leg in sol.legs:
            if len(sol.travel_meals.get(leg.day, [])) >= 3:
                continue
            for city in (leg.origin, leg.dest):
                for e in self.index.cities[city].eateries:
                    if (e.city, e.name) not in used:
                        if best is None or e.cost < best[1].cost:
                            best = (leg.day, e)
                        break
        return best

    # --- reasons ------------------------------------------------------------------------------
    def _venue_reason(
        self, q: TravelQuery, cities: list[str], usable: int, why: dict[str, int], active: Active
    ) -> tuple[str, str]:
        where = cities[0] if q.days == 3 else f"the cities of {q.dest}"
        lc = q.local_constraint
        kind = max(("accommodation", "attractions", "restaurants"), key=lambda k: why[k])
        if kind == "accommodation":
            wanted = []
            if active.room_type and lc.room_type:
                wanted.append(lc.room_type)
            if active.house_rule and lc.house_rule:
                wanted.append(f"allowing {lc.house_rule}")
            if self.single_unit:
                wanted.append(f"for {q.people_number} people")
            what = f"an accommodation ({', '.join(wanted)})" if wanted else "an accommodation"
            return kind, (
                f"only {usable} of {len(cities)} candidate cities ({where}) offer {what} "
                f"whose minimum stay fits the nights; the trip needs {q.visiting_city_number}"
            )
        return kind, (
            f"only {usable} of {len(cities)} candidate cities ({where}) have enough {kind} "
            f"for the stay days; the trip needs {q.visiting_city_number}"
        )

    def _transport_reason(self, q: TravelQuery, cities: list[str], active: Active) -> str:
        fams = self._families(q, active)
        pref = q.local_constraint.transportation if active.transportation else None
        modes = {"self-driving": "self-driving", "taxi": "taxi", "flight+taxi": "flights or taxis"}
        how = " or ".join(modes[f] for f in fams)
        if not any(self._leg(f, q.org, c, q.date[0], q.people_number)[1] for f in fams for c in cities):
            where = cities[0] if q.days == 3 else f"any city of {q.dest}"
            return f"no way from {q.org} to {where} on {q.date[0]} by {how}" + (f" ({pref})" if pref else "")
        if not any(self._leg(f, c, q.org, q.date[-1], q.people_number)[1] for f in fams for c in cities):
            where = cities[0] if q.days == 3 else f"any city of {q.dest}"
            return f"no way back from {where} to {q.org} on {q.date[-1]} by {how}" + (f" ({pref})" if pref else "")
        return f"no route through {q.dest} connects every leg on its day by {how} (with a consistent mode)" + (
            f" ({pref})" if pref else ""
        )
