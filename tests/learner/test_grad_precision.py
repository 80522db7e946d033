"""bench/grad_precision.py end to end on a few micro-batches: fp32 reduction is repeatable to the bit,
and each bf16 step (the reduction, then the accumulation) loses more of the gradient."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bf16_reduction_and_accumulation_lose_gradient_in_order(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "grad_precision.py"),
            "--micro-batches",
            "8",
            "--results",
            str(tmp_path),
            "--name",
            "gp",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-12000:]  # the ranks' own errors come before the launcher's summary
    configs = json.loads((tmp_path / "gp.json").read_text())["configs"]
    err = {name: row["relative_error"] for name, row in configs.items()}
    assert err["fp32 accumulation, fp32 reduction, run again"] == 0.0
    assert 0 < err["fp32 accumulation, bf16 reduction"] < err["bf16 accumulation, bf16 reduction"]
    assert "| bf16 accumulation, bf16 reduction |" in (tmp_path / "gp.md").read_text()
