"""`star score` and `star evaluate` (and `star formatter format`) from the command line."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from services.cli import app
from services.common.schemas import Plan, PlanDay
from services.formatter.structured import render_plan

runner = CliRunner()


def _record(gold, i):
    return {k: v for k, v in gold.records[i].items() if k not in ("annotated_plan", "reference_information")}


def test_score_json_plan_and_text_plan(official_world_url, gold, tmp_path):
    q = tmp_path / "q.json"
    q.write_text(json.dumps(_record(gold, 0)))
    plan = gold.plan(0)
    plan[2]["transportation"] = (
        "Flight Number: F0000001, from Rockford to St. Petersburg, Departure Time: 19:00, Arrival Time: 22:43"
    )
    p = tmp_path / "p.json"
    p.write_text(json.dumps(plan))
    r = runner.invoke(app, ["score", "--query", str(q), "--plan", str(p), "--db", official_world_url])
    assert r.exit_code == 0, r.output
    assert "Within Sandbox" in r.output and "FAIL" in r.output and "F0000001" in r.output
    assert "success 0" in r.output

    text = tmp_path / "plan.txt"
    text.write_text(render_plan(Plan(days=[PlanDay(**d) for d in gold.plans[0] if d])))
    r = runner.invoke(
        app,
        [
            "score",
            "--query",
            str(q),
            "--plan",
            str(text),
            "--db",
            official_world_url,
            "--mode",
            "strict",
            "--reward",
            "curriculum",
            "--epoch",
            "5",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    body = json.loads(r.output)
    assert body["reward"] == 1.0 and body["score"]["mode"] == "strict" and body["formatter"]["status"] == "ok"


def test_score_preference_penalty(official_world_url, gold, tmp_path):
    i = next(
        i
        for i in range(len(gold.queries))
        if gold.queries[i].local_constraint.transportation is None
        and any("Self-driving" in str(d.get("transportation")) for d in gold.plan(i))
    )
    record = _record(gold, i)
    record["local_constraint"] = str(
        {**gold.queries[i].local_constraint.model_dump(by_alias=True), "transportation": "no self-driving"}
    )
    q, p = tmp_path / "q.json", tmp_path / "p.json"
    q.write_text(json.dumps(record))
    p.write_text(json.dumps(gold.plan(i)))
    rewards = []
    for penalty in ("0", "2"):
        r = runner.invoke(
            app,
            [
                "score",
                "--query",
                str(q),
                "--plan",
                str(p),
                "--db",
                official_world_url,
                "--preference-penalty",
                penalty,
                "--json",
            ],
        )
        assert r.exit_code == 0, r.output
        rewards.append(json.loads(r.output)["reward"])
    assert rewards[0] - rewards[1] == 2.0


def test_score_errors_are_messages(official_world_url, gold, tmp_path):
    q = tmp_path / "q.json"
    q.write_text(json.dumps(_record(gold, 0)))
    p = tmp_path / "p.json"
    p.write_text("42")
    cases = [
        (["--query", str(tmp_path / "missing.json"), "--plan", str(p)], "cannot read"),
        (["--query", str(p), "--plan", str(p)], "query"),
        (["--query", str(q), "--plan", str(p)], "plan: a plan must be"),
        (["--query", str(q), "--plan", str(q), "--mode", "loose"], "--mode must be official or strict"),
        (["--query", str(q), "--plan", str(q), "--reward", "curriculum"], "needs the epoch"),
        (
            ["--query", str(q), "--plan", str(q), "--preference-penalty", "6"],
            "preference_penalty: Input should be less",
        ),
        (
            ["--query", str(q), "--plan", str(q), "--preference-penalty", "-1"],
            "preference_penalty: Input should be greater",
        ),
    ]
    for args, needle in cases:
        r = runner.invoke(app, ["score", *args, "--db", official_world_url])
        assert r.exit_code == 2 and needle in r.output, (args, r.output)
        assert "Traceback" not in r.output


def test_evaluate_submission_file(official_world_url, gold, data_env, tmp_path, full_travelplanner_dir):
    """A 45-line file is the train split: its queries and official denominators (full data only)."""
    sub = tmp_path / "submission.jsonl"
    lines = [{"idx": i + 1, "query": gold.records[i]["query"], "plan": gold.plan(i)} for i in range(45)]
    lines[3]["plan"] = None
    lines[4]["plan"] = render_plan(Plan(days=[PlanDay(**d) for d in gold.plans[4] if d]))  # text is formatted
    sub.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = runner.invoke(app, ["evaluate", str(sub), "--db", official_world_url])
    assert r.exit_code == 0, r.output
    assert "official train denominators" in r.output
    assert "97.78%" in r.output and "44/45" in r.output and "352/360" in r.output
    r = runner.invoke(
        app,
        [
            "evaluate",
            str(sub),
            "--db",
            official_world_url,
            "--json",
            "--mode",
            "strict",
            "--queries",
            str(data_env / "train" / "train.json"),
        ],
    )
    report = json.loads(r.output)
    m = report["metrics"]
    assert m["mode"] == "strict" and m["counts"]["final_passed"] == 44
    assert not report["plans"][3]["delivered"] and report["plans"][4]["success"]
    assert report["provenance"]["flights"] == "synthetic+train_rows"


def test_evaluate_validation_is_refused_on_synthetic_flights(official_world_url, gold, tmp_path):
    sub = tmp_path / "submission.jsonl"
    sub.write_text("\n".join(json.dumps({"idx": i + 1, "plan": gold.plan(i)}) for i in range(3)) + "\n")
    queries = tmp_path / "q.json"
    queries.write_text(
        json.dumps([{k: v for k, v in gold.records[i].items() if k != "annotated_plan"} for i in range(3)])
    )
    r = runner.invoke(
        app,
        [
            "evaluate",
            str(sub),
            "--db",
            official_world_url,
            "--queries",
            str(queries),
            "--split",
            "validation",
            "--mode",
            "strict",
        ],
    )
    assert r.exit_code == 2 and "--flights-csv" in r.output
    r = runner.invoke(
        app,
        [
            "evaluate",
            str(sub),
            "--db",
            official_world_url,
            "--queries",
            str(queries),
            "--split",
            "validation",
            "--mode",
            "strict",
            "--allow-synthetic-flights",
        ],
    )
    assert r.exit_code == 0 and "caller's insistence" in " ".join(r.output.split()), r.output


def test_evaluate_needs_the_queries_for_other_splits(official_world_url, travelplanner_dir):
    example = travelplanner_dir / "validation_queries_example_submission.jsonl"
    r = runner.invoke(app, ["evaluate", str(example), "--db", official_world_url])
    assert r.exit_code == 2 and "give --queries" in r.output


def test_formatter_format_command(tmp_path, gold):
    text = tmp_path / "plan.txt"
    text.write_text("My plan:\n" + render_plan(Plan(days=[PlanDay(**d) for d in gold.plans[1] if d])))
    r = runner.invoke(app, ["formatter", "format", str(text), "--backend", "structured"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["plan"][0]["current_city"] == gold.plans[1][0]["current_city"]
    text.write_text("nothing useful")
    r = runner.invoke(app, ["formatter", "format", str(text), "--backend", "structured"])
    assert r.exit_code == 1 and json.loads(r.output)["status"] == "invalid_output"
