"""The official train gold plans score 100% in both modes (spec travelplanner.md §6.8); with the official
denominators on the whole split (full data only)."""

from __future__ import annotations

import pytest

from services.common.schemas import Plan, Score
from services.reward import COMMONSENSE_CHECKS, HARD_CHECKS, evaluate_split
from services.reward.evaluator import OFFICIAL_DENOMINATORS, hard_denominator

MODES = ("official", "strict")


@pytest.mark.parametrize("mode", MODES)
def test_every_gold_plan_passes_every_check(gold, evaluators, mode):
    ev = evaluators[mode]
    for i, (query, plan) in enumerate(zip(gold.queries, gold.plans)):
        score = ev.score(query, plan)
        assert isinstance(score, Score) and score.mode == mode
        failed = {k: v.reason for k, v in (score.commonsense | score.hard).items() if v.passed is False}
        assert not failed, f"gold plan {i + 1} fails in {mode} mode: {failed}"
        assert set(score.commonsense) == set(COMMONSENSE_CHECKS) and set(score.hard) == set(HARD_CHECKS)
        assert all(v.passed is True for v in score.commonsense.values())
        assert (score.cs_micro, score.cs_macro, score.hard_micro, score.hard_macro, score.success) == (1, 1, 1, 1, 1)
        # a hard verdict is None exactly when the query does not ask for that constraint
        lc = query.local_constraint
        asked = {
            "valid_cuisine": bool(lc.cuisine),
            "valid_room_rule": lc.house_rule is not None,
            "valid_transportation": lc.transportation is not None,
            "valid_room_type": lc.room_type is not None,
            "valid_cost": True,
        }
        assert {k: v.passed is not None for k, v in score.hard.items()} == asked


@pytest.mark.parametrize("mode", MODES)
def test_gold_split_metrics_with_official_denominators(gold, evaluators, mode, full_travelplanner_dir):
    metrics = evaluate_split(evaluators[mode], gold.queries, gold.plans, mode=mode, split="train")
    assert metrics.mode == mode and metrics.split == "train"
    for name in ("delivery_rate", "cs_micro", "cs_macro", "hard_micro", "hard_macro", "final_pass_rate"):
        assert getattr(metrics, name) == pytest.approx(100.0), name
    c = metrics.counts
    assert (c.queries, c.cs_total, c.hard_total) == (45, 360, 105)
    assert (c.delivered, c.cs_passed, c.hard_passed, c.final_passed) == (45, 360, 105, 45)
    assert "Final Pass Rate" in metrics.table()


def test_official_denominators_match_the_data(gold, full_travelplanner_dir):
    """105 = 45 budgets + 60 local constraints in train (verified, not just copied)."""
    assert hard_denominator(gold.queries) == OFFICIAL_DENOMINATORS["train"][2] == 105
    assert 8 * len(gold.queries) == OFFICIAL_DENOMINATORS["train"][1]
    assert OFFICIAL_DENOMINATORS["validation"] == (180, 1440, 420)
    assert OFFICIAL_DENOMINATORS["test"] == (1000, 8000, 2290)


def test_known_costs_and_train_45_verdicts(gold, official, strict):
    """Train #1 costs 1608 (first of two Rockford Subways: 42); #45 5036 with room type n/a."""
    assert official.evaluate(gold.queries[0], gold.plans[0]).cost == pytest.approx(1608)
    assert strict.evaluate(gold.queries[0], gold.plans[0]).cost == pytest.approx(1608)
    last = gold.at("Minneapolis", "Ohio")
    e = official.evaluate(gold.queries[last], gold.plans[last])
    assert e.cost == pytest.approx(5036)
    assert {k: v.passed for k, v in e.hard.items()} == {
        "valid_cuisine": True,
        "valid_room_rule": True,
        "valid_transportation": True,
        "valid_room_type": None,
        "valid_cost": True,
    }


def test_plan_model_and_padding_forms_are_equivalent(gold, official):
    raw = gold.plan(4)
    days = [d for d in raw if d]
    as_model = Plan(days=days)
    for form in (raw, days, as_model, {"days": days}, tuple(days)):
        assert official.score(gold.queries[4], form).success == 1.0
