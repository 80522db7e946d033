"""A Python client of the episode API (docs/environments.md): what the adapters and outside trainers call.

    client = EpisodeClient("http://127.0.0.1:8006", token="...")
    episode = client.start(query_id="1", split="train")
    reply = client.call_tool(episode.episode_id, "SearchAccommodation", {"city": "Rockford"})
    result = client.finish(episode.episode_id, answer="Day 1: ...")

Every reply that is not a success raises `EpisodeError` with the HTTP status and the server's message.
A 503 (the sandbox or the scorer is away, or another request is scoring the episode) and a request that
never reached the server are retried, `retries` times, after the server's Retry-After; nothing else is.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from services.common.schemas import (
    EpisodeResult,
    EpisodeStarted,
    EpisodeState,
    EpisodeToolResult,
    TravelQuery,
)

MAX_RETRY_AFTER_S = 10.0


class EpisodeError(RuntimeError):
    """A reply of the episode API that is not a success: `status` (0: no reply), the server's `message`,
    and `retry_after` (seconds) where the server said when to come back."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return self.status in (0, 503)


def start_body(
    query_id: str | None = None, split: str | None = None, query: TravelQuery | dict | None = None, **options: Any
) -> dict[str, Any]:
    """The JSON of `POST /v1/episodes` (options left as None are not sent)."""
    body: dict[str, Any] = {
        "query_id": query_id,
        "split": split,
        "query": query.model_dump(mode="json") if isinstance(query, TravelQuery) else query,
        **options,
    }
    return {k: v for k, v in body.items() if v is not None}


def finish_body(
    plan: Any = None, answer: str | None = None, reward: str | None = None, epoch: int | None = None
) -> dict[str, Any]:
    body = {"plan": plan, "answer": answer, "reward": reward, "epoch": epoch}
    return {k: v for k, v in body.items() if v is not None}


def error_of(reply: httpx.Response) -> EpisodeError:
    """The `EpisodeError` of a problem reply: its detail as one line."""
    try:
        detail: Any = reply.json().get("detail")
    except (ValueError, AttributeError):
        detail = reply.text[:500]
    if isinstance(detail, list):
        detail = "; ".join(
            f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg', '')}" if isinstance(d, dict) else str(d)
            for d in detail
        )
    retry_after = reply.headers.get("retry-after")
    try:
        wait = float(retry_after) if retry_after is not None else None
    except ValueError:
        wait = None
    return EpisodeError(reply.status_code, str(detail or reply.reason_phrase), wait)


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _wait_s(error: EpisodeError, attempt: int) -> float:
    return min(MAX_RETRY_AFTER_S, error.retry_after if error.retry_after is not None else 0.2 * 2**attempt)


