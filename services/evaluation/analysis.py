"""Analyses that need only per-query records: per-constraint pass rates, failure categories,
cohort breakdowns, trajectory signals and reward variance per group."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from services.evaluation.records import QueryRecord, split_metrics
from services.reward.evaluator import COMMONSENSE_CHECKS, HARD_CHECKS
from services.reward.evaluator.aggregate import Mode

# ---- per-constraint table --------------------------------------------------------------------


def constraint_table(records: Sequence[QueryRecord]) -> list[dict[str, Any]]:
    """Each of the 8 + 5 checks: passed / failed / not applicable, and the pass rate over the
    queries it applies to (an undelivered plan fails every applicable check, as in the metrics)."""
    rows = []
    for group, checks in (("commonsense", COMMONSENSE_CHECKS), ("hard", HARD_CHECKS)):
        for key, name in checks.items():
            passed = failed = na = 0
            for r in records:
                verdict = (r.score.commonsense if group == "commonsense" else r.score.hard).get(key)
                value = verdict.passed if verdict is not None else False
                if value is None:
                    na += 1
                elif value:
                    passed += 1
                else:
                    failed += 1
            applicable = passed + failed
            rows.append(
                {
                    "group": group,
                    "check": key,
                    "name": name,
                    "passed": passed,
                    "failed": failed,
                    "not_applicable": na,
                    "pass_rate": 100.0 * passed / applicable if applicable else None,
                }
            )
    return rows


# ---- failure categories ----------------------------------------------------------------------

NO_PLAN_CATEGORIES = {
    "format_error": "format error (agent)",
    "context_limit": "context budget exhausted",
    "tool_budget": "tool budget exhausted",
    "engine_error": "engine error",
    "deadline": "wall-clock deadline passed",
}
# formatter statuses that mean there was no plan to format (not a formatting failure)
NO_ANSWER_STATUSES = ("no_answer", "empty_answer", "no_plan")
HARD_CATEGORIES = {
    "valid_cost": "budget",
    "valid_room_rule": "room rule",
    "valid_room_type": "room type",
    "valid_cuisine": "cuisine",
    "valid_transportation": "transport preference",
}
COMMONSENSE_CATEGORIES = {
    "is_valid_restaurants": "repeated restaurant",
    "is_valid_attractions": "repeated attraction",
    "is_valid_accommodation": "minimum nights",
    "is_valid_transportation": "conflicting transport",
    "is_valid_information_in_current_city": "venue outside the day's city",
    "is_reasonable_visiting_city": "unreasonable route",
}


def _absent_category(reason: str) -> str:
    if "meals" in reason or "attraction" in reason:
        return "missing meal/attraction"
    if "accommodation" in reason:
        return "missing accommodation"
    if "transportation" in reason:
        return "missing transportation"
    if "day(s)" in reason or "city(ies)" in reason or "content after" in reason:
        return "wrong number of days/cities"
    return "incomplete plan"


def _sandbox_category(reason: str) -> str:
    if "flight" in reason:
        return "hallucinated flight"
    if "route" in reason:
        return "hallucinated driving/taxi route"
    return "hallucinated venue"


def failure_categories(record: QueryRecord) -> list[str]:
    """Why a query did not succeed, as category names (empty when it succeeded)."""
    if record.success:
        return []
    score = record.score
    if not record.delivered:
        if record.finish_reason in NO_PLAN_CATEGORIES:
            return [NO_PLAN_CATEGORIES[record.finish_reason]]
        if score.formatter_status != "ok" and not score.formatter_status.startswith(NO_ANSWER_STATUSES):
            return ["format error (formatter)"]
        return ["no plan delivered"]
    reasons = [v.reason for v in score.commonsense.values() if v.passed is False]
    if reasons and all(r.startswith(("invalid plan", "malformed plan")) for r in reasons):
        return ["format error (malformed plan)"]
    out: list[str] = []
    for key, verdict in score.commonsense.items():
        if verdict.passed is not False:
            continue
        if verdict.reason.startswith("malformed plan"):
            out.append("format error (malformed plan)")
        elif key == "is_not_absent":
            out.append(_absent_category(verdict.reason))
        elif key == "is_valid_information_in_sandbox":
            out.append(_sandbox_category(verdict.reason))
        else:
            out.append(COMMONSENSE_CATEGORIES.get(key, key))
    for key, verdict in score.hard.items():
        # a gated-off constraint ("not checked") is already explained by the gate's category
        if verdict.passed is False and not verdict.reason.startswith("not checked"):
            out.append(HARD_CATEGORIES.get(key, key))
    if record.finish_reason in ("context_limit", "tool_budget"):
        out.append(NO_PLAN_CATEGORIES[record.finish_reason])
    return sorted(set(out)) or ["unexplained"]


def failure_table(records: Sequence[QueryRecord]) -> list[dict[str, Any]]:
    """Category → failed queries showing it, and its share of all failed queries (a query may
    show several categories, so shares add up to more than 100%)."""
    failed = [r for r in records if not r.success]
    counts = Counter(c for r in failed for c in failure_categories(r))
    return [
        {"category": c, "queries": n, "share_of_failures": 100.0 * n / len(failed)} for c, n in counts.most_common()
    ]


def failure_examples(records: Sequence[QueryRecord], limit: int = 10) -> list[dict[str, Any]]:
    """The first failed queries with their categories and the evaluator's first reason."""
    out = []
    for r in sorted(records, key=lambda x: x.index):
        if r.success:
            continue
        verdicts = [*r.score.commonsense.values(), *r.score.hard.values()]
        reason = next((v.reason for v in verdicts if v.passed is False), "") or r.score.formatter_status
        out.append(
            {
                "query_id": r.query_id,
                "level": r.query.level,
                "days": r.query.days,
                "categories": failure_categories(r),
                "reason": reason[:200],
            }
        )
        if len(out) >= limit:
            break
    return out


