"""The verifiers adapter against verifiers' own code: `vf.load_environment` loads ours, and the library's
evaluation loop (`evaluate_sync` with an OpenAI client) runs a scripted policy served over real HTTP as OpenAI
chat completions (tests/support/fake_openai.py), whose tool calls and final plans go to a live episode API.

Runs in `.venv-verifiers` (scripts/test-adapters); skips elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import defaultdict
from typing import Any

import pytest

from tests.environments.conftest import library_or_skip

library_or_skip("verifiers", ".venv-verifiers")

import verifiers as vf  # noqa: E402

from tests.support.fake_openai import FakeOpenAI, Reply  # noqa: E402

MODES = ("official", "strict")
ENV_ID = "services.environments.verifiers_env"


os.environ.setdefault("FAKE_OPENAI_KEY", "test")


def policy_client(llm: FakeOpenAI) -> vf.ClientConfig:
    """verifiers' client settings for the scripted policy's server (its OpenAI chat-completions client)."""
    return vf.ClientConfig(api_base_url=llm.base_url, api_key_var="FAKE_OPENAI_KEY", max_retries=0, timeout=60)


def chat_completion(content: str | None = None, tool_calls: list[dict] | None = None) -> Reply:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "scripted",
        "choices": [{"index": 0, "finish_reason": "tool_calls" if tool_calls else "stop", "message": message}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    return Reply(raw=json.dumps(body))


class ScriptedPolicy:
    """Per task text: first (optionally) looks up the destination's accommodations, then answers with its plan
    as JSON. Every tool result it reads is kept, to show the tools ran."""

    def __init__(self, plans: dict[str, list[dict]], destinations: dict[str, str], look_first: bool) -> None:
        self.plans, self.destinations, self.look_first = plans, destinations, look_first
        self.tool_results: list[str] = []

    def __call__(self, body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        task = next(m["content"] for m in messages if m["role"] == "user")
        results = [m["content"] for m in messages if m["role"] == "tool"]
        if self.look_first and not results:
            args = json.dumps({"city": self.destinations[task]})
            call = {"id": "call_1", "type": "function", "function": {"name": "SearchAccommodation", "arguments": args}}
            return chat_completion(tool_calls=[call])
        self.tool_results += results
        return chat_completion(content=json.dumps(self.plans[task]))


def evaluate(served, cases: list[dict], *, mode: str, reward: str = "sum", look_first: bool = False):
    """verifiers' evaluation loop over `cases` (one rollout each); returns their rewards by case name, the
    outputs, and the policy."""
    by_id = [c for c in cases if not c["query_changed"]]
    inline = [c for c in cases if c["query_changed"]]
    assert not (by_id and inline), "one environment holds either a split's queries or inline queries"
    if by_id:
        env = vf.load_environment(
            ENV_ID,
            base_url=served.url,
            token=served.token,
            split="train",
            query_ids=[c["query_id"] for c in by_id],
            reward=reward,
            mode=mode,
        )
    else:
        env = vf.load_environment(
            ENV_ID,
            base_url=served.url,
            token=served.token,
            split=None,
            queries=[c["query"] for c in inline],
            reward=reward,
            mode=mode,
        )
    tasks = [row["prompt"][-1]["content"] for row in env.get_eval_dataset()]
    assert len(set(tasks)) == len(cases)
    policy = ScriptedPolicy(
        {t: c["plan"] for t, c in zip(tasks, cases)}, {t: c["query"]["dest"] for t, c in zip(tasks, cases)}, look_first
    )
    with FakeOpenAI(default=policy) as llm:
        outputs = env.evaluate_sync(client=policy_client(llm), model="scripted", num_examples=len(cases))
    rewards = {}
    for output in outputs["outputs"]:
        task = next(m["content"] for m in output["prompt"] if m["role"] == "user")
        rewards[next(c["name"] for t, c in zip(tasks, cases) if t == task)] = output["reward"]
    return rewards, outputs, policy


def gold_and_broken(served) -> tuple[dict, dict]:
    """A gold plan that `star score` passes in strict mode, and the same query's plan broken once."""
    gold = next((c for c in served.cases if c["breaks"] is None and c["star_score"]["strict"] == 5.0), None)
    if gold is None:
        pytest.fail("no gold plan of the fixture passes `star score --mode strict`")
    broken = next(
        c for c in served.cases if c["query_id"] == gold["query_id"] and c["breaks"] and not c["query_changed"]
    )
    return gold, broken


