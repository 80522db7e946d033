"""Placement's memory model: split or colocated from the GPUs it sees and the model's size, and the
refusals that name the numbers (fake GPU inventories; no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.pipeline.config import load_pipeline_config
from services.pipeline.placement import (
    GiB,
    ModelSize,
    PlacementError,
    activation_bytes,
    choose,
    colocated_concurrency,
    colocated_fit,
    learner_state_bytes,
    placement_for_recipe,
    weight_sync,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# the published config.json shapes of Qwen2.5-7B-Instruct and Qwen2.5-1.5B-Instruct
QWEN_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
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
CARD_80 = 80 * GiB


def gpus(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def recipe(name: str, **placement):
    config = load_pipeline_config(CONFIGS / name)
    return config.model_copy(update={"placement": config.placement.model_copy(update=placement)})


def test_parameter_counts_match_the_published_models():
    assert ModelSize.from_hf_config(QWEN_7B).params == pytest.approx(7.62e9, rel=0.01)
    assert ModelSize.from_hf_config(QWEN_1_5B).params == pytest.approx(1.54e9, rel=0.01)


def test_zero3_state_is_eighteen_bytes_a_parameter_over_the_ranks_with_fp32_gradients():
    size = ModelSize.from_hf_config(QWEN_7B)
    # bf16 weights, fp32 gradient partitions (the default), fp32 master weights and both Adam moments
    assert learner_state_bytes(size, 4) == 18 * size.params // 4
    assert learner_state_bytes(size, 4, fp32_grads=False) == 16 * size.params // 4
    # the weights ZeRO-3 keeps whole count on every rank, up to the whole model
    assert learner_state_bytes(size, 4, persistent_bytes=4 * GiB) - learner_state_bytes(size, 4) == 4 * GiB
    assert learner_state_bytes(size, 4, persistent_bytes=10**12) - learner_state_bytes(size, 4) == size.weights_bytes
    assert activation_bytes(size, 32768, True) < activation_bytes(size, 32768, False)
    # MLP recomputation in fewer layers keeps the other layers' MLP-wide activations: between all and none
    mlp_layer = 32768 * 2 * size.intermediate * 2  # lean: gate and up, bf16
    every = activation_bytes(size, 32768, False, recompute_mlp=True, lean=True)
    half = activation_bytes(size, 32768, False, recompute_mlp=True, lean=True, recompute_mlp_layers=size.layers // 2)
    none = activation_bytes(size, 32768, False, lean=True)
    assert (
        activation_bytes(size, 32768, False, recompute_mlp=True, lean=True, recompute_mlp_layers=size.layers) == every
    )
    assert half - every == (size.layers - size.layers // 2) * mlp_layer
    assert every < half < none


def test_a_kl_term_adds_the_reference_policy_whole_on_every_rank():
    size = ModelSize.from_hf_config(QWEN_7B)
    assert learner_state_bytes(size, 4, reference=True) - learner_state_bytes(size, 4) == 2 * size.params
    # on four 80 GB cards it still fits, with less room left for the engine; on two it is refused, and the
    # refusal names the reference copy
    with_kl = colocated_fit(size, 4, 1, CARD_80, 4 * GiB, 30512, reference=True)
    without = colocated_fit(size, 4, 1, CARD_80, 4 * GiB, 30512)
    assert with_kl.fits and without.fits and with_kl.engine_share < without.engine_share
    config = recipe("qwen2.5-7b-grpo-sum.yaml")
    kl = config.model_copy(update={"rl": config.rl.model_copy(update={"kl_coef": 0.05})})
    with pytest.raises(PlacementError, match="KL reference"):
        placement_for_recipe(kl, gpus(2), CARD_80, size)


@pytest.mark.parametrize("n", [8, 4])
def test_the_7b_recipe_fits_80_gb_hosts_colocated(n):
    config = recipe("qwen2.5-7b-grpo-sum.yaml")
    assert config.placement.mode == "auto" and config.validates_during_rl
    p = placement_for_recipe(config, gpus(n), CARD_80, ModelSize.from_hf_config(QWEN_7B))
    assert p.colocated and p.learner_ranks == n and p.learner_devices == tuple(gpus(n))
    assert p.engine_devices == tuple((g,) for g in gpus(n))  # one engine per GPU
    assert p.derived and p.reason.startswith(f"derived from {n} GPU(s) of 80.0 GiB for 7.62 B parameters: colocated")
    state = learner_state_bytes(
        ModelSize.from_hf_config(QWEN_7B), n, persistent_bytes=int(config.learner.persistent_weights_gib * GiB)
    )
    if n == 8:  # awake, engine 0's GPU holds the learner's state, its engine and a validation's, within the card
        assert not p.validations_after
        assert state + (p.engine_memory_share + p.validation_memory_share) * CARD_80 <= CARD_80
    else:  # on four, a validation's engine does not fit beside them: validations wait for the fleet's end
        assert p.validations_after and p.validation_memory_share is None
        assert "validations run after the RL steps" in p.reason and "validations after the RL steps" in p.describe()
        assert state + p.engine_memory_share * CARD_80 <= CARD_80
    assert p.engine_devices_env(0) == {"CUDA_VISIBLE_DEVICES": "0"} and p.engine_settings(0)["kv_cache_from_share"]
    assert weight_sync(config.deployment, "vllm", p).method == "ipc"
    # each colocated engine derives its episode budget from its own KV share; a recipe's fixed budget
    # for 8 workers is pooled into the n engines
    assert config.inflight_episodes() is None
    assert colocated_concurrency(8, 16, n) * n >= 8 * 16


def test_the_7b_recipe_with_its_ranks_set_splits_where_gpus_of_their_own_exist():
    config = recipe("qwen2.5-7b-grpo-sum.yaml")
    config = config.model_copy(update={"deployment": config.deployment.model_copy(update={"learner_ranks": 4})})
    p = placement_for_recipe(config, gpus(12), CARD_80, ModelSize.from_hf_config(QWEN_7B))
    assert not p.colocated and not p.shared
    assert p.learner_devices == tuple(gpus(4)) and len(p.engine_devices) == 8
    assert p.reason.startswith("auto → split")


def test_the_7b_recipe_on_two_gpus_is_refused_with_the_numbers():
    with pytest.raises(PlacementError) as err:
        placement_for_recipe(recipe("qwen2.5-7b-grpo-sum.yaml"), gpus(2), CARD_80, ModelSize.from_hf_config(QWEN_7B))
    msg = str(err.value)
    assert msg.startswith("no layout fits 2 GPU(s) of 80.0 GiB for 7.62 B parameters: colocated")
    assert "ZeRO-3 state over 2 ranks 67.8 GiB, 4.0 GiB of weights kept whole" in msg and "of 73.6 GiB usable" in msg
    assert "split: a learner rank needs" in msg  # one rank and one engine: the whole state on one GPU


def test_a_1_5b_recipe_colocates_on_one_gpu():
    config = recipe("qwen2.5-1.5b-arpo-macro.yaml", mode="colocated")
    p = placement_for_recipe(config, gpus(1), CARD_80, ModelSize.from_hf_config(QWEN_1_5B))
    assert p.colocated and p.learner_devices == ("0",) and p.engine_devices == (("0",),)
    assert 0.05 < p.engine_memory_share < 0.9


def test_auto_on_one_gpu_takes_colocated():
    config = recipe("qwen2.5-1.5b-arpo-macro.yaml", mode="auto")
    p = placement_for_recipe(config, gpus(1), CARD_80, ModelSize.from_hf_config(QWEN_1_5B))
    assert p.colocated and p.derived and "derived from 1 GPU(s)" in p.reason


def test_activations_beyond_the_card_are_refused_naming_them():
    config = recipe("qwen2.5-1.5b-arpo-macro.yaml", mode="colocated", activation_gib=70.0)
    with pytest.raises(PlacementError, match=r"activations 70\.0 GiB"):
        placement_for_recipe(config, gpus(1), CARD_80, ModelSize.from_hf_config(QWEN_1_5B))


def test_kv_too_small_for_one_episode_is_refused():
    # a 7B learner's whole state (bf16 gradients) on one 141 GB card trains (small rows) but leaves its engine
    # no KV cache
    size = ModelSize.from_hf_config(QWEN_7B)
    fit = colocated_fit(size, 1, 1, 141 * GiB, 1 * GiB, 30512, fp32_grads=False)
    assert not fit.fits and "less than one 30512-token sequence" in fit.why
    assert colocated_fit(size, 4, 1, 141 * GiB, 1 * GiB, 30512).fits


def test_colocated_needs_the_model_size_and_gpu_memory():
    config = recipe("qwen2.5-7b-grpo-sum.yaml", mode="colocated")
    with pytest.raises(PlacementError, match="config.json"):
        choose(
            config.deployment,
            "colocated",
            None,
            8,
            gpus(8),
            CARD_80,
            micro_batch_tokens=32768,
            checkpointing=True,
            min_kv_tokens=30512,
        )


def test_split_mode_and_cpu_keep_the_deployments_plan():
    config = recipe("qwen2.5-7b-grpo-sum.yaml", mode="split")
    p = placement_for_recipe(config, gpus(8), CARD_80, ModelSize.from_hf_config(QWEN_7B))
    assert not p.colocated and p.shared  # engines beside the learner by memory share, as before
    cpu = placement_for_recipe(recipe("qwen2.5-7b-grpo-sum.yaml"), [], None, ModelSize.from_hf_config(QWEN_7B))
    assert cpu.accelerator == "cpu"


def test_colocation_needs_vllm_engines_of_an_embedded_fleet():
    config = recipe("qwen2.5-7b-grpo-sum.yaml")
    p = placement_for_recipe(config, gpus(8), CARD_80, ModelSize.from_hf_config(QWEN_7B))
    with pytest.raises(PlacementError, match="vLLM"):
        weight_sync(config.deployment, "transformers", p)
    assert "colocated" in p.describe() and "why:" in p.describe()


# ---- what a colocated RL stage's processes are told ------------------------------------------------


def _colocated_run(tmp_path: Path):
    from services.pipeline.placement import plan_colocated
    from services.pipeline.stage import Run

    config = load_pipeline_config(
        CONFIGS / "tiny.yaml",
        [
            "services.engine=vllm",
            "services.rollout_workers=8",
            "services.rollout_concurrency=2",
            "placement.sleep_level=2",
        ],
    )
    placement = plan_colocated(config.deployment, gpus(4), 0.3)
    return Run(config, tmp_path, placement=placement, weight_sync=weight_sync(config.deployment, "vllm", placement))


def test_a_colocated_stage_starts_one_sleeping_engine_a_gpu_serving_the_learner(tmp_path):
    from types import SimpleNamespace

    from services.common.schemas import VllmArgs
    from services.controller.embedded_fleet import EmbeddedFleet, _start_workers

    class Sup:
        def __init__(self) -> None:
            self.added: dict[str, dict[str, str]] = {}
            self.configs: dict[str, dict] = {}

        def add(self, name, argv, env=None, log=None, **_):
            self.added[name] = dict(env or {})
            if "--config" in argv:  # a rollout worker's own settings file
                self.configs[name] = json.loads(Path(argv[argv.index("--config") + 1]).read_text())
            return SimpleNamespace(name=name)

    run = _colocated_run(tmp_path)
    f = EmbeddedFleet(Sup(), "redis://x", sandbox_url="http://127.0.0.1:9")
    _start_workers(run, f, "model", {}, tmp_path / "logs")
    rollout = {n: e for n, e in f.sup.added.items() if n.startswith("rollout-")}
    assert sorted(rollout) == [f"rollout-{i}" for i in range(4)]  # one per GPU, not the recipe's 8
    for i, env in enumerate(rollout[f"rollout-{j}"] for j in range(4)):
        cfg = f.sup.configs[f"rollout-{i}"]
        assert VllmArgs.model_validate(cfg["vllm"]).enable_sleep_mode
        # 8 workers × 2 groups pooled over 4 engines: 4 groups' episodes each
        assert env["CUDA_VISIBLE_DEVICES"] == str(i)
        assert cfg["max_inflight_episodes"] == 4 * run.config.rl.group_size
        assert cfg["consumer"] == f"rollout-{i}" and cfg["kv_cache_from_share"] is True
        assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and cfg["http_port"]
        assert not any(k.startswith("STAR_ROLLOUT_") for k in env)  # settings travel in the file, not the env
    assert len(f.rollout_urls) == 4
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in f.sup.added["reward-0"]


def test_a_colocated_learner_sleeps_the_workers_and_takes_ipc(tmp_path):
    from services.common.streams import StreamNames
    from services.controller.learner_config import rl_config
    from services.learner.config import RLConfig
    from services.pipeline.stage import StageFailed

    run = _colocated_run(tmp_path)
    assert run.colocated and run.serves_http and not run.nccl
    servers = [f"http://127.0.0.1:{4100 + i}" for i in range(4)]
    cfg = RLConfig.model_validate_json(rl_config(run, "model", StreamNames("t"), None, 4, servers).read_text())
    assert cfg.weight_sync == "ipc" and cfg.rollout_servers == servers
    assert cfg.sleep_level == 2 and cfg.sleep_timeout_s == 300.0
    assert cfg.engine.ranks == 4 == run.learner_ranks  # a rank on every GPU, whatever deployment.learner_ranks says
    with pytest.raises(StageFailed, match="HTTP addresses"):
        rl_config(run, "model", StreamNames("t"), None, 4, [])


def test_a_config_without_the_model_sizes_is_refused_with_what_it_lacks():
    with pytest.raises(PlacementError, match="no hidden_size, num_attention_heads"):
        ModelSize.from_hf_config(
            {"model_type": "qwen2", "intermediate_size": 11008, "num_hidden_layers": 28, "vocab_size": 152064}
        )
