"""Split files in, submission files out, and a submission scored in full (`score_submission`).

Split: the benchmark's records (a JSON list like `train.json`, or JSON lines), one query each,
typed as `TravelQuery`; the query id is the record's `id`/`idx`, else its 1-based line number.

Submission (the leaderboard's format, spec travelplanner.md §5): JSON lines
`{"idx": i, "query": "<text>", "plan": [day dicts] | null}` in dataset order; `idx` is 1-based
as in the official repo's tools; the official evaluator pairs line i with query i and ignores
`idx`, and so do we. A line may instead carry the agent's plan text (`plan_text`, or `plan` as a
string), which the formatter turns into day dicts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.schemas import EvalMode, Provenance, TravelQuery
from services.reward.evaluator import COMMONSENSE_CHECKS, HARD_CHECKS, SplitMetrics, aggregate
from services.reward.evaluator.aggregate import Split


class SubmissionError(ValueError):
    """A split or predictions file we cannot read; the message names the line."""


def _json_records(path: Path) -> list[Any]:
    if not path.is_file():
        raise SubmissionError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise SubmissionError(f"{path}: not valid JSON: {exc}") from None
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise SubmissionError(f"{path}:{lineno}: not a JSON line: {exc.msg}") from None
    return out


@dataclass(frozen=True)
class SplitQuery:
    index: int
    query_id: str
    query: TravelQuery


def load_split(path: str | Path, limit: int | None = None) -> list[SplitQuery]:
    path = Path(path)
    out = []
    for i, record in enumerate(_json_records(path)):
        if limit is not None and i >= limit:
            break
        if not isinstance(record, dict):
            raise SubmissionError(f"{path}: record {i + 1} is not a JSON object")
        try:
            query = TravelQuery(**record)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise SubmissionError(
                f"{path}: record {i + 1} is not a TravelPlanner query ({where}: {first['msg']}); "
                "a split needs the structured fields (org, dest, days, date, …)"
            ) from None
        qid = str(record.get("id") or record.get("idx") or i + 1)
        out.append(SplitQuery(i, qid, query.model_copy(update={"id": qid})))
    if not out:
        raise SubmissionError(f"{path}: no queries")
    ids = [q.query_id for q in out]
    if len(set(ids)) != len(ids):
        raise SubmissionError(f"{path}: query ids repeat; give every record a distinct id")
    return out


@dataclass(frozen=True)
class Prediction:
    plan: list[dict[str, Any]] | None  # day dicts, as submitted
    plan_text: str | None  # text still to be formatted


def read_predictions(path: str | Path, queries: Sequence[SplitQuery]) -> dict[str, Prediction]:
    """Predictions keyed by query id: by a line's `query_id`/`id` when it names a query of the
    split, otherwise by line order (the official evaluator's pairing). A query without a line
    is not delivered."""
    path = Path(path)
    records = _json_records(path)
    by_id = {q.query_id for q in queries}
    out: dict[str, Prediction] = {}
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise SubmissionError(f"{path}: line {i + 1} is not a JSON object")
        named = record.get("query_id", record.get("id"))
        if named is not None and str(named) in by_id:
            qid = str(named)
        elif i < len(queries):
            qid = queries[i].query_id
        else:
            continue  # lines past the split (or past -n) are ignored: eval.py reads only N lines
        if qid in out:
            raise SubmissionError(f"{path}: line {i + 1} gives a second plan for query {qid!r}")
        plan, text = record.get("plan"), record.get("plan_text")
        if isinstance(plan, str):
            plan, text = None, plan
        if plan is not None and not isinstance(plan, list):
            raise SubmissionError(f"{path}: line {i + 1}: 'plan' must be a list of day objects, text or null")
        if text is not None and not isinstance(text, str):
            raise SubmissionError(f"{path}: line {i + 1}: 'plan_text' must be text")
        out[qid] = Prediction(plan=plan, plan_text=text)
    return out


def submission_lines(records: Sequence[Any]) -> list[dict[str, Any]]:
    """Official submission lines, in dataset order, from run records."""
    return [
        {"idx": r.index + 1, "query": r.query.query, "plan": r.plan} for r in sorted(records, key=lambda r: r.index)
    ]


def write_submission(path: Path, records: Sequence[Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for line in submission_lines(records):
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")


# --- a submission scored in full: the leaderboard numbers, per-plan verdicts, tables, costs -----

SPLITS = ("train", "validation", "test")
MAX_LINES = 1000  # the test split
MAX_QUERY_TEXT = 20_000


class SubmissionLine(BaseModel):
    """One line of the official submission JSONL."""

    model_config = ConfigDict(extra="ignore")

    idx: int | None = Field(
        None,
        description="1-based line number as the official tools write it (ignored: "
        "lines pair with queries by order, as in the official evaluator).",
    )
    query: str | None = Field(
        None,
        max_length=MAX_QUERY_TEXT,
        description="The query text (checked against the split's, a mismatch is a warning).",
    )
    plan: Any = Field(None, description="Day objects, the plan as text, or null (not delivered).")
    plan_text: str | None = Field(None, max_length=200_000, description="The plan as text, for the formatter.")


class FailedCheck(BaseModel):
    check: str
    name: str
    reason: str


class PlanVerdict(BaseModel):
    """One query's verdict: what failed and why."""

    idx: int = Field(description="1-based line number.")
    query_id: str
    level: str | None
    days: int
    delivered: bool
    formatter_status: str
    success: bool
    cs_micro: float
    hard_micro: float
    cost: float | None = Field(description="The plan's total cost as the evaluator computes it.")
    budget: int
    failed: list[FailedCheck]


class CohortRow(BaseModel):
    value: str
    n: int
    delivery_rate: float
    cs_micro: float
    cs_macro: float
    hard_micro: float
    hard_macro: float
    final_pass_rate: float


class CostSummary(BaseModel):
    costed: int = Field(description="Delivered plans whose cost the evaluator could compute.")
    total: float
    mean: float | None
    median: float | None
    max: float | None
    over_budget: int = Field(description="Costed plans above their query's budget.")


class SubmissionReport(BaseModel):
    metrics: SplitMetrics
    by_level: list[CohortRow]
    by_trip_length: list[CohortRow]
    costs: CostSummary
    plans: list[PlanVerdict]
    provenance: Provenance
    warnings: list[str] = Field(default_factory=list)


def dataset_split(directory: str | Path, split: str) -> list[SplitQuery]:
    """A split's queries from a dataset folder laid out as the benchmark's (`train/train.json`) or
    flat (`validation.json`, `validation.jsonl`)."""
    if split not in SPLITS:
        raise SubmissionError(f"unknown split {split!r} (use {', '.join(SPLITS)})")
    root = Path(directory)
    candidates = [
        root / split / f"{split}.json",
        root / split / f"{split}.jsonl",
        root / f"{split}.json",
        root / f"{split}.jsonl",
    ]
    for path in candidates:
        if path.is_file():
            return load_split(path)
    raise SubmissionError(
        f"the dataset folder {root} has no {split} queries (looked for "
        f"{', '.join(str(c.relative_to(root)) for c in candidates)}); put them there "
        "(STAR_TRAVELPLANNER_DIR) or send the queries with the submission"
    )


def queries_from(records: Sequence[TravelQuery]) -> list[SplitQuery]:
    """Queries given in a request, ids defaulting to their 1-based position."""
    out = [
        SplitQuery(i, str(q.id or i + 1), q.model_copy(update={"id": str(q.id or i + 1)}))
        for i, q in enumerate(records)
    ]
    if len({q.query_id for q in out}) != len(out):
        raise SubmissionError("query ids repeat; give every query a distinct id")
    return out


def pair_lines(
    queries: Sequence[SplitQuery], lines: Sequence[SubmissionLine]
) -> tuple[list[Prediction | None], list[str]]:
    """Line i → query i (the official pairing); lines past the split are ignored, missing lines
    are undelivered plans. Also the warnings: query texts that differ from the split's."""
    predictions: list[Prediction | None] = []
    warnings = []
    for i, sq in enumerate(queries):
        if i >= len(lines):
            predictions.append(None)
            continue
        line = lines[i]
        plan, text = line.plan, line.plan_text
        if isinstance(plan, str):
            plan, text = None, plan
        predictions.append(Prediction(plan=plan, plan_text=text))
        if line.query and sq.query.query and " ".join(line.query.split()) != " ".join(sq.query.query.split()):
            warnings.append(f"line {i + 1}: its query text differs from query {sq.query_id!r} of the split")
    if len(lines) > len(queries):
        warnings.append(f"{len(lines) - len(queries)} line(s) past the split's {len(queries)} queries were ignored")
    if len(lines) < len(queries):
        warnings.append(f"{len(queries) - len(lines)} quer(ies) have no line: counted as not delivered")
    return predictions, warnings


def score_submission(
    scorer: Any,
    queries: Sequence[SplitQuery],
    lines: Sequence[SubmissionLine],
    *,
    mode: EvalMode = "official",
    split: Split | None = None,
    backend: str | None = None,
    allow_synthetic_flights: bool = False,
    deadline: Any = None,
) -> SubmissionReport:
    """Score a submission against its split with a `services.reward.scoring.Scorer`. Raises the
    scorer's `ScoreError` for a split this world cannot score or a split of the wrong size."""
    from services.reward.scoring import PlanInput, ScoreError

    provenance = scorer.split_provenance(mode, split, allow_synthetic_flights)
    predictions, warnings = pair_lines(queries, lines)
    items = [
        PlanInput(query=sq.query, plan=p.plan if p else None, plan_text=p.plan_text if p else None)
        for sq, p in zip(queries, predictions)
    ]
    evaluations = [s.evaluation for s in scorer.evaluate_items(items, mode, backend, deadline)]
    try:
        metrics = aggregate([sq.query for sq in queries], evaluations, mode=mode, split=split)
    except ValueError as exc:
        raise ScoreError(str(exc)) from None
    metrics = metrics.model_copy(update={"provenance": provenance})
    return SubmissionReport(
        metrics=metrics,
        by_level=cohort_rows(queries, evaluations, mode, lambda q: q.level or "unknown"),
        by_trip_length=cohort_rows(queries, evaluations, mode, lambda q: f"{q.days} days"),
        costs=_costs(queries, evaluations),
        provenance=provenance,
        warnings=warnings,
        plans=[_verdict(i, sq, e) for i, (sq, e) in enumerate(zip(queries, evaluations))],
    )


def cohort_rows(queries: Sequence[SplitQuery], evaluations: Sequence[Any], mode: EvalMode, key: Any) -> list[CohortRow]:
    """The six metrics per cohort of queries (`key` of a query), with computed denominators: a cohort
    is not an official split."""
    members: dict[str, list[int]] = {}
    for i, sq in enumerate(queries):
        members.setdefault(key(sq.query), []).append(i)
    rows = []
    for value in sorted(members):
        idx = members[value]
        m = aggregate([queries[i].query for i in idx], [evaluations[i] for i in idx], mode=mode, split=None)
        rows.append(
            CohortRow(
                value=value, n=len(idx), **{k: getattr(m, k) for k in CohortRow.model_fields if k not in ("value", "n")}
            )
        )
    return rows


def _verdict(i: int, sq: SplitQuery, e: Any) -> PlanVerdict:
    score = e.to_score()
    failed = [
        FailedCheck(check=k, name=COMMONSENSE_CHECKS[k], reason=v.reason or "")
        for k, v in score.commonsense.items()
        if v.passed is False
    ]
    failed += [
        FailedCheck(check=k, name=HARD_CHECKS[k], reason=v.reason or "")
        for k, v in score.hard.items()
        if v.passed is False
    ]
    return PlanVerdict(
        idx=i + 1,
        query_id=sq.query_id,
        level=sq.query.level,
        days=sq.query.days,
        delivered=e.delivered,
        formatter_status=e.formatter_status,
        success=score.success >= 1.0,
        cs_micro=score.cs_micro,
        hard_micro=score.hard_micro,
        cost=e.cost,
        budget=sq.query.budget,
        failed=failed,
    )


def _costs(queries: Sequence[SplitQuery], evaluations: Sequence[Any]) -> CostSummary:
    import statistics

    costed = [(sq.query.budget, e.cost) for sq, e in zip(queries, evaluations) if e.delivered and e.cost is not None]
    values = [c for _, c in costed]
    return CostSummary(
        costed=len(values),
        total=float(sum(values)),
        mean=statistics.fmean(values) if values else None,
        median=statistics.median(values) if values else None,
        max=max(values) if values else None,
        over_budget=sum(c > b for b, c in costed),
    )
