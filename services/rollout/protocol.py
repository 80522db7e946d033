"""The agent's text protocol: what the model is told, and how each model turn is read.

The form follows the Agent-STAR checkpoints (spec agent-star.md §1.2), so released models and
ours speak the same thing:

- chat = [system: `system_prompt()`, user: `user_message(query)`];
- each model turn is `<think>…</think><tool_call>{"name": …, "arguments": {…}}</tool_call>` or
  `<think>…</think><answer>…</answer>`;
- a tool's output comes back as a user message `"<tool_response>\\n" + text + "</tool_response>"`.

`parse_turn` implements the reference reading order exactly:
1. `<tool_call>` and `</tool_call>` both present: the text between the first `<tool_call>` and
   the next `</tool_call>` is JSON with `name` and `arguments`. An unknown name and any error
   (bad JSON, missing key, arguments that are not an object) are still tool-call turns: the
   tool response is then the error text, and the tool is not run.
2. Else `<answer>` and `</answer>`: the answer runs from the first `<answer>` to the last
   `</answer>`, stripped.
3. Else a lone `<answer>`: everything after it is the answer.
4. Else a format error: no tool call and no answer.

The prose of the prompt is ours; the tags, the tool names and the plan form are the contract.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.schemas import TravelQuery
from services.sandbox.tools.registry import tool_names, tool_schemas

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>\n", "</tool_response>"

TurnKind = Literal["tool_call", "answer", "format_error"]

# An example of the structured plan form (services/formatter/structured.py parses it exactly).
# Invented names: the prompt must not suggest real venues the model should copy.
PLAN_FORM_EXAMPLE = """\
Day 1:
Current City: from Springfield to Riverton
Transportation: Flight Number: F0000001, from Springfield to Riverton, Departure Time: 08:05, Arrival Time: 10:20
Breakfast: -
Attraction: Riverton Botanical Garden, Riverton;
Lunch: The Green Spoon, Riverton
Dinner: Harbor Grill, Riverton
Accommodation: Quiet Loft near the Park, Riverton

Day 2:
Current City: Riverton
Transportation: -
Breakfast: Sunrise Bakery, Riverton
Attraction: Riverton Science Museum, Riverton;Old Town Walk, Riverton;
Lunch: Noodle Corner, Riverton
Dinner: Casa Verde, Riverton
Accommodation: Quiet Loft near the Park, Riverton

Day 3:
Current City: from Riverton to Springfield
Transportation: Self-driving, from Riverton to Springfield, duration: 3 hours 10 mins, distance: 320 km, cost: 16
Breakfast: Morning Mug, Riverton
Attraction: -
Lunch: -
Dinner: -
Accommodation: -"""

_SYSTEM_TEMPLATE = """\
You are a travel-planning agent. You build complete, bookable itineraries for the trip a user \
describes, using only what the travel database tools tell you.

# How to respond
Every reply you write must take exactly one of these two forms, and nothing else:

1. Call one tool:
{call}

2. Give the final itinerary:
{answer_think}<answer>
<the itinerary, in the day-by-day form below>
</answer>

Make a single tool call per reply; {result_note}. \
A reply with neither a tool call nor an answer is wasted.

{tools_section}# Guidelines
- You are a travel planner and nothing else; stay on the user's trip.
- Tool results are the only source of truth. Use names, flight numbers, prices and times exactly \
as the tools print them, and never invent a flight, restaurant, attraction or place to stay.
- The itinerary must cover the whole trip: transportation out and back home, a place to stay for \
every night, at least one attraction on each day that is not spent travelling, and breakfast, lunch \
and dinner at three different restaurants on each such day. Do not repeat a restaurant or an \
attraction across the trip.
- Respect every constraint the user states: the total budget (all transport, meals and lodging for \
every traveller), required cuisines, room type, house rules (parties, smoking, children under 10, \
visitors, pets), minimum nights, maximum occupancy, and any transport the user rules out.
- City names are case-sensitive and must be written exactly as the tools spell them.

# The itinerary form
Write one block per day, numbered from Day 1, with these seven lines in this order. Use "-" for \
anything a day does not have; name each place followed by ", <city>"; end each attraction with ";" \
(several attractions follow one another: "A, City;B, City;"). On a day you move between cities, write "from A to B" as the current city. For example:

