"""Recipes: every shipped config loads; the paper's numbers are where they belong; bad files fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.learner.config import EngineConfig
from services.pipeline.config import ConfigError, dump_config, load_pipeline_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_load_and_round_trip(path, tmp_path):
    config = load_pipeline_config(path)
    again = tmp_path / "resolved.yaml"
    again.write_text(dump_config(config))
    assert load_pipeline_config(again) == config


@pytest.mark.parametrize(
    "scale,algorithm,reward,sft_epochs",
    [("1.5b", "arpo", "macro", 6), ("3b", "grpo", "curriculum", 4), ("7b", "grpo", "sum", 4)],
)
def test_paper_recipes(scale, algorithm, reward, sft_epochs):
    c = load_pipeline_config(CONFIGS / f"qwen2.5-{scale}-{algorithm}-{reward}.yaml")
    assert (c.rl.algorithm, c.rl.reward, c.sft.epochs) == (algorithm, reward, sft_epochs)
    assert (c.rl.batch_prompts, c.rl.group_size, c.rl.lr, c.rl.epochs) == (32, 8, 2e-6, 5)
    assert (c.sft.lr, c.sft.batch_size, c.sft.warmup_ratio) == (5e-6, 32, 0.1)
    assert c.rl.sampling.temperature == 1.0 and c.rl.sampling.max_context_tokens == 30000
    assert c.rl.sampling.max_tool_calls == 60
    assert (c.eval.sampling.temperature, c.eval.sampling.top_p) == (0.6, 0.95)
    assert c.synth.mix == (4, 3, 3) and c.synth.rl_queries == 1000


def test_overrides_apply_and_are_validated():
    c = load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.group_size=4", "rl.sampling.temperature=0.7"])
    assert c.rl.group_size == 4 and c.rl.sampling.temperature == 0.7
    with pytest.raises(ConfigError, match="rl.group_size"):
        load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.group_size=0"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_pipeline_config(CONFIGS / "tiny.yaml", ["nonsense"])


@pytest.mark.parametrize(
    "text,message",
    [
        ("name: x\n", "model"),
        ("name: x\nmodel: {path: /m, tiny: {}}\n", "exactly one"),
        ("name: x\nmodel: {path: /m}\nstages: [rl, sft]\n", "order"),
        ("name: x\nmodel: {path: /m}\nrl: {bogus: 1}\n", "rl.bogus"),
        ("[1, 2", "not valid YAML"),
        ("- a\n- b\n", "mapping"),
    ],
)
def test_bad_recipes_fail_with_a_message(tmp_path, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_pipeline_config(f)
    with pytest.raises(ConfigError, match="no recipe"):
        load_pipeline_config(tmp_path / "missing.yaml")


def test_the_learner_section_reaches_the_learner_engine_config():
    import yaml

    written = yaml.safe_load((CONFIGS / "smollm2-proof.yaml").read_text())["learner"]
    config = load_pipeline_config(CONFIGS / "smollm2-proof.yaml")
    engine = config.learner.engine(config.services.zero_stage, config.seed)
    assert written["micro_batch_rows"] != EngineConfig().micro_batch_rows  # the recipe sets its own
    assert {k: getattr(engine, k) for k in written} == written
    assert engine.zero_stage == config.services.zero_stage == 2


@pytest.mark.parametrize(
    "stages,expected",
    [
        (["synth", "sft", "rl", "eval"], "base"),  # a whole run starts from the base model
        (["rl"], "sft-model"),  # RL alone, after SFT in the same folder
        (["rl", "eval"], "sft-model"),
        (["eval"], "rl-model"),  # evaluation alone: the newest model
        (["sft"], "base"),  # SFT again starts from the base model
    ],
)
def test_a_stage_run_on_its_own_starts_from_the_model_the_stages_before_it_made(stages, expected):
    from services.controller.train import starting_model

    outputs = {"synth": {"sft_data": "x"}, "sft": {"model": "sft-model"}, "rl": {"model": "rl-model"}}
    assert starting_model("base", outputs, stages) == expected
    assert starting_model("base", {"synth": {}}, ["rl"]) == "base"  # no SFT made: the base model


def test_the_rl_section_reaches_the_learner_config(tmp_path):
    from services.common.streams import StreamNames
    from services.controller.learner_config import rl_config
    from services.learner.config import RLConfig
    from services.pipeline.stage import Run

    config = load_pipeline_config(CONFIGS / "smollm2-proof.yaml")
    assert config.rl.mini_batches > 1  # the recipe sets its own
    path = rl_config(Run(config, tmp_path), "model", StreamNames("t"), "redis://x", total_steps=16)
    learner = RLConfig.model_validate_json(path.read_text())
    assert (learner.mini_batches, learner.lr, learner.total_steps) == (config.rl.mini_batches, config.rl.lr, 16)
    assert learner.filters.max_staleness == config.rl.max_staleness
    assert learner.kl_coef == config.rl.kl_coef == 0.05  # the proof recipe anchors to the SFT model
    kl_free = load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.kl_coef=0"])
    path = rl_config(Run(kl_free, tmp_path), "model", StreamNames("t"), "redis://x", total_steps=16)
    assert RLConfig.model_validate_json(path.read_text()).kl_coef == 0.0
    with pytest.raises(ConfigError, match="kl_coef"):
        load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.kl_coef=-1"])
    assert learner.negative_scale == 1.0  # GRPO as the paper unless the recipe says otherwise
    positive = load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.negative_scale=0"])
    path = rl_config(Run(positive, tmp_path), "model", StreamNames("t"), "redis://x", total_steps=16)
    assert RLConfig.model_validate_json(path.read_text()).negative_scale == 0.0
    with pytest.raises(ConfigError, match="negative_scale"):
        load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.negative_scale=2"])


def test_the_loss_bounds_and_temperature_reach_the_learner_config(tmp_path):
    from services.common.streams import StreamNames
    from services.controller.learner_config import rl_config
    from services.learner.config import RLConfig
    from services.pipeline.stage import Run

    def learner(overrides: list[str]) -> RLConfig:
        config = load_pipeline_config(CONFIGS / "smollm2-proof.yaml", overrides)
        return RLConfig.model_validate_json(
            rl_config(Run(config, tmp_path), "model", StreamNames("t"), "redis://x", total_steps=16).read_text()
        )

    shipped = learner([])
    assert (shipped.log_ratio_clamp, shipped.dual_clip_c, shipped.importance_sampling) == (20.0, 3.0, "tis")
    assert shipped.temperature == 1.0
    chosen = learner(
        [
            "rl.importance_sampling=mis",
            "rl.is_low=0.125",
            "rl.is_high=8",
            "rl.loss_agg=group-token-mean",
            "rl.sampling.temperature=0.7",
            "rl.dual_clip_c=null",
        ]
    )
    assert (chosen.importance_sampling, chosen.is_low, chosen.is_high) == ("mis", 0.125, 8.0)
    assert (chosen.loss_agg, chosen.temperature, chosen.dual_clip_c) == ("group-token-mean", 0.7, None)
    on_policy = learner(["rl.importance_sampling=off", "rl.max_staleness=0"])
    assert on_policy.importance_sampling == "off"  # YAML's bare off is false
    # the proof recipe samples under top_p 0.95: its recorded log-probs are the cut distribution's, which
    # stand as "old" only for an importance correction; at top_p 1.0 they are the learner's own
    from services.learner.trainer import old_policy_from_rollouts

    assert on_policy.sampling_cut and not old_policy_from_rollouts(on_policy)
    assert shipped.sampling_cut and old_policy_from_rollouts(shipped)  # tis: the behaviour policy of its weights
    assert old_policy_from_rollouts(chosen)  # mis likewise
    whole = learner(["rl.sampling.top_p=1.0", "rl.sampling.temperature=0.7"])
    assert not whole.sampling_cut and old_policy_from_rollouts(whole)
    assert learner(["rl.sampling.top_p=1.0", "rl.sampling.top_k=20"]).sampling_cut
    with pytest.raises(ConfigError, match="temperature must be above 0"):
        load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.sampling.temperature=0"])
    for bad in ("rl.importance_sampling=sometimes", "rl.is_high=0.5", "rl.dual_clip_c=1", "rl.loss_agg=sum"):
        with pytest.raises(ConfigError):
            load_pipeline_config(CONFIGS / "smollm2-proof.yaml", [bad])


def test_stale_samples_under_a_sampling_cut_need_an_importance_correction():
    # the proof recipe samples at top_p 0.95 with max_staleness 3, so it corrects with tis
    proof = CONFIGS / "smollm2-proof.yaml"
    assert load_pipeline_config(proof).rl.importance_sampling == "tis"
    with pytest.raises(
        ConfigError,
        match=r"rl: .*max_staleness 3 with rl.sampling's top_p 0.95 needs an importance "
        r"correction: set rl.importance_sampling to tis or mis",
    ):
        load_pipeline_config(proof, ["rl.importance_sampling=off"])
    with pytest.raises(ConfigError, match=r"max_staleness 1 with rl.sampling's top_k 20 needs"):
        load_pipeline_config(
            proof, ["rl.importance_sampling=off", "rl.max_staleness=1", "rl.sampling.top_p=1.0", "rl.sampling.top_k=20"]
        )
    # either correction, no cut, or no staleness is accepted
    for fine in (
        ["rl.importance_sampling=mis"],
        ["rl.importance_sampling=off", "rl.sampling.top_p=1.0"],
        ["rl.importance_sampling=off", "rl.max_staleness=0"],
    ):
        assert load_pipeline_config(proof, fine).rl.max_staleness >= 0


def test_the_truncation_policy_reaches_the_learner_filters(tmp_path):
    from services.common.streams import StreamNames
    from services.controller.learner_config import rl_config
    from services.learner.config import RLConfig
    from services.pipeline.stage import Run

    def filters(overrides: list[str]):
        config = load_pipeline_config(CONFIGS / "smollm2-proof.yaml", overrides)
        path = rl_config(Run(config, tmp_path), "model", StreamNames("t"), "redis://x", total_steps=16)
        return RLConfig.model_validate_json(path.read_text()).filters

    masked = filters(["rl.truncated=mask"])  # the STAR code's overlong filter, runs 1-37
    assert set(masked.mask_finish_reasons) == {"context_limit", "tool_budget", "engine_error"}
    assert masked.zero_reward_finish_reasons == ["format_error"]
    failed = filters([])  # the proof recipe's since run 38
    assert failed.mask_finish_reasons == ["engine_error"]  # never the policy's doing
    assert set(failed.zero_reward_finish_reasons) == {"format_error", "context_limit", "tool_budget"}
    assert failed.max_staleness == masked.max_staleness == 3
    with pytest.raises(ConfigError, match="rl.truncated: .*'mask' or 'fail'"):
        load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.truncated=drop"])


def test_a_bad_curriculum_fails_when_the_recipe_loads():
    # Not at the RL stage, after synthesis and SFT have spent their time.
    with pytest.raises(ConfigError, match=r"rl.curriculum: .*'success:2' follows 'sum:1'"):
        load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.reward=curriculum", "rl.curriculum=sum:1,success:2"])
    with pytest.raises(ConfigError, match="rl.curriculum: .*unknown reward kind 'bogus'"):
        load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.curriculum=bogus@1"])
    short = load_pipeline_config(
        CONFIGS / "smollm2-proof.yaml", ["rl.reward=curriculum", "rl.curriculum=sum@1,success@2"]
    )
    assert short.rl.curriculum == "sum@1,success@2"


def test_the_synth_section_reaches_the_synthesizer(tmp_path, monkeypatch):
    from services.pipeline import stages

    calls = []
    monkeypatch.setattr(stages, "run_process", lambda run, name, argv, **kw: calls.append((name, argv)))
    config = load_pipeline_config(CONFIGS / "tiny.yaml", ["synth.flight_share=0.5", "synth.days=[3]"])
    stages.stage_synth(stages.Run(config, tmp_path, world_url="sqlite:///w.db"))
    argv = dict(calls)["synth-queries"]
    assert argv[argv.index("--flight-share") + 1] == "0.5" and argv[argv.index("--days") + 1] == "3"
    with pytest.raises(ConfigError, match="flight_share"):
        load_pipeline_config(CONFIGS / "tiny.yaml", ["synth.flight_share=1.5"])
    assert "--rl-mix" not in argv  # the RL prompts keep `mix` unless told otherwise
    calls.clear()
    config = load_pipeline_config(CONFIGS / "tiny.yaml", ["synth.rl_mix=[1,1,0]"])
    stages.stage_synth(stages.Run(config, tmp_path, world_url="sqlite:///w.db"))
    argv = dict(calls)["synth-queries"]
    assert argv[argv.index("--rl-mix") + 1] == "1:1:0"
    for bad in ("[0,0,0]", "[1,-1,1]"):
        with pytest.raises(ConfigError, match="rl_mix"):
            load_pipeline_config(CONFIGS / "tiny.yaml", [f"synth.rl_mix={bad}"])


def test_the_proof_recipe_plans_one_city_trips_from_oracle_teachers():
    # a recipe that drew 5- and 7-day trips left the SFT model at 0 % (docs/results.md)
    synth = load_pipeline_config(CONFIGS / "smollm2-proof.yaml").synth
    assert (synth.days, synth.teacher, synth.rl_mix) == ([3], "oracle", None)


def test_a_top_p_or_top_k_cut_is_called_off_policy_and_a_temperature_is_not():
    from services.controller.preflight import off_policy_note

    whole = load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.sampling.top_p=1.0"])
    assert off_policy_note(whole.rl.sampling) is None
    # the learner divides its logits by the rollouts' temperature, so T != 1 stays on-policy
    sharper = load_pipeline_config(
        CONFIGS / "smollm2-proof.yaml", ["rl.sampling.top_p=1.0", "rl.sampling.temperature=0.7"]
    )
    assert off_policy_note(sharper.rl.sampling) is None
    note = off_policy_note(load_pipeline_config(CONFIGS / "smollm2-proof.yaml").rl.sampling)  # top_p 0.95
    assert note is not None and "top_p 0.95" in note and "off-policy" in note
    cut = load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.sampling.top_p=1.0", "rl.sampling.top_k=20"])
    assert "top_k 20" in off_policy_note(cut.rl.sampling)


def test_a_preference_penalty_that_cannot_change_a_reward_is_refused():
    # The proof recipe's reward is success: a broken preference already scores 0, and rewards floor at 0.
    with pytest.raises(ConfigError, match="rl: .*preference_penalty 0.25 has no effect under the success reward"):
        load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.preference_penalty=0.25"])
    with pytest.raises(ConfigError, match="no effect"):
        load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.preference_penalty=1", "rl.curriculum=success@1"])
    summed = load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["rl.preference_penalty=0.25", "rl.reward=sum"])
    assert summed.rl.preference_penalty == 0.25
    staged = load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.preference_penalty=0.25"])  # sum, macro, success
    assert staged.rl.preference_penalty == 0.25


def test_curriculum_stages_a_run_never_reaches_are_named():
    from services.controller.preflight import unreached_stages_note
    from services.reward.rewards import Curriculum

    tiny = load_pipeline_config(CONFIGS / "tiny.yaml")  # curriculum over one epoch: sum only
    note = unreached_stages_note(tiny.rl.schedule(), tiny.rl.epochs, steps=2)
    assert note is not None and "macro@3, success@5" in note and "reward is sum (" in note
    assert "rl.curriculum_unit step" in note  # how to reach them within the run
    three = unreached_stages_note(Curriculum.parse("sum:1-2,macro:3-4,success:5"), 3, steps=30)
    assert three is not None and "success@5" in three and "macro@3" not in three and "sum then macro" in three
    paper = load_pipeline_config(CONFIGS / "qwen2.5-3b-grpo-curriculum.yaml")
    assert unreached_stages_note(paper.rl.schedule(), paper.rl.epochs, steps=100) is None  # 5 epochs
    assert unreached_stages_note(None, 1, steps=1) is None  # not a curriculum reward
    # by step, the run's steps decide: one epoch of 32 steps reaches success@9, not success@40
    stepped = load_pipeline_config(
        CONFIGS / "smollm2-proof.yaml",
        ["rl.reward=curriculum", "rl.curriculum=sum@1,success@9", "rl.curriculum_unit=step"],
    )
    assert unreached_stages_note(stepped.rl.schedule(), stepped.rl.epochs, steps=32) is None
    late = unreached_stages_note(Curriculum.parse("sum@1,success@40", unit="step"), 1, steps=32)
    assert late is not None and "success@40 start after the run's 32 steps" in late
    with pytest.raises(ConfigError, match="rl.curriculum: .*expected step 2"):  # the message counts steps too
        load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.curriculum_unit=step", "rl.curriculum=sum:1-1,success:3"])
    with pytest.raises(ConfigError, match="rl.curriculum_unit: .*'epoch' or 'step'"):
        load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.curriculum_unit=batch"])


def test_the_checkpoint_is_not_picked_on_the_queries_that_report_its_success(tmp_path, monkeypatch):
    from services.pipeline import stages

    paper = load_pipeline_config(CONFIGS / "qwen2.5-7b-grpo-sum.yaml")
    assert paper.rl.val_every > 0 and paper.synth.heldout_queries == 1000
    with pytest.raises(ConfigError, match="heldout_queries"):
        load_pipeline_config(CONFIGS / "qwen2.5-7b-grpo-sum.yaml", ["synth.heldout_queries=0"])
    # an eval split of one's own, or no selection, is fine
    load_pipeline_config(CONFIGS / "qwen2.5-7b-grpo-sum.yaml", ["synth.heldout_queries=0", "eval.split=test.jsonl"])
    load_pipeline_config(CONFIGS / "qwen2.5-7b-grpo-sum.yaml", ["synth.heldout_queries=0", "rl.val_every=0"])

    calls = []
    monkeypatch.setattr(stages, "run_process", lambda run, name, argv, **kw: calls.append((name, argv)))
    config = load_pipeline_config(CONFIGS / "tiny.yaml", ["synth.heldout_queries=3"])
    outputs = stages.stage_synth(stages.Run(config, tmp_path, world_url="sqlite:///w.db"))
    argv = dict(calls)["synth-queries"]
    s = config.synth
    assert argv[argv.index("--splits") + 1] == f"{s.sft_queries}:{s.rl_queries}:{s.val_queries}:3"
    assert argv[argv.index("--n") + 1] == str(s.sft_queries + s.rl_queries + s.val_queries + 3)
    assert stages.eval_split(config.eval, outputs) == outputs["heldout_queries"] != outputs["val_queries"]
    without = load_pipeline_config(CONFIGS / "tiny.yaml")
    assert stages.eval_split(without.eval, {"val_queries": "v.jsonl"}) == "v.jsonl"
    # a folder synthesized before held-out queries existed: its picked checkpoint is not scored on validation
    picked = {"model": "m", "best_success": 0.4}
    with pytest.raises(stages.StageFailed, match="picked on v.jsonl"):
        stages.stage_eval(
            stages.Run(without, tmp_path, world_url="sqlite:///w.db"), "m", {"val_queries": "v.jsonl"}, picked
        )
    assert not any(name == "eval" for name, _ in calls)  # refused before any evaluation ran


def test_the_proof_fleet_samples_as_many_batches_as_the_staleness_allows_in_one_epoch():
    # three batches in flight at max_staleness 3 keep the engine's rows busy; a second epoch lost what the
    # first had gained (docs/results.md); one vLLM engine batches every agent's turns itself
    proof = load_pipeline_config(CONFIGS / "smollm2-proof.yaml")
    s, r = proof.services, proof.rl
    assert s.rollout_workers * s.max_inflight_episodes == r.max_staleness * r.batch_prompts * r.group_size
    assert (s.engine, s.rollout_workers, r.epochs, r.max_steps) == ("vllm", 1, 1, 80)
    assert proof.synth.rl_queries == r.max_steps * r.batch_prompts  # one epoch: each prompt seen once


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("qwen2.5-*.yaml")))
def test_table_one_recipes_end_at_the_limit_as_the_reference_does(recipe, tmp_path):
    from services.pipeline.stage import Run, eval_argv

    config = load_pipeline_config(CONFIGS / recipe)
    assert config.eval.sampling.summarize_at_limit and not config.rl.sampling.summarize_at_limit
    assert "--summarize-at-limit" in eval_argv(Run(config, tmp_path), "m", "split.jsonl", tmp_path / "e", None)
    tiny = load_pipeline_config(CONFIGS / "tiny.yaml")
    assert "--summarize-at-limit" not in eval_argv(Run(tiny, tmp_path), "m", "split.jsonl", tmp_path / "e", None)


def test_a_validations_engine_takes_the_share_its_placement_kept(tmp_path):
    from services.pipeline.placement import plan
    from services.pipeline.stage import Run, eval_argv

    config = load_pipeline_config(CONFIGS / "smollm2-proof.yaml")
    placement = plan(config.deployment, config.services.rollout_workers, ["0"], validations=True)
    run = Run(config, tmp_path, placement=placement)
    beside = eval_argv(run, "m", "split.jsonl", tmp_path / "e", None, memory_share=placement.validation_memory_share)
    vllm = json.loads(beside[beside.index("--vllm-args") + 1])
    assert vllm["gpu_memory_utilization"] == pytest.approx(placement.validation_memory_share)
    assert vllm["kv_cache_from_share"] is True
    alone = eval_argv(run, "m", "split.jsonl", tmp_path / "e", None)  # the eval stage: the GPU to itself
    alone_args = json.loads(alone[alone.index("--vllm-args") + 1])
    assert alone_args["gpu_memory_utilization"] == pytest.approx(0.9) and alone_args["kv_cache_from_share"] is False


def test_the_episode_budget_is_the_recipes_or_derived_by_each_worker(tmp_path):
    from services.controller.embedded_fleet import inflight_fields

    seven = load_pipeline_config(CONFIGS / "qwen2.5-7b-grpo-sum.yaml")
    assert seven.inflight_episodes() is None  # each worker derives it from its engine's KV cache
    fields = inflight_fields(seven)
    assert "max_inflight_episodes" not in fields
    assert fields["episode_tokens"] == seven.rl.sampling.max_context_tokens
    proof = load_pipeline_config(CONFIGS / "smollm2-proof.yaml")
    assert inflight_fields(proof)["max_inflight_episodes"] == proof.services.max_inflight_episodes
    groups = load_pipeline_config(CONFIGS / "tiny.yaml", ["services.rollout_concurrency=3"])  # deprecated: groups
    assert groups.inflight_episodes() == 3 * groups.rl.group_size
    set_ = load_pipeline_config(
        CONFIGS / "tiny.yaml", ["services.max_inflight_episodes=48", "services.episode_tokens=6000"]
    )
    assert inflight_fields(set_) == {"episode_tokens": 6000, "max_inflight_episodes": 48, "max_batch": 48}
    with pytest.raises(ConfigError, match="not both"):
        load_pipeline_config(
            CONFIGS / "tiny.yaml", ["services.max_inflight_episodes=48", "services.rollout_concurrency=2"]
        )


def test_over_sampling_and_late_groups_reach_the_learner_and_its_filters():
    config = load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.oversample=0.25", "rl.late_groups=mask"])
    r = config.rl
    assert r.oversample_groups == -(-r.batch_prompts // 4)
    assert "deadline" in r.filters().mask_finish_reasons
    assert "deadline" not in load_pipeline_config(CONFIGS / "tiny.yaml").rl.filters().mask_finish_reasons
    with pytest.raises(ConfigError, match="late_groups"):
        load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.late_groups=later"])


def test_the_checkpoint_interval_reaches_the_learner_and_is_bounded(tmp_path):
    """A 7B checkpoint with its optimizer state is about 106 GB: a recipe sets how often the RL stage writes one."""
    from services.common.streams import StreamNames
    from services.controller.learner_config import rl_config
    from services.learner.config import RLConfig
    from services.pipeline.stage import Run

    config = load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.save_every=16"])
    path = rl_config(Run(config, tmp_path), "model", StreamNames("t"), "redis://x", total_steps=16)
    assert RLConfig.model_validate_json(path.read_text()).save_every == 16
    assert load_pipeline_config(CONFIGS / "tiny.yaml").rl.save_every == RLConfig.model_fields["save_every"].default
    with pytest.raises(ConfigError, match="save_every"):
        load_pipeline_config(CONFIGS / "tiny.yaml", ["rl.save_every=17"])


def test_forced_turns_are_off_unless_set_and_only_for_rl_sampling():
    """rl.sampling.forced_turns (benchmarking: a random-init model's episodes shaped like a trained agent's)."""
    paper = load_pipeline_config(CONFIGS / "qwen2.5-7b-grpo-sum.yaml")
    assert paper.rl.sampling.forced_turns is None and paper.eval.sampling.forced_turns is None
    forced = load_pipeline_config(
        CONFIGS / "qwen2.5-7b-grpo-sum.yaml", ['rl.sampling.forced_turns={"tool_calls": 10, "turn_tokens": 120}']
    )
    assert forced.rl.sampling.forced_turns.tool_calls == 10 and forced.rl.sampling.forced_turns.answer_tokens == 1000
    with pytest.raises(ConfigError, match="max_tool_calls"):  # more forced calls than the episode may make
        load_pipeline_config(CONFIGS / "tiny.yaml", ['rl.sampling.forced_turns={"tool_calls": 5}'])
    with pytest.raises(ConfigError, match="benchmarking"):  # an evaluation of forced answers measures nothing
        load_pipeline_config(CONFIGS / "tiny.yaml", ['eval.sampling.forced_turns={"tool_calls": 2}'])


def test_the_nccl_timeout_reaches_the_learner_from_the_recipe(tmp_path):
    from services.controller.learner_config import nccl_sync
    from services.learner.config import RLConfig
    from services.pipeline.stage import Run

    config = load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["deployment.nccl_timeout_s=900"])
    sync = nccl_sync(Run(config, tmp_path), ["http://127.0.0.1:1"])
    assert sync["nccl_timeout_s"] == 900.0
    assert RLConfig(model="m", output_dir=str(tmp_path), **sync).nccl_timeout_s == 900.0
    with pytest.raises(ConfigError, match="nccl_timeout_s"):
        load_pipeline_config(CONFIGS / "smollm2-proof.yaml", ["deployment.nccl_timeout_s=0"])
