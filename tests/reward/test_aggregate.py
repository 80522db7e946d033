"""Split metrics: the official formulas of eval.py (spec §6.6) on a mixed submission."""

from __future__ import annotations

import pytest

from services.reward.evaluator import aggregate, hard_denominator


def mixed_submission(gold):
    """The gold plans with four faults; train #45 (the last query) with a budget below its cost."""
    plans = [gold.plan(i) for i in range(len(gold.plans))]
    plans[0] = None  # not delivered
    plans[1][1]["lunch"] = "Nonexistent Diner, Pensacola"  # Within Sandbox fails: hard gated off
    plans[2][2]["dinner"] = plans[2][1]["dinner"]  # Diverse Restaurants fails; hard still checked
    queries = list(gold.queries)
    queries[2] = gold.query(2, budget=10_000)  # (the repeated dinner costs more than the original)
    last = gold.at("Minneapolis", "Ohio")
    queries[last] = gold.query(last, budget=5000)  # costs 5036: Budget fails
    return queries, plans


@pytest.mark.parametrize("mode", ["official", "strict"])
def test_mixed_submission_counts(gold, evaluators, mode):
    """Computed denominators (on the whole train split they equal the official 360 and 105)."""
    queries, plans = mixed_submission(gold)
    n, hard_total = len(queries), hard_denominator(queries)
    m = evaluators[mode].evaluate_split(queries, plans, split=None)
    c = m.counts
    assert c.delivered == n - 1 and m.delivery_rate == pytest.approx(100 * (n - 1) / n)
    assert c.cs_passed == 8 * n - 8 - 1 - 1 and m.cs_micro == pytest.approx(100 * (8 * n - 10) / (8 * n))
    assert c.cs_macro_passed == n - 3
    # hard: query 1 (undelivered) and query 2 (gated) lose their budget check, query 45 its budget
    assert c.hard_passed == hard_total - 3 and m.hard_micro == pytest.approx(100 * (hard_total - 3) / hard_total)
    assert c.hard_macro_passed == n - 3 and m.hard_macro == pytest.approx(100 * (n - 3) / n)
    assert c.final_passed == n - 4 and m.final_pass_rate == pytest.approx(100 * (n - 4) / n)


def test_per_plan_scores_match_the_split(gold, official):
    queries, plans = mixed_submission(gold)
    evaluations = official.evaluate_many(queries, plans)
    scores = [e.to_score() for e in evaluations]
    assert sum(s.success for s in scores) == len(scores) - 4
    gated = scores[1]
    assert gated.cs_micro == pytest.approx(7 / 8) and gated.hard_micro == 0 and gated.hard_macro == 0
    assert gated.hard["valid_cost"].reason.startswith("not checked")
    over = scores[gold.at("Minneapolis", "Ohio")]
    assert over.cs_macro == 1 and over.hard_macro == 0
    assert over.hard_micro == pytest.approx(3 / 4)  # cuisine, room rule, transportation pass; budget fails


def test_computed_denominators(gold, official):
    queries, plans = mixed_submission(gold)
    first = official.evaluate_many(queries[:9], plans[:9])
    m = aggregate(queries[:9], first, mode="official", split=None)
    assert m.split is None and m.counts.queries == 9 and m.counts.cs_total == 72
    assert m.counts.hard_total == 9  # nine easy queries: one budget each
    assert m.counts.hard_passed == 7 and m.hard_micro == pytest.approx(100 * 7 / 9)
    with pytest.raises(ValueError, match="180"):
        aggregate(queries, official.evaluate_many(queries, plans), mode="official", split="validation")


def test_formatter_outages_are_counted_apart(gold, official):
    """A plan the formatter never read (llm_error, timeout) is not delivered, and counted as an
    outage, so a report can tell a formatter failure from an agent that gave no plan."""
    from services.reward.evaluator import aggregate

    evaluations = [official.evaluate(gold.queries[i], gold.plans[i]) for i in range(3)]
    evaluations += [
        official.evaluate(gold.queries[3], None, formatter_status="llm_error"),
        official.evaluate(gold.queries[4], None, formatter_status="timeout"),
        official.evaluate(gold.queries[5], None, formatter_status="no_plan"),
    ]
    m = aggregate(gold.queries[:6], evaluations)
    assert m.counts.delivered == 3 and m.counts.formatter_outages == 2
