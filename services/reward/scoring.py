"""Scoring requests: plan or plan text → formatter → evaluator → rewards.

One code path for the REST API (`app.py`), the trajectory worker (`worker.py`) and the CLI, so a
plan scores the same wherever it comes from. No FastAPI here: errors are `ScoreError`s with a
message a client can act on.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.schemas import (
    EvalMode,
    Plan,
    PreferencePenalty,
    Provenance,
    RewardKind,
    Score,
    ScoredTrajectory,
    Trajectory,
    TravelQuery,
)
from services.formatter.core import FormatResult, Formatter, LLMUnavailable
from services.formatter.structured import MAX_TEXT_CHARS
from services.reward.evaluator import Evaluation, Evaluator, PlanError, SplitMetrics, aggregate, hard as hard_checks
from services.reward.evaluator.aggregate import Split, not_delivered
from services.reward.evaluator.context import Context
from services.reward.provenance import refusal, world_provenance
from services.reward.rewards import all_rewards, reward
from services.sandbox.world.store import world_identity

FormatterBackend = Literal["structured", "llm", "auto"]
MAX_BATCH = 1000  # the test split; the same as services.common.http.MAX_BATCH_ITEMS
MAX_EVALUATE = 1000


class Deadline(Protocol):
    """Stops a long loop between items (services.common.http.Deadline)."""

    def check(self) -> None: ...


EXAMPLE_QUERY = {
    "org": "St. Petersburg",
    "dest": "Rockford",
    "days": 3,
    "visiting_city_number": 1,
    "date": ["2022-03-16", "2022-03-17", "2022-03-18"],
    "people_number": 1,
    "budget": 1700,
    "local_constraint": {"house_rule": None, "cuisine": None, "room_type": None, "transportation": None},
    "level": "easy",
}
EXAMPLE_PLAN = [
    {
        "days": 1,
        "current_city": "from St. Petersburg to Rockford",
        "transportation": "Flight Number: F3573659, from St. Petersburg to Rockford, Departure Time: 15:40, "
        "Arrival Time: 17:04",
        "breakfast": "-",
        "attraction": "-",
        "lunch": "-",
        "dinner": "Coco Bambu, Rockford",
        "accommodation": "Pure luxury one bdrm + sofa bed on Central Park, Rockford",
    },
    {
        "days": 2,
        "current_city": "Rockford",
        "transportation": "-",
        "breakfast": "Dial A Cake, Rockford",
        "attraction": "Burpee Museum of Natural History, Rockford;Midway Village Museum, Rockford;",
        "lunch": "Flying Mango, Rockford",
        "dinner": "Cafe Southall, Rockford",
        "accommodation": "Pure luxury one bdrm + sofa bed on Central Park, Rockford",
    },
    {
        "days": 3,
        "current_city": "from Rockford to St. Petersburg",
        "transportation": "Flight Number: F3573120, from Rockford to St. Petersburg, Departure Time: 19:00, "
        "Arrival Time: 22:43",
        "breakfast": "Subway, Rockford",
        "attraction": "Klehm Arboretum & Botanic Garden, Rockford;",
        "lunch": "Gajalee Sea Food, Rockford",
        "dinner": "-",
        "accommodation": "-",
    },
]


class ScoreError(ValueError):
    """A request that cannot be scored (a 4xx): the message says why."""


class PlanInput(BaseModel):
    """A plan as JSON (the benchmark's day list, or {"days": [...]}) or as the agent's text."""

    model_config = ConfigDict(extra="forbid")

    query: TravelQuery
    plan: Any = Field(None, description='Day objects (JSON array) or {"days": [...]}; null: no plan delivered.')
    plan_text: str | None = Field(None, max_length=MAX_TEXT_CHARS, description="The plan as text, for the formatter.")

    @model_validator(mode="after")
    def _one_plan(self) -> PlanInput:
        if self.plan is not None and self.plan_text is not None:
            raise ValueError("give either plan or plan_text, not both")
        return self


class ScoreRequest(PlanInput):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"query": EXAMPLE_QUERY, "plan": EXAMPLE_PLAN, "mode": "official", "reward": "sum"},
                {
                    "query": EXAMPLE_QUERY,
                    "plan_text": "Day 1:\nCurrent City: from St. Petersburg to Rockford\n...",
                    "mode": "strict",
                    "reward": "curriculum",
                    "epoch": 1,
                    "backend": "structured",
                },
            ]
        },
    )

    mode: EvalMode = Field("official", description="official: leaderboard parity; strict: quirks fixed.")
    reward: RewardKind = Field("sum", description="The reward to report as `reward`.")
    epoch: int | None = Field(None, ge=1, le=10_000, description="1-based epoch (needed for curriculum).")
    preference_penalty: PreferencePenalty = 0.0
    backend: FormatterBackend | None = Field(None, description="Formatter backend for plan_text (default: settings).")

    @model_validator(mode="after")
    def _epoch_for_curriculum(self) -> ScoreRequest:
        if self.reward == "curriculum" and self.epoch is None:
            raise ValueError("the curriculum reward needs the epoch")
        return self


class FormatterOutcome(BaseModel):
    status: str
    backend: str
    error: str | None = None


class ScoreResponse(BaseModel):
    score: Score
    reward: float = Field(description="The requested reward kind (0 when no plan was scored).")
    rewards: dict[str, float] = Field(description="Every reward kind (curriculum when the epoch is given).")
    cost: float | None = Field(None, description="Total cost of the plan as the evaluator computes it.")
    plan: Plan | None = Field(None, description="The plan the formatter read from plan_text.")
    formatter: FormatterOutcome | None = Field(None, description="How plan_text was read (absent for JSON plans).")
    provenance: Provenance | None = Field(None, description="The world and mode that produced this score.")


class BatchItemError(BaseModel):
    """One item of a batch that could not be scored; the other items are scored regardless."""

    index: int = Field(description="0-based position of the item in the request.")
    status: int = Field(422, description="The HTTP status this item alone would have had.")
    detail: str = Field(description="Why the item cannot be scored.")


class EvaluateRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "items": [{"query": EXAMPLE_QUERY, "plan": EXAMPLE_PLAN}, {"query": EXAMPLE_QUERY, "plan": None}],
                    "mode": "official",
                }
            ]
        },
    )

    items: list[PlanInput] = Field(min_length=1, max_length=MAX_EVALUATE)
    split: Split | None = Field(None, description="Official split name: its fixed denominators (official mode).")
    mode: EvalMode = "official"
    backend: FormatterBackend | None = None
    allow_synthetic_flights: bool = Field(
        False,
        description="Score a validation or test split even though the world's flights are not the real "
        "ones (refused otherwise); the reply's provenance is then marked.",
    )


@dataclass
class Scored:
    evaluation: Evaluation
    plan: Plan | None
    formatted: FormatResult | None


class Scorer:
    """The evaluator in both modes over one world, plus the formatter."""

    def __init__(
        self, evaluator: Evaluator, formatter: Formatter | None = None, *, default_backend: str = "auto"
    ) -> None:
        self.evaluators = {"official": evaluator.with_mode("official"), "strict": evaluator.with_mode("strict")}
        self.formatter = formatter or Formatter(None)
        self.default_backend = default_backend
        try:
            meta = evaluator.index.world.meta()
        except Exception:  # noqa: BLE001 - a world without metadata still scores; provenance says unknown
            meta = {}
        self.provenance = {mode: world_provenance(meta, mode) for mode in ("official", "strict")}
        self.world = world_identity(meta)  # which world: the controller compares it with the sandbox's

    def close(self) -> None:
        self.formatter.close()

    # -- one plan ------------------------------------------------------------------------------

    def evaluate(self, item: PlanInput, mode: str, backend: str | None = None, *, lenient: bool = False) -> Scored:
        """Format (when text) and evaluate one plan. A value that is not a plan is a `ScoreError`,
        or (lenient, as in a split) a delivered plan failing everything."""
        evaluator = self.evaluators[mode]
        formatted = None
        plan: Any = item.plan
        status = "ok"
        if item.plan_text is not None:
            formatted = self._format(item.plan_text, item.query, backend)
            plan, status = formatted.plan, formatted.status
        try:
            evaluation = evaluator.evaluate(item.query, plan, formatter_status=status)
        except PlanError as exc:
            if not lenient:
                raise ScoreError(f"plan: {exc}") from None
            applicable = hard_checks.applicable(Context(query=item.query, index=evaluator.index, days=[], n=0))
            evaluation = not_delivered(mode, applicable, f"invalid plan: {exc}", delivered=True)  # type: ignore[arg-type]
        return Scored(evaluation, formatted.plan if formatted else None, formatted)

    def _format(self, text: str, query: TravelQuery, backend: str | None) -> FormatResult:
        try:
            return self.formatter.format(text, query, backend or self.default_backend)  # type: ignore[arg-type]
        except LLMUnavailable as exc:
            raise ScoreError(str(exc)) from None
        except ValueError as exc:
            raise ScoreError(str(exc)) from None

    def score(self, request: ScoreRequest) -> ScoreResponse:
        scored = self.evaluate(request, request.mode, request.backend)
        score = scored.evaluation.to_score()
        try:
            chosen = reward(score, request.reward, request.epoch, preference_penalty=request.preference_penalty)
        except ValueError as exc:
            raise ScoreError(str(exc)) from None
        outcome = None
        if scored.formatted is not None:
            f = scored.formatted
            outcome = FormatterOutcome(status=f.status, backend=f.backend, error=f.error)
        return ScoreResponse(
            score=score,
            reward=chosen,
            rewards=all_rewards(score, request.epoch),
            cost=scored.evaluation.cost,
            plan=scored.plan,
            formatter=outcome,
            provenance=self.provenance[request.mode],
        )

    def score_batch(
        self, requests: Sequence[ScoreRequest], *, parallel: int = 8, deadline: Deadline | None = None
    ) -> list[ScoreResponse | BatchItemError]:
        """Results in request order; an item that cannot be scored is a `BatchItemError` in its
        place. When formatting may wait on an LLM, up to `parallel` requests are in flight at once
        (the LLM client's own concurrency limit still applies)."""
        if len(requests) > MAX_BATCH:
            raise ScoreError(f"a batch holds at most {MAX_BATCH} requests, got {len(requests)}")

        def one(i: int) -> ScoreResponse | BatchItemError:
            if deadline is not None:
                deadline.check()
            try:
                return self.score(requests[i])
            except ScoreError as exc:
                return BatchItemError(index=i, detail=str(exc))

        needs_llm = any(r.plan_text is not None for r in requests) and self.formatter.blocking
        if not needs_llm or parallel <= 1 or len(requests) <= 1:
            return [one(i) for i in range(len(requests))]
        with ThreadPoolExecutor(max_workers=min(parallel, len(requests)), thread_name_prefix="score") as pool:
            return list(pool.map(one, range(len(requests))))

    # -- a split -------------------------------------------------------------------------------

    def split_provenance(self, mode: str, split: str | None, allow_synthetic_flights: bool) -> Provenance:
        """The provenance of a split's scores; a `ScoreError` when the world cannot score that split
        (validation or test on flights that are not the real ones) and the caller did not insist."""
        provenance = self.provenance[mode]
        why = refusal(provenance, split)
        if why is None:
            return provenance
        if not allow_synthetic_flights:
            raise ScoreError(why)
        return provenance.model_copy(update={"synthetic_flights_insisted": True})

    def evaluate_items(
        self, items: Sequence[PlanInput], mode: str, backend: str | None = None, deadline: Deadline | None = None
    ) -> list[Scored]:
        out = []
        for item in items:
            if deadline is not None:
                deadline.check()
            out.append(self.evaluate(item, mode, backend, lenient=True))
        return out

    def evaluate_split(self, request: EvaluateRequest, deadline: Deadline | None = None) -> SplitMetrics:
        provenance = self.split_provenance(request.mode, request.split, request.allow_synthetic_flights)
        evaluations = [
            s.evaluation for s in self.evaluate_items(request.items, request.mode, request.backend, deadline)
        ]
        try:
            metrics = aggregate([i.query for i in request.items], evaluations, mode=request.mode, split=request.split)
        except ValueError as exc:
            raise ScoreError(str(exc)) from None
        return metrics.model_copy(update={"provenance": provenance})

    # -- a trajectory (the RL loop) ------------------------------------------------------------

    def score_trajectory(self, trajectory: Trajectory, backend: str | None = None) -> ScoredTrajectory:
        """Score the trajectory's answer against its own query, mode, reward kind and epoch. No
        answer (any finish reason but "answer") or an answer the formatter cannot read scores 0."""
        if trajectory.query is None:
            raise ScoreError("the trajectory carries no query; it cannot be scored")
        if trajectory.eval_mode not in self.evaluators:
            raise ScoreError(f"unknown eval_mode {trajectory.eval_mode!r} (use official or strict)")
        if trajectory.finish_reason == "answer":
            item = PlanInput(query=trajectory.query, plan_text=(trajectory.answer or "")[:MAX_TEXT_CHARS])
            scored = self.evaluate(item, trajectory.eval_mode, backend, lenient=True)
        else:
            status = "empty_answer" if trajectory.finish_reason == "format_error" else trajectory.finish_reason
            evaluation = self.evaluators[trajectory.eval_mode].evaluate(trajectory.query, None, formatter_status=status)
            scored = Scored(evaluation, None, None)
        score = scored.evaluation.to_score()
        try:
            chosen = reward(
                score,
                trajectory.reward_kind,
                trajectory.epoch,  # type: ignore[arg-type]
                finish_reason=trajectory.finish_reason,
                preference_penalty=trajectory.preference_penalty,
            )
        except ValueError as exc:
            raise ScoreError(str(exc)) from None
        # The paper's curriculum only when the trajectory asked for it: a recipe's own schedule arrives
        # resolved to its stage's kind (services/controller/scheduler.py), and the default would misname it.
        curriculum_epoch = trajectory.epoch if trajectory.reward_kind == "curriculum" else None
        rewards = all_rewards(score, curriculum_epoch, finish_reason=trajectory.finish_reason)
        return ScoredTrajectory(
            **trajectory.model_dump(), score=score, reward=chosen, rewards=rewards, plan=scored.plan
        )
