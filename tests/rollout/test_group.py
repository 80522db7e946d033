"""Group sampling and ARPO branching, with the scripted engine and the real tools."""

from __future__ import annotations

import asyncio

from services.common.schemas import SamplingParams
from services.rollout.agent import Agent
from services.rollout.engines.scripted import ScriptedEngine
from services.rollout.group import ArpoConfig, GroupMeta, sample_group, should_branch
from services.rollout.protocol import format_answer, format_tool_call

CALLS = [format_tool_call("SearchCity", {"state": "Illinois"}), format_tool_call("SearchCity", {"state": "Ohio"})]
ANSWER = format_answer("Day 1:\nCurrent City: Chicago")


def by_progress(tokenizer):
    """The next output follows from the tool responses already in the prompt (so a branch,
    which inherits its parent's prefix, continues where its parent was)."""

    def script(prompt_ids, _turn):
        seen = tokenizer.decode(prompt_ids).count("<|im_start|>user\n<tool_response>")
        return CALLS[seen] if seen < len(CALLS) else ANSWER

    return script


def test_group_runs_g_samples_concurrently_with_distinct_seeds(tokenizer, local_tools):
    engine = ScriptedEngine(tokenizer, by_progress(tokenizer))
    agent = Agent(engine, local_tools)
    meta = GroupMeta(run_id="r", task_id="t", prompt_id="p", epoch=2, step=5, reward_kind="macro", eval_mode="official")
    trajs = asyncio.run(sample_group(agent, "a trip", 4, SamplingParams(seed=100), meta=meta))
    assert [t.sample_index for t in trajs] == [0, 1, 2, 3]
    assert all(t.finish_reason == "answer" and t.tool_calls == 2 for t in trajs)
    assert (
        {t.group_id for t in trajs} == {"t"}
        and {t.prompt_id for t in trajs} == {"p"}
        and trajs[0].epoch == 2
        and trajs[0].step == 5
        and trajs[0].reward_kind == "macro"
    )
    first_turn_seeds = [c["params"].seed for c in engine.calls[:4]]
    assert len(set(first_turn_seeds)) == 4
    # Concurrency: all four first turns were issued before any second turn.
    assert [c["prompt_len"] for c in engine.calls[:4]] == [engine.calls[0]["prompt_len"]] * 4


def test_arpo_branches_after_tool_calls_and_fills_the_group(tokenizer, local_tools):
    engine = ScriptedEngine(tokenizer, by_progress(tokenizer))
    agent = Agent(engine, local_tools)
    cfg = ArpoConfig(initial_rollouts=2, beam_size=2, branch_probability=1.0, seed=0)
    trajs = asyncio.run(sample_group(agent, "a trip", 4, SamplingParams(seed=5), arpo=cfg))
    assert len(trajs) == 4
    roots = [t for t in trajs if "arpo_parent" not in t.timings]
    branches = [t for t in trajs if "arpo_parent" in t.timings]
    assert len(roots) == 2 and len(branches) == 2
    for b in branches:
        parent = trajs[int(b.timings["arpo_parent"])]
        at = int(b.timings["arpo_branch_token"])
        assert b.token_ids[:at] == parent.token_ids[:at] and b.loss_mask[:at] == parent.loss_mask[:at]
        assert b.finish_reason == "answer" and b.tool_calls == 2  # the copied call counts, then its own
    # The branches sampled their turns with top-k log-probs (the entropy needs them).
    assert all(c["params"].top_logprobs == 10 for c in engine.calls)


def test_arpo_without_branching_restarts_from_scratch_to_fill_the_group(tokenizer, local_tools):
    agent = Agent(ScriptedEngine(tokenizer, by_progress(tokenizer)), local_tools)
    cfg = ArpoConfig(initial_rollouts=1, branch_probability=0.0, entropy_weight=0.0, seed=0)
    trajs = asyncio.run(sample_group(agent, "a trip", 3, SamplingParams(seed=5), arpo=cfg))
    assert len(trajs) == 3 and all("arpo_parent" not in t.timings for t in trajs)


def test_branch_rule_favours_turns_more_uncertain_than_the_start():
    cfg = ArpoConfig(branch_probability=0.5, entropy_weight=0.2)
    assert should_branch(0.55, entropy=0.9, initial=0.1, cfg=cfg)  # 0.55 - 0.16 = 0.39 ≤ 0.5
    assert not should_branch(0.55, entropy=0.1, initial=0.1, cfg=cfg)  # 0.55 > 0.5
    assert not should_branch(0.45, entropy=0.0, initial=1.0, cfg=cfg)  # calmer than the start: 0.65
    assert should_branch(0.45, entropy=None, initial=None, cfg=cfg)
