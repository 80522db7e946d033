"""The engine takes a micro-batch's attention bounds computed on the host (PackedRow.bounds) as they are."""

from __future__ import annotations

import dataclasses

import torch

from services.learner.attention import packed_kwargs
from services.learner.batching import Sequence_, pack_sequences
from services.learner.config import EngineConfig, ScheduleConfig


def test_host_bounds_are_the_ones_attention_uses(tiny_model):
    from services.learner.engine import PolicyEngine

    g = torch.Generator().manual_seed(4)
    seqs = [
        Sequence_(torch.randint(100, 5000, (n,), generator=g).tolist(), [0, 0] + [1] * (n - 2), index=i)
        for i, n in enumerate((20, 30))
    ]
    (row,) = pack_sequences(seqs, 64)
    engine = PolicyEngine(tiny_model, EngineConfig(micro_batch_tokens=64), ScheduleConfig(lr=1e-3), total_steps=10)
    read_here, _ = engine.logprobs(row, grad=False)
    given = dataclasses.replace(row, bounds=packed_kwargs(row.position_ids[None]))
    from_host, _ = engine.logprobs(given, grad=False)
    torch.testing.assert_close(from_host, read_here, rtol=0, atol=0)
    # bounds saying the row is one sequence: its second sequence then reads the first, so they are used
    one = dataclasses.replace(row, bounds={})
    joined, _ = engine.logprobs(one, grad=False)
    assert torch.allclose(joined[:20], read_here[:20], atol=1e-5)
    assert not torch.allclose(joined[20:49], read_here[20:49], atol=1e-3)
    engine.close()
