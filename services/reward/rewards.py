"""Reward shaping from a plan's `Score` (paper-recipe.md, "Rewards").

- sum     = cs_micro + cs_macro + hard_micro + hard_macro + success   (0..5)
- macro   = cs_macro + hard_macro + success                           (0..3)
- success = success                                                   (0 or 1)
- curriculum: an epoch schedule over the three; the paper's default is sum for epochs 1–2,
  macro for epochs 3–4, success from epoch 5 on. Its stages may count RL steps instead of epochs
  (`unit`), so that a run of an epoch or less still moves from a dense reward to success.

A trajectory that ended without an answer (format error, context or tool budget, engine error),
whose answer could not be formatted into a plan, or that delivered no plan, gets 0.

Our own addition, off by default: `preference_penalty` p takes p points off for each stated
preference the plan breaks (house rule, room type, cuisine, transportation: every hard
constraint but the budget), floored at 0 so that no plan scores below a format error. Under the
paper's rewards a plan that ignores "no self-driving" to stay within budget scores exactly like
one that keeps the preference and overspends, so nothing stops a policy from trading the one for
the other. It does not fix that trade: at 1.0 the policy learns another single mode (flying on
every query) and held-out success falls (docs/results.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from services.common.schemas import Score

BaseKind = Literal["sum", "macro", "success"]
RewardKind = Literal["sum", "macro", "success", "curriculum"]
BASE_KINDS: tuple[BaseKind, ...] = ("sum", "macro", "success")
CurriculumUnit = Literal["epoch", "step"]
# The hard constraints a user states as preferences; the budget is the one hard check left out.
PREFERENCE_CHECKS: tuple[str, ...] = ("valid_room_rule", "valid_room_type", "valid_cuisine", "valid_transportation")


@dataclass(frozen=True)
class Curriculum:
    """Stages as (first epoch or step, reward kind), 1-based; the last stage lasts forever. `unit`
    says what the stage numbers count: epochs (the paper's) or RL steps (batches)."""

    stages: tuple[tuple[int, BaseKind], ...] = ((1, "sum"), (3, "macro"), (5, "success"))
    unit: CurriculumUnit = "epoch"

    def __post_init__(self) -> None:
        if self.unit not in ("epoch", "step"):
            raise ValueError(f"a curriculum counts epochs or steps, not {self.unit!r}")
        if not self.stages or self.stages[0][0] != 1:
            raise ValueError(f"a curriculum's first stage must start at {self.unit} 1")
        starts = [s for s, _ in self.stages]
        if starts != sorted(set(starts)):
            raise ValueError(f"curriculum stage starts must strictly increase, got {starts}")
        for _, kind in self.stages:
            if kind not in BASE_KINDS:
                raise ValueError(f"unknown reward kind {kind!r} in curriculum (use {', '.join(BASE_KINDS)})")

    def kind_at(self, position: int) -> BaseKind:
        """The reward kind at a 1-based epoch (or step, when the curriculum counts steps)."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 1:
            raise ValueError(f"{self.unit} must be an integer >= 1, got {position!r}")
        kind = self.stages[0][1]
        for start, stage_kind in self.stages:
            if position >= start:
                kind = stage_kind
        return kind

    def kind_for(self, epoch: int, step: int) -> BaseKind:
        """The reward kind of a 1-based epoch's 0-based step, whichever the curriculum counts."""
        return self.kind_at(epoch if self.unit == "epoch" else step + 1)

    @classmethod
    def parse(cls, text: str, unit: CurriculumUnit = "epoch") -> Curriculum:
        """From "sum:1-2,macro:3-4,success:5" (ranges must be contiguous from 1) or
        "sum@1,macro@3,success@5" (first epoch, or step, of each stage)."""
        stages: list[tuple[int, BaseKind]] = []
        expected: float = 1
        previous = ""
        for part in (p.strip() for p in text.split(",") if p.strip()):
            m = re.fullmatch(r"(\w+)\s*(?:@\s*(\d+)|:\s*(\d+)(?:\s*-\s*(\d+|))?)", part)
            if not m:
                raise ValueError(f"cannot read curriculum stage {part!r} (use kind:first-last or kind@first)")
            kind, at, first, last = m.groups()
            start = int(at if at is not None else first)
            if at is None:
                if expected == math.inf:
                    raise ValueError(
                        f"curriculum stage {part!r} follows {previous!r}, which has no last {unit} "
                        f"(write {previous}-N, or kind@first for every stage)"
                    )
                if start != expected:
                    raise ValueError(f"curriculum stage {part!r} starts at {start}, expected {unit} {expected:g}")
                expected = int(last) + 1 if last else math.inf
            stages.append((start, kind))  # type: ignore[arg-type]
            previous = part
        return cls(tuple(stages), unit)

    def describe(self) -> str:
        parts = []
        for i, (start, kind) in enumerate(self.stages):
            end = self.stages[i + 1][0] - 1 if i + 1 < len(self.stages) else None
            parts.append(f"{kind}:{start}-{end}" if end is not None else f"{kind}:{start}-")
        return ",".join(parts)


DEFAULT_CURRICULUM = Curriculum()


def base_reward(score: Score, kind: BaseKind) -> float:
    if kind == "sum":
        return score.cs_micro + score.cs_macro + score.hard_micro + score.hard_macro + score.success
    if kind == "macro":
        return score.cs_macro + score.hard_macro + score.success
    if kind == "success":
        return score.success
    raise ValueError(f"unknown reward kind {kind!r} (use sum, macro, success or curriculum)")


def broken_preferences(score: Score) -> int:
    """How many stated preferences (PREFERENCE_CHECKS that apply to the query) the plan breaks."""
    return sum(1 for name in PREFERENCE_CHECKS if name in score.hard and score.hard[name].passed is False)


def reward(
    score: Score | None,
    kind: RewardKind = "sum",
    epoch: int | None = None,
    *,
    curriculum: Curriculum = DEFAULT_CURRICULUM,
    finish_reason: str | None = None,
    preference_penalty: float = 0.0,
) -> float:
    """The scalar reward of one trajectory. `epoch` (1-based) is required for "curriculum".
    `finish_reason` other than "answer", a missing score, or a formatter failure give 0.
    `preference_penalty` (default 0: the paper's rewards) is taken off per broken preference."""
    if kind == "curriculum":
        if epoch is None:
            raise ValueError("the curriculum reward needs the epoch")
        kind = curriculum.kind_at(epoch)
    elif kind not in BASE_KINDS:
        raise ValueError(f"unknown reward kind {kind!r} (use sum, macro, success or curriculum)")
    if not math.isfinite(preference_penalty) or preference_penalty < 0:
        raise ValueError(f"preference_penalty must be a finite number >= 0, got {preference_penalty!r}")
    if finish_reason is not None and finish_reason != "answer":
        return 0.0
    if score is None or score.formatter_status != "ok":
        return 0.0
    value = base_reward(score, kind)
    if preference_penalty:
        value = max(0.0, value - preference_penalty * broken_preferences(score))
    return float(value)


def all_rewards(
    score: Score | None,
    epoch: int | None = None,
    *,
    curriculum: Curriculum = DEFAULT_CURRICULUM,
    finish_reason: str | None = None,
) -> dict[str, float]:
    """Every reward kind at once (curriculum only when the epoch is known)."""
    out = {k: reward(score, k, finish_reason=finish_reason) for k in BASE_KINDS}
    if epoch is not None:
        out["curriculum"] = reward(score, "curriculum", epoch, curriculum=curriculum, finish_reason=finish_reason)
    return out
