"""The OpenAI-compatible engine against a real HTTP server speaking the chat-completions API.

The server stands in for a hosted API (the only kind of stand-in allowed): it answers from a
script, fails on request to exercise retries, and records what it was sent.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.common.redis import free_port
from services.common.schemas import SamplingParams
from services.rollout.agent import Agent
from services.rollout.engines.openai_engine import OpenAIEngine
from services.rollout.protocol import format_answer, format_tool_call, tool_response

REPLIES = [format_tool_call("SearchCity", {"state": "Illinois"}), format_answer("Day 1:\nCurrent City: Chicago")]


class ChatServer:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.fail_next = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            if request.headers.get("authorization") != "Bearer sk-test":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            if self.fail_next:
                self.fail_next -= 1
                return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
            self.requests.append(body)
            turn = sum(m["role"] == "assistant" for m in body["messages"])
            text = REPLIES[min(turn, len(REPLIES) - 1)]
            return {
                "id": "x",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            }

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture
def chat_server():
    with ChatServer() as server:
        yield server


def test_text_agent_runs_over_the_chat_api_with_retries(chat_server, tokenizer, local_tools, toolbox):
    chat_server.fail_next = 1
    engine = OpenAIEngine(
        f"http://127.0.0.1:{chat_server.port}/v1", "teacher", api_key="sk-test", backoff_s=0.01, tokenizer=tokenizer
    )
    agent = Agent(engine, local_tools)
    traj = asyncio.run(agent.run("Plan a trip.", SamplingParams(temperature=0.6, seed=2)))
    assert traj.finish_reason == "answer" and traj.tool_calls == 1 and traj.token_ids == []
    second = chat_server.requests[1]
    assert second["model"] == "teacher" and second["temperature"] == 0.6
    assert second["messages"][-1] == {
        "role": "user",
        "content": tool_response(toolbox.call("SearchCity", {"state": "Illinois"}).text),
    }
    assert second["max_tokens"] <= 8192


def test_a_refused_key_is_an_engine_error_with_the_reason(chat_server, tokenizer, local_tools):
    engine = OpenAIEngine(f"http://127.0.0.1:{chat_server.port}/v1", "teacher", api_key="wrong", tokenizer=tokenizer)
    traj = asyncio.run(Agent(engine, local_tools).run("Plan a trip."))
    assert traj.finish_reason == "engine_error" and "401" in traj.error


def test_text_agent_at_the_limit_overwrites_the_last_message_and_scores_the_next_reply(
    chat_server, tokenizer, local_tools
):
    from services.rollout.agent import SUMMARY_REQUEST

    def agent() -> Agent:  # one per event loop: the engine's HTTP client belongs to the loop it started on
        return Agent(
            OpenAIEngine(
                f"http://127.0.0.1:{chat_server.port}/v1",
                "teacher",
                api_key="sk-test",
                backoff_s=0.01,
                tokenizer=tokenizer,
            ),
            local_tools,
        )

    plain = asyncio.run(agent().run("Plan a trip.", SamplingParams(seed=2)))
    chat = [{"role": m["role"], "content": m["content"]} for m in plain.messages[:4]]  # up to the city list
    with_list = agent()._count_chat(chat)
    with_request = agent()._count_chat(chat[:3] + [{"role": "user", "content": SUMMARY_REQUEST}])
    assert with_request < with_list  # the list is longer than the request
    sampling = SamplingParams(seed=2, max_context_tokens=with_request + 1, summarize_at_limit=True)
    chat_server.requests.clear()
    traj = asyncio.run(agent().run("Plan a trip.", sampling))
    # as the reference: the tool response's content became the request, one more call answered it
    assert traj.finish_reason == "answer" and traj.answer == "Day 1:\nCurrent City: Chicago"
    assert traj.timings["summarized_at_limit"] == 1.0
    assert chat_server.requests[-1]["messages"][-1] == {"role": "user", "content": SUMMARY_REQUEST}
    off = asyncio.run(agent().run("Plan a trip.", SamplingParams(seed=2, max_context_tokens=with_request + 1)))
    assert off.finish_reason == "context_limit" and off.answer is None
