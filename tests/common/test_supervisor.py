"""The process supervisor with real processes: restarts with backoff and a budget per window, one
process group, children that die with their supervisor however it ends, orphans found and
stopped by the next one, and the run-folder lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.common.supervisor import (
    RestartPolicy,
    RunLock,
    Supervisor,
    SupervisorError,
    alive,
    process_start_time,
    stop_orphans,
)

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def wait_until(condition, timeout=10.0, poll=0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return False


def test_restarts_back_off_and_stop_at_the_budget(tmp_path):
    sup = Supervisor(tmp_path / "record.json")
    policy = RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.2, max_backoff_s=10)
    child = sup.add(
        "crasher", [sys.executable, "-c", "raise SystemExit(3)"], log=tmp_path / "crasher.log", policy=policy
    )
    starts = [time.monotonic()]
    try:
        with pytest.raises(SupervisorError, match="crasher keeps dying .*3 restarts"):
            while True:
                if sup.poll():
                    starts.append(time.monotonic())
                time.sleep(0.01)
    finally:
        sup.stop_all()
    assert child.restarts == 3
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # 0.2, 0.4, 0.8 s of backoff (plus the time each run took to exit)
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.8, gaps


def test_the_budget_is_per_window():
    policy = RestartPolicy(max_restarts=2, window_s=100, backoff_s=0.0, reset_after_s=1e9)
    sup = Supervisor(None)
    child = sup.add("c", [sys.executable, "-c", "pass"], policy=policy)
    try:
        now = time.monotonic()
        for _ in range(2):
            child.proc.wait(10)
            assert sup.restart_due(child, now)
            sup.restart(child)
        child.proc.wait(10)
        with pytest.raises(SupervisorError):
            sup.restart_due(child, now + 50)  # third death inside the window
        assert sup.restart_due(child, now + 200)  # the window has moved past both restarts
    finally:
        sup.stop_all()


def test_one_group_and_stop_all_reaches_grandchildren(tmp_path):
    sup = Supervisor(tmp_path / "record.json")
    grandchild_pid = tmp_path / "grandchild.pid"
    spawner = [
        sys.executable,
        "-c",
        textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(grandchild_pid)!r}, "w").write(str(p.pid))
        time.sleep(60)
    """),
    ]
    a = sup.add("a", SLEEP)
    b = sup.add("b", spawner)
    # the spawner creates the file, then writes the pid: wait for the pid itself
    assert wait_until(lambda: grandchild_pid.exists() and grandchild_pid.read_text().strip())
    grandchild = int(grandchild_pid.read_text())
    assert os.getpgid(a.pid) == os.getpgid(b.pid) == os.getpgid(grandchild) == sup.pgid != os.getpgid(0)
    assert json.loads((tmp_path / "record.json").read_text())["pgid"] == sup.pgid
    sup.stop_all()
    assert wait_until(lambda: not alive(grandchild))
    assert not alive(a.pid) and not alive(b.pid)
    assert not (tmp_path / "record.json").exists()


CONTROLLER = """
import signal, sys, time
from pathlib import Path
# a controller in a terminal: SIGHUP ends it and SIGINT interrupts it (a runner started under nohup, or as a
# background job of a shell without job control, hands its children SIGHUP or SIGINT ignored)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
from services.common.supervisor import RunLock, Supervisor
lock = RunLock(Path(sys.argv[1])).acquire()
sup = Supervisor(Path(sys.argv[1]) / "fleet.json")
child = sup.add("worker", [sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def _controller(folder: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    return proc, int(proc.stdout.readline())


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP, signal.SIGINT])
def test_children_die_with_their_supervisor(tmp_path, how):
    proc, child = _controller(tmp_path)
    assert alive(child)
    proc.send_signal(how)
    proc.wait(10)
    assert wait_until(lambda: not alive(child)), "the child outlived its supervisor"


def test_a_rerun_finds_and_stops_orphans(tmp_path):
    """What survives its supervisor (here: a process that ignores the parent-death signal) is in the
    record; the next holder of the lock stops it, and never a process that merely reuses a pid."""
    proc, child = _controller(tmp_path)
    with pytest.raises(SupervisorError, match=f"in use by process {proc.pid}"):
        RunLock(tmp_path).acquire()
    orphan = subprocess.Popen(SLEEP, start_new_session=True)
    stranger = subprocess.Popen(SLEEP, start_new_session=True)
    record = json.loads((tmp_path / "fleet.json").read_text())
    record["children"] += [
        {"name": "orphan", "pid": orphan.pid, "started": process_start_time(orphan.pid)},
        {"name": "reused", "pid": stranger.pid, "started": 1},
    ]
    (tmp_path / "fleet.json").write_text(json.dumps(record))
    proc.kill()
    proc.wait(10)
    try:
        with RunLock(tmp_path):  # the kernel released the dead controller's lock
            stopped = stop_orphans(tmp_path / "fleet.json")
        assert "orphan" in stopped and "reused" not in stopped
        assert orphan.wait(10) is not None
        assert stranger.poll() is None
        assert wait_until(lambda: not alive(child))
    finally:
        for p in (orphan, stranger):
            if p.poll() is None:
                p.kill()
