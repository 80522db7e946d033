"""The scorer using the formatter service over HTTP (docs/architecture.md: reward workers → formatter), with
the formatter's LLM backend pointed at a real chat-completions server."""

from __future__ import annotations

import json
import time

import pytest

from services.common.schemas import Plan, PlanDay
from services.common.settings import Settings
from services.controller.launcher import ServiceProcess
from services.formatter.core import Formatter, LLMUnavailable, RemoteFormatter
from services.formatter.structured import render_plan
from services.reward.scoring import Scorer, ScoreRequest
from tests.support.fake_openai import FakeOpenAI, Reply


@pytest.fixture(scope="module")
def llm_server():
    with FakeOpenAI() as s:
        yield s


@pytest.fixture(scope="module")
def formatter_url(llm_server, tmp_path_factory):
    env = {
        "STAR_LOG_LEVEL": "WARNING",
        "STAR_FORMATTER_LLM_URL": llm_server.base_url,
        "STAR_FORMATTER_LLM_MODEL": "m",
        "STAR_FORMATTER_MAX_ATTEMPTS": "2",
        "STAR_FORMATTER_URL": "http://127.0.0.1:9",
    }  # the service must not call itself
    proc = ServiceProcess("formatter", "services.formatter.app:create_app", env, tmp_path_factory.mktemp("f")).start()
    yield proc.url
    proc.stop()


def test_prose_goes_to_the_service_and_structured_text_does_not(formatter_url, llm_server, gold, official):
    llm_server.clear()
    remote = Formatter.from_settings(Settings(formatter_url=formatter_url))
    assert isinstance(remote, RemoteFormatter) and remote.blocking
    scorer = Scorer(official, remote)
    plan = [d for d in gold.plan(0) if d]
    llm_server.push(Reply(content="```json\n" + json.dumps(plan) + "\n```"))
    out = scorer.score(ScoreRequest(query=gold.queries[0], plan_text="A nice trip to Rockford, see the flights..."))
    assert out.formatter.status == "ok" and out.formatter.backend == "llm" and out.reward == 5.0
    assert len(llm_server.requests) == 1
    text = render_plan(Plan(days=[PlanDay(**d) for d in plan]))
    out = scorer.score(ScoreRequest(query=gold.queries[0], plan_text=text))
    assert out.formatter.backend == "structured" and out.reward == 5.0 and len(llm_server.requests) == 1
    llm_server.default = Reply(status=500)
    out = scorer.score(ScoreRequest(query=gold.queries[0], plan_text="Another trip, different words."))
    assert out.formatter.status == "llm_error" and out.reward == 0 and "HTTP 500" in out.formatter.error
    llm_server.default = None


def test_service_down_or_without_llm(gold, tmp_path_factory):
    down = RemoteFormatter("http://127.0.0.1:9", timeout_s=2)
    result = down.format("some prose", gold.queries[0], "auto")
    assert result.status == "llm_error" and "cannot reach the formatter service" in result.error
    proc = ServiceProcess(
        "formatter-bare",
        "services.formatter.app:create_app",
        {"STAR_LOG_LEVEL": "WARNING", "STAR_FORMATTER_LLM_URL": ""},
        tmp_path_factory.mktemp("g"),
    ).start()
    try:
        bare = RemoteFormatter(proc.url)
        result = bare.format("some prose", gold.queries[0], "auto")
        assert result.status == "invalid_output" and result.backend == "structured"
        with pytest.raises(LLMUnavailable, match="no LLM formatter is configured"):
            bare.format("some prose", gold.queries[0], "llm")
    finally:
        proc.stop()


def test_batches_format_with_the_llm_in_parallel_and_keep_order(gold, official):
    from services.formatter.llm import LLMFormatter

    plans = {i: [d for d in gold.plan(i) if d] for i in range(4)}
    with FakeOpenAI() as server:
        # Each request names its trip; the reply is that trip's plan, after a delay.
        def reply(body):
            text = body["messages"][-1]["content"]
            i = int(text.rsplit("trip number ", 1)[1].split(".")[0])
            return Reply(content=json.dumps(plans[i]), delay=0.6)

        server.default = reply
        scorer = Scorer(official, Formatter(LLMFormatter(server.base_url, "m", concurrency=4, backoff_s=0)))
        requests = [
            ScoreRequest(query=gold.queries[i], plan_text=f"This is trip number {i}.", backend="llm") for i in range(4)
        ]
        started = time.monotonic()
        out = scorer.score_batch(requests)
        elapsed = time.monotonic() - started
    assert [r.reward for r in out] == [5.0] * 4
    assert [len(r.plan.days) for r in out] == [gold.queries[i].days for i in range(4)]
    assert server.max_in_flight >= 2 and elapsed < 4 * 0.6
