"""Validation during RL: which versions are due, and which one is best."""

from __future__ import annotations


from services.pipeline.rl import Validation


def test_due_every_n_versions_once_and_best_prefers_success_then_recency():
    v = Validation(run=None, split="val.jsonl", every=2)  # type: ignore[arg-type]
    assert [n for n in range(0, 7) if v.due(n)] == [2, 4, 6]
    v.history = [{"version": 2, "success": 0.25}, {"version": 4, "success": 0.5}, {"version": 6, "success": 0.5}]
    assert not v.due(4)
    assert v.best()["version"] == 6
    v.history.append({"version": 8, "success": 0.1})
    assert v.best()["version"] == 6
    assert Validation(run=None, split="x", every=0).due(3) is False  # type: ignore[arg-type]
    assert Validation(run=None, split="x", every=1).best() is None  # type: ignore[arg-type]
