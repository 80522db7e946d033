"""`star eval compare RUN_A RUN_B`: metric deltas with paired bootstrap confidence intervals.

Paired over queries: both runs must have scored the same query ids; each resample draws query
ids with replacement and recomputes every metric of both runs on that same draw, so the spread
reflects which queries happened to be in the split, not noise between unmatched samples. Micro
metrics are ratios of sums over the drawn queries (as the split metrics are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from services.evaluation.analysis import METRIC_KEYS, METRIC_NAMES
from services.evaluation.records import QueryRecord, to_evaluation


class CompareError(ValueError):
    pass


def per_query_counts(records: list[QueryRecord]) -> dict[str, np.ndarray]:
    """Numerators and denominators of every metric, one entry per query (in the given order)."""
    rows = []
    for r in records:
        e = to_evaluation(r)
        rows.append(
            (
                e.delivered,
                e.cs_passed if e.delivered else 0,
                8,
                e.cs_all and e.hard_evaluated,
                e.hard_passed,
                e.hard_total,
                e.hard_all,
                e.cs_all and e.hard_all,
            )
        )
    a = np.array(rows, dtype=float).reshape(-1, 8)
    return {
        "delivery_rate": (a[:, 0], None),
        "cs_micro": (a[:, 1], a[:, 2]),
        "cs_macro": (a[:, 3], None),
        "hard_micro": (a[:, 4], a[:, 5]),
        "hard_macro": (a[:, 6], None),
        "final_pass_rate": (a[:, 7], None),
    }


def _metric(num: np.ndarray, den: np.ndarray | None, idx: np.ndarray) -> np.ndarray:
    """Metric in % for each resample (rows of idx)."""
    top = num[idx].sum(axis=-1)
    bottom = den[idx].sum(axis=-1) if den is not None else np.full(top.shape, idx.shape[-1], dtype=float)
    return 100.0 * np.divide(top, bottom, out=np.zeros_like(top), where=bottom > 0)


@dataclass
class MetricDelta:
    metric: str
    a: float
    b: float
    delta: float
    low: float
    high: float
    p_b_better: float  # share of resamples where B > A

    def row(self) -> list[str]:
        return [
            METRIC_NAMES[self.metric],
            f"{self.a:.2f}",
            f"{self.b:.2f}",
            f"{self.delta:+.2f}",
            f"[{self.low:+.2f}, {self.high:+.2f}]",
            f"{self.p_b_better:.3f}",
        ]


def compare_records(
    a: list[QueryRecord], b: list[QueryRecord], *, resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[list[MetricDelta], dict[str, Any]]:
    by_a = {r.query_id: r for r in a}
    by_b = {r.query_id: r for r in b}
    common = sorted(set(by_a) & set(by_b), key=lambda q: by_a[q].index)
    if not common:
        raise CompareError("the runs share no query ids; compare runs of the same split")
    info = {"paired_queries": len(common), "only_a": len(set(by_a) - set(by_b)), "only_b": len(set(by_b) - set(by_a))}
    mismatch = [q for q in common if by_a[q].query != by_b[q].query]
    if mismatch:
        raise CompareError(f"query {mismatch[0]!r} differs between the runs; they are not runs of the same split")
    ca = per_query_counts([by_a[q] for q in common])
    cb = per_query_counts([by_b[q] for q in common])
    n = len(common)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    full = np.arange(n)[None, :]
    alpha = (1.0 - confidence) / 2
    out = []
    for key in METRIC_KEYS:
        va, vb = _metric(*ca[key], full)[0], _metric(*cb[key], full)[0]
        deltas = _metric(*cb[key], idx) - _metric(*ca[key], idx)
        low, high = np.quantile(deltas, [alpha, 1 - alpha])
        out.append(
            MetricDelta(key, float(va), float(vb), float(vb - va), float(low), float(high), float((deltas > 0).mean()))
        )
    return out, info


def compare_table(deltas: list[MetricDelta], confidence: float = 0.95) -> str:
    header = ["metric", "A", "B", "B − A", f"{int(confidence * 100)}% CI", "P(B > A)"]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---:|---:|---|---:|"]
    lines += ["| " + " | ".join(d.row()) + " |" for d in deltas]
    return "\n".join(lines)
