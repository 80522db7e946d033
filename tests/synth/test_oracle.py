"""The oracle planner: strict-valid cheapest plans on the real tables, exactness against a naive
enumeration, and clear reasons when a query has no plan."""

from __future__ import annotations

import itertools
import random

import pytest

from services.common.schemas import TravelQuery
from services.synth import meals
from services.synth.baseline import naive_cheapest
from services.synth.index import Eatery, SynthIndex
from services.synth.oracle import Oracle, night_splits
from tests.conftest import train_position
from tests.synth.conftest import failures


def test_night_splits_cover_every_composition():
    assert night_splits(3, 1) == [(2,)]
    assert night_splits(5, 2) == [(2, 2), (1, 3), (3, 1)]
    splits = night_splits(7, 3)
    assert splits[0] == (2, 2, 2) and len(splits) == 10 and len(set(splits)) == 10
    assert all(sum(s) == 6 and min(s) >= 1 for s in splits)
    assert night_splits(7, 3, even_only=True) == [(2, 2, 2)]


def test_every_train_query_gets_a_strict_success_plan(oracle, strict_eval, train_queries):
    """All 45 official train queries on the real tables + our flights: a plan that the strict
    evaluator scores as a success, priced exactly as the evaluator prices it."""
    solved = 0
    for i, q in enumerate(train_queries):
        result = oracle.solve(q)
        assert result.feasible, f"train #{i + 1}: {result.constraint}: {result.reason}"
        evaluation = strict_eval.evaluate(q, result.solution.day_dicts())
        assert failures(evaluation) == {}, f"train #{i + 1}"
        assert evaluation.cost == pytest.approx(result.cost)
        solved += 1
    assert solved == len(train_queries)


def test_reference_world_oracle_is_never_dearer_than_gold(reference_world, train_queries, gold_plans):
    """With exactly the gold plans' flights, every train query is solved and the oracle's plan
    costs no more than the gold plan (priced by the strict evaluator, which accepts all 45)."""
    from services.reward import Evaluator

    oracle = Oracle(SynthIndex.build(reference_world))
    strict = Evaluator(reference_world, "strict")
    cheaper = 0
    for i, (q, gold) in enumerate(zip(train_queries, gold_plans)):
        gold_eval = strict.evaluate(q, gold)
        assert failures(gold_eval) == {}, f"gold plan #{i + 1} should pass strict"
        result = oracle.solve(q)
        assert result.feasible, f"train #{i + 1}: {result.constraint}: {result.reason}"
        assert failures(strict.evaluate(q, result.solution.day_dicts())) == {}
        assert result.cost <= gold_eval.cost + 1e-9, f"train #{i + 1}: oracle {result.cost} > gold {gold_eval.cost}"
        cheaper += result.cost < gold_eval.cost
    assert cheaper >= len(train_queries) - 5  # gold plans eat on travel days and pick pricier stays (40 of 45)


def _sample_queries(index: SynthIndex, n: int, seed: int, days: int) -> list[TravelQuery]:
    rng = random.Random(seed)
    states = [s for s, cities in index.state_cities.items() if len(cities) >= 3 and len(cities) <= 9]
    cities = list(index.cities)
    out = []
    while len(out) < n:
        org = rng.choice(cities)
        dest = rng.choice(cities) if days == 3 else rng.choice(states)
        if dest == org or index.state_of(org) == dest:
            continue
        targets = [dest] if days == 3 else index.state_cities[dest]
        if not any(index.road(org, c) and index.road(c, org) for c in targets):
            continue  # most random pairs have no road at all; keep the search non-trivial
        start = rng.randint(1, 31 - days + 1)
        lc = {
            "room type": rng.choice([None, None, None, "private room", "entire room"]),
            "house rule": rng.choice([None, None, None, "pets", "smoking"]),
            "transportation": rng.choice([None, None, "no flight", "no self-driving"]),
            "cuisine": rng.choice([None, None, ["Chinese", "Italian"], ["French", "Mexican", "Indian"]]),
        }
        out.append(
            TravelQuery(
                org=org,
                dest=dest,
                days=days,
                visiting_city_number={3: 1, 5: 2, 7: 3}[days],
                date=[f"2022-03-{start + i:02d}" for i in range(days)],
                people_number=rng.randint(1, 8),
                local_constraint=lc,
                budget=10**7,
            )
        )
    return out


