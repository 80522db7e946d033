"""The peer benchmark's command line in the main environment (its end-to-end smoke runs in .venv-trl): the TRL
side's Python is a file or a command on PATH, as the GPU job passes it, and a missing one is a CLI error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer_trl import python_command

ROOT = Path(__file__).resolve().parents[1]


def test_the_trl_python_is_a_file_or_a_command_on_path(tmp_path):
    assert python_command(Path(sys.executable)) == Path(sys.executable)
    on_path = python_command(Path("python3"))
    assert on_path is not None and on_path.is_absolute() and on_path.is_file()
    assert python_command(tmp_path / "no-python") is None
    assert python_command(Path("no-such-python-command")) is None


@pytest.mark.integration
def test_a_missing_trl_python_is_a_cli_error_naming_it(tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench/peer_trl.py", "--trl-python", "no-such-python-command", "--work", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no TRL Python at no-such-python-command" in proc.stderr and "Traceback" not in proc.stderr
