"""bench/recipe_1p5b.py's parts on CPU: the variants' recipe overrides (loaded by the real config), the steps' figures
from a run's metrics, the trained episodes' turn scripts, the rollout worker's environment for the ceiling, the
record and its Markdown and PNG; the time model carried to the 1.5B shape; and the whole script on the tiny recipe
(slow)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import recipe_1p5b as r
from bench.time_model import at_shape, components_from_results, rollout_ceiling_tps
from services.pipeline.config import load_pipeline_config
from services.pipeline.placement import GiB, ModelSize, placement_for_recipe

ROOT = Path(__file__).resolve().parents[1]
QWEN_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def args(**kw) -> argparse.Namespace:
    base = dict(
        smoke=False,
        steps=10,
        prompts=4,
        oversample=0.25,
        group_timeout_s=40.0,
        set=[],
        tool_calls=10,
        turn_tokens=120,
        answer_tokens=1000,
    )
    return argparse.Namespace(**{**base, **kw})


def test_the_variants_load_as_the_recipe_with_deadlines_and_over_sampling_on_or_off(tmp_path):
    on = load_pipeline_config(ROOT / r.RECIPE, r.run_items(args(), tmp_path / "model", "on", 10))
    off = load_pipeline_config(ROOT / r.RECIPE, r.run_items(args(), tmp_path / "model", "off", 6))
    assert on.rl.sampling.forced_turns.shape == "teacher" and on.rl.batch_prompts == 4
    assert on.rl.oversample == 0.25 and on.rl.sampling.group_timeout_s == 40.0 and on.rl.late_groups == "partial"
    assert off.rl.oversample == 0 and off.rl.sampling.group_timeout_s == 5400.0 and off.rl.max_steps == 6
    # enough queries for every published prompt of every step, over-sampled ones included
    assert on.synth.rl_queries >= r.published(4, 0.25) * 10 and r.published(4, 0.25) == 5
    assert on.world.synthetic_size == "full" and on.deployment.learner_ranks is None
    # on one H200 the recipe's layout is derived: colocated, one engine asleep while the learner trains
    p = placement_for_recipe(on, ["0"], 141 * GiB, ModelSize.from_hf_config(QWEN_1_5B))
    assert p.colocated and p.derived and len(p.engine_devices) == 1


def test_the_rollout_workers_settings_are_the_fleets(tmp_path):
    from services.rollout.config import load_rollout_config

    config = load_pipeline_config(ROOT / r.RECIPE, r.run_items(args(), tmp_path / "model", "on", 10))
    p = placement_for_recipe(config, ["3"], 141 * GiB, ModelSize.from_hf_config(QWEN_1_5B))
    assert p.engine_devices_env(0) == {"CUDA_VISIBLE_DEVICES": "3"}
    cfg = load_rollout_config(r.write_worker_config(config, p, tmp_path / "model", tmp_path / "worker.json"))
    assert cfg.kv_cache_from_share is True and cfg.gpu_memory_utilization == pytest.approx(
        p.engine_memory_share, abs=0.005
    )
    assert cfg.vllm.enable_sleep_mode is True
    assert cfg.max_model_len == config.rl.sampling.engine_max_len
    assert cfg.episode_tokens == 30000 and cfg.model == str(tmp_path / "model")


def metrics_row(step: int, rollout: float, idle: float, hist: dict[str, int]) -> dict:
    return {
        "step": step,
        "time_step_wall_s": rollout + idle + 20.0,
        "split_rollout_s": rollout,
        "split_scoring_s": 0.1,
        "split_training_s": 18.0,
        "split_sync_s": 1.9,
        "split_idle_s": idle,
        "packed_rows": 7,
        "tokens": 200_000,
        "samples_trained": 32,
        "rollout/sampled_tokens_mean": 1000.0,
        "rollout/total_s_max": 33.0,
        "groups_late": 1,
        "groups_partial": 1,
        "episodes_cut": 2,
        **{f"trajectory_tokens/{k}": v for k, v in hist.items()},
    }


def test_step_figures_and_the_summary_from_a_runs_metrics(tmp_path):
    rows = [
        metrics_row(1, 90.0, 0.0, {"le_8192": 30, "le_16384": 2}),
        metrics_row(2, 16.0, 4.0, {"le_8192": 32}),
        metrics_row(3, 0.5, 0.0, {"le_4096": 1, "le_8192": 31}),
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    steps = r.step_figures(tmp_path)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[1]["agent_tokens_per_s"] == pytest.approx(32_000 / 16.0)
    assert steps[2]["agent_tokens_per_s"] is None  # no rollout wait to speak of
    assert steps[0]["length_histogram"] == {"le_8192": 30, "le_16384": 2}
    assert steps[1]["split_share"]["idle"] == pytest.approx(4.0 / 40.0)
    assert steps[0]["groups"]["episodes_cut"] == 2
    s = r.summary(steps)  # steps after the first
    assert s["measured_step_s"] == pytest.approx((40.0 + 20.5) / 2)
    assert s["idle_share"] == pytest.approx(4.0 / 60.5)
    assert s["agent_tokens_per_s"] == pytest.approx(64_000 / 16.5)
    assert r.summary([])["measured_step_s"] is None


class Words:
    """A tokenizer of whitespace words."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": text.split()}


