"""Reward shaping (paper-recipe.md, "Rewards"): Sum, Macro, Success, Curriculum; format errors → 0."""

from __future__ import annotations

import pytest

from services.common.schemas import Score
from services.reward import DEFAULT_CURRICULUM, Curriculum, all_rewards, reward


def make_score(cs_micro=0.75, cs_macro=0.0, hard_micro=0.5, hard_macro=0.0, success=0.0, status="ok") -> Score:
    return Score(cs_micro=cs_micro, cs_macro=cs_macro, hard_micro=hard_micro, hard_macro=hard_macro,
                 success=success, formatter_status=status)


PARTIAL = make_score(cs_micro=7 / 8, cs_macro=0, hard_micro=2 / 3, hard_macro=0, success=0)
HARD_ONLY = make_score(cs_micro=7 / 8, cs_macro=0, hard_micro=1, hard_macro=1, success=0)
PERFECT = make_score(1, 1, 1, 1, 1)


def test_sum():
    assert reward(PARTIAL, "sum") == pytest.approx(7 / 8 + 2 / 3)
    assert reward(HARD_ONLY, "sum") == pytest.approx(7 / 8 + 1 + 1)
    assert reward(PERFECT, "sum") == 5.0


def test_macro():
    assert reward(PARTIAL, "macro") == 0.0
    assert reward(HARD_ONLY, "macro") == 1.0
    assert reward(make_score(1, 1, 0.5, 0, 0), "macro") == 1.0
    assert reward(PERFECT, "macro") == 3.0


def test_success():
    assert reward(PARTIAL, "success") == 0.0
    assert reward(HARD_ONLY, "success") == 0.0
    assert reward(PERFECT, "success") == 1.0


@pytest.mark.parametrize("epoch,kind", [(1, "sum"), (2, "sum"), (3, "macro"), (4, "macro"), (5, "success"),
                                        (6, "success"), (100, "success")])
def test_default_curriculum_boundaries(epoch, kind):
    assert DEFAULT_CURRICULUM.kind_at(epoch) == kind
    for score in (PARTIAL, HARD_ONLY, PERFECT):
        assert reward(score, "curriculum", epoch) == reward(score, kind)


def test_curriculum_values_across_stages():
    assert [reward(HARD_ONLY, "curriculum", e) for e in range(1, 7)] == pytest.approx(
        [2.875, 2.875, 1.0, 1.0, 0.0, 0.0])


def test_curriculum_is_configurable():
    c = Curriculum.parse("sum:1-3, success:4-")
    assert [c.kind_at(e) for e in range(1, 6)] == ["sum", "sum", "sum", "success", "success"]
    assert Curriculum.parse("macro@1,success@2") == Curriculum(((1, "macro"), (2, "success")))
    assert Curriculum.parse("sum:1-2,macro:3-4,success:5") == DEFAULT_CURRICULUM
    assert DEFAULT_CURRICULUM.describe() == "sum:1-2,macro:3-4,success:5-"
    assert reward(PERFECT, "curriculum", 4, curriculum=c) == 1.0


@pytest.mark.parametrize("text", ["sum:2-3", "sum:1-2,macro:4-5", "bogus:1", "sum@1,sum@1", "sum", "sum@0"])
def test_bad_curricula_are_refused(text):
    with pytest.raises(ValueError):
        Curriculum.parse(text)


@pytest.mark.parametrize("epoch", [None, 0, -1, 1.5, True])
def test_curriculum_needs_a_valid_epoch(epoch):
    with pytest.raises(ValueError):
        reward(PERFECT, "curriculum", epoch)


def test_unknown_kind():
    with pytest.raises(ValueError):
        reward(PERFECT, "dense")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["sum", "macro", "success"])
def test_format_error_or_no_answer_gets_zero(kind):
    assert reward(None, kind) == 0.0
    assert reward(make_score(1, 1, 1, 1, 1, status="format_error"), kind) == 0.0
    for finish in ("format_error", "context_limit", "tool_budget", "engine_error"):
        assert reward(PERFECT, kind, finish_reason=finish) == 0.0
    assert reward(PERFECT, kind, finish_reason="answer") > 0
    assert reward(None, "curriculum", 3) == 0.0


def test_undelivered_plan_rewards_zero(gold, official):
    score = official.score(gold.queries[0], None)
    assert all_rewards(score, epoch=1) == {"sum": 0.0, "macro": 0.0, "success": 0.0, "curriculum": 0.0}


def test_rewards_of_real_scores(gold, official):
    """Gold passes everything; a sandbox failure gates the hard checks off (hard terms 0)."""
    assert all_rewards(official.score(gold.queries[44], gold.plans[44]), epoch=3) == {
        "sum": 5.0, "macro": 3.0, "success": 1.0, "curriculum": 3.0}
    plan = gold.plan(0)
    plan[1]["lunch"] = "Nonexistent Diner, Rockford"
    s = official.score(gold.queries[0], plan)
    assert reward(s, "sum") == pytest.approx(7 / 8)
    assert reward(s, "macro") == 0.0
