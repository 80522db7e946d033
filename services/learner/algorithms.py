"""The RL math, free of DeepSpeed: advantages, the clipped policy loss, filters and diagnostics.

Conventions (spec/paper-recipe.md "RL defaults", agent-star.md §4.1, §4.4, §4.5; docs/rl-numerics.md):
- GRPO advantage: (r - mean_g) / (std_g + eps) with the unbiased std over the G samples of a
  prompt; a group of one sample gets mean 0 and std 1 (verl's convention). Negative advantages may
  be scaled down (`negative_scale`, our own; 1 keeps GRPO as the paper).
- Overlength / truncated samples keep their reward in the group statistics but carry no loss.
  Engine errors (a sandbox outage, an engine crash) are not the policy's answers: they leave the
  group statistics as well as the loss.
- Format errors score 0 whatever the scorer said.
- Token-level normalization: every loss token of the step weighs 1 / (all loss tokens of the
  step), so long trajectories are not down-weighted the way a per-sequence mean would
  (`token-mean`); `group-token-mean` is the paper's: 1 / Σ|H_i| within a group, groups averaged.
- The policy loss is bounded: the log-ratio is clamped at ±`LOG_RATIO_CLAMP` and negative
  advantages are dual-clipped at `DUAL_CLIP_C` (verl's defaults), so one token far off the
  behaviour policy gives a finite loss and no gradient.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

# ---- rewards and advantages ------------------------------------------------------------------

# Finishes that are no answer of the policy's: out of the loss and out of their group's statistics.
ERROR_FINISHES: tuple[str, ...] = ("engine_error",)


def effective_reward(reward: float, finish_reason: str, zero_reasons: Iterable[str] = ("format_error",)) -> float:
    """The reward the learner uses: a format error (no parsable answer) is worth nothing."""
    if finish_reason in set(zero_reasons):
        return 0.0
    if not math.isfinite(reward):
        raise ValueError(f"reward must be finite, got {reward}")
    return float(reward)


def group_advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], *, std_normalize: bool = True, eps: float = 1e-6
) -> list[float]:
    """One advantage per sample, normalized inside its group (all samples count, masked or not)."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        values = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        if len(idx) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = values.mean().item(), values.std(unbiased=True).item()
        for i in idx:
            centred = rewards[i] - mean
            out[i] = centred / (std + eps) if std_normalize else centred
    return out


def scale_negative_advantages(advantages: Sequence[float], scale: float) -> list[float]:
    """Negative advantages times `scale` (1: GRPO as is; 0: only the group's better samples push).
    A brake for a policy that full GRPO pushes off its format at a high learning rate."""
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"negative advantage scale must be in [0, 1], got {scale}")
    return [a * scale if a < 0 else a for a in advantages]


# ---- which groups and samples train ------------------------------------------------------------


def reward_spread(rewards: Sequence[float]) -> float:
    return max(rewards) - min(rewards) if rewards else 0.0


def is_flat(rewards: Sequence[float], eps: float = 1e-6) -> bool:
    """A group whose rewards agree (max - min <= eps): its advantages are zero, it carries no gradient."""
    return reward_spread(rewards) <= eps


@dataclass
class GroupSelection:
    kept: list[Hashable]
    dropped_flat: list[Hashable] = field(default_factory=list)  # DAPO: zero-variance groups
    dropped_low_spread: list[Hashable] = field(default_factory=list)  # StarPO-S: below the kept fraction

    def counts(self) -> dict[str, int]:
        return {
            "groups_kept": len(self.kept),
            "groups_dropped_flat": len(self.dropped_flat),
            "groups_dropped_low_spread": len(self.dropped_low_spread),
        }


