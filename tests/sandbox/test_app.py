"""The sandbox over real HTTP: same text as in-process, clear 4xx for bad input, faults, metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.common.settings import Settings
from services.controller.launcher import ServiceProcess
from services.sandbox.app import create_app
from services.sandbox.tools.toolbox import ToolBox

TOKEN = "test-token"


@pytest.fixture(scope="module")
def server(official_world_url, tmp_path_factory):
    env = {"STAR_DB_URL": official_world_url, "STAR_API_TOKEN": TOKEN, "STAR_LOG_LEVEL": "WARNING"}
    proc = ServiceProcess("sandbox", "services.sandbox.app:create_app", env, tmp_path_factory.mktemp("logs")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def call(client, name, arguments, **extra):
    return client.post("/tools/call", json={"name": name, "arguments": arguments, **extra})


def test_lists_six_tool_schemas(client):
    tools = client.get("/tools").json()
    names = {t["function"]["name"] for t in tools}
    assert names == {
        "SearchCity",
        "SearchFlight",
        "GoogleDistanceMatrix",
        "SearchAccommodation",
        "SearchRestaurant",
        "SearchAttraction",
    }
    flight = next(t for t in tools if t["function"]["name"] == "SearchFlight")["function"]["parameters"]
    assert set(flight["required"]) == {"departure", "destination", "date"}


@pytest.mark.parametrize("dialect", ["star", "official"])
@pytest.mark.parametrize(
    "name,arguments",
    [
        ("SearchCity", {"state": "Illinois"}),
        ("SearchFlight", {"departure": "St. Petersburg", "destination": "Rockford", "date": "2022-03-16"}),
        ("GoogleDistanceMatrix", {"departure": "Detroit", "destination": "Norfolk", "mode": "taxi"}),
        ("SearchAccommodation", {"city": "Rockford"}),
        ("SearchRestaurant", {"city": "Rockford"}),
        ("SearchAttraction", {"city": "Rockford"}),
        ("SearchRestaurant", {"city": "Atlantis"}),
    ],
)
def test_http_text_equals_in_process(client, official_world, dialect, name, arguments):
    over_http = call(client, name, arguments, dialect=dialect)
    assert over_http.status_code == 200, over_http.text
    in_process = ToolBox(official_world, dialect=dialect, cache_size=0).call(name, arguments)
    assert over_http.json()["text"] == in_process.text
    assert over_http.json()["ok"] == in_process.ok


def test_path_form_matches_call_form(client):
    a = client.post("/tools/SearchAttraction", json={"city": "Rockford"}).json()
    b = call(client, "SearchAttraction", {"city": "Rockford"}).json()
    assert a["text"] == b["text"] and "Burpee Museum of Natural History" in a["text"]


def test_flight_of_a_gold_plan_is_found(client):
    text = call(
        client, "SearchFlight", {"departure": "St. Petersburg", "destination": "Rockford", "date": "2022-03-16"}
    ).json()["text"]
    assert "[F3573659] $474. Departure: 15:40, Arrival: 17:04" in text


def test_unknown_tool_is_404_with_message(client):
    r = call(client, "BookHotel", {"city": "Rockford"})
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    assert "BookHotel" in r.json()["detail"] and "SearchFlight" in r.json()["detail"]


def test_missing_argument_gets_the_tools_own_text(client):
    r = call(client, "SearchFlight", {"departure": "Rockford"})
    assert r.status_code == 200
    assert r.json()["text"] == "Invalid parameters. Please provide departure, destination and date."
    assert r.json()["ok"] is False


@pytest.mark.parametrize(
    "body",
    [
        {"name": "SearchCity", "arguments": "Illinois"},
        {"name": 7, "arguments": {}},
        {"arguments": {"state": "Illinois"}},
        {"name": "SearchCity", "arguments": {}, "fault_rate": 2},
        {"name": "SearchCity", "arguments": {}, "surprise": True},
        [1, 2, 3],
    ],
)
def test_malformed_envelope_is_422(client, body):
    r = client.post("/tools/call", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["title"] == "Invalid request"


def test_not_json_is_422(client):
    r = client.post("/tools/call", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_a_string_over_the_body_limit_is_413(client):
    from services.common.http import MAX_BODY_BYTES

    r = call(client, "SearchCity", {"state": "x" * (MAX_BODY_BYTES + 1)})
    assert r.status_code == 413 and "limit" in r.json()["detail"]


@pytest.mark.parametrize(
    "value", ["'; DROP TABLE flights; --", "Rock%", "\u202eRockford", "Rock\u00a0ford", "🛫", "rockford", " Rockford"]
)
def test_hostile_strings_find_nothing_and_do_no_harm(client, value):
    r = call(client, "SearchAccommodation", {"city": value})
    assert r.status_code == 200
    assert r.json()["ok"] is False and r.json()["text"].startswith("There is no accommodation in ")
    assert call(client, "SearchAccommodation", {"city": "Rockford"}).json()["ok"] is True


@pytest.mark.parametrize("value", ["Rockford\u0000", "Rock\u0007ford"])
def test_nul_and_control_characters_are_422(client, value):
    r = call(client, "SearchAccommodation", {"city": value})
    assert r.status_code == 422 and ("NUL" in r.text or "control" in r.text)


def test_lone_surrogate_is_handled(client):
    raw = b'{"name": "SearchCity", "arguments": {"state": "\\ud800"}}'
    r = client.post("/tools/call", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "surrogate" in r.text


def test_per_request_faults_are_deterministic_and_counted(client):
    def metric():
        for line in client.get("/metrics").text.splitlines():
            if line.startswith('star_sandbox_tool_faults_injected_total{tool="SearchCity"}'):
                return float(line.split()[-1])
        return 0.0

    before = metric()
    outcomes = []
    for i in range(40):
        r = call(client, "SearchCity", {"state": "Illinois"}, fault_rate=0.5, fault_seed=3, fault_key=f"t/{i}").json()
        outcomes.append(r["fault_injected"])
        if r["fault_injected"]:
            assert r["text"] == "Error: Current tool SearchCity is not available."
    again = [
        call(client, "SearchCity", {"state": "Illinois"}, fault_rate=0.5, fault_seed=3, fault_key=f"t/{i}").json()[
            "fault_injected"
        ]
        for i in range(40)
    ]
    assert outcomes == again
    assert 5 < sum(outcomes) < 35
    assert metric() - before == 2 * sum(outcomes)


def test_run_level_faults_need_the_token(client):
    r = client.put("/faults", json={"rate": 1.0, "seed": 1})
    assert r.status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        assert client.put("/faults", json={"rate": 1.0, "seed": 1}, headers=auth).json()["rate"] == 1.0
        assert call(client, "SearchCity", {"state": "Illinois"}).json()["fault_injected"] is True
        r = client.put("/faults", json={"rate": 0.1, "per_tool": {"NoSuchTool": 0.5}}, headers=auth)
        assert r.status_code == 422 and "NoSuchTool" in r.json()["detail"]
    finally:
        client.put("/faults", json={"rate": 0.0, "seed": 0}, headers=auth)
    assert call(client, "SearchCity", {"state": "Illinois"}).json()["fault_injected"] is False


@pytest.mark.usefixtures("full_travelplanner_dir")
def test_metrics_and_world_info(client):
    call(client, "SearchRestaurant", {"city": "Rockford"})
    text = client.get("/metrics").text
    assert 'star_sandbox_tool_seconds_bucket{le="0.001",tool="SearchRestaurant"}' in text
    info = client.get("/world").json()
    assert info["counts"]["accommodations"] == 4285 and info["meta"]["kind"] == "official"


def test_not_ready_without_a_world(tmp_path):
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'missing.sqlite'}"))
    from fastapi.testclient import TestClient

    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").status_code == 503
        r = c.post("/tools/call", json={"name": "SearchCity", "arguments": {"state": "Illinois"}})
        assert r.status_code == 503 and "star world build" in r.json()["detail"]


@pytest.fixture(scope="module")
def asgi_client(official_world_url):
    from fastapi.testclient import TestClient

    with TestClient(create_app(Settings(db_url=official_world_url))) as c:
        yield c


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(
        [
            "SearchCity",
            "SearchFlight",
            "GoogleDistanceMatrix",
            "SearchAccommodation",
            "SearchRestaurant",
            "SearchAttraction",
            "Nope",
            "",
        ]
    ),
    arguments=json_values,
    dialect=st.sampled_from([None, "star", "official", "klingon"]),
)
def test_fuzzed_bodies_never_5xx(asgi_client, name, arguments, dialect):
    body = {"name": name, "arguments": arguments}
    if dialect is not None:
        body["dialect"] = dialect
    r = asgi_client.post("/tools/call", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code == 200:
        assert isinstance(r.json()["text"], str)


def test_lone_surrogate_in_path_form_is_422(client):
    raw = b'{"city": "\\udfff"}'
    r = client.post("/tools/SearchCity", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "surrogate" in r.text


def test_stale_or_half_built_world_is_refused_with_a_reason(tmp_path):
    from fastapi.testclient import TestClient
    from sqlalchemy import text

    from services.sandbox.world import World
    from services.sandbox.world.build import build_synthetic_world

    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    build_synthetic_world(url, size="tiny")
    assert World(url).problem() is None
    with World(url).engine.begin() as conn:
        conn.execute(text("update world_meta set value = '1' where key = 'schema_version'"))
    with TestClient(create_app(Settings(db_url=url))) as c:
        assert c.get("/readyz").status_code == 503
        r = c.post("/tools/call", json={"name": "SearchCity", "arguments": {"state": "X"}})
        assert r.status_code == 503 and "schema version 1" in r.json()["detail"] and "rebuild" in r.json()["detail"]
    with World(url).engine.begin() as conn:
        conn.execute(text("delete from world_meta"))
    assert "half-built" in World(url).problem()
