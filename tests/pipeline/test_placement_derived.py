"""Placement derived from the machine: a recipe that leaves `deployment.learner_ranks` unset (the paper's three)
gets its learner ranks and engines from the GPUs seen, their memory and the model's size (fake GPU inventories
and the published config.json shapes; no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.pipeline.config import load_pipeline_config
from services.pipeline.placement import (
    GiB,
    ModelSize,
    PlacementError,
    derive,
    learner_rank_choices,
    placement_for_recipe,
    weight_sync,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QWEN_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
QWEN_3B = {
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
PAPER = {
    "qwen2.5-1.5b-arpo-macro.yaml": QWEN_1_5B,
    "qwen2.5-3b-grpo-curriculum.yaml": QWEN_3B,
    "qwen2.5-7b-grpo-sum.yaml": QWEN_7B,
}


def gpus(n: int) -> list[str]:
    return [str(i) for i in range(n)]


@pytest.mark.parametrize("name", sorted(PAPER))
def test_the_paper_recipes_leave_the_layout_to_the_machine(name):
    config = load_pipeline_config(CONFIGS / name)
    assert config.deployment.learner_ranks is None and config.placement.mode == "auto"


@pytest.mark.parametrize("card", [80, 141])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_the_1_5b_recipe_colocates_on_every_machine_size(n, card):
    config = load_pipeline_config(CONFIGS / "qwen2.5-1.5b-arpo-macro.yaml")
    p = placement_for_recipe(config, gpus(n), card * GiB, ModelSize.from_hf_config(QWEN_1_5B))
    assert p.colocated and p.derived and p.learner_ranks == n and p.learner_devices == tuple(gpus(n))
    assert p.engine_devices == tuple((g,) for g in gpus(n))  # one engine a GPU, the 8 workers' budget pooled
    assert p.reason.startswith(f"derived from {n} GPU(s) of {card}.0 GiB for 1.54 B parameters: colocated")
    assert "colocated: asleep while the learner trains" in p.describe() and "why: derived" in p.describe()
    assert weight_sync(config.deployment, "vllm", p).method == "ipc"
    # awake, the engine's share and the learner's state stay within the card; more ranks leave the engine more
    state = 20 * ModelSize.from_hf_config(QWEN_1_5B).params / n
    assert state + p.engine_memory_share * card * GiB < card * GiB
    if n > 1:
        fewer = placement_for_recipe(config, gpus(n // 2), card * GiB, ModelSize.from_hf_config(QWEN_1_5B))
        assert p.engine_memory_share >= fewer.engine_memory_share


def test_a_bigger_card_gives_the_one_gpu_engine_more_memory():
    config = load_pipeline_config(CONFIGS / "qwen2.5-1.5b-arpo-macro.yaml")
    size = ModelSize.from_hf_config(QWEN_1_5B)
    small, big = (placement_for_recipe(config, gpus(1), c * GiB, size) for c in (80, 141))
    assert big.engine_memory_share > small.engine_memory_share and big.engine_memory_share >= 0.5


@pytest.mark.parametrize(
    "card,n,fits",
    [
        (80, 1, False),
        (80, 2, False),
        (80, 4, True),
        (80, 8, True),
        (141, 1, False),
        (141, 2, True),
        (141, 4, True),
        (141, 8, True),
    ],
)
def test_the_7b_recipe_fits_where_its_state_does_and_is_refused_with_the_numbers_elsewhere(card, n, fits):
    config = load_pipeline_config(CONFIGS / "qwen2.5-7b-grpo-sum.yaml")
    size = ModelSize.from_hf_config(QWEN_7B)
    if fits:
        p = placement_for_recipe(config, gpus(n), card * GiB, size)
        assert p.derived and p.colocated and p.learner_ranks == n
        return
    with pytest.raises(PlacementError) as err:
        placement_for_recipe(config, gpus(n), card * GiB, size)
    msg = str(err.value)
    assert msg.startswith(f"no layout fits {n} GPU(s) of {card}.0 GiB for 7.62 B parameters: colocated: training needs")
    assert f"ZeRO-3 state over {n} ranks" in msg and "usable" in msg
    assert ("split needs at least 2 GPUs" in msg) if n == 1 else ("split: a learner rank needs" in msg)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_the_3b_recipe_fits_both_cards(n):
    config = load_pipeline_config(CONFIGS / "qwen2.5-3b-grpo-curriculum.yaml")
    for card in (80, 141):
        p = placement_for_recipe(config, gpus(n), card * GiB, ModelSize.from_hf_config(QWEN_3B))
        assert p.derived and p.colocated and len(p.engine_devices) == n
    # one 80 GB card has no room for a validation's engine beside the fleet: validations wait for its end
    one = placement_for_recipe(config, gpus(1), 80 * GiB, ModelSize.from_hf_config(QWEN_3B))
    assert (
        one.validations_after
        and not placement_for_recipe(config, gpus(1), 141 * GiB, ModelSize.from_hf_config(QWEN_3B)).validations_after
    )


def test_split_is_derived_where_a_colocated_engine_would_hold_too_little_kv():
    # 7B on 8 × 80 GB with episodes of 800K tokens: beside a learner rank an engine's KV holds fewer, on a GPU
    # of its own it holds them; 2 ranks cannot hold the state, 4 can: 4 learner GPUs + 4 engines
    config = load_pipeline_config(CONFIGS / "qwen2.5-7b-grpo-sum.yaml")
    size = ModelSize.from_hf_config(QWEN_7B)
    p = derive(config.deployment, size, gpus(8), 80 * GiB, 16 * GiB, 800_000)
    assert p.derived and not p.colocated and not p.shared
    assert p.learner_devices == tuple(gpus(4)) and p.engine_devices == tuple((g,) for g in gpus(8)[4:])
    assert "4 learner rank(s) + 4 engine(s)" in p.reason and "less than one 800000-token sequence" in p.reason
    assert weight_sync(config.deployment, "vllm", p).method == "nccl"  # engines on GPUs of their own


def test_learner_rank_choices_start_at_a_quarter_of_the_machine_and_leave_an_engine():
    assert learner_rank_choices(1, 1) == []
    assert learner_rank_choices(2, 1) == [1]
    assert learner_rank_choices(4, 1) == [1, 2]
    assert learner_rank_choices(8, 1) == [2, 4]
    assert learner_rank_choices(8, 2) == [2, 4]
    assert learner_rank_choices(8, 4) == [2, 4]


def test_ranks_set_in_the_recipe_keep_its_own_plan():
    config = load_pipeline_config(CONFIGS / "qwen2.5-1.5b-arpo-macro.yaml", ["deployment.learner_ranks=2"])
    with pytest.raises(PlacementError, match="learner_ranks 2 needs 2 GPUs, one per rank; this machine shows 1"):
        placement_for_recipe(
            config.model_copy(update={"placement": config.placement.model_copy(update={"mode": "split"})}),
            gpus(1),
            141 * GiB,
            ModelSize.from_hf_config(QWEN_1_5B),
        )
    p = placement_for_recipe(config, gpus(4), 141 * GiB, ModelSize.from_hf_config(QWEN_1_5B))
    assert not p.derived


def test_tiny_and_cpu_runs_keep_one_rank():
    tiny = load_pipeline_config(CONFIGS / "tiny.yaml")
    assert tiny.deployment.learner_ranks is None and tiny.placement.mode == "split"
    p = placement_for_recipe(tiny, [], None, None)
    assert p.accelerator == "cpu" and p.learner_ranks == 1
    shared = placement_for_recipe(tiny, gpus(1), 80 * GiB, ModelSize.from_hf_config(QWEN_1_5B))
    assert shared.learner_ranks == 1 and not shared.derived
