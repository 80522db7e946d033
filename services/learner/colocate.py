"""The learner's side of colocation: rollout engines on the learner's own GPUs, used in turns.

Placement `colocated` (services/pipeline/placement.py) puts a learner rank and an engine on every GPU.
Each RL step, in this order:

1. `sleep()` (rank 0, before the forward/backward): every colocated rollout server holds new turns,
   finishes those in flight and frees its GPU memory (`POST /sleep`). All must answer within
   `timeout_s`; one that does not (or cannot sleep) makes the learner refuse the step with
   `ColocationError`, naming it, rather than train into memory an engine still holds. Servers that did
   sleep are woken again first, so rollouts go on.
2. the optimizer steps.
3. `publish()` (every rank): each rank frees its cached activation memory, rank 0 wakes the servers'
   weights (`POST /wake {"tags": ["weights"]}`), then the new version goes to them by CUDA IPC, chunk
   by chunk (services/weights/cuda_ipc.py; each engine opens the handle of its own GPU). The last chunk
   finishes the load, then `POST /wake` brings back the KV cache and the held turns run on the new version.
   Every `files_every`-th version and the last also go to the weights store (what a restarted server
   loads).

Metrics per step: `colocate_sleep_s` (the slowest server's drain and sleep, as the learner waited for
it), `colocate_wake_s` (both wakes), `colocate_weights_s` (the IPC transfer and load).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from services.weights.cuda_ipc import ipc_chunks, send_version
from services.weights.files import StorePublisher, publish_files

log = logging.getLogger(__name__)

CONNECT_RETRY_S = 2.0  # between attempts to reach a server that refuses connections (restarting)


class ColocationError(RuntimeError):
    """A colocated server did not free its GPU for the learner's step (or did not take the weights)."""


