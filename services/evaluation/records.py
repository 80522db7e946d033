"""One line per evaluated query (`scores.jsonl`), and what the split metrics need from it.

A record carries the query, the plan as scored (official day dicts), the evaluator's `Score`
and, when an agent produced the plan, a summary of its trajectory (finish reason, steps, tool
calls, tokens, group and reward). The full messages go to `trajectories.jsonl` beside it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, Field

from services.common.schemas import Score, Trajectory, TravelQuery
from services.reward.evaluator import Evaluation, SplitMetrics, aggregate, hard as hard_checks
from services.reward.evaluator.aggregate import Mode, Split

GATES = ("is_not_absent", "is_valid_information_in_sandbox")


class TrajectorySummary(BaseModel):
    finish_reason: str
    steps: int = Field(description="Model turns (assistant messages).")
    tool_calls: int
    tokens: int = Field(description="Token ids of the whole trajectory (prompt included), or 0 if unknown.")
    group_id: str | None = None
    sample_index: int = 0
    reward: float | None = None
    policy_version: int = 0

    @classmethod
    def of(cls, trajectory: Trajectory, reward: float | None = None) -> TrajectorySummary:
        steps = sum(m.get("role") == "assistant" for m in trajectory.messages)
        return cls(
            finish_reason=trajectory.finish_reason,
            steps=steps,
            tool_calls=trajectory.tool_calls,
            tokens=len(trajectory.token_ids),
            group_id=trajectory.group_id,
            sample_index=trajectory.sample_index,
            reward=reward,
            policy_version=trajectory.policy_version,
        )


class QueryRecord(BaseModel):
    index: int = Field(description="0-based position of the query in the split (official line order).")
    query_id: str
    query: TravelQuery
    plan: list[dict[str, Any]] | None = Field(None, description="The day dicts as scored; None: not delivered.")
    plan_text: str | None = None
    delivered: bool
    score: Score
    cost: float | None = None
    trajectory: TrajectorySummary | None = None

    @property
    def success(self) -> bool:
        return self.score.success >= 1.0

    @property
    def finish_reason(self) -> str | None:
        return self.trajectory.finish_reason if self.trajectory else None


def to_evaluation(record: QueryRecord) -> Evaluation:
    """The evaluator's `Evaluation` rebuilt from a stored record, so split metrics are computed
    by `services.reward.evaluator.aggregate` itself (official denominators included)."""
    score = record.score
    return Evaluation(
        mode=score.mode,
        delivered=record.delivered,
        commonsense=dict(score.commonsense),
        hard=dict(score.hard),
        hard_evaluated=record.delivered
        and all(score.commonsense.get(g) is not None and score.commonsense[g].passed is True for g in GATES),
        applicable=hard_checks.applicable(SimpleNamespace(query=record.query)),
        cost=record.cost,
        formatter_status=score.formatter_status,
    )


def split_metrics(records: Sequence[QueryRecord], mode: Mode, split: Split | None = None) -> SplitMetrics:
    ordered = sorted(records, key=lambda r: r.index)
    return aggregate([r.query for r in ordered], [to_evaluation(r) for r in ordered], mode=mode, split=split)


def read_records(path: Path) -> list[QueryRecord]:
    """Every complete line of a scores file. A torn last line (the run was killed mid-write) is
    dropped, so that query is simply run again."""
    if not path.is_file():
        return []
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(QueryRecord.model_validate_json(line))
        except ValueError:
            if lineno == len(lines):
                break
            raise ValueError(f"{path}:{lineno}: not a score record") from None
    return out


def append_jsonl(path: Path, items: Iterable[BaseModel | dict]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        for item in items:
            fh.write(
                (item.model_dump_json() if isinstance(item, BaseModel) else json.dumps(item, ensure_ascii=False)) + "\n"
            )
        fh.flush()
