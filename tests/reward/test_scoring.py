"""Scoring requests in-process: plan or text → formatter → evaluator → rewards; splits; trajectories."""

from __future__ import annotations

import pytest

from services.common.schemas import Plan, PlanDay, Trajectory
from services.formatter.structured import render_plan
from services.reward.scoring import BatchItemError, EvaluateRequest, PlanInput, ScoreError, Scorer, ScoreRequest


@pytest.fixture(scope="module")
def scorer(official) -> Scorer:
    return Scorer(official)


def gold_text(gold, i: int) -> str:
    return render_plan(Plan(days=[PlanDay(**d) for d in gold.plans[i] if d]))


@pytest.mark.parametrize("mode", ["official", "strict"])
def test_gold_plans_as_json_and_as_text_score_full_marks(gold, scorer, mode):
    for i in range(0, len(gold.plans), 4):
        by_json = scorer.score(ScoreRequest(query=gold.queries[i], plan=gold.plan(i), mode=mode))
        by_text = scorer.score(
            ScoreRequest(query=gold.queries[i], plan_text=gold_text(gold, i), mode=mode, backend="structured")
        )
        for out in (by_json, by_text):
            s = out.score
            assert (s.cs_micro, s.cs_macro, s.hard_micro, s.hard_macro, s.success) == (1, 1, 1, 1, 1), i
            assert out.reward == 5.0 and out.rewards == {"sum": 5.0, "macro": 3.0, "success": 1.0}
        assert by_json.formatter is None and by_json.plan is None
        assert by_text.formatter.status == "ok" and by_text.formatter.backend == "structured"
        assert by_text.cost == by_json.cost
        assert by_text.score.commonsense == by_json.score.commonsense


def test_reward_kinds_and_curriculum(gold, scorer):
    plan = gold.plan(0)
    plan[1]["breakfast"] = plan[1]["lunch"]  # a repeated restaurant: one commonsense check fails
    out = scorer.score(ScoreRequest(query=gold.queries[0], plan=plan, reward="curriculum", epoch=3))
    assert out.score.commonsense["is_valid_restaurants"].passed is False
    assert out.score.cs_micro == pytest.approx(7 / 8) and out.score.success == 0
    assert out.reward == out.rewards["macro"] == out.score.hard_macro  # epoch 3: macro stage
    assert out.rewards["sum"] == pytest.approx(7 / 8 + 0 + 1 + 1 + 0)
    with pytest.raises(ValueError, match="needs the epoch"):
        scorer.score(ScoreRequest(query=gold.queries[0], plan=plan, reward="curriculum"))


def test_text_the_parser_cannot_read_scores_zero(gold, scorer):
    out = scorer.score(ScoreRequest(query=gold.queries[0], plan_text="We fly out, eat, sleep and come back."))
    assert out.formatter.status == "invalid_output" and "not a structured plan" in out.formatter.error
    assert out.score.formatter_status == "invalid_output" and out.reward == 0
    assert all(v.passed is False for v in out.score.commonsense.values())
    out = scorer.score(ScoreRequest(query=gold.queries[0], plan_text="answer not found"))
    assert out.formatter.status == "no_plan" and out.rewards == {"sum": 0, "macro": 0, "success": 0}


def test_values_that_are_not_plans_are_score_errors(gold, scorer):
    for bad in (42, "Day 1", {"day": 1}, {"days": "x"}):
        with pytest.raises(ScoreError, match="plan: a plan must be"):
            scorer.score(ScoreRequest(query=gold.queries[0], plan=bad))
    with pytest.raises(ValueError, match="either plan or plan_text"):
        ScoreRequest(query=gold.queries[0], plan=gold.plan(0), plan_text="Day 1:")
    with pytest.raises(ScoreError, match="STAR_FORMATTER_LLM_URL"):
        scorer.score(ScoreRequest(query=gold.queries[0], plan_text="x", backend="llm"))


def test_batch_keeps_order_and_names_the_bad_item(gold, scorer):
    reqs = [ScoreRequest(query=gold.queries[i], plan=gold.plan(i)) for i in range(3)]
    reqs[1] = ScoreRequest(query=gold.queries[1], plan=None)
    out = scorer.score_batch(reqs)
    assert [r.reward for r in out] == [5.0, 0.0, 5.0]
    reqs[2] = ScoreRequest(query=gold.queries[2], plan="not a plan")
    out = scorer.score_batch(reqs)
    # the bad item is an error in its place; the others are scored regardless
    assert [getattr(r, "reward", None) for r in out] == [5.0, 0.0, None]
    assert isinstance(out[2], BatchItemError) and out[2].index == 2 and "plan:" in out[2].detail


