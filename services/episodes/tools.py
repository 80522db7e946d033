"""The six tools inside an episode: arguments checked against the tool's schema, then run by the sandbox
service over HTTP (the same text the rollout's agents read)."""

from __future__ import annotations

from typing import Any

import httpx

from services.common.schemas import ToolResult
from services.rollout.retry import post_retrying
from services.sandbox.tools.registry import resolve_tool, tool_names

MAX_ARGUMENT_CHARS = 1000  # a city, a state, a date: nothing legitimate is longer


class BadToolCall(ValueError):
    """A call that names no tool or does not fit its schema (a 422; the tool does not run)."""


class ToolsUnavailable(RuntimeError):
    """The sandbox did not answer, or kept failing (a retryable 503)."""


def check_call(name: str, arguments: dict[str, Any]) -> str:
    """The tool's own name (official names resolve too) when `arguments` fit its schema."""
    spec = resolve_tool(name)
    if spec is None:
        raise BadToolCall(f"unknown tool {name!r}; the tools are {', '.join(tool_names())}")
    accepted = {p.name for p in spec.params} | {a for p in spec.params for a in p.aliases}
    unknown = sorted(set(arguments) - accepted)
    if unknown:
        raise BadToolCall(f"{spec.name} takes {', '.join(p.name for p in spec.params)}; not {', '.join(unknown)}")
    for key, value in arguments.items():
        if not isinstance(value, str):
            raise BadToolCall(f"{spec.name}: argument {key!r} must be a string, got {type(value).__name__}")
        if len(value) > MAX_ARGUMENT_CHARS:
            raise BadToolCall(f"{spec.name}: argument {key!r} is longer than {MAX_ARGUMENT_CHARS} characters")
    given = set(arguments)
    missing = [
        r
        for r in spec.required
        if r not in given and not ({a for p in spec.params if p.name == r for a in p.aliases} & given)
    ]
    if missing:
        raise BadToolCall(f"{spec.name} needs {', '.join(missing)}")
    return spec.name


class SandboxTools:
    """`POST {sandbox}/tools/call`, retrying transport errors and 5xx replies with backoff."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.1,
        max_connections: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=max_connections),
        )

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        reply, last = await post_retrying(
            self._client,
            "/tools/call",
            {"name": name, "arguments": arguments},
            retries=self.retries,
            backoff_s=self.backoff_s,
        )
        if reply is None:
            raise ToolsUnavailable(f"the sandbox did not answer ({last}); retry shortly")
        if reply.status_code != 200:
            raise BadToolCall(f"the sandbox refused the call: {_detail(reply)}")
        return ToolResult.model_validate_json(reply.content)

    async def ready(self) -> bool:
        try:
            return (await self._client.get("/readyz", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        await self._client.aclose()


def _detail(reply: httpx.Response) -> str:
    try:
        detail = reply.json().get("detail")
    except (ValueError, AttributeError):
        return reply.text[:300]
    if isinstance(detail, list):
        return "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail)
    return str(detail)
