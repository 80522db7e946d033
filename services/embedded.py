"""Embedded mode: every service as a local process on 127.0.0.1, no Docker.

`ServiceProcess` runs one service's app under uvicorn and waits until it answers (the tests' servers);
`ensure_world` builds the default world once, for `star up` and `star train`. The fleet itself is
services.pipeline.fleet.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from services.common.redis import free_port, redact
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

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        self.proc = spawn(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                self.factory,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            env=self.env,
            log_path=self.log_path,
        )
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
