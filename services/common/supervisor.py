"""The one process supervisor: how every local fleet (the RL stage, `star up`, the learner's runs
API, embedded Redis) starts, restarts and stops its processes.

- One process group: the first child starts a new group and every later child joins it, so
  stopping the fleet reaches grandchildren too (torchrun's ranks) with one `killpg`. The group is
  not the controller's: a Ctrl-C or a closed terminal reaches the controller alone, and the
  controller stops the fleet in order (learner last to checkpoint, Redis after it).
- Children die with their supervisor: each one asks the kernel for SIGTERM when the process that
  started it ends (PR_SET_PDEATHSIG), so even a SIGKILL of the controller stops them. Whatever
  survives that (a grandchild) is found on the next start through the record file
  (`stop_orphans`): pids, their start times (so a reused pid is never killed) and the group.
- Restarts with backoff and a budget per time window (`RestartPolicy`): a child that keeps
  dying is given up on, one that died once an hour ago is not.
- `RunLock`: one controller per run folder (flock, released by the kernel however it ends).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class SupervisorError(RuntimeError):
    """A child cannot be kept running (restart budget spent) or a run folder is taken."""


@dataclass(frozen=True)
class RestartPolicy:
    """At most `max_restarts` restarts in any `window_s` seconds; the n-th restart in a row waits
    `backoff_s * 2**(n-1)` (capped at `max_backoff_s`); a child that ran `reset_after_s` without
    dying starts its backoff again from the beginning."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    reset_after_s: float = 120.0

    def delay(self, streak: int) -> float:
        return 0.0 if streak <= 0 else min(self.backoff_s * 2 ** (streak - 1), self.max_backoff_s)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first, then the parent pid), or None
    when the process is gone or unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None when it is gone; with the
    pid it names one process for good (pids are reused)."""
    fields = proc_stat(pid)
    return None if fields is None else int(fields[19])


def alive(pid: int, started: int | None = None) -> bool:
    """Is `pid` running (and, given `started`, still the same process)? Zombies count as gone."""
    fields = proc_stat(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] == "Z":
        return False
    return started is None or int(fields[19]) == started


def _die_with_parent(parent: int):
    def preexec() -> None:
        if _libc is not None:
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request was made
            os._exit(1)

    return preexec


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    group: int | None = 0,
    die_with_parent: bool = True,
    cwd: Path | None = None,
) -> subprocess.Popen:
    """Start one process with output appended to `log_path`. `group`: 0 starts a new process group
    led by the child, a pgid joins that group (a new one when it has emptied)."""
    out: IO[bytes] | int = subprocess.DEVNULL
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")
    kwargs: dict[str, Any] = {
        "env": dict(env) if env is not None else None,
        "stdout": out,
        "stderr": out,
        "stdin": subprocess.DEVNULL,
        "cwd": cwd,
    }
    if die_with_parent and _libc is not None:
        kwargs["preexec_fn"] = _die_with_parent(os.getpid())
    try:
        try:
            return subprocess.Popen(list(argv), process_group=group, **kwargs)
        except PermissionError:
            if not group:
                raise
            return subprocess.Popen(list(argv), process_group=0, **kwargs)  # that group has emptied
    finally:
        if not isinstance(out, int):
            out.close()


def stop_process(proc: subprocess.Popen | None, timeout: float = 30.0) -> int | None:
    """SIGTERM, then SIGKILL after `timeout`; returns the exit status (None if it was not ours)."""
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def stop_pid(pid: int, timeout: float = 10.0, started: int | None = None) -> bool:
    """Stop a process that is not our child (an orphan, a detached `star up` service); returns
    whether it was running."""
    if not alive(pid, started):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive(pid, started):
        _reap(pid)
        time.sleep(0.05)
    if alive(pid, started):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _reap(pid)
    return True


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_ready(name: str, proc: subprocess.Popen, url: str, log: Path | None, timeout: float) -> None:
    """Wait for `url`/readyz to answer 200; fails when the process exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"{name} not ready within {timeout:.0f}s; see {log}")


