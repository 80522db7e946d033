"""The LLM backend: any OpenAI-compatible chat-completions API turns free text into a plan.

What the public STAR formatter gets wrong, and what this one does instead (agent-star.md §4.3):
- every failure path counts against a fixed attempt budget (an empty reply included), and a
  wall-clock deadline bounds the whole call, so it cannot loop forever;
- a reply we cannot use is answered with a repair message saying what was wrong, in the same
  conversation, instead of re-asking blindly;
- the result is cached by a content hash of (query, plan text, model, prompt version), so a
  repeated answer costs no call;
- at most `concurrency` requests are in flight per process (RL fans out 256 answers a step);
- every outcome has a status: ok | no_plan | llm_error | invalid_output | timeout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import ValidationError

from services.common.schemas import Plan, PlanDay, TravelQuery
from services.formatter import prompt

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)
_DAY_KEYS = ("current_city", "transportation", "breakfast", "attraction", "lunch", "dinner", "accommodation")


@dataclass
class LLMResult:
    status: str  # ok | no_plan | llm_error | invalid_output | timeout
    plan: Plan | None = None
    error: str | None = None
    attempts: int = 0
    cached: bool = False
    elapsed_s: float = 0.0
    history: list[str] = field(default_factory=list)  # one line per failed attempt


class OutputError(ValueError):
    """The model's reply is not a usable plan; the message becomes the repair instruction."""


