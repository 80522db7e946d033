"""A small HTTP/1.1 load generator: keep-alive connections driven by asyncio streams.

httpx spends more CPU per request than the server under test, which on a 2-core machine would
measure the client. This client only formats bytes and reads Content-Length bodies.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class LoadResult:
    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@contextmanager
def serve_app(
    factory: str,
    port: int,
    env: dict[str, str],
    *,
    workers: int = 1,
    timeout: float = 120.0,
    host: str = "127.0.0.1",
    wrap: Sequence[str] = (),
) -> Iterator[subprocess.Popen]:
    """Run `factory` (e.g. services.reward.app:create_app) under uvicorn on `host`:`port` until the
    block ends; returns (the process) once /readyz answers 200. `wrap`: a command the server runs
    under (e.g. one entering another network namespace)."""
    import httpx

    proc = subprocess.Popen(
        [
            *wrap,
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            factory,
            "--host",
            host,
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        env={**os.environ, **env},
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"http://{host}:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{factory} did not start on {host}:{port}")
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def post_request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    )
    return head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("server closed the connection")
    status = int(status_line.split(b" ", 2)[1])
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        if line[:15].lower() == b"content-length:":
            length = int(line[15:].strip())
    await reader.readexactly(length)
    return status


async def _worker(
    host: str, port: int, requests: Sequence[bytes], offset: int, deadline: float, out: LoadResult
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    i = offset
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            writer.write(requests[i % len(requests)])
            status = await _read_response(reader)
            out.latencies_ms.append((time.perf_counter() - t0) * 1000)
            out.requests += 1
            if status != 200:
                out.errors += 1
            i += 1
    finally:
        writer.close()


async def run_load(host: str, port: int, requests: Sequence[bytes], *, connections: int, seconds: float) -> LoadResult:
    out = LoadResult(0, 0, 0.0, [])
    start = time.perf_counter()
    deadline = start + seconds
    step = max(1, len(requests) // connections)
    await asyncio.gather(*(_worker(host, port, requests, k * step, deadline, out) for k in range(connections)))
    out.seconds = time.perf_counter() - start
    return out
