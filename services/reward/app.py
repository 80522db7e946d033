"""HTTP face of the reward scorer: score plans from any agent, one at a time, in batches, or a split.

Run with `star reward serve` (or `uvicorn --factory services.reward.app:create_app`). The world
comes from settings (STAR_DB_URL, else STAR_HOME/world.sqlite), like the sandbox's. A plan that
fails checks is a 200 with its verdicts; 4xx is for requests that cannot be scored at all (a bad
query, a value that is not a plan, an unknown reward), each with a message.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from services.common.http import (
    MAX_BATCH_ITEMS,
    REQUEST_TIME_LIMIT_S,
    WORK_THREADS,
    GuardedRoute,
    Worker,
    create_app as create_service_app,
    problem,
)
from services.common.logging import configure_logging
from services.common.metrics import Metrics
from services.common.schemas import EvalMode, Score, TravelQuery
from services.common.settings import Settings, get_settings
from services.formatter.core import Formatter
from services.reward.evaluator import Evaluator, SplitMetrics
from services.reward.scoring import (
    EXAMPLE_PLAN,
    EXAMPLE_QUERY,
    BatchItemError,
    EvaluateRequest,
    FormatterBackend,
    ScoreError,
    Scorer,
    ScoreRequest,
    ScoreResponse,
)
from services.reward.submission import (
    MAX_LINES,
    SubmissionError,
    SubmissionLine,
    SubmissionReport,
    dataset_split,
    queries_from,
    score_submission,
)
from services.sandbox.world import World

VERSION = "0.1.0"


class ScoreBatchRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "items": [
                        {"query": EXAMPLE_QUERY, "plan": EXAMPLE_PLAN, "mode": "strict", "reward": "sum"},
                        {"query": EXAMPLE_QUERY, "plan": None},
                    ]
                }
            ]
        },
    )

    items: list[ScoreRequest] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)


class ScoreBatchResponse(BaseModel):
    results: list[ScoreResponse | BatchItemError] = Field(
        description="One per item, in request order: a score, or why that item alone could not be scored."
    )


class SubmissionRequest(BaseModel):
    """The official submission lines and the split they answer."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "lines": [
                        {"idx": 1, "query": "A 3-day trip from St. Petersburg to Rockford ...", "plan": EXAMPLE_PLAN}
                    ],
                    "queries": [EXAMPLE_QUERY],
                    "mode": "official",
                },
                {"lines": [{"idx": 1, "query": "...", "plan": EXAMPLE_PLAN}], "split": "train"},
            ]
        },
    )

    lines: list[SubmissionLine] = Field(
        min_length=1, max_length=MAX_LINES, description="The submission JSONL, one object per line, in split order."
    )
    split: Literal["train", "validation", "test"] | None = Field(
        None,
        description="The split: its queries come from the operator's dataset folder unless `queries` are "
        "given, and official mode uses its fixed denominators.",
    )
    queries: list[TravelQuery] | None = Field(
        None, min_length=1, max_length=MAX_LINES, description="The split's queries with their structured fields."
    )
    mode: EvalMode = "official"
    backend: FormatterBackend | None = None
    allow_synthetic_flights: bool = Field(
        False,
        description="Score validation/test on a world whose flights are not the real ones (refused otherwise); marked.",
    )


class ScorerMetrics:
    def __init__(self) -> None:
        self.registry = Metrics("reward")
        self.plans = self.registry.counter("plans_scored_total", "Plans scored", ("mode", "formatter_status"))
        self.latency = self.registry.histogram("score_seconds", "Time to score one request", ("route",))

    def observe(self, score: Score) -> None:
        self.plans.labels(score.mode, score.formatter_status).inc()


@dataclass
class RewardApp:
    """What the routes read from `app.state.reward`: the settings, the metrics, the scorer handed to create_app
    (if any) and, once the lifespan has loaded the world, the scorer (or why there is none) and its work threads."""

    settings: Settings
    metrics: ScorerMetrics
    given: Scorer | None = None
    scorer: Scorer | None = None
    problem: str | None = None
    worker: Worker | None = None


def reward_app(request: Request) -> RewardApp:
    return request.app.state.reward


def current(state: RewardApp) -> Scorer:
    """The scorer; 503 with the reason while there is none."""
    if state.scorer is None:
        raise HTTPException(503, state.problem or "the travel world is not loaded")
    return state.scorer


def worker(state: RewardApp) -> Worker:
    return state.worker or Worker()


def fail(exc: ScoreError) -> HTTPException:
    return HTTPException(422, str(exc))


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: RewardApp = app.state.reward
    settings = state.settings
    world = None
    if state.given is not None:
        state.scorer = state.given
    else:
        world = World(settings.world_url)
        state.problem = world.problem()
        if state.problem is None:
            state.scorer = Scorer(
                Evaluator(world), Formatter.from_settings(settings), default_backend=settings.formatter_backend
            )
    # Scoring is CPU work off the event loop (so /healthz answers meanwhile), with a time limit
    # per request; when it may wait on the LLM formatter, as many threads as the LLM client
    # sends requests, and the formatting deadline on top of the limit.
    if state.scorer is not None and state.scorer.formatter.blocking:
        state.worker = Worker(
            threads=max(WORK_THREADS, settings.formatter_concurrency),
            time_limit_s=REQUEST_TIME_LIMIT_S + settings.formatter_deadline_s,
        )
    else:
        state.worker = Worker()
    yield
    if state.scorer is not None and state.given is None:
        state.scorer.close()
    if world is not None:
        world.close()


