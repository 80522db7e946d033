"""One definition per setting: the RL knobs a recipe shares with the learner are declared once (RLKnobs) and
reach RLConfig as the recipe sets them; the budgets an episode may spend are set once, in rl.sampling; and
every shipped recipe resolves to the values it resolved to before these moves (test_config_recipes.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.learner.config import RLConfig, RLKnobs
from services.pipeline.config import PipelineConfig, RLSpec, load_pipeline_config, sampling_cuts

CONFIGS = Path(__file__).parents[2] / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))
RESOLVED = json.loads((Path(__file__).parent / "test_config_recipes.json").read_text())
# Fields both classes have under one name that are not the same setting: the recipe's algorithm adds arpo
# (trained as grpo); its max_steps caps the stage's schedule (the learner's total_steps), not the learner.
NOT_SHARED = {"algorithm", "max_steps"}


def learner_fields_by_hand(r: RLSpec) -> dict[str, Any]:
    """The RLConfig keyword arguments the controller copied from `rl:` one by one before RLKnobs existed."""
    return dict(
        algorithm="dapo" if r.algorithm == "dapo" else "grpo",
        group_size=r.group_size,
        batch_prompts=r.batch_prompts,
        lr=r.lr,
        mini_batches=r.mini_batches,
        kl_coef=r.kl_coef,
        negative_scale=r.negative_scale,
        samples_per_step=r.samples_per_step,
        save_every=r.save_every,
        loss_agg=r.loss_agg,
        dual_clip_c=r.dual_clip_c,
        log_ratio_clamp=r.log_ratio_clamp,
        importance_sampling=r.importance_sampling,
        is_low=r.is_low,
        is_high=r.is_high,
        temperature=r.sampling.temperature,
        sampling_cut=bool(sampling_cuts(r.sampling)),
        eps_low=r.eps_low,
        eps_high=r.eps_high,
        filters=r.filters(),
        oversample_groups=r.oversample_groups,
        late_groups=r.late_groups,
    )


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_passes_the_learner_what_it_passed_by_hand(path):
    r = load_pipeline_config(path).rl
    assert r.learner_fields() == learner_fields_by_hand(r)
    rl = RLConfig(**r.learner_fields(), model="m", output_dir="o")
    assert rl == RLConfig(**learner_fields_by_hand(r), model="m", output_dir="o")


def test_a_field_both_sides_name_is_declared_once():
    # a knob added to RLSpec and RLConfig apart (two definitions, two defaults) fails here: declare it in RLKnobs
    both = (set(RLSpec.model_fields) & set(RLConfig.model_fields)) - NOT_SHARED
    assert both == set(RLKnobs.model_fields)
    for name in RLKnobs.model_fields:
        fields = (RLSpec.model_fields[name], RLConfig.model_fields[name], RLKnobs.model_fields[name])
        assert len({repr(f) for f in fields}) == 1, f"{name} is declared again apart from RLKnobs"


def test_a_recipe_that_sets_every_shared_knob_gets_them_all_in_the_learner_config():
    knobs = {
        "group_size": 3,
        "batch_prompts": 5,
        "lr": 7e-6,
        "mini_batches": 2,
        "eps_low": 0.1,
        "eps_high": 0.4,
        "dual_clip_c": 4.0,
        "log_ratio_clamp": 10.0,
        "importance_sampling": "mis",
        "is_low": 0.25,
        "is_high": 3.0,
        "loss_agg": "group-token-mean",
        "kl_coef": 0.01,
        "negative_scale": 0.5,
        "late_groups": "drop",
        "save_every": 2,
        "samples_per_step": 1,
    }
    assert set(knobs) == set(RLKnobs.model_fields), "set every shared knob here to a value that is not its default"
    for name, value in knobs.items():
        assert RLKnobs.model_fields[name].default != value, name
    config = PipelineConfig.model_validate(
        {
            "name": "knobs",
            "model": {"tiny": {}},
            "rl": {
                **knobs,
                "algorithm": "dapo",
                "max_staleness": 2,
                "oversample": 0.5,
                "sampling": {"temperature": 0.7, "top_p": 0.9},
            },
        }
    )
    rl = RLConfig(**config.rl.learner_fields(), model="m", output_dir="o")
    assert {name: getattr(rl, name) for name in knobs} == knobs
    assert (rl.algorithm, rl.temperature, rl.sampling_cut, rl.oversample_groups) == ("dapo", 0.7, True, 3)
    assert rl.filters.max_staleness == 2 and rl.filters.dynamic_sampling


def test_arpo_trains_as_grpo_and_a_yaml_off_is_no_correction(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nmodel: {tiny: {}}\nrl: {algorithm: arpo, importance_sampling: off}\n")
    fields = load_pipeline_config(recipe).rl.learner_fields()
    assert (fields["algorithm"], fields["importance_sampling"]) == ("grpo", "off")


def _unchanged(recorded: Any, now: Any, where: str) -> list[str]:
    """Where `now` differs from `recorded`, over the keys `recorded` has (a field added since is no change)."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        return [d for key, value in recorded.items() for d in _unchanged(value, now.get(key), f"{where}.{key}")]
    return [] if recorded == now else [f"{where}: {recorded!r} → {now!r}"]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_resolves_as_it_did(path):
    assert path.name in RESOLVED, f"record {path.name}'s resolved values in test_config_recipes.json"
    now = load_pipeline_config(path).model_dump(mode="json")
    assert _unchanged(RESOLVED[path.name], now, path.stem) == []


def test_eval_episodes_take_the_budgets_rl_sampling_sets_where_eval_sampling_leaves_them_out():
    rl = {"sampling": {"max_tokens_per_turn": 64, "max_context_tokens": 4096, "max_tool_calls": 4}}
    left_out = PipelineConfig.model_validate({"name": "e", "model": {"tiny": {}}, "rl": rl})
    s = left_out.eval.sampling
    assert (s.temperature, s.top_p, s.max_context_tokens) == (0.6, 0.95, 32768)  # the paper's decoding and context
    assert (s.max_tokens_per_turn, s.max_tool_calls) == (64, 4)
    partial = PipelineConfig.model_validate(
        {"name": "e", "model": {"tiny": {}}, "rl": rl, "eval": {"sampling": {"temperature": 0.3, "max_tool_calls": 9}}}
    )
    s = partial.eval.sampling
    assert (s.temperature, s.max_tokens_per_turn, s.max_context_tokens, s.max_tool_calls) == (0.3, 64, 4096, 9)
    assert partial.rl.sampling.max_tool_calls == 4


def test_a_resolved_recipe_loads_back_to_itself(tmp_path):
    from services.pipeline.config import dump_config

    config = load_pipeline_config(
        CONFIGS / "tiny.yaml", ["eval.sampling={temperature: 0.6}", "rl.sampling.max_tool_calls=3"]
    )
    assert config.eval.sampling.max_tool_calls == 3
    (tmp_path / "resolved.yaml").write_text(dump_config(config))
    assert load_pipeline_config(tmp_path / "resolved.yaml") == config
