"""Rows packed and dealt by work (services/learner/balancing.py, batching.plan_rows): even work across ranks on
the recipe's lengths, every token once with its old loss weight, and the rows a rank builds equal to the
token-by-token ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.learner_multigpu import RECIPE_LENGTHS, RECIPE_ROW_TOKENS, length_location
from services.learner.attention import packed_kwargs
from services.learner.balancing import costed_rows, deal_rounds, even_out, spread
from services.learner.batching import (
    PackedRow,
    RankRows,
    Sequence_,
    assign_weights,
    pack_bins,
    pack_sequences,
    plan_rows,
    rank_micro_batches,
    sequence_weights,
    shard_rows,
    stack_rows,
    weighted_row,
)
from services.learner.flops import QWEN25_1P5B_COST, TrajectoryCost, train_flops

RECIPE_STEP = 32 * 8  # configs/qwen2.5-1.5b-arpo-macro.yaml: batch_prompts x group_size trajectories a step
SIGMA = 0.6  # bench/learner_multigpu.py --length-sigma


def recipe_lengths(count: int, seed: int) -> np.ndarray:
    """Trajectory lengths as the benchmark draws them: a log-normal clipped to the recipe's range, mean ~10.3K."""
    lo, mean, hi = RECIPE_LENGTHS["min"], RECIPE_LENGTHS["mean"], RECIPE_LENGTHS["max"]
    draws = np.random.default_rng(seed).lognormal(length_location(mean, SIGMA, lo, hi), SIGMA, count)
    return np.clip(np.round(draws), lo, hi).astype(np.int64)


def token_dealt_work(lengths: np.ndarray, world: int) -> list[float]:
    """Each rank's work under the earlier dealing: first-fit decreasing rows, dealt by tokens."""
    seqs = [Sequence_(np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), index=i) for i, n in enumerate(lengths)]
    rows = [weighted_row([seqs[i] for i in b], {}) for b in pack_bins(lengths.tolist(), RECIPE_ROW_TOKENS)]
    members = [
        [r.seq_index.unique().tolist() for r in shard_rows(rows, world, k) if r.seq_index[0] >= 0] for k in range(world)
    ]
    return [float(sum(QWEN25_1P5B_COST(lengths[m]).sum() for m in rank)) for rank in members]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_recipe_step_work_is_even_across_ranks(world):
    worst = 0.0
    for seed in range(4):
        lengths = recipe_lengths(RECIPE_STEP, seed)
        plan = plan_rows(lengths, RECIPE_ROW_TOKENS, world)
        worst = max(worst, spread(plan.rank_work()))
        assert spread(plan.rank_work()) <= 0.05, (seed, plan.rank_work())
        # the plan is a packing: each trajectory once, rows within the capacity, every rank as many rows
        assert sorted(i for r in plan.rows for i in r) == list(range(RECIPE_STEP))
        assert max(int(lengths[r].sum()) for r in plan.rows) <= RECIPE_ROW_TOKENS
        assert len({len(r) for r in plan.ranks}) == 1
        assert sorted(k for r in plan.ranks for k in r) == list(range(len(plan.rows)))
        # no more rows than first-fit decreasing needs, up to the next multiple of the ranks
        assert len(plan.rows) == -(-len(pack_bins(lengths.tolist(), RECIPE_ROW_TOKENS)) // world) * world
        work = [train_flops(*_shape(QWEN25_1P5B_COST), lengths[sum((plan.rows[k] for k in r), [])]) for r in plan.ranks]
        assert plan.rank_work() == pytest.approx(work, rel=1e-9)  # the plan's work is the MFU's FLOPs
    # the earlier dealing by tokens is several times less even on the same lengths (what the new one is for)
    assert max(spread(token_dealt_work(recipe_lengths(RECIPE_STEP, s), world)) for s in range(4)) > 4 * worst


def _shape(cost: TrajectoryCost) -> tuple[int, int, int]:
    return cost.n_params, cost.layers, cost.attn_width


def test_micro_batches_of_a_round_have_neighbouring_work():
    """Under ZeRO-3 a micro-batch waits for the slowest rank: each round's rows are neighbours in work."""
    lengths = recipe_lengths(RECIPE_STEP, 7)
    plan = plan_rows(lengths, RECIPE_ROW_TOKENS, 4)
    rounds = np.array([[plan.costs[r[k]] for r in plan.ranks] for k in range(len(plan.ranks[0]))])
    assert (np.diff(rounds.max(axis=1)) <= 0).all()  # costliest rounds first
    assert rounds.max(axis=1).sum() <= 1.05 * plan.costs.sum() / 4  # near the ideal step time


def test_costed_rows_respect_the_capacity_or_say_they_cannot():
    lengths = np.array([30, 30, 30, 10])
    cost = np.array([9.0, 9.0, 9.0, 1.0])
    rows = costed_rows(lengths, cost, 40, 3)
    assert rows == [[0, 3], [1], [2]]  # the cheap one to the first of three equal rows
    assert costed_rows(np.array([30, 30, 30]), np.ones(3), 40, 2) is None


def test_even_out_lowers_the_heaviest_row_within_the_capacity():
    lengths = np.array([10, 10, 10, 10, 2, 2])
    cost = lengths.astype(float) ** 2
    rows = even_out([[0, 1, 2], [3, 4, 5]], lengths, cost, 32)
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert max(cost[r].sum() for r in rows) < 300  # from 300 | 108 to 208 | 200
    assert all(lengths[r].sum() <= 32 for r in rows) and all(rows)


def test_deal_rounds_needs_whole_rounds():
    assert deal_rounds([5.0, 4.0, 3.0, 2.0], 2) == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="do not deal evenly"):
        deal_rounds([1.0, 2.0, 3.0], 2)


