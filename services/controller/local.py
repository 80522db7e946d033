"""`star up`, `star down`, `star status`: Redis and every service as local processes on 127.0.0.1.

`star up` starts one detached supervisor process (`python -m services.controller.local supervise`),
which outlives the command: it starts Redis (with a password) and the services in one process
group through the launcher, restarts what dies (backoff, a budget per window) and records them in
`STAR_HOME/fleet.json` (mode 0600: it holds the Redis URL) so `star status` and `star down` find
them. `star down` stops the supervisor, which stops the rest. Each service gets the others' URLs
through the same STAR_* settings Compose and Helm set.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import redis

from services.common.redis import redact
from services.common.settings import Settings, get_settings
from services.common.supervisor import alive as _alive_since, spawn, stop_pid
from services.controller import launcher
from services.controller.launcher import SERVICES, Process, available


@dataclass
class FleetState:
    redis_url: str
    processes: list[Process] = field(default_factory=list)
    supervisor: int | None = None
    ready: bool = False
    error: str | None = None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{k: v for k, v in asdict(p).items() if k != "password"} for p in self.processes]
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                json.dumps(
                    {
                        "redis_url": self.redis_url,
                        "processes": rows,
                        "supervisor": self.supervisor,
                        "ready": self.ready,
                        "error": self.error,
                    },
                    indent=2,
                )
            )
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> FleetState | None:
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except ValueError:
            return None
        return cls(
            data["redis_url"],
            [Process(**p) for p in data["processes"]],
            data.get("supervisor"),
            bool(data.get("ready")),
            data.get("error"),
        )

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
    return _alive_since(pid)


def up(
    settings: Settings | None = None,
    only: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
    on_start=None,
    timeout: float = 300.0,
) -> FleetState:
    """Start the fleet's supervisor (detached) and wait until every service is ready, unless a
    fleet is running."""
    settings = settings or get_settings()
    path = state_path(settings)
    existing = FleetState.load(path)
    if existing and (
        existing.supervisor and alive(existing.supervisor) or any(alive(p.pid) for p in existing.processes)
    ):
        raise RuntimeError(f"a fleet is already running (see {path}); run `star down` first")
    path.unlink(missing_ok=True)
    log_dir = settings.home / "logs"
    argv = [sys.executable, "-m", "services.controller.local", "supervise"] + [f"--only={n}" for n in (only or [])]
    env = {**os.environ, "STAR_HOME": str(settings.home), "STAR_FLEET_ENV": json.dumps(extra_env or {})}
    proc = spawn(argv, env=env, log_path=log_dir / "supervisor.log", group=0, die_with_parent=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = FleetState.load(path)
        if state is not None and state.error:
            down(settings)
            raise RuntimeError(state.error)
        if state is not None and state.ready:
            for p in state.processes:
                if on_start:
                    on_start(p)
            return state
        if proc.poll() is not None:
            raise RuntimeError(
                f"the fleet's supervisor exited with {proc.returncode}; see {log_dir / 'supervisor.log'}"
            )
        time.sleep(0.2)
    down(settings)
    raise RuntimeError(f"the fleet was not ready within {timeout:.0f} s; see {log_dir}")


def supervise(
    settings: Settings | None = None,
    only: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
    poll_s: float = 0.5,
) -> None:
    """The fleet's supervisor process: start Redis and the services, keep them running, stop them
    all on SIGTERM/SIGINT/SIGHUP. Its children die with it even if it is killed."""
    from services.common.supervisor import Supervisor, SupervisorError

    settings = settings or get_settings()
    path = state_path(settings)
    log_dir = settings.home / "logs"
    stop = {"now": False}

    def _stop(*_: object) -> None:
        stop["now"] = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    sup = Supervisor(None)
    state = FleetState("", supervisor=os.getpid())
    ports: dict[str, int | None] = {}
    try:
        state.redis_url = launcher.start_redis(sup, settings.home / "redis", log_dir)
        ports["redis"] = sup.info["redis_port"]
        for spec in SERVICES:
            if (only and spec.name not in only) or not available(spec) or stop["now"]:
                continue
            env = {
                **_service_env(state, ports),
                "STAR_DB_URL": settings.world_url,
                "STAR_HOME": str(settings.home),
                **(extra_env or {}),
            }
            _, ports[spec.name] = launcher.start_service(sup, spec, env, log_dir)
        state.ready = True
        while not stop["now"]:
            _record(state, sup, ports, path)
            sup.poll()
            time.sleep(poll_s)
    except (RuntimeError, SupervisorError) as exc:
        state.error = str(exc)
        _record(state, sup, ports, path)
    finally:
        sup.stop_all([n for n in reversed(sup.children) if n != "redis"] + ["redis"])
        if not state.error:
            path.unlink(missing_ok=True)


def _service_env(state: FleetState, ports: dict[str, int | None]) -> dict[str, str]:
    out = {"STAR_REDIS_URL": state.redis_url}
    for spec in SERVICES:
        if spec.env_url and ports.get(spec.name):
            out[spec.env_url] = f"http://127.0.0.1:{ports[spec.name]}"
    return out


def _record(state: FleetState, sup, ports: dict[str, int | None], path: Path) -> None:
    state.processes = [Process(c.name, c.pid, ports.get(c.name), str(c.log)) for c in sup.children.values() if c.pid]
    state.save(path)


def down(settings: Settings | None = None, timeout: float = 30.0) -> list[str]:
    """Stop the fleet: its supervisor stops the services, then Redis; whatever outlived a killed
    supervisor is stopped here by pid. Returns the names that were running."""
    settings = settings or get_settings()
    path = state_path(settings)
    state = FleetState.load(path)
    if state is None:
        return []
    running = [p.name for p in state.processes if alive(p.pid)]
    if state.supervisor:
        stop_pid(state.supervisor, timeout)
    for proc in reversed(state.processes):
        stop_pid(proc.pid, 10)
    path.unlink(missing_ok=True)
    return running


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
        url = redact(state.redis_url) if p.name == "redis" else p.url
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
    return {
        "running": True,
        "redis_url": redact(state.redis_url),
        "redis_password_file": str(settings.home / "redis" / "redis.password"),
        "processes": rows,
        "streams": streams,
        "weights": weights,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m services.controller.local supervise [--only=NAME ...]` (started by `star up`)."""
    from services.common.logging import configure_logging

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "supervise":
        print("usage: python -m services.controller.local supervise [--only=NAME ...]", file=sys.stderr)
        return 2
    settings = get_settings()
    configure_logging("fleet", settings.log_level, settings.log_json)
    only = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--only=")]
    supervise(settings, only or None, json.loads(os.environ.get("STAR_FLEET_ENV") or "{}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
