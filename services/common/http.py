"""The HTTP conventions every service shares: JSON problem errors, body limits, health, metrics, auth.

Services build their FastAPI app with `create_app` and add only their own routes, which keeps
each `app.py` thin. Errors never carry stack traces: a client gets a status and a message.

Limits, the same for every service (docs/scoring-api.md):
- a request body holds at most `MAX_BODY_BYTES` (STAR_MAX_BODY_BYTES overrides it): 413 beyond;
- a batch (`/score/batch`, `/evaluate`) holds at most `MAX_BATCH_ITEMS` items: 422 beyond;
- JSON nests at most `MAX_JSON_DEPTH` levels, and its text holds no lone surrogate, NUL or other
  control character but tab, newline and carriage return: 422, naming where;
- CPU-heavy work runs off the event loop (`run_limited`), at most `WORK_THREADS` requests at once
  and `REQUEST_TIME_LIMIT_S` seconds each, so /healthz answers while it runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import orjson
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BODY_BYTES = 16 * 1024 * 1024  # a whole test split of plans (1,000 plans of a few KB) fits
MAX_BATCH_ITEMS = 1000  # the test split
MAX_JSON_DEPTH = 32  # a plan is 3 levels deep inside a request; nothing legitimate comes close
REQUEST_TIME_LIMIT_S = 60.0
WORK_THREADS = 2
SWITCH_INTERVAL_S = 0.001
_PARSE_IN_THREAD_BYTES = 256 * 1024
_ALLOWED_CONTROLS = frozenset("\t\n\r")
_CONTROLS = frozenset(chr(c) for c in range(32)) - _ALLOWED_CONTROLS


class Problem(BaseModel):
    """An RFC 9457 problem document: every 4xx and 5xx reply of every service."""

    type: str = "about:blank"
    title: str = Field(description="The HTTP reason, e.g. 'Invalid request'.")
    status: int
    detail: str | list[dict[str, Any]] | None = Field(
        None, description="What was wrong: a message, or for 422 one {loc, msg, input} entry per error."
    )


PROBLEM_EXAMPLES: dict[str, dict[str, Any]] = {
    "400": {"type": "about:blank", "title": "Bad Request", "status": 400, "detail": "the request is malformed"},
    "401": {
        "type": "about:blank",
        "title": "Unauthorized",
        "status": 401,
        "detail": "a valid bearer token is required for this endpoint",
    },
    "404": {"type": "about:blank", "title": "Not Found", "status": 404, "detail": "Not Found"},
    "413": {
        "type": "about:blank",
        "title": "Request body too large",
        "status": 413,
        "detail": f"the limit is {MAX_BODY_BYTES} bytes",
    },
    "422": {
        "type": "about:blank",
        "title": "Invalid request",
        "status": 422,
        "detail": [{"loc": ["body", "query", "days"], "msg": "Input should be 3, 5 or 7", "input": 4}],
    },
    "503": {
        "type": "about:blank",
        "title": "Service Unavailable",
        "status": 503,
        "detail": "the travel world is not loaded",
    },
}


def problem(status: int, title: str, detail: str | list | None = None) -> JSONResponse:
    """An RFC 9457 problem document."""
    body = {"type": "about:blank", "title": title, "status": status}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=status, media_type="application/problem+json")


def _short(value: object, limit: int = 120) -> object:
    """Validation errors echo input: keep a 1 MB string or a lone surrogate out of the reply."""
    text = ascii(value)
    if len(text) > limit:
        return text[:limit] + "…"
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
        return value
    except (TypeError, ValueError, UnicodeEncodeError):
        return text


class InputError(ValueError):
    """JSON text a service will not read: where it is and why."""

    def __init__(self, loc: list[Any], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise `InputError` for nesting deeper than `max_depth`, or text (keys included) with a lone
    surrogate, a NUL or another control character (tab, newline and carriage return are text).
    Iterative, so no input can exhaust the stack."""
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        item, loc = stack.pop()
        if isinstance(item, str):
            _check_text(item, loc)
        elif isinstance(item, (dict, list)):
            if len(loc) >= max_depth:
                raise InputError(loc, f"the JSON nests more than {max_depth} levels deep")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str):
                    _check_text(key, [*loc, key])
                stack.append((child, [*loc, key]))


def _check_text(text: str, loc: list[Any]) -> None:
    if text.isprintable() or not (_CONTROLS.intersection(text) or _has_surrogate(text)):
        return
    if "\x00" in text:
        raise InputError(loc, "text may not contain NUL characters")
    if _has_surrogate(text):
        raise InputError(loc, "text must be valid Unicode (found a lone surrogate)")
    bad = sorted(_CONTROLS.intersection(text))
    raise InputError(loc, f"text may not contain control characters (found {', '.join(map(ascii, bad))})")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def read_json(body: bytes) -> Any:
    """The body's JSON value (orjson: strict UTF-8, no NaN, bounded nesting), checked by
    `check_json_value`. Raises `json.JSONDecodeError` or `InputError`."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise json.JSONDecodeError(exc.msg, exc.doc if isinstance(exc.doc, str) else "", exc.pos) from None
    check_json_value(value)
    return value


class _GuardedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                # A large body takes a while to parse and check: off the event loop.
                self._json = (
                    read_json(body)
                    if len(body) < _PARSE_IN_THREAD_BYTES
                    else await anyio.to_thread.run_sync(read_json, body)
                )
            except InputError as exc:
                raise HTTPException(422, [{"loc": ["body", *exc.loc], "msg": exc.msg, "input": None}]) from None
        return self._json


class GuardedRoute(APIRoute):
    """A route whose JSON body is read by `read_json` (the checks above) instead of `json.loads`."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            return await handler(_GuardedRequest(request.scope, request.receive))

        return guarded


