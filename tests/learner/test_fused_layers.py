"""Lean activations (services/learner/fused_layers.py): the same forward and gradients as transformers' own
layers, with fewer bytes saved for backward (counted through saved-tensor hooks)."""

from __future__ import annotations

import pytest
import torch

from services.learner.attention import PER_SEQUENCE_ATTENTION, packed_kwargs
from services.learner.fused_layers import lean_activations

LENGTH = 48


def _model(tiny_model, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype, attn_implementation=PER_SEQUENCE_ATTENTION)
    lm.config.use_cache = False
    return lm.train()


def _batch(packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(100, 4000, (1, LENGTH), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(30), torch.arange(LENGTH - 30)]) if packed else torch.arange(LENGTH)
    return ids, positions[None]


def _forward(lm, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    hidden = lm.model(input_ids=ids, position_ids=positions, use_cache=False, **packed_kwargs(positions))
    return hidden.last_hidden_state


def _loss_and_grads(lm, ids, positions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = _forward(lm, ids, positions)
    (out.square().mean() + out[..., :7].sum() * 1e-2).backward()
    return out.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fold_down", [True, False], ids=["swiglu+down", "swiglu"])
@pytest.mark.parametrize("packed", [False, True], ids=["single-sequence", "packed"])
def test_lean_layers_match_transformers_forward_and_gradients(tiny_model, packed, fold_down):
    ids, positions = _batch(packed)
    out, grads = _loss_and_grads(_model(tiny_model), ids, positions)
    lean = _model(tiny_model)
    names = [n for n, _ in lean.named_parameters()]
    counts = lean_activations(lean, fold_down=fold_down)
    layers = lean.config.num_hidden_layers
    assert counts == {"swiglu": layers, "rms_norm": 2 * layers + 1, "layers": layers}
    assert [n for n, _ in lean.named_parameters()] == names
    lean_out, lean_grads = _loss_and_grads(lean, ids, positions)
    torch.testing.assert_close(lean_out, out, rtol=1e-6, atol=1e-6)
    assert lean_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(lean_grads[name], g, rtol=1e-6, atol=1e-6, msg=name)


def saved_bytes(lm, ids: torch.Tensor, positions: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward after the forward (each counted once, as
    memory is: a tensor saved by several nodes, or views of one storage, count once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _forward(lm, ids, positions)
    out.sum().backward()
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lean_layers_save_the_product_and_the_norm_outputs_less(tiny_model, dtype):
    """Per token and layer the lean layers keep, of the MLP, gate and up only (eager PyTorch also keeps
    SiLU(gate) and the product), and of the two norms no output (the projections' input) and no
    normalized copy: at least 2 x intermediate + 4 x hidden elements fewer per token and layer."""
    ids, positions = _batch(packed=True)
    plain = saved_bytes(_model(tiny_model, dtype), ids, positions)
    lean_model = _model(tiny_model, dtype)
    lean_activations(lean_model)
    lean = saved_bytes(lean_model, ids, positions)
    cfg = lean_model.config
    fewer = LENGTH * cfg.num_hidden_layers * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * dtype.itemsize
    assert plain - lean >= fewer, (plain, lean, fewer)
    only_swiglu = _model(tiny_model, dtype)
    lean_activations(only_swiglu, recompute_norms=False)
    assert lean < saved_bytes(only_swiglu, ids, positions) < plain


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("width", ["1.5B", "7B"])
def test_lean_layers_activation_memory_per_layer_on_gpu(width):
    """Bytes a 32K-token packed row keeps per decoder layer after the forward (bf16, varlen attention, two
    layers of Qwen2.5's width), as the engine runs them on GPU: `keep` with the compiled point-wise functions
    (fuse_pointwise), `lean` with the compiled lean pieces, and eager `keep` for reference. Printed for the
    recipes' choice (pytest -s); lean keeps at least (intermediate + 2 x hidden) x 2 bytes per token and layer
    less than compiled keep (down_proj's input and the two norm outputs)."""
    import json

    from transformers import Qwen2Config, Qwen2Model

    from services.learner.attention import PACKED_ATTENTION
    from services.learner.pointwise import fuse_pointwise

    d, heads, kv, inter = {"1.5B": (1536, 12, 2, 8960), "7B": (3584, 28, 4, 18944)}[width]
    tokens, layers = 32768, 2
    lengths = [12000, 9000, tokens - 21000]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    held = {}
    for mode in ("keep-eager", "keep-fused", "lean"):
        cfg = Qwen2Config(
            hidden_size=d,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=inter,
            num_hidden_layers=layers,
            vocab_size=128,
            attn_implementation=PACKED_ATTENTION,
        )
        torch.manual_seed(0)
        model = Qwen2Model(cfg).to("cuda", torch.bfloat16).train()
        if mode == "keep-fused":
            fuse_pointwise(model)
        elif mode == "lean":
            lean_activations(model, compiled=True)
        h = (torch.randn(1, tokens, d, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
        for _ in range(2):  # the first pass compiles
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = model(
                inputs_embeds=h, position_ids=positions, use_cache=False, **packed_kwargs(positions)
            ).last_hidden_state
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - before
            out.float().square().mean().backward()
            model.zero_grad(set_to_none=True)
            h.grad = None
        held[mode] = kept / layers
        del model, out
        torch.cuda.empty_cache()
    per_token = {m: b / tokens for m, b in held.items()}
    print(
        json.dumps(
            {
                "width": width,
                "tokens": tokens,
                "bytes_per_token_per_layer": per_token,
                "gib_per_layer_at_32k": {m: b / 2**30 for m, b in held.items()},
            }
        )
    )
    assert per_token["keep-fused"] - per_token["lean"] >= 0.9 * 2 * (inter + 2 * d)
    assert per_token["lean"] < per_token["keep-fused"] < per_token["keep-eager"]
