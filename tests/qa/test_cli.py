"""`star qa index | search | eval` end to end on the tests' own corpus and questions."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.cli import app
from tests.qa.conftest import QUESTIONS

runner = CliRunner()


def title_agent(item, tools):
    """A retrieve-and-copy agent: answers with the title of the top passage, in the protocol."""
    top = tools.call("Search", {"query": item.question}, top_k=1).text
    title = top.split("(Title: ", 1)[1].split(")", 1)[0]
    return f"<think>the top passage is about {title}</think><answer>{title}</answer>"


@pytest.fixture
def qa_files(tmp_path):
    nq = tmp_path / "nq_test.jsonl"
    nq.write_text(
        "".join(
            json.dumps({"id": f"n{i}", "question": q, "golden_answers": a}) + "\n"
            for i, (q, _, a) in enumerate(QUESTIONS[:4])
        ),
        encoding="utf-8",
    )
    popqa = tmp_path / "popqa_test.jsonl"
    popqa.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "question": q, "possible_answers": json.dumps(a)}) + "\n"
            for i, (q, _, a) in enumerate(QUESTIONS[4:])
        ),
        encoding="utf-8",
    )
    return nq, popqa


def test_index_then_search(tmp_path, corpus_file):
    out = tmp_path / "idx"
    r = runner.invoke(app, ["qa", "index", str(corpus_file), "--out", str(out), "--batch-size", "5"])
    assert r.exit_code == 0, r.output
    assert (out / "meta.json").is_file()
    r = runner.invoke(app, ["qa", "search", "Which planet orbits closest to the Sun?", "--index", str(out), "--k", "1"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Doc 1(Title: Mercury (planet))")


def test_eval_predictions_table(tmp_path, qa_files):
    nq, popqa = qa_files
    preds = tmp_path / "preds.jsonl"
    replies = [
        {"dataset": "nq", "id": "n0", "prediction": "<think>..</think><answer>Alexander Fleming</answer>"},  # EM 1
        {"dataset": "nq", "id": "n1", "prediction": "Kilimanjaro"},  # EM 1 (alias)
        {"dataset": "nq", "id": "n2", "prediction": "Vienna"},  # EM 0
        # n3 missing: unanswered, EM 0
        {"dataset": "popqa", "id": "p0", "prediction": "the planet Mercury"},  # EM 0, F1 2/3, cover 1
        {"dataset": "popqa", "id": "p1", "answer": "Guido van Rossum"},  # EM 1
        {"dataset": "popqa", "id": "p2", "response": "<think>no idea</think>"},  # no answer
        {"dataset": "popqa", "id": "p3", "prediction": "The pancreas."},  # EM 1
    ]
    preds.write_text("".join(json.dumps(r) + "\n" for r in replies), encoding="utf-8")
    out = tmp_path / "run"
    r = runner.invoke(
        app, ["qa", "eval", "--data", str(nq), "--data", str(popqa), "--predictions", str(preds), "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    metrics = json.loads((out / "metrics.json").read_text())["ood_qa"]
    by_name = {d["dataset"]: d for d in metrics["datasets"]}
    assert by_name["nq"]["em"] == pytest.approx(50.0)
    assert by_name["popqa"]["em"] == pytest.approx(50.0)
    assert by_name["popqa"]["f1"] == pytest.approx(100 * (2 / 3 + 1 + 0 + 1) / 4)
    assert by_name["popqa"]["cover_em"] == pytest.approx(75.0)
    assert metrics["average"]["em"] == pytest.approx(50.0)
    assert "| **average** | 8 | 50.00" in r.stdout
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [row["prediction"] for row in rows][:4] == ["Alexander Fleming", "Kilimanjaro", "Vienna", None]


def test_eval_with_an_agent_using_the_search_tool(tmp_path, qa_files, index_dir):
    nq, popqa = qa_files
    r = runner.invoke(
        app,
        [
            "qa",
            "eval",
            "--data",
            str(nq),
            "--data",
            str(popqa),
            "--agent",
            "tests.qa.test_cli:title_agent",
            "--index",
            str(index_dir),
            "-n",
            "4",
        ],
    )
    assert r.exit_code == 0, r.output
    # Only "What is the highest mountain in Africa?" has a passage title equal to its answer.
    assert "| nq | 4 | 25.00" in r.stdout and "| popqa | 4 | 0.00" in r.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["qa", "eval", "--data", "nope.jsonl", "--predictions", "p.jsonl"], "no such file"),
        (["qa", "eval", "--data", "x.jsonl"], "exactly one of --predictions"),
        (["qa", "search", "x", "--index", "/nonexistent"], "meta.json missing"),
        (["qa", "index", "/nonexistent.jsonl", "--out", "/tmp/never"], "no such corpus"),
        (["qa", "index", "/nonexistent.jsonl", "--encoder", "bert"], "unknown encoder"),
    ],
)
def test_cli_errors_are_messages(args, message):
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output
