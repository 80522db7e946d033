"""Several packed rows per forward/backward (`micro_batch_rows`): padding carries no loss, batches
of single-sequence rows keep SDPA's plain causal path, and a step comes out as with one row per pass."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.learner.batching import Sequence_, assign_weights, micro_batches, pack_sequences, rl_sequences, shard_rows
from services.learner.config import EngineConfig, FilterConfig, ScheduleConfig
from services.learner.steps import rl_step, sft_step, split_mini_batches

from .conftest import behaviour_logprobs, scored_batch

# Capacity 64 packs these into rows [60], [50 + 12], [33 + 30], [20]: rows of different lengths,
# two of them holding two sequences each.
CAPACITY = 64
LENGTHS = [60, 50, 33, 30, 20, 12]


def _seqs(lengths: list[int], seed: int = 0, logprobs: list[list[float]] | None = None) -> list[Sequence_]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(100, 5000, (n,), generator=g).tolist()
        lps = None
        if logprobs is not None:
            lps = [None, None] + logprobs[i][2:]  # the prompt has no rollout logprob
        out.append(Sequence_(ids, [0, 0] + [1] * (n - 2), lps, advantage=1.5 if i % 2 else -0.7, index=i))
    return out


def _rl_seqs(model_dir) -> list[Sequence_]:
    """Rollout logprobs off the learner's by noise, so ratios vary and some clip."""
    plain = _seqs(LENGTHS)
    g = torch.Generator().manual_seed(1)
    lps = [
        [lp + 0.3 * float(torch.randn((), generator=g)) for lp in row]
        for row in behaviour_logprobs(model_dir, [s.token_ids for s in plain])
    ]
    return _seqs(LENGTHS, logprobs=lps)


def _weighted_rows(seqs: list[Sequence_]):
    rows = pack_sequences(seqs, CAPACITY)
    assign_weights(rows)
    return rows


def test_padding_carries_no_loss_and_continues_positions():
    rows = _weighted_rows(_seqs(LENGTHS))
    assert sorted(r.tokens for r in rows) == [20, 60, 62, 63]
    first, second = micro_batches(rows, 2)
    assert first.input_ids.shape == (2, 63) and second.input_ids.shape == (2, 60)
    short = second.position_ids[1]  # the 20-token row, padded by 40
    assert short.tolist() == list(range(60))  # no restart: still one sequence to transformers
    pad = slice(20, 60)
    assert not second.mask[1, pad].any() and not second.weights[1, pad].any()
    assert not second.has_old[1, pad].any() and not second.advantages[1, pad].any()
    assert (second.seq_index[1, pad] == -1).all() and not second.old_logp[1, pad].any()
    # a packed row keeps its restart and continues its last sequence's positions into the padding
    packed = first.position_ids[1]  # 50 + 12 tokens, padded by 1
    assert packed[50:].tolist() == list(range(13))
    with pytest.raises(ValueError, match="loss weights"):
        micro_batches(pack_sequences(_seqs([10, 8]), CAPACITY), 2)


def test_lengths_round_up_to_the_pad_multiple_with_no_loss_on_the_padding():
    rows = _weighted_rows(_seqs(LENGTHS))
    batches = micro_batches(rows, 2, pad_to_multiple=16)
    assert [b.input_ids.shape for b in batches] == [(2, 64), (2, 64)]  # 63 → 64, 60 → 64
    assert sum(float(b.mask.sum()) for b in batches) == sum(float(r.mask.sum()) for r in rows)
    assert sum(float(b.weights.sum()) for b in batches) == pytest.approx(sum(float(r.weights.sum()) for r in rows))
    single = micro_batches(rows, 1, pad_to_multiple=16)
    assert sorted(b.input_ids.shape[1] for b in single) == [32, 64, 64, 64]  # 20, 60, 62, 63
    assert single[-1].position_ids[0].tolist() == list(range(32))  # padding continues the positions


def test_every_rank_runs_the_same_number_of_micro_batches():
    lengths = [60, 55, 50, 45, 40]  # no two share a row: 5 rows over 2 ranks, so one filler
    rows = _weighted_rows(_seqs(lengths))
    counts = [len(micro_batches(shard_rows(rows, 2, rank), 2)) for rank in (0, 1)]
    assert counts == [2, 2]
    tokens = sum(float(b.mask.sum()) for rank in (0, 1) for b in micro_batches(shard_rows(rows, 2, rank), 2))
    assert tokens == sum(n - 2 for n in lengths)


