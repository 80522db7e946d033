"""The optimizer steps of an SFT step or an RL batch over packed rows, with its statistics summed over ranks.

Every rank plans the whole step's rows identically from the sequences' lengths (packed and dealt by
their work, `batching.plan_rows`) and builds only its own; loss weights come from the whole step's
sequences, so they need no communication; DeepSpeed averages gradients over ranks, which is why each
micro-batch loss is multiplied by the world size. A micro-batch is `micro_batch_rows` packed rows
stacked to [B, T]; its per-token arrays are flattened to match the [B·T] logprobs.

Throughput metrics: `tokens_per_s`, `tflops_per_s` and `mfu` count model FLOPs the PaLM way
(attention in full); `mfu_causal_half` counts causal attention at half (see flops.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from services.learner import algorithms as alg
from services.learner.batching import Balance, PackedRow, RankRows, Sequence_, rank_micro_batches
from services.learner.config import RLConfig
from services.learner.engine import PolicyEngine
from services.learner.flops import TrajectoryCost, model_shape, peak_flops, train_flops


@dataclass
class StepOutput:
    metrics: dict[str, float] = field(default_factory=dict)


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return t.tolist()


def trajectory_cost(engine: PolicyEngine) -> TrajectoryCost:
    """The work of a trajectory on this engine's model (rows are packed and dealt by it)."""
    return TrajectoryCost(engine.num_parameters(), *model_shape(engine.lm_config))


def prepare_rows(
    engine: PolicyEngine,
    seqs: Sequence[Sequence_],
    loss_agg: alg.LossAggregation = "token-mean",
    balance: Balance = "work",
    cost: TrajectoryCost | None = None,
) -> Sequence[PackedRow]:
    """This rank's micro-batches ([B, T] each) of the step's packed, weighted rows; by work, each
    built when the step first reaches it (`RankRows`)."""
    args = (
        seqs,
        engine.cfg.micro_batch_tokens,
        engine.world_size,
        engine.rank,
        engine.cfg.micro_batch_rows,
        engine.cfg.pad_to_multiple,
        loss_agg,
    )
    if balance == "work":
        return RankRows(*args, cost=cost or trajectory_cost(engine))
    return rank_micro_batches(*args, balance=balance)


def filled_rows(prepared: Sequence[Sequence[PackedRow]]) -> int:
    """How many of this rank's rows hold a sequence (filler rows left out), without building any."""
    return sum(
        rows.filled
        if isinstance(rows, RankRows)
        else sum(int((b.seq_index.reshape(-1, b.seq_index.shape[-1]) >= 0).any(dim=1).sum()) for b in rows)
        for rows in prepared
    )


def on_device(batches: Sequence[PackedRow], device: torch.device) -> Iterator[PackedRow]:
    """The micro-batches in turn with their tensors on `device` (pinned, non-blocking copies: the host
    never waits on one). The next micro-batch is built and its copy issued once the caller is done
    launching the current one, while the device still runs it."""

    def moved(b: PackedRow) -> PackedRow:
        weights = None if b.weights is None else _to(b.weights, device)
        return PackedRow(**{f: _to(getattr(b, f), device) for f in _TENSOR_FIELDS}, weights=weights, bounds=b.bounds)

    ahead = moved(batches[0]) if len(batches) else None
    for k in range(len(batches)):
        current = ahead
        yield current
        ahead = moved(batches[k + 1]) if k + 1 < len(batches) else None


