"""One retrying POST for the rollout's HTTP clients (the sandbox, chat APIs)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx


def server_fault(reply: httpx.Response) -> bool:
    return reply.status_code >= 500


async def post_retrying(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    *,
    retries: int,
    backoff_s: float,
    transient: Callable[[httpx.Response], bool] = server_fault,
) -> tuple[httpx.Response | None, str]:
    """POST `body` up to `retries` + 1 times, backing off exponentially after a transport error
    or a `transient` reply. Returns the first other reply, or (None, the last failure) when the
    attempts run out; what a final reply means is the caller's to decide."""
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            reply = await client.post(path, json=body)
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
            continue
        if transient(reply):
            last = f"HTTP {reply.status_code}: {reply.text[:300]}"
            continue
        return reply, ""
    return None, last
