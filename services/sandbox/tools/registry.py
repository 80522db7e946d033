"""The six travel tools: names, parameters and descriptions, in one place.

Everything that describes a tool to the outside (the agent's system prompt, `GET /tools`, the
HTTP layer's 404 message, per-tool fault rates) reads it from here. Names and parameter names
are the ones the released Agent-STAR checkpoints were trained to call; the TravelPlanner
two-stage names (`FlightSearch`, ...) resolve to the same tools. Descriptions are our own words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# Modes the distance tool advertises. The star dialect prices any mode containing "driving" as
# driving and everything else as a taxi, so the enum documents intent rather than the only input.
DISTANCE_MODES = ("driving", "taxi")


@dataclass(frozen=True)
class Param:
    name: str
    description: str
    enum: tuple[str, ...] | None = None
    default: str | None = None
    # Other names the official dialect accepts for this parameter (the TravelPlanner code's own
    # argument names). The star dialect ignores them: Agent-STAR's tools only read `name`.
    aliases: tuple[str, ...] = ()

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "string", "description": self.description}
        if self.enum is not None:
            out["enum"] = list(self.enum)
        if self.default is not None:
            out["default"] = self.default
        return out


@dataclass(frozen=True)
class ToolSpec:
    name: str  # the star name (what an agent calls)
    official_name: str  # the TravelPlanner two-stage action name
    description: str
    params: tuple[Param, ...]
    required: tuple[str, ...]  # what the tool itself insists on (else "Invalid parameters ...")

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def parameters(self) -> dict[str, Any]:
        """JSON Schema of the arguments object."""
        return {
            "type": "object",
            "properties": {p.name: p.schema() for p in self.params},
            "required": list(self.required),
        }

    def function(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters()}


_CITY = "City name exactly as the database spells it (case-sensitive), e.g. 'San Francisco'."

# Order = the order the Agent-STAR system prompt lists them in.
TOOL_SPECS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name="SearchFlight",
        official_name="FlightSearch",
        description="List every flight from one city to another on a given day, with flight number, "
        "ticket price per person, departure and arrival times, duration and distance.",
        params=(
            Param("departure", "City the flight leaves from. " + _CITY, aliases=("origin",)),
            Param("destination", "City the flight arrives in. " + _CITY),
            Param("date", "Day of departure, formatted YYYY-MM-DD.", aliases=("departure_date",)),
        ),
        required=("departure", "destination", "date"),
    ),
    ToolSpec(
        name="GoogleDistanceMatrix",
        official_name="GoogleDistanceMatrix",
        description="Road trip between two cities: driving time, distance and the cost of going by "
        "self-driving or by taxi.",
        params=(
            Param("departure", "City the trip starts in. " + _CITY, aliases=("origin",)),
            Param("destination", "City the trip ends in. " + _CITY),
            Param(
                "mode",
                "How to travel: 'driving' (your own car) or 'taxi'. Defaults to driving.",
                enum=DISTANCE_MODES,
                default="driving",
            ),
        ),
        required=("departure", "destination"),
    ),
    ToolSpec(
        name="SearchAccommodation",
        official_name="AccommodationSearch",
        description="List the places to stay in a city: nightly price, room type, house rules, minimum "
        "stay, maximum occupancy and review score.",
        params=(Param("city", "City to stay in. " + _CITY),),
        required=("city",),
    ),
    ToolSpec(
        name="SearchRestaurant",
        official_name="RestaurantSearch",
        description="List the restaurants of a city with their average cost per person, cuisines and rating.",
        params=(Param("city", "City to eat in. " + _CITY),),
        required=("city",),
    ),
    ToolSpec(
        name="SearchAttraction",
        official_name="AttractionSearch",
        description="List the sights of a city with address, phone number and website.",
        params=(Param("city", "City to visit. " + _CITY),),
        required=("city",),
    ),
    ToolSpec(
        name="SearchCity",
        official_name="CitySearch",
        description="List the cities of a state (or territory) that the travel database covers.",
        params=(Param("state", "State name, e.g. 'Texas' or 'New York'."),),
        required=("state",),
    ),
)

TOOLS: dict[str, ToolSpec] = {t.name: t for t in TOOL_SPECS}
# Official two-stage names → our names (GoogleDistanceMatrix is the same in both).
ALIASES: dict[str, str] = {t.official_name: t.name for t in TOOL_SPECS if t.official_name != t.name}


def resolve_tool(name: object) -> ToolSpec | None:
    """The tool a name (ours or the official alias) refers to; None for anything else."""
    if not isinstance(name, str):
        return None
    spec = TOOLS.get(name)
    if spec is None:
        alias = ALIASES.get(name)
        spec = TOOLS[alias] if alias else None
    return spec


def tool_names() -> list[str]:
    return [t.name for t in TOOL_SPECS]


SchemaStyle = Literal["openai", "plain"]


def tool_schemas(style: SchemaStyle = "openai") -> list[dict[str, Any]]:
    """Tool schemas for an agent prompt.

    `openai`: `{"type": "function", "function": {name, description, parameters}}` (chat-completions
    `tools=` form); `plain`: the inner `{name, description, parameters}` objects, the form the
    Agent-STAR prompt embeds as JSON inside `<tools>...</tools>`.
    """
    if style == "openai":
        return [{"type": "function", "function": t.function()} for t in TOOL_SPECS]
    if style == "plain":
        return [t.function() for t in TOOL_SPECS]
    raise ValueError(f"unknown schema style {style!r}; use 'openai' or 'plain'")
