"""State shared by the checks of one plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.schemas import TravelQuery
from services.reward.evaluator.lookup import WorldIndex
from services.reward.evaluator.plan import StrictDay

Verdict = tuple[bool | None, str]  # (passed, reason); reason names the offending day/field/value


@dataclass
class Context:
    query: TravelQuery
    index: WorldIndex
    days: list[Any]  # the raw day list (official checks read it as the official code does)
    n: int  # evaluated days: min(query.days, len(days))
    parties_typo: bool = False  # reproduce the pre-2024-04-26 'parities' typo (room rule)
    cursor: int | None = None  # 0-based day being read, for the reason of a malformed input
    strict: list[StrictDay] = field(default_factory=list)
    extra: list[int] = field(default_factory=list)  # strict: later days that have content
    cost: float | None = None  # set by the Budget check

    @property
    def constraint(self) -> dict[str, Any]:
        return self.query.local_constraint.to_official()

    def day(self, i: int) -> Any:
        self.cursor = i
        return self.days[i]


def short(value: Any, limit: int = 80) -> str:
    """A plan value quoted for a reason, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"
