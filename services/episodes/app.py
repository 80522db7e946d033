"""HTTP face of the episode API: routes and status codes only (the episodes live in service.py).

Served by `star episodes serve` (or `uvicorn --factory services.episodes.app:create_app`). It needs Redis
(STAR_REDIS_URL), the sandbox (STAR_SANDBOX_URL) and the world the scorer reads (STAR_DB_URL, else
STAR_HOME/world.sqlite). Every route under /v1 takes the bearer token when one is configured.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

import orjson
import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.exceptions import RedisError

from services.common.http import PROBLEM_EXAMPLES, Worker, bearer_auth, create_app as create_service_app, problem
from services.common.logging import configure_logging
from services.common.schemas import (
    EpisodeFinish,
    EpisodeResult,
    EpisodeStart,
    EpisodeStarted,
    EpisodeState,
    EpisodeToolCall,
    EpisodeToolResult,
)
from services.common.settings import Settings, get_settings
from services.episodes import service as episodes
from services.episodes.queries import QueryCatalog
from services.episodes.service import EpisodeLimitsConfig, EpisodeMetrics, EpisodeService
from services.episodes.store import EpisodeStore
from services.episodes.tools import SandboxTools

VERSION = "0.1.0"
EPISODE_ID = Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="The id `start` returned.")


def _problem(status: int, title: str, detail: str) -> dict[str, Any]:
    return {"type": "about:blank", "title": title, "status": status, "detail": detail}


def _described(*codes: tuple[int, str, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for a route's own error replies, with an example each."""
    return {
        code: {
            "description": text,
            "content": {
                "application/problem+json": {
                    "schema": {"$ref": "#/components/schemas/Problem"},
                    "example": _problem(code, title, text),
                }
            },
        }
        for code, title, text in codes
    }


UNAUTHORIZED = (401, "Unauthorized", PROBLEM_EXAMPLES["401"]["detail"])
NOT_FOUND = (404, "Not Found", "no episode …: it was never started, was closed, or expired")
RETRY = (503, "Service Unavailable", "the sandbox did not answer; retry shortly (Retry-After says when)")

# Domain errors → status.
STATUS: dict[type[Exception], int] = {
    episodes.EpisodeNotFound: 404,
    episodes.QueryNotFound: 404,
    episodes.EpisodeFinished: 409,
    episodes.ToolBudgetSpent: 429,
    episodes.TooManyEpisodes: 429,
    episodes.BadToolCall: 422,
    episodes.InvalidRequest: 422,
    episodes.ToolsUnavailable: 503,
    episodes.ScoringBusy: 503,
}


def _http(exc: Exception) -> HTTPException:
    """A domain error as its reply; only a 503 says when to retry (a spent budget never comes back)."""
    status = STATUS[type(exc)]
    return HTTPException(status, str(exc), headers={"Retry-After": "1"} if status == 503 else None)


DOMAIN_ERRORS = tuple(STATUS)


async def _authorized(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(HTTPBearer(auto_error=False))
) -> None:
    """The app's bearer check (`bearer_auth` of its token), so the router can sit at module level."""
    await request.app.state.episodes_auth(credentials)


def service(request: Request) -> EpisodeService:
    """The running EpisodeService of the app serving `request`; 503 while it starts or cannot."""
    svc = getattr(request.app.state, "episodes", None)
    if svc is None:
        problem = getattr(request.app.state, "episodes_problem", None)
        raise HTTPException(503, problem or "the episode service is starting", headers={"Retry-After": "1"})
    return svc


router = APIRouter(prefix="/v1", tags=["episodes"], dependencies=[Depends(_authorized)])


@router.post(
    "/episodes",
    status_code=201,
    response_model=EpisodeStarted,
    summary="Start an episode: the task, system prompt, tool schemas and limits",
    responses=_described(
        UNAUTHORIZED,
        (404, "Not Found", "split 'train' has no query '99' (its ids run 1..45)"),
        (429, "Too Many Requests", "client '10.0.0.7' already holds 256 open episodes; finish or close some first"),
    ),
)
async def start_episode(request: EpisodeStart, http: Request) -> Response:
    caller = http.client.host if http.client else "unknown"
    try:
        started = await service(http).start(request, caller)
    except DOMAIN_ERRORS as exc:
        raise _http(exc) from None
    return _json(started, 201)


@router.post(
    "/episodes/{episode_id}/tool_calls",
    response_model=EpisodeToolResult,
    summary="Run one tool inside the episode (counts against its budget)",
    responses=_described(
        UNAUTHORIZED,
        NOT_FOUND,
        (409, "Conflict", "episode … is finished; it takes no more tool calls"),
        (429, "Too Many Requests", "episode … has made all its 60 tool calls; finish it"),
        RETRY,
    ),
)
async def call_tool(call: EpisodeToolCall, http: Request, episode_id: str = EPISODE_ID) -> Response:
    try:
        return _json(await service(http).call_tool(episode_id, call))
    except DOMAIN_ERRORS as exc:
        raise _http(exc) from None


