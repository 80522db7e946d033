"""Stopping the RL stage's fleet: the learner first, given time to exit when its run is over."""

from __future__ import annotations

import json
import signal
import sys

import pytest


@pytest.mark.parametrize("state, exit_code", [("finished", 0), ("running", -signal.SIGTERM)])
def test_a_learner_whose_run_is_over_is_left_to_exit_before_the_fleet_stops(tmp_path, state, exit_code):
    """A learner that wrote `finished` still tears down (process groups, threads) before it exits, with
    no Python handler for SIGTERM by then: stopping it at once would kill it mid-teardown. One still
    training is stopped as before."""
    from services.common.supervisor import Supervisor
    from services.controller.embedded_fleet import EmbeddedFleet

    status = tmp_path / "rl" / "status.json"
    status.parent.mkdir(parents=True)
    status.write_text(json.dumps({"state": state}))
    # no SIGTERM handler: a stop signal kills it (-15), as one reaching a rank in its teardown does
    teardown = "import time; time.sleep(2)" if state == "finished" else "import time; time.sleep(60)"
    sup = Supervisor()
    learner = sup.add("learner", [sys.executable, "-c", teardown], log=tmp_path / "learner.log")
    fleet = EmbeddedFleet(sup, "", learner=learner, status_path=status)
    fleet.stop()
    assert learner.exited() == exit_code
