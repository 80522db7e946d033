"""Per-plan scores and split-level metrics (spec travelplanner.md §6.6, §7; paper-recipe.md).

Per plan (Agent-STAR's `eval_one_sample`, agent-star.md §4.2):
- cs_micro = passed commonsense checks / 8; cs_macro = all 8 passed;
- hard_micro = passed applicable hard constraints / applicable ones (0 when the hard checks were
  gated off); hard_macro = hard checks ran and none failed; success = cs_macro and hard_macro;
- an undelivered plan scores 0 everywhere.

Over a split (the official `eval.py`): delivery rate, commonsense micro (passes / 8N), commonsense
macro, hard micro (passes / D_h, D_h = Σ over all queries of 1 + asked-for local constraints),
hard macro and final pass rate, as percentages. The official mode uses the hard-coded
denominators of the named split (train 45/360/105, validation 180/1440/420, test 1000/8000/2290);
the strict mode, or a split of None, computes them from the queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from services.common.schemas import CheckVerdict, Provenance, Score, TravelQuery
from services.reward.evaluator.commonsense import COMMONSENSE_CHECKS
from services.reward.evaluator.hard import HARD_CHECKS

Mode = Literal["official", "strict"]
# Formatter statuses that say the formatter itself failed (services/formatter/core.py), not the plan:
# the RL loop retries them; split metrics count them apart.
FORMATTER_OUTAGES = ("llm_error", "timeout")
Split = Literal["train", "validation", "test"]

# split → (queries, commonsense-micro denominator, hard-micro denominator), as eval.py hard-codes them
OFFICIAL_DENOMINATORS: dict[str, tuple[int, int, int]] = {
    "train": (45, 360, 105),
    "validation": (180, 1440, 420),
    "test": (1000, 8000, 2290),
}


@dataclass
class Evaluation:
    """Everything the evaluator found about one plan (a `Score` is its public summary)."""

    mode: Mode
    delivered: bool
    commonsense: dict[str, CheckVerdict] = field(default_factory=dict)
    hard: dict[str, CheckVerdict] = field(default_factory=dict)
    hard_evaluated: bool = False  # the two gates passed and the hard checks ran
    applicable: dict[str, bool] = field(default_factory=dict)
    cost: float | None = None
    malformed: list[str] = field(default_factory=list)  # checks the official evaluator would crash in
    formatter_status: str = "ok"

    @property
    def cs_passed(self) -> int:
        return sum(v.passed is True for v in self.commonsense.values())

    @property
    def hard_passed(self) -> int:
        return sum(v.passed is True for v in self.hard.values()) if self.hard_evaluated else 0

    @property
    def hard_total(self) -> int:
        return sum(self.applicable.values())

    @property
    def cs_all(self) -> bool:
        return self.delivered and all(v.passed is True for v in self.commonsense.values())

    @property
    def hard_all(self) -> bool:
        return self.hard_evaluated and not any(v.passed is False for v in self.hard.values())

    def to_score(self) -> Score:
        cs_macro = float(self.cs_all)
        hard_macro = float(self.hard_all)
        return Score(
            mode=self.mode,
            commonsense=self.commonsense,
            hard=self.hard,
            cs_micro=self.cs_passed / len(COMMONSENSE_CHECKS) if self.delivered else 0.0,
            cs_macro=cs_macro,
            hard_micro=self.hard_passed / self.hard_total if self.hard_total else 0.0,
            hard_macro=hard_macro,
            success=float(cs_macro and hard_macro),
            formatter_status=self.formatter_status,
        )


def not_delivered(
    mode: Mode, applicable: dict[str, bool], reason: str, *, delivered: bool = False, formatter_status: str = "ok"
) -> Evaluation:
    """An evaluation in which every check failed for one reason (no plan, or an unreadable one)."""
    return Evaluation(
        mode=mode,
        delivered=delivered,
        commonsense={k: CheckVerdict(passed=False, reason=reason) for k in COMMONSENSE_CHECKS},
        hard={
            k: CheckVerdict(
                passed=False if applicable[k] else None,
                reason=reason if applicable[k] else "the query does not ask for it",
            )
            for k in HARD_CHECKS
        },
        applicable=applicable,
        formatter_status=formatter_status,
    )


class SplitCounts(BaseModel):
    queries: int
    delivered: int
    cs_passed: int
    cs_total: int
    cs_macro_passed: int
    hard_passed: int
    hard_total: int
    hard_macro_passed: int
    final_passed: int
    formatter_outages: int = Field(
        0,
        description="Plans not delivered because the formatter failed (llm_error, "
        "timeout), not the agent: score them again once it is back.",
    )


class SplitMetrics(BaseModel):
    """The leaderboard's six numbers, in percent, with the counts behind them."""

    split: Split | None = None
    mode: Mode = "official"
    delivery_rate: float = Field(description="Plans delivered / N, in %.")
    cs_micro: float = Field(description="Commonsense Constraint Micro Pass Rate, in %.")
    cs_macro: float = Field(description="Commonsense Constraint Macro Pass Rate, in %.")
    hard_micro: float = Field(description="Hard Constraint Micro Pass Rate, in %.")
    hard_macro: float = Field(description="Hard Constraint Macro Pass Rate, in %.")
    final_pass_rate: float = Field(description="Final Pass Rate (success), in %.")
    counts: SplitCounts
    provenance: Provenance | None = Field(None, description="The world and mode that produced these numbers.")

    def table(self) -> str:
        rows = [
            ("Delivery Rate", self.delivery_rate),
            ("Commonsense Micro", self.cs_micro),
            ("Commonsense Macro", self.cs_macro),
            ("Hard Micro", self.hard_micro),
            ("Hard Macro", self.hard_macro),
            ("Final Pass Rate", self.final_pass_rate),
        ]
        return "\n".join(f"{name:<20}{value:7.2f}%" for name, value in rows)