def test_evaluate_split_official_denominators(gold, scorer, full_travelplanner_dir):
    """The official train denominators need the whole split (full data only)."""
    items = [PlanInput(query=q, plan=p) for q, p in zip(gold.queries, gold.plans)]
    m = scorer.evaluate_split(EvaluateRequest(items=items, split="train"))
    assert (m.delivery_rate, m.cs_micro, m.hard_micro, m.final_pass_rate) == (100, 100, 100, 100)
    items[0] = PlanInput(query=gold.queries[0], plan=None)  # undelivered
    items[1] = PlanInput(query=gold.queries[1], plan="garbage")  # delivered, but not a plan
    items[2] = PlanInput(query=gold.queries[2], plan_text=gold_text(gold, 2))
    m = scorer.evaluate_split(EvaluateRequest(items=items, split="train"))
    assert m.counts.delivered == 44 and m.counts.final_passed == 43
    assert m.delivery_rate == pytest.approx(100 * 44 / 45)
    assert m.cs_micro == pytest.approx(100 * (360 - 16) / 360)
    with pytest.raises(ScoreError, match="official train split has 45 queries"):
        scorer.evaluate_split(EvaluateRequest(items=items[:10], split="train"))
    strict = scorer.evaluate_split(EvaluateRequest(items=items[:10], mode="strict"))
    assert strict.counts.cs_total == 80


def _trajectory(gold, i: int, **kw) -> Trajectory:
    base = dict(
        run_id="r",
        task_id="t",
        prompt_id="p",
        group_id="g",
        sample_index=0,
        finish_reason="answer",
        answer=f"<think>done</think><answer>\n{gold_text(gold, i)}</answer>",
        query=gold.queries[i],
        epoch=5,
        reward_kind="curriculum",
        eval_mode="strict",
    )
    return Trajectory(**(base | kw))


def test_trajectory_scoring(gold, scorer):
    scored = scorer.score_trajectory(_trajectory(gold, 3))
    assert scored.reward == 1.0 and scored.rewards == {"sum": 5, "macro": 3, "success": 1, "curriculum": 1}
    assert scored.score.mode == "strict" and scored.plan is not None and len(scored.plan.days) == gold.queries[3].days
    assert scored.task_id == "t" and scored.query == gold.queries[3]
    # a kind the RL scheduler resolved from a recipe's curriculum: the paper's schedule is not reported beside it
    resolved = scorer.score_trajectory(_trajectory(gold, 3, reward_kind="macro"))
    assert resolved.reward == 3 and resolved.rewards == {"sum": 5, "macro": 3, "success": 1}

    for kw in (
        {"finish_reason": "tool_budget", "answer": None},
        {"finish_reason": "format_error"},
        {"answer": "I could not finish. answer not found"},
        {"answer": None},
    ):
        out = scorer.score_trajectory(_trajectory(gold, 3, **kw))
        assert out.reward == 0 and set(out.rewards.values()) == {0.0}, kw
        assert out.score.formatter_status != "ok"
    with pytest.raises(ScoreError, match="carries no query"):
        scorer.score_trajectory(_trajectory(gold, 3, query=None))


def test_trajectory_preference_penalty_reaches_the_reward(gold, scorer):
    # a gold plan scored against its query with a transport rule the plan breaks
    i = next(
        i
        for i in range(45)
        if gold.queries[i].local_constraint.transportation is None
        and any("Self-driving" in str(d.get("transportation")) for d in gold.plan(i))
    )
    query = gold.queries[i].model_copy(deep=True)
    query.local_constraint.transportation = "no self-driving"
    plain = scorer.score_trajectory(_trajectory(gold, i, query=query, reward_kind="sum"))
    shaped = scorer.score_trajectory(_trajectory(gold, i, query=query, reward_kind="sum", preference_penalty=1.5))
    assert plain.score.hard["valid_transportation"].passed is False
    assert shaped.reward == pytest.approx(plain.reward - 1.5)
    assert shaped.rewards == plain.rewards  # the paper's kinds are logged unshaped