def read_plan_json(content: str | None) -> Plan | None:
    """The plan in a model reply (fenced or bare JSON). None means the model said there is no
    plan (an empty array). Raises `OutputError` saying what is wrong."""
    if content is None or not content.strip():
        raise OutputError("the reply was empty")
    text = content.strip()
    fenced = _FENCE.search(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text.startswith(("[", "{")):
        start, end = text.find("["), text.rfind("]")
        if start < 0 or end < start:
            raise OutputError("the reply holds no JSON array")
        text = text[start : end + 1]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OutputError(f"the reply is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if isinstance(value, dict):
        inner = value.get("plan", value.get("days"))
        if not isinstance(inner, list):
            raise OutputError("the reply is a JSON object, not an array of days")
        value = inner
    if not isinstance(value, list):
        raise OutputError(f"the reply is a JSON {type(value).__name__}, not an array of days")
    days = [d for d in value if d != {}]
    if not days:
        return None
    return Plan(days=[_day(d, i) for i, d in enumerate(days, 1)])


def _day(raw: Any, number: int) -> PlanDay:
    if not isinstance(raw, dict):
        raise OutputError(f"item {number} of the array is a {type(raw).__name__}, not a day object")
    if "current_city" not in raw:
        raise OutputError(f'day {number} has no "current_city"')
    fields: dict[str, Any] = {"day": number}
    for key in _DAY_KEYS:
        value = raw.get(key, "-")
        if value is None:
            value = "-"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise OutputError(f'day {number} "{key}" is a {type(value).__name__}, not a string')
        fields[key] = _as_written(value)
    try:
        return PlanDay(**fields)
    except ValidationError as exc:  # pragma: no cover - every field is a string by now
        raise OutputError(f"day {number} is not a plan day: {exc.errors()[0]['msg']}") from None


def _as_written(value: str) -> str:
    """A field as the tools wrote it: only line breaks (not part of any name) become spaces and the
    ends are trimmed. Inner whitespace stays: 150 accommodations and 18 restaurants of the real
    database have double spaces in their names, and a collapsed name no longer matches its row."""
    text = " ".join(value.splitlines()) if ("\n" in value or "\r" in value) else value
    return text.strip() or "-"


def cache_key(query: TravelQuery | None, plan_text: str, model: str) -> str:
    """Content hash of everything the result depends on."""
    q = query.model_dump(mode="json") if query is not None else None
    blob = json.dumps([q, plan_text, model, prompt.PROMPT_VERSION], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


class LLMFormatter:
    """A chat-completions client with bounded retries, repair, a cache and a concurrency limit.

    Thread-safe: the scorer calls it from worker threads and from the HTTP app's thread pool."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        max_attempts: int = 3,
        request_timeout_s: float = 60.0,
        deadline_s: float = 180.0,
        concurrency: int = 8,
        cache_size: int = 4096,
        temperature: float = 0.0,
        max_tokens: int = 4096,
        backoff_s: float = 0.2,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_attempts = max_attempts
        self.request_timeout_s = request_timeout_s
        self.deadline_s = deadline_s
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=request_timeout_s,
            limits=httpx.Limits(max_connections=concurrency),
        )
        self._slots = threading.BoundedSemaphore(concurrency)
        self._cache: OrderedDict[str, LLMResult] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.calls = 0  # HTTP requests made (for tests and metrics)

    def close(self) -> None:
        self._http.close()

    # -- cache -----------------------------------------------------------------------------

    def _cached(self, key: str) -> LLMResult | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _store(self, key: str, result: LLMResult) -> None:
        if self._cache_size <= 0:
            return
        with self._lock:
            self._cache[key] = result
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    # -- formatting ------------------------------------------------------------------------

    def format(self, query: TravelQuery | None, plan_text: str) -> LLMResult:
        """Extract the plan in `plan_text`. Never raises for a model or network failure."""
        key = cache_key(query, plan_text, self.model)
        hit = self._cached(key)
        if hit is not None:
            return LLMResult(hit.status, hit.plan, hit.error, 0, True, 0.0, [])
        result = self._format(query, plan_text)
        if result.status in ("ok", "no_plan"):  # failures may be transient: never cache them
            self._store(key, result)
        return result

    def _format(self, query: TravelQuery | None, plan_text: str) -> LLMResult:
        started = time.monotonic()
        deadline = started + self.deadline_s
        chat = prompt.messages(query, plan_text)
        history: list[str] = []
        last = "llm_error"
        for attempt in range(1, self.max_attempts + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                history.append(f"attempt {attempt}: deadline of {self.deadline_s:g}s passed")
                last = "timeout"
                break
            try:
                content = self._complete(chat, timeout=min(self.request_timeout_s, left))
            except httpx.TimeoutException:
                history.append(f"attempt {attempt}: no reply within {min(self.request_timeout_s, left):.3g}s")
                last = "timeout"
            except _CallError as exc:
                history.append(f"attempt {attempt}: {exc}")
                last = "llm_error"
            else:
                try:
                    plan = read_plan_json(content)
                except OutputError as exc:
                    history.append(f"attempt {attempt}: {exc}")
                    last = "invalid_output"
                    chat = [
                        *chat,
                        {"role": "assistant", "content": (content or "")[:8000]},
                        {"role": "user", "content": prompt.repair_message(str(exc))},
                    ]
                    continue  # a repair needs no back-off
                status = "ok" if plan is not None else "no_plan"
                return LLMResult(
                    status,
                    plan,
                    None if plan else "the model found no plan in the text",
                    attempt,
                    False,
                    time.monotonic() - started,
                    history,
                )
            if attempt < self.max_attempts:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), max(0.0, deadline - time.monotonic())))
        error = f"{last} after {len(history)} attempt(s): " + "; ".join(history[-3:])
        log.warning("formatter failed", extra={"status": last, "attempts": len(history), "model": self.model})
        return LLMResult(last, None, error, len(history), False, time.monotonic() - started, history)

    def _complete(self, chat: list[dict[str, str]], *, timeout: float) -> str | None:
        body = {"model": self.model, "messages": chat, "temperature": self.temperature, "max_tokens": self.max_tokens}
        with self._slots:
            self.calls += 1
            try:
                response = self._http.post("/chat/completions", json=body, timeout=timeout)
            except httpx.TimeoutException:
                raise
            except httpx.HTTPError as exc:
                raise _CallError(f"cannot reach {self.base_url}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise _CallError(f"HTTP {response.status_code}: {_error_text(response)}")
        try:
            data = response.json()
            message = data["choices"][0]["message"]
            content = message.get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise _CallError(
                f"the API answered 200 with a body that is not a chat completion: {response.text[:200]!r}"
            ) from None
        if content is not None and not isinstance(content, str):
            raise _CallError(f"message content is a {type(content).__name__}, not text")
        return content


class _CallError(Exception):
    """The API call itself failed (network, status, malformed completion)."""


def _error_text(response: httpx.Response) -> str:
    try:
        data = response.json()
        if isinstance(data, dict):
            err = data.get("error", data.get("detail", data))
            if isinstance(err, dict):
                err = err.get("message", err)
            return str(err)[:300]
    except ValueError:
        pass
    return response.text[:300]
