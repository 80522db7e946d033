"""Fused point-wise functions: the model computes what transformers' eager code computes."""

from __future__ import annotations

import sys

import torch

from services.learner.engine import recompute_mlps
from services.learner.pointwise import fuse_pointwise


def test_fused_pointwise_keeps_logits_gradients_and_names(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(100, 4000, (1, 40), generator=torch.Generator().manual_seed(5))
    calls: list[str] = []

    def run(fused: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        names = [n for n, _ in lm.named_parameters()]
        if fused:
            modeling = sys.modules[type(lm.model.layers[0].self_attn).__module__]
            monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)  # restored after
            layers = lm.config.num_hidden_layers
            assert fuse_pointwise(lm) == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rotary": 1}
            recompute_mlps(lm)  # wraps the fused MLP forward, as the engine orders them
            lm.model.layers[0].mlp.up_proj.register_forward_hook(lambda *_: calls.append("up"))
        assert [n for n, _ in lm.named_parameters()] == names
        out = lm(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}

    plain_logits, plain = run(False)
    fused_logits, fused = run(True)
    assert calls == ["up", "up"]  # the fused MLP ran, and again when recomputed in backward
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-5, atol=1e-5)
    for name, g in plain.items():
        torch.testing.assert_close(fused[name], g, rtol=1e-4, atol=1e-6, msg=name)
