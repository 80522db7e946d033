"""Every tensor verified after a sync, on the transformers engine (a tiny Qwen2 on CPU, loaded from
files as a rollout server loads a published version): a sha256 of each parameter it holds against
the learner's. The same check runs on vLLM (tests/rollout/test_weight_sync_vllm.py, and on GPUs
bench/weight_sync_gpu.py and tests/rollout/test_nccl_fleet_gpu.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.settings import Settings
from services.rollout.service import RolloutService
from services.weights.digests import check_engine_weights
from tests.rollout.test_weight_sync_vllm import NoTools, _publish, _step


def test_after_a_sync_every_parameter_equals_the_learners_and_a_dropped_one_is_named(tiny_model, tmp_path, loop):
    from transformers import AutoModelForCausalLM

    from services.rollout.engines import build_engine

    def on(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    engine = on(_build(build_engine, tiny_model))
    service = RolloutService(engine, NoTools(), settings=Settings(weights_root=tmp_path / "weights"))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    n_params = len(list(model.parameters()))
    start = check_engine_weights(model, on(service.parameter_digests()))
    assert start["equal"] and start["tensors_equal"] == start["tensors_checked"] == n_params

    _step(model, 1)
    on(service.update_weights(_publish(tmp_path, model, 1)))
    after = check_engine_weights(model, on(service.parameter_digests()))
    assert after["equal"] and after["tensors_equal"] == n_params and after["unverifiable"] == []
    assert all(after["digests"][n] != start["digests"][n] for n in start["digests"])  # every tensor changed

    old = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    _step(model, 2)
    on(service.update_weights(_publish(tmp_path, model, 2, keep_from={"model.layers.1.mlp.down_proj.weight": old})))
    partial = check_engine_weights(model, on(service.parameter_digests()))
    assert not partial["equal"] and partial["differ"] == ["model.layers.1.mlp.down_proj.weight"]
    assert partial["tensors_equal"] == n_params - 1
    on(service.close())


async def _build(build_engine, tiny_model):
    return build_engine("transformers", tiny_model, max_model_len=512, dtype="float32")


@pytest.mark.parametrize(
    "packed", [{}, {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}]
)
def test_the_learners_side_is_put_in_the_engines_layout(tiny_model, packed):
    from transformers import AutoModelForCausalLM

    from services.weights.digests import engine_layout_digests, tensor_digest

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    ours = engine_layout_digests(model.named_parameters(), packed, torch.bfloat16)
    attn = model.model.layers[0].self_attn
    if packed:
        stacked = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).to(torch.bfloat16)
        assert ours["model.layers.0.self_attn.qkv_proj.weight"] == tensor_digest(stacked)
        assert not any(".q_proj." in n or ".gate_proj." in n for n in ours)
    else:
        assert ours["model.layers.0.self_attn.q_proj.weight"] == tensor_digest(attn.q_proj.weight.to(torch.bfloat16))
