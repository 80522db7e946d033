"""One TravelPlanner episode for any trainer: start it for a query, call tools inside it, finish it with a plan
and get the reward with every check's verdict in both modes, close it or let it expire.

The state lives in Redis (`store.py`), so any instance of the service can serve any episode and a restart
loses none. Tools run in the sandbox service over HTTP; a plan is scored by the reward service's own code
(`Scorer.score`, the code of `star score` and `POST /score`), in official and strict mode. A finish claims
the episode under a short lock that its request keeps fresh while it scores: a second finish meanwhile
waits for the first's result, and one after it reads the stored result, so an episode is scored once. A
scoring process killed mid-way leaves a lock that lapses within seconds, and the next finish scores.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from services.common.metrics import Metrics
from services.common.schemas import (
    EpisodeFinish,
    EpisodeLimits,
    EpisodeResult,
    EpisodeScores,
    EpisodeStart,
    EpisodeStarted,
    EpisodeState,
    EpisodeSuccess,
    EpisodeToolCall,
    EpisodeToolResult,
    ModeVerdicts,
    Plan,
    PlanDay,
    TravelQuery,
)
from services.episodes.queries import QueryCatalog, QueryNotFound
from services.episodes.store import EpisodeStore
from services.episodes.tools import BadToolCall, SandboxTools, ToolsUnavailable, check_call
from services.reward.scoring import ScoreError, Scorer, ScoreRequest, ScoreResponse
from services.rollout.protocol import system_prompt, user_message
from services.sandbox.tools.registry import tool_schemas

MODES = ("official", "strict")
LOCK_MS = 5000  # a killed scorer's claim lapses this soon
LOCK_REFRESH_S = 1.0
BUSY_WAIT_S = 30.0  # a finish waits this long for another request's scoring, then 503
BUSY_POLL_S = 0.05
NATIVE_CALL = "Call one of the tools you are given (function calling), with its arguments as a JSON object."

RunBlocking = Callable[..., Awaitable[Any]]


class EpisodeNotFound(LookupError):
    """No such episode: never started, closed, or expired (404)."""


class EpisodeFinished(RuntimeError):
    """The episode is finished, or being finished: no more tool calls (409)."""


class ToolBudgetSpent(RuntimeError):
    """The episode has made all its tool calls (429)."""


class TooManyEpisodes(RuntimeError):
    """The client holds as many open episodes as it may (429)."""


class InvalidRequest(ValueError):
    """A request the episode cannot take: a limit asked beyond the service's, a value that is no plan (422)."""


class ScoringBusy(RuntimeError):
    """Another request is scoring this episode and has not finished yet (503, retry)."""


__all__ = [
    "BadToolCall",
    "EpisodeFinished",
    "EpisodeNotFound",
    "EpisodeService",
    "InvalidRequest",
    "QueryNotFound",
    "ScoringBusy",
    "ToolBudgetSpent",
    "ToolsUnavailable",
    "TooManyEpisodes",
]


@dataclass(frozen=True)
class EpisodeLimitsConfig:
    max_tool_calls: int = 60
    idle_expiry_s: float = 900.0
    max_open_per_client: int = 256

    @property
    def idle_ms(self) -> int:
        return max(1, int(self.idle_expiry_s * 1000))


class EpisodeMetrics:
    def __init__(self) -> None:
        self.registry = Metrics("episodes")
        self.started = self.registry.counter("started_total", "Episodes started", ("source",))
        self.finished = self.registry.counter("finished_total", "Episodes scored", ("success_strict",))
        self.replayed = self.registry.counter("finish_replays_total", "Finishes answered with the stored result")
        self.closed = self.registry.counter("closed_total", "Episodes closed")
        self.tool_calls = self.registry.counter("tool_calls_total", "Tool calls run", ("tool", "outcome"))
        self.refused = self.registry.counter("refused_total", "Requests refused", ("reason",))
        self.tool_latency = self.registry.histogram("tool_call_seconds", "Tool call time, sandbox round trip included")
        self.score_latency = self.registry.histogram("score_seconds", "Time to score a finished episode (both modes)")


