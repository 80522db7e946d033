"""Scoring requests: plan or plan text → formatter → evaluator → rewards.

One code path for the REST API (`app.py`), the trajectory worker (`worker.py`) and the CLI, so a
plan scores the same wherever it comes from. No FastAPI here: errors are `ScoreError`s with a
message a client can act on.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.schemas import (
    EvalMode,
    Plan,
    PreferencePenalty,
    RewardKind,
    Score,
    ScoredTrajectory,
    Trajectory,
    TravelQuery,
)
from services.formatter.core import Formatter, FormatResult, LLMUnavailable
from services.formatter.structured import MAX_TEXT_CHARS
from services.reward.evaluator import Evaluation, Evaluator, PlanError, SplitMetrics, aggregate
from services.reward.evaluator import hard as hard_checks
from services.reward.evaluator.aggregate import Split, not_delivered
from services.reward.evaluator.context import Context
from services.reward.rewards import all_rewards, reward

FormatterBackend = Literal["structured", "llm", "auto"]
MAX_BATCH = 512
MAX_EVALUATE = 1000  # the test split


class ScoreError(ValueError):
    """A request that cannot be scored (a 4xx): the message says why."""


class PlanInput(BaseModel):
    """A plan as JSON (the benchmark's day list, or {"days": [...]}) or as the agent's text."""

    model_config = ConfigDict(extra="forbid")

    query: TravelQuery
    plan: Any = Field(None, description="Day objects (JSON array) or {\"days\": [...]}; null: no plan delivered.")
    plan_text: str | None = Field(None, max_length=MAX_TEXT_CHARS, description="The plan as text, for the formatter.")

    @model_validator(mode="after")
    def _one_plan(self) -> PlanInput:
        if self.plan is not None and self.plan_text is not None:
            raise ValueError("give either plan or plan_text, not both")
        return self


class ScoreRequest(PlanInput):
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


class EvaluateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[PlanInput] = Field(min_length=1, max_length=MAX_EVALUATE)
    split: Split | None = Field(None, description="Official split name: its fixed denominators (official mode).")
    mode: EvalMode = "official"
    backend: FormatterBackend | None = None


@dataclass
class Scored:
    evaluation: Evaluation
    plan: Plan | None
    formatted: FormatResult | None


class Scorer:
    """The evaluator in both modes over one world, plus the formatter."""

    def __init__(self, evaluator: Evaluator, formatter: Formatter | None = None, *, default_backend: str = "auto") -> None:
        self.evaluators = {"official": evaluator.with_mode("official"), "strict": evaluator.with_mode("strict")}
        self.formatter = formatter or Formatter(None)
        self.default_backend = default_backend

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
        return ScoreResponse(score=score, reward=chosen, rewards=all_rewards(score, request.epoch),
                             cost=scored.evaluation.cost, plan=scored.plan, formatter=outcome)

    def score_batch(self, requests: Sequence[ScoreRequest], *, parallel: int = 8) -> list[ScoreResponse]:
        """Results in request order. When formatting may wait on an LLM, up to `parallel` requests
        are in flight at once (the LLM client's own concurrency limit still applies)."""
        if len(requests) > MAX_BATCH:
            raise ScoreError(f"a batch holds at most {MAX_BATCH} requests, got {len(requests)}")

        def one(i: int) -> ScoreResponse:
            try:
                return self.score(requests[i])
            except ScoreError as exc:
                raise ScoreError(f"item {i}: {exc}") from None

        needs_llm = any(r.plan_text is not None for r in requests) and self.formatter.blocking
        if not needs_llm or parallel <= 1 or len(requests) <= 1:
            return [one(i) for i in range(len(requests))]
        with ThreadPoolExecutor(max_workers=min(parallel, len(requests)), thread_name_prefix="score") as pool:
            return list(pool.map(one, range(len(requests))))

    # -- a split -------------------------------------------------------------------------------

    def evaluate_split(self, request: EvaluateRequest) -> SplitMetrics:
        evaluations = [self.evaluate(item, request.mode, request.backend, lenient=True).evaluation
                       for item in request.items]
        try:
            return aggregate([i.query for i in request.items], evaluations, mode=request.mode, split=request.split)
        except ValueError as exc:
            raise ScoreError(str(exc)) from None

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
            chosen = reward(score, trajectory.reward_kind, trajectory.epoch,  # type: ignore[arg-type]
                            finish_reason=trajectory.finish_reason, preference_penalty=trajectory.preference_penalty)
        except ValueError as exc:
            raise ScoreError(str(exc)) from None
        # The paper's curriculum only when the trajectory asked for it: a recipe's own schedule arrives
        # resolved to its stage's kind (services/pipeline/scheduler.py), and the default would misname it.
        curriculum_epoch = trajectory.epoch if trajectory.reward_kind == "curriculum" else None
        rewards = all_rewards(score, curriculum_epoch, finish_reason=trajectory.finish_reason)
        return ScoredTrajectory(**trajectory.model_dump(), score=score, reward=chosen, rewards=rewards,
                                plan=scored.plan)
