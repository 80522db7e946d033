"""`star synth ...`: queries → plans → teacher trajectories from the command line, on the real
tables and on a fully synthetic world; bad input is a message and exit code 2, not a traceback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def made(official_world_url, tmp_path_factory):
    out = tmp_path_factory.mktemp("synth-cli")
    r = runner.invoke(
        app,
        [
            "synth",
            "queries",
            "--n",
            "20",
            "--mix",
            "4:3:3",
            "--splits",
            "2:2:1",
            "--out",
            str(out),
            "--db",
            official_world_url,
            "--workers",
            "1",
            "--seed",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    return out, r.output


def test_queries_command_writes_splits_and_a_summary(made):
    out, output = made
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accepted"] == {"easy": 8, "medium": 6, "hard": 6}
    assert (
        summary["splits"]["sft"]["easy"] + summary["splits"]["rl"]["easy"] + summary["splits"]["validation"]["easy"]
        == 8
    )
    assert sorted(summary["files"]) == ["queries.jsonl", "rl.jsonl", "sft.jsonl", "validation.jsonl"]
    assert "synthesized queries" in output and "hard" in output
    ids = [
        set(json.loads(line)["id"] for line in (out / f"{s}.jsonl").read_text().splitlines())
        for s in ("sft", "rl", "validation")
    ]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2]) and sum(map(len, ids)) == 20


def test_a_fourth_share_writes_held_out_queries_apart_from_the_rest(official_world_url, tmp_path):
    r = runner.invoke(
        app,
        [
            "synth",
            "queries",
            "--n",
            "20",
            "--mix",
            "4:3:3",
            "--splits",
            "2:2:1:1",
            "--out",
            str(tmp_path),
            "--db",
            official_world_url,
            "--workers",
            "1",
            "--seed",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    ids = {
        s: {json.loads(line)["id"] for line in (tmp_path / f"{s}.jsonl").read_text().splitlines()}
        for s in ("sft", "rl", "validation", "heldout")
    }
    assert [len(ids[s]) for s in ("sft", "rl", "validation", "heldout")] == [7, 7, 3, 3]
    assert len(set().union(*ids.values())) == 20  # disjoint
    r = runner.invoke(
        app,
        [
            "synth",
            "queries",
            "--n",
            "5",
            "--splits",
            "1:1",
            "--out",
            str(tmp_path / "bad"),
            "--db",
            official_world_url,
            "--workers",
            "1",
        ],
    )
    assert r.exit_code == 2 and "--splits must be 3 to 4" in r.output


def test_the_rl_split_may_have_a_mix_of_its_own(official_world_url, tmp_path):
    r = runner.invoke(
        app,
        [
            "synth",
            "queries",
            "--n",
            "20",
            "--mix",
            "1:1:1",
            "--rl-mix",
            "1:1:0",
            "--splits",
            "2:2:1",
            "--out",
            str(tmp_path),
            "--db",
            official_world_url,
            "--workers",
            "1",
            "--seed",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    levels = {
        s: [json.loads(line)["level"] for line in (tmp_path / f"{s}.jsonl").read_text().splitlines()]
        for s in ("sft", "rl", "validation")
    }
    assert [len(levels[s]) for s in levels] == [8, 8, 4]
    assert "hard" not in levels["rl"] and levels["rl"].count("easy") == levels["rl"].count("medium") == 4
    assert levels["sft"].count("hard") >= 2 and levels["validation"].count("hard") >= 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rl_mix"] == "1:1:0" and summary["splits"]["rl"] == {"easy": 4, "medium": 4, "hard": 0}
    r = runner.invoke(
        app,
        [
            "synth",
            "queries",
            "--n",
            "5",
            "--rl-mix",
            "0:0:0",
            "--out",
            str(tmp_path / "bad"),
            "--db",
            official_world_url,
            "--workers",
            "1",
        ],
    )
    assert r.exit_code == 2 and "--rl-mix must be 3" in r.output


def test_plan_and_teacher_commands(made, official_world_url):
    out, _ = made
    r = runner.invoke(
        app,
        [
            "synth",
            "plan",
            "--queries",
            str(out / "rl.jsonl"),
            "--db",
            official_world_url,
            "--out",
            str(out / "plans.jsonl"),
        ],
    )
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "plans.jsonl").read_text().splitlines()]
    assert rows and all(row["feasible"] and row["plan"] for row in rows)
    r = runner.invoke(
        app,
        [
            "synth",
            "teacher",
            "--queries",
            str(out / "sft.jsonl"),
            "--teacher",
            "oracle",
            "--out",
            str(out / "teacher"),
            "--db",
            official_world_url,
        ],
    )
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "teacher" / "teacher_summary.json").read_text())
    n_sft = len((out / "sft.jsonl").read_text().splitlines())
    assert summary["kept"] == summary["queries"] == n_sft >= 6
    assert len((out / "teacher" / "sft.jsonl").read_text().splitlines()) == n_sft


def test_synthetic_world_without_real_data(tmp_path):
    db = f"sqlite:///{tmp_path / 'small.sqlite'}"
    assert runner.invoke(app, ["world", "build", "--synthetic", "small", "--db", db]).exit_code == 0
    r = runner.invoke(
        app, ["synth", "queries", "--n", "10", "--out", str(tmp_path / "q"), "--db", db, "--workers", "1"]
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app,
        [
            "synth",
            "teacher",
            "--queries",
            str(tmp_path / "q" / "queries.jsonl"),
            "--out",
            str(tmp_path / "t"),
            "--db",
            db,
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "t" / "teacher_summary.json").read_text())["kept"] == 10
    # one-city (3-day) trips only, e.g. for a small model's first curriculum stage
    r = runner.invoke(
        app,
        ["synth", "queries", "--n", "8", "--days", "3", "--out", str(tmp_path / "q3"), "--db", db, "--workers", "1"],
    )
    assert r.exit_code == 0, r.output
    days = [json.loads(line)["days"] for line in (tmp_path / "q3" / "queries.jsonl").read_text().splitlines()]
    assert days == [3] * 8
    assert json.loads((tmp_path / "q3" / "summary.json").read_text())["trip_days"] == [3]


@pytest.mark.parametrize(
    "args,message",
    [
        (["synth", "queries", "--n", "5", "--mix", "4:3", "--out", "X"], "--mix must be 3"),
        (["synth", "queries", "--n", "5", "--budget-factors", "0.5:1:1", "--out", "X"], "at least 1"),
        (["synth", "queries", "--n", "5", "--language", "klingon", "--out", "X"], "template' or 'openai"),
        (["synth", "queries", "--n", "5", "--language", "openai", "--out", "X"], "needs --llm-url"),
        (["synth", "queries", "--n", "5", "--days", "4", "--out", "X"], "subset of (3, 5, 7)"),
        (["synth", "queries", "--n", "5", "--days", "three", "--out", "X"], "--days must be comma-separated"),
        (["synth", "teacher", "--queries", "absent.jsonl", "--out", "X"], "no query file"),
        (["synth", "teacher", "--queries", "absent.jsonl", "--teacher", "gpt", "--out", "X"], "'oracle' or 'openai'"),
    ],
)
def test_bad_options_are_messages(args, message):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())  # rich wraps long lines
    assert message in text and "Traceback" not in text