@pytest.fixture(scope="module")
def make_engine(tiny_model):
    from services.learner.engine import PolicyEngine

    def make(rows: int, pad: int = 1):
        # adam_eps 1: Adam's first update is lr·g/(|g| + 1) ≈ lr·g, so the weights show the gradient
        # itself (with the default eps it would be ≈ lr·sign(g), blind to a wrong magnitude); a large
        # lr lifts that update far above the fp32 rounding of the weights it is added to.
        cfg = EngineConfig(
            micro_batch_tokens=CAPACITY,
            micro_batch_rows=rows,
            pad_to_multiple=pad,
            attn_implementation="sdpa",
            adam_eps=1.0,
        )
        return PolicyEngine(tiny_model, cfg, ScheduleConfig(lr=0.1), total_steps=10)

    return make


@pytest.mark.slow
def test_single_sequence_rows_take_the_unmasked_causal_path(make_engine, monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    masks = []
    real = modeling_qwen2.create_causal_mask

    def spy(*args, **kwargs):
        masks.append(real(*args, **kwargs))
        return masks[-1]

    monkeypatch.setattr(modeling_qwen2, "create_causal_mask", spy)
    engine = make_engine(2)
    seqs = _seqs([40, 25, 30, 20])
    single = _weighted_rows(seqs[:2])  # 40 and 25: one sequence per row (capacity 64)
    (batch,) = micro_batches(single, 2)
    together, _ = engine.logprobs(batch, grad=False)
    assert masks == [None]  # SDPA gets is_causal and no mask: the flash / cuDNN kernels stay eligible
    # padding changed no real token's logprob
    for k, row in enumerate(single):
        alone, _ = engine.logprobs(row, grad=False)
        assert torch.allclose(together[k * 40 : k * 40 + row.tokens], alone, atol=1e-5)
    # a row holding two sequences keeps them apart by their boundaries (packed attention), with no block mask
    (packed,) = _weighted_rows(seqs[2:])  # 30 + 20 tokens in one row
    (batch,) = micro_batches([packed, single[0]], 2)  # [50 | 40 + 10 padding]
    masks.clear()
    out, _ = engine.logprobs(batch, grad=False)
    assert masks == [None]
    for s, start in ((seqs[2], 0), (seqs[3], 30), (seqs[0], 50)):
        alone, _ = engine.logprobs(pack_sequences([s], CAPACITY)[0], grad=False)
        assert torch.allclose(out[start : start + len(s)], alone, atol=1e-5)


def _step(make_engine, rows: int, step, seqs, pad: int = 1, **kw) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    engine = make_engine(rows, pad)
    before = {n: p.detach().clone() for n, p in engine.hf_model.named_parameters()}
    metrics = step(engine, seqs, **kw).metrics
    delta = {n: p.detach() - before[n] for n, p in engine.hf_model.named_parameters()}
    return metrics, delta


def _assert_same(a: tuple[dict, dict], b: tuple[dict, dict], keys: list[str]) -> None:
    (m1, d1), (m2, d2) = a, b
    for key in keys:
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-9), key
    moved = 0
    for name, ref in d1.items():
        scale = ref.norm().item()
        moved += scale > 0
        # 1e-4, not 1e-5: a norm weight near 1 rounds its small update to fp32 steps of 1.2e-7, so a
        # last-bit difference in the gradient sum can flip a rounding (seen: 9e-6 of the update).
        assert (d2[name] - ref).norm().item() <= 1e-4 * scale + 1e-12, name
    assert moved >= 10  # the step moved the weights, so the comparison means something


RL_KEYS = [
    "loss",
    "loss_tokens",
    "grad_norm",
    "clip_fraction",
    "clip_fraction_high",
    "clip_fraction_low",
    "ratio_mean",
    "entropy",
    "mismatch_kl_k1",
    "mismatch_kl_k3",
    "mismatch_logp_max_abs",
]


@pytest.fixture(scope="module")
def rl_reference(make_engine, tiny_model):
    seqs = _rl_seqs(tiny_model)
    return seqs, _step(make_engine, 1, rl_step, seqs, eps_low=0.2, eps_high=0.28)


# (rows per pass, pad-to-multiple): several rows, and lengths rounded up to a multiple of 16
SHAPES = [(2, 1), (3, 1), (1, 16), (2, 16)]


@pytest.mark.parametrize(("rows", "pad"), SHAPES)
def test_rl_step_is_the_same_with_several_rows_per_pass(make_engine, rl_reference, rows, pad):
    seqs, reference = rl_reference
    assert 0.0 < reference[0]["clip_fraction"] < 1.0  # ratios vary: the comparison covers clipping
    _assert_same(reference, _step(make_engine, rows, rl_step, seqs, pad, eps_low=0.2, eps_high=0.28), RL_KEYS)


