"""A published version's folder and its manifest: written once by the learner, checked by every reader.

A version is the HF model folder `{root}/v{version}` (safetensors shards, config, tokenizer) with
`manifest.json`: the version and the sha256 and size of every other file. The sha256 of the manifest
itself is what a `WeightsUpdate` announces, so a reader that trusts that hash can trust each file by
its size, or by its sha256 where it re-hashes.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.common.files import sha256_file
from services.common.schemas import WeightsUpdate

MANIFEST = "manifest.json"


class WeightsError(RuntimeError):
    """A version that cannot be published, sent or loaded, or a weight transfer a server refuses; `status`
    is the HTTP status a server answers it with (422: the version itself is unusable)."""

    def __init__(self, message: str, *, status: int = 422) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def write_manifest(folder: Path, version: int, hashed: dict[str, dict[str, Any]] | None = None) -> str:
    """Write `manifest.json` listing every file of `folder` (sha256 and size; `hashed`: entries already
    taken, e.g. shards hashed while they were written) and return its sha256."""
    folder = Path(folder)
    files = dict(hashed or {})
    for item in sorted(folder.iterdir()):
        if item.is_file() and item.name != MANIFEST and not item.name.startswith(".") and item.name not in files:
            files[item.name] = {"sha256": sha256_file(item), "bytes": item.stat().st_size}
    manifest = {"version": version, "created": time.time(), "files": dict(sorted(files.items()))}
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (folder / MANIFEST).write_bytes(raw)
    return hashlib.sha256(raw).hexdigest()


def check_version(folder: Path, sha256: str | None = None, *, rehash: bool = True) -> dict[str, Any]:
    """The manifest of the version in `folder`, after checking it against `sha256` (when given) and every
    file it lists by its size and (`rehash`) its sha256; a WeightsError (422) says what does not match."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise WeightsError(f"{folder} has no {MANIFEST}: not a published version")
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and digest != sha256:
        raise WeightsError(f"{path} does not match the announced sha256: announced {sha256}, found {digest}")
    try:
        manifest = json.loads(raw)
        listed = manifest.get("files") or {}
    except (ValueError, AttributeError):
        raise WeightsError(f"{path} is not a JSON object") from None
    if not isinstance(listed, dict):
        raise WeightsError(f"{path}: files must be an object")
    inside = folder.resolve()
    expected: dict[Path, str] = {}
    for name, entry in listed.items():
        # the learner's form: {"file": {"sha256": …, "bytes": …}}; a bare digest is accepted too
        sha = entry.get("sha256") if isinstance(entry, dict) else entry
        size = entry.get("bytes") if isinstance(entry, dict) else None
        file = (inside / name).resolve()
        if not file.is_relative_to(inside) or not file.is_file():
            raise WeightsError(f"{MANIFEST} lists {name!r}, which is not a file of the version in {folder}")
        if isinstance(size, int) and file.stat().st_size != size:
            raise WeightsError(f"{folder / name} has {file.stat().st_size} bytes; the manifest says {size}")
        if isinstance(sha, str):
            expected[file] = sha
    if rehash and expected:
        with ThreadPoolExecutor(max_workers=min(8, len(expected))) as pool:
            digests = dict(zip(expected, pool.map(sha256_file, expected)))
        for file, sha in expected.items():
            if digests[file] != sha:
                raise WeightsError(f"{file} does not match its sha256 in the manifest")
    return manifest


def announced_folder(update: WeightsUpdate, root: Path) -> Path:
    """The folder `update.uri` names (a path, relative to the weights root or absolute, or a file:// URI),
    or a WeightsError: 422 for another scheme, 403 outside the weights root, 404 when no folder is there."""
    uri = update.uri
    if "://" in uri:
        scheme, _, rest = uri.partition("://")
        if scheme != "file":
            raise WeightsError(f"unsupported uri scheme {scheme!r}: use a path or a file:// URI")
        uri = rest
    folder = Path(uri)
    root = Path(root).resolve()
    if not folder.is_absolute():
        folder = root / folder
    folder = folder.resolve()
    if not folder.is_relative_to(root):
        raise WeightsError(f"{update.uri} is outside the weights root {root}", status=403)
    if not folder.is_dir():
        raise WeightsError(f"no weights folder at {folder}", status=404)
    return folder


def check_weights(update: WeightsUpdate, root: Path, rehash: bool = False) -> Path:
    """The folder of an announced version, or a WeightsError saying why it cannot be loaded: the folder
    under the weights root, its manifest by the announced sha256, each file by its size (`rehash`: by
    its sha256 too; the learner hashed every file into the manifest)."""
    folder = announced_folder(update, root)
    check_version(folder, update.sha256, rehash=rehash)
    return folder