async def too_deep(_req: Request, _exc: RecursionError) -> JSONResponse:
    return problem(422, "Invalid request", "the JSON body is nested too deeply")


router = APIRouter(route_class=GuardedRoute)


@router.post(
    "/score",
    tags=["score"],
    response_model=ScoreResponse,
    summary="Score one plan: per-check verdicts, the five scores, every reward",
)
async def score(request: ScoreRequest, state: RewardApp = Depends(reward_app)) -> Response:
    s = current(state)
    with state.metrics.latency.labels("score").time():
        try:
            out = await worker(state).run(s.score, request)
        except ScoreError as exc:
            raise fail(exc) from None
    state.metrics.observe(out.score)
    return _json(out)


@router.post(
    "/score/batch",
    tags=["score"],
    response_model=ScoreBatchResponse,
    summary=f"Score up to {MAX_BATCH_ITEMS} plans; results in request order, errors per item",
)
async def score_batch(request: ScoreBatchRequest, state: RewardApp = Depends(reward_app)) -> Response:
    s = current(state)
    with state.metrics.latency.labels("score_batch").time():
        try:
            out = await worker(state).run(s.score_batch, request.items, deadline=True)
        except ScoreError as exc:
            raise fail(exc) from None
    for r in out:
        if isinstance(r, ScoreResponse):
            state.metrics.observe(r.score)
    return _json(ScoreBatchResponse(results=out))


@router.post(
    "/evaluate",
    tags=["evaluate"],
    response_model=SplitMetrics,
    summary="Leaderboard metrics of a set of (query, plan) items",
)
async def evaluate(request: EvaluateRequest, state: RewardApp = Depends(reward_app)) -> SplitMetrics:
    s = current(state)
    with state.metrics.latency.labels("evaluate").time():
        try:
            return await worker(state).run(s.evaluate_split, request, deadline=True)
        except ScoreError as exc:
            raise fail(exc) from None


@router.post(
    "/submission",
    tags=["evaluate"],
    response_model=SubmissionReport,
    summary="Score an official submission: leaderboard metrics, per-plan verdicts, tables, costs",
)
async def submission(request: SubmissionRequest, state: RewardApp = Depends(reward_app)) -> Response:
    s = current(state)
    try:
        if request.queries is not None:
            queries = queries_from(request.queries)
        elif request.split is not None:
            queries = dataset_split(state.settings.travelplanner_dir, request.split)
        else:
            raise SubmissionError("give the split (its queries come from the dataset folder) or the queries")
    except SubmissionError as exc:
        raise HTTPException(422, str(exc)) from None

    def run(deadline: Any = None) -> SubmissionReport:
        return score_submission(
            s,
            queries,
            request.lines,
            mode=request.mode,
            split=request.split,
            backend=request.backend,
            allow_synthetic_flights=request.allow_synthetic_flights,
            deadline=deadline,
        )

    with state.metrics.latency.labels("submission").time():
        try:
            report = await worker(state).run(run, deadline=True)
        except ScoreError as exc:
            raise fail(exc) from None
    return _json(report)


@router.get("/world", tags=["evaluate"], summary="Which world the scorer reads: hash, source, kind")
async def world_info(state: RewardApp = Depends(reward_app)) -> dict:
    return current(state).world


@router.get("/checks", tags=["evaluate"], summary="The checks, their names and the mode differences")
async def checks() -> dict:
    from services.reward.evaluator import COMMONSENSE_CHECKS, HARD_CHECKS, MODE_DIFFERENCES

    return {"commonsense": COMMONSENSE_CHECKS, "hard": HARD_CHECKS, "mode_differences": list(MODE_DIFFERENCES)}


def create_app(settings: Settings | None = None, scorer: Scorer | None = None) -> FastAPI:
    settings = settings or get_settings()
    configure_logging("reward", settings.log_level, settings.log_json)
    state = RewardApp(settings, ScorerMetrics(), given=scorer)
    app = create_service_app(
        service="reward",
        title="STAR reward",
        version=VERSION,
        metrics=state.metrics.registry,
        ready=lambda: state.scorer is not None,
        max_body_bytes=settings.max_body_bytes,
        description="The TravelPlanner evaluator (official parity and strict modes) and the RL rewards: "
        "score a plan (JSON or text), a batch, or a whole split.",
    )
    app.state.reward = state
    app.router.lifespan_context = lifespan
    app.add_exception_handler(RecursionError, too_deep)
    app.include_router(router)
    return app


def _json(model: BaseModel) -> Response:
    """Serialise once with orjson (the model is already validated; FastAPI would validate it again)."""
    return Response(orjson.dumps(model.model_dump(mode="json")), media_type="application/json")
