"""RL numerics benchmark: what one outlier token does to the policy loss, under the shipped
bounds and without them (the baseline, measured in the same run), and with dual clip alone.

    .venv/bin/python bench/numerics.py

For each outlier log-ratio (learner log-prob minus the sampler's; 24 and 100 nats) and a
negative advantage, it computes the clipped policy loss and its gradient on one token alone,
and on a step of 4,096 ordinary tokens (log-ratios ~ N(0, 0.05²), advantages ±1) with that one
token among them: unbounded (no log-ratio clamp, no dual clip, the old defaults) and with the
shipped defaults (clamp ±20, dual clip c = 3). It also records the token-level importance
weights (TIS / MIS) and the group statistics with an engine-error sample, worked by hand in
tests/learner/test_algorithms.py, as the code computes them.

Target (issue 37): with the defaults every loss and gradient is finite, and the outlier token
carries no gradient. Results: bench/results/numerics.json.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.schemas import Score, ScoredTrajectory  # noqa: E402
from services.learner import algorithms as alg  # noqa: E402
from services.learner.batching import rl_sequences  # noqa: E402
from services.learner.config import FilterConfig, RLConfig  # noqa: E402

RESULTS = ROOT / "bench" / "results"
OUTLIERS = (24.0, 100.0)
ADVANTAGE = -0.5
EPS_LOW, EPS_HIGH = 0.2, 0.28
TOKENS = 4096
UNBOUNDED = {"log_ratio_clamp": None, "dual_clip_c": None}
DUAL_CLIP_ONLY = {"log_ratio_clamp": None, "dual_clip_c": alg.DUAL_CLIP_C}


def finite_json(value):
    """inf and NaN as strings: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value


def one_token(log_ratio: float, bounds: dict) -> dict:
    logp = torch.tensor([log_ratio], requires_grad=True)
    loss, stats = alg.clipped_policy_loss(
        logp, torch.zeros(1), torch.tensor([ADVANTAGE]), torch.ones(1), eps_low=EPS_LOW, eps_high=EPS_HIGH, **bounds
    )
    loss.backward()
    return {
        "loss": loss.item(),
        "grad": logp.grad.item(),
        "loss_finite": math.isfinite(loss.item()),
        "grad_finite": math.isfinite(logp.grad.item()),
        "dual_clipped": stats.dual_clipped,
        "log_ratio_clamped": stats.log_ratio_clamped,
    }


