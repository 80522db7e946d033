"""Query synthesis: exact mixture, feasibility by construction, determinism, disjoint splits,
the benchmark's field layout (HF `datasets` loads it), loaders, phrasing and back-translation."""

from __future__ import annotations

import json
import random

import pytest

from services.common.schemas import TravelQuery
from services.synth.language import BackTranslationError, BackTranslator, template_text
from services.synth.queries import (
    LEVELS,
    QueryFileError,
    QuerySynthesizer,
    allocate,
    dedupe_key,
    load_queries,
    mixed_split_table,
    parse_ratio,
    split_queries,
    split_table,
    write_jsonl,
)
from tests.conftest import train_position
from tests.support.fake_openai import FakeOpenAI, Reply
from tests.synth.conftest import failures


def test_allocate_is_exact_and_proportional():
    assert allocate(1000, (4, 3, 3)) == [400, 300, 300]
    assert allocate(7, (4, 3, 3)) == [3, 2, 2]
    assert allocate(10, (1, 0, 1)) == [5, 0, 5]
    rng = random.Random(0)
    for _ in range(200):
        weights = [rng.uniform(0, 5) for _ in range(3)] + [1.0]
        total = rng.randint(0, 500)
        counts = allocate(total, weights)
        assert sum(counts) == total
        assert all(abs(c - total * w / sum(weights)) < 1 for c, w in zip(counts, weights))


@pytest.mark.parametrize("text", ["4:3", "a:b:c", "-1:2:3", "0:0:0", "1:inf:1"])
def test_bad_ratios_are_refused_with_a_message(text):
    with pytest.raises(ValueError, match="--mix"):
        parse_ratio(text, 3, "--mix")


def test_the_held_out_share_may_be_left_out_and_counts_zero():
    assert parse_ratio("4:5:1", 4, "--splits", optional=1) == (4.0, 5.0, 1.0, 0.0)
    assert parse_ratio("4:5:1:2", 4, "--splits", optional=1) == (4.0, 5.0, 1.0, 2.0)
    for text in ("4:5", "1:1:1:1:1"):
        with pytest.raises(ValueError, match="3 to 4 non-negative numbers"):
            parse_ratio(text, 4, "--splits", optional=1)


def test_trip_lengths_can_be_narrowed_and_the_default_draws_all_three(oracle, synthesized):
    queries, _ = QuerySynthesizer(oracle, seed=7, trip_days=(5, 7)).generate({"easy": 6, "medium": 0, "hard": 0})
    assert {q.days for q in queries} <= {5, 7} and len(queries) == 6
    assert {q.days for q in synthesized[0]} == {3, 5, 7}
    with pytest.raises(ValueError, match="subset of"):
        QuerySynthesizer(oracle, trip_days=())


@pytest.fixture(scope="module")
def synthesized(oracle):
    synth = QuerySynthesizer(oracle, seed=7)
    return synth.generate({"easy": 12, "medium": 9, "hard": 9})


def test_mix_is_exact_and_every_query_is_feasible(synthesized, oracle, strict_eval):
    queries, report = synthesized
    assert [sum(q.level == lv for q in queries) for lv in LEVELS] == [12, 9, 9]
    assert report.accepted == {"easy": 12, "medium": 9, "hard": 9}
    assert 0 < report.feasibility() <= 1 and sum(report.attempts.values()) >= 30
    for q in queries:
        result = oracle.solve(q)
        assert result.feasible, (q.id, result.reason)
        assert failures(strict_eval.evaluate(q, result.solution.day_dicts())) == {}
        assert q.budget % 100 == 0 and q.budget >= result.cost
        # the budget is the cheapest cost times the level's factor, rounded up to 100
        factor = {"easy": 1.5, "medium": 1.3, "hard": 1.15}[q.level]
        assert q.budget - 100 < result.cost * factor <= q.budget


