"""The NCCL transport: weights broadcast from the learner's rank 0 into live vLLM engines.

Sending (`NcclPublisher`): rank 0 forms one NCCL group with every engine of the fleet (through each
rollout server's `POST /weights/group`), and after each step sends the full weights, gathered layer
group by layer group under ZeRO-3, through vLLM's own weight-transfer engine while every server
receives them in place (`POST /weights/broadcast`). Receiving: a server's vLLM engine joins the group
(`join_group`) and takes each broadcast in one update session (`receive_broadcast`).

How the fleet learns the version (`FleetSync`): a version broadcast over NCCL is in every engine
that received it before the publication returns, so the engine's own version is the truth on the
rollout side. In Redis, `{prefix}:weights:latest` keeps one meaning: the newest version that has
files (what a starting or lagging server loads); `{prefix}:weights:version` says the newest version
published by any path, and the controller asks tasks for that one.

Where an external fleet's servers meet the learner: rank 0 announces an address and a fixed port
(`STAR_NCCL_MASTER_ADDR`, `STAR_NCCL_PORT`): the servers, on other hosts or pods, join its TCP
rendezvous there, each engine with all of its tensor-parallel ranks (`weight_ranks`). Without a
configured address, the one this host routes to the first rollout server from is announced (what
that server can reach back, NAT aside). The announced address is kept in Redis
(`{prefix}:weights:nccl_master`) for operators.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from services.weights.buckets import iter_full_parameters, parameter_layout
from services.weights.files import StorePublisher, publish_files
from services.weights.manifest import WeightsError

log = logging.getLogger(__name__)


# ---- the address the learner announces --------------------------------------------------------


def nccl_master_key(prefix: str) -> str:
    return f"{prefix}:weights:nccl_master"


def route_address(url: str) -> str:
    """This host's address on the route to `url`'s host (a UDP socket's connect sends nothing)."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    if not host:
        raise ValueError(f"{url!r} names no host")
    family, _, _, _, addr = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr[:2])
        return s.getsockname()[0]


def announced_master(configured: str | None, port: int, servers: list[str]) -> tuple[str, int]:
    """(address, port) rank 0 announces: `configured` (host[:port]) when set, else the route address
    to the first server; a loopback address is refused when a server is on another host."""
    if configured:
        host, sep, given = configured.strip().rpartition(":")
        if sep and given.isdigit() and "]" not in given:
            return host.strip("[]"), int(given)
        return configured.strip().strip("[]"), port
    if not servers:
        raise ValueError("the learner announces an NCCL address to its rollout servers, and none are configured")
    address = route_address(servers[0])
    remote = any(not _loopback(urlsplit(u).hostname or "") for u in servers)
    if _loopback(address) and remote:
        raise ValueError(
            f"the route to {servers[0]} leaves through loopback ({address}); set STAR_NCCL_MASTER_ADDR "
            "to an address the rollout servers reach this learner at"
        )
    return address, port


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_master(spec: str, servers: list[str], settings: Any) -> tuple[str, int]:
    """RLConfig.nccl_master as (address, port): host:port as given, or `auto` (an external fleet):
    the announced address and port of `settings` (STAR_NCCL_MASTER_ADDR, STAR_NCCL_PORT)."""
    if spec.strip() == "auto":
        return announced_master(settings.nccl_master_addr, settings.nccl_port, servers)
    host, _, port = spec.rpartition(":")
    return host.strip("[]"), int(port)


# ---- the sending side: the learner -------------------------------------------------------------

STUCK_EXIT = 75


def end_stuck_learner(message: str) -> None:
    """A collective that will never finish cannot be interrupted from Python (NCCL has no timeout
    and vLLM's communicator no abort): the process ends, so its stage fails with this message
    instead of hanging; rerunning the recipe resumes from the last checkpoint."""
    print(f"weight sync: {message}", file=sys.stderr, flush=True)
    log.error("weight sync: %s", message)
    os._exit(STUCK_EXIT)


