"""Memory and communication options of the learner: the DeepSpeed config they make, the NCCL protocol, and
selective recomputation that leaves the gradients as they were."""

from __future__ import annotations

import os

import pytest
import torch
from pydantic import ValidationError

from services.learner import nccl_env
from services.learner.config import EngineConfig
from services.learner.engine import deepspeed_config, recompute_mlps


def test_fp32_gradient_accumulation_and_reduction_under_bf16_zero():
    ds = deepspeed_config(EngineConfig(zero_stage=3), bf16=True, world_size=2, on_gpu=True)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "fp32"
    assert ds["zero_optimization"]["overlap_comm"] is True  # on GPU by default
    # fp32 weights accumulate in fp32 anyway; without ZeRO DeepSpeed has no bf16/fp32 mix
    assert "data_types" not in deepspeed_config(EngineConfig(zero_stage=2), bf16=False, world_size=1)
    assert "data_types" not in deepspeed_config(EngineConfig(zero_stage=0), bf16=True, world_size=1)
    off = deepspeed_config(
        EngineConfig(zero_stage=2, fp32_grad_accum=False, overlap_comm=False), bf16=True, world_size=1, on_gpu=True
    )
    assert "data_types" not in off and off["zero_optimization"]["overlap_comm"] is False
    wire = deepspeed_config(EngineConfig(zero_stage=3, grad_reduce_dtype="bf16"), bf16=True, world_size=2, on_gpu=True)
    assert wire["data_types"] == {"grad_accum_dtype": "fp32"} and wire["communication_data_type"] == "bf16"
    with pytest.raises(ValidationError, match="grad_reduce_dtype"):
        EngineConfig(grad_reduce_dtype="fp16")


def test_offload_options():
    ds = deepspeed_config(
        EngineConfig(zero_stage=3, offload_optimizer="cpu", offload_params="cpu"), bf16=True, world_size=2, on_gpu=True
    )
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    with pytest.raises(ValidationError, match="offload_params needs zero_stage 3"):
        EngineConfig(zero_stage=2, offload_params="cpu")
    with pytest.raises(ValidationError, match="offload_optimizer needs ZeRO"):
        EngineConfig(zero_stage=0, offload_optimizer="cpu")


def test_mlp_recomputation_keeps_gradients_and_names(tiny_model):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(100, 4000, (1, 40), generator=torch.Generator().manual_seed(3))

    def grads(recompute: bool) -> dict[str, torch.Tensor]:
        lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        names = [n for n, _ in lm.named_parameters()]
        if recompute:
            assert recompute_mlps(lm) == lm.config.num_hidden_layers
        assert [n for n, _ in lm.named_parameters()] == names
        calls = []
        lm.model.layers[0].mlp.gate_proj.register_forward_hook(lambda *_: calls.append(1))
        lm(input_ids=ids, labels=ids).loss.backward()
        runs.append(len(calls))
        return {n: p.grad.clone() for n, p in lm.named_parameters()}

    runs: list[int] = []
    plain, recomputed = grads(False), grads(True)
    assert runs == [1, 2]  # the MLP ran again in backward
    for name, g in plain.items():
        assert torch.allclose(g, recomputed[name], rtol=1e-5, atol=1e-7), name


def test_mlp_recomputation_in_the_first_layers_only(tiny_model):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(100, 4000, (1, 40), generator=torch.Generator().manual_seed(5))

    def run(layers: int | None) -> tuple[list[int], dict[str, torch.Tensor]]:
        lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        if layers is not None:
            assert recompute_mlps(lm, layers) == layers
        calls = [0] * lm.config.num_hidden_layers
        for i, layer in enumerate(lm.model.layers):
            layer.mlp.gate_proj.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        lm(input_ids=ids, labels=ids).loss.backward()
        return calls, {n: p.grad.clone() for n, p in lm.named_parameters()}

    plain_calls, plain = run(None)
    calls, recomputed = run(1)
    assert plain_calls == [1] * len(plain_calls) and len(calls) >= 2
    assert calls == [2] + [1] * (len(calls) - 1)  # only the first layer's MLP ran again in backward
    for name, g in plain.items():
        assert torch.allclose(g, recomputed[name], rtol=1e-5, atol=1e-7), name
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with pytest.raises(ValueError, match="recompute_mlp_layers 99 is more than the model's"):
        recompute_mlps(lm, 99)


def test_mlp_layers_need_mlp_recomputation():
    assert EngineConfig(recompute_mlp=True, recompute_mlp_layers=3).recompute_mlp_layers == 3
    with pytest.raises(ValidationError, match="recompute_mlp_layers 3 needs recompute_mlp: true"):
        EngineConfig(recompute_mlp_layers=3)
    with pytest.raises(ValidationError):
        EngineConfig(recompute_mlp=True, recompute_mlp_layers=0)


def test_zero3_whole_weight_budget():
    """The budget is in GiB of the weights' own dtype; 0 leaves only the small parameters whole."""
    bf16 = deepspeed_config(EngineConfig(zero_stage=3, persistent_weights_gib=4.0), bf16=True, world_size=2)
    assert bf16["zero_optimization"]["stage3_model_persistence_threshold"] == 2 * 2**30
    assert bf16["zero_optimization"]["stage3_param_persistence_threshold"] == 2 * 2**30
    fp32 = deepspeed_config(EngineConfig(zero_stage=3, persistent_weights_gib=4.0), bf16=False, world_size=2)
    assert fp32["zero_optimization"]["stage3_model_persistence_threshold"] == 2**30
    off = deepspeed_config(EngineConfig(zero_stage=3, persistent_weights_gib=0), bf16=True, world_size=2)[
        "zero_optimization"
    ]
    assert off["stage3_param_persistence_threshold"] == 10_000 and "stage3_model_persistence_threshold" not in off
    assert (
        "stage3_param_persistence_threshold"
        not in deepspeed_config(EngineConfig(zero_stage=2), bf16=True, world_size=2)["zero_optimization"]
    )


def test_nccl_protocol_only_where_the_environment_chose_none(monkeypatch):
    monkeypatch.setattr(nccl_env, "_set_here", None)
    monkeypatch.delenv("NCCL_PROTO", raising=False)
    nccl_env.set_learner_protocol(EngineConfig().nccl_protocol)
    assert os.environ["NCCL_PROTO"] == "Simple"
    # a group with the fleet's engines is made under NCCL's own choice, as on their side
    with nccl_env.peer_protocol():
        assert "NCCL_PROTO" not in os.environ
    assert os.environ["NCCL_PROTO"] == "Simple"

    monkeypatch.setattr(nccl_env, "_set_here", None)
    monkeypatch.setenv("NCCL_PROTO", "LL128")
    nccl_env.set_learner_protocol("Simple")
    assert os.environ["NCCL_PROTO"] == "LL128"  # the operator's setting wins, for every group
    with nccl_env.peer_protocol():
        assert os.environ["NCCL_PROTO"] == "LL128"

    monkeypatch.setattr(nccl_env, "_set_here", None)
    monkeypatch.delenv("NCCL_PROTO")
    nccl_env.set_learner_protocol(EngineConfig(nccl_protocol=None).nccl_protocol)
    assert "NCCL_PROTO" not in os.environ
