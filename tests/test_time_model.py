"""The time model's projection (bench/time_model.py): the arithmetic that turns measured components into
minutes per step of the paper's 7B recipe on 16×A100, and the reading of the benchmarks' own results."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.gpu_shapes import SHAPES
from bench.time_model import Components, Recipe, components_from_results, project, side_seconds, step_flops

# The Qwen2.5-7B shape: 28 layers, attention width 28 × 128
SEVEN_B = dict(n_params=7_615_616_512, layers=28, attn_width=3584)


def comps(**kw) -> Components:
    base = dict(
        device="NVIDIA H100 80GB HBM3",
        rollout_wall_s=60.0,
        rollout_agents=32,
        learner_mfu=0.45,
        sync_s=0.21,
        score_plans_per_s=700.0,
        **SEVEN_B,
    )
    return Components(**{**base, **kw})


def test_a_steps_training_matches_the_issues_scale():
    # ~2.6M tokens at 7B is about 1.5e17 FLOPs, about 70 s on 16 A100s at 45 % MFU
    r = Recipe()
    assert step_flops(comps(), r) == pytest.approx(1.5e17, rel=0.05)
    # synchronous: the learner trains on all 16 GPUs
    assert project(comps(), r)["seconds"]["sync"]["training"] == pytest.approx(70, rel=0.05)


def test_rollout_scales_by_bandwidth_and_by_each_engines_share():
    r = Recipe()
    one = side_seconds(comps(rollout_wall_s=60.0, rollout_agents=32), r, 8, 8)["rollout"]  # 256 / 8 = 32 each
    assert one == pytest.approx(60.0 * 3.35 / 2.0)
    # measured at 16 agents while an engine's share is 32: twice the batches of sequential work
    assert side_seconds(comps(rollout_agents=16), r, 8, 8)["rollout"] == pytest.approx(2 * one)
    # more agents than an engine's share: no credit for the smaller batch
    assert side_seconds(comps(rollout_agents=64), r, 8, 8)["rollout"] == pytest.approx(one)
    assert side_seconds(comps(), r, 16, 16)["rollout"] == pytest.approx(one)  # 16 each: still the slowest's turns
    assert side_seconds(comps(), r, 4, 12)["rollout"] == pytest.approx(2 * one)


def test_asynchronous_is_the_slower_side_and_never_slower_than_synchronous():
    slow_rollout = project(comps(rollout_wall_s=300.0))
    assert slow_rollout["bound_by"] == "rollout"
    s = slow_rollout["seconds"]["async"]
    assert slow_rollout["async"] == pytest.approx((s["rollout"] + s["scoring"]) / 60, abs=0.01)
    slow_learner = project(comps(rollout_wall_s=5.0, learner_mfu=0.05))
    assert slow_learner["bound_by"] == "training"
    for p in (slow_rollout, slow_learner):
        assert p["sync"] == pytest.approx(sum(p["seconds"]["sync"].values()) / 60, abs=0.01)
        split = p["async_split"]
        assert split["rollout_gpus"] + split["learner_gpus"] == 16
    # the split is the best of all: slow rollout takes engines, a slow learner takes GPUs
    assert slow_rollout["async_split"]["rollout_gpus"] > slow_learner["async_split"]["rollout_gpus"]
    r = Recipe()
    for k in range(1, 16):
        sec = side_seconds(comps(rollout_wall_s=300.0), r, k, 16 - k)
        assert (
            slow_rollout["async"]
            <= round(max(sec["rollout"] + sec["scoring"], sec["training"] + sec["weight_sync"]) / 60, 2) + 0.01
        )
    assert project(comps(rollout_wall_s=60.0))["target_async_met"]
    assert not project(comps(rollout_wall_s=200.0))["target_async_met"]


def test_components_are_read_from_the_benchmarks_results(tmp_path):
    cfg = {**SHAPES["7b"]}
    (tmp_path / "tm_rollout.json").write_text(
        json.dumps(
            {
                "device": "NVIDIA H100 80GB HBM3",
                "load": {"agents": 32},
                "shapes": {
                    "7b": {
                        "params": SEVEN_B["n_params"],
                        "config": cfg,
                        "engines": {"vllm": {"wall_s": 48.0, "tokens_per_s": 2000.0, "turn_p99_s": 9.0}},
                    }
                },
            }
        )
    )
    (tmp_path / "tm_learner.json").write_text(json.dumps({"device": "H100", "mfu": 0.33, "tokens_per_s": 9000.0}))
    (tmp_path / "tm_sync.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"shape": "7b", "method": "nccl", "seconds": 0.25},
                    {"shape": "7b", "method": "nccl", "seconds": 0.21},
                    {"shape": "7b", "method": "files", "seconds": 14.7},
                    {"shape": "1.5b", "method": "nccl", "seconds": 0.1},
                ]
            }
        )
    )
    (tmp_path / "reward.json").write_text(
        json.dumps({"machine": "2 cores", "http": {"official": {"score_batch": {"plans_per_s": 759.1}}}})
    )
    c, shapes = components_from_results("tm", tmp_path)
    assert c == replace(comps(), rollout_wall_s=48.0, learner_mfu=0.33, sync_s=0.21, score_plans_per_s=759.1)
    assert [row["seconds"] for row in shapes["weight_sync"]["rows"]] == [0.25, 0.21]
    assert shapes["weight_sync"]["source"].endswith("tm_sync.json")
    # without a sync of its own, the weight-sync benchmark's 7B NCCL rows
    (tmp_path / "tm_sync.json").rename(tmp_path / "weight_sync_gpu.json")
    c, shapes = components_from_results("tm", tmp_path)
    assert c.sync_s == 0.21 and shapes["weight_sync"]["source"].endswith("weight_sync_gpu.json")


def test_the_projection_scales_from_the_card_the_components_were_measured_on():
    h100, h200 = project(comps()), project(comps(device="NVIDIA H200"))
    assert h200["seconds"]["sync"]["rollout"] == pytest.approx(h100["seconds"]["sync"]["rollout"] * 4.8 / 3.35)
    assert h200["ratios"]["hbm_tbs"] == [4.8, 2.0] and h100["ratios"]["bf16_tflops"] == [989.0, 312.0]
    with pytest.raises(SystemExit, match="no bandwidth figures"):
        project(comps(device="Some GPU"))


def test_missing_results_say_how_to_make_them(tmp_path):
    with pytest.raises(SystemExit, match="time_model.py measure"):
        components_from_results("tm", tmp_path)


# -- the prediction for a given machine (bench/recipe_7b.py compares it with `star train`'s steps) ----------


def test_a_colocated_step_is_the_sum_of_its_parts_on_the_machines_own_card():
    from bench.time_model import Machine, predict_step

    r = Recipe(prompts=32, group=8)
    m = Machine(device="NVIDIA H100 80GB HBM3", gpus=4, placement="colocated", engines=4, learner_gpus=4)
    sec = predict_step(comps(), r, m)
    # same card as the components: no bandwidth ratio; 64 agents an engine against 32 measured: twice the wall
    assert sec["rollout"] == pytest.approx(2 * 60.0)
    assert sec["weight_sync"] == pytest.approx(0.21)  # without a colocation record: the NCCL sync
    assert sec["step"] == pytest.approx(sec["rollout"] + sec["scoring"] + sec["training"] + sec["weight_sync"])
    # training over the 4 GPUs at the measured MFU
    from services.learner.flops import peak_flops

    assert sec["training"] == pytest.approx(step_flops(comps(), r) / (4 * peak_flops("H100") * 0.45))


def test_a_split_asynchronous_step_is_its_slower_side_and_a_synchronous_one_the_sum():
    from bench.time_model import Machine, predict_step

    r = Recipe()
    split = Machine(device="NVIDIA H100 80GB HBM3", gpus=8, placement="split", engines=4, learner_gpus=4)
    sec = predict_step(comps(), r, split)
    assert sec["step"] == pytest.approx(max(sec["rollout"] + sec["scoring"], sec["training"] + sec["weight_sync"]))
    on_policy = predict_step(comps(), r, replace(split, max_staleness=0))
    assert on_policy["step"] == pytest.approx(sum(v for k, v in on_policy.items() if k != "step"))


def test_a_colocated_sync_is_the_measured_cycle_scaled_by_parameters():
    from bench.time_model import Machine, colocated_sync_s, predict_step

    colocate = {
        "shape": "1.5b",
        "params": 1_000_000_000,
        "cycles": [
            {"colocate_sleep_s": 1.0, "time_sync_s": 0.5},
            {"colocate_sleep_s": 3.0, "time_sync_s": 0.5},
            {"colocate_sleep_s": 2.0, "time_sync_s": 0.5},
        ],
    }
    assert colocated_sync_s(comps(), colocate) == pytest.approx(2.5 * 7.615616512)
    m = Machine(device="NVIDIA H200", gpus=4, placement="colocated", engines=4, learner_gpus=4)
    sec = predict_step(comps(), Recipe(), m, colocate=colocate)
    assert sec["weight_sync"] == pytest.approx(2.5 * 7.615616512)
    # H200's faster memory shortens the rollout measured on an H100
    assert sec["rollout"] == pytest.approx(2 * 60.0 * 3.35 / 4.8)


def test_the_7b_record_names_why_a_run_fell_short(tmp_path):
    """A `star train` run that restarted its learner records each process's last error; a clean run records
    none (its logs may hold handled errors that explain nothing)."""
    from bench.recipe_7b import failures

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "learner.log").write_text("step 0\n[rank2]: torch.OutOfMemoryError: CUDA out of memory.\n")
    (tmp_path / "logs" / "rollout-0.log").write_text("INFO ready\n")
    said = "learner exited (1, failed); resuming from its checkpoint\n" * 3
    assert failures(tmp_path, said, 124) == {
        "learner_restarts": 3,
        "causes": {"learner": "[rank2]: torch.OutOfMemoryError: CUDA out of memory."},
    }
    assert failures(tmp_path, "rl: done in 62 s\n", 0) == {"learner_restarts": 0, "causes": {}}


# -- the recipe's own path: packed-row MFU, the long tail, the deployment's sync ---------------------------


def test_the_long_tail_waits_for_the_slowest_trajectory_and_a_deadline_shortens_it():
    from bench.time_model import tail_factor

    r = Recipe()
    tail = tail_factor(r, draws=100)
    assert 2.0 < tail <= r.context / r.trajectory_tokens  # the slowest of 256 is well past the mean, within the context
    assert tail_factor(r, draws=100, cut_quantile=0.95) < tail
    assert tail_factor(replace(r, prompts=1, group=1), draws=2000) == pytest.approx(1.0, abs=0.05)  # one: the mean
    slow = project(comps(), r, tail=tail)
    assert slow["seconds"]["sync"]["rollout"] == pytest.approx(tail * project(comps(), r)["seconds"]["sync"]["rollout"])


def test_over_sampling_waits_for_the_batchs_last_group_among_more():
    from bench.time_model import tail_factor

    r = Recipe()
    tails = [tail_factor(r, draws=100, oversample=o) for o in (0.0, 0.25, 1.0)]
    assert tails[0] == tail_factor(r, draws=100)  # none: the slowest trajectory of the step
    assert tails[0] > tails[1] > tails[2] > 1.0
    # one trajectory a group, twice the groups: the step waits for the median of 2 × prompts lengths
    single = replace(r, group=1, prompts=64)
    assert tail_factor(single, draws=300, oversample=1.0) < 1.0 < tail_factor(single, draws=300)


def test_an_asynchronous_step_overlaps_its_slowest_episode_with_other_steps():
    from bench.time_model import async_period

    r = Recipe()
    base = project(comps(), r)["seconds"]
    one, two = (project(comps(), r, tail=3.0, max_staleness=k)["seconds"] for k in (1, 2))
    assert one["sync"]["rollout"] == two["sync"]["rollout"] == pytest.approx(3.0 * base["sync"]["rollout"])
    sec = {"rollout": 70.0, "scoring": 0.0, "training": 100.0, "weight_sync": 0.0}
    # k + 1 steps take one slowest episode (3 × 70 s) and one training: (210 + 100) / 2 at k = 1
    assert async_period(sec, 3.0, 1) == pytest.approx(155.0)
    assert async_period(sec, 3.0, 0) == pytest.approx(310.0)  # on-policy: the episode, then the training
    assert async_period(sec, 3.0, 3) == 100.0  # a long window: the learner's side
    assert async_period(dict(sec, training=10.0), 1.0, 3) == 70.0  # never below an engine's share of the work
    # the same schedule stepped through: publish(s) = trained(s - k - 1), trained(s) = max(ended(s), trained(s - 1)) + T
    for k in (1, 2):
        trained: list[float] = []
        for s in range(60):
            start = trained[s - k - 1] if s - k - 1 >= 0 else 0.0
            trained.append(max(start + 210.0, trained[-1] if trained else 0.0) + 100.0)
        assert (trained[-1] - trained[-31]) / 30 == pytest.approx(async_period(sec, 3.0, k))
    assert project(comps(), r, tail=3.0, max_staleness=2)["async"] < project(comps(), r, tail=3.0)["async"]
    assert project(comps(), r, tail=1.0, max_staleness=3)["async"] == project(comps(), r)["async"]


def test_the_deployments_sync_replaces_the_nvlink_figure_per_mode():
    p = project(comps(), Recipe(), sync_s={"sync": 3.4, "async": 3.7})
    assert (p["seconds"]["sync"]["weight_sync"], p["seconds"]["async"]["weight_sync"]) == (3.4, 3.7)


def test_the_recipe_runs_figures_are_its_steps_after_the_first(tmp_path):
    from bench.time_model import cross_host_sync_s, recipe_path_inputs, recipe_run_figures

    assert recipe_run_figures(tmp_path) is None and cross_host_sync_s(tmp_path) is None
    steps = [
        {"step": 1, "mfu": 0.26, "tokens": 1.0e6, "split_s": {"sync": 7.5}},
        {"step": 2, "mfu": 0.39, "tokens": 1.2e6, "split_s": {"sync": 3.4}},
        {"step": 3, "mfu": 0.41, "tokens": 1.3e6, "split_s": {"sync": 3.6}},
    ]
    (tmp_path / "recipe_7b.json").write_text(
        json.dumps({"device": "NVIDIA H200", "gpus": 4, "steps": steps, "trajectories": {"mean_tokens": 10000}})
    )
    (tmp_path / "weight_sync_hosts.json").write_text(
        json.dumps(
            {
                "device": "2× NVIDIA H200",
                "shapes": [{"shape": "1.5b", "nccl": {"seconds": 0.9}}, {"shape": "7b", "nccl": {"seconds": 3.7}}],
            }
        )
    )
    run = recipe_run_figures(tmp_path)
    assert run["mfu"] == pytest.approx(0.40) and run["sync_s"] == pytest.approx(3.5) and run["steps"] == 2
    inputs = recipe_path_inputs(comps(), tmp_path)
    assert inputs["components"].learner_mfu == pytest.approx(0.40)
    assert inputs["sync_s"] == {"sync": pytest.approx(3.5), "async": 3.7}
    assert inputs["tail_cut_p95"] < inputs["tail"]
