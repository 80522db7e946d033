"""The agent protocol: the prompt carries the tools and the plan form; turns read per agent-star §1.2."""

from __future__ import annotations

import json
import re

import pytest

from services.common.schemas import TravelQuery
from services.formatter.structured import parse_plan
from services.rollout.protocol import (
    PLAN_FORM_EXAMPLE,
    format_answer,
    format_tool_call,
    parse_turn,
    system_prompt,
    tool_response,
    user_message,
)
from services.sandbox.tools.registry import tool_schemas


def test_system_prompt_embeds_every_tool_schema_inside_tools_tags():
    prompt = system_prompt()
    block = re.search(r"<tools>\n(.*)\n</tools>", prompt, re.DOTALL)
    assert block, "the tool list must sit inside <tools>…</tools>"
    embedded = [json.loads(line) for line in block.group(1).splitlines()]
    assert embedded == tool_schemas("plain")
    for tag in ("<think>", "<tool_call>", "</tool_call>", "<answer>", "</answer>", "<tool_response>"):
        assert tag in prompt


def test_system_prompt_accepts_openai_form_and_a_subset():
    only = [tool_schemas("openai")[0]]
    prompt = system_prompt(only)
    assert '"name": "SearchFlight"' in prompt and "SearchCity" not in prompt.split("<tools>")[1].split("</tools>")[0]


def test_the_plan_form_shown_in_the_prompt_is_what_the_formatter_parses():
    assert PLAN_FORM_EXAMPLE in system_prompt()
    plan = parse_plan(PLAN_FORM_EXAMPLE, days=3)
    assert [d.current_city for d in plan.days] == [
        "from Springfield to Riverton",
        "Riverton",
        "from Riverton to Springfield",
    ]
    assert plan.days[1].attraction.endswith(";")


def test_user_message_uses_the_query_text_or_describes_the_fields():
    q = TravelQuery(
        org="Sarasota",
        dest="Chicago",
        days=3,
        visiting_city_number=1,
        date=["2022-03-22", "2022-03-23", "2022-03-24"],
        people_number=2,
        budget=1900,
        local_constraint={"room type": "private room", "cuisine": ["Italian"]},
    )
    text = user_message(q)
    for part in ("Sarasota", "Chicago", "3-day", "2 people", "$1900", "private room", "Italian", "2022-03-22"):
        assert part in text
    assert user_message(q.model_copy(update={"query": "  Plan my trip.  "})) == "Plan my trip."


def test_tool_call_takes_the_first_call_only():
    text = (
        '<think>a</think><tool_call>{"name": "SearchCity", "arguments": {"state": "Texas"}}</tool_call>'
        '<tool_call>{"name": "SearchRestaurant", "arguments": {"city": "Dallas"}}</tool_call><answer>x</answer>'
    )
    turn = parse_turn(text)
    assert (turn.kind, turn.name, turn.arguments, turn.error) == ("tool_call", "SearchCity", {"state": "Texas"}, None)
    assert turn.runnable


def test_answer_runs_from_first_open_to_last_close():
    turn = parse_turn("<think>t</think><answer> Day 1: a </answer> tail </answer> more")
    assert (turn.kind, turn.answer) == ("answer", "Day 1: a </answer> tail")


def test_lone_answer_tag_takes_the_rest():
    assert parse_turn("<think>t</think><answer>\nDay 1:\n...").answer == "Day 1:\n..."


@pytest.mark.parametrize(
    "text", ["just prose", "<think>only thinking</think>", "<tool_call>{no close", "</answer> closing only", ""]
)
def test_neither_call_nor_answer_is_a_format_error(text):
    turn = parse_turn(text)
    assert turn.kind == "format_error" and turn.error and not turn.runnable


def test_unknown_tool_gets_the_reference_message():
    turn = parse_turn('<tool_call>{"name": "BookHotel", "arguments": {}}</tool_call>')
    assert turn.kind == "tool_call" and not turn.runnable
    assert turn.error == "Tool BookHotel not found, please rethink your tool call and try again."


@pytest.mark.parametrize(
    "body,expected",
    [
        (
            "{bad json}",
            "Error calling tool: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        ('{"arguments": {}}', "Error calling tool: 'name'"),
        ('{"name": "SearchCity"}', "Error calling tool: 'arguments'"),
        (
            '{"name": "SearchCity", "arguments": "Texas"}',
            "Error calling tool: arguments must be a JSON object, got str",
        ),
    ],
)
def test_malformed_calls_are_reported_as_tool_errors(body, expected):
    turn = parse_turn(f"<think>x</think><tool_call>{body}</tool_call>")
    assert turn.kind == "tool_call" and not turn.runnable and turn.error == expected


def test_tool_call_wins_over_answer_and_close_before_open_reads_to_the_next_close():
    assert (
        parse_turn(
            '<answer>x</answer><tool_call>{"name": "SearchCity", "arguments": {"state": "Ohio"}}</tool_call>'
        ).kind
        == "tool_call"
    )
    # A stray </tool_call> before the call: the body ends at the close that follows the open.
    turn = parse_turn('</tool_call><tool_call>{"name": "SearchCity", "arguments": {"state": "Ohio"}}</tool_call>')
    assert turn.runnable and turn.arguments == {"state": "Ohio"}


def test_tool_response_wrapping_is_exact():
    assert tool_response("A\nB\n") == "<tool_response>\nA\nB\n</tool_response>"


def test_formatted_turns_read_back():
    call = format_tool_call(
        "SearchFlight",
        {"departure": "Sarasota", "destination": "Chicago", "date": "2022-03-22"},
        think="outbound flight",
    )
    turn = parse_turn(call)
    assert turn.runnable and turn.name == "SearchFlight" and turn.arguments["destination"] == "Chicago"
    answer = parse_turn(format_answer(PLAN_FORM_EXAMPLE, think="done"))
    assert answer.kind == "answer" and answer.answer == PLAN_FORM_EXAMPLE