class NcclPublisher:
    """The learner's side of weight sync into live vLLM engines, over vLLM's NCCL weight transfer.

    `connect()` forms the group: rank 0 is this process, each member server's engine takes as many
    ranks as its tensor-parallel size. `publish()` asks every member to receive a version and sends
    the tensors meanwhile; it returns once every member has loaded it, and raises `WeightsError`
    naming the servers that did not (they then refuse to sample until a version loads). After each
    call `missed` lists the servers without the version, which the caller sends it as files.

    A broadcast into a group that lost a rank would never end, so before each one the servers are
    asked for their state (GET /weights) and the group is formed again, of the servers that answer,
    whenever that set differs from its members or a member no longer reports the group's id (it
    restarted, or left it after a failed broadcast). A failed broadcast drops the group: the next
    publication forms a new one, every answering server joining it again. A member that dies while
    the group forms or a broadcast runs would still leave rank 0 waiting forever: each of those
    calls has `timeout_s`, after which `on_stuck` is called (by default it ends the process:
    `end_stuck_learner`); a broadcast whose member's receive request has already failed (its server died:
    the connection broke) cannot end either, so `on_stuck` is called then, after `member_grace_s`, rather
    than at the deadline. `forming` wraps the making of rank 0's communicator (the learner keeps its own
    NCCL protocol out of it: every member must pick the same one)."""

    def __init__(
        self,
        servers: Iterable[str],
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 29731,
        api_token: str | None = None,
        timeout_s: float = 120.0,
        member_grace_s: float = 5.0,
        on_stuck: Callable[[str], None] = end_stuck_learner,
        forming: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.servers = [s.rstrip("/") for s in servers]
        if not self.servers:
            raise ValueError("NCCL weight sync needs at least one rollout server")
        self.master_address = master_address
        self.master_port = master_port
        self.headers = {"authorization": f"Bearer {api_token}"} if api_token else {}
        self.timeout_s = timeout_s
        self.member_grace_s = member_grace_s
        self.on_stuck = on_stuck
        self.forming = forming
        self.group: Any = None
        self.group_id: str | None = None
        self.group_port = master_port  # the port of the group formed last
        self.formed = 0  # groups formed so far
        self.members: list[str] = []
        self.missed: list[str] = []
        self.pool = ThreadPoolExecutor(max_workers=min(32, 2 * len(self.servers)))

    def _post(self, url: str, path: str, body: Any) -> Any:
        import httpx

        r = httpx.post(f"{url}{path}", json=body, headers=self.headers, timeout=self.timeout_s)
        if r.status_code >= 300:
            raise WeightsError(f"{url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def _info(self, url: str) -> dict[str, Any] | None:
        """A server's GET /weights, or None when it does not answer (down, restarting)."""
        import httpx

        try:
            r = httpx.get(f"{url}/weights", headers=self.headers, timeout=min(self.timeout_s, 10.0))
            return r.json() if r.status_code < 300 else None
        except (httpx.HTTPError, ValueError):
            return None

    def survey(self) -> dict[str, dict[str, Any] | None]:
        """Every server's weights state (None: no answer), asked at once."""
        return dict(zip(self.servers, self.pool.map(self._info, self.servers)))

    def drop(self) -> None:
        """Forget the group (its communicator goes with the last reference): the next publication
        forms a new one."""
        self.group, self.group_id, self.members = None, None, []

    @contextlib.contextmanager
    def _deadline(self, what: str, receives: dict[str, Future] | None = None) -> Iterator[None]:
        """Calls `on_stuck` if the block has not finished within `timeout_s`, or `member_grace_s` after one
        of `receives` (each member's request to receive) failed while the block still runs."""
        done = threading.Event()

        def failed_member() -> str | None:
            for url, f in (receives or {}).items():
                exc = f.exception() if f.done() else None
                if exc is not None:
                    return f"{url}: {type(exc).__name__}: {str(exc)[:200]}"
            return None

        def watch() -> None:
            end = time.monotonic() + self.timeout_s
            while not done.wait(min(0.5, max(0.0, end - time.monotonic()))):
                if time.monotonic() >= end:
                    self.on_stuck(
                        f"{what} did not finish within {self.timeout_s:g} s (a member of the weight "
                        f"group died or stopped answering: {', '.join(self.members) or 'none formed yet'})"
                    )
                    return
                gone = failed_member()
                if gone is not None:
                    if not done.wait(self.member_grace_s):
                        self.on_stuck(f"{what} cannot end: a member's receive failed while it ran ({gone})")
                    return

        threading.Thread(target=watch, name="nccl-deadline", daemon=True).start()
        try:
            yield
        finally:
            done.set()

    def _trainer_init(self, port: int, world_size: int) -> Any:
        """vLLM's side of forming the group: rank 0's communicator (blocks until every rank joins)."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        with self.forming():  # the engines' workers pick NCCL's own protocol; so must rank 0
            return NCCLWeightTransferEngine.trainer_init(
                dict(master_address=self.master_address, master_port=port, world_size=world_size)
            )

    def _next_port(self) -> int:
        """The configured port for the first group; on a loopback master a free port for each later one,
        as a dropped group's listening socket may stay bound until its communicator is collected."""
        if self.formed == 0 or self.master_address not in ("127.0.0.1", "localhost", "::1"):
            return self.master_port
        from services.common.redis import free_port

        return free_port()

    def _trainer_send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's side of a broadcast: the tensors, packed, from rank 0 to the group."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), {"group": self.group, "packed": True})
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def connect(self, servers: Iterable[str] | None = None) -> dict[str, float]:
        """Form the group with `servers` (default: all), each joining under a new group id."""
        members = [s.rstrip("/") for s in servers] if servers is not None else list(self.servers)
        self.drop()
        t0 = time.perf_counter()
        ranks = []
        for url in members:
            info = self._info(url) or {}
            if not info.get("weight_ranks"):
                raise WeightsError(f"{url} cannot join an NCCL weight group (its engine needs weight_transfer: nccl)")
            ranks.append(int(info["weight_ranks"]))
        world = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        group_id, port = uuid.uuid4().hex, self._next_port()
        self.formed += 1
        joins = [
            self.pool.submit(
                self._post,
                url,
                "/weights/group",
                {
                    "master_address": self.master_address,
                    "master_port": port,
                    "rank_offset": off,
                    "world_size": world,
                    "group_id": group_id,
                },
            )
            for url, off in zip(members, offsets)
        ]
        with self._deadline(f"forming the NCCL weight group of {world} ranks"):
            group = self._trainer_init(port, world)
        for f in joins:
            f.result(timeout=self.timeout_s)
        self.group, self.group_id, self.group_port, self.members = group, group_id, port, members
        return {"sync_connect_s": time.perf_counter() - t0, "sync_world_size": float(world)}

    def stale(self, infos: dict[str, dict[str, Any] | None]) -> bool:
        """Whether the group no longer matches the servers that answer (or there is none)."""
        up = [u for u, info in infos.items() if info is not None]
        return (
            self.group is None
            or set(up) != set(self.members)
            or any(infos[u].get("weight_group") != self.group_id or infos[u].get("broken") for u in up)
        )

    def publish(
        self, version: int, layout: dict[str, list], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> dict[str, float]:
        """Send `tensors` (in `layout`'s order) as `version` to every member of the group, formed
        again first when it is stale. `tensors` may be left unconsumed when nothing is sent."""
        infos = self.survey()
        ahead = {u: i.get("version") for u, i in infos.items() if i is not None and int(i.get("version", 0)) > version}
        if ahead:
            # a learner resumed from a checkpoint older than what it published: those servers keep their
            # newer version (a number is never given other weights) and the others get this one
            log.warning("servers ahead of this version are left out of it", extra={"version": version, "ahead": ahead})
            infos = {u: i for u, i in infos.items() if u not in ahead}
        self.missed = [u for u in self.servers if u not in ahead]
        metrics: dict[str, float] = {}
        if not self.missed:
            return metrics  # every server is ahead: nothing to send
        if self.stale(infos):
            up = [u for u, info in infos.items() if info is not None]
            if not up:
                self.drop()
                raise WeightsError("no rollout server answers GET /weights")
            try:
                metrics.update(self.connect(up))
            except Exception as exc:  # noqa: BLE001 - no group: the caller falls back to the store
                self.drop()
                raise WeightsError(f"could not form the NCCL weight group: {type(exc).__name__}: {exc}") from exc
        metrics.update(self._send(version, layout, tensors, ahead))
        self.missed = [u for u in self.servers if u not in self.members and u not in ahead]
        return metrics

    def _send(
        self, version: int, layout: dict[str, list], tensors: Iterable[tuple[str, torch.Tensor]], ahead: dict[str, Any]
    ) -> dict[str, float]:
        """One broadcast to the members; on any failure the group is dropped and the members that did
        not load the version are named."""
        t0 = time.perf_counter()
        body = {"version": version, **layout}
        receives = {url: self.pool.submit(self._post, url, "/weights/broadcast", body) for url in self.members}
        failed: dict[str, str] = {}
        try:
            with self._deadline(f"the NCCL broadcast of version {version}", receives):
                self._trainer_send(tensors)
        except Exception as exc:  # noqa: BLE001 - the members' receives fail too, and are named below
            failed["learner"] = f"send failed: {type(exc).__name__}: {exc}"
        sent = time.perf_counter() - t0
        for url, f in receives.items():
            try:
                reply = f.result(timeout=self.timeout_s)
                if int(reply.get("version", -1)) != version:
                    failed[url] = f"reports version {reply.get('version')}"
            except Exception as exc:  # noqa: BLE001 - collected, then raised together
                failed[url] = f"{type(exc).__name__}: {exc}"
        if failed:
            loaded = [u for u in self.members if u not in failed and "learner" not in failed]
            self.missed = [u for u in self.servers if u not in loaded and u not in ahead]
            self.drop()
            raise WeightsError(f"version {version} did not load on {len(self.missed)} server(s): {failed}")
        return {"sync_send_s": sent, "sync_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class FleetSync:
    """Weights over NCCL every step, through the store when NCCL cannot serve: every `files_every`-th
    version (what a restarted server or a new host loads), the run's last (`write_files`), and any
    version a server missed, posted to that server at once. Every rank calls `publish` and
    `write_files` (the ZeRO-3 gathers are collective); rank 0 sends, writes, and records each
    version in Redis (`StorePublisher.record_version`) once every server has it or was sent files."""

    def __init__(self, store: StorePublisher | None, nccl: NcclPublisher | None, *, files_every: int = 10) -> None:
        self.store = store
        self.nccl = nccl
        self.files_every = files_every
        self.files_version = -1  # the newest version this process wrote to the store (the same on every rank)

    def publish(
        self, version: int, model: torch.nn.Module, *, zero3: bool, buckets: Any, config: Any, source_dir: Path | None
    ) -> dict[str, float]:
        """`buckets`: a callable giving the store's buckets (called only when files are written)."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        missed = self._broadcast(version, model, zero3, metrics)
        if _every_rank_agrees(bool(missed) or version % self.files_every == 0):
            metrics.update(self._write(version, buckets, config, source_dir, missed))
        if self.store is not None:
            self.store.record_version(version)
        metrics["time_sync_s"] = time.perf_counter() - t0
        return metrics

    def write_files(self, version: int, *, buckets: Any, config: Any, source_dir: Path | None) -> dict[str, float]:
        """Write `version` to the store unless this process already has: the version a run ends on
        must have files (the stage's result, the eval stage's model), broadcast or not."""
        if version <= self.files_version:
            return {}
        metrics = self._write(version, buckets, config, source_dir, [])
        if self.store is not None:
            self.store.record_version(version)
        return metrics

    def _broadcast(self, version: int, model: torch.nn.Module, zero3: bool, metrics: dict[str, float]) -> list[str]:
        """Rank 0 sends `version` over NCCL; the servers that did not get it (on rank 0). Every rank
        walks the whole parameter list, rank 0 too after a failed send: the gathers are collective."""
        tensors = iter_full_parameters(model, zero3=zero3)
        if self.nccl is None:
            for _ in tensors:  # the other ranks' share of rank 0's gathers
                pass
            return []
        try:
            metrics.update(self.nccl.publish(version, parameter_layout(model), tensors))
        except WeightsError as exc:
            log.error(
                "NCCL weight sync failed; those servers get the version from the store",
                extra={"version": version, "error": str(exc)},
            )
            metrics["sync_nccl_failed"] = 1.0
        finally:
            for _ in tensors:  # what a send that stopped early left of the gathers
                pass
        metrics["sync_nccl_missed"] = float(len(self.nccl.missed))
        return list(self.nccl.missed)

    def _write(
        self, version: int, buckets: Any, config: Any, source_dir: Path | None, missed: list[str]
    ) -> dict[str, float]:
        """The store's copy of `version`, posted to the `missed` servers (every rank gathers)."""
        self.files_version = version
        return publish_files(self.store, version, buckets, config=config, source_dir=source_dir, servers=missed)


def _every_rank_agrees(flag: bool) -> bool:
    """True on every rank when it is true on any (rank 0 alone learns that a broadcast failed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ---- the receiving side: a rollout server's engine -----------------------------------------------


def weight_ranks(engine: Any) -> int:
    """The NCCL ranks `engine` takes in the learner's weight group: its tensor-parallel size when it was
    started with `weight_transfer: nccl`, else 0 (it cannot join one)."""
    args = getattr(engine, "args", None)
    if args is None or getattr(args, "weight_transfer", "files") != "nccl":
        return 0
    return args.tensor_parallel_size


async def join_group(llm: Any, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
    """A vLLM engine (`llm`: its AsyncLLM) joins the learner's NCCL group for weight updates, its
    workers taking the ranks from `rank_offset`. Blocks until every member has joined."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    await llm.init_weight_transfer_engine(
        WeightTransferInitRequest(
            init_info=dict(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
            )
        )
    )


async def receive_broadcast(
    llm: Any, names: list[str], dtype_names: list[str], shapes: list[list[int]], *, packed: bool = True
) -> None:
    """One version's tensors from the learner's broadcast into a vLLM engine's parameters, in place, in
    one update session (the caller holds the engine's scheduler paused)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    info = {"names": names, "dtype_names": dtype_names, "shapes": shapes, "packed": packed}
    await llm.start_weight_update()
    try:
        await llm.update_weights(WeightTransferUpdateRequest(update_info=info))
    except asyncio.CancelledError:
        raise  # no clean-up call: the core may be blocked in the receive
    except BaseException:
        # close the update session: left open, every later broadcast's start would be refused
        with contextlib.suppress(Exception):
            await llm.finish_weight_update()
        raise
    await llm.finish_weight_update()
