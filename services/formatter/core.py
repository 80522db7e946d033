"""Plan text → `Plan`, through one of two backends, with one status vocabulary.

Backends:
- `structured`: the exact parser of the day-by-day form (`structured.parse_plan`); no LLM.
- `llm`: an OpenAI-compatible chat API with our extraction prompt (`llm.LLMFormatter`).
- `auto`: structured first; the LLM only when the text is not in the structured form (and an LLM
  is configured).

Statuses (`FormatResult.status`): ok | empty_answer (no text) | no_plan (the agent said "answer
not found", or the LLM found no plan) | invalid_output (the text, or the LLM's reply, is not a
plan) | llm_error (the API failed) | timeout (the API did not answer in time). Only `ok` carries
a plan; every other status scores 0 reward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from services.common.schemas import Plan, TravelQuery
from services.common.settings import Settings
from services.formatter.llm import LLMFormatter
from services.formatter.structured import PlanTextError, parse_plan

Backend = Literal["structured", "llm", "auto"]
BACKENDS: tuple[str, ...] = ("structured", "llm", "auto")
STATUSES = ("ok", "empty_answer", "no_plan", "invalid_output", "llm_error", "timeout")

# The official formatter's skip rule (agent-star.md §4.3): such an answer is an empty plan.
_NOT_FOUND = re.compile(r"answer\s+not\s+found", re.IGNORECASE)


class LLMUnavailable(RuntimeError):
    """The LLM backend was asked for, but none is configured."""


@dataclass
class FormatResult:
    status: str
    backend: str  # the backend that produced this result ("rule" for the skip rules)
    plan: Plan | None = None
    error: str | None = None
    attempts: int = 0
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Formatter:
    def __init__(self, llm: LLMFormatter | None = None) -> None:
        self.llm = llm

    @classmethod
    def from_settings(cls, settings: Settings, *, remote: bool = True) -> Formatter:
        """The formatter service (STAR_FORMATTER_URL, when `remote`) so that its LLM cache is shared
        by every scorer; else a direct LLM client when STAR_FORMATTER_LLM_URL is set; else the
        structured parser alone. The formatter service itself passes remote=False."""
        if remote and settings.formatter_url:
            return RemoteFormatter(settings.formatter_url, timeout_s=settings.formatter_deadline_s + 5)
        if not settings.formatter_llm_url:
            return cls(None)
        return cls(
            LLMFormatter(
                # Compose passes unset variables as empty strings: an empty model or key means the default.
                settings.formatter_llm_url,
                settings.formatter_llm_model or "deepseek-chat",
                api_key=settings.formatter_llm_api_key or None,
                max_attempts=settings.formatter_max_attempts,
                request_timeout_s=settings.formatter_timeout_s,
                deadline_s=settings.formatter_deadline_s,
                concurrency=settings.formatter_concurrency,
                cache_size=settings.formatter_cache_size,
            )
        )

    @property
    def blocking(self) -> bool:
        """Whether a call may wait on the network (callers then run it off the event loop)."""
        return self.llm is not None

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()

    def format(
        self, plan_text: str | None, query: TravelQuery | None = None, backend: Backend = "auto"
    ) -> FormatResult:
        """The plan in `plan_text`. Raises `LLMUnavailable` only for backend="llm" without an LLM;
        `ValueError` for an unknown backend. Every other outcome is a status."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown formatter backend {backend!r} (use {', '.join(BACKENDS)})")
        if backend == "llm" and self.llm is None:
            raise LLMUnavailable(
                "no LLM formatter is configured (set STAR_FORMATTER_LLM_URL and STAR_FORMATTER_LLM_MODEL)"
            )
        if plan_text is None or not plan_text.strip():
            return FormatResult("empty_answer", "rule", error="the answer is empty")
        if _NOT_FOUND.search(plan_text):
            return FormatResult("no_plan", "rule", error="the answer says 'answer not found'")
        if backend in ("structured", "auto"):
            result = self._structured(plan_text, query)
            if result.ok or backend == "structured" or self.llm is None:
                return result
        assert self.llm is not None
        out = self.llm.format(query, plan_text)
        return FormatResult(out.status, "llm", out.plan, out.error, out.attempts, out.cached)

    @staticmethod
    def _structured(plan_text: str, query: TravelQuery | None) -> FormatResult:
        try:
            plan = parse_plan(plan_text, days=query.days if query is not None else None)
        except PlanTextError as exc:
            return FormatResult("invalid_output", "structured", error=f"not a structured plan: {exc}")
        return FormatResult("ok", "structured", plan)


class RemoteFormatter(Formatter):
    """The formatter service over HTTP (reward workers → formatter, docs/architecture.md). The structured
    parser still runs in-process (no round trip for the common case); only text the parser cannot
    read, or backend="llm", goes to the service."""

    def __init__(self, base_url: str, *, timeout_s: float = 185.0) -> None:
        import httpx

        super().__init__(None)
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    @property
    def blocking(self) -> bool:
        return True

    def close(self) -> None:
        self._http.close()

    def format(
        self, plan_text: str | None, query: TravelQuery | None = None, backend: Backend = "auto"
    ) -> FormatResult:
        import httpx

        if backend not in BACKENDS:
            raise ValueError(f"unknown formatter backend {backend!r} (use {', '.join(BACKENDS)})")
        if plan_text is None or not plan_text.strip():
            return FormatResult("empty_answer", "rule", error="the answer is empty")
        if _NOT_FOUND.search(plan_text):
            return FormatResult("no_plan", "rule", error="the answer says 'answer not found'")
        if backend in ("structured", "auto"):
            local = self._structured(plan_text, query)
            if local.ok or backend == "structured":
                return local
        body = {
            "plan_text": plan_text,
            "backend": "llm",
            "query": query.model_dump(mode="json") if query is not None else None,
        }
        try:
            response = self._http.post("/format", json=body)
        except httpx.TimeoutException:
            return FormatResult(
                "timeout", "llm", error=f"the formatter service at {self.base_url} did not answer in time"
            )
        except httpx.HTTPError as exc:
            return FormatResult(
                "llm_error", "llm", error=f"cannot reach the formatter service at {self.base_url}: {exc}"
            )
        if response.status_code == 503:
            detail = _detail(response)
            if "no llm formatter is configured" in detail.lower():
                if backend == "auto":
                    return local  # the service has no LLM either: the parser's verdict stands
                raise LLMUnavailable(f"the formatter service at {self.base_url}: {detail}")
            return FormatResult("llm_error", "llm", error=f"formatter service: {detail}")
        if response.status_code != 200:
            return FormatResult(
                "llm_error", "llm", error=f"formatter service answered {response.status_code}: {_detail(response)}"
            )
        data = response.json()
        plan = Plan(**data["plan"]) if data.get("plan") else None
        return FormatResult(
            data["status"],
            data.get("backend", "llm"),
            plan,
            data.get("error"),
            data.get("attempts", 0),
            data.get("cached", False),
        )


def _detail(response) -> str:
    try:
        body = response.json()
        return str(body.get("detail") or body.get("title") or body)[:300]
    except ValueError:
        return response.text[:300]
