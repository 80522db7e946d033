"""The engine's `activation_memory` option: lean layers train as the model's own."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.learner.batching import Sequence_, pack_sequences
from services.learner.config import EngineConfig, ScheduleConfig


def test_lean_activations_give_the_engine_the_same_logprobs_and_gradient_norm(tiny_model):
    from services.learner.engine import PolicyEngine

    g = torch.Generator().manual_seed(2)
    seqs = [
        Sequence_(torch.randint(100, 5000, (n,), generator=g).tolist(), [0, 0] + [1] * (n - 2), index=i)
        for i, n in enumerate((20, 30))
    ]
    (row,) = pack_sequences(seqs, 64)
    seen = {}
    for memory in ("keep", "lean"):
        engine = PolicyEngine(
            tiny_model,
            EngineConfig(micro_batch_tokens=64, activation_memory=memory),
            ScheduleConfig(lr=1e-3),
            total_steps=10,
        )
        down_calls = []  # the lean MLP folds down_proj into its own function, which calls no module
        engine.hf_model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *_: down_calls.append(1))
        logp, _ = engine.logprobs(row, grad=True)
        assert len(down_calls) == (0 if memory == "lean" else 1)
        engine.backward((logp * row.mask.flatten()).sum())
        seen[memory] = (logp.detach(), engine.step().grad_norm)
        engine.close()
    torch.testing.assert_close(seen["lean"][0], seen["keep"][0], rtol=1e-6, atol=1e-6)
    assert seen["lean"][1] == pytest.approx(seen["keep"][1], rel=1e-5) and seen["keep"][1] > 0


def test_lean_activations_refuse_compiled_layers():
    with pytest.raises(ValidationError, match="activation_memory lean"):
        EngineConfig(activation_memory="lean", compile_layers=True)
    with pytest.raises(ValidationError, match="activation_memory"):
        EngineConfig(activation_memory="none")