class ColocatedServers:
    """Rank 0's HTTP client of the colocated rollout servers."""

    def __init__(
        self,
        servers: Iterable[str],
        *,
        level: int = 1,
        timeout_s: float = 300.0,
        api_token: str | None = None,
        post: Callable[[str, str, Any, float], Any] | None = None,
        get: Callable[[str, str], Any] | None = None,
    ) -> None:
        self.servers = [s.rstrip("/") for s in servers]
        if not self.servers:
            raise ValueError("colocation needs the rollout servers' addresses")
        self.level = level
        self.timeout_s = timeout_s
        self.headers = {"authorization": f"Bearer {api_token}"} if api_token else {}
        self._post = post or self._http_post
        self._get = get or self._http_get
        self.pool = ThreadPoolExecutor(max_workers=min(32, 2 * len(self.servers)))

    def _http_post(self, url: str, path: str, body: Any, timeout_s: float) -> Any:
        import httpx

        r = httpx.post(f"{url}{path}", json=body, headers=self.headers, timeout=timeout_s)
        if r.status_code >= 300:
            raise ColocationError(f"{url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def _all(self, path: str, body: Any, timeout_s: float, post: Callable[..., Any] | None = None) -> dict[str, Any]:
        """`path` on every server at once: url → its reply, or the exception it raised."""
        futures = {url: self.pool.submit(post or self._post, url, path, body, timeout_s) for url in self.servers}
        out: dict[str, Any] = {}
        for url, f in futures.items():
            try:
                out[url] = f.result(timeout=timeout_s + 5)
            except Exception as exc:  # noqa: BLE001 - collected and named together
                out[url] = exc
        return out

    def sleep(self) -> dict[str, float]:
        """Every server asleep, or ColocationError (those that slept are woken again)."""
        t0 = time.perf_counter()
        # the server drains within timeout_s; the request itself gets a little longer to answer
        replies = self._all(
            "/sleep", {"level": self.level, "timeout_s": self.timeout_s}, self.timeout_s + 30, post=self._post_when_up
        )
        failed = {u: r for u, r in replies.items() if isinstance(r, Exception)}
        if failed:
            slept = [u for u, r in replies.items() if not isinstance(r, Exception)]
            for url in slept:
                try:
                    self._post(url, "/wake", {"tags": None}, 120.0)
                except Exception as exc:  # noqa: BLE001 - reported with the refusal
                    failed[url] = ColocationError(f"slept, then did not wake: {exc}")
            raise ColocationError(
                f"refusing to train: {len(failed)} of {len(self.servers)} colocated rollout server(s) did not free "
                f"their GPU within {self.timeout_s:g} s (placement.sleep_timeout_s): "
                + "; ".join(f"{u}: {e}" for u, e in failed.items())
            )
        drain = max(float(r.get("drain_s", 0.0)) for r in replies.values())
        return {"colocate_sleep_s": time.perf_counter() - t0, "colocate_drain_s": drain}

    def _post_when_up(self, url: str, path: str, body: Any, timeout_s: float) -> Any:
        """`_post`, retried while the server refuses connections: one its supervisor is restarting (after
        a crash) listens again once its engine is up. Retried for the servers' `timeout_s`
        (placement.sleep_timeout_s); each attempt may take the call's own `timeout_s`."""
        import httpx

        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._post(url, path, body, timeout_s)
            except (httpx.ConnectError, ConnectionRefusedError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(CONNECT_RETRY_S)

    def recover(self) -> list[str]:
        """Wake servers a previous learner left asleep (it died mid-step); returns their addresses. One
        that cannot wake whole (its level-2 weights are gone) ends and is restarted by its supervisor."""
        asleep = []
        for url in self.servers:
            try:
                info = self._get(url, "/weights")
            except Exception:  # noqa: BLE001 - not up yet: nothing to wake
                continue
            if (info.get("sleep") or {}).get("asleep"):
                asleep.append(url)
                try:
                    self._post(url, "/wake", {"tags": None}, 300.0)
                except Exception as exc:  # noqa: BLE001 - it restarts with the newest files
                    log.warning("a colocated server left asleep could not wake", extra={"url": url, "error": str(exc)})
        return asleep

    def _http_get(self, url: str, path: str) -> Any:
        import httpx

        r = httpx.get(f"{url}{path}", headers=self.headers, timeout=10.0)
        r.raise_for_status()
        return r.json()

    def wake(self, tags: list[str] | None) -> None:
        replies = self._all("/wake", {"tags": tags}, 300.0)
        failed = {u: r for u, r in replies.items() if isinstance(r, Exception)}
        if failed:
            raise ColocationError(f"could not wake {', '.join(failed)}: " + "; ".join(map(str, failed.values())))

    def load_chunk(self, body: dict[str, Any]) -> None:
        replies = self._all("/weights/ipc", body, 600.0)
        failed = {u: r for u, r in replies.items() if isinstance(r, Exception)}
        if failed:
            raise ColocationError(
                f"version {body['version']} did not load on {', '.join(failed)}: "
                + "; ".join(map(str, failed.values()))
            )

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class ColocatedSync:
    """Weight publication for colocated engines (the trainer's `fleet_sync` when `weight_sync` is
    ipc): sleep before the step, wake with the new version by CUDA IPC after it, files every
    `files_every`-th version. Every rank calls `publish` and `write_files`; `servers` only on rank 0."""

    def __init__(
        self,
        store: StorePublisher | None,
        servers: ColocatedServers | None,
        *,
        files_every: int = 10,
        chunks: Callable[[Iterator[tuple[str, torch.Tensor]], int], Iterator[dict[str, Any]]] = ipc_chunks,
    ) -> None:
        self.store = store
        self.servers = servers
        self.files_every = files_every
        self.files_version = -1
        self.asleep = False
        self._chunks = chunks
        if servers is not None and (left := servers.recover()):
            log.warning("woke colocated servers a previous learner left asleep", extra={"servers": left})

    def sleep(self) -> dict[str, float]:
        """Rank 0 puts every server to sleep; the outcome reaches every rank (all refuse together)."""
        metrics: dict[str, float] = {}
        error = None
        if self.servers is not None:
            try:
                metrics = self.servers.sleep()
            except ColocationError as exc:
                error = str(exc)
        error = _from_rank0(error)
        if error is not None:
            raise ColocationError(error)
        self.asleep = True
        return metrics

    def wake(
        self, version: int | None, model: torch.nn.Module | None = None, *, zero3: bool = False
    ) -> dict[str, float]:
        """Wake the servers; with `version`, loading it from `model` by CUDA IPC between the weights and
        the KV cache (without, only after a level-1 sleep: level 2 discarded the weights). Every rank
        calls it (the gathers and the handle gathers are collective)."""
        if not self.asleep:
            return {}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the step's activations back to the driver: the engines need it
        t0 = time.perf_counter()
        if version is None or model is None:
            if self.servers is not None:
                self.servers.wake(None)
            self.asleep = False
            return {"colocate_wake_s": time.perf_counter() - t0}
        if self.servers is not None:
            self.servers.wake(["weights"])
        woke = time.perf_counter() - t0
        t1 = time.perf_counter()
        load_chunk = self.servers.load_chunk if self.servers is not None else None
        send_version(version, model, zero3=zero3, load_chunk=load_chunk, chunks=self._chunks)
        weights = time.perf_counter() - t1
        t2 = time.perf_counter()
        if self.servers is not None:
            self.servers.wake(None)
        self.asleep = False
        return {"colocate_wake_s": woke + time.perf_counter() - t2, "colocate_weights_s": weights}

    def publish(
        self, version: int, model: torch.nn.Module, *, zero3: bool, buckets: Any, config: Any, source_dir: Path | None
    ) -> dict[str, float]:
        """The new version into the engines (waking them), and to the store when due."""
        t0 = time.perf_counter()
        metrics = self.wake(version, model, zero3=zero3)
        if version % self.files_every == 0:
            metrics.update(self.write_files(version, buckets=buckets, config=config, source_dir=source_dir))
        if self.store is not None:  # the controller asks the next tasks for this version
            self.store.record_version(version)
        metrics["time_sync_s"] = time.perf_counter() - t0
        return metrics

    def write_files(self, version: int, *, buckets: Any, config: Any, source_dir: Path | None) -> dict[str, float]:
        if version <= self.files_version:
            return {}
        self.files_version = version
        # posted to no server: the engines have it already, by IPC
        return publish_files(self.store, version, buckets, config=config, source_dir=source_dir, servers=[])


def _from_rank0(value: Any) -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
