"""From data to tensors: scored trajectories and SFT chats → packed next-token rows.

A row concatenates whole sequences up to a token capacity; `position_ids` restart at 0 for each
sequence, which transformers turns into a block-diagonal causal mask, so packed sequences never
attend to each other. Every per-token array is aligned to "predict the next token": position t
carries the target token_ids[t+1] and that target's loss mask, behaviour logprob and advantage.
A micro-batch stacks rows of similar length into [B, T] tensors (`micro_batches`), one forward
and backward for all of them.

A step's rows are planned from the sequences' lengths alone (`plan_rows`: packed and dealt to ranks and
micro-batches by their work, balancing.py), the same plan on every rank; each rank then builds only
its own rows (`rank_micro_batches`), with numpy over whole sequences rather than token by token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from services.common.schemas import ScoredTrajectory
from services.learner import algorithms as alg
from services.learner.attention import packed_kwargs
from services.learner.balancing import costed_rows, deal_rounds, even_out
from services.learner.config import TRUNCATED_FINISHES, FilterConfig, ScheduleConfig
from services.learner.flops import QWEN25_1P5B_COST, TrajectoryCost

# How a step's sequences become this rank's rows: "work" packs and deals by training FLOPs (the default),
# "tokens" is first-fit decreasing by tokens, dealt largest first by tokens (the earlier dealing).
Balance = Literal["work", "tokens"]


@dataclass
class Sequence_:
    """One training sequence before packing (full token ids, per-token arrays aligned to ids)."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None] | None = None
    advantage: float = 1.0
    index: int = 0
    group: str = ""  # the GRPO group it was sampled in ("": a group of its own)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class PackedRow:
    """One packed row ([T] tensors), or a micro-batch of rows ([B, T], from `micro_batches`)."""

    input_ids: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [T] long, restarting at each sequence
    targets: torch.Tensor  # [T] long: the next token (0 at a sequence's last position)
    mask: torch.Tensor  # [T] float: 1 where the target carries loss
    old_logp: torch.Tensor  # [T] float: behaviour logprob of the target (0 where unknown)
    has_old: torch.Tensor  # [T] bool: the rollout gave a logprob for this target
    advantages: torch.Tensor  # [T] float
    seq_index: torch.Tensor  # [T] long: which sequence a position belongs to (-1: filler)
    weights: torch.Tensor | None = None  # [T] float: loss weight per target, set for the whole step
    # A micro-batch's sequence boundaries as attention keyword arguments (attention.packed_kwargs of its
    # position ids), computed on the host as it is stacked; {} when every row is one sequence. Its
    # cu_seq_lens tensors are on the host: the engine copies them to the device without reading them back.
    bounds: dict[str, Any] | None = None

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


def _aligned(seq: Sequence_) -> dict[str, list]:
    ids = seq.token_ids
    n = len(ids)
    if len(seq.loss_mask) != n:
        raise ValueError(f"sequence {seq.index}: {n} token ids but {len(seq.loss_mask)} loss-mask entries")
    if seq.logprobs is not None and len(seq.logprobs) not in (0, n):
        raise ValueError(f"sequence {seq.index}: {n} token ids but {len(seq.logprobs)} logprobs")
    lps = seq.logprobs if seq.logprobs else [None] * n
    targets = ids[1:] + [0]
    mask = [float(m) for m in seq.loss_mask[1:]] + [0.0]
    old = [lp if lp is not None else 0.0 for lp in lps[1:]] + [0.0]
    has = [lp is not None for lp in lps[1:]] + [False]
    return {
        "input_ids": ids,
        "position_ids": list(range(n)),
        "targets": targets,
        "mask": mask,
        "old_logp": old,
        "has_old": has,
        "advantages": [seq.advantage] * n,
        "seq_index": [seq.index] * n,
    }


def pack_sequences(seqs: Sequence[Sequence_], capacity: int) -> list[PackedRow]:
    """First-fit decreasing into rows of at most `capacity` tokens (a longer sequence gets a row
    of its own). Deterministic: ties keep input order."""
    return [_row([seqs[i] for i in b]) for b in pack_bins([len(s) for s in seqs], capacity)]