@router.post(
    "/episodes/{episode_id}/finish",
    response_model=EpisodeResult,
    summary="Finish with a plan (JSON or text): the reward and every check's verdict, both modes; "
    "a second finish returns the same result",
    responses=_described(
        UNAUTHORIZED,
        NOT_FOUND,
        (503, "Service Unavailable", "episode … is being scored by another request; retry for its result"),
    ),
)
async def finish_episode(request: EpisodeFinish, http: Request, episode_id: str = EPISODE_ID) -> Response:
    try:
        return _json(await service(http).finish(episode_id, request))
    except DOMAIN_ERRORS as exc:
        raise _http(exc) from None


@router.get(
    "/episodes/{episode_id}",
    response_model=EpisodeState,
    summary="The episode's state: budget used, time to expiry, the result once finished",
    responses=_described(UNAUTHORIZED, NOT_FOUND),
)
async def episode_state(http: Request, episode_id: str = EPISODE_ID) -> Response:
    try:
        return _json(await service(http).state(episode_id))
    except DOMAIN_ERRORS as exc:
        raise _http(exc) from None


@router.delete(
    "/episodes/{episode_id}",
    status_code=204,
    summary="Close the episode (finished or not)",
    responses=_described(UNAUTHORIZED, NOT_FOUND),
)
async def close_episode(http: Request, episode_id: str = EPISODE_ID) -> Response:
    try:
        await service(http).close(episode_id)
    except DOMAIN_ERRORS as exc:
        raise _http(exc) from None
    return Response(status_code=204)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    configure_logging("episodes", settings.log_level, settings.log_json)
    metrics = EpisodeMetrics()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        from services.formatter.core import Formatter
        from services.reward.evaluator import Evaluator
        from services.reward.scoring import Scorer
        from services.sandbox.world import World

        world = World(settings.world_url)
        problems = [
            p
            for p in (
                world.problem(),
                None if settings.redis_url else "STAR_REDIS_URL is not set (episodes live in Redis)",
                None if settings.sandbox_url else "STAR_SANDBOX_URL is not set (tools run there)",
            )
            if p
        ]
        scorer = tools = client = None
        if problems:
            _app.state.episodes_problem = "; ".join(problems)
        else:
            client = aioredis.from_url(settings.redis_url)
            tools = SandboxTools(settings.sandbox_url, settings.api_token)
            scorer = Scorer(
                Evaluator(world), Formatter.from_settings(settings), default_backend=settings.formatter_backend
            )
            worker = Worker(time_limit_s=120.0 + settings.formatter_deadline_s)
            limits = EpisodeLimitsConfig(
                settings.episodes_max_tool_calls, settings.episodes_idle_expiry_s, settings.episodes_max_open_per_client
            )
            _app.state.episodes = state["service"] = EpisodeService(
                EpisodeStore(client, settings.stream_prefix),
                QueryCatalog(settings.travelplanner_dir, settings.episodes_splits_dir),
                tools,
                scorer,
                limits,
                metrics=metrics,
                run_blocking=worker.run,
            )
        yield
        state.pop("service", None)
        _app.state.episodes = None
        if scorer is not None:
            scorer.close()
        if tools is not None:
            await tools.close()
        if client is not None:
            await client.aclose()
        world.close()

    app = create_service_app(
        service="episodes",
        title="STAR episodes",
        version=VERSION,
        metrics=metrics.registry,
        ready=lambda: "service" in state,
        max_body_bytes=settings.episodes_max_body_bytes,
        description="TravelPlanner as an environment: start an episode for a query, call the six tools inside it, "
        "finish with a plan and get the reward with every check's verdict (official and strict). "
        "Episodes live in Redis, are bounded (tool calls, idle expiry, open episodes per client, body "
        "size) and are scored exactly once.",
    )
    app.router.lifespan_context = lifespan

    @app.exception_handler(RedisError)
    async def _redis_away(_req: Request, exc: RedisError) -> Response:
        # Episodes live in Redis: without it nothing can be answered, but nothing is lost either.
        response = problem(
            503, "Service Unavailable", f"the episode store (Redis) did not answer: {type(exc).__name__}; retry shortly"
        )
        response.headers["Retry-After"] = "1"
        return response

    app.state.episodes_auth = bearer_auth(settings.api_token)
    app.include_router(router)
    return app


def _json(model: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(model.model_dump(mode="json")), status_code=status, media_type="application/json")
