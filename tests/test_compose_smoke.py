"""The Compose path for real (scripts/compose-smoke). Its record, bench/results/compose_smoke.json, must be
as new as what it tested: a change to compose.yaml, a Dockerfile, deploy/ or services/pipeline/external.py
fails the first test here until the smoke is run again. The smoke itself runs only with
STAR_COMPOSE_SMOKE=1 on a machine with a Docker engine (it builds images and trains); extra arguments for
the script (a local base image, say) come from STAR_COMPOSE_SMOKE_ARGS."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench" / "results" / "compose_smoke.json"


def _recorder():
    spec = importlib.util.spec_from_file_location("compose_smoke_record", ROOT / "scripts" / "compose_smoke_record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stale_files(record: dict) -> list[str]:
    """The tested files that changed (or came or went) since the record was made."""
    then, now = record.get("tested_files", {}), _recorder().watched_digests(ROOT)
    return sorted(name for name in then.keys() | now.keys() if then.get(name) != now.get(name))


def test_the_smoke_record_passed_and_is_as_new_as_what_it_tested():
    assert RECORD.is_file(), "no bench/results/compose_smoke.json: run scripts/compose-smoke"
    record = json.loads(RECORD.read_text())
    assert record["passed"], record.get("failed")
    assert record["recipe"] == "configs/tiny.yaml" and "docker compose --profile train up -d" in record["commands"]
    assert record["rl"]["steps_trained"] == record["rl_steps_wanted"] > 0
    assert len(set(record["world_hash"].values())) == 1 and None not in record["world_hash"].values()
    changed = stale_files(record)
    assert not changed, f"changed since the smoke ran on {record['commit'][:12]}: {changed}; run scripts/compose-smoke"


def test_a_change_to_a_tested_file_makes_the_record_stale(tmp_path):
    record = {"tested_files": _recorder().watched_digests(ROOT)}
    assert stale_files(record) == []
    assert "compose.yaml" in record["tested_files"] and "services/pipeline/external.py" in record["tested_files"]
    assert "deploy/images/Dockerfile.redis" in record["tested_files"]
    edited = {**record["tested_files"], "compose.yaml": "0" * 64}
    assert stale_files({"tested_files": edited}) == ["compose.yaml"]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("STAR_COMPOSE_SMOKE") != "1", reason="set STAR_COMPOSE_SMOKE=1 (needs a Docker engine)"
)
@pytest.mark.timeout(7200)
def test_compose_trains_the_default_recipe_as_documented():
    args = shlex.split(os.environ.get("STAR_COMPOSE_SMOKE_ARGS", ""))
    proc = subprocess.run(
        [str(ROOT / "scripts" / "compose-smoke"), *args], capture_output=True, text=True, timeout=7000
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(RECORD.read_text())["passed"]
