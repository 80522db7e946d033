"""`star eval`: a whole run from a predictions file, resumption, re-analysis, clear errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.evaluation.runfolder import RunFolder
from services.reward.evaluator import OFFICIAL_DENOMINATORS

runner = CliRunner()


def whole_train_split(gold) -> bool:
    """Whether gold is the whole train split (the full data), which official mode scores with the official
    denominators; the fixture's subset gets computed ones."""
    return len(gold.plans) == OFFICIAL_DENOMINATORS["train"][0]


def test_eval_predictions_end_to_end(gold, official_world_url, mutated_submission, tmp_path):
    """Four planted faults, one of them an undelivered plan: the rates follow from the split's size."""
    n = len(gold.plans)
    out = tmp_path / "run"
    args = [
        "eval",
        "--split",
        str(gold.split_path),
        "--predictions",
        str(mutated_submission),
        "--db",
        official_world_url,
        "--out",
        str(out),
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    denominators = "official train denominators" if whole_train_split(gold) else "computed denominators"
    assert f"{n} queries, official mode, {denominators}" in r.stdout
    final = 100 * (n - 4) / n
    assert (
        f"Final Pass Rate       {final:.2f}%" in r.stdout
        and f"Delivery Rate         {100 * (n - 1) / n:.2f}%" in r.stdout
    )
    # the reader the RL stage's validation picks its checkpoint by
    assert RunFolder(out).metrics()["final_pass_rate"] == pytest.approx(final, abs=0.005)
    assert RunFolder(tmp_path / "nothing").metrics() is None
    for name in ("manifest.json", "scores.jsonl", "predictions.jsonl", "metrics.json", "report.md"):
        assert (out / name).is_file(), name
    report = (out / "report.md").read_text()
    assert f"| Final Pass Rate | {final:.2f} |" in report and "repeated restaurant" in report
    # a rerun finds everything done and prints the same table
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and again.stdout == r.stdout
    # strict mode into the same folder is refused: the scoring setup differs
    strict = runner.invoke(app, args + ["--mode", "strict"])
    assert strict.exit_code == 2 and "another scoring setup" in strict.output
    # re-analysis from scores alone gives the same metrics
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    (out / "metrics.json").unlink()
    r = runner.invoke(app, ["eval", "report", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "metrics.json").read_text())["metrics"]["final_pass_rate"] == metrics["final_pass_rate"]


def test_whole_train_split_official_numbers(
    gold, official_world_url, mutated_submission, tmp_path, full_travelplanner_dir
):
    """The published train numbers of the planted faults: official denominators (full data only)."""
    r = runner.invoke(
        app,
        [
            "eval",
            "--split",
            str(gold.split_path),
            "--predictions",
            str(mutated_submission),
            "--db",
            official_world_url,
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "45 queries, official mode, official train denominators" in r.stdout
    assert "Final Pass Rate       91.11%" in r.stdout and "Delivery Rate         97.78%" in r.stdout


def test_limit_uses_computed_denominators(gold, official_world_url, mutated_submission, tmp_path):
    r = runner.invoke(
        app,
        [
            "eval",
            "--split",
            str(gold.split_path),
            "--predictions",
            str(mutated_submission),
            "--db",
            official_world_url,
            "--out",
            str(tmp_path / "run"),
            "-n",
            "5",
            "--mode",
            "strict",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "5 queries, strict mode, computed denominators" in r.stdout


@pytest.mark.parametrize(
    "extra,message",
    [
        ([], "exactly one of --model, --agent, --fleet or --predictions"),
        (["--predictions", "/nonexistent.jsonl"], "no such file"),
        (["--predictions", "P", "--mode", "lenient"], "--mode must be official or strict"),
        (["--predictions", "P", "--official-split", "dev"], "--official-split must be"),
        (["--agent", "no.such.module:fn"], "cannot load agent"),
        (["--predictions", "P", "--formatter", "nowhere:thing"], "cannot load formatter"),
        (["--predictions", "P", "--formatter", "llm"], "needs an LLM"),
        (["--model", "/nonexistent-model", "--engine", "transformers"], "not an HF model folder"),
        (["--model", "/nonexistent-model", "--engine", "tpu"], "unknown engine"),
        (["--predictions", "P", "--concurrency", "0"], "--concurrency"),
    ],
)
def test_errors_are_messages(gold, official_world_url, mutated_submission, tmp_path, extra, message):
    extra = [str(mutated_submission) if x == "P" else x for x in extra]
    r = runner.invoke(
        app,
        ["eval", "--split", str(gold.split_path), "--db", official_world_url, "--out", str(tmp_path / "run"), *extra],
    )
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_missing_split_and_bad_split(official_world_url, tmp_path, travelplanner_dir):
    r = runner.invoke(app, ["eval", "--predictions", "x.jsonl", "--db", official_world_url])
    assert r.exit_code == 2 and "--split FILE is required" in r.output
    r = runner.invoke(
        app,
        [
            "eval",
            "--split",
            str(travelplanner_dir / "validation_queries_example_submission.jsonl"),
            "--predictions",
            str(travelplanner_dir / "validation_queries_example_submission.jsonl"),
            "--db",
            official_world_url,
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert r.exit_code == 2 and "not a TravelPlanner query" in r.output


def test_unusable_world_is_an_error(gold, mutated_submission, tmp_path):
    r = runner.invoke(
        app,
        [
            "eval",
            "--split",
            str(gold.split_path),
            "--predictions",
            str(mutated_submission),
            "--db",
            f"sqlite:///{tmp_path / 'empty.sqlite'}",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert r.exit_code == 2 and "world is not usable" in r.output


def test_eval_submission_prints_the_same_metrics_as_a_run_folder(
    gold, official_world_url, mutated_submission, tmp_path, travelplanner_dir
):
    """`star eval submission` (no run folder) and `star eval --predictions` agree; the old `star evaluate`
    spelling, with its old flag names, still answers the same."""
    out = tmp_path / "run"
    runner.invoke(
        app,
        [
            "eval",
            "--split",
            str(gold.split_path),
            "--predictions",
            str(mutated_submission),
            "--db",
            official_world_url,
            "--out",
            str(out),
        ],
    )
    folder = RunFolder(out).metrics()["final_pass_rate"]
    # the official denominators for the whole train split, as the run folder used; none for the subset
    new_flag, old_flag = (["--official-split", "train"], ["--split", "train"]) if whole_train_split(gold) else ([], [])
    r = runner.invoke(
        app,
        [
            "eval",
            "submission",
            str(mutated_submission),
            "--split",
            str(gold.split_path),
            *new_flag,
            "--db",
            official_world_url,
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["metrics"]["final_pass_rate"] == pytest.approx(folder, abs=0.005)
    old = runner.invoke(
        app,
        [
            "evaluate",
            str(mutated_submission),
            "--queries",
            str(gold.split_path),
            *old_flag,
            "--db",
            official_world_url,
            "--json",
        ],
    )
    assert old.exit_code == 0 and json.loads(old.stdout) == json.loads(r.stdout)
    bad = runner.invoke(
        app,
        [
            "eval",
            "submission",
            str(mutated_submission),
            "--split",
            str(gold.split_path),
            "--official-split",
            "dev",
            "--db",
            official_world_url,
        ],
    )
    assert bad.exit_code == 2 and "--official-split must be" in bad.output and "Traceback" not in bad.output
