"""An in-memory index of the travel world, built once, for the oracle planner and the samplers.

It reads the same SQL tables the tools and the evaluator read, with the same visibility rules
(only `visible` rows; the first row of a duplicated distance pair), and keeps exactly the
attributes the strict evaluator judges a plan by:

- venues are keyed by their whitespace-normalised name within a city; when a name repeats, the
  first row in table order supplies price, cuisines, room type and rules (the evaluator reads
  `rows[0]` of the exact match), and the *smallest* minimum-nights of the rows decides the
  Minimum Nights check (it fails only when every such row needs more nights);
- flights keep, per (origin, destination, date), the cheapest flight (first in table order on a
  tie) and how many flights fly that leg;
- driving and taxi costs per vehicle come from `distance_cost`, the evaluator's own function.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import select

from services.reward.evaluator.parsing import distance_cost, norm_ws
from services.sandbox.world import schema
from services.sandbox.world.rows import Flight
from services.sandbox.world.store import World


@dataclass(frozen=True)
class Stay:
    """An accommodation as the evaluator sees it."""

    name: str  # whitespace-normalised, as written in a plan
    city: str
    price: float  # per night per unit
    room_type: str
    house_rules: str
    occupancy: int
    min_nights: float

    def units(self, people: int) -> int:
        return -(-people // self.occupancy)

    def night_cost(self, people: int) -> float:
        return self.price * self.units(people)


@dataclass(frozen=True)
class Eatery:
    name: str
    city: str
    cost: int  # per person per meal
    cuisines: frozenset[str]


@dataclass(frozen=True)
class Road:
    """A usable distance row: duration and distance text, cost per vehicle by mode."""

    origin: str
    destination: str
    duration: str
    distance: str
    drive: int  # per car (5 people)
    taxi: int  # per taxi (4 people)


@dataclass
class CityInfo:
    city: str
    state: str
    searchable: bool
    stays: list[Stay] = field(default_factory=list)  # by price, cheapest first (ties: table order)
    eateries: list[Eatery] = field(default_factory=list)  # by cost, cheapest first
    sights: list[str] = field(default_factory=list)  # attraction names, table order
    meal_prefix: list[int] = field(default_factory=lambda: [0])  # sum of the k cheapest meals


class SynthIndex:
    """Everything the oracle reads, in dictionaries. Build with `SynthIndex.build(world)`."""

    def __init__(self) -> None:
        self.cities: dict[str, CityInfo] = {}
        self.state_cities: dict[str, list[str]] = defaultdict(list)
        self.roads: dict[tuple[str, str], Road] = {}
        self.flights: dict[tuple[str, str, str], tuple[tuple, int]] = {}  # cheapest row, count
        self.flight_dates: list[str] = []
        self.build_seconds: float = 0.0

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def build(cls, world: World) -> SynthIndex:
        t0 = time.perf_counter()
        ix = cls()
        with world.engine.connect() as conn:
            ix._load_cities(conn)
            ix._load_stays(conn)
            ix._load_eateries(conn)
            ix._load_sights(conn)
            ix._load_roads(conn)
            ix._load_flights(conn)
        ix.build_seconds = time.perf_counter() - t0
        return ix

    def _load_cities(self, conn) -> None:
        c = schema.cities.c
        for city, state, searchable in conn.execute(select(c.city, c.state, c.searchable).order_by(c.id)):
            self.cities[city] = CityInfo(city, state, bool(searchable))
            self.state_cities[state].append(city)

    def _load_stays(self, conn) -> None:
        a = schema.accommodations.c
        rows = conn.execute(
            select(a.name, a.price, a.room_type, a.house_rules, a.minimum_nights, a.maximum_occupancy, a.city)
            .where(a.visible.is_(True))
            .order_by(a.id)
        )
        first: dict[tuple[str, str], list] = {}
        for name, price, room, rules, min_nights, occ, city in rows:
            if city not in self.cities:
                continue  # a city outside the city set cannot be on a route
            key = (city, norm_ws(name))
            if key in first:
                first[key][6] = min(first[key][6], float(min_nights))
            else:
                first[key] = [key[1], city, float(price), room, rules, int(occ), float(min_nights)]
        for values in first.values():
            self.cities[values[1]].stays.append(Stay(*values))
        for info in self.cities.values():
            info.stays.sort(key=lambda s: s.price)  # stable: table order breaks ties

    def _load_eateries(self, conn) -> None:
        r = schema.restaurants.c
        rows = conn.execute(
            select(r.name, r.average_cost, r.cuisines, r.city).where(r.visible.is_(True)).order_by(r.id)
        )
        seen: set[tuple[str, str]] = set()
        for name, cost, cuisines, city in rows:
            key = (city, norm_ws(name))
            if city not in self.cities or key in seen:
                continue
            seen.add(key)
            labels = frozenset(x.strip() for x in cuisines.split(","))
            self.cities[city].eateries.append(Eatery(key[1], city, int(cost), labels))
        for info in self.cities.values():
            info.eateries.sort(key=lambda e: e.cost)
            prefix = [0]
            for e in info.eateries:
                prefix.append(prefix[-1] + e.cost)
            info.meal_prefix = prefix

    def _load_sights(self, conn) -> None:
        t = schema.attractions.c
        seen: set[tuple[str, str]] = set()
        for name, city in conn.execute(select(t.name, t.city).where(t.visible.is_(True)).order_by(t.id)):
            key = (city, norm_ws(name))
            if city in self.cities and key not in seen and ";" not in name:
                seen.add(key)
                self.cities[city].sights.append(key[1])

    def _load_roads(self, conn) -> None:
        d = schema.distances.c
        seen: set[tuple[str, str]] = set()
        for origin, dest, duration, distance in conn.execute(
            select(d.origin, d.destination, d.duration, d.distance).order_by(d.id)
        ):
            if (origin, dest) in seen:
                continue  # the first row of a pair is the one the tools and the evaluator read
            seen.add((origin, dest))
            if duration is None or distance is None:
                continue
            drive = distance_cost(distance, duration, "self-driving")
            taxi = distance_cost(distance, duration, "taxi")
            if drive is None or taxi is None:
                continue
            self.roads[(origin, dest)] = Road(origin, dest, duration, distance, drive, taxi)

    def _load_flights(self, conn) -> None:
        """The cheapest flight and the number of flights of every (origin, dest, date)."""
        columns = "flight_number, price, dep_time, arr_time, elapsed, flight_date, origin, dest, distance"
        cursor = conn.connection.dbapi_connection.cursor()
        best: dict[tuple[str, str, str], tuple[tuple, int]] = {}
        if conn.dialect.name == "sqlite":
            # SQLite fills bare columns from the row holding the min(); the route index makes
            # this one ordered pass (ties: the lowest id, i.e. table order).
            cursor.execute(
                f"SELECT {columns}, min(price), count(*) FROM flights WHERE visible GROUP BY origin, dest, flight_date"
            )
            for row in cursor.fetchall():
                best[(row[6], row[7], row[5])] = (row[:9], row[10])
        else:
            cursor.execute(f"SELECT {columns} FROM flights WHERE visible ORDER BY id")
            scan: dict[tuple[str, str, str], list] = {}
            while rows := cursor.fetchmany(100_000):
                for row in rows:
                    key = (row[6], row[7], row[5])
                    current = scan.get(key)
                    if current is None:
                        scan[key] = [row, 1]
                    else:
                        current[1] += 1
                        if row[1] < current[0][1]:
                            current[0] = row
            best = {k: (tuple(v[0]), v[1]) for k, v in scan.items()}
        cursor.close()
        self.flights = best
        self.flight_dates = sorted({k[2] for k in best})

    # --- lookups ------------------------------------------------------------------------------
    def state_of(self, city: str) -> str | None:
        info = self.cities.get(city)
        return info.state if info else None

    def flight(self, origin: str, dest: str, date: str) -> Flight | None:
        hit = self.flights.get((origin, dest, date))
        return Flight(*hit[0]) if hit else None

    def flight_count(self, origin: str, dest: str, date: str) -> int:
        hit = self.flights.get((origin, dest, date))
        return hit[1] if hit else 0

    def road(self, origin: str, dest: str) -> Road | None:
        return self.roads.get((origin, dest))

    def stats(self) -> dict[str, int | float]:
        return {
            "cities": len(self.cities),
            "states": len(self.state_cities),
            "roads": len(self.roads),
            "flight_legs": len(self.flights),
            "flight_dates": len(self.flight_dates),
            "build_seconds": round(self.build_seconds, 3),
        }
