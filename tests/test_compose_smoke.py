"""The Compose fleet for real (scripts/compose-smoke): only with STAR_COMPOSE_SMOKE=1 on a machine
with a Docker engine, since it builds images and runs every service. Extra arguments for the script
(a local base image, say) come from STAR_COMPOSE_SMOKE_ARGS."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("STAR_COMPOSE_SMOKE") != "1",
                                 reason="set STAR_COMPOSE_SMOKE=1 (needs a Docker engine)")]


@pytest.mark.timeout(7200)
def test_compose_fleet_serves_scores_and_trains_one_step_then_goes_away():
    args = shlex.split(os.environ.get("STAR_COMPOSE_SMOKE_ARGS", ""))
    proc = subprocess.run([str(ROOT / "scripts" / "compose-smoke"), *args], capture_output=True, text=True,
                          timeout=7000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (ROOT / "bench" / "results" / "compose_smoke.md").read_text()
    result = json.loads(report.split("```json\n", 1)[1].split("\n```", 1)[0])
    assert result["tools"]["ok"] and result["tools"]["chars"] > 0
    assert result["score"]["status"] == 200
    assert result["rl"]["state"] == "finished" and result["rl"]["weights_version"] == 1, result["rl"]
