"""Reward shaping (paper-recipe.md, "Rewards"): Sum, Macro, Success, Curriculum; format errors → 0."""

from __future__ import annotations

import pytest

from services.common.schemas import Score
from services.reward import DEFAULT_CURRICULUM, Curriculum, all_rewards, reward


def make_score(cs_micro=0.75, cs_macro=0.0, hard_micro=0.5, hard_macro=0.0, success=0.0, status="ok") -> Score:
    return Score(
        cs_micro=cs_micro,
        cs_macro=cs_macro,
        hard_micro=hard_micro,
        hard_macro=hard_macro,
        success=success,
        formatter_status=status,
    )


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


@pytest.mark.parametrize(
    "epoch,kind", [(1, "sum"), (2, "sum"), (3, "macro"), (4, "macro"), (5, "success"), (6, "success"), (100, "success")]
)
def test_default_curriculum_boundaries(epoch, kind):
    assert DEFAULT_CURRICULUM.kind_at(epoch) == kind
    for score in (PARTIAL, HARD_ONLY, PERFECT):
        assert reward(score, "curriculum", epoch) == reward(score, kind)


def test_curriculum_values_across_stages():
    assert [reward(HARD_ONLY, "curriculum", e) for e in range(1, 7)] == pytest.approx(
        [2.875, 2.875, 1.0, 1.0, 0.0, 0.0]
    )


def test_curriculum_is_configurable():
    c = Curriculum.parse("sum:1-3, success:4-")
    assert [c.kind_at(e) for e in range(1, 6)] == ["sum", "sum", "sum", "success", "success"]
    assert Curriculum.parse("macro@1,success@2") == Curriculum(((1, "macro"), (2, "success")))
    assert Curriculum.parse("sum:1-2,macro:3-4,success:5") == DEFAULT_CURRICULUM
    assert DEFAULT_CURRICULUM.describe() == "sum:1-2,macro:3-4,success:5-"
    assert reward(PERFECT, "curriculum", 4, curriculum=c) == 1.0


def test_a_curriculum_may_count_steps():
    by_step = Curriculum.parse("sum:1-8,success:9", unit="step")
    assert by_step.unit == "step" and by_step.stages == Curriculum.parse("sum:1-8,success:9").stages
    # a 0-based step of epoch 1: step 7 is the 8th, the last on sum
    assert [by_step.kind_for(epoch=1, step=s) for s in (0, 7, 8, 31)] == ["sum", "sum", "success", "success"]
    assert DEFAULT_CURRICULUM.kind_for(epoch=2, step=40) == "sum"  # by epoch, the step does not matter
    with pytest.raises(ValueError, match="starts at 3, expected step 2"):
        Curriculum.parse("sum:1-1,success:3", unit="step")
    with pytest.raises(ValueError, match="counts epochs or steps, not 'batch'"):
        Curriculum(unit="batch")  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["sum:2-3", "sum:1-2,macro:4-5", "bogus:1", "sum@1,sum@1", "sum", "sum@0"])
def test_bad_curricula_are_refused(text):
    with pytest.raises(ValueError):
        Curriculum.parse(text)


def test_a_stage_after_an_open_ended_one_is_refused_by_name():
    # "sum:1" runs forever, so nothing can follow it; the message says how to close it.
    with pytest.raises(ValueError, match=r"'success:2' follows 'sum:1', which has no last epoch \(write sum:1-N"):
        Curriculum.parse("sum:1,success:2")
    assert Curriculum.parse("sum:1-1,success:2").kind_at(2) == "success"


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
    last = gold.at("Minneapolis", "Ohio")
    assert all_rewards(official.score(gold.queries[last], gold.plans[last]), epoch=3) == {
        "sum": 5.0,
        "macro": 3.0,
        "success": 1.0,
        "curriculum": 3.0,
    }
    plan = gold.plan(0)
    plan[1]["lunch"] = "Nonexistent Diner, Rockford"
    s = official.score(gold.queries[0], plan)
    assert reward(s, "sum") == pytest.approx(7 / 8)
    assert reward(s, "macro") == 0.0


def _with_hard(**verdicts) -> Score:
    """A plan that passes commonsense and breaks the hard checks given as False."""
    from services.common.schemas import CheckVerdict

    hard = {name: CheckVerdict(passed=ok) for name, ok in verdicts.items()}
    applicable = [ok for ok in verdicts.values() if ok is not None]
    share = sum(applicable) / len(applicable)
    return Score(
        cs_micro=1, cs_macro=1, hard=hard, hard_micro=share, hard_macro=float(share == 1), success=float(share == 1)
    )


def test_preference_penalty_ranks_a_broken_preference_below_a_broken_budget():
    over_budget = _with_hard(valid_cost=False, valid_transportation=True, valid_cuisine=True)
    forbidden_mode = _with_hard(valid_cost=True, valid_transportation=False, valid_cuisine=True)
    # the paper's sum cannot tell the two apart
    assert reward(over_budget, "sum") == reward(forbidden_mode, "sum") == pytest.approx(2 + 2 / 3)
    assert reward(over_budget, "sum", preference_penalty=1.0) == pytest.approx(2 + 2 / 3)
    assert reward(forbidden_mode, "sum", preference_penalty=1.0) == pytest.approx(1 + 2 / 3)
    assert reward(PERFECT, "sum", preference_penalty=1.0) == 5.0


def test_preference_penalty_counts_each_broken_preference_and_never_goes_below_zero():
    both = _with_hard(valid_cost=True, valid_transportation=False, valid_room_type=False, valid_room_rule=None)
    assert reward(both, "sum", preference_penalty=0.5) == pytest.approx(2 + 1 / 3 - 1.0)
    assert reward(both, "macro", preference_penalty=1.0) == 0.0  # 1 - 2, floored: no worse than a format error
    assert reward(both, "sum", preference_penalty=1.0, finish_reason="format_error") == 0.0
    with pytest.raises(ValueError, match="preference_penalty"):
        reward(both, "sum", preference_penalty=-1.0)