{example}
"""


_HERMES_CALL = """<think>what you know so far and what you need next</think>
<tool_call>
{"name": "<tool name>", "arguments": {"<parameter>": "<value>"}}
</tool_call>"""


def system_prompt(
    tools: Sequence[dict[str, Any]] | None = None, *, call: str | None = None, tools_listed_elsewhere: bool = False
) -> str:
    """The system message. `tools`: schemas in the plain `{name, description, parameters}` form
    (default: the sandbox's six tools), embedded one JSON object per line. `call`: how a tool call
    is written (default: the Agent-STAR `<think>` + `<tool_call>` form); `tools_listed_elsewhere`:
    the chat template lists the tools itself (then the prompt does not)."""
    schemas = list(tools) if tools is not None else tool_schemas("plain")
    rendered = "\n".join(json.dumps(_plain(t), ensure_ascii=False) for t in schemas)
    section = (
        ""
        if tools_listed_elsewhere
        else f"# Tools\nThe tools are described as JSON schemas:\n<tools>\n{rendered}\n</tools>\n\n"
    )
    agent_star = call is None
    return _SYSTEM_TEMPLATE.format(
        call=_HERMES_CALL if agent_star else call,
        tools_section=section,
        example=PLAN_FORM_EXAMPLE,
        answer_think="<think>why this plan satisfies every requirement</think>\n" if agent_star else "",
        result_note="the result comes back to you inside <tool_response></tool_response>"
        if agent_star
        else "the result comes back to you in the next message",
    )


def _plain(schema: dict[str, Any]) -> dict[str, Any]:
    """Accept the OpenAI `{"type": "function", "function": {...}}` form too."""
    return schema["function"] if schema.get("type") == "function" and "function" in schema else schema


def user_message(query: TravelQuery | str) -> str:
    """The user turn: the query's own words, or a description built from its fields when a
    (synthetic) query has none."""
    if isinstance(query, str):
        return query
    if query.query.strip():
        return query.query.strip()
    return describe_query(query)


def describe_query(query: TravelQuery) -> str:
    dates = ", ".join(query.date)
    people = "1 person" if query.people_number == 1 else f"{query.people_number} people"
    cities = "1 city" if query.visiting_city_number == 1 else f"{query.visiting_city_number} cities"
    parts = [
        f"Please plan a {query.days}-day trip for {people} from {query.org} to {query.dest} "
        f"({cities} to visit), on {dates}, with a budget of ${query.budget}."
    ]
    c = query.local_constraint
    if c.house_rule:
        parts.append(f"The accommodation must allow {c.house_rule}.")
    if c.room_type:
        parts.append(f"We want a {c.room_type}.")
    if c.cuisine:
        parts.append(f"We would like to try {', '.join(c.cuisine)} cuisine.")
    if c.transportation:
        parts.append(f"Transportation: {c.transportation}.")
    return " ".join(parts)


@dataclass
class Turn:
    """One model turn, read.

    - `tool_call`: `name`/`arguments` are set when the call is well formed and the tool known;
      otherwise `error` holds the text to send back as the tool response (and the tool is not run).
    - `answer`: `answer` holds the final text.
    - `format_error`: neither; `error` says so.
    """

    kind: TurnKind
    name: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    answer: str | None = None
    error: str | None = None

    @property
    def runnable(self) -> bool:
        return self.kind == "tool_call" and self.error is None


FORMAT_ERROR = "format error: the reply has neither a tool call nor an answer"


def parse_turn(text: str, tools: Iterable[str] | None = None) -> Turn:
    """Read one model turn (agent-star.md §1.2). `tools`: the callable names (default: the six)."""
    known = set(tools) if tools is not None else set(tool_names())
    if TOOL_CALL_OPEN in text and TOOL_CALL_CLOSE in text:
        return _tool_call(_between_first(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE), known)
    if ANSWER_OPEN in text and ANSWER_CLOSE in text:
        start = text.index(ANSWER_OPEN) + len(ANSWER_OPEN)
        end = text.rindex(ANSWER_CLOSE)
        # A `</answer>` before the first `<answer>` leaves nothing between them.
        return Turn("answer", answer=text[start:end].strip() if end >= start else "")
    if ANSWER_OPEN in text:
        return Turn("answer", answer=text[text.index(ANSWER_OPEN) + len(ANSWER_OPEN) :].strip())
    return Turn("format_error", error=FORMAT_ERROR)


def _between_first(text: str, open_tag: str, close_tag: str) -> str:
    """From the first `open_tag` to the next `close_tag` (or the end when none follows)."""
    start = text.index(open_tag) + len(open_tag)
    end = text.find(close_tag, start)
    return text[start:] if end < 0 else text[start:end]


def _tool_call(body: str, known: set[str]) -> Turn:
    try:
        call = json.loads(body.strip())
        name = call["name"]
        arguments = call["arguments"]
    except Exception as exc:  # noqa: BLE001 - any failure is reported to the model, as the reference does
        return Turn("tool_call", error=call_error(exc))
    if not isinstance(name, str) or name not in known:
        return Turn("tool_call", name=str(name), error=unknown_tool(name))
    if not isinstance(arguments, dict):
        return Turn(
            "tool_call",
            name=name,
            error=call_error(TypeError(f"arguments must be a JSON object, got {type(arguments).__name__}")),
        )
    return Turn("tool_call", name=name, arguments=arguments)


def unknown_tool(name: object) -> str:
    return f"Tool {name} not found, please rethink your tool call and try again."


def call_error(exc: BaseException) -> str:
    return f"Error calling tool: {exc}"


def tool_response(text: str) -> str:
    """A tool's output as the content of the user message that carries it back."""
    return TOOL_RESPONSE_OPEN + text + TOOL_RESPONSE_CLOSE


def format_tool_call(name: str, arguments: dict[str, Any], think: str = "") -> str:
    """A well-formed tool-call turn (what the oracle teacher writes)."""
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{THINK_OPEN}{think}{THINK_CLOSE}\n{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def format_answer(plan_text: str, think: str = "") -> str:
    """A well-formed final turn carrying the structured plan text."""
    return f"{THINK_OPEN}{think}{THINK_CLOSE}\n{ANSWER_OPEN}\n{plan_text}\n{ANSWER_CLOSE}"
