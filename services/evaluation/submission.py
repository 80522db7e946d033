"""Split files in, submission files out.

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

from pydantic import ValidationError

from services.common.schemas import TravelQuery


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
            raise SubmissionError(f"{path}: record {i + 1} is not a TravelPlanner query ({where}: {first['msg']}); "
                                  "a split needs the structured fields (org, dest, days, date, …)") from None
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
    plan_text: str | None              # text still to be formatted


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
    return [{"idx": r.index + 1, "query": r.query.query, "plan": r.plan} for r in sorted(records, key=lambda r: r.index)]


def write_submission(path: Path, records: Sequence[Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for line in submission_lines(records):
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