@dataclass
class Child:
    """One supervised process: how to start it and its restart history."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log: Path | None = None
    stop_timeout: float = 30.0
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    _recent: deque = field(default_factory=deque)
    _streak: int = 0
    _due: float | None = None  # when a pending restart may happen

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts children in one process group, restarts them within their policy, stops them all."""

    def __init__(self, record: Path | None = None, die_with_parent: bool = True) -> None:
        self.record = record
        self.die_with_parent = die_with_parent
        self.children: dict[str, Child] = {}
        self.pgid: int | None = None
        self.info: dict[str, Any] = {}  # saved with the record (no secrets: it is not private)

    # -- starting ------------------------------------------------------------------------------

    def start(self, child: Child) -> Child:
        env = {**os.environ, **child.env}
        child.proc = spawn(
            child.argv, env=env, log_path=child.log, group=self.pgid or 0, die_with_parent=self.die_with_parent
        )
        if self.pgid is None or os.getpgid(child.proc.pid) != self.pgid:
            try:
                self.pgid = os.getpgid(child.proc.pid)
            except ProcessLookupError:
                pass
        child.started_at = time.monotonic()
        self.children[child.name] = child
        self._save()
        return child

    def add(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        policy: RestartPolicy | None = None,
        stop_timeout: float = 30.0,
    ) -> Child:
        child = Child(name, list(argv), dict(env or {}), log, stop_timeout, policy or RestartPolicy())
        return self.start(child)

    # -- watching ------------------------------------------------------------------------------

    def restart_due(self, child: Child, now: float | None = None) -> bool:
        """`child` has exited: note it (once) and say whether its restart may happen now. Raises
        SupervisorError when its budget for the window is spent."""
        now = time.monotonic() if now is None else now
        if child._due is None:
            if now - child.started_at >= child.policy.reset_after_s:
                child._streak = 0
            while child._recent and now - child._recent[0] > child.policy.window_s:
                child._recent.popleft()
            if len(child._recent) >= child.policy.max_restarts:
                where = f"; see {child.log}" if child.log else ""
                raise SupervisorError(
                    f"{child.name} keeps dying (exit {child.exited()}, {len(child._recent)} "
                    f"restarts in {child.policy.window_s:.0f} s){where}"
                )
            child._streak += 1
            child._due = now + child.policy.delay(child._streak)
        return now >= child._due

    def restart(self, child: Child) -> Child:
        child._recent.append(time.monotonic())
        child._due = None
        child.restarts += 1
        return self.start(child)

    def poll(self, names: Sequence[str] | None = None) -> list[str]:
        """Restart the named (default: all) children that exited and whose backoff has passed;
        returns the names restarted."""
        restarted = []
        for child in list(self.children.values()):
            if names is not None and child.name not in names:
                continue
            if child.exited() is None or child.proc is None:
                continue
            if self.restart_due(child):
                self.restart(child)
                restarted.append(child.name)
        return restarted

    # -- stopping ------------------------------------------------------------------------------

    def stop(self, name: str) -> None:
        child = self.children.get(name)
        if child is not None:
            stop_process(child.proc, child.stop_timeout)

    def stop_all(self, order: Sequence[str] | None = None) -> None:
        """Stop the children (in `order`, then the rest newest first), then SIGKILL whatever is
        left in the group (grandchildren)."""
        names = list(order or []) + [n for n in reversed(self.children) if n not in (order or [])]
        for name in names:
            self.stop(name)
        if self.pgid is not None:
            kill_group(self.pgid)
        if self.record is not None:
            self.record.unlink(missing_ok=True)

    def _save(self) -> None:
        if self.record is None:
            return
        children = [
            {"name": c.name, "pid": c.pid, "started": process_start_time(c.pid)}
            for c in self.children.values()
            if c.pid
        ]
        self.record.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"supervisor": os.getpid(), "pgid": self.pgid, "children": children, **self.info}, indent=1)
        )
        tmp.replace(self.record)


def stop_orphans(record: Path) -> list[str]:
    """Stop what a supervisor that died without cleaning up (SIGKILL, power loss of its terminal)
    left running, as listed in its record; returns the names stopped. Call it holding the lock
    that supervisor held, so it cannot be running."""
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return []
    children = [c for c in data.get("children", []) if c.get("pid")]
    # the group is still ours only while one of our processes is in it (a pgid is reused only
    # once its group is empty): then its grandchildren go too
    pgid = data.get("pgid")
    ours = (
        pgid
        and pgid != os.getpgid(0)
        and any(alive(int(c["pid"]), c.get("started")) and _pgid(int(c["pid"])) == pgid for c in children)
    )
    stopped = [c["name"] for c in children if stop_pid(int(c["pid"]), 10.0, c.get("started"))]
    if ours:
        kill_group(int(pgid))
    record.unlink(missing_ok=True)
    if stopped:
        log.warning("stopped processes left by an earlier controller", extra={"processes": stopped})
    return stopped


class RunLock:
    """An exclusive lock on a folder (`<folder>/.lock`, flock): a second controller on the same run
    folder is refused instead of starting a second Redis on the same data and a second learner on
    the same checkpoints. The kernel drops it when its holder ends, however it ends."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise SupervisorError(
                f"{self.path.parent} is in use by process {holder}; stop it first (or wait for it to end)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