def test_oracle_plan_scores_one_and_a_corrupted_one_less(served) -> None:
    gold, broken = gold_and_broken(served)
    rewards, outputs, policy = evaluate(served, [gold], mode="strict", reward="success", look_first=True)
    assert rewards == {gold["name"]: 1.0}
    # the tool call ran in the episode: the sandbox's accommodations of the destination, the plan's hotel among them
    hotel = next(d["accommodation"] for d in gold["plan"] if d["accommodation"] not in ("-", ""))
    assert len(policy.tool_results) == 1 and hotel.rsplit(",", 1)[0].strip() in policy.tool_results[0]

    rewards, _, _ = evaluate(served, [broken], mode="strict", reward="success", look_first=True)
    assert rewards[broken["name"]] < 1.0


def test_rollout_that_never_answers_scores_zero(served) -> None:
    """A policy that only calls tools ends at max_turns; its episode is finished with no plan and scores 0."""
    gold, _ = gold_and_broken(served)
    env = vf.load_environment(
        ENV_ID, base_url=served.url, token=served.token, split="train", query_ids=[gold["query_id"]], max_turns=2
    )
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "SearchAccommodation", "arguments": json.dumps({"city": gold["query"]["dest"]})},
    }
    with FakeOpenAI(default=lambda body: chat_completion(tool_calls=[call])) as llm:
        out = env.evaluate_sync(client=policy_client(llm), model="scripted", num_examples=1)
        assert len(llm.requests) == 2
    assert [o["reward"] for o in out["outputs"]] == [0.0]


def test_refused_episode_ends_its_rollout_not_the_run(served) -> None:
    """A start the episode API refuses (a tool budget above the service's) is the rollout's error, reward 0."""
    gold, _ = gold_and_broken(served)
    env = vf.load_environment(
        ENV_ID,
        base_url=served.url,
        token=served.token,
        split="train",
        query_ids=[gold["query_id"]],
        max_tool_calls=10**6,
    )
    with FakeOpenAI(default=lambda body: chat_completion(content=json.dumps(gold["plan"]))) as llm:
        out = env.evaluate_sync(client=policy_client(llm), model="scripted", num_examples=1)
        assert llm.requests == []
    [rollout] = out["outputs"]
    assert rollout["reward"] == 0.0
    assert "max_tool_calls" in str(rollout.get("error"))


def test_tool_calls_of_a_gone_episode_stop_the_rollout(served) -> None:
    """A refused call is the tool's message for the model; a call into an episode that is gone is the
    environment's stop error (verifiers ends the rollout with it)."""
    from services.environments.verifiers_env import EPISODE_KEY, EpisodeGone

    gold, _ = gold_and_broken(served)
    env = vf.load_environment(
        ENV_ID, base_url=served.url, token=served.token, split="train", query_ids=[gold["query_id"]]
    )
    assert env.stop_errors == [EpisodeGone]

    async def calls() -> tuple[str, BaseException | None]:
        state = vf.State(input={"info": json.loads(env.get_eval_dataset()[0]["info"])})
        state["info"] = state["input"]["info"]
        await env.setup_state(state)
        refused = await env.call_tool("SearchAccommodation", {"town": "x", EPISODE_KEY: state[EPISODE_KEY]}, "c1")
        await env.episodes().close(state[EPISODE_KEY])
        try:
            await env.call_tool("SearchAccommodation", {"city": "x", EPISODE_KEY: state[EPISODE_KEY]}, "c2")
        except EpisodeGone as exc:
            return refused.content, exc
        return refused.content, None

    content, gone = asyncio.run(calls())
    assert content.startswith("Error: ") and "town" in content
    assert gone is not None and "HTTP 404" in str(gone)


def test_load_environment_names_a_bad_request(served) -> None:
    with pytest.raises(RuntimeError, match="no query"):
        vf.load_environment(ENV_ID, base_url=served.url, token=served.token, split="train", query_ids=["9999"])
    with pytest.raises(RuntimeError, match="query_ids"):
        vf.load_environment(ENV_ID, base_url=served.url, token=served.token, split="train")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_reward_equals_star_score(served, mode: str) -> None:
    """Every gold plan and every plan broken one constraint at a time, through verifiers' evaluation loop: the
    rubric's reward is `star score`'s, in both modes."""
    kinds: dict[str, list[dict]] = defaultdict(list)  # one environment per kind of break: its tasks are distinct
    for case in served.cases:
        kinds[case["name"].split("-", 2)[2]].append(case)
    got, want = {}, {}
    for cases in kinds.values():
        rewards, _, _ = evaluate(served, cases, mode=mode)
        got.update(rewards)
        want.update({c["name"]: c["star_score"][mode] for c in cases})
    assert got == want
    assert len(set(want.values())) > 1  # the cases do differ in reward
