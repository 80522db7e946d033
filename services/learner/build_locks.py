"""Stale locks of torch's JIT-built extensions (DeepSpeed's CPU shared-memory op among them).

torch builds an extension under a file lock (`torch.utils.file_baton.FileBaton`): the builder creates
`<build dir>/lock`, keeps it open while it compiles and removes it at the end, and every other process
waits for the file to go. A builder killed outright (SIGKILL, an out-of-memory kill) leaves the file behind,
and every later learner on the machine then waits for it forever, before DeepSpeed's first collective. A
lock no process holds open, older than a live lock's brief gaps (created a moment before its builder holds
it, closed a moment before it is removed; every load of a built op takes it too), is such a leftover; this
removes it before DeepSpeed starts.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)
STALE_AFTER_S = 30.0  # a lock younger than this may be a live one between its creation and its removal


def extensions_root() -> Path:
    """Where torch builds JIT extensions: TORCH_EXTENSIONS_DIR, else torch's default root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def open_paths() -> set[Path] | None:
    """Every file some process of this machine (that this user may inspect) holds open; None where /proc
    does not list them (not Linux), so nothing is called stale there."""
    proc = Path("/proc")
    if not sys.platform.startswith("linux") or not proc.is_dir():
        return None
    held: set[Path] = set()
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            fds = list(fd_dir.iterdir())
        except OSError:  # the process ended, or is not ours to inspect
            continue
        for fd in fds:
            try:
                held.add(Path(os.readlink(fd)))
            except OSError:
                continue
    return held


def age_s(path: Path, now: float) -> float:
    """Seconds since `path` was last modified (0 if it is gone)."""
    try:
        return now - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def clear_stale_build_locks(root: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the extension build locks under `root` (default: `extensions_root()`) older than
    `stale_after_s` that no process holds open; returns those removed."""
    root = root or extensions_root()
    now = time.time()
    locks = [p for p in [*root.glob("*/*/lock"), *root.glob("*/lock")] if p.is_file() and age_s(p, now) > stale_after_s]
    if not locks:
        return []
    held = open_paths()
    if held is None:
        return []
    removed = []
    for lock in locks:
        if lock.resolve() in held:
            continue
        try:
            lock.unlink()
        except FileNotFoundError:  # its builder finished meanwhile
            continue
        log.warning(
            "removed a stale extension build lock that no process held (a build was killed)", extra={"lock": str(lock)}
        )
        removed.append(lock)
    return removed
