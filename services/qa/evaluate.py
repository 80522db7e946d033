"""Score an agent on the OOD QA sets: per-dataset EM / F1 and their average (paper Table 2).

The answers come either from an agent function (question → final reply text, given the Search
tool set; the rollout service provides the real one) or from a predictions file of earlier
replies. A reply in the agent protocol is reduced to its <answer>; plain text is taken as is.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.common.files import iter_jsonl
from services.qa.datasets import QAItem
from services.qa.metrics import QATable, cover_em, exact_match, f1_score, score_table
from services.qa.prompt import extract_answer

# question, its tool set → the agent's final reply (None: no reply)
QAAgent = Callable[[QAItem, Any], "str | None"]


class QAPredictionError(ValueError):
    pass


def read_predictions(path: str | Path) -> dict[tuple[str, str] | str, str | None]:
    """JSONL of {id, [dataset], prediction | answer | response}; keyed by (dataset, id) when the
    line names its dataset, else by id."""
    out: dict[tuple[str, str] | str, str | None] = {}
    path = Path(path)
    if not path.is_file():
        raise QAPredictionError(f"{path}: no such predictions file")
    for lineno, record in iter_jsonl(path, QAPredictionError):
        if not isinstance(record, dict) or "id" not in record:
            raise QAPredictionError(f"{path}:{lineno}: a prediction needs an 'id'")
        text = next((record[k] for k in ("prediction", "answer", "response") if k in record), None)
        if text is not None and not isinstance(text, str):
            raise QAPredictionError(f"{path}:{lineno}: the prediction must be text or null")
        key = (record["dataset"], str(record["id"])) if record.get("dataset") else str(record["id"])
        out[key] = text
    return out


def final_answer(reply: str | None) -> str | None:
    """The <answer> of a protocol reply, or the reply itself when it has no tags."""
    if reply is None:
        return None
    extracted = extract_answer(reply)
    if extracted is not None:
        return extracted
    return None if "<think>" in reply or "<tool_call>" in reply else reply.strip()


def load_agent(spec: str) -> QAAgent:
    """`package.module:function` → the function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise QAPredictionError(f"agent {spec!r} must look like package.module:function")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise QAPredictionError(f"cannot load agent {spec!r}: {exc}") from None


def evaluate_qa(
    items: Sequence[QAItem],
    *,
    predictions: dict | None = None,
    agent: QAAgent | None = None,
    tools: Any = None,
    progress: bool = True,
) -> tuple[QATable, list[dict[str, Any]]]:
    """Score every item; returns the table and one row per question (for predictions.jsonl)."""
    from tqdm import tqdm

    if (predictions is None) == (agent is None):
        raise QAPredictionError("give either predictions or an agent")
    rows = []
    for item in tqdm(items, desc="qa", unit="q", disable=not progress):
        if agent is not None:
            reply = agent(item, tools)
        else:
            reply = predictions.get((item.dataset, item.id), predictions.get(item.id))
        answer = final_answer(reply)
        rows.append(
            {
                "dataset": item.dataset,
                "id": item.id,
                "question": item.question,
                "answers": list(item.answers),
                "prediction": answer,
                "em": exact_match(answer, item.answers),
                "f1": f1_score(answer, item.answers),
                "cover_em": cover_em(answer, item.answers),
            }
        )
    table = score_table((r["dataset"], r["prediction"], r["answers"]) for r in rows)
    return table, rows


def write_qa_run(out_dir: str | Path, table: QATable, rows: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "metrics.json").write_text(json.dumps({"ood_qa": table.to_dict(), "meta": meta}, indent=2), encoding="utf-8")
    (out / "report.md").write_text(
        "# OOD QA (out of domain; reported apart from TravelPlanner)\n\n" + table.markdown() + "\n", encoding="utf-8"
    )
    return out
