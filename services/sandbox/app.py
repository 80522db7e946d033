"""HTTP face of the sandbox: the six tools over the travel world.

Run with `star sandbox serve` (or `uvicorn --factory services.sandbox.app:create_app`).
The text a tool returns is the same in-process and over HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Body, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from services.common.http import GuardedRoute, Worker, bearer_auth, create_app as create_service_app
from services.common.logging import configure_logging
from services.common.metrics import Metrics
from services.common.schemas import ToolCall, ToolResult
from services.common.settings import Settings, get_settings
from services.sandbox.config import SandboxConfig
from services.sandbox.tools.registry import tool_schemas
from services.sandbox.tools.toolbox import BackendError, ToolBox, UnknownTool
from services.sandbox.world import World
from services.sandbox.world.store import world_identity

VERSION = "0.1.0"


class FaultConfig(BaseModel):
    """The run-level failure injection: every call without its own override draws from this."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"rate": 0.05, "seed": 7, "per_tool": {"SearchFlight": 0.2}}]}
    )

    rate: float = Field(0.0, ge=0.0, le=1.0)
    seed: int = 0
    per_tool: dict[str, float] = Field(default_factory=dict, description="Rates by tool name, overriding `rate`.")


class SandboxMetrics:
    def __init__(self) -> None:
        self.registry = Metrics("sandbox")
        self.latency = self.registry.histogram("tool_seconds", "Tool call latency (in-process part)", ("tool",))
        self.calls = self.registry.counter("tool_calls_total", "Tool calls by outcome", ("tool", "outcome"))
        self.faults = self.registry.counter("tool_faults_injected_total", "Injected tool failures", ("tool",))

    def observe(self, result: ToolResult) -> None:
        self.latency.labels(result.name).observe(result.elapsed_ms / 1000.0)
        outcome = "fault" if result.fault_injected else ("ok" if result.ok else "error")
        self.calls.labels(result.name, outcome).inc()
        if result.fault_injected:
            self.faults.labels(result.name).inc()


@dataclass
class SandboxApp:
    """What the routes read from `app.state.sandbox`: the settings, the tools' settings, the metrics, the bearer
    check of the app's token, the world handed to create_app (if any) and, once the lifespan has loaded the world,
    its tool box (or why there is none) and the counts `/world` computed."""

    settings: Settings
    config: SandboxConfig
    metrics: SandboxMetrics
    admin: Callable
    worker: Worker
    given: World | None = None
    world: World | None = None
    toolbox: ToolBox | None = None
    problem: str | None = None
    blocking: bool = False
    meta: dict | None = None
    counts: dict | None = None


def sandbox_app(request: Request) -> SandboxApp:
    return request.app.state.sandbox


def toolbox(state: SandboxApp) -> ToolBox:
    """The loaded tool box; 503 with the reason while there is none."""
    if state.toolbox is None:
        raise HTTPException(503, state.problem or "the travel world is not loaded")
    return state.toolbox


async def admin(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(HTTPBearer(auto_error=False))
) -> None:
    """The app's bearer check, so the router can sit at module level."""
    await sandbox_app(request).admin(credentials)


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: SandboxApp = app.state.sandbox
    settings = state.settings
    w = state.given or World(settings.world_url)
    state.problem = w.problem()
    if state.problem is None:
        state.world = w
        state.toolbox = ToolBox(w, **state.config.toolbox_options())
        # Off-thread only where a query waits on the network; SQLite reads are pure CPU.
        state.blocking = not w.url.startswith("sqlite")
    yield
    if state.given is None:
        w.close()


async def run_call(state: SandboxApp, call: ToolCall) -> Response:
    box = toolbox(state)
    kwargs = dict(
        dialect=call.dialect, fault_rate=call.fault_rate, fault_seed=call.fault_seed, fault_key=call.fault_key
    )
    try:
        if state.blocking:
            result = await run_in_threadpool(box.call, call.name, call.arguments, **kwargs)
        else:
            result = box.call(call.name, call.arguments, **kwargs)
    except UnknownTool:
        raise HTTPException(404, f"unknown tool {call.name!r}; known tools: {', '.join(box.names())}") from None
    except BackendError as exc:
        raise HTTPException(503, f"the world database did not answer: {exc}") from None
    state.metrics.observe(result)
    return Response(orjson.dumps(result.model_dump()), media_type="application/json")


