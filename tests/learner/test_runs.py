"""A run's state read from where it writes (its config's output_dir, never a predecessor's status there)
and, for a run an earlier API process started, its liveness and stop through the pid and start time in run.json."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from services.common.supervisor import process_start_time
from services.learner.runs import RunManager
from services.learner.trainer import write_status
from tests.support.waiting import until


def _adopted_run(root, output, argv) -> tuple[str, subprocess.Popen]:
    """A run folder as an earlier API process left it, its process still going."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    folder = root / "r1"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"output_dir": str(output)}))
    (folder / "run.json").write_text(
        json.dumps(
            {
                "id": "r1",
                "kind": "rl",
                "pid": proc.pid,
                "ranks": 1,
                "started": process_start_time(proc.pid),
                "created": time.time(),
            }
        )
    )
    return "r1", proc


def test_a_run_of_an_earlier_api_process_is_described_from_its_output_and_stopped_by_pid(tmp_path):
    output = tmp_path / "controller" / "rl"
    script = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
        "print('ready', flush=True); time.sleep(120)"
    )
    write_status(output, state="stopped", step=1, version=1)  # the run before it, in the same output folder
    run_id, proc = _adopted_run(tmp_path / "runs", output, [sys.executable, "-c", script])
    try:
        manager = RunManager(tmp_path / "runs")  # a fresh API process: it did not start the run
        assert manager.describe(run_id)["state"] == "starting"  # not its predecessor's "stopped"
        write_status(output, state="running", step=1, version=1)
        described = manager.describe(run_id)
        assert (described["state"], described["step"]) == ("running", 1)
        manager.stop(run_id)
        assert proc.wait(30) == 0  # SIGTERM reached the run's process
        # it ended without recording an end state: no longer "running"
        assert until(lambda: manager.describe(run_id)["state"] == "failed", 10)
        write_status(output, state="stopped", step=1, version=1)
        assert manager.describe(run_id)["state"] == "stopped"
    finally:
        proc.kill()
        proc.wait()
