"""A run folder's metrics: one JSON line per step in metrics.jsonl, and the same scalars in TensorBoard
and in the experiment trackers STAR_TRACKING switches on (W&B, MLflow: services/common/tracking.py)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class RunLog:
    def __init__(self, folder: Path, *, enabled: bool = True, tensorboard: bool = True) -> None:
        self.folder = Path(folder)
        self.enabled = enabled
        self.writer = None
        self.last: dict[str, Any] = {}
        self.trackers = None
        if enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.writer = SummaryWriter(str(self.folder / "tensorboard"))
                except ImportError:  # pragma: no cover - tensorboard is a dependency
                    self.writer = None
            from services.common.tracking import Trackers

            # named after the run and the stage folder, e.g. "tiny/rl"
            self.trackers = Trackers.open(self.folder, f"{self.folder.parent.name}/{self.folder.name}")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self.last = record
        if not self.enabled:
            return
        with open(self.folder / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record, default=_jsonable) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.trackers is not None:
            self.trackers.log(metrics, step)

    def write_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        """Whole trajectories of a step, one JSON line each, in samples.jsonl."""
        if not self.enabled or not records:
            return
        with open(self.folder / "samples.jsonl", "a") as fh:
            for record in records:
                fh.write(json.dumps({"step": step, **record}, default=_jsonable) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.trackers is not None:
            self.trackers.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
