"""HTTP face of the rollout service: run groups, load weight versions.

Run with `star rollout serve [--config FILE]` (or `uvicorn --factory services.rollout.app:create_app`);
the engine comes from the config file and `STAR_ROLLOUT_*` (services/rollout/config.py; default vLLM
on `STAR_MODEL`), the sandbox from `STAR_SANDBOX_URL`. A stream worker (`services.rollout.worker`)
serves the same API on its own engine when `STAR_ROLLOUT_HTTP_PORT` is set (`embedded_server`): that
is how the learner reaches the engines of an embedded fleet with NCCL weight broadcasts.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.common.http import GuardedRoute, bearer_auth, create_app as create_service_app, problem, reason
from services.common.logging import configure_logging
from services.common.schemas import (
    GenerateRequest,
    GenerateResult,
    IpcWeights,
    SleepRequest,
    Trajectory,
    WakeRequest,
    WeightsBroadcast,
    WeightsGroup,
    WeightsUpdate,
)
from services.common.settings import Settings, get_settings
from services.rollout.config import RolloutConfig
from services.rollout.service import (
    STUCK_EXIT,
    RolloutMetrics,
    RolloutRequest,
    RolloutService,
)
from services.weights.manifest import WeightsError

VERSION = "0.1.0"


@dataclass
class RolloutApp:
    """What the routes read from `app.state.rollout`: the settings, the metrics, the bearer check of the app's
    token, the service handed to create_app (if any) or the config to build one from and, once the lifespan has
    started, the service itself."""

    settings: Settings
    metrics: RolloutMetrics
    admin: Callable
    given: RolloutService | None = None
    config: RolloutConfig | None = None
    service: RolloutService | None = None


def rollout_app(request: Request) -> RolloutApp:
    return request.app.state.rollout


def svc(request: Request) -> RolloutService:
    """The running service; 503 until the lifespan has built it (its engine loads first)."""
    s = rollout_app(request).service
    if s is None:
        raise HTTPException(503, "the engine is not loaded yet")
    return s


async def auth(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(HTTPBearer(auto_error=False))
) -> None:
    """The app's bearer check, so the router can sit at module level."""
    await rollout_app(request).admin(credentials)


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: RolloutApp = app.state.rollout
    service = state.given
    if service is None:
        from services.rollout.service import make_engine, make_tools

        cfg = state.config or RolloutConfig()
        service = RolloutService(
            make_engine(state.settings, cfg),
            make_tools(state.settings, cfg),
            settings=state.settings,
            config=cfg,
            metrics=state.metrics,
        )
        service.on_fatal = end_soon
    state.service = service
    yield
    if state.given is None:
        await service.close()


async def weights_error(_request: Any, exc: WeightsError) -> Any:
    """The service's refusals (bad version, no NCCL, a broken broadcast) as problem replies."""
    return problem(exc.status, reason(exc.status), exc.message)


router = APIRouter(route_class=GuardedRoute)


@router.post(
    "/rollouts",
    tags=["rollout"],
    dependencies=[Depends(auth)],
    summary="Run one query G times; returns the trajectories",
)
async def rollouts(request: RolloutRequest, http: Request) -> dict[str, list[Trajectory]]:
    return {"trajectories": await svc(http).rollout(request)}


@router.post(
    "/weights",
    tags=["weights"],
    dependencies=[Depends(auth)],
    summary="Load a published weight version (pause, load, reset prefix cache, resume)",
)
async def load_weights(update: WeightsUpdate, http: Request) -> dict[str, Any]:
    return await svc(http).update_weights(update)


@router.post(
    "/weights/group",
    tags=["weights"],
    dependencies=[Depends(auth)],
    summary="Join the learner's NCCL group for weight broadcasts (vLLM with weight_transfer: nccl)",
)
async def join_weight_group(group: WeightsGroup, http: Request) -> dict[str, Any]:
    return await svc(http).join_weight_group(group)