def pack_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The rows `pack_sequences` makes, as sorted indices into `lengths` (empty sequences left out)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        if n == 0:
            continue
        for b, load in enumerate(loads):
            if load + n <= capacity:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return [sorted(b) for b in bins]


def _row(seqs: Sequence[Sequence_]) -> PackedRow:
    parts = [_aligned(s) for s in seqs]
    cat = {k: sum((p[k] for p in parts), []) for k in parts[0]}
    return PackedRow(
        input_ids=torch.tensor(cat["input_ids"], dtype=torch.long),
        position_ids=torch.tensor(cat["position_ids"], dtype=torch.long),
        targets=torch.tensor(cat["targets"], dtype=torch.long),
        mask=torch.tensor(cat["mask"], dtype=torch.float32),
        old_logp=torch.tensor(cat["old_logp"], dtype=torch.float32),
        has_old=torch.tensor(cat["has_old"], dtype=torch.bool),
        advantages=torch.tensor(cat["advantages"], dtype=torch.float32),
        seq_index=torch.tensor(cat["seq_index"], dtype=torch.long),
    )


def filler_row() -> PackedRow:
    """A one-token row with no loss: keeps ranks at the same micro-batch count (ZeRO reduces per backward)."""
    return PackedRow(
        input_ids=torch.zeros(1, dtype=torch.long),
        position_ids=torch.zeros(1, dtype=torch.long),
        targets=torch.zeros(1, dtype=torch.long),
        mask=torch.zeros(1),
        old_logp=torch.zeros(1),
        has_old=torch.zeros(1, dtype=torch.bool),
        advantages=torch.zeros(1),
        seq_index=torch.full((1,), -1, dtype=torch.long),
        weights=torch.zeros(1),
    )


def sequence_weights(seqs: Sequence[Sequence_], mode: alg.LossAggregation = "token-mean") -> dict[int, float]:
    """The loss weight of each sequence's loss tokens over the whole step, read from the sequences
    (`assign_weights` reads the same counts from the packed rows): every rank computes it without
    building the other ranks' rows. Checks every sequence, so a bad one fails on every rank alike."""
    counts: dict[int, float] = {}
    for s in seqs:
        _check(s)
        if len(s):
            counts[s.index] = float(sum(s.loss_mask) - s.loss_mask[0])  # targets are tokens 1..n-1
    return alg.sequence_token_weights(counts, mode, {s.index: s.group for s in seqs if s.group})


def _check(seq: Sequence_) -> None:
    n = len(seq.token_ids)
    if len(seq.loss_mask) != n:
        raise ValueError(f"sequence {seq.index}: {n} token ids but {len(seq.loss_mask)} loss-mask entries")
    if seq.logprobs is not None and len(seq.logprobs) not in (0, n):
        raise ValueError(f"sequence {seq.index}: {n} token ids but {len(seq.logprobs)} logprobs")


def _next(values: np.ndarray, ends: np.ndarray, last: float) -> np.ndarray:
    """Each position's value at the next position of its sequence; `last` at a sequence's last one."""
    out = np.empty_like(values)
    out[:-1] = values[1:]
    out[ends - 1] = last
    return out


def weighted_row(seqs: Sequence[Sequence_], scale: Mapping[int, float]) -> PackedRow:
    """One packed row of these sequences with its loss weights (`scale`: `sequence_weights`), built
    from whole arrays: the same tensors as `pack_sequences` then `assign_weights`."""
    for s in seqs:
        _check(s)
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    ends = np.cumsum(lens)
    ids = np.concatenate([np.asarray(s.token_ids, dtype=np.int64) for s in seqs])
    loss = np.concatenate([np.asarray(s.loss_mask, dtype=np.float32) for s in seqs])
    # a missing logprob (None, or none given) reads as NaN here, and as "no rollout logprob" below
    lps = np.concatenate(
        [np.asarray(s.logprobs, dtype=np.float64) if s.logprobs else np.full(len(s), np.nan) for s in seqs]
    )
    behaviour = _next(lps, ends, np.nan)
    has = ~np.isnan(behaviour)
    mask = torch.from_numpy(_next(loss, ends, 0.0))
    per_token = np.repeat(np.array([scale.get(s.index, 0.0) for s in seqs], dtype=np.float64), lens)
    return PackedRow(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(np.arange(ends[-1], dtype=np.int64) - np.repeat(ends - lens, lens)),
        targets=torch.from_numpy(_next(ids, ends, 0)),
        mask=mask,
        old_logp=torch.from_numpy(np.where(has, behaviour, 0.0).astype(np.float32)),
        has_old=torch.from_numpy(has),
        advantages=torch.from_numpy(
            np.repeat(np.array([s.advantage for s in seqs], dtype=np.float64), lens).astype(np.float32)
        ),
        seq_index=torch.from_numpy(np.repeat(np.array([s.index for s in seqs], dtype=np.int64), lens)),
        weights=mask * torch.from_numpy(per_token.astype(np.float32)),
    )