# ---- cohorts --------------------------------------------------------------------------------


def constraint_types(record: QueryRecord) -> list[str]:
    lc = record.query.local_constraint
    kinds = [
        name
        for name, value in (
            ("house rule", lc.house_rule),
            ("cuisine", lc.cuisine),
            ("room type", lc.room_type),
            ("transportation", lc.transportation),
        )
        if value
    ]
    return kinds or ["none"]


COHORTS: dict[str, Callable[[QueryRecord], list[str]]] = {
    "level": lambda r: [r.query.level or "unknown"],
    "trip length": lambda r: [f"{r.query.days} days"],
    "constraint type": constraint_types,
}


def cohort_table(records: Sequence[QueryRecord], mode: Mode) -> list[dict[str, Any]]:
    """Every metric per cohort (computed denominators: a cohort is not an official split)."""
    rows = []
    for cohort, key_of in COHORTS.items():
        members: dict[str, list[QueryRecord]] = defaultdict(list)
        for r in records:
            for key in key_of(r):
                members[key].append(r)
        for key in sorted(members):
            m = split_metrics(members[key], mode, None)
            steps = [r.trajectory.steps for r in members[key] if r.trajectory is not None]
            rows.append(
                {
                    "cohort": cohort,
                    "value": key,
                    "n": len(members[key]),
                    **{k: getattr(m, k) for k in METRIC_KEYS},
                    "steps_p50": percentile(steps, 50),
                    "steps_p99": percentile(steps, 99),
                }
            )
    return rows


METRIC_KEYS = ("delivery_rate", "cs_micro", "cs_macro", "hard_micro", "hard_macro", "final_pass_rate")
METRIC_NAMES = {
    "delivery_rate": "Delivery Rate",
    "cs_micro": "Commonsense Micro",
    "cs_macro": "Commonsense Macro",
    "hard_micro": "Hard Micro",
    "hard_macro": "Hard Macro",
    "final_pass_rate": "Final Pass Rate",
}


# ---- trajectory signals ----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def trajectory_stats(records: Sequence[QueryRecord]) -> dict[str, Any]:
    with_traj = [r for r in records if r.trajectory is not None]
    if not with_traj:
        return {"trajectories": 0}
    steps = [r.trajectory.steps for r in with_traj]
    calls = [r.trajectory.tool_calls for r in with_traj]
    tokens = [r.trajectory.tokens for r in with_traj if r.trajectory.tokens]
    finish = Counter(r.trajectory.finish_reason for r in with_traj)
    return {
        "trajectories": len(with_traj),
        "task_completion": 100.0 * finish.get("answer", 0) / len(with_traj),
        "finish_reasons": dict(finish),
        "steps_p50": percentile(steps, 50),
        "steps_p99": percentile(steps, 99),
        "steps_mean": statistics.fmean(steps),
        "tool_calls_p50": percentile(calls, 50),
        "tool_calls_p99": percentile(calls, 99),
        "tool_calls_mean": statistics.fmean(calls),
        "tokens_mean": statistics.fmean(tokens) if tokens else None,
        "tokens_p50": percentile(tokens, 50),
        "tokens_p99": percentile(tokens, 99),
        "steps_histogram": dict(sorted(Counter(steps).items())),
    }


def group_reward_variance(records: Sequence[QueryRecord]) -> dict[str, Any]:
    """Population variance of the reward within each sampling group (GRPO's signal: a group
    whose rewards are all equal teaches nothing)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for r in records:
        t = r.trajectory
        if t is not None and t.group_id is not None:
            groups[t.group_id].append(t.reward if t.reward is not None else r.score.success)
    sized = {g: v for g, v in groups.items() if len(v) > 1}
    if not sized:
        return {"groups": 0}
    variances = [statistics.pvariance(v) for v in sized.values()]
    return {
        "groups": len(sized),
        "mean_variance": statistics.fmean(variances),
        "zero_variance_share": 100.0 * sum(v == 0 for v in variances) / len(variances),
        "per_group": {g: statistics.pvariance(v) for g, v in sorted(sized.items())},
    }
