"""Recomputation in backward runs under the SDPA kernels its forward ran under (issue 63, item 4).

The learner's forward runs inside `sdpa_priority`, its backward outside it. A layer recomputed in backward on
another SDPA kernel saves other tensors, and activation checkpointing refuses the mismatch (on an H200:
cuDNN's logsumexp saved as [1, 12, T, 1], flash's recomputed as [1, 12, T]). On CPU the same happens between
SDPA's math and flash kernels, so the CPU tests below fail without the fix (the first shows it with HF's plain
checkpointing)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointError

from services.learner.attention import PACKED_ATTENTION, PER_SEQUENCE_ATTENTION, packed_kwargs
from services.learner.engine import recompute_layers, sdpa_kernels_now, sdpa_priority

LENGTH = 40


def _model(tiny_model, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=attn)
    lm.config.use_cache = False
    return lm.train()


def _batch(packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(100, 4000, (1, LENGTH), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(25), torch.arange(LENGTH - 25)]) if packed else torch.arange(LENGTH)
    return ids, positions[None]


def _loss_under_math(lm, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The engine's order: the forward inside the kernel priority (math: not CPU SDPA's default, flash), the
    backward after it."""
    with sdpa_priority(["math"]):
        hidden = lm.model(
            input_ids=ids, position_ids=positions, use_cache=False, **packed_kwargs(positions)
        ).last_hidden_state
    return hidden.square().mean()


def test_plain_layer_checkpointing_recomputes_on_another_kernel(tiny_model):
    """The failure the fix removes, on CPU: HF's checkpointing recomputes under the default kernels."""
    lm = _model(tiny_model)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(CheckpointError, match="different metadata"):
        _loss_under_math(lm, *_batch(packed=False)).backward()


@pytest.mark.parametrize("packed", [False, True], ids=["single-sequence", "packed"])
def test_layer_recompute_keeps_the_forward_kernels_and_gradients(tiny_model, packed):
    """Each layer's attention sees the same SDPA kernels, in the same order, on its forward and on its recompute
    (recorded inside the call), and the gradients are those of the model kept whole."""
    ids, positions = _batch(packed)
    attn = PER_SEQUENCE_ATTENTION if packed else "sdpa"
    plain = _model(tiny_model, attn)
    _loss_under_math(plain, ids, positions).backward()

    lm = _model(tiny_model, attn)
    recompute_layers(lm)
    seen: list[list] = []
    lm.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: seen.append(sdpa_kernels_now()))
    _loss_under_math(lm, ids, positions).backward()

    assert len(seen) == 2, "the layer ran once forward and once recomputed"
    assert seen[0] == seen[1] != sdpa_kernels_now()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert grads
    for name, p in lm.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-7, msg=name)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuDNN and flash SDPA)")


@GPU
@pytest.mark.parametrize(
    "attn,packed",
    [("sdpa", False), (PACKED_ATTENTION, True), (PER_SEQUENCE_ATTENTION, True)],
    ids=["single-sequence", "packed-auto", "packed-per-sequence"],
)
def test_layer_recompute_under_cudnn_priority_on_gpu(tiny_model, attn, packed):
    """The case that crashed, layer by layer: the forward under cuDNN-then-flash, the backward outside; the
    gradients match the model kept whole (bf16)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 4000, (1, 2048), generator=g).cuda()
    positions = (torch.cat([torch.arange(n) for n in (700, 500, 848)]) if packed else torch.arange(2048))[None].cuda()

    def grads(recompute: bool) -> dict[str, torch.Tensor]:
        lm = _model(tiny_model, attn).to("cuda", torch.bfloat16)
        if recompute:
            recompute_layers(lm)
        with sdpa_priority(["cudnn", "flash"]):
            hidden = lm.model(
                input_ids=ids, position_ids=positions, use_cache=False, **packed_kwargs(positions)
            ).last_hidden_state
        hidden.float().square().mean().backward()
        return {n: p.grad.float() for n, p in lm.named_parameters() if p.grad is not None}

    plain, recomputed = grads(False), grads(True)
    assert plain.keys() == recomputed.keys() and plain
    for name, g_plain in plain.items():
        torch.testing.assert_close(recomputed[name], g_plain, rtol=2e-2, atol=2e-3, msg=name)


@GPU
@pytest.mark.parametrize("packed", [False, True], ids=["single-sequence", "packed"])
def test_engine_gradient_checkpointing_with_sdpa_backends_on_gpu(tiny_model, packed):
    """The recipes' `gradient_checkpointing` with the documented `sdpa_backends: [cudnn, flash]` through the
    engine: a step on a single-sequence and on a packed micro-batch completes with a finite gradient norm."""
    from services.learner.batching import Sequence_, pack_sequences
    from services.learner.config import EngineConfig, ScheduleConfig
    from services.learner.engine import PolicyEngine

    g = torch.Generator().manual_seed(0)
    lengths = [700, 500, 800] if packed else [2048]
    seqs = [
        Sequence_(torch.randint(100, 5000, (n,), generator=g).tolist(), [0, 0] + [1] * (n - 2), index=i)
        for i, n in enumerate(lengths)
    ]
    (row,) = pack_sequences(seqs, 2048)
    cfg = EngineConfig(micro_batch_tokens=2048, gradient_checkpointing=True, sdpa_backends=["cudnn", "flash"])
    engine = PolicyEngine(tiny_model, cfg, ScheduleConfig(lr=1e-4), total_steps=10)
    logp, _ = engine.logprobs(row, grad=True)
    engine.backward((logp * row.mask.to(logp.device).flatten()).sum() / row.mask.sum())
    assert torch.isfinite(torch.tensor(engine.step().grad_norm))
    engine.close()
