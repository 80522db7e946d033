"""Exact match and token F1 with the standard SQuAD answer normalisation (agent-star.md §6.2).

normalise: lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace. A
prediction scores EM 1 when it equals any gold answer after normalisation; F1 is the best token
F1 over the gold answers. `cover_em` (Search-R1's substring variant) is 1 when a normalised gold
answer appears inside the normalised prediction.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, in SQuAD's order (lower, punctuation, articles, whitespace)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str | None, answers: Sequence[str]) -> float:
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def cover_em(prediction: str | None, answers: Sequence[str]) -> float:
    """Substring exact match: a normalised gold answer occurs in the normalised prediction."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any((gold := normalize_answer(a)) and gold in pred for a in answers))


def _f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, answers: Sequence[str]) -> float:
    """Best token-level F1 against any gold answer; yes/no/noanswer must match exactly (as in
    HotpotQA's official script, so "yes" does not half-match "yes it is")."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer)
        if pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer"):
            score = float(pred == gold)
        else:
            score = _f1(pred.split(), gold.split())
        best = max(best, score)
    return best


@dataclass
class DatasetScore:
    dataset: str
    n: int = 0
    em: float = 0.0  # in %
    f1: float = 0.0  # in %
    cover_em: float = 0.0  # in %
    answered: float = 0.0  # share of questions with any answer, in %


@dataclass
class QATable:
    """Per-dataset scores and their unweighted average (the paper's Table 2 averages datasets)."""

    rows: list[DatasetScore] = field(default_factory=list)

    @property
    def average(self) -> DatasetScore:
        avg = DatasetScore("average", n=sum(r.n for r in self.rows))
        if self.rows:
            for key in ("em", "f1", "cover_em", "answered"):
                setattr(avg, key, sum(getattr(r, key) for r in self.rows) / len(self.rows))
        return avg

    def to_dict(self) -> dict:
        return {"datasets": [vars(r) for r in self.rows], "average": vars(self.average)}

    def markdown(self) -> str:
        lines = ["| dataset | n | EM | F1 | cover EM | answered |", "|---|---:|---:|---:|---:|---:|"]
        for r in [*self.rows, self.average]:
            name = f"**{r.dataset}**" if r.dataset == "average" else r.dataset
            lines.append(f"| {name} | {r.n} | {r.em:.2f} | {r.f1:.2f} | {r.cover_em:.2f} | {r.answered:.2f} |")
        return "\n".join(lines)


def score_table(results: Iterable[tuple[str, str | None, Sequence[str]]]) -> QATable:
    """(dataset, prediction or None, gold answers) triples → the per-dataset table."""
    sums: dict[str, list[float]] = {}
    for dataset, prediction, answers in results:
        acc = sums.setdefault(dataset, [0, 0.0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += exact_match(prediction, answers)
        acc[2] += f1_score(prediction, answers)
        acc[3] += cover_em(prediction, answers)
        acc[4] += prediction is not None and prediction.strip() != ""
    table = QATable()
    for dataset in sorted(sums):
        n, em, f1, cem, answered = sums[dataset]
        table.rows.append(DatasetScore(dataset, int(n), 100 * em / n, 100 * f1 / n, 100 * cem / n, 100 * answered / n))
    return table
