"""`Evaluator`: scores one plan against one query, in official or strict mode."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from services.common.schemas import CheckVerdict, Plan, Score, TravelQuery
from services.reward.evaluator import commonsense, hard
from services.reward.evaluator.aggregate import (
    Evaluation,
    Mode,
    Split,
    SplitMetrics,
    aggregate,
    not_delivered,
)
from services.reward.evaluator.context import Context, Verdict
from services.reward.evaluator.lookup import WorldIndex
from services.reward.evaluator.plan import (
    PlanError,
    check_sizes,
    coerce_plan,
    strict_days,
)
from services.sandbox.world.store import World

# What the official code raises on malformed plans (spec §6.7); each makes that one check fail.
_CRASHES = (TypeError, AttributeError, KeyError, IndexError, ValueError)
GATES = ("is_not_absent", "is_valid_information_in_sandbox")
EMPTY_PLAN = "the plan names no transportation, meal, attraction or accommodation on any day"


def _crash_reason(exc: Exception, ctx: Context) -> str:
    where = f"day {ctx.cursor + 1}: " if ctx.cursor is not None else ""
    if isinstance(exc, KeyError):
        what = f"missing field {exc.args[0]!r}" if exc.args else "a missing field"
    elif isinstance(exc, (TypeError, AttributeError)):
        what = "a value of the wrong type or an unreadable 'from A to B'"
    elif isinstance(exc, IndexError):
        what = "a value without the expected form (e.g. no 'Flight Number: ')"
    else:
        what = "an unparseable value"
    return f"malformed plan: {where}{what} (the official evaluator raises {type(exc).__name__} here)"


class Evaluator:
    """The TravelPlanner evaluator over a `World`.

    mode: "official" reproduces the official evaluator verdict for verdict (spec §6, quirks of
    §8.2 included); "strict" fixes the quirks (see the package docstring).
    parties_typo: reproduce the pre-2024-04-26 'parities' typo of the room-rule check (official
    mode only; the Jan-2024 leaderboard copy had it).
    """

    def __init__(self, world: World | WorldIndex, mode: Mode = "official", *, parties_typo: bool = False) -> None:
        if mode not in ("official", "strict"):
            raise ValueError(f"mode must be 'official' or 'strict', not {mode!r}")
        self.index = world if isinstance(world, WorldIndex) else WorldIndex(world)
        self.mode: Mode = mode
        self.parties_typo = parties_typo and mode == "official"

    def with_mode(self, mode: Mode) -> Evaluator:
        """The same world caches, another mode."""
        return Evaluator(self.index, mode, parties_typo=self.parties_typo)

    # --- one plan -----------------------------------------------------------------------------
    def score(self, query: TravelQuery, plan: Plan | list | None, *, formatter_status: str = "ok") -> Score:
        """Per-check verdicts and the five scores. Raises `PlanError` when `plan` is not a plan."""
        return self.evaluate(query, plan, formatter_status=formatter_status).to_score()

    def evaluate(self, query: TravelQuery, plan: Any, *, formatter_status: str = "ok") -> Evaluation:
        """Like `score`, with the details (gating, cost, malformed checks)."""
        days = coerce_plan(plan)
        ctx = Context(query=query, index=self.index, days=days or [], n=0, parties_typo=self.parties_typo)
        applicable = hard.applicable(ctx)
        if days is None:
            return not_delivered(self.mode, applicable, "no plan was delivered", formatter_status=formatter_status)
        ctx.n = min(query.days, len(days))
        check_sizes(days, ctx.n)
        if self.mode == "strict":
            ctx.strict, ctx.extra = strict_days(days, query.days)
            if not any(day.present_fields for day in ctx.strict):
                # Checks that look for faults find none in a plan that names nothing: without this
                # an all-'-' plan would pass 5 of 8 commonsense checks and earn a reward.
                return not_delivered(
                    self.mode, applicable, EMPTY_PLAN, delivered=True, formatter_status=formatter_status
                )
        result = Evaluation(mode=self.mode, delivered=True, applicable=applicable, formatter_status=formatter_status)
        cs_fns, hard_fns = (
            (commonsense.OFFICIAL, hard.OFFICIAL) if self.mode == "official" else (commonsense.STRICT, hard.STRICT)
        )
        for key, fn in cs_fns.items():
            result.commonsense[key] = self._run(key, fn, ctx, result)
        result.hard_evaluated = all(result.commonsense[g].passed is True for g in GATES)
        for key, fn in hard_fns.items():
            if not applicable[key]:
                passed, reason = hard.NOT_ASKED
            elif not result.hard_evaluated:
                failed = [commonsense.COMMONSENSE_CHECKS[g] for g in GATES if result.commonsense[g].passed is not True]
                passed, reason = False, f"not checked: the plan failed {' and '.join(failed)}"
            else:
                verdict = self._run(key, fn, ctx, result)
                passed, reason = verdict.passed, verdict.reason
            result.hard[key] = CheckVerdict(passed=passed, reason=reason)
        result.cost = ctx.cost
        return result

    def _run(self, key: str, fn: Callable[[Context], Verdict], ctx: Context, result: Evaluation) -> CheckVerdict:
        ctx.cursor = None
        if self.mode == "strict":
            passed, reason = fn(ctx)
            return CheckVerdict(passed=passed, reason=reason)
        try:
            passed, reason = fn(ctx)
        except _CRASHES as exc:
            result.malformed.append(key)
            return CheckVerdict(passed=False, reason=_crash_reason(exc, ctx))
        return CheckVerdict(passed=passed, reason=reason)

    # --- a split ------------------------------------------------------------------------------
    def evaluate_many(self, queries: Sequence[TravelQuery], plans: Sequence[Any]) -> list[Evaluation]:
        """One evaluation per (query, plan); a plan that is not a plan counts as delivered and
        failing everywhere (the official evaluator would crash on it)."""
        if len(queries) != len(plans):
            raise ValueError(f"{len(queries)} queries but {len(plans)} plans; give one plan (or None) per query")
        out = []
        for query, plan in zip(queries, plans):
            try:
                out.append(self.evaluate(query, plan))
            except PlanError as exc:
                ctx = Context(query=query, index=self.index, days=[], n=0)
                out.append(not_delivered(self.mode, hard.applicable(ctx), f"invalid plan: {exc}", delivered=True))
        return out

    def evaluate_split(
        self, queries: Sequence[TravelQuery], plans: Sequence[Any], split: Split | None = None
    ) -> SplitMetrics:
        return aggregate(queries, self.evaluate_many(queries, plans), mode=self.mode, split=split)


def evaluate_split(
    world: World | WorldIndex | Evaluator,
    queries: Sequence[TravelQuery],
    plans: Sequence[Any],
    mode: Mode = "official",
    split: Split | None = None,
) -> SplitMetrics:
    """The leaderboard metrics of a whole split (official denominators when `split` is named)."""
    evaluator = world if isinstance(world, Evaluator) else Evaluator(world, mode)
    if evaluator.mode != mode:
        evaluator = evaluator.with_mode(mode)
    return evaluator.evaluate_split(queries, plans, split)
