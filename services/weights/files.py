"""The files transport: a version as an HF model folder in the weights store, and loading one.

The learner (`StorePublisher`) writes full weights, gathered bucket by bucket, as the folder
`STAR_HOME/weights/v{version}` (safetensors shards, config, tokenizer) plus its manifest
(services/weights/manifest.py). The folder is written under a temporary name and renamed, so a reader
never sees half a version. Then the latest version goes to Redis (`{prefix}:weights:latest`, a
WeightsUpdate) and to every rollout server (`POST /weights`), and versions older than the last K are
deleted. A rollout server checks the announced folder (`check_weights`) and its engine reads the
shards (`load_state_dict`; vLLM reloads them itself); a live torch model takes a version in place
with `load_into`.

Version numbers only grow and each names one set of weights: `{prefix}:weights:highest` is the highest
number ever published in the run (never lowered, while a restarted learner may lower
`weights:version` to its checkpoint's); a learner numbers every new version above it, the store's
folders and the engines' own versions (services/learner/trainer.py, `RLTrainer._number_past_the_fleet`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.schemas import WeightsUpdate
from services.weights.buckets import FlatBucket, tied_head
from services.weights.manifest import MANIFEST, WeightsError, check_version, version_dir, write_manifest

log = logging.getLogger(__name__)

WEIGHT_FILES = (".safetensors", ".bin", ".pt")
INDEX = "model.safetensors.index.json"


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
    digest = write_manifest(tmp, version, files)
    if fsync:
        for item in tmp.iterdir():
            with open(item, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_s = time.perf_counter() - t_start - gather_s
    return final, digest, gather_s, write_s, total


# ---- reading a version --------------------------------------------------------------------------


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
        check = pool.submit(check_version, folder, sha256, rehash=verify)
        device = next(model.parameters()).device
        state = load_state_dict(folder, device)
        check.result()
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in params if n not in state and not tied_head(model, n)]
    if missing:
        raise WeightsError(f"{folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, tensor in state.items():
            if name in params:
                params[name].copy_(tensor)
    return len(state)


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
