"""How the agent reaches the sandbox: over HTTP (production) or a ToolBox in-process (tests, demos).

Both return a `ToolResult` whose text is exactly what the tool prints. The HTTP client retries
transport errors and 5xx answers with backoff; when the sandbox stays unreachable it raises
`ToolServiceError`, which the agent turns into an `engine_error` trajectory (an outage is not the
policy's fault, so it must not be trained on as a failure). `reachable` is the cheap check a rollout
worker makes before it takes a task, so that an outage mostly leaves tasks waiting instead.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import httpx

from services.common.schemas import ToolResult
from services.rollout.protocol import call_error
from services.rollout.retry import post_retrying

READY_TIMEOUT_S = 2.0  # a sandbox slower than this to say it is ready counts as down


class ToolServiceError(RuntimeError):
    """The sandbox could not be reached or kept failing."""


class ToolClient(Protocol):
    async def call(self, name: str, arguments: dict[str, Any], *, fault_key: str | None = None) -> ToolResult: ...

    async def reachable(self) -> bool:
        """Whether the tools can serve calls now: one cheap check, no retries."""
        ...

    async def close(self) -> None: ...


class HttpToolClient:
    """`POST {base_url}/tools/call` with timeouts and retries."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        dialect: str | None = None,
        fault_rate: float | None = None,
        fault_seed: int | None = None,
        max_connections: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.options = {
            k: v
            for k, v in {"dialect": dialect, "fault_rate": fault_rate, "fault_seed": fault_seed}.items()
            if v is not None
        }
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=max_connections),
        )

    async def call(self, name: str, arguments: dict[str, Any], *, fault_key: str | None = None) -> ToolResult:
        body = {"name": name, "arguments": arguments, **self.options}
        if fault_key is not None and "fault_seed" in self.options:
            body["fault_key"] = fault_key[:256]
        reply, last = await post_retrying(
            self._client, "/tools/call", body, retries=self.retries, backoff_s=self.backoff_s
        )
        if reply is None:
            raise ToolServiceError(f"sandbox at {self.base_url} failed {self.retries + 1} times; last: {last}")
        if reply.status_code == 200:
            return ToolResult.model_validate_json(reply.content)
        # 4xx: the call itself is bad (e.g. text that is not valid Unicode); the model is told.
        return ToolResult(name=name, text=call_error(ValueError(_problem_detail(reply))), ok=False)

    async def reachable(self) -> bool:
        """The sandbox answers `GET /readyz` with 200 within `READY_TIMEOUT_S`."""
        try:
            reply = await self._client.get("/readyz", timeout=READY_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def close(self) -> None:
        await self._client.aclose()


def _problem_detail(reply: httpx.Response) -> str:
    try:
        detail = reply.json().get("detail")
    except ValueError:
        return reply.text[:300]
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        return "; ".join(str(d.get("msg", "")) for d in detail)
    return str(detail)


class LocalToolClient:
    """A ToolBox in this process. Calls run on a worker thread: a slow query must not hold the event
    loop, which serves every agent and the health checks."""

    def __init__(
        self,
        toolbox: Any,
        *,
        dialect: str | None = None,
        fault_rate: float | None = None,
        fault_seed: int | None = None,
    ) -> None:
        self.toolbox = toolbox
        self.dialect = dialect
        self.fault_rate = fault_rate
        self.fault_seed = fault_seed

    async def call(self, name: str, arguments: dict[str, Any], *, fault_key: str | None = None) -> ToolResult:
        from services.sandbox.tools.toolbox import BackendError

        try:
            return await asyncio.to_thread(
                self.toolbox.call,
                name,
                arguments,
                dialect=self.dialect,
                fault_rate=self.fault_rate,
                fault_seed=self.fault_seed,
                fault_key=fault_key,
            )
        except BackendError as exc:
            raise ToolServiceError(f"world database: {exc}") from exc

    async def reachable(self) -> bool:
        return True  # in this process

    async def close(self) -> None:
        return None