def select_groups(
    group_rewards: dict[Hashable, Sequence[float]],
    *,
    dynamic_sampling: bool = False,
    keep_fraction: float = 1.0,
    eps: float = 1e-6,
) -> GroupSelection:
    """DAPO dynamic sampling (drop groups with max - min <= eps: they carry no gradient) and
    StarPO-S filtering (keep the top `keep_fraction` of groups by reward spread, at least one).

    Spread, not std, decides flatness, so a continuous reward is judged as verl's std > 0 would
    (rLLM's "all <= 0 or all >= 1" rule wrongly drops differing rewards above 1)."""
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    order = list(group_rewards)
    flat: list[Hashable] = []
    if dynamic_sampling:
        flat = [g for g in order if is_flat(group_rewards[g], eps)]
        order = [g for g in order if g not in set(flat)]
    low: list[Hashable] = []
    if keep_fraction < 1.0 and order:
        n_keep = max(1, math.ceil(keep_fraction * len(order)))
        # Stable: ties keep arrival order, so the choice is deterministic.
        ranked = sorted(order, key=lambda g: -reward_spread(group_rewards[g]))
        keep = set(ranked[:n_keep])
        low = [g for g in order if g not in keep]
        order = [g for g in order if g in keep]
    return GroupSelection(kept=order, dropped_flat=flat, dropped_low_spread=low)


def split_stale(
    versions: Sequence[int], learner_version: int, max_staleness: int, groups: Sequence[Hashable] | None = None
) -> tuple[list[int], list[int]]:
    """Indices of samples fresh enough to train on, and of those too old (learner - sampled > max).

    With `groups`, a group is judged whole by its oldest sample: dropping samples one by one would
    leave partial groups whose statistics miss the slowest (longest) trajectories."""
    if groups is not None and len(groups) != len(versions):
        raise ValueError(f"{len(versions)} versions but {len(groups)} group ids")
    oldest: dict[Hashable, int] = {}
    if groups is not None:
        for g, v in zip(groups, versions):
            oldest[g] = min(v, oldest.get(g, v))
    fresh, stale = [], []
    for i, v in enumerate(versions):
        judged = oldest[groups[i]] if groups is not None else v
        (stale if learner_version - judged > max_staleness else fresh).append(i)
    return fresh, stale


# ---- the loss --------------------------------------------------------------------------------

LossAggregation = Literal["token-mean", "group-token-mean", "seq-mean-token-mean"]
LOG_RATIO_CLAMP = 20.0  # verl's: exp(±20) is finite in fp32 with room to spare (exp(89) is not)
DUAL_CLIP_C = 3.0  # verl's clip_ratio_c: a negative advantage costs at most c·|A| per token
IS_LOW, IS_HIGH = 0.5, 2.0  # token-level importance-weight bounds (verl's rollout_is threshold 2, lower 1/2)
ImportanceMode = Literal["off", "tis", "mis"]
IMPORTANCE_MODES: tuple[str, ...] = get_args(ImportanceMode)


def sequence_token_weights(
    counts: Mapping[Hashable, float],
    mode: LossAggregation = "token-mean",
    groups: Mapping[Hashable, Hashable] | None = None,
) -> dict[Hashable, float]:
    """The loss weight of each loss token of each sequence, from every sequence's loss-token count
    over the whole step (all groups, all ranks' data).

    token-mean: 1 / Σ|mask| for every loss token of the step.
    group-token-mean: 1 / (n_groups · Σ_{i in g}|mask_i|), the paper's: tokens normalized within
    their group, groups averaged (n_groups counts groups with loss tokens; a sequence missing from
    `groups` is a group of its own).
    seq-mean-token-mean: 1 / (n_seq · |mask_i|)."""
    if mode == "token-mean":
        total = max(sum(counts.values()), 1.0)
        return {i: 1.0 / total for i in counts}
    if mode == "seq-mean-token-mean":
        n = max(sum(1 for c in counts.values() if c > 0), 1)
        return {i: 1.0 / (n * max(c, 1.0)) for i, c in counts.items()}
    if mode == "group-token-mean":
        group_of = {i: (groups or {}).get(i, ("sequence", i)) for i in counts}
        per_group: dict[Hashable, float] = defaultdict(float)
        for i, c in counts.items():
            per_group[group_of[i]] += c
        n = max(sum(1 for c in per_group.values() if c > 0), 1)
        return {i: 1.0 / (n * max(per_group[group_of[i]], 1.0)) for i in counts}
    raise ValueError(f"unknown loss aggregation {mode!r}")