class RequestTimeout(RuntimeError):
    """Work that ran past its time limit (answered 503 with Retry-After)."""


class Deadline:
    """A cancellation flag with a time limit, for loops that can stop between items."""

    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def check(self) -> None:
        """Raise `RequestTimeout` once cancelled or past the limit."""
        if self._cancelled.is_set() or (self.at is not None and time.monotonic() > self.at):
            raise RequestTimeout("the request ran past its time limit")


class Worker:
    """Runs blocking calls off the event loop: `threads` at once, each with a time limit. A call
    that takes a `deadline` keyword is told to stop when its time is up."""

    def __init__(self, threads: int = WORK_THREADS, time_limit_s: float = REQUEST_TIME_LIMIT_S) -> None:
        self.threads = threads
        self.time_limit_s = time_limit_s
        self._limiter: anyio.CapacityLimiter | None = None

    async def run(self, fn: Callable[..., T], *args: Any, deadline: bool = False) -> T:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        stop = Deadline(self.time_limit_s) if deadline else None
        call = partial(fn, *args, deadline=stop) if deadline else partial(fn, *args)
        try:
            # abandon_on_cancel: the reply goes out at the limit; a call that cannot stop finishes
            # in its thread, its result dropped (a `deadline` call stops at its next item).
            return await asyncio.wait_for(
                anyio.to_thread.run_sync(call, limiter=self._limiter, abandon_on_cancel=True), self.time_limit_s
            )
        except (TimeoutError, RequestTimeout):
            if stop is not None:
                stop.cancel()
            raise HTTPException(
                503,
                f"the request needed more than the {self.time_limit_s:g} s time limit; send fewer or smaller items",
                headers={"Retry-After": "1"},
            ) from None


class BodyLimit:
    """Reject request bodies over `max_bytes` with 413, before anything parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(scope, receive, send)
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem(413, "Request body too large", f"the limit is {self.max_bytes} bytes")
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


def create_app(
    *,
    service: str,
    title: str,
    version: str,
    metrics: Metrics,
    ready: Callable[[], bool],
    max_body_bytes: int | None = None,
    description: str = "",
    alive: Callable[[], bool] | None = None,
) -> FastAPI:
    """`ready` gates /readyz; `alive`, where given, gates /healthz too: a process that answers but
    cannot recover (a broken GPU engine) should be restarted, not merely taken out of service.
    `max_body_bytes`: None for the shared `MAX_BODY_BYTES`."""
    max_body_bytes = max_body_bytes or MAX_BODY_BYTES
    # Work threads hold the GIL for up to the switch interval at a time; the event loop needs it
    # for every step of a request, so a shorter interval keeps /healthz fast under load.
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
    app = FastAPI(title=title, version=version, description=description)
    app.router.route_class = GuardedRoute

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": _message(e), "input": _short(e.get("input"))} for e in exc.errors()
        ]
        return problem(422, "Invalid request", errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = problem(exc.status_code, reason(exc.status_code), exc.detail)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"path": req.url.path})
        return problem(500, "Internal error", f"{type(exc).__name__}; see the {service} logs")

    @app.get("/healthz", tags=["ops"], summary="Liveness: the process answers and can recover")
    async def healthz() -> JSONResponse:
        ok = alive is None or alive()
        return JSONResponse({"status": "ok" if ok else "broken", "service": service}, status_code=200 if ok else 503)

    @app.get("/readyz", tags=["ops"], summary="Readiness: dependencies are usable")
    async def readyz() -> JSONResponse:
        ok = ready()
        return JSONResponse(
            {"status": "ready" if ok else "not ready", "service": service}, status_code=200 if ok else 503
        )

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.openapi = partial(_openapi, app)  # type: ignore[method-assign]
    return app


def _message(error: dict) -> str:
    """A validation message, with the parser's reason for a JSON decode error."""
    msg = str(error.get("msg", ""))
    reason = (error.get("ctx") or {}).get("error")
    return f"{msg}: {reason}" if reason and error.get("type") == "json_invalid" else msg


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with the error replies these services really send: problem documents
    (422 included, which FastAPI would describe as its own `HTTPValidationError`), with examples."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            codes = ["404"] if "{" in path else []
            if method in ("post", "put", "patch"):
                codes += ["413", "422"]
            elif "parameters" in operation:
                codes.append("422")
            if any(p.get("in") == "header" for p in operation.get("parameters", ())) or operation.get("security"):
                codes.append("401")
            for code in codes:
                responses[code] = _problem_response(code)
            if "422" in responses:
                responses["422"] = _problem_response("422")
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    app.openapi_schema = schema
    return schema


def _problem_response(code: str) -> dict[str, Any]:
    example = PROBLEM_EXAMPLES.get(code, {"type": "about:blank", "title": reason(int(code)), "status": int(code)})
    return {
        "description": str(example["title"]),
        "content": {
            "application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}, "example": example}
        },
    }


def reason(status: int) -> str:
    """The standard phrase of an HTTP status (a problem reply's title)."""
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def bearer_auth(token: str | None) -> Callable:
    """A dependency that requires `Authorization: Bearer <token>` when a token is configured."""
    scheme = HTTPBearer(auto_error=False)

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:
        if token is None:
            return
        # Bytes, not str: compare_digest refuses non-ASCII text, and a header may hold any byte.
        given = credentials.credentials.encode("utf-8", "surrogateescape") if credentials else b""
        if credentials is None or not secrets.compare_digest(given, token.encode("utf-8")):
            raise HTTPException(
                401, "a valid bearer token is required for this endpoint", headers={"WWW-Authenticate": "Bearer"}
            )

    return check
