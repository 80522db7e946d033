"""The HTTP layer every service shares: hostile input is a problem+json 4xx naming the problem,
unknown routes and methods too, the OpenAPI document describes those replies, and slow work runs
off the event loop under a time limit while /healthz keeps answering."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from fastapi import Depends
from pydantic import BaseModel

from services.common.http import (
    MAX_BATCH_ITEMS,
    MAX_JSON_DEPTH,
    Worker,
    bearer_auth,
    create_app,
)
from services.common.metrics import Metrics


class Echo(BaseModel):
    text: str = ""
    items: list = []


def make_app():
    app = create_app(service="t", title="t", version="0", metrics=Metrics("guards"), ready=lambda: True)
    worker = Worker(threads=2, time_limit_s=1.0)
    stop = threading.Event()

    @app.post("/echo")
    async def echo(body: Echo) -> dict:
        return {"text": body.text}

    @app.post("/admin", dependencies=[Depends(bearer_auth("s3cret"))])
    async def admin() -> dict:
        return {"ok": True}

    @app.post("/slow")
    async def slow(seconds: float = 0.2) -> dict:
        def work(deadline) -> float:
            started = time.monotonic()
            while time.monotonic() - started < seconds:  # busy CPU work that checks its deadline
                deadline.check()
                sum(range(10_000))
            return seconds

        return {"slept": await worker.run(work, deadline=True)}

    app.state.stop = stop
    return app


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The app in its own uvicorn process, as services run."""
    from services.controller.launcher import ServiceProcess

    proc = ServiceProcess(
        "guards",
        "tests.common.test_http_guards:make_app",
        {"STAR_LOG_LEVEL": "WARNING"},
        tmp_path_factory.mktemp("logs"),
    ).start()
    yield proc.url
    proc.stop()


def post_raw(url: str, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json", **headers})


def assert_problem(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert body["status"] == status and body["title"]
    assert needle in str(body.get("detail")), body


@pytest.mark.parametrize(
    "body, needle",
    [
        (rb'{"text": "a\ud800b"}', "surrogate"),
        (rb'{"text": "a\u0000b"}', "NUL"),
        (rb'{"text": "bell\u0007"}', "control characters"),
        (rb'{"text": "x", "items": [{"k\u0001": 1}]}', "control characters"),
        (b'{"text": "x", "items": ' + b"[" * (MAX_JSON_DEPTH + 5) + b"]" * (MAX_JSON_DEPTH + 5) + b"}", "nests more"),
        (b"[" * 5000 + b"]" * 5000, "JSON decode error"),
        (b'{"text": NaN}', "JSON decode error"),
        (b'{"text": 5}', "valid string"),
        (b'{"text": "x"', "JSON decode error"),
    ],
)
def test_hostile_json_is_a_422_problem(url, body, needle):
    assert_problem(post_raw(url, "/echo", body), 422, needle)


def test_text_keeps_tabs_newlines_and_any_language(url):
    r = post_raw(url, "/echo", '{"text": "Day 1:\\n\\tCafé  東京\\r\\n"}'.encode())
    assert r.status_code == 200 and r.json()["text"] == "Day 1:\n\tCafé  東京\r\n"


def test_unknown_routes_and_methods_are_problems(url):
    assert_problem(httpx.get(f"{url}/nowhere"), 404, "Not Found")
    r = httpx.get(f"{url}/echo")
    assert_problem(r, 405, "Method Not Allowed")
    assert "POST" in r.headers.get("allow", "")


@pytest.mark.parametrize("header", [b"Bearer \xc3\xa9t\xc3\xa9", b"Bearer \xff\xfe", b"Bearer \x80\x81", b"Basic abc"])
def test_odd_bearer_tokens_are_401(url, header):
    r = httpx.post(f"{url}/admin", headers=[(b"authorization", header)])
    assert r.status_code in (401, 403), r.text
    assert r.headers["content-type"].startswith("application/problem+json")


def test_the_right_token_passes(url):
    assert httpx.post(f"{url}/admin", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_openapi_describes_problem_replies_with_examples(url):
    spec = httpx.get(f"{url}/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert "Problem" in schemas and "HTTPValidationError" not in schemas
    for path, method in (("/echo", "post"), ("/admin", "post"), ("/slow", "post")):
        responses = spec["paths"][path][method]["responses"]
        for code in ("413", "422"):
            content = responses[code]["content"]["application/problem+json"]
            assert content["schema"] == {"$ref": "#/components/schemas/Problem"} and content["example"][
                "status"
            ] == int(code)


def test_slow_work_runs_off_the_loop_under_a_time_limit(url):
    """While CPU-bound requests run, /healthz answers quickly; past the limit the reply is 503."""
    results: list[httpx.Response] = []

    def slow(seconds: float) -> None:
        results.append(httpx.post(f"{url}/slow", params={"seconds": seconds}, timeout=10))

    threads = [threading.Thread(target=slow, args=(0.3,)), threading.Thread(target=slow, args=(3.0,))]
    for t in threads:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in threads):
        started = time.monotonic()
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.02)
    for t in threads:
        t.join()
    print(f"worst /healthz {worst:.3f} s")
    assert worst < 1.0, f"/healthz took {worst:.2f} s while work ran"
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200, 503], statuses
    timed_out = next(r for r in results if r.status_code == 503)
    assert "time limit" in timed_out.json()["detail"] and timed_out.headers.get("retry-after")


def test_one_batch_limit_for_every_service():
    from services.reward.scoring import MAX_BATCH, MAX_EVALUATE

    assert MAX_BATCH == MAX_EVALUATE == MAX_BATCH_ITEMS


def test_large_bodies_are_checked_too(url):
    """Bodies past 256 KiB are parsed in a thread; the same checks apply."""
    items = ",".join(['"ok"'] * 60_000)
    assert post_raw(url, "/echo", f'{{"text": "x", "items": [{items}]}}'.encode()).status_code == 200
    bad = f'{{"text": "x", "items": [{items}, "\\u0000"]}}'.encode()
    assert len(bad) > 256 * 1024
    assert_problem(post_raw(url, "/echo", bad), 422, "NUL")


def test_work_that_cannot_stop_still_gets_its_reply_at_the_limit():
    """A call without a deadline (one plan, say) that runs past the limit: the 503 goes out at
    the limit, not when the call finally ends."""
    import asyncio

    from fastapi import HTTPException

    worker = Worker(threads=1, time_limit_s=0.3)

    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(HTTPException) as caught:
            await worker.run(time.sleep, 2.0)
        assert caught.value.status_code == 503
        return time.monotonic() - started

    assert asyncio.run(main()) < 1.5
