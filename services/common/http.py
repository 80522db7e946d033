"""The HTTP conventions every service shares: JSON problem errors, body limits, health, metrics, auth.

Services build their FastAPI app with `create_app` and add only their own routes, which keeps
each `app.py` thin. Errors never carry stack traces: a client gets a status and a message.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.metrics import Metrics

log = logging.getLogger(__name__)


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
    max_body_bytes: int,
    description: str = "",
    alive: Callable[[], bool] | None = None,
) -> FastAPI:
    """`ready` gates /readyz; `alive`, where given, gates /healthz too: a process that answers but
    cannot recover (a broken GPU engine) should be restarted, not merely taken out of service."""
    app = FastAPI(title=title, version=version, description=description)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "input": _short(e.get("input"))}
            for e in exc.errors()
        ]
        return problem(422, "Invalid request", errors)

    @app.exception_handler(HTTPException)
    async def _http(_req: Request, exc: HTTPException) -> JSONResponse:
        return problem(exc.status_code, _reason(exc.status_code), exc.detail)

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
        return JSONResponse({"status": "ready" if ok else "not ready", "service": service}, status_code=200 if ok else 503)

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    return app


def _reason(status: int) -> str:
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
        if credentials is None or not secrets.compare_digest(credentials.credentials, token):
            raise HTTPException(401, "a valid bearer token is required for this endpoint")

    return check