def _seqs(lengths, seed=0, groups=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = [0] * min(3, n) + torch.randint(0, 2, (max(n - 3, 0),), generator=g).tolist()
        lps = [None if (m == 0 or j % 7 == 0) else -float(torch.rand(1, generator=g)) for j, m in enumerate(mask)]
        out.append(
            Sequence_(
                torch.randint(1, 900, (n,), generator=g).tolist(),
                mask,
                lps if i % 4 else None,
                advantage=float(torch.randn(1, generator=g)),
                index=i,
                group=f"g{i % groups}",
            )
        )
    return out


FIELDS = ("input_ids", "position_ids", "targets", "mask", "old_logp", "has_old", "advantages", "seq_index", "weights")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "group-token-mean"])
def test_a_row_built_from_arrays_is_the_row_packed_token_by_token(mode):
    seqs = _seqs([23, 1, 40, 17, 9, 31, 12])
    old = pack_sequences(seqs, 64)
    assign_weights(old, mode, {s.index: s.group for s in seqs})
    scale = sequence_weights(seqs, mode)
    for row in old:
        members = sorted(set(row.seq_index.tolist()))
        new = weighted_row([seqs[i] for i in members], scale)
        for f in FIELDS:
            a, b = getattr(row, f), getattr(new, f)
            assert a.dtype == b.dtype and torch.equal(a, b), f


def _token_weights(batches: list[PackedRow]) -> dict[tuple[int, int], tuple[float, int]]:
    """(sequence, position) → (weight, target) for every real token of the micro-batches."""
    out = {}
    for b in batches:
        real = b.seq_index >= 0
        for s, p, w, t in zip(
            b.seq_index[real].tolist(),
            b.position_ids[real].tolist(),
            b.weights[real].tolist(),
            b.targets[real].tolist(),
        ):
            assert (s, p) not in out
            out[(s, p)] = (w, t)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_work_dealing_trains_every_token_once_with_its_old_weight(world):
    seqs = _seqs([23, 40, 17, 9, 31, 12, 44, 5, 28, 36, 2], seed=world)
    old, new = [], []
    for rank in range(world):
        old += rank_micro_batches(seqs, 48, world, rank, 2, 8, "group-token-mean", balance="tokens")
        mine = rank_micro_batches(seqs, 48, world, rank, 2, 8, "group-token-mean")
        new += mine
        assert len(mine) == len(rank_micro_batches(seqs, 48, world, 0, 2, 8, "group-token-mean"))
        assert all(b.input_ids.shape[1] % 8 == 0 for b in mine)
    assert _token_weights(new) == _token_weights(old)
    assert len(_token_weights(new)) == sum(len(s) for s in seqs)


def test_a_micro_batch_carries_its_attention_bounds_from_the_host():
    seqs = _seqs([23, 40, 17, 9, 31, 12])
    rows = pack_sequences(seqs, 48)
    assign_weights(rows)
    batch = stack_rows(rows[:3], 16)
    want = packed_kwargs(batch.position_ids)
    assert batch.bounds.keys() == want.keys() and want
    assert torch.equal(batch.bounds["cu_seq_lens_q"], want["cu_seq_lens_q"])
    assert batch.bounds["cu_seq_lens_q"].device.type == "cpu" and batch.bounds["cu_seq_lens_q"].dtype == torch.int32
    assert batch.bounds["sequence_spans"] == want["sequence_spans"]
    assert batch.bounds["max_length_q"] == want["max_length_q"]
    lone = stack_rows([weighted_row(seqs[:1], sequence_weights(seqs[:1]))])
    assert lone.bounds == {}  # one sequence a row: the plain causal path


def test_long_empty_and_few_sequences_still_give_every_rank_its_rows():
    seqs = _seqs([70, 0, 12])  # one longer than a row, one empty, fewer than the ranks
    for rank in range(4):
        mine = rank_micro_batches(seqs, 48, 4, rank)
        assert len(mine) == 1  # four rows: two real, two fillers
    got = [int(b.seq_index.max()) for rank in range(4) for b in rank_micro_batches(seqs, 48, 4, rank)]
    assert sorted(got) == [-1, -1, 0, 2]


def test_bad_input_fails_on_every_rank_alike():
    seqs = _seqs([20, 30, 25, 22])
    seqs[3].loss_mask = seqs[3].loss_mask[:-1]
    for rank in range(2):  # the bad sequence sits on one rank's rows, yet both ranks refuse the step
        with pytest.raises(ValueError, match="sequence 3: 22 token ids but 21 loss-mask entries"):
            rank_micro_batches(seqs, 48, 2, rank)
    with pytest.raises(ValueError, match="unknown row balance"):
        rank_micro_batches(seqs[:3], 48, 2, 0, balance="flops")


def test_rank_rows_build_a_micro_batch_when_first_asked_and_keep_it():
    seqs = _seqs([23, 40, 17, 9, 31, 12, 44])
    lazy = RankRows(seqs, 48, 2, 1, 2, 8)
    assert not lazy._built and lazy.filled == sum(1 for r in lazy.plan.ranks[1] if lazy.plan.rows[r])
    first = lazy[0]
    assert lazy[0] is first and len(lazy._built) == 1
    eager = rank_micro_batches(seqs, 48, 2, 1, 2, 8)
    assert len(eager) == len(lazy)
    for a, b in zip(eager, lazy):
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)
    with pytest.raises(IndexError):
        lazy[len(lazy)]
