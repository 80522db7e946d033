"""Analyses from scores: failure categories from real verdicts, per-constraint counts, cohorts,
percentiles, group reward variance."""

from __future__ import annotations

import pytest

from services.common.schemas import Trajectory
from services.evaluation import analysis
from services.evaluation.records import split_metrics
from services.evaluation.runner import score_query
from services.reward.submission import SplitQuery


def record(evaluator, gold, i, plan="gold", trajectory=None, status="ok", **query_changes):
    query = gold.queries[i].model_copy(update={"id": str(i + 1), **query_changes})
    plan = gold.plan(i) if plan == "gold" else plan
    return score_query(evaluator, SplitQuery(i, str(i + 1), query), plan, status, None, trajectory)


def traj(finish: str, group: str = "g", sample: int = 0, reward: float | None = None) -> Trajectory:
    return Trajectory(run_id="r", task_id="t", prompt_id="p", group_id=group, sample_index=sample, finish_reason=finish)


def test_failure_categories_from_verdicts(gold, evaluator):
    strict = evaluator.with_mode("strict")
    no_lunch = gold.plan(0)
    no_lunch[1]["lunch"] = "-"
    fake_dinner = gold.plan(0)
    fake_dinner[1]["dinner"] = "Nowhere Diner Supreme, Rockford"
    cases = {
        "budget": record(evaluator, gold, 0, budget=100),
        "missing meal/attraction": record(strict, gold, 0, plan=no_lunch),
        "hallucinated venue": record(evaluator, gold, 0, plan=fake_dinner),
        "context budget exhausted": record(evaluator, gold, 0, plan=None, trajectory=traj("context_limit")),
        "format error (formatter)": record(
            evaluator, gold, 0, plan=None, status="invalid_output: not a structured plan"
        ),
        "no plan delivered": record(evaluator, gold, 0, plan=None),
    }
    for category, rec in cases.items():
        assert category in analysis.failure_categories(rec), (category, rec.score)
    # the hard checks a failed gate switched off are not blamed
    assert "budget" not in analysis.failure_categories(cases["hallucinated venue"])
    assert analysis.failure_categories(record(evaluator, gold, 0)) == []
    table = analysis.failure_table(list(cases.values()))
    assert sum(row["queries"] for row in table) >= len(cases)
    assert all(0 < row["share_of_failures"] <= 100 for row in table)


def test_room_type_and_rule_categories(gold, evaluator):
    i = next(k for k, q in enumerate(gold.queries) if q.local_constraint.room_type is None and q.people_number <= 2)
    shared = record(
        evaluator,
        gold,
        i,
        local_constraint=gold.queries[i].local_constraint.model_copy(update={"room_type": "shared room"}),
    )
    assert shared.score.hard["valid_room_type"].passed is False
    assert "room type" in analysis.failure_categories(shared)


def test_constraint_table_counts(gold, evaluator):
    records = [record(evaluator, gold, i) for i in range(6)] + [record(evaluator, gold, 6, plan=None)]
    rows = {r["check"]: r for r in analysis.constraint_table(records)}
    assert rows["is_not_absent"]["passed"] == 6 and rows["is_not_absent"]["failed"] == 1
    budget = rows["valid_cost"]
    assert (budget["passed"], budget["failed"], budget["not_applicable"]) == (6, 1, 0)
    cuisine = rows["valid_cuisine"]
    asked = sum(bool(gold.queries[i].local_constraint.cuisine) for i in range(7))
    assert cuisine["passed"] + cuisine["failed"] == asked and cuisine["not_applicable"] == 7 - asked


def test_cohorts_cover_every_query(gold, evaluator):
    n = len(gold.queries)
    records = [record(evaluator, gold, i) for i in range(n)]
    rows = analysis.cohort_table(records, "official")
    for cohort in ("level", "trip length"):
        assert sum(r["n"] for r in rows if r["cohort"] == cohort) == n
    assert {r["value"] for r in rows if r["cohort"] == "trip length"} == {"3 days", "5 days", "7 days"}
    assert all(r["final_pass_rate"] == 100.0 for r in rows)
    # one failing 3-day query shows up in its cohort only
    records[0] = record(evaluator, gold, 0, budget=100)
    rows = {(r["cohort"], r["value"]): r for r in analysis.cohort_table(records, "official")}
    three = sum(q.days == 3 for q in gold.queries)  # 15 of the 45
    assert gold.queries[0].days == 3
    assert rows[("trip length", "3 days")]["final_pass_rate"] == pytest.approx(100 * (three - 1) / three)
    assert rows[("trip length", "5 days")]["final_pass_rate"] == 100.0
    assert split_metrics(records, "official").final_pass_rate == pytest.approx(100 * (n - 1) / n)


def test_percentile_matches_numpy():
    import numpy as np

    values = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    for q in (0, 50, 90, 99, 100):
        assert analysis.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert analysis.percentile([], 50) is None


def test_group_reward_variance(gold, evaluator):
    recs = [
        record(evaluator, gold, 0, trajectory=traj("answer", "g1", 0)),
        record(evaluator, gold, 0, plan=None, trajectory=traj("format_error", "g1", 1)),
        record(evaluator, gold, 1, trajectory=traj("answer", "g2", 0)),
        record(evaluator, gold, 1, trajectory=traj("answer", "g2", 1)),
    ]
    out = analysis.group_reward_variance(recs)
    assert out["groups"] == 2 and out["per_group"] == {"g1": 0.25, "g2": 0.0}
    assert out["zero_variance_share"] == 50.0 and out["mean_variance"] == pytest.approx(0.125)
