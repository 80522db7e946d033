"""The reward API over real HTTP: scores match in-process, clear 4xx for hostile input, never a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.common.schemas import Plan, PlanDay
from services.controller.launcher import ServiceProcess
from services.formatter.structured import render_plan


@pytest.fixture(scope="module")
def server(official_world_url, travelplanner_dir, tmp_path_factory):
    env = {
        "STAR_DB_URL": official_world_url,
        "STAR_TRAVELPLANNER_DIR": str(travelplanner_dir),
        "STAR_LOG_LEVEL": "WARNING",
        "STAR_FORMATTER_LLM_URL": "",
        "STAR_MAX_BODY_BYTES": str(2 * 1024 * 1024),
    }
    proc = ServiceProcess("reward", "services.reward.app:create_app", env, tmp_path_factory.mktemp("logs")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def record(gold, i):
    """The query as the benchmark stores it (Python-literal strings for date and constraints)."""
    return {k: v for k, v in gold.records[i].items() if k != "annotated_plan" and k != "reference_information"}


def test_score_matches_in_process(client, gold, official, strict):
    plan = gold.plan(5)
    plan[1]["accommodation"] = "Nowhere Inn, " + plan[1]["current_city"]
    for mode, ev in (("official", official), ("strict", strict)):
        r = client.post("/score", json={"query": record(gold, 5), "plan": plan, "mode": mode, "reward": "macro"})
        assert r.status_code == 200, r.text
        body = r.json()
        expected = ev.score(gold.queries[5], plan)
        assert body["score"] == json.loads(expected.model_dump_json())
        assert body["reward"] == body["rewards"]["macro"] == 0.0
        assert body["score"]["commonsense"]["is_valid_information_in_sandbox"]["passed"] is False
        assert "Nowhere Inn" in body["score"]["commonsense"]["is_valid_information_in_sandbox"]["reason"]


def test_score_plan_text_and_batch(client, gold):
    text = render_plan(Plan(days=[PlanDay(**d) for d in gold.plans[7] if d]))
    r = client.post(
        "/score",
        json={"query": record(gold, 7), "plan_text": "Here it is:\n" + text, "reward": "curriculum", "epoch": 1},
    )
    body = r.json()
    assert r.status_code == 200 and body["reward"] == 5.0 and body["rewards"]["curriculum"] == 5.0
    assert body["formatter"] == {"status": "ok", "backend": "structured", "error": None}
    assert len(body["plan"]["days"]) == gold.queries[7].days
    items = [{"query": record(gold, i), "plan": gold.plan(i), "mode": "strict"} for i in range(4)]
    items.append({"query": record(gold, 4), "plan_text": "no idea"})
    results = client.post("/score/batch", json={"items": items}).json()["results"]
    assert [x["reward"] for x in results] == [5.0, 5.0, 5.0, 5.0, 0.0]
    assert results[4]["formatter"]["status"] == "invalid_output"


def test_evaluate_gold_train_split(client, gold, full_travelplanner_dir):
    """The official train denominators need the whole split (full data only)."""
    items = [{"query": record(gold, i), "plan": gold.plan(i)} for i in range(45)]
    items[0]["plan"] = None
    r = client.post("/evaluate", json={"items": items, "split": "train", "mode": "official"})
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["split"] == "train" and m["counts"]["queries"] == 45 and m["counts"]["hard_total"] == 105
    assert m["delivery_rate"] == pytest.approx(100 * 44 / 45) and m["final_pass_rate"] == pytest.approx(100 * 44 / 45)
    r = client.post("/evaluate", json={"items": items[:3], "split": "train"})
    assert r.status_code == 422 and "official train split has 45 queries" in r.json()["detail"]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"plan": []}, "query"),
        ({"query": {"org": "A"}, "plan": []}, "dest"),
        ({"query": "Sarasota to Chicago", "plan": []}, "query"),
        ("QUERY", "plan"),  # replaced below: a plan that is not a plan
        ({"query": "Q", "plan": [], "plan_text": "Day 1:"}, "either plan or plan_text"),
        ({"query": "Q", "plan": [], "mode": "lenient"}, "mode"),
        ({"query": "Q", "plan": [], "reward": "bonus"}, "reward"),
        ({"query": "Q", "plan": [], "reward": "curriculum"}, "needs the epoch"),
        ({"query": "Q", "plan": [], "epoch": 0}, "epoch"),
        ({"query": "Q", "plan_text": "x", "backend": "llm"}, "STAR_FORMATTER_LLM_URL"),
    ],
)
def test_bad_requests_are_4xx_with_a_message(client, gold, body, needle):
    if body == "QUERY":
        body = {"query": "Q", "plan": {"itinerary": "fly"}}
    if isinstance(body, dict) and body.get("query") == "Q":
        body["query"] = record(gold, 0)
    r = client.post("/score", json=body)
    assert r.status_code in (422, 503) and r.headers["content-type"].startswith("application/problem+json")
    assert needle in json.dumps(r.json()), r.text


def test_plan_with_hostile_values(client, gold):
    plan = gold.plan(0)
    plan[1]["breakfast"] = "x" * 5000
    r = client.post("/score", json={"query": record(gold, 0), "plan": plan})
    assert r.status_code == 422 and "characters" in r.json()["detail"]
    r = client.post("/score", content=b"[" * 50_000 + b"]" * 50_000, headers={"content-type": "application/json"})
    assert r.status_code in (400, 422) and r.json()["detail"]  # nested too deeply to parse
    r = client.post(
        "/score", content=b'{"query": ' + b" " * (3 * 1024 * 1024) + b"}", headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    r = client.post("/score/batch", json={"items": []})
    assert r.status_code == 422


def test_openapi_documents_the_routes(client):
    spec = client.get("/openapi.json").json()
    assert {"/score", "/score/batch", "/evaluate"} <= set(spec["paths"])
    assert client.get("/docs").status_code == 200
    assert "reward_plans_scored_total" in client.get("/metrics").text


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=12), c, max_size=5),
    max_leaves=20,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=_json, mode=st.sampled_from(["official", "strict"]))
def test_any_json_as_a_plan_is_never_a_5xx(client, gold, plan, mode):
    r = client.post("/score", json={"query": record(gold, 2), "plan": plan, "mode": mode})
    assert r.status_code in (200, 422), r.text
    if r.status_code == 422:
        assert r.json()["detail"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_json)
def test_any_json_body_is_never_a_5xx(client, body):
    for path in ("/score", "/score/batch", "/evaluate"):
        r = client.post(path, json=body)
        assert r.status_code < 500, (path, r.text)


# --- per-item batch errors, provenance, submissions, health under load ------------------------


def test_batch_reports_errors_per_item(client, gold):
    items = [
        {"query": record(gold, 0), "plan": gold.plan(0)},
        {"query": record(gold, 1), "plan": "not a plan"},
        {"query": record(gold, 2), "plan_text": "x", "backend": "llm"},
        {"query": record(gold, 3), "plan": None},
    ]
    r = client.post("/score/batch", json={"items": items})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert results[0]["reward"] == 5.0 and results[3]["reward"] == 0.0
    assert results[1]["index"] == 1 and "plan" in results[1]["detail"]
    assert results[2]["index"] == 2 and "STAR_FORMATTER_LLM_URL" in results[2]["detail"]


def test_every_score_says_which_world_and_mode(client, gold):
    r = client.post("/score", json={"query": record(gold, 0), "plan": gold.plan(0), "mode": "strict"})
    p = r.json()["provenance"]
    assert p["mode"] == "strict" and p["world"] == "official" and p["flights"] == "synthetic+train_rows"
    assert len(p["world_hash"]) == 16 and "reference rows" in p["flights_source"]


def test_validation_on_synthetic_flights_is_refused_unless_insisted(client, gold):
    items = [{"query": record(gold, i), "plan": gold.plan(i)} for i in range(3)]
    r = client.post("/evaluate", json={"items": items, "split": "validation", "mode": "strict"})
    assert r.status_code == 422 and "--flights-csv" in r.json()["detail"] and "synthetic" in r.json()["detail"]
    r = client.post(
        "/evaluate", json={"items": items, "split": "validation", "mode": "strict", "allow_synthetic_flights": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["provenance"]["synthetic_flights_insisted"] is True
    r = client.post("/evaluate", json={"items": items, "mode": "strict"})  # no split named: nothing to refuse
    assert r.status_code == 200 and r.json()["provenance"]["synthetic_flights_insisted"] is False


def submission_lines(gold, n=45):
    lines = [{"idx": i + 1, "query": gold.records[i]["query"], "plan": gold.plan(i)} for i in range(n)]
    lines[3]["plan"][1]["accommodation"] = "Nowhere Inn, " + lines[3]["plan"][1]["current_city"]
    if n > 7:
        lines[7]["plan"] = None
    return lines


def test_submission_of_the_train_split_from_the_dataset_folder(client, gold, full_travelplanner_dir):
    """The server reads the whole train split from its dataset folder (full data only: the fixture's
    subset is not the official split, whose denominators are fixed)."""
    r = client.post("/submission", json={"lines": submission_lines(gold), "split": "train"})
    assert r.status_code == 200, r.text
    report = r.json()
    m = report["metrics"]
    assert m["counts"]["queries"] == 45 and m["counts"]["cs_total"] == 360 and m["counts"]["hard_total"] == 105
    assert m["delivery_rate"] == pytest.approx(100 * 44 / 45) and m["final_pass_rate"] == pytest.approx(100 * 43 / 45)
    plans = report["plans"]
    assert len(plans) == 45 and plans[0]["success"] and not plans[0]["failed"]
    assert not plans[7]["delivered"] and plans[7]["failed"]
    bad = plans[3]
    assert not bad["success"] and any(
        f["check"] == "is_valid_information_in_sandbox" and "Nowhere Inn" in f["reason"] for f in bad["failed"]
    )
    levels = {row["value"]: row for row in report["by_level"]}
    assert set(levels) == {"easy", "medium", "hard"} and sum(row["n"] for row in levels.values()) == 45
    assert {row["value"] for row in report["by_trip_length"]} == {"3 days", "5 days", "7 days"}
    assert report["costs"]["costed"] >= 40 and report["costs"]["over_budget"] == 0
    assert report["provenance"]["mode"] == "official" and report["warnings"] == []


def test_submission_with_queries_in_the_request(client, gold):
    queries = [record(gold, i) for i in range(4)]
    lines = submission_lines(gold, 4)
    lines[0]["query"] = "some other question"
    r = client.post("/submission", json={"lines": lines, "queries": queries, "mode": "strict"})
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["metrics"]["counts"]["queries"] == 4 and len(report["plans"]) == 4
    assert any("line 1" in w for w in report["warnings"])


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"lines": [{"plan": None}]}, "give the split"),
        ({"lines": [{"plan": None}], "split": "validation"}, "no validation queries"),
        ({"lines": [], "split": "train"}, "at least 1"),
    ],
)
def test_bad_submissions_are_422_with_a_message(client, body, needle):
    r = client.post("/submission", json=body)
    assert r.status_code == 422 and needle in json.dumps(r.json()), r.text


def test_official_mode_scores_four_visiting_cities(client, gold):
    query = dict(record(gold, 0), visiting_city_number=4)
    r = client.post("/score", json={"query": query, "plan": gold.plan(0), "mode": "official"})
    assert r.status_code == 200, r.text
    verdict = r.json()["score"]["commonsense"]["is_not_absent"]
    assert verdict["passed"] is False and "4 city" in verdict["reason"]


def test_healthz_answers_while_a_large_batch_is_scored(client, gold):
    import threading
    import time

    n = len(gold.plans)
    items = [{"query": record(gold, i % n), "plan": gold.plan(i % n), "mode": "strict"} for i in range(400)]
    done: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: done.append(client.post("/score/batch", json={"items": items})))
    worker.start()
    worst = 0.0
    with httpx.Client(base_url=str(client.base_url), timeout=10) as probe:
        while worker.is_alive():
            started = time.monotonic()
            assert probe.get("/healthz").status_code == 200
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.05)
    worker.join()
    assert done[0].status_code == 200 and len(done[0].json()["results"]) == 400
    assert worst < 1.0, f"/healthz took {worst:.2f} s during scoring"
