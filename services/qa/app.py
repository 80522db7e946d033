"""HTTP face of the OOD tool set: `Search` over a local passage index.

Run with `star qa serve` (or `uvicorn --factory services.qa.app:create_app`); the index folder
comes from `STAR_QA_INDEX` (default `STAR_HOME/qa/index`), built by `star qa index`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from services.common.http import GuardedRoute, create_app as create_service_app
from services.common.logging import configure_logging
from services.common.metrics import Metrics
from services.common.schemas import ToolCall, ToolResult
from services.common.settings import Settings, get_settings
from services.qa.retriever import PassageIndex, RetrieverError, render_hits
from services.qa.tools import MAX_QUERY_CHARS, SearchToolSet
from services.sandbox.tools.toolbox import UnknownTool

VERSION = "0.1.0"


class SearchRequest(BaseModel):
    model_config = {"extra": "forbid"}

    query: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    top_k: int | None = Field(None, ge=1, le=100, description="Passages to return; default from settings.")


class SearchHit(BaseModel):
    id: str
    title: str
    text: str
    score: float


class SearchResponse(BaseModel):
    query: str
    hits: list[SearchHit]
    text: str = Field(description="The hits as the agent reads them (Doc i(Title: …) …).")


def index_dir(settings: Settings):
    return settings.qa_index or settings.home / "qa" / "index"


@dataclass
class QaApp:
    """What the routes read from `app.state.qa`: the settings, the latency histogram, the index handed to
    create_app (if any) and, once the lifespan has loaded it, the tool set or why it could not."""

    settings: Settings
    latency: Any
    given: PassageIndex | None = None
    tools: SearchToolSet | None = None
    problem: str | None = None


def qa_app(request: Request) -> QaApp:
    return request.app.state.qa


def tools(state: QaApp = Depends(qa_app)) -> SearchToolSet:
    """The loaded tool set; 503 with the reason while there is none."""
    if state.tools is None:
        raise HTTPException(503, state.problem or "the passage index is not loaded")
    return state.tools


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: QaApp = app.state.qa
    try:
        loaded = state.given or PassageIndex.load(index_dir(state.settings))
        _ = loaded.encoder  # load the model now, not on the first request
        state.tools = SearchToolSet(loaded, top_k=state.settings.qa_top_k)
    except RetrieverError as exc:
        state.problem = str(exc)
    yield


router = APIRouter(route_class=GuardedRoute)


@router.get("/tools", tags=["tools"], summary="Tool schemas (OpenAI function format) for agent prompts")
async def list_tools() -> list[dict]:
    return SearchToolSet.schemas()


@router.get("/index", tags=["tools"], summary="What index is loaded")
async def index_info(t: SearchToolSet = Depends(tools)) -> dict:
    return {"passages": len(t.index), "top_k": t.top_k, "meta": t.index.meta}


@router.post("/search", tags=["tools"], response_model=SearchResponse, summary="Top-k passages for a query")
async def search(request: SearchRequest, state: QaApp = Depends(qa_app)) -> SearchResponse:
    if not request.query.strip():
        raise HTTPException(422, "query must not be blank")
    t = tools(state)
    k = request.top_k or t.top_k
    with state.latency.time():
        hits = await run_in_threadpool(t.index.search, request.query.strip(), k)

    return SearchResponse(
        query=request.query,
        text=render_hits(hits),
        hits=[SearchHit(id=h.passage.id, title=h.passage.title, text=h.passage.text, score=h.score) for h in hits],
    )


@router.post("/tools/call", tags=["tools"], response_model=ToolResult, summary="Run one tool ({name, arguments})")
async def call_tool(call: ToolCall, state: QaApp = Depends(qa_app)) -> ToolResult:
    t = tools(state)
    try:
        with state.latency.time():
            return await run_in_threadpool(t.call, call.name, call.arguments)
    except UnknownTool:
        raise HTTPException(404, f"unknown tool {call.name!r}; known tools: Search") from None


def create_app(settings: Settings | None = None, index: PassageIndex | None = None) -> FastAPI:
    settings = settings or get_settings()
    configure_logging("qa", settings.log_level, settings.log_json)
    metrics = Metrics("qa")
    state = QaApp(settings, metrics.histogram("search_seconds", "Search latency (encode + scan)", ()), given=index)
    app = create_service_app(
        service="qa",
        title="STAR OOD search",
        version=VERSION,
        metrics=metrics,
        ready=lambda: state.tools is not None,
        max_body_bytes=settings.max_body_bytes,
        description="Dense passage search over a local corpus: the tool set of the OOD QA evaluation.",
    )
    app.state.qa = state
    app.router.lifespan_context = lifespan
    app.include_router(router)
    return app
