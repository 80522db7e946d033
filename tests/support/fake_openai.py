"""A real HTTP server speaking the OpenAI chat-completions API, with scripted replies.

For testing clients of hosted LLM APIs (formatter, synthesis, any OpenAI backend) without the
hosted service: requests travel over TCP through uvicorn, as they would to OpenAI or vLLM.

    with FakeOpenAI() as server:
        server.push(Reply("[...]"), Reply(status=500), Reply(content="", delay=2.0))
        client = MyClient(base_url=server.base_url)        # http://127.0.0.1:<port>/v1
        ...
        assert len(server.requests) == 3

What a reply can be: content text (fences, garbage, the empty string), a JSON-level `null`
content, an HTTP status with an error body, a delay before answering (to trip timeouts), or a
raw body that is not JSON at all. When the queue is empty, `default` answers (a function of the
request, or a fixed `Reply`); with neither, the server answers 503 "script exhausted", so a
client that retries forever shows up as a test failure instead of a hang.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

_UNSET = object()


@dataclass
class Reply:
    """One scripted answer. `content=None` sends JSON null as the message content."""

    content: str | None = "[]"
    status: int = 200
    delay: float = 0.0
    raw: str | None = None  # sent verbatim instead of a chat-completion body
    finish_reason: str = "stop"
    error: str = "scripted failure"
    headers: dict[str, str] = field(default_factory=dict)


ReplyFn = Callable[[dict[str, Any]], "Reply | str"]


class FakeOpenAI:
    """The server, run in a background thread on a free port of 127.0.0.1."""

    def __init__(
        self, default: Reply | ReplyFn | None = None, *, model: str = "fake-model", api_key: str | None = None
    ) -> None:
        self.model = model
        self.api_key = api_key
        self.default = default
        self.requests: list[dict[str, Any]] = []  # every chat request body, in arrival order
        self._queue: deque[Reply | str] = deque()
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.in_flight = 0
        self.max_in_flight = 0  # the most chat requests the server held at once

    # -- scripting ----------------------------------------------------------------------------

    def push(self, *replies: Reply | str) -> FakeOpenAI:
        """Queue replies; a plain string is a 200 reply with that content."""
        with self._lock:
            self._queue.extend(replies)
        return self

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
            self.requests.clear()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _next(self, body: dict[str, Any]) -> Reply | None:
        with self._lock:
            self.requests.append(body)
            item: Any = self._queue.popleft() if self._queue else _UNSET
        if item is _UNSET:
            if self.default is None:
                return None
            item = self.default(body) if callable(self.default) else self.default
        return Reply(content=item) if isinstance(item, str) else item

    # -- the API ------------------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI(title="fake OpenAI")

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "tests"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return _error(401, "invalid api key", "authentication_error")
            try:
                body = await request.json()
            except ValueError:
                return _error(400, "body is not JSON", "invalid_request_error")
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                return _error(400, "'messages' must be a list", "invalid_request_error")
            reply = self._next(body)
            if reply is None:
                return _error(503, "script exhausted: no reply queued", "server_error")
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if reply.delay:
                    await asyncio.sleep(reply.delay)
            finally:
                with self._lock:
                    self.in_flight -= 1
            if reply.raw is not None:
                return Response(
                    reply.raw, status_code=reply.status, media_type="application/json", headers=reply.headers
                )
            if reply.status != 200:
                return _error(reply.status, reply.error, "server_error", reply.headers)
            return JSONResponse(self._completion(body, reply), headers=reply.headers)

        return app

    def _completion(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        prompt_chars = sum(len(str(m.get("content") or "")) for m in body["messages"] if isinstance(m, dict))
        out_chars = len(reply.content or "")
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": reply.finish_reason,
                    "message": {"role": "assistant", "content": reply.content},
                }
            ],
            "usage": {
                "prompt_tokens": prompt_chars // 4,
                "completion_tokens": out_chars // 4,
                "total_tokens": (prompt_chars + out_chars) // 4,
            },
        }

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> FakeOpenAI:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status, headers=headers
    )