def test_elements_follow_the_level_definitions(synthesized, synth_index):
    queries, _ = synthesized
    dates = set(synth_index.flight_dates)
    for q in queries:
        lc = q.local_constraint
        local = [lc.house_rule, lc.cuisine, lc.room_type]
        assert set(q.date) <= dates and len(set(q.date)) == q.days
        assert q.visiting_city_number == {3: 1, 5: 2, 7: 3}[q.days]
        if q.days == 3:
            assert q.dest in synth_index.cities
        else:
            assert len(synth_index.state_cities[q.dest]) >= 3
            assert synth_index.state_of(q.org) != q.dest
        if q.level == "easy":
            assert q.people_number == 1 and lc.count() == 0
        elif q.level == "medium":
            assert 2 <= q.people_number <= 8 and lc.transportation is None
            assert sum(x is not None for x in local) == 1
            assert lc.cuisine is None or len(lc.cuisine) == 2
        else:
            assert 2 <= q.people_number <= 8 and lc.transportation in ("no flight", "no self-driving")
            assert sum(x is not None for x in local) == 2
            assert lc.cuisine is None or len(lc.cuisine) in (2, 3)
        if lc.room_type in ("shared room", "not shared room"):
            assert q.people_number <= 2
        assert q.query and f"${q.budget:,}" in q.query and q.org in q.query and q.dest in q.query


def test_same_seed_same_queries_other_seed_others(oracle, synthesized):
    again, _ = QuerySynthesizer(oracle, seed=7).generate({"easy": 12, "medium": 9, "hard": 9})
    assert [q.model_dump() for q in again] == [q.model_dump() for q in synthesized[0]]
    other, _ = QuerySynthesizer(oracle, seed=8).generate({"easy": 12, "medium": 9, "hard": 9})
    assert {dedupe_key(q) for q in other} != {dedupe_key(q) for q in again}


def test_worker_processes_give_the_same_queries(oracle, synthesized):
    parallel, _ = QuerySynthesizer(oracle, seed=7, workers=2).generate({"easy": 12, "medium": 9, "hard": 9})
    assert [q.model_dump() for q in parallel] == [q.model_dump() for q in synthesized[0]]


def test_splits_are_disjoint_and_keep_the_mix(synthesized):
    queries, _ = synthesized
    assert len({dedupe_key(q) for q in queries}) == len(queries)
    parts = split_queries(queries, (4, 5, 1), seed=7)
    ids = [q.id for part in parts.values() for q in part]
    assert sorted(ids) == sorted(q.id for q in queries) and len(set(ids)) == len(ids)
    assert [len(parts[s]) for s in ("sft", "rl", "validation")] == allocate(30, (4, 5, 1))  # exact sizes
    for level, n in (("easy", 12), ("medium", 9), ("hard", 9)):  # the mixture, within one query
        got = [sum(q.level == level for q in parts[s]) for s in ("sft", "rl", "validation")]
        assert sum(got) == n and all(abs(g - e) <= 1 for g, e in zip(got, allocate(n, (4, 5, 1))))


def test_a_held_out_split_leaves_the_other_splits_as_they_were_without_one(synthesized):
    queries, _ = synthesized
    three = split_queries(queries, (4, 5, 1, 0), seed=7)
    assert three["heldout"] == []
    four = split_queries(queries, (4, 5, 1, 2), seed=7)
    assert [len(four[s]) for s in ("sft", "rl", "validation", "heldout")] == allocate(30, (4, 5, 1, 2))
    ids = [q.id for part in four.values() for q in part]
    assert sorted(ids) == sorted(q.id for q in queries) and len(set(ids)) == len(ids)
    # the same seed without a held-out share gives what it gave before the held-out split existed
    assert {s: [q.id for q in three[s]] for s in ("sft", "rl", "validation")} == {
        s: [q.id for q in split_queries(queries, (4, 5, 1), seed=7)[s]] for s in ("sft", "rl", "validation")
    }


@pytest.mark.parametrize(
    "sizes,ratios",
    [
        ({"easy": 332, "medium": 332, "hard": 332}, (640, 256, 100)),  # rounding each level gave 99 validation
        ({"easy": 12, "medium": 9, "hard": 9}, (4, 5, 1)),
        ({"easy": 5, "medium": 0, "hard": 1}, (1, 1, 1)),
        ({"easy": 7, "medium": 7, "hard": 7}, (1, 0, 0)),
    ],
)
def test_split_sizes_are_exact_and_each_level_stays_within_one_of_its_share(sizes, ratios):
    table = split_table(sizes, ratios)
    assert [sum(row[j] for row in table.values()) for j in range(3)] == allocate(sum(sizes.values()), ratios)
    for level, n in sizes.items():
        assert sum(table[level]) == n and min(table[level]) >= 0
        assert all(abs(got - n * w / sum(ratios)) < 1 + 1e-9 for got, w in zip(table[level], ratios))


