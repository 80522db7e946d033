"""The TRL adapter against TRL's own GRPOTrainer, over real HTTP to our real episode API.

Runs in `.venv-trl` (scripts/test-adapters); skipped where TRL is not installed. `served` (conftest.py) is the
live episode API with the fixture's plan cases and their `star score` rewards. The training step is TRL's
GRPOTrainer on CPU with a tiny random Qwen2 (the offline Qwen2.5 tokenizer, Qwen2.5's chat template as TRL
ships it), our environment as `environment_factory` and our reward function.
"""

from __future__ import annotations

import json

import pytest

from tests.environments.adapter_server import fixture_query_ids
from tests.environments.conftest import library_or_skip

library_or_skip("trl", ".venv-trl")


# starts the episode API (conftest's `served`); one GRPO step on CPU
pytestmark = pytest.mark.slow


def _env(served, **options):
    from services.environments.trl import TravelPlannerEnv

    return TravelPlannerEnv(served.url, served.token, **options)


def _row(case: dict) -> dict:
    return {"query": case["query"]} if case["query_changed"] else {"query_id": case["query_id"], "split": "train"}


def test_tool_schemas_are_the_episode_apis(served):
    """What TRL renders for the model (transformers' schema of each tool method) names the server's tools and
    parameters."""
    from transformers.utils import get_json_schema

    from services.environments.trl import TravelPlannerEnv

    with served.client() as client:
        started = client.start(query_id="1", split="train", tool_format="native")
        client.close(started.episode_id)
    server = {t["function"]["name"]: t["function"]["parameters"] for t in started.tools}
    ours = {}
    for name in server:
        schema = get_json_schema(getattr(TravelPlannerEnv, name))["function"]
        assert schema["description"]
        ours[name] = schema["parameters"]
    assert set(ours) == set(server) and len(server) == 6
    for name, params in server.items():
        assert set(ours[name]["properties"]) == set(params["properties"]), name
        assert set(ours[name].get("required", [])) == set(params["required"]), name


def test_tools_run_inside_the_episode_and_its_budget(served):
    case = served.cases[0]
    env = _env(served, max_tool_calls=2)
    assert env.SearchCity("Texas") == "Error: no episode is running"
    env.reset(**_row(case), prompt=[{"role": "user", "content": "ignored"}])
    try:
        assert case["query"]["dest"] in env.SearchAccommodation(case["query"]["dest"])
        with served.client() as client:
            assert client.state(env.episode_id).tool_calls_used == 1
        assert not env.SearchRestaurant(case["query"]["dest"]).startswith("Error:")
        spent = env.SearchAttraction(case["query"]["dest"])  # the third call of a budget of two
        assert spent.startswith("Error:") and "2" in spent
    finally:
        env._close()


def test_reset_closes_the_episode_before(served):
    env = _env(served)
    env.reset(**_row(served.cases[0]))
    first = env.episode_id
    env.reset(**_row(served.cases[0]))
    try:
        assert env.episode_id != first
        from services.episodes.client import EpisodeError

        with served.client() as client, pytest.raises(EpisodeError) as err:
            client.state(first)
        assert err.value.status == 404
    finally:
        env._close()


@pytest.mark.parametrize("mode", ["official", "strict"])
def test_reward_equals_star_score_on_gold_and_broken_plans(served, mode):
    from services.environments.trl import travelplanner_reward

    assert {c["query_id"] for c in served.cases} == fixture_query_ids()
    assert any(c["breaks"] for c in served.cases) and any(c["breaks"] is None for c in served.cases)
    env = _env(served, mode=mode, reward="sum")
    mismatches = []
    try:
        for case in served.cases:
            env.reset(**_row(case))
            completion = [{"role": "assistant", "content": json.dumps(case["plan"])}]
            [got] = travelplanner_reward([completion], [env])
            assert env.result.mode == mode
            if got != case["star_score"][mode]:
                mismatches.append((case["name"], got, case["star_score"][mode]))
    finally:
        env._close()
    assert not mismatches


def test_one_grpo_step_of_a_tiny_model_through_the_environment(served, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    from services.common.settings import get_settings
    from services.environments.trl import (
        close_environments,
        environment_factory,
        travelplanner_dataset,
        travelplanner_reward,
    )
    from services.models import tiny_qwen2

    # the tokenizer and model are built here, by this environment's transformers, not shared with the main one's
    monkeypatch.setenv("STAR_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    folder = tiny_qwen2(tmp_path / "tiny", hidden=64, layers=1, heads=1, kv_heads=1, max_positions=8192)
    get_settings.cache_clear()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.chat_template = qwen2_5_chat_template  # Qwen2.5-Instruct's, with its tools block
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    with served.client() as client:
        dataset = travelplanner_dataset(client, "train", ["1", "2"])
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=12,
        max_tool_calling_iterations=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        temperature=1.0,
        gradient_checkpointing=False,  # a model this small has nothing to save, and recomputing costs CPU time
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[travelplanner_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=environment_factory(served.url, served.token, reward="sum"),
    )
    trainer.train()

    assert trainer.state.global_step == 1
    envs = [e for pool in trainer._environment_pool.values() for e in pool if e.result is not None]
    assert len(envs) == 2  # 1 prompt x 2 generations, each scored once by the episode API
    with served.client() as client:
        for env in envs:
            stored = client.state(env.episode_id)
            assert stored.result is not None and stored.result.reward == env.result.reward
    logged = next(h for h in trainer.state.log_history if "rewards/travelplanner_reward/mean" in h)
    mean = sum(e.result.reward for e in envs) / len(envs)
    assert logged["rewards/travelplanner_reward/mean"] == pytest.approx(mean)
    assert any("travelplanner/success_strict" in h for h in trainer.state.log_history)
    assert "loss" in trainer.state.log_history[0] and all(torch.isfinite(p).all() for p in model.parameters())

    close_environments(envs)


def test_unscorable_rollouts(served):
    """JSON that is no plan is read as text (reward 0); an episode gone before the reward gives None."""
    from services.environments.trl import travelplanner_reward

    env = _env(served)
    try:
        env.reset(**_row(served.cases[0]))
        assert travelplanner_reward([[{"role": "assistant", "content": "[1, 2]"}]], [env]) == [0.0]
        env.reset(**_row(served.cases[0]))
        with served.client() as client:
            client.close(env.episode_id)
        with pytest.warns(RuntimeWarning, match="not scored"):
            assert travelplanner_reward(["Day 1: ..."], [env]) == [None]
        with pytest.raises(ValueError, match="query_id"):
            env.reset(prompt=[])
    finally:
        env._close()
