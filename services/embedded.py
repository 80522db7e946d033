"""Embedded mode: every service as a local process on 127.0.0.1, no Docker.

`star demo` is the README's main job. Today it builds the world, starts an embedded Redis and
the sandbox service, and plans the first leg of a trip through real HTTP tool calls; it grows
into the whole pipeline as the other services land.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console

from services.common.redis import EmbeddedRedis, free_port, redact
from services.common.settings import get_settings
from services.common.supervisor import spawn, stop_process, wait_ready

console = Console()


class ServiceProcess:
    """One service as a child process, started with uvicorn and stopped on exit."""

    def __init__(self, name: str, factory: str, env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.factory = factory
        self.port = free_port()
        self.env = {**os.environ, **env}
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServiceProcess":
        self.proc = spawn([sys.executable, "-m", "uvicorn", "--factory", self.factory, "--host", "127.0.0.1",
                           "--port", str(self.port), "--log-level", "warning", "--no-access-log"],
                          env=self.env, log_path=self.log_path)
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


def demo(keep: bool = typer.Option(False, help="Keep the services running until Ctrl-C.")) -> None:
    """Build the world, start Redis and the sandbox, and call tools over HTTP."""
    settings = get_settings()
    url = settings.world_url
    ensure_world(url)
    log_dir = settings.home / "logs"
    with EmbeddedRedis(data_dir=settings.home / "redis") as redis_server:
        env = {"STAR_DB_URL": url, "STAR_REDIS_URL": redis_server.url}
        sandbox = ServiceProcess("sandbox", "services.sandbox.app:create_app", env, log_dir).start()
        try:
            console.print(f"redis   {redact(redis_server.url)}\nsandbox {sandbox.url}  (docs: {sandbox.url}/docs)")
            _plan_a_leg(sandbox.url)
            if keep:
                console.print("serving; Ctrl-C to stop")
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            sandbox.stop()


def _plan_a_leg(base: str) -> None:
    """A few calls an agent would make at the start of a trip."""
    with httpx.Client(base_url=base, timeout=30) as client:
        world = client.get("/world").json()
        city, state = _some_city(client)
        calls = [
            ("SearchCity", {"state": state}),
            ("SearchAccommodation", {"city": city}),
            ("SearchRestaurant", {"city": city}),
        ]
        if city == "Rockford":  # the first leg of the first official train query's gold plan
            calls.insert(0, ("SearchFlight", {"departure": "St. Petersburg", "destination": "Rockford",
                                              "date": "2022-03-16"}))
        for name, args in calls:
            resp = client.post("/tools/call", json={"name": name, "arguments": args})
            resp.raise_for_status()
            text = resp.json()["text"]
            lines = text.split("\n")
            shown = "\n".join(lines[:7]) + (f"\n… ({len(lines) - 7} more lines)" if len(lines) > 7 else "")
            console.rule(f"{name} {args}")
            console.print(shown, markup=False, highlight=False)
        console.rule()
        console.print(f"world: {world['meta'].get('kind')} · " + ", ".join(f"{k} {v:,}" for k, v in world["counts"].items()))


def _some_city(client: httpx.Client) -> tuple[str, str]:
    """Rockford, Illinois in the real world; the first city of the first state otherwise."""
    probe = client.post("/tools/call", json={"name": "SearchCity", "arguments": {"state": "Illinois"}}).json()
    if probe["ok"] and "Rockford" in probe["text"]:
        return "Rockford", "Illinois"
    from services.sandbox.world import World

    first = World(get_settings().world_url).cities()[0]
    return first.city, first.state
