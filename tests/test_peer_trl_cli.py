"""The peer benchmark in the main environment (its end-to-end smoke runs in .venv-trl): the TRL side's Python is
a file or a command on PATH, as the GPU job passes it, and a missing one, or one that cannot import what the TRL
side needs, is a CLI error before any phase runs; the TRL side's steps take their figures from TRL's log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer_trl import python_command, trl_side_failures, trl_steps

ROOT = Path(__file__).resolve().parents[1]


def peer_cli(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    """bench/peer_trl.py with these arguments, in this environment's Python."""
    return subprocess.run(
        [sys.executable, "bench/peer_trl.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_the_trl_python_is_a_file_or_a_command_on_path(tmp_path):
    assert python_command(Path(sys.executable)) == Path(sys.executable)
    on_path = python_command(Path("python3"))
    assert on_path is not None and on_path.is_absolute() and on_path.is_file()
    assert python_command(tmp_path / "no-python") is None
    assert python_command(Path("no-such-python-command")) is None


@pytest.mark.integration
def test_a_missing_trl_python_is_a_cli_error_naming_it(tmp_path):
    proc = peer_cli("--trl-python", "no-such-python-command", "--work", str(tmp_path), timeout=120)
    assert proc.returncode == 2
    assert "no TRL Python at no-such-python-command" in proc.stderr and "Traceback" not in proc.stderr


def test_the_trl_side_imports_are_checked_with_their_reasons(tmp_path):
    # this environment has transformers, datasets and accelerate but not TRL (it lives in .venv-trl)
    failures = trl_side_failures(Path(sys.executable), gpu=False)
    assert set(failures) == {"trl:GRPOTrainer"}
    assert "No module named 'trl'" in failures["trl:GRPOTrainer"]
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    broken.chmod(0o755)
    (reason,) = trl_side_failures(broken, gpu=False).values()
    assert "exit 3" in reason and "broken" in reason


@pytest.mark.integration
def test_a_trl_python_without_trl_fails_before_any_phase(tmp_path):
    proc = peer_cli("--trl-python", sys.executable, "--work", str(tmp_path / "work"), timeout=300)
    assert proc.returncode == 2
    assert "cannot import what the TRL side needs: trl:GRPOTrainer" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "work").exists()  # nothing ran


def test_each_trl_step_takes_the_reward_and_tokens_of_its_own_generation():
    # TRL's log history as the GPU run wrote it (2 updates per RL step): a generation's reward and cumulative
    # num_tokens come with the first update of its step, which ends before the step's timer entry is made
    log_history = [
        {"step": 1, "reward": 0.09375, "num_tokens": 157571.0, "loss": 0.1},
        {"step": 2, "loss": 0.2},
        {"step": 3, "reward": 0.15625, "num_tokens": 312100.0, "loss": 0.3},
        {"step": 4, "loss": 0.4},
        {"step": 5, "reward": 0.0625, "num_tokens": 474835.0, "loss": 0.5},
        {"step": 6, "loss": 0.6},
        {"train_runtime": 40.0},
    ]
    timed = [{"step": k, "step_s": 10.0 + k, "wall_s": 10.0 * k} for k in (1, 2, 3)]
    steps = trl_steps(timed, log_history)
    assert [s["reward"] for s in steps] == [0.09375, 0.15625, 0.0625]
    assert [s["tokens"] for s in steps] == [157571.0, 312100.0 - 157571.0, 474835.0 - 312100.0]
    assert [s["step_s"] for s in steps] == [11.0, 12.0, 13.0]
    # a step cut off before its generation was logged keeps its time and says it has no figures
    cut = trl_steps([*timed, {"step": 4, "step_s": 9.0, "wall_s": 40.0}], log_history)
    assert cut[-1]["reward"] is None and cut[-1]["tokens"] is None and cut[-1]["step_s"] == 9.0


def test_a_negative_side_cap_is_a_cli_error():
    proc = peer_cli("--side-minutes", "-1", "--phases", "report", timeout=120)
    assert proc.returncode == 2 and "--side-minutes must be 0 (no cap) or more, not -1" in proc.stderr
