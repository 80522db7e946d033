"""Any OpenAI-compatible chat API (hosted teachers, API baselines, a vLLM server's /v1).

Text only: messages go in, the assistant's text comes out; there are no token ids and no
log-probs, so its trajectories serve evaluation and SFT data, not policy-gradient training.
Transient failures (transport errors, 429, 5xx) are retried with backoff.
"""

from __future__ import annotations

from typing import Any

import httpx

from services.rollout.engines.base import Engine, EngineError, Generation, TurnParams
from services.rollout.retry import post_retrying, server_fault


class OpenAIEngine(Engine):
    name = "openai"
    token_level = False

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        tokenizer: Any = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(tokenizer)
        self.model = model
        self.retries = retries
        self.backoff_s = backoff_s
        self.extra_body = extra_body or {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=httpx.Timeout(timeout_s)
        )

    async def generate_chat(
        self, messages: list[dict[str, str]], params: TurnParams, request_id: str = ""
    ) -> Generation:
        await self._open.wait()
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            **self.extra_body,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        reply, last = await post_retrying(
            self._client,
            "/chat/completions",
            body,
            retries=self.retries,
            backoff_s=self.backoff_s,
            transient=_busy_or_failing,
        )
        if reply is None:
            raise EngineError(f"chat API failed {self.retries + 1} times; last: {last}")
        if reply.status_code != 200:
            raise EngineError(f"chat API refused the request: HTTP {reply.status_code}: {reply.text[:300]}")
        try:
            choice = reply.json()["choices"][0]
            text = choice["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"chat API answered an unexpected body: {exc}") from exc
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return Generation(token_ids=[], logprobs=None, finish=finish, text=text, policy_version=self.policy_version)

    async def close(self) -> None:
        await self._client.aclose()


def _busy_or_failing(reply: httpx.Response) -> bool:
    """Rate limits and server faults pass; any other refusal will not."""
    return reply.status_code == 429 or server_fault(reply)
