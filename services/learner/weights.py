"""Weight publication: after each optimizer step the fleet gets the new policy.

Portable path (`StorePublisher`): full weights, gathered bucket by bucket, become an HF model
folder `STAR_HOME/weights/v{version}` (safetensors shards, config, tokenizer) plus
`manifest.json` (version, sha256 and size per file). The folder is written under a temporary
name and renamed, so a reader never sees half a version. Then the latest version goes to Redis
(`{prefix}:weights:latest`, a WeightsUpdate) and to every rollout server (`POST /weights`), and
versions older than the last K are deleted.

Fast path into vLLM (`NcclPublisher`): the learner's rank 0 forms one NCCL group with every
engine of the fleet (through each rollout server's `POST /weights/group`), and after each step
sends the full weights, gathered layer group by layer group under ZeRO-3, through vLLM's own
weight-transfer engine while every server receives them in place (`POST /weights/broadcast`).

How the fleet learns the version (`FleetSync`): a version broadcast over NCCL is in every engine
that received it before the publication returns, so the engine's own version is the truth on the
rollout side. In Redis, `{prefix}:weights:latest` keeps one meaning: the newest version that has
files (what a starting or lagging server loads); `{prefix}:weights:version` says the newest version
published by any path, and the controller asks tasks for that one.

Version numbers only grow and each names one set of weights: `{prefix}:weights:highest` is the highest
number ever published in the run (never lowered, while a restarted learner may lower
`weights:version` to its checkpoint's); a learner numbers every new version above it, the store's
folders and the engines' own versions (services/learner/trainer.py, `RLTrainer._number_past_the_fleet`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.files import sha256_file
from services.common.schemas import WeightsUpdate

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
WEIGHT_FILES = (".safetensors", ".bin", ".pt")
INDEX = "model.safetensors.index.json"


class WeightsError(RuntimeError):
    """A version folder is missing, incomplete or does not match its manifest."""


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version}"


@dataclass
class PublishResult:
    update: WeightsUpdate | None
    gather_s: float = 0.0
    write_s: float = 0.0
    notify_s: float = 0.0
    bytes: int = 0
    servers: dict[str, str] = field(default_factory=dict)  # url → "ok" or the error

    def metrics(self) -> dict[str, float]:
        ok = sum(v == "ok" for v in self.servers.values())
        return {
            "sync_gather_s": self.gather_s,
            "sync_write_s": self.write_s,
            "sync_fleet_load_s": self.notify_s,
            "sync_bytes": float(self.bytes),
            "sync_servers_ok": float(ok),
            "sync_servers_failed": float(len(self.servers) - ok),
        }


# ---- writing a version --------------------------------------------------------------------------

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ALIGN = 64  # every tensor starts on a 64-byte boundary inside a shard's data


@dataclass
class FlatBucket:
    """Several tensors laid out in one byte buffer: one device→host copy, one write, one broadcast."""

    entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]  # name, dtype, shape, start, end
    data: torch.Tensor  # uint8, 1-D

    @property
    def nbytes(self) -> int:
        return self.entries[-1][4] if self.entries else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.data[a:b].view(dtype).view(shape) for name, dtype, shape, a, b in self.entries}


def layout(named: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> tuple[list, int]:
    """Byte offsets for (name, dtype, shape, numel) entries, each aligned; returns (entries, total bytes)."""
    entries, pos = [], 0
    for name, dtype, shape, numel in named:
        pos = (pos + _ALIGN - 1) // _ALIGN * _ALIGN
        size = numel * dtype.itemsize
        entries.append((name, dtype, tuple(shape), pos, pos + size))
        pos += size
    return entries, pos


def flatten(
    named: list[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
) -> FlatBucket:
    """Copy tensors (any device) into one uint8 buffer `out` (e.g. pinned host memory) or a new one
    on the tensors' device."""
    entries, total = layout([(n, dtype or t.dtype, tuple(t.shape), t.numel()) for n, t in named])
    device = named[0][1].device if named else torch.device("cpu")
    staging = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), (_, dt, _, a, b) in zip(named, entries):
        staging[a:b].copy_(t.detach().to(dt).reshape(-1).view(torch.uint8))
    if out is None:
        return FlatBucket(entries, staging)
    target = out[:total]
    target.copy_(staging, non_blocking=staging.is_cuda and target.is_pinned())
    if staging.is_cuda:
        torch.cuda.current_stream(staging.device).synchronize()
    return FlatBucket(entries, target)


