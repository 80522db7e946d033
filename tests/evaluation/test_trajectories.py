"""Backtracking and tool-selection diagnostics on trajectories whose tool responses are the real
sandbox's text (star dialect over the official world)."""

from __future__ import annotations

import json

import pytest

from services.evaluation.trajectories import backtracking_summary, dead_ends, tool_calls, tool_selection
from services.sandbox.tools.toolbox import ToolBox


@pytest.fixture(scope="module")
def toolbox(official_world):
    return ToolBox(official_world, dialect="star", cache_size=0)


def chat(toolbox, calls, answer="<answer>plan</answer>"):
    """System + user, then one assistant turn per (name, arguments) and the tool's real reply."""
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "plan my trip"}]
    for name, arguments in calls:
        messages.append(
            {
                "role": "assistant",
                "content": f"<think>next</think><tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>",
            }
        )
        messages.append(
            {"role": "user", "content": "<tool_response>\n" + toolbox.call(name, arguments).text + "</tool_response>"}
        )
    messages.append({"role": "assistant", "content": f"<think>done</think>{answer}"})
    return messages


def test_tool_calls_pair_with_responses(toolbox, gold):
    msgs = chat(toolbox, [("SearchAccommodation", {"city": "Rockford"}), ("SearchCity", {"state": "Illinois"})])
    msgs.insert(4, {"role": "assistant", "content": "<think>x</think><tool_call>{not json</tool_call>"})
    calls = tool_calls(msgs)
    assert [c.name for c in calls] == ["SearchAccommodation", None, "SearchCity"]
    assert [c.step for c in calls] == [1, 2, 3]
    assert calls[0].response.startswith("A SearchAccommodation for Rockford found")
    assert calls[1].error.startswith("unreadable tool call")


def test_structured_calls_of_llama_and_mistral_records_are_read(toolbox, gold):
    text = toolbox.call("SearchCity", {"state": "Illinois"}).text
    msgs = [
        {"role": "user", "content": "plan my trip"},
        {
            "role": "assistant",
            "content": '{"name": "SearchCity", "parameters": {"state": "Illinois"}}',
            "tool_calls": [
                {
                    "id": "call00000",
                    "type": "function",
                    "function": {"name": "SearchCity", "arguments": {"state": "Illinois"}},
                }
            ],
        },
        {"role": "tool", "content": text, "tool_call_id": "call00000"},
        {"role": "assistant", "content": "<answer>plan</answer>"},
    ]
    calls = tool_calls(msgs)
    assert [(c.name, c.arguments, c.response) for c in calls] == [("SearchCity", {"state": "Illinois"}, text)]


def test_city_dead_end_revised_and_not(toolbox, gold):
    q = gold.queries[0]  # St. Petersburg → Rockford, 3 days
    msgs = chat(
        toolbox,
        [
            ("SearchRestaurant", {"city": "Atlantis"}),  # commits to Atlantis
            ("SearchAccommodation", {"city": "Atlantis"}),  # nowhere to sleep there
            ("SearchAccommodation", {"city": "Rockford"}),
        ],
    )
    calls = tool_calls(msgs)
    assert calls[1].response.startswith("There is no accommodation in Atlantis")
    [end] = dead_ends(q, calls, gold.plan(0))
    assert (end.kind, end.key, end.committed_step, end.observed_step) == ("city", "Atlantis", 1, 2)
    assert end.earlier_choice and end.revised  # the final plan stays in Rockford
    stuck = gold.plan(0)
    stuck[1]["current_city"] = "Atlantis"
    [end] = dead_ends(q, calls, stuck)
    assert not end.revised
    [end] = dead_ends(q, calls, None)  # no plan: judged by later calls (it moved on to Rockford)
    assert end.revised


