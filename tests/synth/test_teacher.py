"""Teacher trajectories: every oracle trajectory follows the protocol, scores success under the
strict evaluator when its answer is parsed back, and replays against the sandbox service over
HTTP with identical tool responses; the LLM teacher keeps strict successes only."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from services.formatter.structured import parse_plan
from services.rollout.protocol import TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, parse_turn, system_prompt
from services.sandbox.tools import ToolBox
from services.synth.queries import QuerySynthesizer
from services.synth.teacher import HttpTools, InProcessTools, LLMTeacher, OracleTeacher, TeacherError, write_sft
from tests.support.fake_openai import FakeOpenAI
from tests.synth.conftest import failures


@pytest.fixture(scope="module")
def coach(oracle, official_world, strict_eval):
    return OracleTeacher(oracle, InProcessTools(ToolBox(official_world, cache_size=0)), strict_eval)


@pytest.fixture(scope="module")
def samples(coach, train_queries, oracle):
    synthetic, _ = QuerySynthesizer(oracle, seed=11).generate({"easy": 5, "medium": 5, "hard": 5})
    return [coach.trajectory(q, sample_id=f"t{i}") for i, q in enumerate([*train_queries, *synthetic])]


def test_every_oracle_trajectory_is_a_strict_success(samples, strict_eval, train_queries):
    assert len(samples) == len(train_queries) + 15
    for s in samples:
        answer = parse_turn(s.messages[-1]["content"])
        assert answer.kind == "answer"
        plan = parse_plan(answer.answer, days=s.query.days)  # what RL scoring does with an answer
        evaluation = strict_eval.evaluate(s.query, plan)
        assert failures(evaluation) == {}, s.id
        assert evaluation.cost == pytest.approx(s.cost)
        assert s.score.success == 1.0


def test_trajectories_follow_the_agent_protocol(samples):
    calls = []
    for s in samples:
        roles = [m["role"] for m in s.messages]
        assert roles[:2] == ["system", "user"] and s.messages[0]["content"] == system_prompt()
        assert roles[2:] == ["assistant", "user"] * len(s.calls) + ["assistant"]
        for turn, reply in zip(s.messages[2::2], s.messages[3::2]):
            parsed = parse_turn(turn["content"])
            assert parsed.runnable, turn["content"]
            assert turn["content"].startswith("<think>") and len(turn["content"].split("</think>")[0]) > 20
            assert reply["content"].startswith(TOOL_RESPONSE_OPEN) and reply["content"].endswith(TOOL_RESPONSE_CLOSE)
        names = [name for name, _ in s.calls]
        # a careful agent searches every city it stays in and every leg it travels
        for stop_city in {a["city"] for n, a in s.calls if n == "SearchAccommodation"}:
            assert ("SearchRestaurant", {"city": stop_city}) in s.calls
        assert sum(n in ("SearchFlight", "GoogleDistanceMatrix") for n in names) >= s.query.visiting_city_number + 1
        assert ("SearchCity" in names) == (s.query.days > 3)
        calls.append(len(s.calls))
    assert 5 <= sum(calls) / len(calls) <= 20


def _thoughts(s) -> list[tuple[str, str | None]]:
    """(thought, tool called after it) for each assistant turn."""
    out = []
    for m in s.messages[2::2]:
        turn = parse_turn(m["content"])
        out.append((m["content"].split("</think>")[0], turn.name if turn.kind == "tool_call" else None))
    return out


def test_thoughts_restate_each_preference_where_the_agent_acts_on_it(samples):
    seen = Counter()
    for s in samples:
        lc = s.query.local_constraint
        thoughts = _thoughts(s)
        text = " ".join(t for t, _ in thoughts)
        first_leg = next(t for t, name in thoughts if name in ("SearchFlight", "GoogleDistanceMatrix"))
        if lc.transportation == "no flight":
            seen["no flight"] += 1
            assert "flights are ruled out" in first_leg and "SearchFlight" not in [n for _, n in thoughts], s.id
        elif lc.transportation == "no self-driving":
            seen["no self-driving"] += 1
            assert "may not drive" in first_leg, s.id
        else:
            assert "ruled out" not in text and "may not drive" not in text, s.id
        before_restaurants = [t for t, name in thoughts if name == "SearchRestaurant"]
        if lc.room_type:
            seen["room"] += 1
            assert all(re.search(r"\((Entire home/apt|Private room|Shared room)", t) for t in before_restaurants), s.id
        if lc.house_rule:
            seen["rule"] += 1
            assert all(f"{lc.house_rule} allowed" in t for t in before_restaurants), s.id
        if not lc.room_type and not lc.house_rule:
            assert not any(re.search(r"\((Entire home/apt|Private room|Shared room)", t) for t in before_restaurants)
        for cuisine in lc.cuisine or []:
            seen["cuisine"] += 1
            assert f"For {cuisine}:" in text, (s.id, cuisine)
    assert all(seen[k] > 0 for k in ("no flight", "no self-driving", "room", "rule", "cuisine")), seen


def test_trajectories_replay_over_http_with_identical_responses(samples, official_world_url, tmp_path_factory):
    from services.controller.launcher import ServiceProcess

    env = {"STAR_DB_URL": official_world_url, "STAR_LOG_LEVEL": "WARNING"}
    proc = ServiceProcess("sandbox", "services.sandbox.app:create_app", env, tmp_path_factory.mktemp("logs")).start()
    try:
        tools = HttpTools(proc.url)
        replayed = 0
        for s in samples[::3]:
            responses = [m["content"] for m in s.messages[3::2]]
            for (name, arguments), recorded in zip(s.calls, responses):
                assert TOOL_RESPONSE_OPEN + tools(name, arguments) + TOOL_RESPONSE_CLOSE == recorded
                replayed += 1
        tools.close()
    finally:
        proc.stop()
    assert replayed >= len(samples)  # every trajectory calls tools (over 100 calls on the full data)


def test_a_query_without_a_plan_is_refused(coach, train_queries):
    q = train_queries[0].model_copy(update={"budget": 100})
    with pytest.raises(TeacherError, match="no plan: budget"):
        coach.trajectory(q)


def test_sft_files_are_read_by_the_learner_and_hf_datasets(samples, tmp_path):
    from datasets import load_dataset

    assert write_sft(tmp_path, samples[:10]) == 10
    lines = (tmp_path / "sft.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert record["success"] == 1.0 and record["teacher"] == "oracle"
    assert all(set(m) == {"role", "content"} for m in record["messages"])
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    assert info["star_sft"]["file_name"] == "sft.jsonl" and info["star_sft"]["formatting"] == "sharegpt"
    ds = load_dataset("json", data_files=str(tmp_path / "sft.jsonl"), split="train")
    assert ds[0]["messages"] == record["messages"]


def test_llm_teacher_keeps_only_strict_successes(samples, official_world, strict_eval):
    """A real HTTP chat server plays two models: one replays a successful oracle episode turn by
    turn, the other answers with a plan that breaks the budget. Only the first is kept."""
    good, bad = samples[0], samples[1]
    good_turns = [m["content"] for m in good.messages if m["role"] == "assistant"]
    broken = bad.messages[-1]["content"]

    def play(body):
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        if body["model"] == "good":
            return good_turns[turn]
        return broken  # the answer of another query: wrong route and days for this one

    tools = InProcessTools(ToolBox(official_world))
    with FakeOpenAI(default=play) as server:
        kept = LLMTeacher(server.base_url, "good", tools, strict_eval, samples=2).run([good.query])
        assert len(kept) == 2 and all(k.score.success == 1.0 for k in kept)
        assert kept[0].messages == good.messages and kept[0].teacher == "openai:good"
        teacher = LLMTeacher(server.base_url, "bad", tools, strict_eval)
        assert teacher.run([good.query]) == []
        assert teacher.report.tried == 1 and sum(teacher.report.rejected.values()) == 1
