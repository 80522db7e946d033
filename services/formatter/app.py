"""HTTP face of the formatter: `POST /format` turns plan text into a plan.

Run with `star formatter serve` (or `uvicorn --factory services.formatter.app:create_app`).
A formatting failure is not an HTTP error: the reply is 200 with `status` and `error`; 4xx is
for requests that are malformed, 503 for an LLM backend that is not configured.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from services.common.http import GuardedRoute, Worker, create_app as create_service_app
from services.common.logging import configure_logging
from services.common.metrics import Metrics
from services.common.schemas import Plan, TravelQuery
from services.common.settings import Settings, get_settings
from services.formatter.core import FormatResult, Formatter, LLMUnavailable
from services.formatter.structured import MAX_TEXT_CHARS

VERSION = "0.1.0"


class FormatRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "plan_text": "Day 1:\nCurrent City: from Sarasota to Chicago\nTransportation: "
                    "Flight Number: F3573659, from Sarasota to Chicago, Departure Time: 15:40, "
                    "Arrival Time: 17:04\nBreakfast: -\n"
                    "Attraction: -\nLunch: -\nDinner: Coco Bambu, Chicago\nAccommodation: Cozy Room, Chicago",
                    "backend": "structured",
                },
                {
                    "plan_text": "On day 1 I fly F3573659 from Sarasota to Chicago and dine at Coco Bambu.",
                    "backend": "llm",
                    "query": {
                        "org": "Sarasota",
                        "dest": "Chicago",
                        "days": 3,
                        "visiting_city_number": 1,
                        "date": ["2022-03-22", "2022-03-23", "2022-03-24"],
                        "people_number": 1,
                        "budget": 1900,
                    },
                },
            ]
        },
    )

    query: TravelQuery | None = Field(
        None, description="The query the plan answers (gives the LLM context and the structured parser the day count)."
    )
    plan_text: str = Field(max_length=MAX_TEXT_CHARS, description="The agent's answer, as written.")
    backend: Literal["structured", "llm", "auto"] | None = Field(None, description="Default: STAR_FORMATTER_BACKEND.")


class FormatResponse(BaseModel):
    status: str = Field(description="ok | empty_answer | no_plan | invalid_output | llm_error | timeout")
    backend: str = Field(description="The backend that produced the result (rule: a skip rule decided).")
    plan: Plan | None = None
    error: str | None = None
    attempts: int = 0
    cached: bool = False


def to_response(result: FormatResult) -> FormatResponse:
    return FormatResponse(
        status=result.status,
        backend=result.backend,
        plan=result.plan,
        error=result.error,
        attempts=result.attempts,
        cached=result.cached,
    )


@dataclass
class FormatterApp:
    """What the routes read from `app.state.formatter`: the settings, the outcome counter, the work threads and,
    once the lifespan has started, the formatter (`given`: one handed to create_app, not closed here)."""

    settings: Settings
    outcomes: Any
    worker: Worker
    given: Formatter | None = None
    formatter: Formatter | None = None


def formatter_app(request: Request) -> FormatterApp:
    return request.app.state.formatter


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: FormatterApp = app.state.formatter
    state.formatter = state.given or Formatter.from_settings(state.settings, remote=False)
    yield
    if state.given is None:
        state.formatter.close()


router = APIRouter(route_class=GuardedRoute)


@router.post(
    "/format",
    tags=["format"],
    response_model=FormatResponse,
    response_model_exclude_none=True,
    summary="Turn plan text into a plan",
)
async def format_plan(request: FormatRequest, state: FormatterApp = Depends(formatter_app)) -> FormatResponse:
    backend = request.backend or state.settings.formatter_backend
    try:
        result = await state.worker.run(state.formatter.format, request.plan_text, request.query, backend)
    except LLMUnavailable as exc:
        raise HTTPException(503, str(exc)) from None
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    state.outcomes.labels(result.backend, result.status).inc()
    return to_response(result)


def create_app(settings: Settings | None = None, formatter: Formatter | None = None) -> FastAPI:
    settings = settings or get_settings()
    configure_logging("formatter", settings.log_level, settings.log_json)
    registry = Metrics("formatter")
    # Parsing 200K characters, or waiting on the LLM, happens off the event loop; as many at once
    # as the LLM client sends, each bounded by the formatting deadline.
    state = FormatterApp(
        settings,
        registry.counter("format_total", "Formatting outcomes", ("backend", "status")),
        Worker(threads=settings.formatter_concurrency, time_limit_s=settings.formatter_deadline_s + 5),
        given=formatter,
    )
    app = create_service_app(
        service="formatter",
        title="STAR formatter",
        version=VERSION,
        metrics=registry,
        ready=lambda: state.formatter is not None,
        max_body_bytes=settings.max_body_bytes,
        description="Plan text → TravelPlanner plan: an exact parser of the structured day-by-day form, "
        "and an LLM backend over any OpenAI-compatible chat API.",
    )
    app.state.formatter = state
    app.router.lifespan_context = lifespan
    app.include_router(router)
    return app