@pytest.mark.parametrize("days", [5, 7])
def test_oracle_cost_equals_naive_enumeration(synth_index, oracle, days):
    """Branch and bound finds the same least cost as trying every route, split, leg mode and stay."""
    queries = _sample_queries(synth_index, 12 if days == 5 else 6, seed=days, days=days)
    feasible = 0
    for q in queries:
        naive = naive_cheapest(synth_index, q)
        result = oracle.cheapest(q)
        if naive == float("inf"):
            assert not result.feasible and result.constraint is not None
        else:
            feasible += 1
            assert result.feasible, (q, result.reason)
            assert result.cost == pytest.approx(naive), q
    assert feasible >= 3


def test_coverage_matches_brute_force():
    rng = random.Random(3)
    labels = ["Chinese", "Italian", "French", "Mexican", "BBQ"]
    for trial in range(40):
        eateries = sorted(
            (
                Eatery(f"R{i}", "X", rng.randint(10, 90), frozenset(rng.sample(labels, rng.randint(0, 3))))
                for i in range(rng.randint(3, 9))
            ),
            key=lambda e: e.cost,
        )
        required, extra = rng.randint(0, 3), rng.randint(0, 2)
        wanted = rng.sample(labels[:4], rng.randint(1, 3))
        table = meals.coverage(eateries, required, extra, wanted)
        for mask in range(1 << len(wanted)):
            need = {c for i, c in enumerate(wanted) if mask >> i & 1}
            best = min(
                (
                    sum(e.cost for e in combo)
                    for size in range(required, required + extra + 1)
                    for combo in itertools.combinations(eateries, size)
                    if need <= set().union(*(e.cuisines for e in combo))
                ),
                default=None,
            )
            if best is None:
                assert mask not in table
            else:
                assert table[mask][0] == best, (trial, mask)


def test_cuisine_plan_uses_travel_day_meals_when_stay_meals_cannot_cover(
    oracle, strict_eval, train_queries, train_records
):
    q = train_queries[train_position(train_records, "Minneapolis", "Ohio")].model_copy(
        deep=True
    )  # Minneapolis -> Ohio, 7 days, 4 cuisines, no flight
    result = oracle.solve(q)
    assert result.feasible and result.evaluated >= 1
    assert failures(strict_eval.evaluate(q, result.solution.day_dicts())) == {}


def _with(q: TravelQuery, **lc) -> TravelQuery:
    data = q.model_dump()
    data["local_constraint"].update(lc)
    return TravelQuery(**data)


@pytest.mark.parametrize(
    "change,constraint,words",
    [
        ({"budget": 100}, "budget", "over the budget of 100"),
        ({"dest": "Atlantis"}, "route", "not a city"),
        ({"lc": {"room_type": "shared room"}, "dest": "Rockford"}, "room type", "shared room"),
        ({"lc": {"transportation": "no flight"}}, "transportation", "(no flight)"),  # no road St. Petersburg-Rockford
    ],
)
def test_infeasible_queries_name_the_constraint(oracle, train_queries, change, constraint, words):
    q = train_queries[0]
    data = q.model_dump()
    data.update({k: v for k, v in change.items() if k != "lc"})
    data["local_constraint"].update(change.get("lc", {}))
    result = oracle.solve(TravelQuery(**data))
    assert not result.feasible
    assert result.constraint == constraint, result.reason
    assert words in result.reason


def test_unreachable_state_reports_route(oracle, train_queries, train_records):
    data = train_queries[train_position(train_records, "Houston", "Utah")].model_dump()  # a 7-day trip
    data["dest"] = "Wallonia"  # a one-city "state"
    result = oracle.solve(TravelQuery(**data))
    assert not result.feasible and result.constraint == "route" and "needs 3" in result.reason
