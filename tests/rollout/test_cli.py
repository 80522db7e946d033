"""`star rollout`: clear errors for bad input, and a real run printing the trajectories."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from services.cli import app

QUERY = {
    "org": "Sarasota",
    "dest": "Chicago",
    "days": 3,
    "visiting_city_number": 1,
    "date": "['2022-03-22', '2022-03-23', '2022-03-24']",
    "people_number": 1,
    "budget": 1900,
    "local_constraint": "{'house rule': None, 'cuisine': None, 'room type': None, 'transportation': None}",
    "query": "Plan a 3-day trip from Sarasota to Chicago for one person with $1,900.",
}


@pytest.fixture
def query_file(tmp_path):
    path = tmp_path / "q.json"
    path.write_text(json.dumps(QUERY))
    return path


@pytest.mark.parametrize(
    "make,args,message",
    [
        (lambda p: None, ["--query", "{missing}"], "no query file"),
        (lambda p: p.write_text("{not json"), ["--query", "{file}"], "is not JSON"),
        (lambda p: p.write_text(json.dumps({**QUERY, "days": 4})), ["--query", "{file}"], "days"),
        (lambda p: p.write_text(json.dumps(QUERY)), ["--query", "{file}", "--engine", "llamacpp"], "unknown engine"),
        (
            lambda p: p.write_text(json.dumps(QUERY)),
            ["--query", "{file}", "--engine", "transformers", "--model", "{dir}"],
            "not an HF model folder",
        ),
        (
            lambda p: p.write_text(json.dumps(QUERY)),
            ["--query", "{file}", "--engine", "openai", "--model", "x"],
            "needs base_url",
        ),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, make, args, message):
    file = tmp_path / "q.json"
    make(file)
    argv = [a.format(file=file, missing=tmp_path / "none.json", dir=tmp_path) for a in args]
    result = CliRunner().invoke(app, ["rollout", *argv])
    said = " ".join(result.output.split())  # rich wraps long lines
    assert result.exit_code == 2 and message in said and "Traceback" not in said


def test_rollout_prints_the_group_and_writes_jsonl(query_file, tiny_model, official_world_url, tmp_path):
    out = tmp_path / "t.jsonl"
    env = {**os.environ, "STAR_DB_URL": official_world_url, "HF_HUB_OFFLINE": "1", "COLUMNS": "160"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "rollout",
            "--model",
            str(tiny_model),
            "--query",
            str(query_file),
            "-G",
            "2",
            "--engine",
            "transformers",
            "--max-tokens",
            "6",
            "--context",
            "2048",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sample 0" in proc.stdout and "sample 1" in proc.stdout and "format_error" in proc.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["sample_index"] for t in lines] == [0, 1] and all(sum(t["loss_mask"]) == 18 for t in lines)