def token_weights(
    masks: Sequence[torch.Tensor], mode: LossAggregation = "token-mean", groups: Sequence[Hashable] | None = None
) -> list[torch.Tensor]:
    """Per-token loss weights for the whole step, one mask per sequence (`sequence_token_weights`)."""
    if groups is not None and len(groups) != len(masks):
        raise ValueError(f"{len(masks)} masks but {len(groups)} group ids")
    counts = {i: float(m.sum().item()) for i, m in enumerate(masks)}
    scale = sequence_token_weights(counts, mode, dict(enumerate(groups)) if groups is not None else None)
    return [m.float() * scale[i] for i, m in enumerate(masks)]


@dataclass
class LossStats:
    """Token counts of one step's loss (sums over loss tokens; divide by `tokens` for fractions)."""

    tokens: float
    clipped_high: float  # tokens where the upper bound cut the gradient (A > 0, ratio > 1 + eps_high)
    clipped_low: float  # tokens where the lower bound cut it (A < 0, ratio < 1 - eps_low)
    dual_clipped: float  # A < 0 tokens held at c·|A|
    ratio_sum: float
    log_ratio_clamped: float = 0.0  # |log ratio| beyond the clamp
    is_truncated: float = 0.0  # TIS: importance weights cut down to the upper bound
    is_masked: float = 0.0  # MIS: tokens whose importance weight left the bounds (weight 0)
    is_weight_sum: float = 0.0  # the importance weights applied (1 per token when off)

    def merge(self, other: LossStats) -> LossStats:
        return LossStats(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[float, ...]:
        return tuple(getattr(self, f) for f in LOSS_STAT_FIELDS)


LOSS_STAT_FIELDS = tuple(LossStats.__dataclass_fields__)


def importance_weights(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    has_behaviour: torch.Tensor,
    mode: ImportanceMode,
    *,
    low: float = IS_LOW,
    high: float = IS_HIGH,
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level importance weights π_prox / π_behaviour correcting for the sampler (inference /
    training mismatch and staleness), with no gradient, and which tokens a bound touched.

    tis: truncated, min(w, high) (TRL's vllm_importance_sampling_cap, verl's rollout_is "truncate").
    mis: masked, w where low <= w <= high else 0 (verl's rollout_is "mask"; prime-rl masks at [1/8, 8]).
    off: all ones. A token without a behaviour logprob weighs 1."""
    if mode not in IMPORTANCE_MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r} (one of {', '.join(IMPORTANCE_MODES)})")
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"importance bounds need 0 <= low <= 1 <= high, got [{low}, {high}]")
    with torch.no_grad():
        ones = torch.ones_like(proximal_logp)
        if mode == "off":
            return ones, torch.zeros_like(proximal_logp, dtype=torch.bool)
        log_w = proximal_logp.detach().float() - behaviour_logp.float()
        if log_ratio_clamp is not None:
            log_w = log_w.clamp(-log_ratio_clamp, log_ratio_clamp)
        w = torch.where(has_behaviour.bool(), torch.exp(log_w), ones)
        if mode == "tis":
            touched = w > high
            return w.clamp(max=high), touched
        touched = (w < low) | (w > high)
        return torch.where(touched, torch.zeros_like(w), w), touched


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = DUAL_CLIP_C,
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
    is_weights: torch.Tensor | None = None,
    is_touched: torch.Tensor | None = None,
    is_mode: ImportanceMode = "off",
) -> tuple[torch.Tensor, LossStats]:
    """PPO's clipped surrogate with asymmetric bounds, summed with per-token `weights`.

    per token: max(-A·ρ, -A·clip(ρ, 1-eps_low, 1+eps_high)), and with dual clip for A < 0 at most
    -A·c; ρ = exp(clamp(logp - old, ±log_ratio_clamp)). `is_weights` (from `importance_weights`)
    multiply each token's term. `weights` is 0 off the loss mask, so padding and tool tokens
    contribute nothing."""
    loss, sums = clipped_policy_terms(
        logp,
        old_logp,
        advantages,
        weights,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip_c=dual_clip_c,
        log_ratio_clamp=log_ratio_clamp,
        is_weights=is_weights,
        is_touched=is_touched,
        is_mode=is_mode,
    )
    return loss, LossStats(*sums.tolist())


def clipped_policy_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = DUAL_CLIP_C,
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
    is_weights: torch.Tensor | None = None,
    is_touched: torch.Tensor | None = None,
    is_mode: ImportanceMode = "off",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`clipped_policy_loss` with its statistics left on the device, in `LossStats` field order
    (float64): the training step sums them over micro-batches and reads them once, so the GPU
    never waits for the host between micro-batches.

    The clamp matters even with dual clip: at a log-ratio of 100 the ratio is inf in fp32, and
    although the dual clip's min picks the constant, backward multiplies its zero by exp(100) = inf
    and the gradient is NaN."""
    log_ratio = logp - old_logp
    clamped = torch.zeros_like(log_ratio, dtype=torch.bool)
    if log_ratio_clamp is not None:
        clamped = log_ratio.detach().abs() > log_ratio_clamp
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = (per_token * weights).sum()
    with torch.no_grad():
        live = weights != 0
        zero = torch.zeros_like(ratio)
        touched = is_touched.bool() if is_touched is not None else torch.zeros_like(live)
        sums = torch.stack(
            [
                live.sum(),
                (live & (advantages > 0) & (ratio > 1.0 + eps_high)).sum(),
                (live & (advantages < 0) & (ratio < 1.0 - eps_low)).sum(),
                (live & dual).sum(),
                torch.where(live, ratio, zero).sum(),
                (live & clamped).sum(),
                (live & touched).sum() if is_mode == "tis" else live.new_zeros(()).sum(),
                (live & touched).sum() if is_mode == "mis" else live.new_zeros(()).sum(),
                torch.where(
                    live,
                    is_weights.detach().to(ratio.dtype) if is_weights is not None else torch.ones_like(ratio),
                    zero,
                ).sum(),
            ]
        ).double()
    return loss, sums


def kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π || π_ref) on samples from π: e^(ref-logp) - (ref-logp) - 1 ≥ 0."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


KL_PENALTY_CAP = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 to the reference as a loss term, capped per token at `KL_PENALTY_CAP` (as verl's
    low_var_kl). Uncapped, one sampled token the policy has pushed ~16 nats below the reference
    is worth e^16 and its gradient swamps the whole step (a grad norm in the thousands against
    ~0.1); capped, such a token carries no KL gradient and the policy-gradient term alone decides it."""
    return kl_low_var(logp, ref_logp).clamp(max=KL_PENALTY_CAP)


@dataclass
class MismatchKL:
    """Train/inference mismatch between the rollout's logprobs and the learner's recomputation."""

    k1: float  # mean(log b - log π): plain estimate of KL(b || π)
    k3: float  # mean of the non-negative k3 estimator
    max_abs: float  # largest |log b - log π| over loss tokens
    tokens: int


def mismatch_kl(behaviour_logp: torch.Tensor, learner_logp: torch.Tensor, mask: torch.Tensor) -> MismatchKL:
    k1_sum, k3_sum, n, max_abs = mismatch_terms(behaviour_logp, learner_logp, mask).tolist()
    if n == 0:
        return MismatchKL(0.0, 0.0, 0.0, 0)
    return MismatchKL(k1_sum / n, k3_sum / n, max_abs, int(n))


def mismatch_terms(behaviour_logp: torch.Tensor, learner_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum of log b - log π, sum of k3, tokens, max |log b - log π|] over `mask`, on the device
    (float64), so micro-batches add up without a host sync."""
    live = mask.bool()
    b, p = behaviour_logp.double(), learner_logp.double()
    zero = torch.zeros_like(b)
    diff = torch.where(live, b - p, zero)
    k3 = torch.where(live, kl_low_var(b, p), zero)  # samples come from b, so KL(b || π) with the roles swapped
    return torch.stack([diff.sum(), k3.sum(), live.sum().double(), diff.abs().max() if diff.numel() else zero.sum()])


def summarize(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": float(t.mean()), "std": float(t.std(unbiased=False)), "min": float(t.min()), "max": float(t.max())}
