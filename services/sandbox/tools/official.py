"""The `official` dialect: what the TravelPlanner benchmark's two-stage agent observes.

Tables are the DataFrames the official tools return, printed as `to_string(index=False)` (our own
renderer, table.py, without pandas); the argument checks and messages are the two-stage agent's
(spec travelplanner.md §3.1-§3.3):

- FlightSearch: the date must match `^\\d{4}-\\d{2}-\\d{2}$`, then origin and destination must be in
  the agent's city set (citySet.txt: the world's `searchable` cities), else
  `'<date>' is not in the format YYYY-MM-DD` / `<city> is not valid city in [...]`;
- Attraction/Accommodation/RestaurantSearch: the same city check;
- CitySearch: the Python list repr of the state's cities, or `Invalid State`;
- GoogleDistanceMatrix: no city check; arguments cut before a parenthesis; the official mode rules;
- anything malformed: `Illegal <Tool> Search. Please try again.` (or `Illegal GoogleDistanceMatrix`).

Tables are not stripped: they equal the released reference information. (The two-stage agent
itself `.strip()`s attraction, accommodation, restaurant and city observations, which removes the
header's leading spaces; callers that want that can strip.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.sandbox.tools import lookup
from services.sandbox.tools.registry import TOOLS, Param
from services.sandbox.tools.star import ToolDialect, mode_contains, parse_km
from services.sandbox.tools.table import Column, render_table
from services.sandbox.world import World
from services.sandbox.world.rows import Accommodation, Attraction, Distance, Flight, Restaurant

Outcome = tuple[str, bool]

FLIGHT_COLUMNS = (
    Column("Flight Number", "str"),
    Column("Price", "int"),
    Column("DepTime", "str"),
    Column("ArrTime", "str"),
    Column("ActualElapsedTime", "str"),
    Column("FlightDate", "str"),
    Column("OriginCityName", "str"),
    Column("DestCityName", "str"),
    Column("Distance", "float"),
)
ACCOMMODATION_COLUMNS = (
    Column("NAME", "str"),
    Column("price", "float"),
    Column("room type", "str"),
    Column("house_rules", "str"),
    Column("minimum nights", "float"),
    Column("maximum occupancy", "int"),
    Column("review rate number", "float"),
    Column("city", "str"),
)
RESTAURANT_COLUMNS = (
    Column("Name", "str"),
    Column("Average Cost", "int"),
    Column("Cuisines", "str"),
    Column("Aggregate Rating", "float"),
    Column("City", "str"),
)
ATTRACTION_COLUMNS = (
    Column("Name", "str"),
    Column("Latitude", "float"),
    Column("Longitude", "float"),
    Column("Address", "str"),
    Column("Phone", "str"),
    Column("Website", "str"),
    Column("City", "str"),
)

ILLEGAL = {
    "SearchFlight": "Illegal Flight Search. Please try again.",
    "SearchAttraction": "Illegal Attraction Search. Please try again.",
    "SearchAccommodation": "Illegal Accommodation Search. Please try again.",
    "SearchRestaurant": "Illegal Restaurant Search. Please try again.",
    "SearchCity": "Illegal City Search. Please try again.",
    "GoogleDistanceMatrix": "Illegal GoogleDistanceMatrix. Please try again.",
}
NO_VALID_INFORMATION = "No valid information."
# re.match semantics kept on purpose: `$` also accepts one trailing newline, `\d` any Unicode digit.
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


# --- renderers (pure: rows in, text out) -----------------------------------------------------
def flights_table(rows: Sequence[Flight]) -> str:
    return render_table(FLIGHT_COLUMNS, rows)


def accommodations_table(rows: Sequence[Accommodation]) -> str:
    return render_table(ACCOMMODATION_COLUMNS, rows)


def restaurants_table(rows: Sequence[Restaurant], *, with_index: bool = False) -> str:
    """HEAD prints `to_string(index=False)`; the version behind the released reference information
    printed `to_string()`, whose index is the restaurant's row number in the CSV."""
    body = [r[1:] for r in rows]  # drop src_index
    return render_table(RESTAURANT_COLUMNS, body, index=[r.src_index for r in rows] if with_index else None)


def attractions_table(rows: Sequence[Attraction]) -> str:
    return render_table(ATTRACTION_COLUMNS, rows)


def distance_text(origin: str, dest: str, mode: Any, row: Distance | None) -> Outcome:
    """`GoogleDistanceMatrix.run` after its lookup (origin/dest already cut before '(')."""
    if row is None:
        return f"{mode}, from {origin} to {dest}, no valid information.", False
    if not row.duration or not row.distance:
        return NO_VALID_INFORMATION, False
    km = parse_km(row.distance)
    if mode_contains(mode, "driving"):
        cost: int | None = int(km * 0.05)
    elif mode == "taxi":
        cost = int(km)
    else:
        cost = None
    if "day" in row.duration:
        return NO_VALID_INFORMATION, False
    return f"{mode}, from {origin} to {dest}, duration: {row.duration}, distance: {row.distance}, cost: {cost}", True


