"""Request-level concurrency and deadlines: episodes, not groups, hold a worker's engine slots."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.common.schemas import RolloutTask, SamplingParams
from services.common.streams import StreamNames, publish, read_all
from services.rollout.agent import Agent, turn_seed
from services.rollout.capacity import engine_episodes, episodes_for_kv, inflight_budget, kv_bytes_per_token
from services.rollout.config import RolloutConfig
from services.rollout.engines.scripted import ScriptedEngine
from services.rollout.group import EpisodeSlots, sample_group
from services.rollout.protocol import format_answer
from services.rollout.service import RolloutService
from services.rollout.worker import GROUP, RolloutWorker
from tests.rollout.test_worker import QUERY, run_until

ANSWER = format_answer("Day 1:\nCurrent City: Chicago")


def task(n: int, group: int = 2, **sampling) -> RolloutTask:
    return RolloutTask(
        run_id="run",
        task_id=f"task-{n}",
        prompt_id=f"p-{n}",
        query=QUERY,
        group_size=group,
        sampling=SamplingParams(seed=n, max_tokens_per_turn=64, max_context_tokens=4096, **sampling),
    )


def first_turn_of(task_seed: int, sample: int) -> int:
    """The seed of the first turn of sample `sample` of a task seeded `task_seed` (what the engine sees)."""
    return turn_seed(task_seed + sample, 0)


def slow_engine(tokenizer, slow: dict[int, float]) -> ScriptedEngine:
    """Answers at once, except the first turns whose seeds `slow` maps to a duration."""
    return ScriptedEngine(tokenizer, lambda ids, turn: ANSWER, delay_s=lambda params, _r: slow.get(params.seed, 0.0))


def written_order(client, names) -> list[str]:
    return [data["task_id"] for _, data in read_all(client, names.trajectories)]


def test_a_slow_episode_does_not_hold_its_groups_other_slots(redis_client, tokenizer, local_tools, loop):
    # a budget of 2 episodes, groups of 2: task-1's sample 0 takes 3 s; when its sample 1 ends, its slot
    # goes to task-2, whose group is written long before task-1's (a group-per-slot worker waits 3 s)
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    engine = slow_engine(tokenizer, {first_turn_of(1, 0): 3.0})
    service = RolloutService(engine, local_tools)
    publish(client, names.tasks, task(1))
    publish(client, names.tasks, task(2))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w", max_inflight_episodes=2)
    t0 = time.monotonic()
    run_until(worker, lambda: "task-2" in written_order(client, names))
    assert time.monotonic() - t0 < 2.5
    assert written_order(client, names) == ["task-2", "task-2"]
    assert client.xpending(names.tasks, GROUP)["pending"] >= 1  # task-1 still in flight, unacknowledged


def test_the_worker_never_runs_more_episodes_than_its_budget(redis_client, tokenizer, local_tools, loop):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    peak = []
    engine = ScriptedEngine(
        tokenizer, lambda ids, turn: ANSWER, delay_s=lambda p, r: peak.append(engine.in_flight) or 0.05
    )
    service = RolloutService(engine, local_tools)
    for n in range(6):
        publish(client, names.tasks, task(n, group=3))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w", max_inflight_episodes=4)
    run_until(worker, lambda: client.xlen(names.trajectories) >= 18)
    assert max(peak) == 4  # full, and never over
    assert sorted(written_order(client, names)) == sorted(f"task-{n}" for n in range(6) for _ in range(3))
    assert client.xpending(names.tasks, GROUP)["pending"] == 0


def test_an_episode_past_its_deadline_ends_as_deadline_and_its_turn_is_aborted(
    redis_client, tokenizer, local_tools, loop
):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    engine = slow_engine(tokenizer, {first_turn_of(7, 1): 30.0})
    service = RolloutService(engine, local_tools)
    publish(client, names.tasks, task(7, episode_timeout_s=0.5))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w", max_inflight_episodes=4)
    t0 = time.monotonic()
    run_until(worker, lambda: client.xlen(names.trajectories) >= 2)
    assert time.monotonic() - t0 < 5
    trajs = sorted((d for _, d in read_all(client, names.trajectories)), key=lambda d: d["sample_index"])
    assert [t["finish_reason"] for t in trajs] == ["answer", "deadline"]
    assert "aborted" in trajs[1]["error"] and sum(trajs[1]["loss_mask"]) == 0
    assert len(engine.cancelled) == 1  # the engine's request was cancelled, not left running


def test_a_turn_past_its_own_limit_is_cut_though_the_episode_has_time(tokenizer, local_tools):
    engine = slow_engine(tokenizer, {first_turn_of(3, 0): 30.0})
    sampling = SamplingParams(seed=3, turn_timeout_s=0.3, episode_timeout_s=60)
    trajs = asyncio.run(sample_group(Agent(engine, local_tools), "a trip", 2, sampling))
    assert [t.finish_reason for t in trajs] == ["deadline", "answer"]
    assert "0.3 s budget" in trajs[0].error


def test_a_group_deadline_cuts_episodes_still_waiting_for_a_slot(tokenizer, local_tools):
    # one slot, four episodes of 0.3 s, a group limit of 0.5 s: two run, the others start past it
    engine = ScriptedEngine(tokenizer, lambda ids, turn: ANSWER, delay_s=lambda p, r: 0.3)
    sampling = SamplingParams(seed=1, group_timeout_s=0.5)
    trajs = asyncio.run(sample_group(Agent(engine, local_tools), "a trip", 4, sampling, slots=EpisodeSlots(1)))
    reasons = [t.finish_reason for t in trajs]
    assert reasons[0] == "answer" and reasons[-1] == "deadline" and set(reasons) == {"answer", "deadline"}


def test_episode_slots_refuse_a_zero_budget():
    with pytest.raises(ValueError, match="at least 1"):
        EpisodeSlots(0)


# -- the budget's default ---------------------------------------------------------------------------

QWEN7B = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584}


def test_kv_bytes_per_token_follow_the_model_shape():
    assert kv_bytes_per_token(QWEN7B) == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token({**QWEN7B, "head_dim": 64}, dtype_bytes=1) == 2 * 28 * 4 * 64
    with pytest.raises(ValueError, match="shape field"):
        kv_bytes_per_token({"num_hidden_layers": 2})
    assert episodes_for_kv(10 * 57344 * 1000, 57344, 1000) == 10
    assert episodes_for_kv(1, 57344, 1000) == 1


def test_the_episode_budget_derives_from_the_engines_memory_share(tmp_path):
    from services.rollout.engines.vllm_engine import ENGINE_RESERVE_BYTES

    (tmp_path / "config.json").write_text(json.dumps(QWEN7B))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    card = 80 * 2**30
    full = engine_episodes(tmp_path, share=0.9, card_bytes=card, tensor_parallel=1, episode_tokens=30_000)
    kv = int(0.9 * card) - 1024 - ENGINE_RESERVE_BYTES
    assert full == kv // (57344 * 30_000)
    short = engine_episodes(tmp_path, share=0.9, card_bytes=card, tensor_parallel=1, episode_tokens=6_000)
    assert short == kv // (57344 * 6_000) > full
    config = RolloutConfig(engine="vllm", max_model_len=30_000)
    assert inflight_budget(config, str(tmp_path), card_bytes=card) == full
    assert inflight_budget(config.model_copy(update={"max_inflight_episodes": 7}), str(tmp_path), card) == 7
    assert inflight_budget(config.model_copy(update={"concurrency": 3, "group_size": 8}), str(tmp_path), card) == 24
    assert inflight_budget(config, str(tmp_path), card_bytes=None) >= 1  # no GPU here: the default


def test_a_written_group_is_summed_up_in_one_log_line():
    from services.common.schemas import Trajectory
    from services.rollout.worker import group_summary

    def traj(i: int, finish: str, version: int, total_s: float) -> Trajectory:
        return Trajectory(
            run_id="r",
            task_id="r/s00002/p007",
            prompt_id="p",
            group_id="r/s00002/p007",
            sample_index=i,
            policy_version=version,
            finish_reason=finish,
            step=2,
            timings={"total_s": total_s},
        )

    summary = group_summary([traj(0, "answer", 1, 40.0), traj(1, "deadline", 0, 612.34), traj(2, "answer", 1, 3.0)])
    assert summary == {
        "group": "r/s00002/p007",
        "step": 2,
        "episodes": 3,
        "finish": {"answer": 2, "deadline": 1},
        "versions": [0, 1],
        "slowest_s": 612.3,
    }


def test_a_workers_engine_is_sized_to_its_episode_budget_unless_the_recipe_sizes_it():
    from services.common.schemas import VllmArgs
    from services.rollout.capacity import engine_for_budget

    config = RolloutConfig(engine="vllm")
    assert config.vllm.max_num_seqs is None  # vLLM's card default unless sized
    assert engine_for_budget(config, 443).vllm.max_num_seqs == 443
    assert config.vllm.max_num_seqs is None  # a copy: the caller's config is left as it was
    assert engine_for_budget(config.model_copy(update={"vllm": VllmArgs(max_num_seqs=64)}), 443).vllm.max_num_seqs == 64
    assert engine_for_budget(config.model_copy(update={"tensor_parallel_size": 4}), 2).vllm.max_num_seqs == 4
    transformers = RolloutConfig(engine="transformers")
    assert engine_for_budget(transformers, 443) is transformers


def test_the_card_is_read_through_vllms_platform_before_torch(monkeypatch):
    # NVML (vLLM's CUDA platform) reads the card without making a CUDA context in the worker's process
    import sys
    import types

    from services.rollout import capacity

    class Platform:
        @staticmethod
        def is_cuda() -> bool:
            return True

        @staticmethod
        def get_device_total_memory(device_id: int = 0) -> int:
            assert device_id == 0
            return 80 * 2**30

    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=Platform))
    assert capacity._card_bytes() == 80 * 2**30