router = APIRouter(route_class=GuardedRoute)


@router.get("/tools", tags=["tools"], summary="Tool schemas (OpenAI function format) for agent prompts")
async def list_tools() -> list[dict]:
    return tool_schemas()


@router.post("/tools/call", tags=["tools"], response_model=ToolResult, summary="Run one tool")
async def call_tool(call: ToolCall, state: SandboxApp = Depends(sandbox_app)) -> Response:
    return await run_call(state, call)


@router.post("/tools/{name}", tags=["tools"], response_model=ToolResult, summary="Run one tool by path")
async def call_named_tool(
    name: str = Path(max_length=64),
    arguments: dict[str, Any] = Body(default_factory=dict, examples=[{"city": "Chicago"}]),
    dialect: str | None = Query(None, pattern="^(star|official)$"),
    fault_rate: float | None = Query(None, ge=0.0, le=1.0),
    fault_seed: int | None = Query(None),
    fault_key: str | None = Query(None, max_length=256),
    state: SandboxApp = Depends(sandbox_app),
) -> Response:
    try:
        call = ToolCall(
            name=name,
            arguments=arguments,
            dialect=dialect,
            fault_rate=fault_rate,
            fault_seed=fault_seed,
            fault_key=fault_key,
        )
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    return await run_call(state, call)


@router.get("/faults", tags=["faults"], response_model=FaultConfig, summary="Run-level failure injection")
async def get_faults(state: SandboxApp = Depends(sandbox_app)) -> FaultConfig:
    return FaultConfig(**toolbox(state).fault_config())


@router.put(
    "/faults",
    tags=["faults"],
    response_model=FaultConfig,
    dependencies=[Depends(admin)],
    summary="Set run-level failure injection (bearer token when configured)",
)
async def put_faults(config: FaultConfig, state: SandboxApp = Depends(sandbox_app)) -> FaultConfig:
    box = toolbox(state)
    unknown = sorted(set(config.per_tool) - set(box.names()))
    if unknown:
        raise HTTPException(422, f"unknown tools in per_tool: {unknown}")
    box.set_faults(rate=config.rate, seed=config.seed, per_tool=config.per_tool)
    return FaultConfig(**box.fault_config())


@router.get("/world", tags=["world"], summary="What world is loaded: source, seed, row counts")
async def world_info(state: SandboxApp = Depends(sandbox_app)) -> dict:
    box = toolbox(state)
    w = state.world
    if state.counts is None:  # counting millions of flights takes a while: once, off the loop
        state.meta, state.counts = await state.worker.run(lambda: (w.meta(), w.counts()))
    return {
        "url": _redact(w.url),
        **world_identity(state.meta),
        "meta": state.meta,
        "counts": state.counts,
        "dialect": box.dialect,
        "cache": box.cache_info(),
        "stats": box.stats_snapshot(),
    }


def create_app(
    settings: Settings | None = None, world: World | None = None, config: SandboxConfig | None = None
) -> FastAPI:
    """The sandbox app; its tools' settings are `config`, by default the environment's (`star sandbox serve`
    puts its config file's there for its workers)."""
    settings = settings or get_settings()
    configure_logging("sandbox", settings.log_level, settings.log_json)
    config = config or SandboxConfig()
    state = SandboxApp(settings, config, SandboxMetrics(), bearer_auth(settings.api_token), Worker(), given=world)
    app = create_service_app(
        service="sandbox",
        title="STAR sandbox",
        version=VERSION,
        metrics=state.metrics.registry,
        ready=lambda: state.toolbox is not None,
        max_body_bytes=settings.max_body_bytes,
        description="The TravelPlanner travel world and its six tools (dialects: star, official).",
    )
    app.state.sandbox = state
    app.router.lifespan_context = lifespan
    app.include_router(router)
    return app


def _redact(url: str) -> str:
    """Hide a password in a database URL."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