def step_with_outlier(log_ratio: float, bounds: dict, seed: int = 0) -> dict:
    """A token-mean step of TOKENS tokens, the first one the outlier."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(TOKENS, generator=g) * 3
    logp = old + 0.05 * torch.randn(TOKENS, generator=g)
    logp[0] = old[0] + log_ratio
    logp.requires_grad_(True)
    adv = torch.where(torch.rand(TOKENS, generator=g) < 0.5, -1.0, 1.0)
    adv[0] = ADVANTAGE
    weights = torch.full((TOKENS,), 1.0 / TOKENS)
    loss, stats = alg.clipped_policy_loss(logp, old, adv, weights, eps_low=EPS_LOW, eps_high=EPS_HIGH, **bounds)
    loss.backward()
    grad = logp.grad
    others = grad[1:]
    return {
        "loss": loss.item(),
        "loss_finite": math.isfinite(loss.item()),
        "grad_finite": bool(torch.isfinite(grad).all()),
        "grad_norm": float(grad.norm()),
        "outlier_grad": float(grad[0]),
        "others_grad_norm": float(others.norm()),
        "clip_fraction": (stats.clipped_high + stats.clipped_low) / stats.tokens,
        "dual_clip_fraction": stats.dual_clipped / stats.tokens,
        "log_ratio_clamp_fraction": stats.log_ratio_clamped / stats.tokens,
    }


def importance_examples() -> dict:
    prox = torch.tensor([math.log(3.0), math.log(0.25), math.log(1.5), -2.0])
    behaviour = torch.zeros(4)
    has = torch.tensor([True, True, True, False])
    out = {"proximal_over_behaviour": [3.0, 0.25, 1.5, None]}
    for mode in ("tis", "mis"):
        w, touched = alg.importance_weights(prox, behaviour, has, mode, low=alg.IS_LOW, high=alg.IS_HIGH)
        out[mode] = {"weights": [round(x, 6) for x in w.tolist()], "touched": touched.tolist()}
    return out


def group_example() -> dict:
    def traj(i: int, reward: float, finish: str = "answer") -> ScoredTrajectory:
        return ScoredTrajectory(
            run_id="bench",
            task_id="t",
            prompt_id="g",
            group_id="g",
            sample_index=i,
            token_ids=[1, 2, 3],
            loss_mask=[0, 1, 1],
            logprobs=[None, -1.0, -1.0],
            finish_reason=finish,
            score=Score(),
            reward=reward,
        )

    trajs = [traj(0, 1.0), traj(1, 0.0), traj(2, 0.0), traj(3, 0.0, "engine_error")]
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0)
    counted_as_failure = alg.group_advantages([1.0, 0.0, 0.0, 0.0], ["g"] * 4)
    return {
        "rewards": [1.0, 0.0, 0.0, "engine_error"],
        "advantages": [round(a, 6) for a in batch.advantages],
        "advantages_if_the_error_counted_as_a_failure": [round(a, 6) for a in counted_as_failure],
        "groups_dropped_errors": batch.stats["groups_dropped_errors"],
    }


def main() -> None:
    cfg = RLConfig(model="-", output_dir="-")
    defaults = {
        "log_ratio_clamp": cfg.log_ratio_clamp,
        "dual_clip_c": cfg.dual_clip_c,
        "importance_sampling": cfg.importance_sampling,
        "is_low": cfg.is_low,
        "is_high": cfg.is_high,
        "loss_agg": cfg.loss_agg,
        "eps_low": cfg.eps_low,
        "eps_high": cfg.eps_high,
    }
    shipped = {"log_ratio_clamp": cfg.log_ratio_clamp, "dual_clip_c": cfg.dual_clip_c}
    cases = []
    for lr in OUTLIERS:
        case = {
            "log_ratio": lr,
            "advantage": ADVANTAGE,
            "baseline_unbounded": {"one_token": one_token(lr, UNBOUNDED), "step": step_with_outlier(lr, UNBOUNDED)},
            "dual_clip_without_clamp": {
                "one_token": one_token(lr, DUAL_CLIP_ONLY),
                "step": step_with_outlier(lr, DUAL_CLIP_ONLY),
            },
            "defaults": {"one_token": one_token(lr, shipped), "step": step_with_outlier(lr, shipped)},
        }
        cases.append(case)
        for name in ("baseline_unbounded", "dual_clip_without_clamp", "defaults"):
            t, s = case[name]["one_token"], case[name]["step"]
            print(
                f"log-ratio {lr:5.0f}  {name:23s}  token loss {t['loss']:.4g} grad {t['grad']:.4g}   "
                f"step loss {s['loss']:.4g} grad norm {s['grad_norm']:.4g} (outlier {s['outlier_grad']:.3g})"
            )
    ordinary = step_with_outlier(0.0, shipped)
    print(
        f"no outlier       defaults                 step loss {ordinary['loss']:.4g} grad norm {ordinary['grad_norm']:.4g}"
    )
    with_defaults = [c["defaults"][k] for c in cases for k in ("one_token", "step")]
    result = {
        "bench": "numerics",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "outlier_log_ratio": list(OUTLIERS),
        "loss_finite": all(r["loss_finite"] for r in with_defaults),
        "grad_finite": all(r["grad_finite"] for r in with_defaults),
        "outlier_grad_zero": all(c["defaults"]["step"]["outlier_grad"] == 0.0 for c in cases),
        "baseline_loss_finite": all(
            c["baseline_unbounded"][k]["loss_finite"] for c in cases for k in ("one_token", "step")
        ),
        "baseline_grad_finite": all(
            c["baseline_unbounded"][k]["grad_finite"] for c in cases for k in ("one_token", "step")
        ),
        "defaults": defaults,
        "cases": cases,
        "step_without_outlier": ordinary,
        "importance_sampling": importance_examples(),
        "group_with_engine_error": group_example(),
    }
    print(
        f"defaults: loss finite {result['loss_finite']}, grad finite {result['grad_finite']}, outlier grad 0 "
        f"{result['outlier_grad_zero']}; unbounded baseline: loss finite {result['baseline_loss_finite']}, "
        f"grad finite {result['baseline_grad_finite']}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "numerics.json").write_text(json.dumps(finite_json(result), indent=2, allow_nan=False))
    print(f"wrote {RESULTS / 'numerics.json'}")


if __name__ == "__main__":
    main()
