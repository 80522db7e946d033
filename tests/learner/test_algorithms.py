"""The RL math against hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.schemas import Score, ScoredTrajectory
from services.learner import algorithms as alg
from services.learner.batching import rl_sequences
from services.learner.config import FilterConfig, RLConfig, masked_finishes, zero_reward_finishes

# ---- advantages ---------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    # group a: rewards 1,0,0,1 → mean 0.5, unbiased std sqrt(1/3) → ±0.5·sqrt(3) = ±0.8660
    # group b: one sample → mean 0, std 1 → advantage = reward
    adv = alg.group_advantages([1, 0, 0, 1, 0.7], ["a", "a", "a", "a", "b"], eps=0.0)
    assert adv[:4] == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-6)
    assert adv[4] == pytest.approx(0.7)


def test_group_advantages_mean_only_and_flat_groups():
    assert alg.group_advantages([3, 1], ["g", "g"], std_normalize=False) == pytest.approx([1.0, -1.0])
    # a flat group has zero advantage (no gradient), not a division by zero
    assert alg.group_advantages([2, 2, 2], ["g"] * 3) == pytest.approx([0.0, 0.0, 0.0])


def test_group_advantages_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 rewards but 1 group"):
        alg.group_advantages([1, 2], ["g"])


def test_format_error_is_worth_zero_and_nan_rejected():
    assert alg.effective_reward(4.2, "format_error") == 0.0
    assert alg.effective_reward(4.2, "answer") == 4.2
    with pytest.raises(ValueError, match="finite"):
        alg.effective_reward(float("nan"), "answer")


# ---- clipping -------------------------------------------------------------------------------------


def _loss(ratio: float, adv: float, **kw):
    logp = torch.tensor([math.log(ratio)], requires_grad=True)
    loss, stats = alg.clipped_policy_loss(
        logp, torch.zeros(1), torch.tensor([adv]), torch.ones(1), eps_low=0.2, eps_high=0.28, **kw
    )
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_clip_high_side_for_positive_advantage():
    # ratio 1.5 > 1.28: the loss is -A·1.28 and the gradient is cut
    loss, grad, stats = _loss(1.5, 1.0)
    assert loss == pytest.approx(-1.28)
    assert grad == 0.0
    assert stats.clipped_high == 1 and stats.clipped_low == 0


def test_clip_low_side_for_negative_advantage():
    # ratio 0.5 < 0.8 with A = -1: loss = max(0.5, 0.8) = 0.8, no gradient
    loss, grad, stats = _loss(0.5, -1.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert stats.clipped_low == 1 and stats.clipped_high == 0


def test_unclipped_side_keeps_the_gradient():
    # A = -1, ratio 1.5: the unclipped term (1.5) is larger, so it is used: d/dlogp = -A·ratio = 1.5
    loss, grad, stats = _loss(1.5, -1.0)
    assert loss == pytest.approx(1.5)
    assert grad == pytest.approx(1.5)
    assert stats.clipped_low == 0 and stats.clipped_high == 0
    # A = +1, ratio 0.5: -0.5 vs -0.8 → -0.5, gradient -0.5
    loss, grad, _ = _loss(0.5, 1.0)
    assert (loss, grad) == (pytest.approx(-0.5), pytest.approx(-0.5))


def test_asymmetric_bounds_differ():
    # 1.25 is inside the upper bound 1.28 but would be clipped by a symmetric 0.2
    loss, grad, stats = _loss(1.25, 1.0)
    assert loss == pytest.approx(-1.25) and grad == pytest.approx(-1.25) and stats.clipped_high == 0


def test_dual_clip_caps_negative_advantages():
    loss, grad, stats = _loss(4.0, -1.0, dual_clip_c=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0 and stats.dual_clipped == 1


# ---- token-level normalization -------------------------------------------------------------------


def test_token_mean_weights_count_every_loss_token_of_the_step():
    masks = [torch.tensor([0, 1, 1, 1.0]), torch.tensor([1, 0, 0.0])]
    w = alg.token_weights(masks, "token-mean")
    assert w[0].tolist() == pytest.approx([0, 0.25, 0.25, 0.25])
    assert w[1].tolist() == pytest.approx([0.25, 0, 0])
    # per-sequence mean instead: the short sequence's single token weighs 1/2, the long one's 1/6
    w = alg.token_weights(masks, "seq-mean-token-mean")
    assert w[0].tolist() == pytest.approx([0, 1 / 6, 1 / 6, 1 / 6])
    assert w[1].tolist() == pytest.approx([0.5, 0, 0])


def test_token_mean_loss_by_hand():
    # two sequences at ratio 1: loss = -Σ A_i·w = -(3·0.25·1 + 1·0.25·(-1)) = -0.5
    masks = [torch.tensor([1, 1, 1.0]), torch.tensor([1.0])]
    weights = torch.cat(alg.token_weights(masks))
    adv = torch.tensor([1, 1, 1, -1.0])
    loss, stats = alg.clipped_policy_loss(torch.zeros(4), torch.zeros(4), adv, weights, eps_low=0.2, eps_high=0.28)
    assert loss.item() == pytest.approx(-0.5)
    assert stats.tokens == 4 and stats.ratio_sum == pytest.approx(4.0)


# ---- filters -------------------------------------------------------------------------------------


def test_dynamic_sampling_drops_flat_groups():
    sel = alg.select_groups(
        {"a": [1, 1, 1], "b": [0, 1, 0], "c": [0, 0, 0], "d": [2.5, 2.5, 2.5000001]}, dynamic_sampling=True
    )
    assert sel.kept == ["b"]
    assert sel.dropped_flat == ["a", "c", "d"]


def test_dynamic_sampling_keeps_continuous_rewards_above_one():
    # rLLM's rule (all >= 1 → drop) would lose this group; spread > 0 keeps it
    sel = alg.select_groups({"a": [1.5, 2.0, 3.2]}, dynamic_sampling=True)
    assert sel.kept == ["a"]


def test_starpo_keeps_the_groups_with_the_largest_spread():
    rewards = {"a": [0, 0.1], "b": [0, 3], "c": [1, 2], "d": [0, 0]}
    sel = alg.select_groups(rewards, keep_fraction=0.5)
    assert sel.kept == ["b", "c"]
    assert sel.dropped_low_spread == ["a", "d"]
    assert sel.counts() == {"groups_kept": 2, "groups_dropped_flat": 0, "groups_dropped_low_spread": 2}
    # both filters: flat d goes first, then the top ceil(0.5·3) = 2 of a, b, c
    sel = alg.select_groups(rewards, dynamic_sampling=True, keep_fraction=0.5)
    assert sel.dropped_flat == ["d"] and sel.kept == ["b", "c"] and sel.dropped_low_spread == ["a"]


def test_staleness_split():
    fresh, stale = alg.split_stale([5, 4, 3, 5], learner_version=5, max_staleness=1)
    assert fresh == [0, 1, 3] and stale == [2]
    assert alg.split_stale([5, 4], 5, 0) == ([0], [1])


def test_mismatch_kl_by_hand():
    b = torch.tensor([math.log(0.5), math.log(0.25), 0.0])
    p = torch.tensor([math.log(0.25), math.log(0.25), -5.0])
    m = alg.mismatch_kl(b, p, torch.tensor([1, 1, 0]))
    # k1 = mean(log b - log p) over the two loss tokens = (log 2 + 0) / 2
    assert m.k1 == pytest.approx(math.log(2) / 2)
    # k3 on token 1: r = p/b = 0.5 → r - 1 - log r = -0.5 + log 2; token 2: 0
    assert m.k3 == pytest.approx((-0.5 + math.log(2)) / 2)
    assert m.max_abs == pytest.approx(math.log(2)) and m.tokens == 2


def test_kl_penalty_caps_a_token_far_below_the_reference():
    # one token the policy pushed 16 nats under the reference, one 0.5 nats under it
    logp = torch.tensor([-17.0, -1.5], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])
    penalty = alg.kl_penalty(logp, ref)
    assert float(penalty[0]) == pytest.approx(alg.KL_PENALTY_CAP)
    assert float(penalty[1]) == pytest.approx(math.exp(0.5) - 0.5 - 1.0)  # below the cap: plain k3
    penalty.sum().backward()
    # the capped token adds no gradient; the other keeps k3's own: 1 - e^(ref - logp)
    assert logp.grad[0] == 0.0
    assert float(logp.grad[1]) == pytest.approx(1.0 - math.exp(0.5))


# ---- trajectories → sequences --------------------------------------------------------------------


def _traj(group: str, i: int, reward: float, finish: str = "answer", version: int = 0, n: int = 6) -> ScoredTrajectory:
    mask = [0, 0] + [1] * (n - 2)
    return ScoredTrajectory(
        run_id="r",
        task_id=f"t-{group}",
        prompt_id=group,
        group_id=group,
        sample_index=i,
        policy_version=version,
        token_ids=list(range(10, 10 + n)),
        loss_mask=mask,
        logprobs=[None if m == 0 else -1.0 for m in mask],
        finish_reason=finish,
        score=Score(),
        reward=reward,
    )


def test_rl_sequences_overlength_masked_but_kept_in_normalization():
    trajs = [_traj("g", 0, 1.0), _traj("g", 1, 0.0), _traj("g", 2, 1.0, "context_limit"), _traj("g", 3, 0.0)]
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0)
    # the context-limit sample's reward 1 is still in the group: mean 0.5, std sqrt(1/3)
    assert batch.advantages == pytest.approx([0.8660, -0.8660, 0.8660, -0.8660], abs=1e-3)
    assert sum(batch.sequences[2].loss_mask) == 0
    assert sum(batch.sequences[0].loss_mask) == 4
    assert batch.stats["samples_masked_overlength"] == 1 and batch.stats["samples_trained"] == 3


def test_truncated_samples_train_as_failures_under_the_fail_policy():
    # A context-limit sample the reward worker scored 1 (it never does: the guard here is the learner's own)
    trajs = [
        _traj("g", 0, 1.0),
        _traj("g", 1, 0.0),
        _traj("g", 2, 1.0, "context_limit"),
        _traj("g", 3, 0.0, "tool_budget"),
    ]
    filters = FilterConfig(
        mask_finish_reasons=masked_finishes("fail"), zero_reward_finish_reasons=zero_reward_finishes("fail")
    )
    batch = rl_sequences(trajs, filters, learner_version=0)
    # rewards 1, 0, 0, 0: mean 0.25, std 0.5; both truncated samples are pushed down and trained
    assert batch.rewards == [1.0, 0.0, 0.0, 0.0]
    assert batch.advantages == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-4)
    assert [sum(s.loss_mask) for s in batch.sequences] == [4, 4, 4, 4]
    assert batch.stats["samples_masked_overlength"] == 0 and batch.stats["samples_trained"] == 4
    assert batch.stats["samples_truncated"] == 2  # counted under either policy
    assert rl_sequences(trajs, FilterConfig(), learner_version=0).stats["samples_truncated"] == 2
    engine = rl_sequences(
        [_traj("h", 0, 1.0), _traj("h", 1, 0.0), _traj("h", 2, 0.0, "engine_error")], filters, learner_version=0
    )
    assert len(engine.sequences) == 2  # an engine failure is still left out, under either policy


@pytest.mark.parametrize("scale", [0.0, 0.25, 1.0])
def test_negative_advantages_are_scaled_and_positive_ones_kept(scale):
    trajs = [_traj("g", 0, 1.0), _traj("g", 1, 0.0), _traj("g", 2, 0.0), _traj("g", 3, 0.0)]
    full = rl_sequences(trajs, FilterConfig(), learner_version=0).advantages
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0, negative_scale=scale)
    # mean 0.25, std 0.5: the better sample +1.5, the others -0.5 times the scale
    assert full == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-4)
    assert batch.advantages == pytest.approx([1.5] + [-0.5 * scale] * 3, abs=1e-4)
    assert [s.advantage for s in batch.sequences] == batch.advantages


def test_negative_scale_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match=r"in \[0, 1\], got 1.5"):
        alg.scale_negative_advantages([1.0, -1.0], 1.5)
    with pytest.raises(ValueError, match="negative_scale"):
        RLConfig(model="m", output_dir="o", negative_scale=-0.1)


def test_rl_sequences_format_error_zero_stale_and_dapo():
    trajs = [
        _traj("a", 0, 3.0, "format_error"),
        _traj("a", 1, 0.0),  # flat after zeroing → dropped
        _traj("b", 0, 2.0),
        _traj("b", 1, 1.0),
        _traj("c", 0, 2.0, version=0),
        _traj("c", 1, 1.0, version=0),
    ]
    trajs[4].policy_version = trajs[5].policy_version = -3  # far behind: stale
    batch = rl_sequences(trajs, FilterConfig(dynamic_sampling=True, max_staleness=1), learner_version=0)
    assert batch.stats["samples_stale"] == 2
    assert batch.stats["groups_dropped_flat"] == 1 and batch.stats["groups_kept"] == 1
    assert batch.stats["samples_format_error"] == 1
    assert [s.advantage for s in batch.sequences] == pytest.approx([0.7071, -0.7071], abs=1e-3)


def test_flat_fraction_is_measured_when_flat_groups_are_kept():
    # GRPO keeps flat groups (zero advantage); the metric must still say how many there were
    trajs = [
        _traj("a", 0, 5.0),
        _traj("a", 1, 5.0),
        _traj("b", 0, 2.0),
        _traj("b", 1, 2.0),
        _traj("c", 0, 2.0),
        _traj("c", 1, 4.0),
    ]
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0)
    assert batch.stats["groups_flat_fraction"] == pytest.approx(2 / 3)
    assert batch.stats["groups_dropped_flat"] == 0 and len(batch.sequences) == 6
    assert [s.advantage for s in batch.sequences[:4]] == [0.0] * 4


def test_rl_sequences_shape_errors_are_clear():
    bad = _traj("g", 0, 1.0)
    bad.loss_mask = bad.loss_mask[:-1]
    with pytest.raises(ValueError, match="6 token ids but 5 loss-mask"):
        rl_sequences([bad], FilterConfig(), learner_version=0)


def test_rl_config_defaults_and_validation():
    cfg = RLConfig(model="m", output_dir="o")
    assert (cfg.group_size, cfg.batch_prompts, cfg.lr, cfg.kl_coef) == (8, 32, 2e-6, 0.0)
    assert cfg.eps_high > cfg.eps_low
    assert RLConfig(model="m", output_dir="o", algorithm="dapo").filters.dynamic_sampling
    with pytest.raises(ValueError, match="eps_high >= eps_low"):
        RLConfig(model="m", output_dir="o", eps_low=0.3, eps_high=0.2)


def test_mismatch_kl_of_no_loss_tokens_is_zero_not_nan():
    m = alg.mismatch_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, float("nan")]), torch.tensor([0, 0]))
    assert (m.k1, m.k3, m.max_abs, m.tokens) == (0.0, 0.0, 0.0, 0)


def test_step_statistics_summed_on_the_device_equal_the_per_micro_batch_floats():
    g = torch.Generator().manual_seed(0)
    rows = [
        (
            torch.randn(7, generator=g),
            torch.randn(7, generator=g),
            torch.randn(7, generator=g),
            (torch.rand(7, generator=g) > 0.3).float(),
        )
        for _ in range(3)
    ]
    summed = sum(alg.clipped_policy_terms(lp, old, adv, w, eps_low=0.2, eps_high=0.28)[1] for lp, old, adv, w in rows)
    floats = [alg.clipped_policy_loss(lp, old, adv, w, eps_low=0.2, eps_high=0.28)[1] for lp, old, adv, w in rows]
    merged = floats[0].merge(floats[1]).merge(floats[2])
    assert summed.tolist() == pytest.approx(list(merged.astuple()))
    assert merged.tokens == sum(float((w != 0).sum()) for *_, w in rows)


def test_sdpa_backend_names_are_checked():
    from pydantic import ValidationError

    from services.learner.config import EngineConfig
    from services.learner.engine import sdpa_priority

    assert EngineConfig(sdpa_backends=["cudnn", "flash"]).sdpa_backends == ["cudnn", "flash"]
    with pytest.raises(ValidationError):
        EngineConfig(sdpa_backends=["fastest"])
    q = torch.randn(1, 2, 4, 8)
    with sdpa_priority(["math"]):  # a real priority list, honoured on CPU too
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), atol=1e-6)


# ---- bounded loss: log-ratio clamp, dual clip, token-level importance sampling ----------------------


def _outlier(log_ratio: float, adv: float, **kw):
    """One token `log_ratio` nats above its "old" log-prob, with one advantage."""
    logp = torch.tensor([log_ratio], requires_grad=True)
    loss, stats = alg.clipped_policy_loss(
        logp, torch.zeros(1), torch.tensor([adv]), torch.ones(1), eps_low=0.2, eps_high=0.28, **kw
    )
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_outlier_token_unbounded_loss_by_hand():
    # the old loss: ratio e^24 = 2.65e10, A = -0.5 → -A·ρ = 1.32e10 (the figure)
    loss, grad, _ = _outlier(24.0, -0.5, dual_clip_c=None, log_ratio_clamp=None)
    assert loss == pytest.approx(0.5 * math.exp(24), rel=1e-5)
    assert grad == pytest.approx(0.5 * math.exp(24), rel=1e-5)  # and the gradient with it
    # at a log-ratio of 100 exp overflows float32: the loss is inf and, even under dual clip, the
    # gradient is NaN (the min's zero times exp(100) = inf)
    loss, grad, _ = _outlier(100.0, -0.5, log_ratio_clamp=None, dual_clip_c=None)
    assert math.isinf(loss)
    loss, grad, _ = _outlier(100.0, -0.5, log_ratio_clamp=None)
    assert loss == pytest.approx(1.5) and math.isnan(grad)


def test_outlier_token_gives_a_finite_loss_and_no_gradient_by_default():
    # defaults: clamp ±20, dual clip c = 3 → loss = c·|A| = 1.5, no gradient through the clipped branch
    for log_ratio in (24.0, 100.0):
        loss, grad, stats = _outlier(log_ratio, -0.5)
        assert loss == pytest.approx(3 * 0.5) and grad == 0.0
        assert stats.dual_clipped == 1 and stats.log_ratio_clamped == 1
    # A > 0 and a ratio far above 1 + eps_high: -A·1.28, no gradient; the clamp is counted
    loss, grad, stats = _outlier(100.0, 2.0)
    assert (loss, grad) == (pytest.approx(-2.56), 0.0)
    assert stats.clipped_high == 1 and stats.log_ratio_clamped == 1 and stats.dual_clipped == 0
    # far below the sampler with A < 0: the lower bound holds it at 0.8·|A|, no gradient
    loss, grad, stats = _outlier(-100.0, -1.0)
    assert (loss, grad) == (pytest.approx(0.8), 0.0)
    assert math.isfinite(stats.ratio_sum)
    # inside the clamp the clamp changes nothing: log-ratio 0.1, A = -1 → ratio e^0.1, gradient e^0.1
    loss, grad, stats = _outlier(0.1, -1.0)
    assert (loss, grad) == (pytest.approx(math.exp(0.1)), pytest.approx(math.exp(0.1)))
    assert stats.log_ratio_clamped == 0 and stats.dual_clipped == 0


def test_shipped_defaults_are_bounded():
    cfg = RLConfig(model="m", output_dir="o")
    assert (cfg.dual_clip_c, cfg.log_ratio_clamp, cfg.importance_sampling) == (3.0, 20.0, "off")
    assert (alg.DUAL_CLIP_C, alg.LOG_RATIO_CLAMP) == (3.0, 20.0)


def test_truncated_importance_weights_by_hand():
    # proximal - behaviour log-ratios: ln 3 (w 3 → cut to 2), ln 0.25 (w 0.25, kept), 0 (w 1), none (w 1)
    prox = torch.tensor([math.log(3.0), math.log(0.25), -1.0, -2.0])
    behaviour = torch.tensor([0.0, 0.0, -1.0, 0.0])
    has = torch.tensor([True, True, True, False])
    w, touched = alg.importance_weights(prox, behaviour, has, "tis", high=2.0)
    assert w.tolist() == pytest.approx([2.0, 0.25, 1.0, 1.0])
    assert touched.tolist() == [True, False, False, False]


def test_masked_importance_weights_by_hand():
    prox = torch.tensor([math.log(3.0), math.log(0.25), math.log(1.5), -2.0])
    behaviour = torch.tensor([0.0, 0.0, 0.0, 0.0])
    has = torch.tensor([True, True, True, False])
    w, touched = alg.importance_weights(prox, behaviour, has, "mis", low=0.5, high=2.0)
    # 3 > 2 and 0.25 < 0.5 leave the loss; 1.5 is kept as is; a token with no behaviour logprob weighs 1
    assert w.tolist() == pytest.approx([0.0, 0.0, 1.5, 1.0])
    assert touched.tolist() == [True, True, False, False]
    off, _ = alg.importance_weights(prox, behaviour, has, "off")
    assert off.tolist() == [1.0] * 4
    with pytest.raises(ValueError, match="importance sampling mode"):
        alg.importance_weights(prox, behaviour, has, "sometimes")
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        alg.importance_weights(prox, behaviour, has, "mis", low=1.5, high=2.0)


def test_importance_weights_scale_the_loss_and_its_gradient():
    # ratio 1 against the proximal policy (on-policy), A = +1 on both tokens, weights 1/2 each:
    # per token -A·ρ·w → loss = -(2 + 0.25)/2 = -1.125; d/dlogp_i = -A·w_i/2
    logp = torch.zeros(2, requires_grad=True)
    w, touched = alg.importance_weights(
        torch.tensor([math.log(3.0), math.log(0.25)]), torch.zeros(2), torch.ones(2, dtype=torch.bool), "tis", high=2.0
    )
    loss, stats = alg.clipped_policy_loss(
        logp,
        logp.detach(),
        torch.ones(2),
        torch.full((2,), 0.5),
        eps_low=0.2,
        eps_high=0.28,
        is_weights=w,
        is_touched=touched,
        is_mode="tis",
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.125)
    assert logp.grad.tolist() == pytest.approx([-1.0, -0.125])
    assert (stats.is_truncated, stats.is_masked, stats.is_weight_sum) == (1, 0, pytest.approx(2.25))


# ---- group statistics: engine errors, staleness per group, group-token-mean ----------------------------


def test_engine_errors_leave_the_group_statistics():
    # rewards 1, 0, 0 and an engine error (reward 0): without the error, mean 1/3, std sqrt(1/3)
    # → advantages (1 - 1/3)/0.57735 = 1.1547 and (0 - 1/3)/0.57735 = -0.5774. Counted as a failure
    # it would give mean 0.25, std 0.5 → 1.5, -0.5.
    trajs = [_traj("g", 0, 1.0), _traj("g", 1, 0.0), _traj("g", 2, 0.0), _traj("g", 3, 0.0, "engine_error")]
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0)
    assert batch.advantages == pytest.approx([1.1547, -0.5774, -0.5774], abs=1e-4)
    assert len(batch.sequences) == 3
    assert batch.stats["samples_engine_error"] == 1 and batch.stats["groups_dropped_errors"] == 0


def test_a_group_errors_leave_with_one_sample_is_dropped():
    trajs = [
        _traj("a", 0, 1.0),
        _traj("a", 1, 0.0, "engine_error"),
        _traj("b", 0, 0.0, "engine_error"),
        _traj("b", 1, 0.0, "engine_error"),
        _traj("c", 0, 2.0),
        _traj("c", 1, 1.0),
    ]
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0)
    assert [s.group for s in batch.sequences] == ["c", "c"]
    assert batch.stats["groups_dropped_errors"] == 2 and batch.stats["groups_in"] == 3
    assert batch.stats["samples_engine_error"] == 3


def test_staleness_is_judged_per_group_by_its_oldest_sample():
    # learner at 5, max staleness 2: group a's samples are at 4 and 2 (3 behind) → all of a goes;
    # group b's at 4 and 3 → kept whole
    fresh, stale = alg.split_stale([4, 2, 4, 3], 5, 2, groups=["a", "a", "b", "b"])
    assert (fresh, stale) == ([2, 3], [0, 1])
    # one by one, a's fresher sample would have stayed alone
    assert alg.split_stale([4, 2, 4, 3], 5, 2) == ([0, 2, 3], [1])
    trajs = [
        _traj("a", 0, 1.0, version=4),
        _traj("a", 1, 0.0, version=2),
        _traj("b", 0, 1.0, version=4),
        _traj("b", 1, 0.0, version=3),
    ]
    batch = rl_sequences(trajs, FilterConfig(max_staleness=2), learner_version=5)
    assert [s.group for s in batch.sequences] == ["b", "b"] and batch.stats["samples_stale"] == 2


def test_group_token_mean_weights_by_hand():
    # group a: sequences of 2 and 6 loss tokens (8 in the group); group b: one of 4 tokens.
    # group-token-mean: 1 / (2 groups · 8) = 1/16 in a, 1 / (2 · 4) = 1/8 in b; each group sums to 1/2.
    # token-mean: 1/12 everywhere, so a (8 tokens) weighs 2/3 of the step and b 1/3.
    masks = [torch.ones(2), torch.ones(6), torch.ones(4)]
    w = alg.token_weights(masks, "group-token-mean", groups=["a", "a", "b"])
    assert [float(x[0]) for x in w] == pytest.approx([1 / 16, 1 / 16, 1 / 8])
    assert float(w[0].sum() + w[1].sum()) == pytest.approx(0.5) and float(w[2].sum()) == pytest.approx(0.5)
    flat = alg.token_weights(masks, "token-mean")
    assert float(flat[0].sum() + flat[1].sum()) == pytest.approx(2 / 3)
    # a group with no loss tokens does not count in the number of groups
    w = alg.token_weights([torch.ones(2), torch.zeros(3)], "group-token-mean", groups=["a", "b"])
    assert float(w[0][0]) == pytest.approx(1 / 2) and float(w[1].sum()) == 0.0


def test_group_token_mean_through_packed_rows():
    from services.learner.batching import Sequence_, assign_weights, pack_sequences

    # the loss mask counts targets from position 1: 2 + 2 loss tokens in group a, 4 in group b
    seqs = [
        Sequence_([1, 2, 3], [0, 1, 1], index=0, group="a"),
        Sequence_([1, 2, 3, 4], [0, 0, 1, 1], index=1, group="a"),
        Sequence_([5, 6, 7, 8, 9], [0, 1, 1, 1, 1], index=2, group="b"),
    ]
    rows = pack_sequences(seqs, 64)
    assign_weights(rows, "group-token-mean", {s.index: s.group for s in seqs})
    by_seq: dict[int, float] = {}
    for r in rows:
        for i, wt in zip(r.seq_index.tolist(), r.weights.tolist()):
            by_seq[i] = by_seq.get(i, 0.0) + wt
    # group a: 4 tokens, each 1/(2·4); group b: 4 tokens, each 1/(2·4): every group sums to 1/2
    assert by_seq[0] + by_seq[1] == pytest.approx(0.5) and by_seq[2] == pytest.approx(0.5)
    assert by_seq[0] == pytest.approx(2 / 8)
