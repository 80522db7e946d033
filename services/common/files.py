"""Small file helpers every service uses: content hashes and JSON-lines reading with line numbers."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def sha256_file(path: str | Path, chunk: int = 8 * 2**20) -> str:
    """Hex sha256 of a file, read in chunks (weights shards can be gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def iter_jsonl(
    path: str | Path, error: type[Exception] = ValueError, *, skip_bad: bool = False
) -> Iterator[tuple[int, Any]]:
    """(1-based line number, value) of each non-blank line. A line that is not JSON raises
    `error` naming the file and line, or is skipped with `skip_bad` (a line cut by a crash).
    A `.gz` file is read through gzip (the proof's samples come back from the GPU compressed)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                if skip_bad:
                    continue
                raise error(f"{path}:{lineno}: not a JSON line ({exc.msg})") from None
