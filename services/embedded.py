"""Embedded mode: every service as a local process on 127.0.0.1, no Docker.

`ServiceProcess` runs one service's app under uvicorn and waits until it answers (the tests' servers);
`ensure_world` builds the default world once, for `star up` and `star train`. The fleet itself is
services.pipeline.fleet.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console

from services.common.redis import free_port
from services.common.settings import get_settings

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
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", self.factory, "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", "--no-access-log"],
            env=self.env, stdout=log, stderr=log,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} not ready within {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def ensure_world(url: str) -> None:
    """Build the default world once: the real tables when present, else a synthetic one."""
    from services.sandbox.world import World

    problem = World(url).problem()
    if problem is None:
        return
    from services.sandbox.world import build

    settings = get_settings()
    database = settings.travelplanner_dir / "database"
    console.print(f"{problem}\nbuilding the travel world → {url}")
    if (database / "background").is_dir():
        ref = settings.travelplanner_dir / "train" / "train_ref_info.jsonl"
        meta = build.build_official_world(url, database, ref_info=[ref] if ref.is_file() else [])
    else:
        console.print(f"(no TravelPlanner data at {settings.travelplanner_dir}: using a synthetic world)")
        meta = build.build_synthetic_world(url, size="small")
    console.print(f"world built in {meta.get('seconds', '?')} s")