def test_episode_scripts_are_the_trained_turns_and_what_the_environment_added(tmp_path):
    messages = [
        {"role": "system", "content": "a b c"},
        {"role": "user", "content": "d e"},
        {"role": "assistant", "content": "x", "tokens": 71},
        {"role": "user", "content": "r " * 10},
        {"role": "assistant", "content": "y", "tokens": 60},
        {"role": "user", "content": "s " * 4},
        {"role": "assistant", "content": "plan", "tokens": 400},
    ]
    rows = [{"messages": messages}, {"messages": [{"role": "system", "content": "a"}]}, {"messages": messages}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    scripts = r.episode_scripts(tmp_path, Words())
    assert len(scripts) == 2  # an episode without a turn gives none
    first = scripts[0]
    assert first["context"] == 3 + 5 + 2 + 5
    assert [(t[0], t[1]) for t in first["turns"]] == [(71, 15), (60, 9), (400, 0)]
    assert len({t[2] for s in scripts for t in s["turns"]}) == 6  # a seed per turn


def test_the_record_its_markdown_and_its_plot(tmp_path):
    steps = [
        {
            "step": i,
            "wall_s": 40.0,
            "split_s": {k: 8.0 for k in r.SPLIT},
            "packed_rows": 6,
            "sampled_tokens": 9e3,
            "agent_tokens_per_s": 1100.0,
            "length_histogram": {"le_8192": 32},
            "groups": {"groups_surplus_trained": 1.0, "groups_surplus_dropped": float(i == 2)},
            "longest_episode_s": 10.0 * i,
        }
        for i in (1, 2)
    ]
    variants = {
        "on": {"settings": r.variant_items("on", args()), "steps": steps, **r.summary(steps), "rc": 0},
        "off": {"settings": r.variant_items("off", args()), "skipped": "no time left"},
    }
    ceiling = {"tokens_per_s": 1250.0, "episodes": 80, "scripts": 20, "inflight": 80, "rc": 0}
    rec = r.record(args(smoke=True, gpus=0), None, variants, ceiling, ["placement: CPU"])
    assert rec["rollout_efficiency"] == pytest.approx(rec["agent_tokens_per_s"] / 1250.0)
    assert rec["idle_share"] == pytest.approx(0.2) and rec["measured_step_s"] == 40.0
    md = r.markdown(rec)
    assert "## Variant off" in md and "Not run: no time left" in md and "Rollout efficiency" in md
    tail = rec["deadlines_effect"]["on"]  # the long tail over the variant's steps; the skipped variant has none
    assert (
        tail["groups_surplus_trained"] == 2
        and tail["groups_surplus_dropped"] == 1
        and "off" not in rec["deadlines_effect"]
    )
    assert tail["slowest_episode_s_median"] == 15.0 and tail["slowest_episode_s_max"] == 20.0
    assert (
        not tail["deadline_fired"] and "The group deadline never fired" in md and "| on | 0 | 0 | 0 | 0 | 2 | 1 |" in md
    )
    r.plot(rec, tmp_path / "split.png")
    assert (tmp_path / "split.png").stat().st_size > 1000


def test_the_time_model_is_carried_to_the_1_5b_shape():
    comps, _ = components_from_results()
    small, how = at_shape(comps, "1.5b")
    assert small.n_params == pytest.approx(1.54e9, rel=0.01) and small.layers == 28 and small.attn_width == 1536
    ceilings = rollout_ceiling_tps("1.5b")
    assert small.rollout_wall_s < comps.rollout_wall_s and "rollout ÷" in how and ceilings
    assert at_shape(comps, "7b")[0] is comps


def test_bad_variants_are_refused(capsys):
    with pytest.raises(SystemExit):
        r.main(["--variants", "sideways", "--smoke"])
    assert "--variants" in capsys.readouterr().err


@pytest.mark.slow
def test_the_smoke_runs_a_variant_through_star_train(tmp_path):
    # the variant with deadlines and over-sampling, the one with more to go wrong; both variants share every
    # other line of the script (a second `star train` would double a test that already takes minutes)
    assert r.main(["--smoke", "--variants", "on", "--work", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "recipe_1p5b_h200_smoke.json").read_text())
    assert len(rec["variants"]["on"]["steps"]) == 2 and "off" not in rec["variants"]
    assert rec["steps"][0]["split_s"]["training"] > 0 and rec["steps"][0]["length_histogram"]
    assert (tmp_path / "recipe_1p5b_h200_smoke.png").is_file()