def extract_before_parenthesis(s: str) -> str:
    """The official `re.search(r'^(.*?)\\([^)]*\\)', s)` helper, in linear time.

    The regex cuts at the first '(' when some ')' follows it and no newline precedes it ('.'
    does not match a newline); otherwise the string is returned unchanged.
    """
    if not isinstance(s, str):
        raise TypeError("expected string or bytes-like object")
    p = s.find("(")
    if p < 0 or "\n" in s[:p] or s.find(")", p + 1) < 0:
        return s
    return s[:p]


def load_city_set(path: Path) -> list[str]:
    """The agent's city list from a `citySet.txt`, in file order (its repr is part of a message)."""
    return Path(path).read_text(encoding="utf-8").strip().split("\n")


class _Illegal(Exception):
    """A required argument is missing (the two-stage grammar's 'fewer than N parts')."""


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


def _get(args: Mapping[str, Any], param: Param) -> Any:
    if param.name in args:
        return args[param.name]
    for alias in param.aliases:
        if alias in args:
            return args[alias]
    return _MISSING


class OfficialTools(ToolDialect):
    """TravelPlanner's tools and two-stage argument checks over a `World`.

    `city_set` overrides the validation list (default: the world's searchable cities in world
    order; the official citySet.txt lists the same 311 cities with Charleston elsewhere, which
    only changes the order inside the invalid-city message). `restaurant_index` prints restaurant
    tables with the CSV row index, like the released reference information.
    """

    def __init__(
        self,
        world: World,
        *,
        city_set: Sequence[str] | None = None,
        restaurant_index: bool = False,
        reader: lookup.WorldLookup | None = None,
    ) -> None:
        super().__init__(world, reader=reader)
        cities = list(city_set) if city_set is not None else self.lookup.searchable_cities
        self._city_set = frozenset(cities)
        self._city_set_repr = str(cities)
        self.restaurant_index = restaurant_index

    def not_an_object(self, tool: str, args: Any) -> str:
        return ILLEGAL[tool]

    def failed(self, tool: str, exc: Exception) -> str:
        return ILLEGAL[tool]  # the two-stage agent turns any other exception into this

    # --- argument checks ------------------------------------------------------------------
    @staticmethod
    def _args(tool: str, args: Mapping[str, Any]) -> list[Any]:
        """Parameter values in schema order (aliases accepted); a missing required one is illegal."""
        spec = TOOLS[tool]
        values = [_get(args, p) for p in spec.params]
        if any(v is _MISSING and p.name in spec.required for v, p in zip(values, spec.params)):
            raise _Illegal(tool)
        return values

    def _invalid_city(self, city: Any) -> str | None:
        if isinstance(city, str) and city in self._city_set:
            return None
        return f"{city} is not valid city in {self._city_set_repr}."

    # --- the tools ---------------------------------------------------------------------------
    def search_flight(self, args: Mapping[str, Any]) -> Outcome:
        origin, dest, date = self._args("SearchFlight", args)
        if not _DATE.match(date):  # a non-string raises TypeError → Illegal, as in the agent
            return f"'{date}' is not in the format YYYY-MM-DD", False
        for city in (origin, dest):
            if (msg := self._invalid_city(city)) is not None:
                return msg, False
        rows = self.lookup.flights(origin, dest, date)
        if not rows:
            return f"There is no flight from {origin} to {dest} on {date}.", False
        return flights_table(rows), True

    def search_accommodation(self, args: Mapping[str, Any]) -> Outcome:
        (city,) = self._args("SearchAccommodation", args)
        if (msg := self._invalid_city(city)) is not None:
            return msg, False
        rows = self.lookup.accommodations(city)
        if not rows:
            return "There is no attraction in this city.", False  # sic: the official copy-paste slip
        return accommodations_table(rows), True

    def search_restaurant(self, args: Mapping[str, Any]) -> Outcome:
        (city,) = self._args("SearchRestaurant", args)
        if (msg := self._invalid_city(city)) is not None:
            return msg, False
        rows = self.lookup.restaurants(city)
        if not rows:
            return "There is no restaurant in this city.", False
        return restaurants_table(rows, with_index=self.restaurant_index), True

    def search_attraction(self, args: Mapping[str, Any]) -> Outcome:
        (city,) = self._args("SearchAttraction", args)
        if (msg := self._invalid_city(city)) is not None:
            return msg, False
        rows = self.lookup.attractions(city)
        if not rows:
            return "There is no attraction in this city.", False
        return attractions_table(rows), True

    def search_city(self, args: Mapping[str, Any]) -> Outcome:
        (state,) = self._args("SearchCity", args)
        hash(state)  # an unhashable state fails the official dict lookup → Illegal City Search
        cities = self.lookup.cities_in_state(state)
        if not cities:
            return "Invalid State", False
        return str(cities), True

    def distance(self, args: Mapping[str, Any]) -> Outcome:
        origin, dest, mode = self._args("GoogleDistanceMatrix", args)
        if mode is _MISSING:
            mode = "driving"  # GoogleDistanceMatrix.run's default
        origin, dest = extract_before_parenthesis(origin), extract_before_parenthesis(dest)
        return distance_text(origin, dest, mode, self.lookup.distance(origin, dest))
