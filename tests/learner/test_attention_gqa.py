"""Packed attention with grouped-query attention kept native (`varlen-gqa`), and cuDNN's per-sequence plans
built up front: exact against unpacked rows on CPU, within bf16 of them on a GPU."""

from __future__ import annotations

import pytest
import torch

from services.learner.attention import (
    IMPLEMENTATIONS,
    PACKED_IMPLEMENTATIONS,
    VARLEN_GQA_ATTENTION,
    FlashVarlenGQA,
    _varlen,
    packed_kwargs,
    sequence_layout,
    uses_varlen_kernel,
    warm_sequence_plans,
)
from services.learner.config import EngineConfig
from services.learner.engine import attention_choice

LENGTHS = (30, 18, 44)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlashAttention's varlen kernel)")


def _layers(impl: str, device: str = "cpu", dtype=torch.float32, heads: int = 8, kv_heads: int = 2):
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(
        hidden_size=256,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=512,
        num_hidden_layers=2,
        vocab_size=64,
        attn_implementation=impl,
    )
    torch.manual_seed(0)
    return Qwen2Model(config).to(device=device, dtype=dtype).train()


def _packed_against_alone(impl: str, device: str, dtype) -> tuple[list, list]:
    """(packed, alone) pairs of outputs and input gradients for one row of LENGTHS."""
    model = _layers(impl, device, dtype)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(1, n, 256, generator=g).to(device, dtype) for n in LENGTHS]
    row = torch.cat(seqs, dim=1).requires_grad_()
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(device)
    out = model(
        inputs_embeds=row, position_ids=positions, use_cache=False, **packed_kwargs(positions)
    ).last_hidden_state
    out.float().square().sum().backward()
    alone_out, alone_grad = [], []
    for s in seqs:
        s = s.clone().requires_grad_()
        o = model(
            inputs_embeds=s, position_ids=torch.arange(s.shape[1], device=device)[None], use_cache=False
        ).last_hidden_state
        o.float().square().sum().backward()
        alone_out.append(o.detach())
        alone_grad.append(s.grad)
    return [out.detach(), row.grad], [torch.cat(alone_out, dim=1), torch.cat(alone_grad, dim=1)]


def test_varlen_gqa_is_an_option_of_the_learner():
    assert attention_choice(EngineConfig(packed_attention="varlen-gqa")) == {
        "attn_implementation": VARLEN_GQA_ATTENTION
    }
    assert VARLEN_GQA_ATTENTION in PACKED_IMPLEMENTATIONS and IMPLEMENTATIONS["varlen-gqa"] == VARLEN_GQA_ATTENTION


def test_varlen_gqa_packed_rows_are_exact_against_unpacked_on_cpu():
    """On CPU `varlen-gqa` runs SDPA per sequence (with GQA native, as transformers calls it): the packed
    row's outputs and input gradients are its sequences' alone."""
    assert not uses_varlen_kernel(torch.zeros(1))
    packed, alone = _packed_against_alone(VARLEN_GQA_ATTENTION, "cpu", torch.float32)
    for p, a in zip(packed, alone):
        torch.testing.assert_close(p, a, rtol=1e-5, atol=1e-6)


def test_each_sequence_reaches_sdpa_in_the_layers_own_layout():
    """A slice of a layer's [1, heads, T, D] query (a view of [1, T, heads, D]) reaches SDPA with those strides,
    padded after its end or not, and a contiguous [heads, T, D] tensor is laid out the same way: so every
    per-sequence call shares the plain path's layout (cuDNN's plans do not key on it)."""
    layer_q = torch.randn(1, 10, 4, 8).transpose(1, 2)
    for heads_first in (layer_q[0, :, 2:7], layer_q[0, :, 2:7].contiguous()):
        for extra in (0, 3):
            one = sequence_layout(heads_first, extra)
            assert one.shape == (1, 4, 5 + extra, 8)
            assert one.stride()[1:] == (8, 32, 1), (heads_first.is_contiguous(), extra)
            assert torch.equal(one[0, :, :5], layer_q[0, :, 2:7]) and not one[0, :, 5:].any()


def test_sequence_plans_are_built_for_every_padded_length():
    lengths = warm_sequence_plans(4, 2, 16, longest=10, device=torch.device("cpu"), dtype=torch.float32, multiple=4)
    assert lengths == [4, 8, 12]
    assert warm_sequence_plans(4, 4, 16, longest=8, device=torch.device("cpu"), dtype=torch.float32, multiple=4) == [
        4,
        8,
    ]


@GPU
def test_flash_varlen_gqa_matches_repeated_kv_and_sdpa_per_sequence():
    """The kernel alone: K/V at 2 heads for 8 query heads against the same with K/V repeated (today's
    varlen on torch without enable_gqa) and against causal SDPA per sequence; forward and gradients."""
    g = torch.Generator(device="cuda").manual_seed(0)
    total, heads, kv, d = sum(LENGTHS), 8, 2, 64
    q = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (
        torch.randn(total, kv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2)
    )
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    grad = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def run(fn):
        for t in (q, k, v):
            t.grad = None
        out = fn()
        out.backward(grad)
        return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]

    native = run(lambda: FlashVarlenGQA.apply(q, k, v, cu, max(LENGTHS), None, None))
    repeated = run(
        lambda: _varlen(
            q, k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1), cu, max(LENGTHS), None
        )
    )

    def per_sequence():
        parts = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            one = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
            parts.append(
                torch.nn.functional.scaled_dot_product_attention(*one, is_causal=True, enable_gqa=True)[0].transpose(
                    0, 1
                )
            )
        return torch.cat(parts)

    sdpa = run(per_sequence)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), native, repeated, sdpa):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=name)
        torch.testing.assert_close(a, c, rtol=2e-2, atol=2e-2, msg=name)


@GPU
def test_varlen_gqa_packed_rows_match_unpacked_on_gpu():
    packed, alone = _packed_against_alone(VARLEN_GQA_ATTENTION, "cuda", torch.bfloat16)
    for p, a in zip(packed, alone):
        torch.testing.assert_close(p.float(), a.float(), rtol=3e-2, atol=3e-2)
