"""Forced episodes of the teacher's shape (`ForcedTurns.shape: teacher`): tool calls, turn and answer lengths drawn
from the fit to the oracle teacher's trajectories, seeded, the long tail included, within the recipe's limits."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from services.common.schemas import ForcedTurns, SamplingParams, TravelQuery
from services.rollout.agent import Agent
from services.rollout.engines.scripted import ScriptedEngine
from services.rollout.episode_shapes import ANSWER_TOKENS, TOOL_CALLS, TURN_TOKENS, LogNormal, draw_episode, shape_rng

RECORD = Path(__file__).resolve().parents[2] / "bench" / "results" / "episode_shapes.json"
QUERY = TravelQuery(
    id="q-7",
    org="Sarasota",
    dest="Chicago",
    days=3,
    visiting_city_number=1,
    date=["2022-03-22", "2022-03-23", "2022-03-24"],
    people_number=1,
    budget=1900,
)


def test_the_constants_are_the_recorded_fit():
    fit = json.loads(RECORD.read_text())["fit"]
    for name, dist in (("tool_calls", TOOL_CALLS), ("turn_tokens", TURN_TOKENS), ("answer_tokens", ANSWER_TOKENS)):
        assert (dist.mu, dist.sigma) == pytest.approx((fit[name]["mu"], fit[name]["sigma"]), abs=1e-4), name


def test_draws_follow_the_fit_with_a_tail_past_the_teachers_longest():
    rng = random.Random(0)
    shapes = [draw_episode(rng, 60) for _ in range(20_000)]
    calls = [s.tool_calls for s in shapes]
    # the log-normal's median and spread, back from its draws
    assert statistics.median(calls) == pytest.approx(TOOL_CALLS.median, abs=1)
    logs = [math.log(c) for c in calls if c > 0]
    assert statistics.pstdev(logs) == pytest.approx(TOOL_CALLS.sigma, rel=0.1)
    record = json.loads(RECORD.read_text())
    longest = record["teacher"]["tool_calls"]["max"]
    beyond = sum(c > longest for c in calls) / len(calls)
    assert 0.01 < beyond < 0.1  # lone long trajectories exist, and are rare
    assert max(calls) <= 60 and max(calls) >= 25
    answers = [s.answer_tokens for s in shapes]
    assert statistics.median(answers) == pytest.approx(ANSWER_TOKENS.median, rel=0.05)


def test_the_tool_budget_caps_the_draw():
    rng = random.Random(1)
    assert max(draw_episode(rng, 12).tool_calls for _ in range(2000)) == 12
    assert LogNormal(10.0, 0.0).draw(random.Random(0), 1, 50) == 50


def test_the_same_seed_draws_the_same_shape_and_samples_differ():
    first = draw_episode(shape_rng(7, "q", 0), 60)
    assert draw_episode(shape_rng(7, "q", 0), 60) == first
    # without a seed, the query and the sample decide: stable, and different across a group
    group = [draw_episode(shape_rng(None, "q-1", i), 60) for i in range(8)]
    assert group == [draw_episode(shape_rng(None, "q-1", i), 60) for i in range(8)]
    assert len({s.tool_calls for s in group}) > 1


def run_forced(tokenizer, tools, seed: int | None):
    engine = ScriptedEngine(tokenizer, lambda ids, turn: [1] * 2000, append_stop=False)
    sampling = SamplingParams(seed=seed, forced_turns=ForcedTurns(shape="teacher"))
    traj = asyncio.run(Agent(engine, tools).run(QUERY, sampling))
    return traj, [c["params"].max_tokens for c in engine.calls]


def test_a_teacher_shaped_episode_takes_its_drawn_calls_turns_and_answer(tokenizer, local_tools):
    traj, asked = run_forced(tokenizer, local_tools, seed=11)
    rng = shape_rng(11, QUERY.id, 0)
    shape = draw_episode(rng, 60)
    turns = [TURN_TOKENS.draw(rng) for _ in range(shape.tool_calls)]
    assert traj.finish_reason == "answer" and traj.tool_calls == shape.tool_calls
    assert asked == turns + [shape.answer_tokens]
    assert sum(traj.loss_mask) == sum(turns) + shape.answer_tokens
    again, asked_again = run_forced(tokenizer, local_tools, seed=11)
    assert asked_again == asked and again.tool_calls == traj.tool_calls
    # another seed, another shape
    other = [run_forced(tokenizer, local_tools, seed=s)[1] for s in (12, 13, 14)]
    assert any(o != asked for o in other)


def test_the_fixed_shape_is_unchanged_by_default(tokenizer, local_tools):
    assert ForcedTurns().shape == "fixed"
    engine = ScriptedEngine(tokenizer, lambda ids, turn: [1] * 50, append_stop=False)
    sampling = SamplingParams(seed=3, forced_turns=ForcedTurns(tool_calls=2, turn_tokens=9, answer_tokens=11))
    traj = asyncio.run(Agent(engine, local_tools).run(QUERY, sampling))
    assert [c["params"].max_tokens for c in engine.calls] == [9, 9, 11] and traj.tool_calls == 2


def test_an_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="shape"):
        ForcedTurns(shape="paper")
