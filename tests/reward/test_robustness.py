"""Inputs that crash the official evaluator (spec §6.7), and property tests: any JSON value as a
plan, and random damage to gold plans, yields a Score or a PlanError, never another exception."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.common.schemas import Score
from services.reward import COMMONSENSE_CHECKS, PlanError
from services.reward.evaluator.plan import MAX_FIELD_CHARS

MODES = ("official", "strict")
KEYS = ("day", "days", "current_city", "transportation", "breakfast", "attraction", "lunch", "dinner", "accommodation")
SANDBOX = "is_valid_information_in_sandbox"


def check_score(score: Score) -> None:
    assert isinstance(score, Score)
    assert set(score.commonsense) == set(COMMONSENSE_CHECKS) and len(score.hard) == 5
    for value in (score.cs_micro, score.cs_macro, score.hard_micro, score.hard_macro, score.success):
        assert 0.0 <= value <= 1.0
    assert score.success <= min(score.cs_macro, score.hard_macro)
    for verdict in (score.commonsense | score.hard).values():
        assert verdict.passed is not False or verdict.reason  # every failure says why


def score_or_plan_error(ev, query, plan):
    try:
        score = ev.score(query, plan)
    except PlanError as exc:
        assert str(exc)
        return None
    check_score(score)
    return score


# --- the official evaluator's crash inputs ------------------------------------------------------

CRASHES = {
    "missing current_city": (1, lambda d: d.pop("current_city"), "is_reasonable_visiting_city"),
    "missing transportation": (1, lambda d: d.pop("transportation"), SANDBOX),
    "from without to": (1, lambda d: d.update(current_city="from Rockford"), "is_reasonable_visiting_city"),
    "lower-case flight number": (0, lambda d: d.update(transportation=d["transportation"].lower()), SANDBOX),
    "flight without 'Flight Number: '": (
        0,
        lambda d: d.update(transportation="Flight number F3573659, from St. Petersburg to Rockford"),
        SANDBOX,
    ),
    "flight with no route anywhere": (1, lambda d: d.update(transportation="Flight Number: F3573659"), SANDBOX),
    "None accommodation": (0, lambda d: d.update(accommodation=None), "is_valid_accommodation"),
    "number as a meal": (1, lambda d: d.update(lunch=42), SANDBOX),
}


@pytest.mark.parametrize("case", sorted(CRASHES))
def test_official_crash_inputs_fail_with_a_reason(gold, official, strict, case):
    day, change, key = CRASHES[case]
    plan = gold.plan(0)
    change(plan[day])
    e = official.evaluate(gold.queries[0], plan)
    assert e.commonsense[key].passed is False and key in e.malformed
    assert e.commonsense[key].reason.startswith("malformed plan: day") or "malformed" in e.commonsense[key].reason
    check_score(e.to_score())
    check_score(strict.score(gold.queries[0], plan))


def test_none_meals_do_not_crash_officially(gold, official):
    """A None meal is absent for every check, yet passes Complete Information (§6.7)."""
    plan = gold.plan(0)
    plan[1]["lunch"] = None
    e = official.evaluate(gold.queries[0], plan)
    assert not e.malformed and e.to_score().success == 1.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan", [5, "a plan", {"plan": []}, {"a": 1}, 3.5, True, {"days": "x"}])
def test_non_plans_raise_plan_error(gold, evaluators, mode, plan):
    with pytest.raises(PlanError, match="JSON array"):
        evaluators[mode].score(gold.queries[0], plan)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan", [None, [], {}, "", 0, False, {"days": []}])
def test_nothing_delivered_scores_zero(gold, evaluators, mode, plan):
    e = evaluators[mode].evaluate(gold.queries[gold.at("Minneapolis", "Ohio")], plan)
    s = e.to_score()
    assert not e.delivered and (s.cs_micro, s.cs_macro, s.hard_micro, s.hard_macro, s.success) == (0, 0, 0, 0, 0)
    assert all(v.passed is False for v in s.commonsense.values())
    assert s.hard["valid_room_type"].passed is None and s.hard["valid_cost"].passed is False


@pytest.mark.parametrize("mode", MODES)
def test_huge_field_is_a_plan_error(gold, evaluators, mode):
    plan = gold.plan(0)
    plan[1]["attraction"] = "x, Rockford;" * (MAX_FIELD_CHARS // 10)
    with pytest.raises(PlanError, match="characters"):
        evaluators[mode].score(gold.queries[0], plan)
    plan[5] = {"current_city": "y" * (10 * MAX_FIELD_CHARS)}  # beyond the evaluated days: ignored
    plan[1]["attraction"] = gold.plans[0][1]["attraction"]
    assert evaluators[mode].score(gold.queries[0], plan).success == (1.0 if mode == "official" else 0.0)


def test_split_tolerates_non_plans(gold, official):
    plans = list(gold.plans)
    plans[3] = "not a plan"
    plans[7] = None
    n = len(plans)
    m = official.evaluate_split(gold.queries, plans)
    assert m.counts.delivered == n - 1 and m.counts.final_passed == n - 2
    assert m.counts.cs_passed == (n - 2) * 8
    with pytest.raises(ValueError, match="45 queries"):
        official.evaluate_split(gold.queries[:10], gold.plans[:10], split="train")
    with pytest.raises(ValueError, match="plans"):
        official.evaluate_split(gold.queries, gold.plans[:3])


# --- property tests ---------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=25,
)
texts = st.one_of(
    st.text(max_size=60),
    st.sampled_from(
        [
            "-",
            "",
            "from",
            "from  to ",
            "to ",
            ",",
            ";",
            "Flight Number: ",
            "flight number: F1",
            "Self-driving",
            "taxi, from Rockford to",
            "(",
            ")(",
            "from A to B, from C to D",
            "Coco Bambu, Rockford",
            "Rockford(Illinois)",
            "x;",
            ";;;",
        ]
    ),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=200, max_size=MAX_FIELD_CHARS),
)
field_values = st.one_of(texts, json_values)
day_dicts = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), field_values, max_size=10)
plans = st.one_of(json_values, st.lists(st.one_of(day_dicts, json_values), max_size=9))
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(plan=plans, which=st.integers(0, 44))
def test_any_json_value(gold, evaluators, mode, plan, which):
    which %= len(gold.queries)  # the train split has 45 queries, the fixture fewer
    score_or_plan_error(evaluators[mode], gold.queries[which], plan)


@st.composite
def damaged_gold(draw):
    which = draw(st.integers(0, 44))
    return which, draw(
        st.lists(
            st.tuples(
                st.sampled_from(["set", "delete", "drop_day", "dup_day", "truncate", "wrong_type_day", "swap"]),
                st.integers(0, 7),
                st.sampled_from(KEYS),
                field_values,
                st.integers(0, 400),
            ),
            min_size=1,
            max_size=4,
        )
    )


def apply_damage(plan, damage):
    for op, day, key, value, cut in damage:
        if not plan:
            break
        day %= len(plan)
        target = plan[day]
        if op == "set" and isinstance(target, dict):
            target[key] = value
        elif op == "delete" and isinstance(target, dict):
            target.pop(key, None)
        elif op == "drop_day":
            del plan[day]
        elif op == "dup_day":
            plan.insert(day, copy.deepcopy(target))
        elif op == "truncate" and isinstance(target, dict) and isinstance(target.get(key), str):
            target[key] = target[key][: cut % (len(target[key]) + 1)]
        elif op == "wrong_type_day":
            plan[day] = value
        elif op == "swap" and isinstance(target, dict) and isinstance(target.get(key), str):
            target[key] = target[key][cut % 7 :] + target[key][: cut % 7]
    return plan


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(case=damaged_gold())
def test_damaged_gold_plans(gold, evaluators, mode, case):
    which, damage = case
    which %= len(gold.queries)
    score_or_plan_error(evaluators[mode], gold.queries[which], apply_damage(gold.plan(which), damage))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", ["Chicago\ud800", "Chi\x00cago", "x" * 1500])
def test_text_no_database_can_hold_scores_without_asking_it(gold, evaluators, mode, bad):
    """Lone surrogates, NUL bytes and over-long names never reach the database (SQLite cannot encode
    a surrogate, PostgreSQL refuses NUL): they match nothing, and the plan just fails."""
    plan = gold.plan(0)
    plan[1]["current_city"] = bad
    plan[1]["breakfast"] = f"Cafe, {bad}"
    plan[1]["accommodation"] = f"Inn, {bad}"
    plan[0]["transportation"] = f"Flight Number: F{bad}, from {bad} to Rockford"
    score = score_or_plan_error(evaluators[mode], gold.queries[0], plan)
    assert score is not None and score.success == 0.0
