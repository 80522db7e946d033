"""The embedded fleet: Redis and every service as local processes on 127.0.0.1 (`star up`).

Processes are detached (their own session) so they outlive the command that started them; what
was started is recorded in `STAR_HOME/fleet.json` so `star status` and `star down` find it. Each
service gets the others' URLs through the same STAR_* settings Compose and Helm set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path

import httpx
import redis

from services.common.redis import free_port, redis_server_binary
from services.common.settings import Settings, get_settings


@dataclass(frozen=True)
class ServiceSpec:
    """How to start one kind of process; `module` must exist for it to be started."""

    name: str
    module: str
    argv: tuple[str, ...]  # after `python -m`
    http: bool = True  # has /readyz
    env_url: str | None = None  # the STAR_* variable through which others find it


def _uvicorn(factory: str) -> tuple[str, ...]:
    return ("uvicorn", "--factory", factory, "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning",
            "--no-access-log")


# Start order matters: each service may need the ones above it.
SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec("sandbox", "services.sandbox.app", _uvicorn("services.sandbox.app:create_app"), env_url="STAR_SANDBOX_URL"),
    ServiceSpec("formatter", "services.formatter.app", _uvicorn("services.formatter.app:create_app"),
                env_url="STAR_FORMATTER_URL"),
    ServiceSpec("reward", "services.reward.app", _uvicorn("services.reward.app:create_app"), env_url="STAR_REWARD_URL"),
    ServiceSpec("reward-worker", "services.reward.worker", ("services.cli", "reward", "worker"), http=False),
    ServiceSpec("rollout", "services.rollout.app", _uvicorn("services.rollout.app:create_app"), env_url="STAR_ROLLOUT_URLS"),
    ServiceSpec("learner", "services.learner.app", _uvicorn("services.learner.app:create_app"), env_url="STAR_LEARNER_URL"),
)


@dataclass
class Process:
    name: str
    pid: int
    port: int | None
    log: str

    @property
    def url(self) -> str | None:
        return f"http://127.0.0.1:{self.port}" if self.port else None


@dataclass
class FleetState:
    redis_url: str
    processes: list[Process] = field(default_factory=list)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"redis_url": self.redis_url, "processes": [asdict(p) for p in self.processes]},
                                   indent=2))

    @classmethod
    def load(cls, path: Path) -> "FleetState | None":
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(data["redis_url"], [Process(**p) for p in data["processes"]])

    def env(self) -> dict[str, str]:
        """The STAR_* variables that point a client (or another service) at this fleet."""
        out = {"STAR_REDIS_URL": self.redis_url}
        specs = {s.name: s for s in SERVICES}
        for p in self.processes:
            spec = specs.get(p.name)
            if spec and spec.env_url and p.url:
                out[spec.env_url] = p.url
        return out


def state_path(settings: Settings | None = None) -> Path:
    return (settings or get_settings()).home / "fleet.json"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab")
    return subprocess.Popen(argv, env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)


def start_redis(settings: Settings, log_dir: Path) -> Process:
    return start_redis_at(settings.home / "redis", log_dir)


def start_redis_at(data: Path, log_dir: Path, port: int | None = None) -> Process:
    """A real Redis with AOF on in `data`, so a restart resumes the streams (pass the old `port`
    to restart it where its clients already point)."""
    data.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    proc = _spawn([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data),
                   "--save", "", "--appendonly", "yes", "--protected-mode", "yes"], dict(os.environ),
                  log_dir / "redis.log")
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}; see {log_dir / 'redis.log'}")
        try:
            client.ping()
            return Process("redis", proc.pid, port, str(log_dir / "redis.log"))
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not answer within 10 s")


def start_service(spec: ServiceSpec, env: dict[str, str], log_dir: Path, timeout: float = 120.0) -> Process:
    port = free_port() if spec.http else None
    argv = [sys.executable, "-m", *(a.replace("{port}", str(port)) for a in spec.argv)]
    log = log_dir / f"{spec.name}.log"
    proc = _spawn(argv, {**os.environ, **env}, log)
    if spec.http:
        _wait_ready(spec.name, proc, f"http://127.0.0.1:{port}", log, timeout)
    return Process(spec.name, proc.pid, port, str(log))


def _wait_ready(name: str, proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
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


def available(spec: ServiceSpec) -> bool:
    return find_spec(spec.module) is not None


def up(settings: Settings | None = None, only: list[str] | None = None, extra_env: dict[str, str] | None = None,
       on_start=None) -> FleetState:
    """Start Redis and the services (all available ones, or `only`), unless a fleet is running."""
    settings = settings or get_settings()
    path = state_path(settings)
    existing = FleetState.load(path)
    if existing and any(alive(p.pid) for p in existing.processes):
        raise RuntimeError(f"a fleet is already running (see {path}); run `star down` first")
    log_dir = settings.home / "logs"
    redis_proc = start_redis(settings, log_dir)
    state = FleetState(f"redis://127.0.0.1:{redis_proc.port}/0", [redis_proc])
    state.save(path)
    try:
        for spec in SERVICES:
            if only is not None and spec.name not in only:
                continue
            if not available(spec):
                continue
            env = {**state.env(), "STAR_DB_URL": settings.world_url, "STAR_HOME": str(settings.home),
                   **(extra_env or {})}
            proc = start_service(spec, env, log_dir)
            state.processes.append(proc)
            state.save(path)
            if on_start:
                on_start(proc)
    except Exception:
        down(settings)
        raise
    return state


def down(settings: Settings | None = None, timeout: float = 10.0) -> list[str]:
    """Stop every recorded process (services first, Redis last); returns the names stopped."""
    settings = settings or get_settings()
    path = state_path(settings)
    state = FleetState.load(path)
    if state is None:
        return []
    stopped = []
    for proc in reversed(state.processes):
        if alive(proc.pid):
            _terminate(proc.pid, timeout)
            stopped.append(proc.name)
    path.unlink(missing_ok=True)
    return stopped


def _terminate(pid: int, timeout: float) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def status(settings: Settings | None = None) -> dict:
    """Each process's health, the streams' depths and the published weight version."""
    from services.common.streams import StreamNames, stream_depth

    settings = settings or get_settings()
    state = FleetState.load(state_path(settings))
    if state is None:
        return {"running": False, "processes": [], "streams": {}, "weights": None}
    rows = []
    for p in state.processes:
        health = "down"
        if alive(p.pid):
            health = "up"
            if p.url and p.name != "redis":
                try:
                    health = "ready" if httpx.get(f"{p.url}/readyz", timeout=2).status_code == 200 else "not ready"
                except httpx.TransportError:
                    health = "no answer"
        url = state.redis_url if p.name == "redis" else p.url
        rows.append({"name": p.name, "pid": p.pid, "url": url, "health": health, "log": p.log})
    streams, weights = {}, None
    try:
        client = redis.Redis.from_url(state.redis_url, socket_connect_timeout=1)
        names = StreamNames(settings.stream_prefix)
        for stream, group in ((names.tasks, "rollout"), (names.trajectories, "reward"), (names.scored, "learner")):
            streams[stream] = stream_depth(client, stream, group)
            streams[stream]["dead"] = client.xlen(StreamNames.dead(stream))
        raw = client.get(names.weights_latest)
        weights = json.loads(raw) if raw else None
    except redis.RedisError as exc:
        streams = {"error": str(exc)}
    return {"running": True, "redis_url": state.redis_url, "processes": rows, "streams": streams, "weights": weights}
