"""The LLM backend against a real OpenAI-compatible HTTP server (tests/support/fake_openai.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from services.formatter.core import Formatter, LLMUnavailable
from services.formatter.llm import LLMFormatter, OutputError, cache_key, read_plan_json
from services.formatter.structured import render_plan
from tests.formatter.samples import DAYS, GOOD, PROSE, QUERY
from tests.support.fake_openai import FakeOpenAI, Reply


@pytest.fixture()
def server():
    with FakeOpenAI(api_key="sk-test") as s:
        yield s


def llm(server: FakeOpenAI, **kw) -> LLMFormatter:
    kw = {"max_attempts": 3, "request_timeout_s": 5.0, "deadline_s": 20.0, "backoff_s": 0.01, **kw}
    return LLMFormatter(server.base_url, "fake-model", api_key="sk-test", **kw)


def test_fenced_json_reply_is_a_plan(server):
    server.push(f"Here you go:\n```json\n{GOOD}\n```\nAnything else?")
    out = llm(server).format(QUERY, PROSE)
    assert out.status == "ok" and out.attempts == 1 and not out.cached
    assert [d.model_dump() for d in out.plan.days] == DAYS
    sent = server.requests[0]
    assert sent["model"] == "fake-model" and sent["temperature"] == 0.0
    roles = [m["role"] for m in sent["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    last = sent["messages"][-1]["content"]
    assert PROSE in last and QUERY.query in last and "2022-03-16" in last
    assert "Flight Number: " in last and 'write "-"' in last.lower()


def test_garbage_gets_a_repair_message_then_succeeds(server):
    server.push("I think the plan is great!", GOOD)
    out = llm(server).format(QUERY, PROSE)
    assert out.status == "ok" and out.attempts == 2
    second = server.requests[1]["messages"]
    assert second[-2] == {"role": "assistant", "content": "I think the plan is great!"}
    assert "could not be used: the reply holds no JSON array" in second[-1]["content"]


@pytest.mark.parametrize(
    "reply, why",
    [
        (Reply(content=""), "the reply was empty"),
        (Reply(content=None), "the reply was empty"),
        (Reply(content='[{"day": 1, "current_city": '), "not valid JSON"),
        (Reply(content='[{"day": 1, "transportation": "-"}]'), 'no "current_city"'),
        (Reply(content='[{"day": 1, "current_city": "X", "lunch": ["a"]}]'), '"lunch" is a list'),
        (Reply(content='{"note": 1}'), "a JSON object, not an array of days"),
        (Reply(content="The plan is fine."), "holds no JSON array"),
    ],
)
def test_bad_output_ends_after_the_attempt_budget(server, reply, why):
    server.default = reply  # the same bad reply forever: the client must stop by itself
    out = llm(server, max_attempts=4).format(QUERY, PROSE)
    assert out.status == "invalid_output" and out.plan is None
    assert out.attempts == 4 and len(server.requests) == 4
    assert why in out.error


def test_server_errors_are_retried_then_reported(server):
    server.push(Reply(status=500, error="upstream exploded"), GOOD)
    assert llm(server).format(QUERY, PROSE).status == "ok"
    server.clear()
    server.default = Reply(status=503, error="overloaded")
    out = llm(server).format(QUERY, PROSE + " (again)")
    assert out.status == "llm_error" and out.attempts == 3 and len(server.requests) == 3
    assert "HTTP 503: overloaded" in out.error


def test_wrong_key_and_non_completion_bodies_are_llm_errors(server):
    bad_key = LLMFormatter(server.base_url, "fake-model", api_key="wrong", max_attempts=2, backoff_s=0)
    out = bad_key.format(QUERY, PROSE)
    assert out.status == "llm_error" and "HTTP 401: invalid api key" in out.error
    server.default = Reply(raw='{"choices": []}')
    out = llm(server, max_attempts=2).format(QUERY, PROSE)
    assert out.status == "llm_error" and "not a chat completion" in out.error


def test_unreachable_api_is_an_llm_error():
    out = LLMFormatter("http://127.0.0.1:9/v1", "m", max_attempts=2, backoff_s=0).format(QUERY, PROSE)
    assert out.status == "llm_error" and "cannot reach" in out.error and out.attempts == 2


def test_slow_replies_time_out(server):
    server.default = Reply(content=GOOD, delay=1.0)
    started = time.monotonic()
    out = llm(server, request_timeout_s=0.2, max_attempts=2).format(QUERY, PROSE)
    assert out.status == "timeout" and out.attempts == 2
    assert time.monotonic() - started < 1.5


def test_the_deadline_bounds_the_whole_call(server):
    server.default = Reply(content="no json here", delay=0.3)
    started = time.monotonic()
    out = llm(server, max_attempts=20, deadline_s=0.8).format(QUERY, PROSE)
    assert out.status in ("timeout", "invalid_output") and out.attempts < 20
    assert time.monotonic() - started < 1.6


def test_empty_array_means_no_plan(server):
    server.push("[]")
    out = llm(server).format(QUERY, PROSE)
    assert out.status == "no_plan" and out.plan is None


def test_results_are_cached_by_content(server):
    server.push(GOOD, GOOD)
    f = llm(server)
    first, again = f.format(QUERY, PROSE), f.format(QUERY, PROSE)
    assert again.cached and again.plan == first.plan and len(server.requests) == 1
    f.format(QUERY, PROSE + " ")  # other text: another call
    assert len(server.requests) == 2
    assert cache_key(QUERY, PROSE, "a") != cache_key(QUERY, PROSE, "b")
    assert cache_key(QUERY, PROSE, "a") != cache_key(None, PROSE, "a")


def test_failures_are_not_cached(server):
    server.push(Reply(status=500), GOOD)
    f = llm(server, max_attempts=1)
    assert f.format(QUERY, PROSE).status == "llm_error"
    assert f.format(QUERY, PROSE).status == "ok"


def test_concurrency_is_limited(server):
    server.default = Reply(content=GOOD, delay=0.3)
    f = llm(server, concurrency=2, cache_size=0)
    threads = [threading.Thread(target=f.format, args=(QUERY, f"{PROSE} #{i}")) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(server.requests) == 6
    assert server.max_in_flight == 2


def test_read_plan_json_contract():
    assert read_plan_json('{"plan": ' + GOOD + "}").days[2].current_city == "from Chicago to Sarasota"
    plan = read_plan_json('[{"day": 7, "current_city": "X", "breakfast": null, "lunch": 12}, {}]')
    assert plan.days[0].day == 1 and plan.days[0].breakfast == "-" and plan.days[0].lunch == "12"
    with pytest.raises(OutputError, match="not a day object"):
        read_plan_json("[1, 2]")


# --- the backend choice ----------------------------------------------------------------------


def test_auto_uses_the_parser_first_and_the_llm_for_prose(server):
    fmt = Formatter(llm(server))
    structured = render_plan(read_plan_json(GOOD))
    out = fmt.format(structured, QUERY, "auto")
    assert out.status == "ok" and out.backend == "structured" and not server.requests
    server.push(GOOD)
    out = fmt.format(PROSE, QUERY, "auto")
    assert out.status == "ok" and out.backend == "llm" and len(server.requests) == 1


def test_skip_rules_never_call_the_llm(server):
    fmt = Formatter(llm(server))
    assert fmt.format("Sorry. Answer NOT found.", QUERY, "llm").status == "no_plan"
    assert fmt.format("  \n", QUERY, "llm").status == "empty_answer"
    assert fmt.format(None, QUERY, "auto").status == "empty_answer"
    assert not server.requests


def test_structured_backend_reports_parse_errors_and_llm_needs_configuration():
    fmt = Formatter(None)
    out = fmt.format(PROSE, QUERY, "structured")
    assert out.status == "invalid_output" and "not a structured plan" in out.error
    assert fmt.format(PROSE, QUERY, "auto").status == "invalid_output"  # no LLM: the parser's verdict
    with pytest.raises(LLMUnavailable, match="STAR_FORMATTER_LLM_URL"):
        fmt.format(PROSE, QUERY, "llm")
    with pytest.raises(ValueError, match="unknown formatter backend"):
        fmt.format(PROSE, QUERY, "magic")  # type: ignore[arg-type]


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda c: (
        st.lists(c, max_size=4)
        | st.dictionaries(st.sampled_from(["day", "current_city", "lunch", "plan", "days", "x"]), c, max_size=4)
    ),
    max_leaves=15,
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=200),
        _json_values.map(json.dumps),
        _json_values.map(lambda v: f"```json\n{json.dumps(v)}\n```"),
    )
)
def test_any_reply_is_a_plan_or_an_output_error(content):
    try:
        plan = read_plan_json(content)
    except OutputError as exc:
        assert str(exc)
    else:
        assert plan is None or all(d.current_city for d in plan.days)


def test_names_keep_their_inner_whitespace(server):
    """Real names hold double spaces ("Affordable  Brooklyn Studio"); the sandbox matches them only
    as written, so the formatter must not collapse them."""
    days = json.loads(GOOD)
    days[0]["accommodation"] = "Cozy  Room in  Wicker Park, Chicago"
    days[1]["breakfast"] = "  Dial A  Cake, Chicago\n"
    server.push(json.dumps(days))
    out = llm(server).format(QUERY, PROSE)
    assert out.status == "ok"
    assert out.plan.days[0].accommodation == "Cozy  Room in  Wicker Park, Chicago"
    assert out.plan.days[1].breakfast == "Dial A  Cake, Chicago"
