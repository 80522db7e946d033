"""services/common: settings, logging, metrics, the Redis helper, HTTP conventions."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest
import redis as redis_lib
from fastapi import Depends

from services.common.http import bearer_auth, create_app
from services.common.logging import JsonFormatter
from services.common.metrics import Metrics
from services.common.redis import EmbeddedRedis, connect_redis
from services.common.settings import Settings


def test_settings_read_star_env(monkeypatch, tmp_path):
    monkeypatch.setenv("STAR_HOME", str(tmp_path))
    monkeypatch.setenv("STAR_FAULT_RATE", "0.25")
    s = Settings()
    assert s.fault_rate == 0.25
    assert s.world_url == f"sqlite:///{tmp_path / 'world.sqlite'}"
    monkeypatch.setenv("STAR_DB_URL", "postgresql+psycopg://u@h/db")
    assert Settings().world_url == "postgresql+psycopg://u@h/db"


def test_settings_reject_bad_values(monkeypatch):
    monkeypatch.setenv("STAR_FAULT_RATE", "1.5")
    with pytest.raises(ValueError):
        Settings()


def test_json_logging_carries_extra_fields():
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(JsonFormatter("sandbox"))
    logger = logging.getLogger("test.json")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.info("tool called", extra={"tool": "SearchCity", "ms": 0.5})
    record = json.loads(buf.getvalue())
    assert record["service"] == "sandbox" and record["msg"] == "tool called"
    assert record["tool"] == "SearchCity" and record["ms"] == 0.5 and record["level"] == "info"


def test_metrics_registries_are_independent():
    a, b = Metrics("x"), Metrics("x")
    a.counter("calls_total", "calls").inc(3)
    b.counter("calls_total", "calls")  # same name in another registry: no duplicate error
    assert b"star_x_calls_total 3.0" in a.render()
    assert b"star_x_calls_total 0.0" in b.render()


def test_embedded_redis_is_a_real_server():
    with EmbeddedRedis() as server:
        client = redis_lib.Redis.from_url(server.url)
        client.xadd("s", {"k": "v"})
        assert client.xlen("s") == 1
        assert client.info("server")["redis_version"].startswith(("6.", "7."))
    with pytest.raises(redis_lib.ConnectionError):
        redis_lib.Redis.from_url(server.url, socket_connect_timeout=0.5).ping()


def test_embedded_redis_aof_survives_restart(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path, appendonly=True) as server:
        port = server.port
        redis_lib.Redis.from_url(server.url).set("k", "kept")
    with EmbeddedRedis(data_dir=tmp_path, port=port, appendonly=True) as server:
        assert redis_lib.Redis.from_url(server.url).get("k") == b"kept"


def test_free_ports_are_bindable_outside_the_kernels_range_and_not_given_twice():
    """Ports the kernel hands to any bind(0) or outgoing connection are not drawn, so a server started on a
    free port a little later does not find it taken by a neighbour (parallel test workers start many)."""
    import socket

    from services.common.redis import _ephemeral_low, free_port

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    if _ephemeral_low() >= 21000:
        assert all(20000 <= p < _ephemeral_low() for p in ports)
    for port in ports[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_processes_given_port_slices_never_draw_the_same_port(monkeypatch):
    from services.common.redis import _PORTS_FROM, _ephemeral_low, _port_slice, free_port

    drawn = {}
    for i in range(3):
        monkeypatch.setenv("STAR_PORT_SLICE", f"{i}/3")
        drawn[i] = {free_port() for _ in range(30)}
        if _ephemeral_low() >= 23000:
            assert {(p - _PORTS_FROM) % 3 for p in drawn[i]} == {i}
    assert not (drawn[0] & drawn[1] or drawn[1] & drawn[2] or drawn[0] & drawn[2])
    for bad in ("", "3/3", "x/2", "1", "-1/2"):
        monkeypatch.setenv("STAR_PORT_SLICE", bad)
        assert _port_slice() == (0, 1)


def test_connect_redis_uses_given_url(redis_server_url):
    client, server = connect_redis(redis_server_url)
    assert server is None and client.ping()


def test_connect_redis_without_url_starts_embedded():
    client, server = connect_redis(None)
    try:
        assert server is not None and client.ping()
    finally:
        server.stop()


@pytest.fixture
def app_client():
    metrics = Metrics("t")
    app = create_app(service="t", title="t", version="0", metrics=metrics, ready=lambda: False, max_body_bytes=1000)

    @app.post("/echo", dependencies=[Depends(bearer_auth("sekret"))])
    async def echo(body: dict) -> dict:
        return body

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("secret internals")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://t")


@pytest.mark.anyio
async def test_http_conventions(app_client):
    async with app_client as c:
        assert (await c.get("/healthz")).json()["status"] == "ok"
        assert (await c.get("/readyz")).status_code == 503
        assert (await c.get("/metrics")).status_code == 200
        r = await c.post("/echo", json={"a": 1})
        assert r.status_code == 401 and r.headers["content-type"] == "application/problem+json"
        auth = {"Authorization": "Bearer sekret"}
        assert (await c.post("/echo", json={"a": 1}, headers=auth)).json() == {"a": 1}
        r = await c.post("/echo", content=b'{"a": "' + b"x" * 5000 + b'"}', headers=auth)
        assert r.status_code == 413 and "1000 bytes" in r.json()["detail"]
        r = await c.post("/echo", content=b"not json", headers={**auth, "content-type": "application/json"})
        assert r.status_code == 422 and r.json()["title"] == "Invalid request"
        r = await c.get("/boom")
        assert r.status_code == 500 and "secret internals" not in r.text and "Traceback" not in r.text


@pytest.fixture
def anyio_backend():
    return "asyncio"
