"""Loaders for the seven OOD QA sets in the forms users have them in.

One record form in, one `QAItem` out. The field names differ by source:

| source form | question | gold answers |
|---|---|---|
| FlashRAG (every set; Search-R1's copy) | `question` | `golden_answers` (list) |
| NQ-open | `question` | `answer` (list) |
| TriviaQA (rc / unfiltered) | `Question` or `question` | `Answer` / `answer`: `{Value, Aliases, NormalizedAliases}` |
| PopQA | `question` | `possible_answers` (a JSON list, often stored as a string) |
| HotpotQA, 2WikiMultihopQA | `question` | `answer` (string); id in `_id` |
| MuSiQue | `question` | `answer` + `answer_aliases` |
| Bamboogle (CSV or JSONL) | `Question` | `Answer` |

Files may be JSONL, a JSON list (HotpotQA and 2Wiki ship that), or CSV (Bamboogle). The dataset
name comes from the caller or from the file name (`nq`, `triviaqa`, `popqa`, `hotpotqa`, `2wiki`,
`musique`, `bamboogle`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle")
# Substrings of a file name (lower-cased) that name its dataset; longest match first.
_NAME_HINTS = (
    ("2wikimultihop", "2wiki"),
    ("2wiki", "2wiki"),
    ("triviaqa", "triviaqa"),
    ("trivia", "triviaqa"),
    ("hotpot", "hotpotqa"),
    ("popqa", "popqa"),
    ("musique", "musique"),
    ("bamboogle", "bamboogle"),
    ("nq", "nq"),
    ("natural_questions", "nq"),
)


class QADataError(ValueError):
    """A QA file or record this loader cannot read; the message says which and why."""


@dataclass(frozen=True)
class QAItem:
    dataset: str
    id: str
    question: str
    answers: tuple[str, ...]


def dataset_from_name(path: Path) -> str | None:
    name = path.name.lower()
    for hint, dataset in _NAME_HINTS:
        if hint in name:
            return dataset
    return None


def _as_list(value: Any) -> list[str]:
    """A gold-answer field in any of its shapes → a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("[") and stripped.endswith("]"):  # PopQA stores lists as JSON text
            try:
                return _as_list(json.loads(stripped))
            except json.JSONDecodeError:
                pass
        return [value] if stripped else []
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [str(value)]
    if isinstance(value, dict):  # TriviaQA: {Value, Aliases, NormalizedAliases}
        out = []
        for key in ("Value", "value", "Aliases", "aliases", "NormalizedAliases", "normalized_aliases"):
            out += _as_list(value.get(key))
        return out
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out += _as_list(v)
        return out
    return []


_QUESTION_KEYS = ("question", "Question", "query", "input")
_ANSWER_KEYS = ("golden_answers", "answers", "answer", "Answer", "possible_answers", "answer_aliases", "output")
_ID_KEYS = ("id", "_id", "qid", "question_id", "QuestionId", "example_id")


def record_to_item(record: dict[str, Any], dataset: str, position: int) -> QAItem:
    if not isinstance(record, dict):
        raise QADataError(f"record {position} is a {type(record).__name__}, not a JSON object")
    question = next((record[k] for k in _QUESTION_KEYS if isinstance(record.get(k), str) and record[k].strip()), None)
    if question is None:
        raise QADataError(f"record {position} has no question (looked for {', '.join(_QUESTION_KEYS)})")
    answers: list[str] = []
    for key in _ANSWER_KEYS:  # every present field adds its answers (MuSiQue: answer + answer_aliases)
        answers += _as_list(record.get(key))
    answers = list(dict.fromkeys(a.strip() for a in answers if a.strip()))
    if not answers:
        raise QADataError(
            f"record {position} ({question[:60]!r}) has no gold answer (looked for {', '.join(_ANSWER_KEYS)})"
        )
    rid = next((str(record[k]) for k in _ID_KEYS if record.get(k) not in (None, "")), f"{dataset}-{position}")
    return QAItem(dataset=dataset, id=rid, question=question.strip(), answers=tuple(answers))


def _records(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix.lower() == ".csv":
        with open(path, newline="", encoding="utf-8") as fh:
            yield from csv.DictReader(fh)
        return
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise QADataError(f"{path}: not valid JSON: {exc}") from None
        yield from data
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            raise QADataError(f"{path}:{lineno}: not a JSON line: {exc.msg}") from None


def load_qa(path: str | Path, dataset: str | None = None, limit: int | None = None) -> list[QAItem]:
    """Every question of a QA file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise QADataError(f"{path}: no such file")
    dataset = dataset or dataset_from_name(path)
    if dataset is None:
        raise QADataError(f"{path}: cannot tell the dataset from the file name; name it ({', '.join(DATASETS)})")
    items = []
    for position, record in enumerate(_records(path)):
        if limit is not None and len(items) >= limit:
            break
        items.append(record_to_item(record, dataset, position))
    if not items:
        raise QADataError(f"{path}: no questions")
    return items
