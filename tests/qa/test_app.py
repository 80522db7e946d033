"""The Search tool set over real HTTP (uvicorn child process): same text as in-process, the
sandbox's ToolResult shape, clear 4xx for bad input."""

from __future__ import annotations

import httpx
import pytest

from services.common.settings import Settings
from services.controller.launcher import ServiceProcess
from services.qa.tools import SearchToolSet


@pytest.fixture(scope="module")
def server(index_dir, tmp_path_factory):
    env = {"STAR_QA_INDEX": str(index_dir), "STAR_QA_TOP_K": "2", "STAR_LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
    proc = ServiceProcess("qa", "services.qa.app:create_app", env, tmp_path_factory.mktemp("logs")).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def test_tools_call_matches_in_process(client, index):
    reply = client.post("/tools/call", json={"name": "Search", "arguments": {"query": "Who created Python?"}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) >= {"name", "text", "ok", "fault_injected", "elapsed_ms"}
    assert body["ok"] is True
    assert body["text"] == SearchToolSet(index, top_k=2).call("Search", {"query": "Who created Python?"}).text
    assert body["text"].startswith("Doc 1(Title: Python (programming language))")


def test_search_endpoint_hits(client):
    body = client.post("/search", json={"query": "highest mountain in Africa", "top_k": 3}).json()
    assert [h["id"] for h in body["hits"]][0] == "p-kilimanjaro"
    assert len(body["hits"]) == 3 and body["hits"][0]["score"] >= body["hits"][1]["score"]
    assert body["text"].count("Doc ") == 3


def test_tool_schemas(client):
    [schema] = client.get("/tools").json()
    assert schema["function"]["name"] == "Search"
    assert schema["function"]["parameters"]["required"] == ["query"]


@pytest.mark.parametrize(
    "path,payload,status,needle",
    [
        ("/tools/call", {"name": "SearchFlight", "arguments": {}}, 404, "unknown tool"),
        ("/search", {"query": ""}, 422, "query"),
        ("/search", {"query": "   "}, 422, "blank"),
        ("/search", {"query": "x", "top_k": 0}, 422, "top_k"),
        ("/search", {"query": "x", "extra": 1}, 422, "extra"),
        ("/search", {"query": "x" * 1001}, 422, "query"),
    ],
)
def test_bad_requests_are_problems(client, path, payload, status, needle):
    reply = client.post(path, json=payload)
    assert reply.status_code == status
    assert reply.headers["content-type"].startswith("application/problem+json")
    assert needle in reply.text


def test_bad_arguments_come_back_as_tool_text(client):
    body = client.post("/tools/call", json={"name": "Search", "arguments": {"query": 7}}).json()
    assert body["ok"] is False and "non-empty 'query'" in body["text"]


def test_missing_index_is_503(tmp_path):
    from fastapi.testclient import TestClient

    from services.qa.app import create_app

    app = create_app(Settings(qa_index=tmp_path / "nothing", log_json=False))
    with TestClient(app) as c:
        reply = c.post("/search", json={"query": "x"})
        assert reply.status_code == 503 and "star qa index" in reply.json()["detail"]
        assert c.get("/readyz").status_code == 503


def test_search_agent_loop_over_http(server):
    """The rollout's agent loop with the search prompt, `Search` over HTTP, a scripted policy that
    searches the question and answers with the top passage's title."""
    import re

    from services.common.schemas import SamplingParams
    from services.models import qwen_tokenizer
    from services.qa.agent import qa_agent
    from services.qa.datasets import QAItem
    from services.qa.evaluate import evaluate_qa
    from services.rollout.engines.scripted import ScriptedEngine
    from services.rollout.protocol import format_answer, format_tool_call
    from services.rollout.tools import HttpToolClient
    from tests.qa.conftest import QUESTIONS

    tokenizer = qwen_tokenizer()

    def script(prompt_ids, turn):
        prompt = tokenizer.decode(prompt_ids)
        if turn == 0:
            question = re.findall(r"Question: (.*)", prompt)[-1].strip()
            return format_tool_call("Search", {"query": question}, think="look it up")
        title = re.findall(r"Doc 1\(Title: (.*?)\) ", prompt)[-1]
        return format_answer(title, think="the top passage says")

    answer, close = qa_agent(ScriptedEngine(tokenizer, script), HttpToolClient(server.url), SamplingParams())
    try:
        items = [QAItem("nq", str(i), q, tuple(a)) for i, (q, _, a) in enumerate(QUESTIONS)]
        table, rows = evaluate_qa(items, agent=answer, progress=False)
    finally:
        close()
    assert [r["prediction"] for r in rows][:2] == ["Penicillin", "Mount Kilimanjaro"]
    assert table.rows[0].em == pytest.approx(100 / 8)  # only the mountain's title is its answer
