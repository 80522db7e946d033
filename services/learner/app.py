"""HTTP face of the learner: start training runs from a config, watch them, stop them.

Run with `star learner serve`. Each run is its own process (see runs.py); this app stays thin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.common.http import GuardedRoute, bearer_auth, create_app as create_service_app
from services.common.logging import configure_logging
from services.common.metrics import Metrics
from services.common.settings import Settings, get_settings
from services.learner.launch import Nodes
from services.learner.runs import JoinError, JoinRequest, RunConfigError, RunManager, RunNotFound, RunRequest

VERSION = "0.1.0"


@dataclass
class LearnerApp:
    """What the routes read from `app.state.learner`: the runs and their start counter, and the bearer check of
    the app's token (`bearer_auth`)."""

    manager: RunManager
    started: Any
    admin: Callable


def learner_app(request: Request) -> LearnerApp:
    return request.app.state.learner


def runs(request: Request) -> RunManager:
    return learner_app(request).manager


async def admin(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(HTTPBearer(auto_error=False))
) -> None:
    """The app's bearer check, so the router can sit at module level."""
    await learner_app(request).admin(credentials)


def describe(manager: RunManager, run_id: str) -> dict:
    try:
        return manager.describe(run_id)
    except RunNotFound:
        raise HTTPException(404, f"no run {run_id!r}") from None


router = APIRouter(route_class=GuardedRoute)


@router.post(
    "/runs",
    status_code=201,
    dependencies=[Depends(admin)],
    tags=["runs"],
    summary="Start a run (sft | rl) from a config",
)
async def start_run(request: RunRequest, state: LearnerApp = Depends(learner_app)) -> dict:
    try:
        run = state.manager.start(request)
    except RunConfigError as exc:
        raise HTTPException(422, str(exc)) from None
    except JoinError as exc:
        raise HTTPException(503, str(exc)) from None
    state.started.labels(request.kind).inc()
    return state.manager.describe(run.id)


@router.post(
    "/runs/{run_id}/join",
    status_code=201,
    dependencies=[Depends(admin)],
    tags=["runs"],
    summary="Multi-node learner, node 1..: start this node's ranks of a run node 0 started",
)
async def join_run(run_id: str, request: JoinRequest, manager: RunManager = Depends(runs)) -> dict:
    try:
        run = manager.join(run_id, request.kind, request.max_steps)
    except RunNotFound:
        raise HTTPException(404, f"no run {run_id!r} in this node's runs folder (is it shared with node 0?)") from None
    except RunConfigError as exc:
        raise HTTPException(422, str(exc)) from None
    return {"id": run.id, "node": manager.nodes.rank, "pid": run.process.pid if run.process else None}


@router.get("/runs", tags=["runs"], summary="All runs")
async def list_runs(manager: RunManager = Depends(runs)) -> list[dict]:
    return manager.list()


@router.get("/runs/{run_id}", tags=["runs"], summary="A run's state, step and latest metrics")
async def get_run(run_id: str, manager: RunManager = Depends(runs)) -> dict:
    return describe(manager, run_id)


@router.post(
    "/runs/{run_id}/stop",
    dependencies=[Depends(admin)],
    tags=["runs"],
    summary="Stop after the current step (it checkpoints and can resume)",
)
async def stop_run(run_id: str, manager: RunManager = Depends(runs)) -> dict:
    describe(manager, run_id)
    return manager.stop(run_id)


def create_app(settings: Settings | None = None, runs_root: Path | None = None) -> FastAPI:
    settings = settings or get_settings()
    configure_logging("learner", settings.log_level, settings.log_json)
    peers = [u.strip() for u in (settings.learner_peer_urls or "").split(",") if u.strip()]
    manager = RunManager(
        runs_root or Path(settings.home) / "runs", Nodes.from_settings(settings), peers, settings.api_token
    )
    metrics = Metrics("learner")
    app = create_service_app(
        service="learner",
        title="STAR learner",
        version=VERSION,
        metrics=metrics,
        ready=lambda: True,
        max_body_bytes=settings.max_body_bytes,
        description="SFT and GRPO/DAPO training runs on DeepSpeed, with weight publication.",
    )
    app.state.learner = LearnerApp(
        manager,
        metrics.counter("runs_started_total", "Training runs started", ("kind",)),
        bearer_auth(settings.api_token),
    )
    app.include_router(router)
    return app
