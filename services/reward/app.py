"""HTTP face of the reward scorer: score plans from any agent, one at a time, in batches, or a split.

Run with `star reward serve` (or `uvicorn --factory services.reward.app:create_app`). The world
comes from settings (STAR_DB_URL, else STAR_HOME/world.sqlite), like the sandbox's. A plan that
fails checks is a 200 with its verdicts; 4xx is for requests that cannot be scored at all (a bad
query, a value that is not a plan, an unknown reward), each with a message.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import orjson
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from services.common.http import create_app as create_service_app, problem
from services.common.logging import configure_logging
from services.common.metrics import Metrics
from services.common.schemas import Score
from services.common.settings import Settings, get_settings
from services.formatter.core import Formatter
from services.reward.evaluator import Evaluator, SplitMetrics
from services.reward.scoring import (
    MAX_BATCH,
    EvaluateRequest,
    ScoreError,
    Scorer,
    ScoreRequest,
    ScoreResponse,
)
from services.sandbox.world import World

VERSION = "0.1.0"


class ScoreBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ScoreRequest] = Field(min_length=1, max_length=MAX_BATCH)


class ScoreBatchResponse(BaseModel):
    results: list[ScoreResponse]


class ScorerMetrics:
    def __init__(self) -> None:
        self.registry = Metrics("reward")
        self.plans = self.registry.counter("plans_scored_total", "Plans scored", ("mode", "formatter_status"))
        self.latency = self.registry.histogram("score_seconds", "Time to score one request", ("route",))

    def observe(self, score: Score) -> None:
        self.plans.labels(score.mode, score.formatter_status).inc()


def create_app(settings: Settings | None = None, scorer: Scorer | None = None) -> FastAPI:
    settings = settings or get_settings()
    configure_logging("reward", settings.log_level, settings.log_json)
    metrics = ScorerMetrics()
    state: dict[str, Any] = {}

    def current() -> Scorer:
        s = state.get("scorer")
        if s is None:
            raise HTTPException(503, state.get("problem") or "the travel world is not loaded")
        return s

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        world = None
        if scorer is not None:
            state["scorer"] = scorer
        else:
            world = World(settings.world_url)
            state["problem"] = world.problem()
            if state["problem"] is None:
                state["scorer"] = Scorer(Evaluator(world), Formatter.from_settings(settings),
                                         default_backend=settings.formatter_backend)
        # Scoring is CPU work over an in-memory index, except when the LLM formatter is involved.
        state["blocking"] = "scorer" in state and state["scorer"].formatter.blocking
        yield
        if "scorer" in state and scorer is None:
            state["scorer"].close()
        if world is not None:
            world.close()

    app = create_service_app(
        service="reward", title="STAR reward", version=VERSION, metrics=metrics.registry,
        ready=lambda: "scorer" in state, max_body_bytes=settings.reward_max_body_bytes,
        description="The TravelPlanner evaluator (official parity and strict modes) and the RL rewards: "
                    "score a plan (JSON or text), a batch, or a whole split.",
    )
    app.router.lifespan_context = lifespan

    @app.exception_handler(RecursionError)
    async def _too_deep(_req: Request, _exc: RecursionError) -> JSONResponse:
        return problem(422, "Invalid request", "the JSON body is nested too deeply")

    async def run(fn, *args):
        if state.get("blocking"):
            return await run_in_threadpool(fn, *args)
        return fn(*args)

    def fail(exc: ScoreError) -> HTTPException:
        return HTTPException(422, str(exc))

    @app.post("/score", tags=["score"], response_model=ScoreResponse,
              summary="Score one plan: per-check verdicts, the five scores, every reward")
    async def score(request: ScoreRequest) -> Response:
        s = current()
        with metrics.latency.labels("score").time():
            try:
                out = await run(s.score, request)
            except ScoreError as exc:
                raise fail(exc) from None
        metrics.observe(out.score)
        return _json(out)

    @app.post("/score/batch", tags=["score"], response_model=ScoreBatchResponse,
              summary=f"Score up to {MAX_BATCH} plans; results in request order")
    async def score_batch(request: ScoreBatchRequest) -> Response:
        s = current()
        with metrics.latency.labels("score_batch").time():
            try:
                out = await run(s.score_batch, request.items)
            except ScoreError as exc:
                raise fail(exc) from None
        for r in out:
            metrics.observe(r.score)
        return _json(ScoreBatchResponse(results=out))

    @app.post("/evaluate", tags=["evaluate"], response_model=SplitMetrics,
              summary="Leaderboard metrics of a set of (query, plan) items")
    async def evaluate(request: EvaluateRequest) -> SplitMetrics:
        s = current()
        with metrics.latency.labels("evaluate").time():
            try:
                return await run(s.evaluate_split, request)
            except ScoreError as exc:
                raise fail(exc) from None

    @app.get("/checks", tags=["evaluate"], summary="The checks, their names and the mode differences")
    async def checks() -> dict:
        from services.reward.evaluator import COMMONSENSE_CHECKS, HARD_CHECKS, MODE_DIFFERENCES

        return {"commonsense": COMMONSENSE_CHECKS, "hard": HARD_CHECKS, "mode_differences": list(MODE_DIFFERENCES)}

    return app


def _json(model: BaseModel) -> Response:
    """Serialise once with orjson (the model is already validated; FastAPI would validate it again)."""
    return Response(orjson.dumps(model.model_dump(mode="json")), media_type="application/json")