def test_flight_dead_end_on_a_date(toolbox, gold):
    q = gold.queries[0]
    day1 = q.date[0]
    msgs = chat(
        toolbox,
        [
            ("SearchAttraction", {"city": "Rockford"}),
            ("SearchFlight", {"departure": "St. Petersburg", "destination": "Rockford", "date": "2022-07-04"}),
            ("SearchFlight", {"departure": "St. Petersburg", "destination": "Rockford", "date": day1}),
        ],
    )
    calls = tool_calls(msgs)
    assert calls[1].response.startswith("There is no available flight")
    assert calls[2].response.startswith("A SearchFlight for St. Petersburg to Rockford")
    [end] = dead_ends(q, calls, gold.plan(0))
    assert end.kind == "flight" and end.key == "St. Petersburg -> Rockford 2022-07-04" and end.committed_step == 1
    assert end.revised  # the plan flies on the trip's first day, not on the dead date


def test_first_sight_miss_is_not_backtracking(toolbox, gold):
    q = gold.queries[0]
    calls = tool_calls(
        chat(
            toolbox,
            [
                (
                    "GoogleDistanceMatrix",
                    {"departure": "St. Petersburg", "destination": "Atlantis", "mode": "self-driving"},
                )
            ],
        )
    )
    [end] = dead_ends(q, calls, gold.plan(0))
    assert end.kind == "driving" and not end.earlier_choice
    summary = backtracking_summary([(True, [end])])
    assert (
        summary["dead_ends"] == 1 and summary["dead_ends_of_earlier_choices"] == 0 and summary["revised_rate"] is None
    )


def test_backtracking_summary_rates(toolbox, gold):
    q = gold.queries[0]
    calls = tool_calls(
        chat(toolbox, [("SearchRestaurant", {"city": "Atlantis"}), ("SearchAccommodation", {"city": "Atlantis"})])
    )
    stuck = gold.plan(0)
    stuck[1]["current_city"] = "Atlantis"
    items = [(True, dead_ends(q, calls, gold.plan(0))), (False, dead_ends(q, calls, stuck)), (False, [])]
    s = backtracking_summary(items)
    assert s["trajectories"] == 3 and s["with_dead_end"] == 2 and s["dead_ends_of_earlier_choices"] == 2
    assert s["revised_rate"] == 50.0
    assert s["failed_trajectories"] == 2 and s["failed_with_unrevised_dead_end"] == 1
    assert s["by_kind"] == {"city": 2, "flight": 0, "driving": 0}


def test_tool_selection_accuracy(toolbox, gold):
    q = gold.queries[0]
    calls = tool_calls(
        chat(
            toolbox,
            [
                (
                    "SearchFlight",
                    {"departure": "St. Petersburg", "destination": "Rockford", "date": q.date[0]},
                ),  # needed
                (
                    "SearchFlight",
                    {"departure": "St. Petersburg", "destination": "Rockford", "date": q.date[0]},
                ),  # repeat
                (
                    "SearchFlight",
                    {"departure": "St. Petersburg", "destination": "Rockford", "date": "2022-07-04"},
                ),  # off-trip date
                ("SearchRestaurant", {"city": "Chicago"}),  # not a city of this 3-day trip
                ("SearchAccommodation", {}),  # malformed
                ("SearchRestaurant", {"city": "Rockford"}),  # needed
            ],
        )
    )
    out = tool_selection(q, calls)
    assert out == {
        "calls": 6,
        "well_formed": 5,
        "needed": 2,
        "well_formed_rate": pytest.approx(500 / 6),
        "accuracy": pytest.approx(200 / 6),
    }


def test_tool_selection_cities_of_the_destination_state(toolbox, gold, evaluator):
    q = next(x for x in gold.queries if x.days == 7)  # the destination is a state
    city_state = evaluator.index.city_state
    inside = next(c for c, s in city_state.items() if s == q.dest)
    outside = next(c for c, s in city_state.items() if s != q.dest and c != q.org)
    calls = tool_calls(
        chat(
            toolbox,
            [
                ("SearchCity", {"state": q.dest}),
                ("SearchRestaurant", {"city": inside}),
                ("SearchRestaurant", {"city": outside}),
                ("SearchCity", {"state": "Atlantis"}),
            ],
        )
    )
    assert tool_selection(q, calls, city_state)["needed"] == 2
    assert tool_selection(q, calls)["needed"] == 3  # without the city table only the state call is judged
