"""A guard that ends a process's descendants once that process is gone, however it ended.

A process killed outright (SIGKILL, the OOM killer, `os._exit` after a stuck weight transfer) runs no
clean-up, and a child it started may live on: vLLM's engine core does (it watches for no parent), holding
its share of the GPU, so the process its supervisor starts in its place finds the memory taken and fails.
`guard_descendants()` starts a small process beside the caller that notes the caller's descendants every
`interval_s` and, once the caller has gone, SIGKILLs those still running (each checked by its start time,
so a reused pid is never hit), with whatever they started themselves, then exits.

    python -m services.common.reaper PID [INTERVAL_S]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.common.supervisor import alive, proc_stat, process_start_time


def descendants(pid: int) -> dict[int, int | None]:
    """Every process below `pid` (its children, theirs, …), with its start time."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: dict[int, int | None] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = process_start_time(child)
                todo.append(child)
    return found


def guard(parent: int, interval_s: float = 1.0) -> list[int]:
    """Follow `parent`'s descendants (this process left out) until it is gone, then SIGKILL the ones
    left and theirs; returns the pids killed."""
    started = process_start_time(parent)
    known: dict[int, int | None] = {}
    while alive(parent, started):
        known = {p: t for p, t in descendants(parent).items() if p != os.getpid()}
        time.sleep(interval_s)
    killed = []
    for pid, when in known.items():
        if not alive(pid, when):
            continue
        below = descendants(pid)
        for victim, victim_started in [(pid, when), *below.items()]:
            if alive(victim, victim_started):
                try:
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)
                except ProcessLookupError:
                    pass
    return killed


def guard_descendants(interval_s: float = 1.0) -> subprocess.Popen:
    """Start the guard of this process's descendants: it outlives this process by design (no parent-death
    signal), stays in its process group (a fleet stopped by group stops it too) and writes to its stderr."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.common.reaper", str(os.getpid()), str(interval_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


if __name__ == "__main__":
    gone = guard(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
    if gone:
        print(f"reaper: {sys.argv[1]} is gone; killed what it left: {sorted(gone)}", file=sys.stderr, flush=True)