class EpisodeClient:
    """Blocking client (httpx). `retries`: how often a 503 or an unsent request is tried again."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 120.0,
        retries: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self._http = httpx.Client(
            base_url=self.base_url, headers=_headers(token), timeout=timeout_s, transport=transport
        )

    def __enter__(self) -> EpisodeClient:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close_client()

    def close_client(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        for attempt in range(self.retries + 1):
            try:
                reply = self._http.request(method, path, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                error = EpisodeError(0, f"episode service at {self.base_url} unreachable: {exc}")
            except httpx.HTTPError as exc:
                raise EpisodeError(0, f"episode service at {self.base_url}: {type(exc).__name__}: {exc}") from None
            else:
                if reply.is_success:
                    return reply.json() if reply.content else None
                error = error_of(reply)
            if not error.retryable or attempt == self.retries:
                raise error
            time.sleep(_wait_s(error, attempt))
        raise AssertionError("unreachable")

    def start(
        self,
        query_id: str | None = None,
        split: str | None = None,
        query: TravelQuery | dict | None = None,
        *,
        reward: str | None = None,
        mode: str | None = None,
        epoch: int | None = None,
        max_tool_calls: int | None = None,
        tool_format: str | None = None,
        client: str | None = None,
    ) -> EpisodeStarted:
        body = start_body(
            query_id,
            split,
            query,
            reward=reward,
            mode=mode,
            epoch=epoch,
            max_tool_calls=max_tool_calls,
            tool_format=tool_format,
            client=client,
        )
        return EpisodeStarted.model_validate(self._request("POST", "/v1/episodes", body))

    def call_tool(self, episode_id: str, name: str, arguments: dict[str, Any] | None = None) -> EpisodeToolResult:
        body = {"name": name, "arguments": arguments or {}}
        return EpisodeToolResult.model_validate(self._request("POST", f"/v1/episodes/{episode_id}/tool_calls", body))

    def finish(
        self,
        episode_id: str,
        plan: Any = None,
        answer: str | None = None,
        reward: str | None = None,
        epoch: int | None = None,
    ) -> EpisodeResult:
        body = finish_body(plan, answer, reward, epoch)
        return EpisodeResult.model_validate(self._request("POST", f"/v1/episodes/{episode_id}/finish", body))

    def state(self, episode_id: str) -> EpisodeState:
        return EpisodeState.model_validate(self._request("GET", f"/v1/episodes/{episode_id}"))

    def close(self, episode_id: str) -> None:
        """End the episode (finished or not); its state is gone afterwards."""
        self._request("DELETE", f"/v1/episodes/{episode_id}")


class AsyncEpisodeClient:
    """The same calls for asyncio trainers (httpx.AsyncClient)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 120.0,
        retries: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=_headers(token),
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections),
        )

    async def __aenter__(self) -> AsyncEpisodeClient:
        return self

    async def __aexit__(self, *_exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        for attempt in range(self.retries + 1):
            try:
                reply = await self._http.request(method, path, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                error = EpisodeError(0, f"episode service at {self.base_url} unreachable: {exc}")
            except httpx.HTTPError as exc:
                raise EpisodeError(0, f"episode service at {self.base_url}: {type(exc).__name__}: {exc}") from None
            else:
                if reply.is_success:
                    return reply.json() if reply.content else None
                error = error_of(reply)
            if not error.retryable or attempt == self.retries:
                raise error
            await asyncio.sleep(_wait_s(error, attempt))
        raise AssertionError("unreachable")

    async def start(
        self,
        query_id: str | None = None,
        split: str | None = None,
        query: TravelQuery | dict | None = None,
        *,
        reward: str | None = None,
        mode: str | None = None,
        epoch: int | None = None,
        max_tool_calls: int | None = None,
        tool_format: str | None = None,
        client: str | None = None,
    ) -> EpisodeStarted:
        body = start_body(
            query_id,
            split,
            query,
            reward=reward,
            mode=mode,
            epoch=epoch,
            max_tool_calls=max_tool_calls,
            tool_format=tool_format,
            client=client,
        )
        return EpisodeStarted.model_validate(await self._request("POST", "/v1/episodes", body))

    async def call_tool(
        self,
        episode_id: str,
        name: str,
        arguments: dict[str, Any] | None = None,
    ) -> EpisodeToolResult:
        body = {"name": name, "arguments": arguments or {}}
        return EpisodeToolResult.model_validate(
            await self._request("POST", f"/v1/episodes/{episode_id}/tool_calls", body)
        )

    async def finish(
        self,
        episode_id: str,
        plan: Any = None,
        answer: str | None = None,
        reward: str | None = None,
        epoch: int | None = None,
    ) -> EpisodeResult:
        body = finish_body(plan, answer, reward, epoch)
        return EpisodeResult.model_validate(await self._request("POST", f"/v1/episodes/{episode_id}/finish", body))

    async def state(self, episode_id: str) -> EpisodeState:
        return EpisodeState.model_validate(await self._request("GET", f"/v1/episodes/{episode_id}"))

    async def close(self, episode_id: str) -> None:
        await self._request("DELETE", f"/v1/episodes/{episode_id}")