@dataclass
class RowPlan:
    """A step's rows and their dealing, from the sequences' lengths (the same on every rank)."""

    rows: list[list[int]]  # each row's sequences, as positions in the step's list (empty: a filler row)
    ranks: list[list[int]]  # each rank's rows, in micro-batch order
    costs: np.ndarray  # each row's work (FLOPs)

    def rank_work(self) -> list[float]:
        return [float(self.costs[r].sum()) for r in self.ranks]


def plan_rows(lengths: Sequence[int], capacity: int, world_size: int, cost: TrajectoryCost | None = None) -> RowPlan:
    """Rows of at most `capacity` tokens (a longer sequence alone in a row), as many as first-fit
    decreasing needs rounded up to a multiple of the ranks, filled so that their work (`cost`, default
    Qwen2.5-1.5B's) is as even as the capacity allows, and dealt to ranks in rounds of neighbouring
    work (balancing.py). Every rank gets the same number of rows."""
    n = np.asarray(lengths, dtype=np.int64).reshape(-1)
    work = (cost or QWEN25_1P5B_COST)(n)
    fewest = pack_bins(n.tolist(), capacity)
    count = max(-(-len(fewest) // world_size), 1) * world_size
    rows = costed_rows(n, work, capacity, count)
    if rows is None:  # cost order fits worse than first-fit decreasing: start from its rows
        rows = fewest + [[] for _ in range(count - len(fewest))]
    rows = even_out(rows, n, work, capacity)
    costs = np.array([work[r].sum() if r else 0.0 for r in rows])
    return RowPlan(rows, deal_rounds(costs, world_size), costs)


def assign_weights(
    rows: Sequence[PackedRow], mode: alg.LossAggregation = "token-mean", groups: Mapping[int, Hashable] | None = None
) -> None:
    """Loss weights over the whole step: every rank sees the same rows, so no all-reduce is needed.
    `groups` maps a sequence's index to its GRPO group (group-token-mean)."""
    counts: dict[int, float] = {}
    for r in rows:
        for idx, m in zip(r.seq_index.tolist(), r.mask.tolist()):
            counts[idx] = counts.get(idx, 0.0) + m
    counts.pop(-1, None)  # filler carries no loss
    scale = alg.sequence_token_weights(counts, mode, groups)
    for r in rows:
        r.weights = r.mask * torch.tensor([scale.get(i, 0.0) for i in r.seq_index.tolist()], dtype=r.mask.dtype)


def shard_rows(rows: Sequence[PackedRow], world_size: int, rank: int) -> list[PackedRow]:
    """This rank's rows, balanced by tokens (largest first to the least loaded rank), padded with
    filler rows so every rank runs the same number of micro-batches."""
    loads = [0] * world_size
    mine: list[list[PackedRow]] = [[] for _ in range(world_size)]
    for row in sorted(rows, key=lambda r: -r.tokens):
        target = min(range(world_size), key=lambda k: (loads[k], k))
        mine[target].append(row)
        loads[target] += row.tokens
    most = max(len(m) for m in mine) if mine else 0
    out = mine[rank]
    return out + [filler_row() for _ in range(most - len(out))]


def stack_rows(rows: Sequence[PackedRow], pad_to_multiple: int = 1) -> PackedRow:
    """Rows right-padded to the longest (rounded up to `pad_to_multiple`) and stacked into one
    [B, T] micro-batch. Rounding keeps the set of shapes small: on a GPU each new length makes
    cuDNN attention build a new plan (~2 ms of host time per attention call on an H100) and a
    compiled layer recompile.

    Padding carries no loss (mask and weight 0, no rollout logprob, advantage 0, seq_index -1) and
    sits after every real token, so under the causal mask no real token attends to it. Its
    positions continue the row's last one: a restart at 0 would read as one more packed sequence,
    and transformers would then build an explicit block mask for the whole micro-batch instead of
    taking SDPA's plain causal path (flash / cuDNN)."""
    if any(r.weights is None for r in rows):
        raise ValueError("assign loss weights before stacking rows into a micro-batch")
    width = -(-max(r.tokens for r in rows) // pad_to_multiple) * pad_to_multiple

    def pad(t: torch.Tensor, value: float | bool) -> torch.Tensor:
        return torch.cat([t, t.new_full((width - t.numel(),), value)])

    def positions(r: PackedRow) -> torch.Tensor:
        last = int(r.position_ids[-1])
        return torch.cat([r.position_ids, torch.arange(last + 1, last + 1 + width - r.tokens, dtype=torch.long)])

    batch = PackedRow(
        input_ids=torch.stack([pad(r.input_ids, 0) for r in rows]),
        position_ids=torch.stack([positions(r) for r in rows]),
        targets=torch.stack([pad(r.targets, 0) for r in rows]),
        mask=torch.stack([pad(r.mask, 0.0) for r in rows]),
        old_logp=torch.stack([pad(r.old_logp, 0.0) for r in rows]),
        has_old=torch.stack([pad(r.has_old, False) for r in rows]),
        advantages=torch.stack([pad(r.advantages, 0.0) for r in rows]),
        seq_index=torch.stack([pad(r.seq_index, -1) for r in rows]),
        weights=torch.stack([pad(r.weights, 0.0) for r in rows]),
    )
    batch.bounds = packed_kwargs(batch.position_ids)
    return batch


def micro_batches(rows: Sequence[PackedRow], rows_per_batch: int, pad_to_multiple: int = 1) -> list[PackedRow]:
    """Rows grouped, longest first, into [B, T] micro-batches of at most `rows_per_batch` rows:
    neighbours in length share a batch, so little of it is padding. Every rank holds the same
    number of rows (`shard_rows`), so every rank runs the same number of micro-batches."""
    ordered = sorted(rows, key=lambda r: -r.tokens)
    return [
        stack_rows(ordered[i : i + rows_per_batch], pad_to_multiple) for i in range(0, len(ordered), rows_per_batch)
    ]


def rank_micro_batches(
    seqs: Sequence[Sequence_],
    capacity: int,
    world_size: int,
    rank: int,
    rows_per_batch: int = 1,
    pad_to_multiple: int = 1,
    loss_agg: alg.LossAggregation = "token-mean",
    *,
    cost: TrajectoryCost | None = None,
    balance: Balance = "work",
) -> list[PackedRow]:
    """This rank's micro-batches ([B, T] each) of a step's sequences: packed into rows of `capacity`
    tokens, weighted over the whole step, shared out among the ranks and stacked. Every rank passes
    the whole step's sequences and gets its own share, the same number of micro-batches on every rank.

    balance "work" (default): rows planned and dealt by their work (`plan_rows`, `cost` the model's,
    `flops.TrajectoryCost`), only this rank's rows built (`RankRows`, all at once here). "tokens": every
    row built, dealt by tokens."""
    if balance == "tokens":
        rows = pack_sequences(seqs, capacity)
        assign_weights(rows, loss_agg, {s.index: s.group for s in seqs if s.group})
        return micro_batches(shard_rows(rows, world_size, rank), rows_per_batch, pad_to_multiple)
    if balance != "work":
        raise ValueError(f"unknown row balance {balance!r} (work or tokens)")
    return list(RankRows(seqs, capacity, world_size, rank, rows_per_batch, pad_to_multiple, loss_agg, cost=cost))


class RankRows(Sequence[PackedRow]):
    """This rank's micro-batches of a step, rows planned and dealt by work (`plan_rows`) and weighted over
    the whole step up front; each micro-batch's tensors are built the first time it is asked for and
    then kept, so a step can start on its first micro-batch and build the next while that one runs."""

    def __init__(
        self,
        seqs: Sequence[Sequence_],
        capacity: int,
        world_size: int,
        rank: int,
        rows_per_batch: int = 1,
        pad_to_multiple: int = 1,
        loss_agg: alg.LossAggregation = "token-mean",
        *,
        cost: TrajectoryCost | None = None,
    ) -> None:
        self.plan = plan_rows([len(s) for s in seqs], capacity, world_size, cost)
        self._scale = sequence_weights(seqs, loss_agg)
        self._seqs = seqs
        mine = self.plan.ranks[rank]
        self._groups = [mine[i : i + rows_per_batch] for i in range(0, len(mine), rows_per_batch)]
        self._pad = pad_to_multiple
        self._built: dict[int, PackedRow] = {}
        # rows of this rank that hold a sequence (the others are fillers)
        self.filled = sum(1 for r in mine if self.plan.rows[r])

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, k: int) -> PackedRow:  # type: ignore[override]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        k %= len(self)
        if k not in self._built:
            rows = [
                weighted_row([self._seqs[i] for i in self.plan.rows[r]], self._scale)
                if self.plan.rows[r]
                else filler_row()
                for r in self._groups[k]
            ]
            self._built[k] = stack_rows(rows, self._pad)
        return self._built[k]


# ---- RL: scored trajectories → sequences with advantages -------------------------------------


@dataclass
class RLBatch:
    sequences: list[Sequence_]
    stats: dict[str, float] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)


def answered_groups(trajs: Sequence[ScoredTrajectory]) -> tuple[list[int], int]:
    """Indices of the samples the policy answers for, and how many groups were dropped for errors.

    An engine error (a sandbox outage, an engine crash) is no answer of the policy's: it leaves the
    group statistics as well as the loss, so an outage does not count as a failure in its group's
    mean. A group that errors leave with one sample out of several is dropped: alone, that sample
    would get its reward as advantage, with no baseline to compare it to."""
    sizes: dict[str, int] = {}
    answered: dict[str, list[int]] = {}
    for i, t in enumerate(trajs):
        sizes[t.group_id] = sizes.get(t.group_id, 0) + 1
        if t.finish_reason not in alg.ERROR_FINISHES:
            answered.setdefault(t.group_id, []).append(i)
    kept: list[int] = []
    dropped = 0
    for g, size in sizes.items():
        idx = answered.get(g, [])
        if not idx or (size > 1 and len(idx) < 2):
            dropped += 1
            continue
        kept.extend(idx)
    return sorted(kept), dropped


def rl_sequences(
    trajs: Sequence[ScoredTrajectory],
    filters: FilterConfig,
    *,
    learner_version: int,
    std_normalize: bool = True,
    negative_scale: float = 1.0,
) -> RLBatch:
    """Staleness (per group) → engine errors out → effective rewards → group selection (DAPO /
    StarPO-S) → advantages (negative ones times `negative_scale`) → loss masks."""
    fresh, stale = alg.split_stale(
        [t.policy_version for t in trajs], learner_version, filters.max_staleness, groups=[t.group_id for t in trajs]
    )
    trajs = [trajs[i] for i in fresh]
    n_errors = sum(t.finish_reason in alg.ERROR_FINISHES for t in trajs)
    answered, dropped_errors = answered_groups(trajs)
    trajs = [trajs[i] for i in answered]
    rewards = [alg.effective_reward(t.reward, t.finish_reason, filters.zero_reward_finish_reasons) for t in trajs]
    by_group: dict[str, list[float]] = {}
    for t, r in zip(trajs, rewards):
        by_group.setdefault(t.group_id, []).append(r)
    selection = alg.select_groups(
        by_group,
        dynamic_sampling=filters.dynamic_sampling,
        keep_fraction=filters.variance_keep_fraction,
        eps=filters.zero_variance_eps,
    )
    kept = set(selection.kept)
    chosen = [i for i, t in enumerate(trajs) if t.group_id in kept]
    advantages = alg.group_advantages(
        [rewards[i] for i in chosen], [trajs[i].group_id for i in chosen], std_normalize=std_normalize
    )
    advantages = alg.scale_negative_advantages(advantages, negative_scale)
    masked_reasons = set(filters.mask_finish_reasons)
    seqs: list[Sequence_] = []
    n_masked = 0
    missing_logprobs = 0
    for k, (i, adv) in enumerate(zip(chosen, advantages)):
        t = trajs[i]
        masked = t.finish_reason in masked_reasons
        n_masked += masked
        mask = [0] * len(t.token_ids) if masked else list(t.loss_mask)
        if len(t.loss_mask) != len(t.token_ids):
            raise ValueError(
                f"trajectory {t.task_id}/{t.sample_index}: {len(t.token_ids)} token ids but "
                f"{len(t.loss_mask)} loss-mask entries"
            )
        lps = list(t.logprobs) if t.logprobs else None
        if lps is not None and len(lps) != len(t.token_ids):
            raise ValueError(
                f"trajectory {t.task_id}/{t.sample_index}: {len(t.token_ids)} token ids but {len(lps)} logprobs"
            )
        if not masked and any(m and (lps is None or lps[j] is None) for j, m in enumerate(mask)):
            missing_logprobs += 1
        seqs.append(Sequence_(list(t.token_ids), mask, lps, adv, index=k, group=t.group_id))
    n_groups = len(by_group) + dropped_errors
    stats = {
        "samples_in": float(len(fresh) + len(stale)),
        "samples_stale": float(len(stale)),
        "samples_trained": float(len(seqs) - n_masked),
        "samples_masked_overlength": float(n_masked),
        "samples_engine_error": float(n_errors),
        "groups_dropped_errors": float(dropped_errors),
        "samples_format_error": float(sum(t.finish_reason == "format_error" for t in trajs)),
        # out of context or tool calls, whether masked or trained as failures (rl.truncated)
        "samples_truncated": float(sum(t.finish_reason in TRUNCATED_FINISHES for t in trajs)),
        "groups_in": float(n_groups),
        "samples_missing_logprobs": float(missing_logprobs),
        **{k: float(v) for k, v in selection.counts().items()},
    }
    # measured whether or not flat groups are dropped: under GRPO they stay in the batch with zero
    # advantage, and a batch of flat groups trains nothing
    flat = sum(alg.is_flat(rs, filters.zero_variance_eps) for rs in by_group.values())
    stats["groups_flat_fraction"] = flat / len(by_group) if by_group else 0.0
    return RLBatch(seqs, stats, [rewards[i] for i in chosen], advantages)


# ---- SFT: chats → sequences with assistant-only loss -----------------------------------------


def chat_to_sequence(
    tokenizer: Any, messages: list[dict[str, Any]], max_len: int | None = None, index: int = 0, *, chat: Any = None
) -> Sequence_:
    """Token ids and loss mask for an SFT chat, in the model's own format by the rollout's path
    (`services.rollout.chat.Chat.supervised`): 1 on each assistant turn as the model writes it and its
    end-of-turn token, 0 on the system, user and tool text, role headers and what the template writes
    after an end-of-turn token (LLaMA-Factory's train_on_prompt=False semantics). `chat`: the format
    (`Chat.for_agent`, built once per data set); default: the tokenizer's, with the default options."""
    from services.rollout.chat import Chat

    if not messages:
        raise ValueError("a chat needs at least one message")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"message {i} needs 'role' and 'content'")
    chat = chat if chat is not None else Chat.for_agent(tokenizer)
    ids, mask = chat.supervised(messages)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return Sequence_(ids, mask, None, 1.0, index=index)


# ---- learning-rate schedule --------------------------------------------------------------------


def lr_lambda(cfg: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base lr at optimizer step `step` (0-based): linear warmup to 1, then
    cosine / linear decay to min_lr_ratio, or constant."""
    total = max(int(total_steps), 1)
    warmup = math.ceil(cfg.warmup_ratio * total)

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
        if cfg.schedule == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return f
