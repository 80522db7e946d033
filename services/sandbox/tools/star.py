"""The `star` dialect: the six tools exactly as Agent-STAR's public tools phrase their answers.

The released checkpoints were trained on these strings, so every success line, empty result and
error message is reproduced byte for byte (spec agent-star.md §1.3). The public tools compare the
raw argument with pandas `==`; a non-string scalar therefore matches nothing and is echoed with
`str()`. Lists and objects, which pandas would choke on in assorted ways, get one clear error.

Each tool returns `(text, ok)`; `ok` is False for every error and every empty result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from services.sandbox.tools import lookup
from services.sandbox.world import World

Outcome = tuple[str, bool]
_SCALARS = (str, int, float, bool, type(None))


class StarArgumentError(TypeError):
    """A list/object where a tool expects a value; reported as `Tool calling error: ...`."""


def _scalar(args: Mapping[str, Any], name: str) -> Any:
    value = args[name]
    if not isinstance(value, _SCALARS):
        raise StarArgumentError(f"parameter '{name}' must be a string, not {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    return type(value).__name__


class ToolDialect:
    """The six tools over a `World` in one output dialect: subclasses write the tools and say
    what a non-object argument or a failing call reads as."""

    def __init__(self, world: World, *, reader: lookup.WorldLookup | None = None) -> None:
        self.world = world
        self.lookup = reader or lookup.WorldLookup(world)
        self._tools: dict[str, Callable[[Mapping[str, Any]], Outcome]] = {
            "SearchFlight": self.search_flight,
            "GoogleDistanceMatrix": self.distance,
            "SearchAccommodation": self.search_accommodation,
            "SearchRestaurant": self.search_restaurant,
            "SearchAttraction": self.search_attraction,
            "SearchCity": self.search_city,
        }

    def run(self, tool: str, args: Any) -> Outcome:
        """Run one tool (by its star name); never raises for any argument value, only for a
        database outage (`lookup.BackendError`, a 503 upstream)."""
        if not isinstance(args, Mapping):
            return self.not_an_object(tool, args), False
        try:
            return self._tools[tool](args)
        except lookup.BackendError:
            raise
        except Exception as exc:  # noqa: BLE001 - each dialect reports any other failure as text
            return self.failed(tool, exc), False

    def not_an_object(self, tool: str, args: Any) -> str:
        raise NotImplementedError

    def failed(self, tool: str, exc: Exception) -> str:
        raise NotImplementedError


class StarTools(ToolDialect):
    """Agent-STAR's tools over a `World`."""

    def not_an_object(self, tool: str, args: Any) -> str:
        return f"Tool calling error: arguments must be a JSON object, not {_json_type(args)}"

    def failed(self, tool: str, exc: Exception) -> str:
        return f"Tool calling error: {exc}"

    # --- the tools ---------------------------------------------------------------------------
    def search_flight(self, args: Mapping[str, Any]) -> Outcome:
        if "departure" not in args or "destination" not in args or "date" not in args:
            return "Invalid parameters. Please provide departure, destination and date.", False
        dep, dst, date = _scalar(args, "departure"), _scalar(args, "destination"), _scalar(args, "date")
        rows = self.lookup.flights(dep, dst, date)
        if not rows:
            return (
                f"There is no available flight from {dep} to {dst} on {date}. "
                "Please rethink your flight search and try again."
            ), False
        lines = [
            f"{i}. [{f.flight_number}] ${f.price}. Departure: {f.dep_time}, Arrival: {f.arr_time}, "
            f"Actual Elapsed Time: {f.elapsed}, Distance: {f.distance} miles\n"
            for i, f in enumerate(rows, 1)
        ]
        return (
            f"A SearchFlight for {dep} to {dst} on {date} found the following {len(rows)} flights:\n" + "\n".join(lines)
        ), True

    def distance(self, args: Mapping[str, Any]) -> Outcome:
        if "departure" not in args or "destination" not in args:
            return "Invalid parameters. Please provide departure, destination and mode.", False
        origin, dest = _scalar(args, "departure"), _scalar(args, "destination")
        mode = _scalar(args, "mode") if "mode" in args else "driving"
        row = self.lookup.distance(origin, dest)
        if row is None:
            return "No valid information found. Please rethink your distance search and try again.", False
        if not row.duration or not row.distance:
            return f"Sorry, we cannot find the distance between {origin} and {dest}.", False
        km = parse_km(row.distance)
        cost = int(km * 0.05) if mode_contains(mode, "driving") else int(km)  # anything else is a taxi
        if "day" in row.duration:
            return (
                "The required time exceeds a single day, we cannot provide the cost. "
                "Please consider an alternative transportation instead."
            ), False
        return (
            "A GoogleDistanceMatrix found the following information:\n"
            f"{mode}, from {origin} to {dest}, duration: {row.duration}, distance: {row.distance}, "
            f"cost: ${cost}"
        ), True

    def search_accommodation(self, args: Mapping[str, Any]) -> Outcome:
        if "city" not in args:
            return "Invalid parameters. Please provide city.", False
        city = _scalar(args, "city")
        rows = self.lookup.accommodations(city)
        if not rows:
            return (
                f"There is no accommodation in {city}. Please rethink your accommodation search and try again."
            ), False
        lines = [
            f"{i}. [{a.name}] ${a.price}. Room Type: {a.room_type}, House Rules: {a.house_rules}, "
            f"Minimum Nights: {a.minimum_nights}, Maximum Occupancy: {a.maximum_occupancy}, "
            f"Review Rate Number: {a.review_rate}\n"
            for i, a in enumerate(rows, 1)
        ]
        return (
            f"A SearchAccommodation for {city} found the following {len(lines)} accommodations:\n" + "\n".join(lines)
        ), True

    def search_restaurant(self, args: Mapping[str, Any]) -> Outcome:
        if "city" not in args:
            return "Invalid parameters. Please provide city.", False
        city = _scalar(args, "city")
        rows = self.lookup.restaurants(city)
        if not rows:
            return (f"There is no restaurant in {city}. Please rethink your restaurant search and try again."), False
        lines = [
            f"{i}. [{r.name}] Avg. Cost ${r.average_cost}. Cuisines: {r.cuisines}. Rating: {r.rating}\n"
            for i, r in enumerate(rows, 1)
        ]
        return (
            f"A SearchRestaurant for city {city} found the following {len(lines)} restaurants:\n" + "\n".join(lines)
        ), True

    def search_attraction(self, args: Mapping[str, Any]) -> Outcome:
        if "city" not in args:
            return "Invalid parameters. Please provide city.", False
        city = _scalar(args, "city")
        rows = self.lookup.attractions(city)
        if not rows:
            return (f"There is no attraction in {city}. Please rethink your attraction search and try again."), False
        lines = [
            f"{i}. [{t.name}]({t.website}) Address: {t.address}. Contact: {t.phone}\n" for i, t in enumerate(rows, 1)
        ]
        return (
            f"A SearchAttraction for city {city} found the following {len(lines)} attractions:\n" + "\n".join(lines)
        ), True

    def search_city(self, args: Mapping[str, Any]) -> Outcome:
        if "state" not in args:
            return "Invalid parameters. Please provide state.", False
        state = _scalar(args, "state")
        cities = self.lookup.cities_in_state(state)
        if not cities:
            return f"There is no city in {state}. Please rethink your city search and try again.", False
        return f"A SearchCity for state {state} found the following {len(cities)} cities:\n" + ", ".join(cities), True


def parse_km(distance: str) -> float:
    """'1,144 km' → 1144.0 (the public tools strip 'km' and thousands commas, then evaluate)."""
    return float(distance.replace("km", "").replace(",", "").strip())


def mode_contains(mode: Any, word: str) -> bool:
    """`word in mode`, failing like Python does for a non-string mode (the public code's message)."""
    if not isinstance(mode, str):
        raise TypeError(f"argument of type '{type(mode).__name__}' is not iterable")
    return word in mode