@pytest.mark.parametrize(("rows", "pad"), SHAPES)
def test_sft_step_is_the_same_with_several_rows_per_pass(make_engine, rows, pad):
    seqs = _seqs(LENGTHS, seed=2)
    keys = ["loss", "loss_tokens", "grad_norm"]
    _assert_same(_step(make_engine, 1, sft_step, seqs), _step(make_engine, rows, sft_step, seqs, pad), keys)


def test_a_batch_splits_into_even_contiguous_shares_and_never_an_empty_one():
    seqs = _seqs(LENGTHS)
    assert [[s.index for s in share] for share in split_mini_batches(seqs, 3)] == [[0, 1], [2, 3], [4, 5]]
    assert [len(share) for share in split_mini_batches(seqs, 4)] == [1, 2, 1, 2]
    assert [len(share) for share in split_mini_batches(seqs, 10)] == [1] * 6
    assert split_mini_batches(seqs, 1) == [seqs]


def _grouped(sizes: list[int]) -> list[Sequence_]:
    """Sequences of consecutive groups, `sizes[k]` samples in group k."""
    seqs = _seqs([8] * sum(sizes))
    groups = [f"g{k}" for k, n in enumerate(sizes) for _ in range(n)]
    return [dataclasses.replace(s, group=g) for s, g in zip(seqs, groups)]


def _share_groups(shares: list[list[Sequence_]]) -> list[list[str]]:
    return [sorted({s.group for s in share}) for share in shares]


def test_a_group_never_straddles_two_mini_batches():
    # three groups of eight left by DAPO out of a batch of eight: cut in quarters by sample count,
    # two of the shares would hold parts of a group whose advantages do not balance
    seqs = _grouped([8, 8, 8])
    assert _share_groups(split_mini_batches(seqs, 4)) == [["g0"], ["g1"], ["g2"]]
    # a full batch of 8 groups in 4 updates is 2 groups an update; a shrunken one keeps that size
    assert _share_groups(split_mini_batches(seqs, 4, batch_groups=8)) == [["g0"], ["g1", "g2"]]
    assert _share_groups(split_mini_batches(_grouped([8] * 8), 4, batch_groups=8)) == [
        ["g0", "g1"],
        ["g2", "g3"],
        ["g4", "g5"],
        ["g6", "g7"],
    ]
    one = split_mini_batches(_grouped([8]), 4, batch_groups=8)
    assert len(one) == 1 and len(one[0]) == 8
    # a group's samples stay together even when they arrive apart, and uneven groups stay whole
    mixed = _grouped([3, 5])
    mixed = [mixed[0], mixed[3], mixed[1], mixed[4], mixed[2], *mixed[5:]]
    shares = split_mini_batches(mixed, 2)
    assert [len(s) for s in shares] == [3, 5] and _share_groups(shares) == [["g0"], ["g1"]]


def test_rl_sequences_carry_their_group(tiny_model):
    trajs = scored_batch(tiny_model, groups=2, group_size=4)
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0)
    assert [s.group for s in batch.sequences] == [t.group_id for t in trajs]


def test_mini_batches_are_optimizer_steps_in_a_row_on_their_shares(make_engine, rl_reference):
    """Two mini-batches equal two one-update steps on the halves, one after the other: the second
    half's ratios are taken under the weights the first half moved."""
    seqs, single = rl_reference
    first, second = split_mini_batches(seqs, 2)
    engine = make_engine(1)
    before = {n: p.detach().clone() for n, p in engine.hf_model.named_parameters()}
    m1 = rl_step(engine, first, eps_low=0.2, eps_high=0.28).metrics
    m2 = rl_step(engine, second, eps_low=0.2, eps_high=0.28).metrics
    in_a_row = {n: p.detach() - before[n] for n, p in engine.hf_model.named_parameters()}
    assert engine.step_count == 2

    engine = make_engine(1)
    before = {n: p.detach().clone() for n, p in engine.hf_model.named_parameters()}
    m = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28, mini_batches=2).metrics
    assert engine.step_count == 2 and m["optimizer_steps"] == 2.0
    tokens = m1["loss_tokens"] + m2["loss_tokens"]
    expected = {
        "loss": (m1["loss"] + m2["loss"]) / 2,
        "loss_tokens": tokens,
        "grad_norm": (m1["grad_norm"] + m2["grad_norm"]) / 2,
        "clip_fraction": (m1["clip_fraction"] * m1["loss_tokens"] + m2["clip_fraction"] * m2["loss_tokens"]) / tokens,
    }
    metrics = {k: m[k] for k in expected}
    _assert_same(
        (expected, in_a_row),
        (metrics, {n: p.detach() - before[n] for n, p in engine.hf_model.named_parameters()}),
        list(expected),
    )
    # and not the single update on the whole batch
    assert any((in_a_row[n] - d).norm().item() > 1e-3 * d.norm().item() for n, d in single[1].items())
