"""The reward API over real HTTP: scores match in-process, clear 4xx for hostile input, never a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.common.schemas import Plan, PlanDay
from services.embedded import ServiceProcess
from services.formatter.structured import render_plan


@pytest.fixture(scope="module")
def server(official_world_url, tmp_path_factory):
    env = {"STAR_DB_URL": official_world_url, "STAR_LOG_LEVEL": "WARNING", "STAR_FORMATTER_LLM_URL": "",
           "STAR_MAX_BODY_BYTES": str(2 * 1024 * 1024)}
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
    r = client.post("/score", json={"query": record(gold, 7), "plan_text": "Here it is:\n" + text,
                                    "reward": "curriculum", "epoch": 1})
    body = r.json()
    assert r.status_code == 200 and body["reward"] == 5.0 and body["rewards"]["curriculum"] == 5.0
    assert body["formatter"] == {"status": "ok", "backend": "structured", "error": None}
    assert len(body["plan"]["days"]) == gold.queries[7].days
    items = [{"query": record(gold, i), "plan": gold.plan(i), "mode": "strict"} for i in range(4)]
    items.append({"query": record(gold, 4), "plan_text": "no idea"})
    results = client.post("/score/batch", json={"items": items}).json()["results"]
    assert [x["reward"] for x in results] == [5.0, 5.0, 5.0, 5.0, 0.0]
    assert results[4]["formatter"]["status"] == "invalid_output"


def test_evaluate_gold_train_split(client, gold):
    items = [{"query": record(gold, i), "plan": gold.plan(i)} for i in range(45)]
    items[0]["plan"] = None
    r = client.post("/evaluate", json={"items": items, "split": "train", "mode": "official"})
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["split"] == "train" and m["counts"]["queries"] == 45 and m["counts"]["hard_total"] == 105
    assert m["delivery_rate"] == pytest.approx(100 * 44 / 45) and m["final_pass_rate"] == pytest.approx(100 * 44 / 45)
    r = client.post("/evaluate", json={"items": items[:3], "split": "train"})
    assert r.status_code == 422 and "official train split has 45 queries" in r.json()["detail"]


@pytest.mark.parametrize("body, needle", [
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
])
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
    r = client.post("/score", content=b'{"query": ' + b" " * (3 * 1024 * 1024) + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/score/batch", json={"items": []})
    assert r.status_code == 422


def test_openapi_documents_the_routes(client):
    spec = client.get("/openapi.json").json()
    assert {"/score", "/score/batch", "/evaluate"} <= set(spec["paths"])
    assert client.get("/docs").status_code == 200
    assert "reward_plans_scored_total" in client.get("/metrics").text


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=12), c, max_size=5),
                     max_leaves=20)


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