def hard_denominator(queries: Sequence[TravelQuery]) -> int:
    """Σ over queries of 1 (budget) + the local constraints it asks for."""
    return sum(
        1
        + bool(q.local_constraint.cuisine)
        + (q.local_constraint.house_rule is not None)
        + (q.local_constraint.room_type is not None)
        + (q.local_constraint.transportation is not None)
        for q in queries
    )


def aggregate(
    queries: Sequence[TravelQuery],
    evaluations: Sequence[Evaluation],
    *,
    mode: Mode = "official",
    split: Split | None = None,
) -> SplitMetrics:
    if len(queries) != len(evaluations):
        raise ValueError(f"{len(queries)} queries but {len(evaluations)} plans; give one plan (or None) per query")
    if mode == "official" and split is not None:
        n, cs_total, hard_total = OFFICIAL_DENOMINATORS[split]
        if len(queries) != n:
            raise ValueError(
                f"the official {split} split has {n} queries, got {len(queries)}; "
                f"pass split=None to use computed denominators"
            )
    else:
        n, cs_total, hard_total = len(queries), 8 * len(queries), hard_denominator(queries)
    counts = SplitCounts(
        queries=n,
        delivered=sum(e.delivered for e in evaluations),
        cs_passed=sum(e.cs_passed for e in evaluations if e.delivered),
        cs_total=cs_total,
        cs_macro_passed=sum(e.cs_all and e.hard_evaluated for e in evaluations),
        hard_passed=sum(e.hard_passed for e in evaluations),
        hard_total=hard_total,
        hard_macro_passed=sum(e.hard_all for e in evaluations),
        final_passed=sum(e.cs_all and e.hard_all for e in evaluations),
        formatter_outages=sum(e.formatter_status in FORMATTER_OUTAGES for e in evaluations),
    )

    def pct(num: int, den: int) -> float:
        return 100.0 * num / den if den else 0.0

    return SplitMetrics(
        split=split,
        mode=mode,
        delivery_rate=pct(counts.delivered, n),
        cs_micro=pct(counts.cs_passed, cs_total),
        cs_macro=pct(counts.cs_macro_passed, n),
        hard_micro=pct(counts.hard_passed, hard_total),
        hard_macro=pct(counts.hard_macro_passed, n),
        final_pass_rate=pct(counts.final_passed, n),
        counts=counts,
    )
