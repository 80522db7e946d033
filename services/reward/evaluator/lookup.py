"""Database lookups of the evaluator over a `World`, with in-memory caches.

Each city's rows are read once from the world and kept; name matches, flight numbers and
distance rows are memoised in bounded caches, so scoring a plan costs a few dictionary lookups
once the cities it names have been seen.

Two kinds of name match:
- official: rows of the city whose name *contains* the given name (case-sensitive), in table
  order; attributes come from the first (spec travelplanner.md §6.1, "entity match");
- strict: rows whose whitespace-normalised name *equals* the given name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from services.reward.evaluator.parsing import distance_cost, norm_ws
from services.sandbox.world.rows import (
    Accommodation,
    Attraction,
    Distance,
    Flight,
    Restaurant,
)
from services.sandbox.world.store import World, searchable

T = TypeVar("T")


class _BoundedCache:
    """A dict that forgets everything when full: plans from the wild name unbounded strings."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data: dict[Hashable, Any] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        try:
            return self.data[key]
        except KeyError:
            pass
        value = make()
        if len(self.data) >= self.limit:
            self.data.clear()
        self.data[key] = value
        return value


class _CityTable:
    """One table's visible rows in one city, with a normalised-name index for exact matches."""

    __slots__ = ("exact", "rows")

    def __init__(self, rows: list[Any]) -> None:
        self.rows = tuple(rows)
        exact: dict[str, list[Any]] = {}
        for row in self.rows:
            exact.setdefault(norm_ws(row.name), []).append(row)
        self.exact = {k: tuple(v) for k, v in exact.items()}


_NO_ROWS = _CityTable([])


class WorldIndex:
    """Cached read access to everything the checks look up."""

    def __init__(self, world: World, cache_size: int = 200_000) -> None:
        self.world = world
        self._lock = threading.Lock()
        self._city_state: dict[str, str] | None = None
        self._tables: dict[str, _BoundedCache] = {
            "restaurants": _BoundedCache(cache_size),
            "accommodations": _BoundedCache(cache_size),
            "attractions": _BoundedCache(cache_size),
        }
        self._matches = _BoundedCache(cache_size)
        self._flights = _BoundedCache(cache_size)
        self._distances = _BoundedCache(cache_size)

    # --- cities -------------------------------------------------------------------------------
    @property
    def city_state(self) -> dict[str, str]:
        """city → state over the evaluator's city map (all 312 cities, `Jackson` included)."""
        if self._city_state is None:
            with self._lock:
                if self._city_state is None:
                    self._city_state = {c.city: c.state for c in self.world.cities()}
        return self._city_state

    # --- per-city tables ----------------------------------------------------------------------
    def _table(self, kind: str, city: str) -> _CityTable:
        fetch = {
            "restaurants": self.world.restaurants,
            "accommodations": self.world.accommodations,
            "attractions": self.world.attractions,
        }[kind]
        if not searchable(city):  # a NUL, a lone surrogate, a non-string: no city has that name
            return _NO_ROWS
        return self._tables[kind].get(city, lambda: _CityTable(fetch(city)))

    def contains(self, kind: str, name: str, city: str) -> tuple[Any, ...]:
        """Official match: rows of `city` whose name contains `name`, in table order."""

        def make() -> tuple[Any, ...]:
            return tuple(r for r in self._table(kind, city).rows if name in r.name)

        return self._matches.get((kind, "sub", name, city), make)

    def exact(self, kind: str, name: str, city: str) -> tuple[Any, ...]:
        """Strict match: rows of `city` whose whitespace-normalised name equals `name`."""
        return self._table(kind, city).exact.get(name, ())

    def restaurants_containing(self, name: str, city: str) -> tuple[Restaurant, ...]:
        return self.contains("restaurants", name, city)

    def accommodations_containing(self, name: str, city: str) -> tuple[Accommodation, ...]:
        return self.contains("accommodations", name, city)

    def attractions_containing(self, name: str, city: str) -> tuple[Attraction, ...]:
        return self.contains("attractions", name, city)

    # --- flights and distances ----------------------------------------------------------------
    def flights_numbered(self, number: str) -> tuple[Flight, ...]:
        """Visible flight rows with this number, in table order."""
        if not searchable(number):
            return ()
        return self._flights.get(number, lambda: tuple(self.world.flight_by_number(number)))

    def distance(self, origin: str, destination: str) -> Distance | None:
        """The first distance row of the ordered pair."""
        if not (searchable(origin) and searchable(destination)):
            return None
        return self._distances.get((origin, destination), lambda: self.world.distance(origin, destination))

    def leg_cost(self, origin: str, destination: str, mode: str) -> int | None:
        """Per-vehicle cost of driving/taxi between two cities, None when the sandbox has no
        usable row (missing pair, empty values, a duration of a day or more)."""
        row = self.distance(origin, destination)
        if row is None or row.duration is None or row.distance is None:
            return None
        return distance_cost(row.distance, row.duration, mode)

    def preload(self, cities: list[str] | None = None) -> None:
        """Read every table of the given (default: all) cities now, e.g. before timing."""
        for city in cities if cities is not None else list(self.city_state):
            for kind in self._tables:
                self._table(kind, city)
