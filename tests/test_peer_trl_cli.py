"""The peer benchmark's command line in the main environment (its end-to-end smoke runs in .venv-trl): the TRL
side's Python is a file or a command on PATH, as the GPU job passes it, and a missing one, or one that cannot
import what the TRL side needs, is a CLI error before any phase runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer_trl import python_command, trl_side_failures

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
