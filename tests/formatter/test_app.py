"""POST /format over real HTTP, with the LLM backend pointed at a real chat-completions server."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.controller.launcher import ServiceProcess
from tests.formatter.samples import DAYS, GOOD, PROSE, QUERY
from tests.support.fake_openai import FakeOpenAI, Reply

STRUCTURED = "\n\n".join(
    f"Day {d['day']}:\nCurrent City: {d['current_city']}\nTransportation: {d['transportation']}\n"
    f"Breakfast: {d['breakfast']}\nAttraction: {d['attraction']}\nLunch: {d['lunch']}\nDinner: {d['dinner']}\n"
    f"Accommodation: {d['accommodation']}"
    for d in DAYS
)


@pytest.fixture(scope="module")
def llm_server():
    with FakeOpenAI(api_key="sk-app") as s:
        yield s


def _service(name, env, tmp_path_factory):
    env = {"STAR_LOG_LEVEL": "WARNING", **env}
    return ServiceProcess(name, "services.formatter.app:create_app", env, tmp_path_factory.mktemp("logs")).start()


@pytest.fixture(scope="module")
def client(llm_server, tmp_path_factory):
    proc = _service(
        "formatter",
        {
            "STAR_FORMATTER_LLM_URL": llm_server.base_url,
            "STAR_FORMATTER_LLM_MODEL": "fmt",
            "STAR_FORMATTER_LLM_API_KEY": "sk-app",
            "STAR_FORMATTER_MAX_ATTEMPTS": "2",
            "STAR_FORMATTER_TIMEOUT_S": "2",
        },
        tmp_path_factory,
    )
    with httpx.Client(base_url=proc.url, timeout=30) as c:
        yield c
    proc.stop()


@pytest.fixture(scope="module")
def bare_client(tmp_path_factory):
    proc = _service("formatter-bare", {"STAR_FORMATTER_LLM_URL": ""}, tmp_path_factory)
    with httpx.Client(base_url=proc.url, timeout=30) as c:
        yield c
    proc.stop()


def q():
    return QUERY.model_dump(mode="json")


def test_structured_text_needs_no_llm(client, llm_server):
    llm_server.clear()
    r = client.post("/format", json={"query": q(), "plan_text": STRUCTURED, "backend": "structured"})
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["backend"] == "structured"
    assert body["plan"]["days"] == DAYS
    assert not llm_server.requests


def test_auto_falls_back_to_the_llm(client, llm_server):
    llm_server.clear()
    llm_server.push(Reply(status=500), f"```json\n{GOOD}\n```")
    r = client.post("/format", json={"query": q(), "plan_text": PROSE, "backend": "auto"})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ok" and body["backend"] == "llm" and body["attempts"] == 2
    assert body["plan"]["days"] == DAYS
    assert llm_server.requests[0]["model"] == "fmt"
    again = client.post("/format", json={"query": q(), "plan_text": PROSE, "backend": "llm"}).json()
    assert again["cached"] is True and len(llm_server.requests) == 2


def test_failures_are_statuses_not_http_errors(client, llm_server):
    llm_server.clear()
    llm_server.push("", "still nothing")
    body = client.post("/format", json={"query": q(), "plan_text": PROSE + " v2", "backend": "llm"}).json()
    assert body["status"] == "invalid_output" and "plan" not in body and "2 attempt(s)" in body["error"]
    body = client.post("/format", json={"plan_text": "answer not found", "backend": "llm"}).json()
    assert body == {
        "status": "no_plan",
        "backend": "rule",
        "error": "the answer says 'answer not found'",
        "attempts": 0,
        "cached": False,
    }
    body = client.post("/format", json={"plan_text": PROSE, "backend": "structured"}).json()
    assert body["status"] == "invalid_output" and "not a structured plan" in body["error"]


def test_llm_backend_without_configuration_is_503(bare_client):
    r = bare_client.post("/format", json={"plan_text": PROSE, "backend": "llm"})
    assert r.status_code == 503 and "STAR_FORMATTER_LLM_URL" in r.json()["detail"]
    r = bare_client.post("/format", json={"plan_text": STRUCTURED})
    assert r.status_code == 200 and r.json()["status"] == "ok"


@pytest.mark.parametrize(
    "body, where",
    [
        ({}, "plan_text"),
        ({"plan_text": 5}, "plan_text"),
        ({"plan_text": "x", "backend": "gpt"}, "backend"),
        ({"plan_text": "x", "query": {"org": "A"}}, "query"),
        ({"plan_text": "x", "query": {**QUERY.model_dump(mode="json"), "days": 4}}, "days"),
        ({"plan_text": "x", "surprise": 1}, "surprise"),
    ],
)
def test_bad_requests_are_422_with_the_field(client, body, where):
    r = client.post("/format", json=body)
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    assert where in json.dumps(r.json()["detail"])


def test_oversized_and_non_json_bodies(client):
    from services.common.http import MAX_BODY_BYTES

    r = client.post(
        "/format", content=b"{" + b" " * MAX_BODY_BYTES + b"}", headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["detail"]
    r = client.post("/format", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=30),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
        max_leaves=12,
    )
)
def test_any_json_is_never_a_5xx(bare_client, value):
    body = value if not isinstance(value, dict) else {"backend": "structured", **value}
    r = bare_client.post("/format", json=body)
    assert r.status_code < 500, r.text