def test_a_split_of_its_own_mix_keeps_every_split_size_exact(synthesized):
    table = mixed_split_table(996, (640, 256, 100, 0), [(1, 1, 1), (1, 1, 0), (1, 1, 1), (1, 1, 1)])
    assert [sum(table[lv][j] for lv in table) for j in range(4)] == [640, 256, 100, 0]
    assert [table[lv][1] for lv in ("easy", "medium", "hard")] == [128, 128, 0]
    assert [table[lv][0] for lv in ("easy", "medium", "hard")] == [214, 213, 213]
    queries, _ = synthesized
    with pytest.raises(ValueError, match="does not add up"):  # the queries must be the table's
        split_queries(queries, (640, 256, 100, 0), seed=0, table=table)


def test_jsonl_has_the_benchmark_layout_and_loads_in_hf_datasets(synthesized, tmp_path):
    from datasets import load_dataset

    queries, _ = synthesized
    path = tmp_path / "q.jsonl"
    write_jsonl(path, queries)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {
        "id",
        "org",
        "dest",
        "days",
        "visiting_city_number",
        "date",
        "people_number",
        "local_constraint",
        "budget",
        "query",
        "level",
    }
    assert first["date"].startswith("['2022-") and first["local_constraint"].startswith("{'house rule'")
    ds = load_dataset("json", data_files=str(path), split="train")
    assert len(ds) == len(queries)
    back = [TravelQuery(**row) for row in ds]
    assert [q.model_dump() for q in back] == [q.model_dump() for q in queries]
    assert [q.model_dump() for q in load_queries(path)] == [q.model_dump() for q in queries]
    typed = tmp_path / "typed.jsonl"  # Agent-STAR's typed layout reads back the same
    write_jsonl(typed, queries, layout="json")
    assert set(json.loads(typed.read_text().splitlines()[0])["local_constraint"]) == {
        "house rule",
        "cuisine",
        "room type",
        "transportation",
    }
    assert [q.model_dump() for q in load_queries(typed)] == [q.model_dump() for q in queries]


def test_loads_official_train_json_and_csv(travelplanner_dir, train_records, tmp_path):
    import csv

    train = load_queries(travelplanner_dir / "train" / "train.json")
    last = train_position(train_records, "Minneapolis", "Ohio")
    assert (
        len(train) == len(train_records) and train[0].org == "St. Petersburg" and train[last].local_constraint.cuisine
    )
    path = tmp_path / "train.csv"
    cols = [
        "org",
        "dest",
        "days",
        "visiting_city_number",
        "date",
        "people_number",
        "local_constraint",
        "budget",
        "query",
        "level",
    ]
    with open(path, "w", newline="") as fh:  # the HF export: dicts and lists as Python reprs
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in train_records:
            w.writerow({c: r[c] for c in cols})
    assert [q.model_dump() for q in load_queries(path)] == [q.model_dump() for q in train]


def test_bad_query_files_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"org": "A"}\nnot json\n')
    with pytest.raises(QueryFileError, match=r"bad.jsonl:2: not a JSON object"):
        load_queries(path)
    path.write_text('{"org": "A", "query": "only text, as in the test split"}\n')
    with pytest.raises(QueryFileError, match=r"bad.jsonl:1: .*missing dest"):
        load_queries(path)
    with pytest.raises(QueryFileError, match="no query file"):
        load_queries(tmp_path / "absent.jsonl")


def test_templates_vary_and_state_every_fact(train_queries, train_records):
    q = train_queries[
        train_position(train_records, "Minneapolis", "Ohio")
    ]  # hard: pets, 4 cuisines, no flight, 2 people
    texts = {template_text(q, random.Random(i)) for i in range(30)}
    assert len(texts) >= 10
    for text in texts:
        assert "Minneapolis" in text and "Ohio" in text and "$5,100" in text and "March 17th" in text
        assert "pets" in text.lower() and "Mediterranean" in text and ("fly" in text or "flight" in text.lower())


def test_back_translation_over_an_openai_compatible_api(train_queries):
    q = train_queries[0]
    with FakeOpenAI() as server:
        server.push(Reply(status=500), Reply(content=""), "I'm going from St. Petersburg to Rockford for 3 days.")
        bt = BackTranslator(server.base_url, "fake-model", attempts=3)
        assert bt(q) == "I'm going from St. Petersburg to Rockford for 3 days."
        assert len(server.requests) == 3
        prompt = server.requests[-1]["messages"][-1]["content"]
        assert '"org": "St. Petersburg"' in prompt and '"budget": 1700' in prompt
        server.push(Reply(status=500), Reply(status=500))
        with pytest.raises(BackTranslationError, match="after 2 attempts"):
            BackTranslator(server.base_url, "fake-model", attempts=2)(q)
