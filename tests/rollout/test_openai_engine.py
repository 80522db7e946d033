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

from services.common.schemas import SamplingParams
from services.embedded import free_port
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
            return {"id": "x", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}

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
    engine = OpenAIEngine(f"http://127.0.0.1:{chat_server.port}/v1", "teacher", api_key="sk-test", backoff_s=0.01,
                          tokenizer=tokenizer)
    agent = Agent(engine, local_tools)
    traj = asyncio.run(agent.run("Plan a trip.", SamplingParams(temperature=0.6, seed=2)))
    assert traj.finish_reason == "answer" and traj.tool_calls == 1 and traj.token_ids == []
    second = chat_server.requests[1]
    assert second["model"] == "teacher" and second["temperature"] == 0.6
    assert second["messages"][-1] == {"role": "user",
                                      "content": tool_response(toolbox.call("SearchCity", {"state": "Illinois"}).text)}
    assert second["max_tokens"] <= 8192


def test_a_refused_key_is_an_engine_error_with_the_reason(chat_server, tokenizer, local_tools):
    engine = OpenAIEngine(f"http://127.0.0.1:{chat_server.port}/v1", "teacher", api_key="wrong", tokenizer=tokenizer)
    traj = asyncio.run(Agent(engine, local_tools).run("Plan a trip."))
    assert traj.finish_reason == "engine_error" and "401" in traj.error