@router.post(
    "/weights/broadcast",
    tags=["weights"],
    dependencies=[Depends(auth)],
    summary="Receive a version from the learner's NCCL broadcast (pause in place, load, resume)",
)
async def receive_weights(broadcast: WeightsBroadcast, request: Request) -> dict[str, Any]:
    return await svc(request).receive_weights(broadcast, sender_gone=request.is_disconnected)


@router.post(
    "/sleep",
    tags=["colocation"],
    dependencies=[Depends(auth)],
    summary="Hold new turns, finish those in flight, free the GPU memory (vLLM sleep mode)",
)
async def sleep(request: SleepRequest, http: Request) -> dict[str, Any]:
    return await svc(http).sleep(request)


@router.post(
    "/wake",
    tags=["colocation"],
    dependencies=[Depends(auth)],
    summary="Bring back the weights or the KV cache (all: the held turns run again)",
)
async def wake(request: WakeRequest, http: Request) -> dict[str, Any]:
    return await svc(http).wake(request)


@router.post(
    "/weights/ipc",
    tags=["colocation"],
    dependencies=[Depends(auth)],
    summary="Load one chunk of a version from the learner's CUDA buffer on this GPU (CUDA IPC)",
)
async def receive_ipc(chunk: IpcWeights, http: Request) -> dict[str, Any]:
    return await svc(http).receive_ipc(chunk)


@router.get(
    "/weights/digests",
    tags=["weights"],
    dependencies=[Depends(auth)],
    summary="A sha256 of every parameter as the engine holds it, with its fused layout and dtype",
)
async def digests(http: Request) -> dict[str, Any]:
    return await svc(http).parameter_digests()


@router.post(
    "/generate",
    tags=["rollout"],
    dependencies=[Depends(auth)],
    summary="One model turn: token ids in, sampled ids and their log-probs out",
)
async def generate(request: GenerateRequest, http: Request) -> GenerateResult:
    return await svc(http).generate(request)


@router.get("/weights", tags=["weights"], summary="The loaded weight version")
async def weights(http: Request) -> dict[str, Any]:
    return svc(http).weights_info()


def create_app(
    settings: Settings | None = None, service: RolloutService | None = None, config: RolloutConfig | None = None
) -> FastAPI:
    settings = settings or get_settings()
    configure_logging("rollout", settings.log_level, settings.log_json)
    state = RolloutApp(
        settings,
        service.metrics if service else RolloutMetrics(),
        bearer_auth(settings.api_token),
        given=service,
        config=config,
    )
    app = create_service_app(
        service="rollout",
        title="STAR rollout",
        version=VERSION,
        metrics=state.metrics.registry,
        # not ready, and not alive, once the engine reports itself broken or a weight transfer left it
        # stuck: it will not recover in this process, so Kubernetes' liveness probe restarts the pod
        ready=lambda: state.service is not None and state.service.healthy,
        alive=lambda: state.service is None or state.service.healthy,
        max_body_bytes=settings.max_body_bytes,
        description="ReAct agents on an inference engine: G trajectories per query, token-in/token-out.",
    )
    app.state.rollout = state
    app.router.lifespan_context = lifespan
    app.add_exception_handler(WeightsError, weights_error)
    app.include_router(router)
    return app


FATAL_EXIT_S = 1.0  # the reply that reports a fatal weight transfer goes out before the process ends


def end_soon(reason: str) -> None:
    """A server whose engine a weight transfer left stuck ends with STUCK_EXIT (its supervisor starts a
    fresh one, which loads the newest files), after a moment for the failed request's reply. Not a
    graceful shutdown: that would wait on requests the stuck engine never finishes."""
    ender = threading.Timer(FATAL_EXIT_S, os._exit, args=(STUCK_EXIT,))
    ender.daemon = True
    ender.start()


class _Embedded(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone: its host (the stream worker)
    has its own shutdown, which sets `should_exit`."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def embedded_server(service: RolloutService, settings: Settings, host: str, port: int) -> uvicorn.Server:
    """The rollout API on `service` (already built, with its engine), for `await server.serve()` on
    the event loop the engine lives on; the caller stops it by setting `should_exit`."""
    app = create_app(settings, service=service)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", log_config=None, lifespan="on", access_log=False
    )
    return _Embedded(config)