_TENSOR_FIELDS = ("input_ids", "position_ids", "targets", "mask", "old_logp", "has_old", "advantages", "seq_index")


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → GPU copies that do not block the host (pinned staging); a plain move elsewhere."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _flat(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A micro-batch's per-token array, flattened like the logprobs, on `device`."""
    return _to(t.flatten(), device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mfu_metrics(engine: PolicyEngine, seq_lens: list[int], seconds: float) -> dict[str, float]:
    layers, attn_width = model_shape(engine.lm_config)
    n_params = engine.num_parameters()
    flops = train_flops(n_params, layers, attn_width, seq_lens)
    tokens = sum(seq_lens)
    out = {
        "tokens": float(tokens),
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tflops_per_s": flops / seconds / 1e12 if seconds > 0 else 0.0,
    }
    peak = peak_flops()
    if peak and seconds > 0:
        out["mfu"] = flops / seconds / (peak * engine.world_size)
        half = train_flops(n_params, layers, attn_width, seq_lens, causal_half=True)
        out["mfu_causal_half"] = half / seconds / (peak * engine.world_size)
    return out


def sft_step(engine: PolicyEngine, seqs: Sequence[Sequence_], balance: Balance = "work") -> StepOutput:
    """Cross-entropy on loss tokens, token-mean over the whole step."""
    _sync(engine.device)
    t0 = time.perf_counter()
    batches = prepare_rows(engine, seqs, balance=balance)
    acc = torch.zeros(2, dtype=torch.float64, device=engine.device)  # nll sum, tokens (read once, see rl_step)
    for batch in on_device(batches, engine.device):
        logp, _ = engine.logprobs(batch, grad=True, with_entropy=False)
        w = _flat(batch.weights, logp.device)
        loss = -(logp * w).sum()
        engine.backward(loss * engine.world_size)
        m = _flat(batch.mask, logp.device)
        acc += torch.stack([-(logp.detach() * m).sum(), m.sum()]).double()
    result = engine.step()
    _sync(engine.device)
    seconds = time.perf_counter() - t0
    nll_sum, tokens = _all_reduce_sum(acc.tolist(), engine.device)
    metrics = {
        "loss": nll_sum / max(tokens, 1.0),
        "loss_tokens": tokens,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "time_compute_s": seconds,
    }
    metrics.update(_mfu_metrics(engine, [len(s) for s in seqs], seconds))
    return StepOutput(metrics)


def split_mini_batches(seqs: Sequence[Sequence_], count: int, batch_groups: int | None = None) -> list[list[Sequence_]]:
    """Contiguous shares of whole groups, one optimizer step each; never an empty share.

    A group never straddles two shares: a share holding part of a group has advantages that do not
    balance (say, only the seven failures of a one-in-eight group), and Adam, whose step is about lr
    whatever the gradient's size, pushes those samples down at full size (a DAPO batch of one group,
    cut in quarters, is enough to collapse a policy).
    With `batch_groups`, `count` is the number of shares of a full batch of that many groups, and a
    share's size in groups stays fixed (verl's ppo_mini_batch_size): a batch the filters shrank makes
    fewer updates of the same size. Without it, `count` shares as even as whole groups allow.
    """
    groups: dict[object, list[Sequence_]] = {}
    for s in seqs:
        groups.setdefault(s.group or id(s), []).append(s)  # an ungrouped sequence is its own group
    members = list(groups.values())
    if batch_groups:
        per_share = -(-batch_groups // max(count, 1))
        count = -(-len(members) // per_share)
    count = max(1, min(count, len(members)))
    bounds = [i * len(members) // count for i in range(count + 1)]
    return [[s for group in members[a:b] for s in group] for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class LossBounds:
    """How the clipped policy loss is bounded and corrected beyond its clip range (RLConfig's
    fields of the same names); the defaults are the shipped ones."""

    dual_clip_c: float | None = alg.DUAL_CLIP_C
    log_ratio_clamp: float | None = alg.LOG_RATIO_CLAMP
    importance_sampling: alg.ImportanceMode = "off"
    is_low: float = alg.IS_LOW
    is_high: float = alg.IS_HIGH


def loss_bounds(cfg: RLConfig) -> LossBounds:
    """The policy-loss bounds of an RL recipe."""
    return LossBounds(
        dual_clip_c=cfg.dual_clip_c,
        log_ratio_clamp=cfg.log_ratio_clamp,
        importance_sampling=cfg.importance_sampling,
        is_low=cfg.is_low,
        is_high=cfg.is_high,
    )


def lacks_rollout_logprobs(seqs: Sequence[Sequence_]) -> bool:
    """Whether some loss token has no rollout logprob (the same answer on every rank: it reads the
    whole step's sequences, not this rank's rows)."""
    return any(m and (not s.logprobs or s.logprobs[j] is None) for s in seqs for j, m in enumerate(s.loss_mask))


def needs_proximal_forward(
    shares: int, seqs: Sequence[Sequence_], bounds: LossBounds, use_rollout_logprobs: bool
) -> bool:
    """Whether the batch needs the learner's log-probs from before its first update.

    With one optimizer step, the update's own forward is that policy (its detached log-probs are
    exactly the proximal ones), so no extra pass is needed. From the second mini-batch on it is
    not: a token with no rollout logprob, or every token when rollout logprobs are off or the
    importance correction is on, would otherwise take the already-updated policy as "old", a ratio
    of exactly 1 and no trust region."""
    if shares <= 1:
        return False
    return bounds.importance_sampling != "off" or not use_rollout_logprobs or lacks_rollout_logprobs(seqs)


def proximal_logprobs(engine: PolicyEngine, prepared: Sequence[Sequence[PackedRow]]) -> list[list[torch.Tensor]]:
    """One no-grad forward over every micro-batch of the batch before its first update."""
    return [[engine.logprobs(batch, grad=False, with_entropy=False)[0].detach() for batch in rows] for rows in prepared]


def rl_step(
    engine: PolicyEngine,
    seqs: Sequence[Sequence_],
    *,
    eps_low: float,
    eps_high: float,
    bounds: LossBounds = LossBounds(),
    loss_agg: alg.LossAggregation = "token-mean",
    use_rollout_logprobs: bool = True,
    kl_coef: float = 0.0,
    reference: torch.nn.Module | None = None,
    mini_batches: int = 1,
    batch_groups: int | None = None,
    balance: Balance = "work",
) -> StepOutput:
    """The clipped policy-gradient update of one batch: one PPO epoch in `mini_batches` optimizer
    steps.

    "old" in the ratio, per token: with the importance correction off, the rollout's logprob where
    there is one (so the ratio also bounds inference/training mismatch and staleness), else the
    proximal policy's (the learner before the batch's first update). With it on (tis / mis), the
    proximal policy's for every token, and the gap from the sampler to it is corrected by a
    token-level importance weight (`alg.importance_weights`). `balance`: how rows are packed and dealt
    (`batching.rank_micro_batches`); it moves no token's loss weight."""
    _sync(engine.device)
    t0 = time.perf_counter()
    n_loss = len(alg.LOSS_STAT_FIELDS)
    # Statistics stay on the device and are read once after the last optimizer step: a host read
    # per micro-batch would make the GPU idle while Python launches the next forward.
    acc = torch.zeros(
        1 + n_loss + 6, dtype=torch.float64, device=engine.device
    )  # pg, LossStats, ent, kl_ref(2), mismatch(3)
    mm_max = torch.zeros((), dtype=torch.float64, device=engine.device)
    shares = split_mini_batches(seqs, mini_batches, batch_groups)
    # each share is normalised on its own tokens, as a batch of that size would be
    cost = trajectory_cost(engine)
    prepared = [prepare_rows(engine, share, loss_agg, balance, cost) for share in shares]
    rows_here = filled_rows(prepared)
    proximal = None
    if needs_proximal_forward(len(shares), seqs, bounds, use_rollout_logprobs):
        proximal = proximal_logprobs(engine, prepared)
    norms: list[float] = []
    for s_i, rows in enumerate(prepared):
        for b_i, batch in enumerate(on_device(rows, engine.device)):
            logp, ent = engine.logprobs(batch, grad=True)
            dev = logp.device
            mask, w, adv = _flat(batch.mask, dev), _flat(batch.weights, dev), _flat(batch.advantages, dev)
            behaviour = _flat(batch.old_logp, dev)
            has_old = _flat(batch.has_old, dev) & use_rollout_logprobs
            prox = proximal[s_i][b_i] if proximal is not None else logp.detach()
            is_w, is_touched = alg.importance_weights(
                prox,
                behaviour,
                has_old,
                bounds.importance_sampling,
                low=bounds.is_low,
                high=bounds.is_high,
                log_ratio_clamp=bounds.log_ratio_clamp,
            )
            old = prox if bounds.importance_sampling != "off" else torch.where(has_old, behaviour, prox)
            loss, loss_sums = alg.clipped_policy_terms(
                logp,
                old,
                adv,
                w,
                eps_low=eps_low,
                eps_high=eps_high,
                dual_clip_c=bounds.dual_clip_c,
                log_ratio_clamp=bounds.log_ratio_clamp,
                is_weights=is_w,
                is_touched=is_touched,
                is_mode=bounds.importance_sampling,
            )
            kl_ref = torch.zeros(2, dtype=torch.float64, device=dev)  # the loss term (capped), k3 uncapped
            if kl_coef > 0.0 and reference is not None:
                with torch.no_grad():
                    ref_logp, _ = reference(
                        _to(batch.input_ids, dev), _to(batch.position_ids, dev), _to(batch.targets, dev), False
                    )
                kl = alg.kl_penalty(logp, ref_logp)
                loss = loss + kl_coef * (kl * w).sum()
                uncapped = alg.kl_low_var(logp.detach(), ref_logp)
                kl_ref = torch.stack([(kl.detach() * mask).sum(), (uncapped * mask).sum()]).double()
            engine.backward(loss * engine.world_size)
            mm = alg.mismatch_terms(behaviour, prox, mask.bool() & has_old)
            acc += torch.cat(
                [loss.detach().double()[None], loss_sums, (ent * mask).sum().double()[None], kl_ref, mm[:3]]
            )
            mm_max = torch.maximum(mm_max, mm[3])
        result = engine.step()
        norms.append(result.grad_norm)
    _sync(engine.device)
    seconds = time.perf_counter() - t0
    totals = _all_reduce_sum(acc.tolist() + [float(rows_here)], engine.device)
    pg_sum, loss_totals = totals[0], alg.LossStats(*totals[1 : 1 + n_loss])
    ent_sum, kl_ref_sum, kl_k3_sum, mm_k1, mm_k3, mm_tokens = totals[1 + n_loss : -1]
    mm_max_t = mm_max.reshape(1)
    if torch.distributed.is_initialized() and engine.world_size > 1:
        torch.distributed.all_reduce(mm_max_t, op=torch.distributed.ReduceOp.MAX)
    metrics = {
        # per mini-batch means: the loss of each share is already normalised on its tokens
        "loss": pg_sum / len(shares),
        "grad_norm": sum(norms) / len(norms),
        "lr": result.lr,
        "optimizer_steps": float(len(shares)),
        "proximal_forward": float(proximal is not None),
        **loss_metrics(loss_totals),
        "entropy": ent_sum / max(loss_totals.tokens, 1.0),
        "mismatch_kl_k1": mm_k1 / mm_tokens if mm_tokens else 0.0,
        "mismatch_kl_k3": mm_k3 / mm_tokens if mm_tokens else 0.0,
        "mismatch_logp_max_abs": float(mm_max_t.item()),
        "time_compute_s": seconds,
        # rows of up to micro_batch_tokens the step's sequences were packed into, over all ranks
        "packed_rows": totals[-1],
    }
    if kl_coef > 0.0:
        # kl_ref is what the loss saw (capped per token); kl_ref_k3 is the estimate itself, so a
        # policy far from its reference shows here even where the cap hides it from the loss
        n = max(loss_totals.tokens, 1.0)
        metrics["kl_ref"] = kl_ref_sum / n
        metrics["kl_ref_k3"] = kl_k3_sum / n
    metrics.update(_mfu_metrics(engine, [len(s) for s in seqs], seconds))
    return StepOutput(metrics)


def loss_metrics(stats: alg.LossStats) -> dict[str, float]:
    """The step's loss-token counts as fractions of its loss tokens: how many tokens each bound touched."""
    n = max(stats.tokens, 1.0)
    return {
        "loss_tokens": stats.tokens,
        "clip_fraction": (stats.clipped_high + stats.clipped_low) / n,
        "clip_fraction_high": stats.clipped_high / n,
        "clip_fraction_low": stats.clipped_low / n,
        "dual_clip_fraction": stats.dual_clipped / n,
        "ratio_mean": stats.ratio_sum / n,
        "log_ratio_clamp_fraction": stats.log_ratio_clamped / n,
        "is_truncated_fraction": stats.is_truncated / n,
        "is_masked_fraction": stats.is_masked / n,
        "is_weight_mean": stats.is_weight_sum / n,
    }