def write_safetensors(path: Path, bucket: FlatBucket) -> tuple[str, int]:
    """Write one shard in the safetensors format straight from the bucket's buffer (no
    serialization copy), hashing as it goes; hashing and file I/O release the GIL."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for name, dtype, shape, a, b in bucket.entries:
        if dtype not in _ST_DTYPES:
            raise WeightsError(f"{name}: dtype {dtype} cannot be written to safetensors")
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [a, b]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    head = len(raw).to_bytes(8, "little") + raw
    body = memoryview(bucket.data[: bucket.nbytes].numpy())
    digest = hashlib.sha256(head)
    digest.update(body)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.write(body)
    return digest.hexdigest(), len(head) + len(body)


def copy_model_files(source: Path, target: Path) -> None:
    """Tokenizer and generation files from the starting model (everything but weights and config)."""
    for item in Path(source).iterdir():
        if (
            item.is_file()
            and not item.name.endswith(WEIGHT_FILES)
            and item.name not in ("config.json", INDEX, MANIFEST)
            and not item.name.startswith(".")
        ):
            shutil.copy2(item, target / item.name)


def write_version(
    root: Path,
    version: int,
    buckets: Iterable[FlatBucket],
    *,
    config: Any,
    source_dir: Path | None,
    threads: int = 4,
    fsync: bool = False,
) -> tuple[Path, str, float, float, int]:
    """Write v{version}; returns (folder, manifest sha256, gather seconds, write seconds, bytes).

    Each bucket becomes one shard, written by a thread while the next bucket is gathered."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".v{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    gather_s = 0.0
    t_start = time.perf_counter()
    futures = []
    weight_map: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        it: Iterator[FlatBucket] = iter(buckets)
        k = 0
        while True:
            t0 = time.perf_counter()
            bucket = next(it, None)
            gather_s += time.perf_counter() - t0
            if bucket is None:
                break
            name = f"model-{k:05d}.safetensors"
            weight_map.update({e[0]: name for e in bucket.entries})
            futures.append((name, pool.submit(write_safetensors, tmp / name, bucket)))
            k += 1
        files = {}
        total = 0
        for name, fut in futures:
            digest, size = fut.result()
            files[name] = {"sha256": digest, "bytes": size}
            total += size
    # Consistent names for loaders: one shard is model.safetensors, several get an index.
    if len(files) == 1:
        (only,) = files
        os.replace(tmp / only, tmp / "model.safetensors")
        files = {"model.safetensors": files[only]}
    else:
        count = len(files)
        renames = {old: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i, old in enumerate(files)}
        for old, new in renames.items():
            os.replace(tmp / old, tmp / new)
        files = {renames[k]: v for k, v in files.items()}
        index = {"metadata": {"total_size": total}, "weight_map": {n: renames[f] for n, f in weight_map.items()}}
        (tmp / INDEX).write_text(json.dumps(index, indent=1))
    config.save_pretrained(tmp)
    if source_dir is not None:
        copy_model_files(Path(source_dir), tmp)
    for item in sorted(tmp.iterdir()):
        if item.name not in files:
            files[item.name] = {"sha256": sha256_file(item), "bytes": item.stat().st_size}
    manifest = {"version": version, "created": time.time(), "files": dict(sorted(files.items()))}
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (tmp / MANIFEST).write_bytes(manifest_bytes)
    if fsync:
        for item in tmp.iterdir():
            with open(item, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_s = time.perf_counter() - t_start - gather_s
    return final, hashlib.sha256(manifest_bytes).hexdigest(), gather_s, write_s, total


def verify_version(folder: Path, sha256: str | None = None, *, check_files: bool = True) -> dict[str, Any]:
    """The manifest, after checking it (and, by default, every file) against the recorded hashes."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise WeightsError(f"{folder} has no {MANIFEST}: not a published version")
    raw = path.read_bytes()
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise WeightsError(f"{path} does not match the announced sha256")
    manifest = json.loads(raw)
    if check_files:
        names = list(manifest["files"])
        with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:
            digests = list(pool.map(lambda n: sha256_file(folder / n) if (folder / n).is_file() else None, names))
        for name, digest in zip(names, digests):
            if digest is None:
                raise WeightsError(f"{folder / name} listed in the manifest is missing")
            if digest != manifest["files"][name]["sha256"]:
                raise WeightsError(f"{folder / name} does not match its sha256 in the manifest")
    return manifest


def load_state_dict(folder: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(shard, device=str(device)))
    return out


def load_into(model: torch.nn.Module, folder: Path, *, sha256: str | None = None, verify: bool = True) -> int:
    """What a rollout server does on POST /weights when it holds a live model: read the new
    tensors while their hashes are checked (in parallel), then copy them into the existing
    parameters in place. Nothing is copied unless the version verifies. Returns the tensor count."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        check = pool.submit(verify_version, folder, sha256, check_files=verify)
        device = next(model.parameters()).device
        state = load_state_dict(folder, device)
        check.result()
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in params if n not in state and not _tied(model, n)]
    if missing:
        raise WeightsError(f"{folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, tensor in state.items():
            if name in params:
                params[name].copy_(tensor)
    return len(state)


def _tied(model: torch.nn.Module, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


# ---- the store publisher --------------------------------------------------------------------------


class StorePublisher:
    """Shared-storage weights + Redis version key + POST /weights to each rollout server."""

    def __init__(
        self,
        root: Path,
        *,
        redis_client: Any = None,
        key_prefix: str = "star",
        servers: Iterable[str] = (),
        keep: int = 3,
        api_token: str | None = None,
        timeout_s: float = 300.0,
        threads: int = 4,
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.root = Path(root)
        self.redis = redis_client
        self.key = f"{key_prefix}:weights:latest"
        self.version_key = f"{key_prefix}:weights:version"  # StreamNames.weights_version
        self.highest_key = f"{key_prefix}:weights:highest"  # StreamNames.weights_highest
        self.servers = [s.rstrip("/") for s in servers]
        self.keep = keep
        self.api_token = api_token
        self.timeout_s = timeout_s
        self.threads = threads

    def publish(
        self, version: int, buckets: Iterable[FlatBucket], *, config: Any, source_dir: Path | None = None
    ) -> PublishResult:
        folder, digest, gather_s, write_s, size = write_version(
            self.root, version, buckets, config=config, source_dir=source_dir, threads=self.threads
        )
        update = WeightsUpdate(version=version, uri=str(folder.resolve()), sha256=digest)
        t0 = time.perf_counter()
        if self.redis is not None:
            from services.common.streams import until_redis

            until_redis(lambda: self.redis.set(self.key, update.model_dump_json()), what="announcing weights")
            self.raise_highest(version)
        servers = self.notify(update)
        notify_s = time.perf_counter() - t0
        self.prune(version)
        return PublishResult(update, gather_s, write_s, notify_s, size, servers)

    def notify(self, update: WeightsUpdate) -> dict[str, str]:
        """POST the update to every server at once; each answers when it has loaded the version."""
        if not self.servers:
            return {}
        import httpx

        headers = {"authorization": f"Bearer {self.api_token}"} if self.api_token else {}

        def post(url: str) -> str:
            try:
                r = httpx.post(f"{url}/weights", json=update.model_dump(), headers=headers, timeout=self.timeout_s)
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            return "ok" if r.status_code < 300 else f"HTTP {r.status_code}: {r.text[:300]}"

        with ThreadPoolExecutor(max_workers=min(16, len(self.servers))) as pool:
            results = dict(zip(self.servers, pool.map(post, self.servers)))
        for url, outcome in results.items():
            if outcome != "ok":
                log.warning(
                    "rollout server did not load the weights",
                    extra={"server": url, "error": outcome, "version": update.version},
                )
        return results

    def prune(self, latest: int) -> list[int]:
        """Delete all but the newest `keep` versions (never `latest`)."""
        versions = sorted(self.versions())
        doomed = [v for v in versions[: max(len(versions) - self.keep, 0)] if v != latest]
        for v in doomed:
            shutil.rmtree(version_dir(self.root, v), ignore_errors=True)
        return doomed

    def versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        out = []
        for item in self.root.iterdir():
            if item.is_dir() and item.name.startswith("v") and item.name[1:].isdigit() and (item / MANIFEST).is_file():
                out.append(int(item.name[1:]))
        return sorted(out)

    def latest(self) -> WeightsUpdate | None:
        if self.redis is None:
            return None
        raw = self.redis.get(self.key)
        return WeightsUpdate.model_validate_json(raw) if raw else None

    def recorded_version(self) -> int:
        """The version last recorded in Redis (`weights:version`; 0 when none)."""
        raw = self.redis.get(self.version_key) if self.redis is not None else None
        return int(raw) if raw else 0

    def record_version(self, version: int) -> None:
        """Say in Redis that `version` is the newest one the fleet must have, files or not
        (`weights:version`; a restarted learner may lower it to its own), and raise the run's highest
        published number (`weights:highest`, never lowered) to it."""
        if self.redis is not None:
            from services.common.streams import until_redis

            until_redis(lambda: self.redis.set(self.version_key, version), what="recording the weights version")
            self.raise_highest(version)

    def raise_highest(self, version: int) -> None:
        """`weights:highest` becomes `version` where that is higher (atomically: never lowered)."""
        from services.common.streams import until_redis

        until_redis(
            lambda: self.redis.eval(RAISE_TO, 1, self.highest_key, version), what="recording the highest version"
        )

    def highest_version(self) -> int:
        """The highest number this run has published by any path, as far as the store and Redis say: the
        highest recorded, the one recorded last, the one announced with files, and every version folder
        in the store (-1 when none). A learner numbers every new version above it."""
        found = [-1, *self.versions()]
        if self.redis is not None:
            highest, recorded = self.redis.mget(self.highest_key, self.version_key)
            latest = self.latest()
            found += [int(highest or -1), int(recorded or -1), latest.version if latest else -1]
        return max(found)


# Raise a counter key to ARGV[1] unless it is already at least that (`StorePublisher.raise_highest`).
RAISE_TO = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > current then redis.call('SET', KEYS[1], ARGV[1]) end
return redis.call('GET', KEYS[1])
"""


# ---- weights over NCCL into live vLLM engines ---------------------------------------------------


def parameter_groups(
    named: list[tuple[str, torch.nn.Parameter]], limit_bytes: int, dtype: torch.dtype | None = None
) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive groups of about `limit_bytes` (full sizes, as `dtype` when given): what one ZeRO-3
    gather holds at a time."""
    groups: list[list[tuple[str, torch.nn.Parameter]]] = [[]]
    size = 0
    for name, p in named:
        if size >= limit_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += getattr(p, "ds_numel", p.numel()) * (dtype.itemsize if dtype is not None else p.element_size())
    return [g for g in groups if g]


def sent_parameters(model: torch.nn.Module, skip_tied: bool = True) -> list[tuple[str, torch.nn.Parameter]]:
    """What a weight sync sends, in order: every parameter once, a tied output head left out."""
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=True) if not (skip_tied and _tied(model, n))]


def iter_full_parameters(
    model: torch.nn.Module, *, zero3: bool = False, group_bytes: int = 512 * 2**20, skip_tied: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter, in a fixed order. Under ZeRO-3 the parameters are
    gathered a group of about `group_bytes` at a time: every rank must iterate (the gather is a
    collective). Tied output heads are skipped (`skip_tied`): the engine ties them itself."""
    named = sent_parameters(model, skip_tied)
    for group in parameter_groups(named, group_bytes):
        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
                # copies: a consumer may hold tensors past the gather (vLLM's packer batches ~1 GiB)
                copies = [(name, p.detach().clone()) for name, p in group]
            yield from copies
        else:
            for name, p in group:
                yield name, p.detach()


def parameter_layout(model: torch.nn.Module, *, skip_tied: bool = True) -> dict[str, list]:
    """Names, dtype names and full shapes of what `iter_full_parameters` yields (no gather needed)."""
    named = sent_parameters(model, skip_tied)
    return {
        "names": [n for n, _ in named],
        "dtype_names": [str(p.dtype).removeprefix("torch.") for _, p in named],
        "shapes": [list(getattr(p, "ds_shape", p.shape)) for _, p in named],
    }


def check_engine_weights(model: torch.nn.Module, engine: dict[str, Any], *, zero3: bool = False) -> dict[str, Any]:
    """Compare a sha256 of every parameter the engine holds (`engine`: its GET /weights/digests) with
    the learner's `model` put in the engine's layout and dtype (every rank walks the parameters under
    ZeRO-3). `equal` only when every tensor matches and neither side has one the other lacks."""
    return compare_engine_digests(learner_digests(model, engine["packed"], engine["dtype"], zero3=zero3), engine)


def learner_digests(
    model: torch.nn.Module, packed: dict[str, list[str]], dtype: str, *, zero3: bool = False
) -> dict[str, str]:
    """The learner's side of `check_engine_weights`: a sha256 of every parameter in an engine's fused
    layout (`packed`) and dtype (its name), without asking the engine (it may hash at the same time)."""
    from services.common.weight_digests import engine_layout_digests

    return engine_layout_digests(iter_full_parameters(model, zero3=zero3), packed, getattr(torch, dtype))


def compare_engine_digests(ours: dict[str, str], engine: dict[str, Any]) -> dict[str, Any]:
    """The verdict of `check_engine_weights` on digests already taken on both sides."""
    from services.common.weight_digests import digest_mismatches

    opaque = set(engine.get("opaque") or [])  # held by the engine in a form it cannot read back
    wrong = digest_mismatches(ours, engine["digests"])
    wrong["missing"] = [n for n in wrong["missing"] if n not in opaque]
    wrong["unverifiable"] = sorted(opaque)
    return {
        "tensors_checked": len(ours),
        "tensors_equal": len(ours) - len(wrong["differ"]) - len(wrong["missing"]) - len(opaque),
        "equal": not any(wrong.values()),
        **{k: v[:10] for k, v in wrong.items()},
        "digests": ours,
    }


# The learner's exit status when an NCCL call of the weight sync outlives its deadline.
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
    than at the deadline."""

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

        from services.learner.nccl_env import peer_protocol

        with peer_protocol():  # the engines' workers pick NCCL's own protocol; so must rank 0
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


def publish_files(
    store: StorePublisher | None,
    version: int,
    buckets: Any,
    *,
    config: Any,
    source_dir: Path | None,
    servers: list[str],
) -> dict[str, float]:
    """`version`'s files in the weights store, posted to `servers` alone (the others have it already).
    Every rank calls it: ranks without the store (`None`) take their share of rank 0's gathers."""
    if store is None:
        for _ in buckets():
            pass
        return {}
    kept, store.servers = store.servers, servers
    try:
        return store.publish(version, buckets(), config=config, source_dir=source_dir).metrics()
    finally:
        store.servers = kept


def _every_rank_agrees(flag: bool) -> bool:
    """True on every rank when it is true on any (rank 0 alone learns that a broadcast failed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
