"""The proximal policy (the learner before a batch's first update) and log-probs at the sampler's
temperature, on the tiny policy through the real DeepSpeed engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.learner.batching import Sequence_, assign_weights, micro_batches, pack_sequences
from services.learner.config import EngineConfig, ScheduleConfig
from services.learner.steps import LossBounds, needs_proximal_forward, rl_step

from .conftest import behaviour_logprobs

CAPACITY = 64


@pytest.fixture
def make_engine(tiny_model):
    from services.learner.engine import PolicyEngine

    def make():
        # lr 0.1 with adam_eps 1: the first update is large enough that the second mini-batch's
        # ratios against the pre-update policy differ from 1
        cfg = EngineConfig(micro_batch_tokens=CAPACITY, attn_implementation="sdpa", adam_eps=1.0)
        return PolicyEngine(tiny_model, cfg, ScheduleConfig(lr=0.1), total_steps=10)

    return make


def _seqs(tiny_model, with_logprobs: list[bool]) -> list[Sequence_]:
    """Two groups of two; sequences flagged False carry no rollout logprobs. Those that do carry
    the starting policy's, a little off (as a sampler's would be)."""
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(100, 5000, (n,), generator=g).tolist() for n in (20, 16, 18, 12)]
    start = behaviour_logprobs(tiny_model, ids)
    out = []
    for i, (tok, lps, has) in enumerate(zip(ids, start, with_logprobs)):
        noisy = [None, None] + [lp + 0.05 * float(torch.randn((), generator=g)) for lp in lps[2:]]
        out.append(
            Sequence_(
                tok,
                [0, 0] + [1] * (len(tok) - 2),
                noisy if has else None,
                advantage=1.0 if i % 2 else -1.0,
                index=i,
                group=f"g{i // 2}",
            )
        )
    return out, start


def _delta(engine, before):
    return {n: p.detach() - before[n] for n, p in engine.hf_model.named_parameters()}


def _run(make_engine, seqs, **kw):
    engine = make_engine()
    before = {n: p.detach().clone() for n, p in engine.hf_model.named_parameters()}
    metrics = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28, mini_batches=2, **kw).metrics
    return metrics, _delta(engine, before)


def test_the_proximal_forward_is_needed_only_from_the_second_mini_batch(tiny_model):
    seqs, _ = _seqs(tiny_model, [True, True, False, True])
    off = LossBounds()
    assert not needs_proximal_forward(1, seqs, off, use_rollout_logprobs=False)  # one update: its own forward
    assert needs_proximal_forward(2, seqs, off, use_rollout_logprobs=True)  # one sequence lacks them
    full, _ = _seqs(tiny_model, [True] * 4)
    assert not needs_proximal_forward(2, full, off, use_rollout_logprobs=True)
    assert needs_proximal_forward(2, full, off, use_rollout_logprobs=False)
    assert needs_proximal_forward(2, full, LossBounds(importance_sampling="tis"), use_rollout_logprobs=True)


def test_missing_rollout_logprobs_fall_back_per_token_to_the_proximal_policy(make_engine, tiny_model):
    """Group g1's second sequence has no rollout logprobs. Its tokens must be judged against the
    policy before the batch's first update: the same step as one where those logprobs were the
    starting policy's own. The other sequences keep their rollout logprobs (per token, not per batch)."""
    seqs, start = _seqs(tiny_model, [True, True, True, False])
    metrics, moved = _run(make_engine, seqs)
    assert metrics["proximal_forward"] == 1.0 and metrics["optimizer_steps"] == 2.0
    filled = list(seqs)
    filled[3] = dataclasses.replace(seqs[3], logprobs=[None, None] + start[3][2:])
    expected, expected_moved = _run(make_engine, filled)
    assert expected["proximal_forward"] == 0.0
    for key in ("loss", "ratio_mean", "clip_fraction", "grad_norm"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    for name, ref in expected_moved.items():
        assert (moved[name] - ref).norm().item() <= 1e-3 * ref.norm().item() + 1e-9, name
    # the second update's ratios are not 1: the trust region holds from the second mini-batch on
    assert abs(metrics["ratio_mean"] - 1.0) > 1e-4


def test_without_rollout_logprobs_the_second_mini_batch_is_judged_against_the_first_policy(make_engine, tiny_model):
    seqs, _ = _seqs(tiny_model, [False] * 4)
    metrics, _ = _run(make_engine, seqs, use_rollout_logprobs=True)
    assert metrics["proximal_forward"] == 1.0
    assert abs(metrics["ratio_mean"] - 1.0) > 1e-4  # before: exactly 1 (the updated policy against itself)
    # importance correction on: rollout logprobs present, the ratio against the proximal policy, and
    # weights π_prox / π_behaviour (noise of 0.05 nats: all inside [0.5, 2], none truncated)
    full, _ = _seqs(tiny_model, [True] * 4)
    tis, _ = _run(make_engine, full, bounds=LossBounds(importance_sampling="tis"))
    assert tis["proximal_forward"] == 1.0 and tis["is_truncated_fraction"] == 0.0
    assert tis["is_weight_mean"] == pytest.approx(1.0, abs=0.05) and tis["is_weight_mean"] != 1.0


def test_learner_logprobs_follow_the_sampling_temperature(make_engine, tiny_model):
    from transformers import AutoModelForCausalLM

    seqs, _ = _seqs(tiny_model, [True] * 4)
    rows = pack_sequences(seqs[:1], CAPACITY)
    assign_weights(rows)
    batch = micro_batches(rows, 1)[0]
    engine = make_engine()
    plain, _ = engine.logprobs(batch, grad=False)
    engine.module.temperature = 0.5
    tempered, _ = engine.logprobs(batch, grad=False)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([seqs[0].token_ids])
    with torch.no_grad():
        logits = lm(ids).logits[0, :-1].float()
    target = ids[0, 1:, None]
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, target).squeeze(-1)
    n = len(seqs[0].token_ids) - 1
    assert torch.allclose(tempered[:n], expected, atol=1e-4)
    assert not torch.allclose(plain[:n], expected, atol=1e-2)  # the untempered log-probs differ
