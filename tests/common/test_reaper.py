"""The descendants' guard (services/common/reaper.py): what a process killed outright leaves running is
ended, as vLLM's engine core must be when its rollout worker is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from services.common.supervisor import alive

# a "worker": starts its guard, then a child that would outlive it, then waits to be killed
WORKER = """
import subprocess, sys, time
from services.common.reaper import guard_descendants
guard_descendants(0.1)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_child_left_by_a_sigkilled_process_is_ended_by_its_guard():
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    child = int(worker.stdout.readline())
    try:
        time.sleep(0.5)  # the guard has noted the child
        assert alive(child)
        worker.kill()
        worker.wait(10)
        assert _wait(lambda: not alive(child), 10), "the child outlived its SIGKILLed parent"
    finally:
        for pid in (child,):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_descendants_reach_grandchildren():
    from services.common.reaper import descendants

    shell = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        assert _wait(lambda: len(descendants(shell.pid)) == 1, 5)
        assert _wait(lambda: len(descendants(os.getpid())) >= 2, 5)  # the shell and its sleep below this one
    finally:
        for pid in descendants(shell.pid):
            os.kill(pid, signal.SIGKILL)
        shell.kill()
        shell.wait()
