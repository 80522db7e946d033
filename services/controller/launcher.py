"""The launcher: Redis and the services as local processes on 127.0.0.1, started one way.

`star up` (`local.supervise`) and the RL stage's embedded fleet (`embedded_fleet.start_fleet`) both
start their processes here under a supervisor: Redis with AOF and a password (`start_redis`), then
each service from its `ServiceSpec` on a free port, waited for until it is ready (`start_service`).
`ServiceProcess` runs one service's app alone (the tests' and benches' servers); `ensure_world` builds
the default world once, for `star up` and `star train`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from rich.console import Console

from services.common.redis import free_port, local_url, redact, redis_argv, redis_password, wait_for_redis
from services.common.settings import get_settings
from services.common.supervisor import Child, Supervisor, spawn, stop_process, wait_ready

console = Console()
READY_S = 120.0  # how long a service may take to answer /readyz


@dataclass(frozen=True)
class ServiceSpec:
    """How to start one kind of process; `module` must exist for it to be started."""

    name: str
    module: str
    argv: tuple[str, ...]  # after `python -m`
    http: bool = True  # has /readyz
    env_url: str | None = None  # the STAR_* variable through which others find it


def _uvicorn(factory: str) -> tuple[str, ...]:
    return (
        "uvicorn",
        "--factory",
        factory,
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--log-level",
        "warning",
        "--no-access-log",
    )


# Start order matters: each service may need the ones above it.
SERVICES: tuple[ServiceSpec, ...] = (
    # as Compose and Helm start it: `star sandbox serve` reads a config file given to --config
    ServiceSpec(
        "sandbox",
        "services.sandbox.app",
        ("services.cli", "sandbox", "serve", "--host", "127.0.0.1", "--port", "{port}"),
        env_url="STAR_SANDBOX_URL",
    ),
    ServiceSpec(
        "formatter",
        "services.formatter.app",
        _uvicorn("services.formatter.app:create_app"),
        env_url="STAR_FORMATTER_URL",
    ),
    ServiceSpec("reward", "services.reward.app", _uvicorn("services.reward.app:create_app"), env_url="STAR_REWARD_URL"),
    ServiceSpec("reward-worker", "services.reward.worker", ("services.cli", "reward", "worker"), http=False),
    ServiceSpec(
        "episodes", "services.episodes.app", _uvicorn("services.episodes.app:create_app"), env_url="STAR_EPISODES_URL"
    ),
    ServiceSpec(
        "rollout", "services.rollout.app", _uvicorn("services.rollout.app:create_app"), env_url="STAR_ROLLOUT_URLS"
    ),
    ServiceSpec(
        "learner", "services.learner.app", _uvicorn("services.learner.app:create_app"), env_url="STAR_LEARNER_URL"
    ),
)


ROLLOUT_WORKER = ServiceSpec("rollout-worker", "services.rollout.worker", ("services.rollout.worker",), http=False)


def spec(name: str) -> ServiceSpec:
    """The service `name` of SERVICES."""
    return next(s for s in SERVICES if s.name == name)


def local_http(port: int | None) -> str:
    return f"http://127.0.0.1:{port}"


@dataclass
class Process:
    name: str
    pid: int
    port: int | None
    log: str
    password: str | None = None  # Redis's, kept out of fleet.json (it is in the data folder)

    @property
    def url(self) -> str | None:
        return local_http(self.port) if self.port else None


def service_argv(spec: ServiceSpec, port: int | None) -> list[str]:
    return [sys.executable, "-m", *(a.replace("{port}", str(port)) for a in spec.argv)]


def available(spec: ServiceSpec) -> bool:
    return find_spec(spec.module) is not None


def start_redis(sup: Supervisor, data: Path, logs: Path) -> str:
    """Redis under `sup` with AOF on in `data` and the password kept there (a restart on its port resumes
    the streams), its port in the supervisor's record; returns its URL once it answers."""
    data.mkdir(parents=True, exist_ok=True)
    password = redis_password(data)
    port = free_port()
    url = local_url(port, password)
    sup.info["redis_port"] = port
    child = sup.add("redis", redis_argv(data, port, password, appendonly=True), log=logs / "redis.log", stop_timeout=10)
    wait_for_redis(url, child.proc, 10, f"; see {child.log}")
    return url


def start_service(
    sup: Supervisor,
    service: ServiceSpec,
    env: dict[str, str],
    logs: Path,
    *,
    name: str | None = None,
    args: tuple[str, ...] = (),
    stop_timeout: float | None = None,
) -> tuple[Child, int | None]:
    """`service` under `sup` as `name` (default: its own), its output in logs/<name>.log, on a free port when
    it serves HTTP, and then waited for until it is ready; returns the child and its port."""
    name = name or service.name
    port = free_port() if service.http else None
    timeout = {} if stop_timeout is None else {"stop_timeout": stop_timeout}
    child = sup.add(name, [*service_argv(service, port), *args], env, logs / f"{name}.log", **timeout)
    if service.http:
        wait_ready(name, child.proc, local_http(port), child.log, READY_S)
    return child, port


def start_redis_at(data: Path, log_dir: Path, port: int | None = None, group: int | None = 0) -> Process:
    """A real Redis with AOF on in `data` and the password kept there, so a restart resumes the
    streams and its clients' URL still holds (pass the old `port` to restart it where they point)."""
    data.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    password = redis_password(data)
    log = log_dir / "redis.log"
    proc = spawn(
        redis_argv(data, port, password, appendonly=True),
        env=dict(os.environ),
        log_path=log,
        group=group,
        die_with_parent=False,
    )
    wait_for_redis(local_url(port, password), proc, 10, f"; see {log}")
    return Process("redis", proc.pid, port, str(log), password=password)


class ServiceProcess:
    """One service's app alone as a child process, started with uvicorn and stopped on exit."""

    def __init__(self, name: str, factory: str, env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.factory = factory
        self.port = free_port()
        self.env = {**os.environ, **env}
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return local_http(self.port)

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        app = ServiceSpec(self.name, self.factory.split(":")[0], _uvicorn(self.factory))
        self.proc = spawn(service_argv(app, self.port), env=self.env, log_path=self.log_path)
        try:
            wait_ready(self.name, self.proc, self.url, self.log_path, timeout)
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_process(self.proc, 10)


def ensure_world(url: str) -> None:
    """Build the default world once: the real tables when present, else a synthetic one."""
    from services.sandbox.world import World

    problem = World(url).problem()
    if problem is None:
        return
    from services.sandbox.world import build

    settings = get_settings()
    database = settings.travelplanner_dir / "database"
    console.print(f"{problem}\nbuilding the travel world → {redact(url)}")
    if (database / "background").is_dir():
        ref = settings.travelplanner_dir / "train" / "train_ref_info.jsonl"
        meta = build.build_official_world(url, database, ref_info=[ref] if ref.is_file() else [])
    else:
        console.print(f"(no TravelPlanner data at {settings.travelplanner_dir}: using a synthetic world)")
        meta = build.build_synthetic_world(url, size="small")
    console.print(f"world built in {meta.get('seconds', '?')} s")
