"""`star eval scored`: analyses of scored RL trajectories, G samples per query."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from services.cli import app
from services.common.schemas import Plan, PlanDay, ScoredTrajectory

runner = CliRunner()


def scored_line(gold, evaluator, i, sample, delivered, reward):
    query = gold.queries[i].model_copy(update={"id": str(i + 1)})
    days = [d for d in gold.plan(i) if d] if delivered else None
    score = evaluator.score(query, days)
    plan = Plan(days=[PlanDay(**d) for d in days]) if days else None
    return ScoredTrajectory(
        run_id="rl",
        task_id=f"t{i}",
        prompt_id=f"p{i}",
        group_id=f"g{i}",
        sample_index=sample,
        finish_reason="answer" if delivered else "tool_budget",
        query=query,
        score=score,
        reward=reward,
        plan=plan,
        tool_calls=3,
    ).model_dump_json()


def test_scored_trajectories_analysis(gold, evaluator, tmp_path):
    lines = [
        scored_line(gold, evaluator, 0, 0, True, 5.0),
        scored_line(gold, evaluator, 0, 1, False, 0.0),
        scored_line(gold, evaluator, 1, 0, True, 5.0),
        scored_line(gold, evaluator, 1, 1, True, 5.0),
    ]
    path = tmp_path / "scored.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    r = runner.invoke(app, ["eval", "scored", str(path), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "4 queries, official mode" in r.stdout and "Final Pass Rate       75.00%" in r.stdout
    # group g0 = rewards {5, 0}: variance 6.25; g1 = {5, 5}: 0
    assert "reward variance per group: mean 3.1250 over 2 groups, zero-variance groups 50.0%" in r.stdout
    result = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert result["failures"] == [{"category": "tool budget exhausted", "queries": 1, "share_of_failures": 100.0}]


def test_bad_scored_file(tmp_path):
    path = tmp_path / "scored.jsonl"
    path.write_text('{"run_id": "x"}\n', encoding="utf-8")
    r = runner.invoke(app, ["eval", "scored", str(path), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "scored.jsonl:1: not a scored trajectory" in r.output
