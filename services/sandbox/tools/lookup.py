"""Guarded reads of the world, shared by both dialects.

The official tools filter DataFrames with `==`, so any value that is not a string naming a row
simply finds nothing. SQL drivers are less forgiving: PostgreSQL rejects NUL bytes, UTF-8
encoding fails on lone surrogates, and a megabyte-long parameter is wasted work. Such values
cannot equal any stored name, so they are answered "no rows" here without asking the database.
A database that is down is different: that is not the caller's fault, and it surfaces as
`BackendError` rather than as tool text.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError, TimeoutError as PoolTimeout

from services.sandbox.world import World
from services.sandbox.world.rows import Accommodation, Attraction, Distance, Flight, Restaurant
from services.sandbox.world.store import searchable


class BackendError(RuntimeError):
    """The world database could not answer (connection, lock, timeout)."""


class WorldLookup:
    """The World read API with input guards; background tables are read once and kept in memory
    (the world is immutable while it is served)."""

    def __init__(self, world: World) -> None:
        self.world = world
        cities = _guard(world.cities)
        self._by_state: dict[str, list[str]] = {}
        for c in cities:
            self._by_state.setdefault(c.state, []).append(c.city)
        self.searchable_cities: list[str] = _guard(world.city_set)

    def cities_in_state(self, state: Any) -> list[str]:
        return self._by_state.get(state, []) if isinstance(state, str) else []

    def flights(self, origin: Any, dest: Any, date: Any) -> list[Flight]:
        if not (searchable(origin) and searchable(dest) and searchable(date)):
            return []
        return _guard(self.world.flights, origin, dest, date)

    def accommodations(self, city: Any) -> list[Accommodation]:
        return _guard(self.world.accommodations, city) if searchable(city) else []

    def restaurants(self, city: Any) -> list[Restaurant]:
        return _guard(self.world.restaurants, city) if searchable(city) else []

    def attractions(self, city: Any) -> list[Attraction]:
        return _guard(self.world.attractions, city) if searchable(city) else []

    def distance(self, origin: Any, dest: Any) -> Distance | None:
        if not (searchable(origin) and searchable(dest)):
            return None
        return _guard(self.world.distance, origin, dest)


def _guard(fn, *args):  # noqa: ANN001, ANN202
    try:
        return fn(*args)
    except (OperationalError, InterfaceError, DisconnectionError, PoolTimeout) as exc:
        raise BackendError(f"world database unavailable: {type(exc).__name__}") from exc