def _to_thread(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    return asyncio.to_thread(fn, *args)


class EpisodeService:
    def __init__(
        self,
        store: EpisodeStore,
        catalog: QueryCatalog,
        tools: SandboxTools,
        scorer: Scorer,
        limits: EpisodeLimitsConfig,
        *,
        metrics: EpisodeMetrics | None = None,
        run_blocking: RunBlocking = _to_thread,
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.tools = tools
        self.scorer = scorer
        self.limits = limits
        self.metrics = metrics or EpisodeMetrics()
        self.run_blocking = run_blocking

    # -- start ---------------------------------------------------------------------------------

    async def start(self, request: EpisodeStart, caller: str) -> EpisodeStarted:
        max_calls = request.max_tool_calls or self.limits.max_tool_calls
        if max_calls > self.limits.max_tool_calls:
            self.metrics.refused.labels("limit").inc()
            raise InvalidRequest(f"max_tool_calls may be at most {self.limits.max_tool_calls} on this service")
        query = request.query or await self.run_blocking(self.catalog.query, request.split, request.query_id)
        episode_id = secrets.token_urlsafe(16)
        client = request.client or caller
        spec = {
            "query": query.model_dump(mode="json"),
            "reward": request.reward,
            "mode": request.mode,
            "epoch": request.epoch,
            "tool_format": request.tool_format,
            "client": client,
            "split": request.split,
            "query_id": request.query_id,
        }
        if not await self.store.create(
            episode_id, spec, max_calls, self.limits.idle_ms, self.limits.max_open_per_client
        ):
            self.metrics.refused.labels("open_episodes").inc()
            raise TooManyEpisodes(
                f"client {client!r} already holds {self.limits.max_open_per_client} open "
                "episodes; finish or close some first"
            )
        self.metrics.started.labels("inline" if request.query is not None else "split").inc()
        return EpisodeStarted(
            episode_id=episode_id,
            task=user_message(query),
            system_prompt=prompt_for(request.tool_format),
            tools=tool_schemas("openai"),
            limits=self._limits(max_calls),
            query=query,
            reward=request.reward,
            mode=request.mode,
        )

    def _limits(self, max_calls: int) -> EpisodeLimits:
        return EpisodeLimits(max_tool_calls=max_calls, idle_expiry_s=self.limits.idle_expiry_s)

    # -- tools ---------------------------------------------------------------------------------

    async def call_tool(self, episode_id: str, call: EpisodeToolCall) -> EpisodeToolResult:
        try:
            name = check_call(call.name, call.arguments)
        except BadToolCall:
            self.metrics.refused.labels("bad_tool_call").inc()
            raise
        reservation = await self.store.reserve(episode_id, self.limits.idle_ms)
        if reservation.code == 0:
            raise EpisodeNotFound(_not_found(episode_id))
        if reservation.code == -1:
            raise EpisodeFinished(f"episode {episode_id} is finished; it takes no more tool calls")
        if reservation.code == -2:
            self.metrics.refused.labels("tool_budget").inc()
            raise ToolBudgetSpent(
                f"episode {episode_id} has made all its {reservation.max_tool_calls} tool calls; finish it"
            )
        started = time.perf_counter()
        try:
            result = await self.tools.call(name, call.arguments)
        except (ToolsUnavailable, BadToolCall):
            await self.store.refund(episode_id)  # the call never ran: it costs the episode nothing
            self.metrics.tool_calls.labels(name, "unavailable").inc()
            raise
        self.metrics.tool_latency.observe(time.perf_counter() - started)
        self.metrics.tool_calls.labels(name, "ok" if result.ok else "error").inc()
        return EpisodeToolResult(
            content=result.text,
            ok=result.ok,
            tool_calls_used=reservation.used,
            tool_calls_left=max(0, reservation.max_tool_calls - reservation.used),
        )

    # -- finish --------------------------------------------------------------------------------

    async def finish(self, episode_id: str, request: EpisodeFinish) -> EpisodeResult:
        token = secrets.token_hex(12)
        waited_until = time.monotonic() + BUSY_WAIT_S
        while True:
            claim = await self.store.claim(episode_id, token, LOCK_MS, self.limits.idle_ms)
            if claim.outcome == "missing":
                raise EpisodeNotFound(_not_found(episode_id))
            if claim.outcome == "done":
                self.metrics.replayed.inc()
                return EpisodeResult.model_validate(claim.result)
            if claim.outcome == "claimed":
                break
            if time.monotonic() > waited_until:
                raise ScoringBusy(f"episode {episode_id} is being scored by another request; retry for its result")
            await asyncio.sleep(BUSY_POLL_S)
        keeper = asyncio.create_task(self._keep_claim(episode_id, token))
        try:
            episode = await self.store.load(episode_id)
            if episode is None:
                raise EpisodeNotFound(_not_found(episode_id))
            started = time.perf_counter()
            result = await self.run_blocking(self.score, episode_id, episode.spec, episode.used, request)
            self.metrics.score_latency.observe(time.perf_counter() - started)
            stored = await self.store.store(
                episode_id, episode.spec["client"], token, result.model_dump(mode="json"), self.limits.idle_ms
            )
            if stored is None:
                raise EpisodeNotFound(f"episode {episode_id} was closed while it was scored")
            final = EpisodeResult.model_validate(stored)
            self.metrics.finished.labels(str(final.success.strict).lower()).inc()
            return final
        finally:
            keeper.cancel()
            await self.store.release(episode_id, token)

    async def _keep_claim(self, episode_id: str, token: str) -> None:
        while True:
            await asyncio.sleep(LOCK_REFRESH_S)
            await self.store.extend(episode_id, token, LOCK_MS)

    def score(self, episode_id: str, spec: dict[str, Any], used: int, request: EpisodeFinish) -> EpisodeResult:
        """Score the plan in both modes with the reward service's code (blocking: CPU work)."""
        query = TravelQuery.model_validate(spec["query"])
        kind = request.reward or spec["reward"]
        epoch = request.epoch or spec.get("epoch")
        if kind == "curriculum" and epoch is None:
            raise InvalidRequest("the curriculum reward needs the epoch (give it at start or finish)")
        replies: dict[str, ScoreResponse] = {}
        for mode in MODES:
            try:
                replies[mode] = self.scorer.score(
                    ScoreRequest(
                        query=query, plan=request.plan, plan_text=request.answer, mode=mode, reward=kind, epoch=epoch
                    )
                )
            except ScoreError as exc:
                raise InvalidRequest(str(exc)) from None
        mode = spec["mode"]
        plan = replies["strict"].plan if request.answer is not None else json_plan(request.plan)
        return EpisodeResult(
            episode_id=episode_id,
            reward=replies[mode].reward,
            reward_kind=kind,
            mode=mode,
            success=EpisodeSuccess(
                official=replies["official"].score.success == 1, strict=replies["strict"].score.success == 1
            ),
            verdicts={m: ModeVerdicts(commonsense=r.score.commonsense, hard=r.score.hard) for m, r in replies.items()},
            scores={m: scores_of(r) for m, r in replies.items()},
            plan=plan,
            tool_calls_used=used,
        )

    # -- state and close -----------------------------------------------------------------------

    async def state(self, episode_id: str) -> EpisodeState:
        episode = await self.store.load(episode_id)
        if episode is None:
            raise EpisodeNotFound(_not_found(episode_id))
        spec = episode.spec
        return EpisodeState(
            episode_id=episode_id,
            status="finished" if episode.result else "open",
            query=TravelQuery.model_validate(spec["query"]),
            reward=spec["reward"],
            mode=spec["mode"],
            tool_calls_used=episode.used,
            tool_calls_left=max(0, episode.max_tool_calls - episode.used),
            limits=self._limits(episode.max_tool_calls),
            expires_in_s=max(0.0, episode.ttl_ms / 1000),
            result=EpisodeResult.model_validate(episode.result) if episode.result else None,
        )

    async def close(self, episode_id: str) -> None:
        episode = await self.store.load(episode_id)
        if episode is None:
            raise EpisodeNotFound(_not_found(episode_id))
        await self.store.delete(episode_id, episode.spec["client"])
        self.metrics.closed.inc()

    async def ready(self) -> bool:
        try:
            return await self.store.ping()
        except Exception:  # noqa: BLE001 - any Redis failure means not ready
            return False


def prompt_for(tool_format: str) -> str:
    if tool_format == "native":
        return system_prompt(call=NATIVE_CALL, tools_listed_elsewhere=True)
    return system_prompt()


def scores_of(reply: ScoreResponse) -> EpisodeScores:
    s = reply.score
    return EpisodeScores(
        cs_micro=s.cs_micro,
        cs_macro=s.cs_macro,
        hard_micro=s.hard_micro,
        hard_macro=s.hard_macro,
        success=s.success,
        formatter_status=s.formatter_status,
        rewards=reply.rewards,
        cost=reply.cost,
    )


def json_plan(value: Any) -> Plan | None:
    """A JSON plan as `Plan` (the benchmark's `{}` padding days dropped); None when it is not one."""
    days = value.get("days") if isinstance(value, dict) else value
    if not isinstance(days, list):
        return None
    try:
        return Plan(days=[PlanDay.model_validate(d) for d in days if isinstance(d, dict) and d])
    except ValueError:
        return None


def _not_found(episode_id: str) -> str:
    return f"no episode {episode_id}: it was never started, was closed, or expired"
