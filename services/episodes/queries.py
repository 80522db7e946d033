"""Which query an episode plays: one of a split's, by id, or one given inline.

The benchmark's splits come from the operator's dataset folder (STAR_TRAVELPLANNER_DIR, read as
`star eval` reads it); other names are query files in the splits folder (STAR_EPISODES_SPLITS_DIR),
such as `star synth queries` writes. A split is read once and kept.
"""

from __future__ import annotations

import threading
from pathlib import Path

from services.common.schemas import TravelQuery
from services.reward.submission import SPLITS, SplitQuery, SubmissionError, dataset_split, load_split


class QueryNotFound(LookupError):
    """No such split, or no such query in it (a 404)."""


class QueryCatalog:
    def __init__(self, dataset_dir: Path, splits_dir: Path | None = None) -> None:
        self.dataset_dir = Path(dataset_dir)
        self.splits_dir = Path(splits_dir) if splits_dir is not None else None
        self._splits: dict[str, dict[str, TravelQuery]] = {}
        self._lock = threading.Lock()

    def query(self, split: str, query_id: str) -> TravelQuery:
        queries = self.split(split)
        found = queries.get(query_id)
        if found is None:
            raise QueryNotFound(
                f"split {split!r} has no query {query_id!r} (its ids run "
                f"{next(iter(queries))}..{next(reversed(queries))})"
            )
        return found

    def split(self, name: str) -> dict[str, TravelQuery]:
        with self._lock:
            if name not in self._splits:
                self._splits[name] = {q.query_id: q.query for q in self._read(name)}
            return self._splits[name]

    def _read(self, name: str) -> list[SplitQuery]:
        try:
            if name in SPLITS:
                return dataset_split(self.dataset_dir, name)
            return load_split(self._extra_split(name))
        except SubmissionError as exc:
            raise QueryNotFound(str(exc)) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise QueryNotFound(f"split {name!r} cannot be read on this service: {exc}") from None

    def _extra_split(self, name: str) -> Path:
        if self.splits_dir is None:
            raise QueryNotFound(
                f"unknown split {name!r}: use {', '.join(SPLITS)} (no splits folder is configured "
                "for other query files: STAR_EPISODES_SPLITS_DIR)"
            )
        for suffix in (".json", ".jsonl"):
            path = self.splits_dir / f"{name}{suffix}"
            # The name is checked by the request schema; resolve() keeps it inside the folder regardless.
            if path.resolve().parent == self.splits_dir.resolve() and path.is_file():
                return path
        raise QueryNotFound(
            f"unknown split {name!r}: no {name}.json or {name}.jsonl in the splits folder, "
            f"and it is not one of {', '.join(SPLITS)}"
        )
