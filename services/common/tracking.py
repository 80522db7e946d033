"""Experiment tracking beside TensorBoard: Weights & Biases and MLflow, off by default.

`STAR_TRACKING=wandb,mlflow` (either or both) switches them on for every stage that logs metrics:
the learner's SFT and RL steps (services/learner/runlog.py) and the pipeline's stage results
(synthesis counts, evaluation scores: services/controller/train.py). Each backend runs in whatever
mode its own settings say:

- W&B: `WANDB_MODE=offline` writes runs under `<run folder>/wandb` for `wandb sync` later (no
  account needed); online needs `WANDB_API_KEY`. Project: `STAR_WANDB_PROJECT` (default `star`).
- MLflow: `STAR_MLFLOW_TRACKING_URI` (a tracking server, or by default a local SQLite store,
  `<run folder>/mlflow.db`, which `mlflow ui --backend-store-uri sqlite:///…` reads); experiment:
  `STAR_MLFLOW_EXPERIMENT` (default `star`).

A backend that cannot start (not installed, no credentials) is reported once and skipped: tracking
never stops training.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Protocol

from services.common.settings import Settings

log = logging.getLogger(__name__)

BACKENDS = ("wandb", "mlflow")


class Tracker(Protocol):
    name: str

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record (what every backend can plot)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def requested(value: str | None = None) -> list[str]:
    """The backends named in STAR_TRACKING (or `value`); an unknown name is an error."""
    # the environment as it is when a run opens its trackers (not the process's cached settings)
    raw = Settings().tracking if value is None else value
    names = [n.strip().lower() for n in raw.split(",") if n.strip() and n.strip().lower() not in ("off", "none")]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"STAR_TRACKING names {', '.join(unknown)}; known: {', '.join(BACKENDS)}")
    return names


class WandbTracker:
    name = "wandb"

    def __init__(self, folder: Path, run_name: str, config: dict[str, Any] | None = None) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=Settings().wandb_project,
            name=run_name,
            dir=str(folder),
            config=config or {},
            reinit="create_new",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, folder: Path, run_name: str, config: dict[str, Any] | None = None) -> None:
        from mlflow.tracking import MlflowClient

        folder.mkdir(parents=True, exist_ok=True)
        settings = Settings()
        uri = settings.mlflow_tracking_uri or f"sqlite:///{(folder / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = settings.mlflow_experiment
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        for key, value in (config or {}).items():
            self.client.log_param(self.run_id, key, str(value)[:500])

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(
    folder: Path, run_name: str, config: dict[str, Any] | None = None, backends: list[str] | None = None
) -> list[Tracker]:
    """The trackers STAR_TRACKING asks for, started for one run whose files live in `folder`."""
    out: list[Tracker] = []
    for name in requested() if backends is None else backends:
        cls = WandbTracker if name == "wandb" else MlflowTracker
        try:
            out.append(cls(folder, run_name, config))
        except Exception as exc:  # noqa: BLE001 - tracking is never worth a failed run
            log.warning(
                "experiment tracker not started", extra={"tracker": name, "error": f"{type(exc).__name__}: {exc}"}
            )
    return out


class Trackers:
    """Fan-out to the open trackers; a tracker that fails is dropped with a warning."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = list(trackers)

    @classmethod
    def open(cls, folder: Path, run_name: str, config: dict[str, Any] | None = None) -> Trackers:
        return cls(open_trackers(folder, run_name, config))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = numeric(metrics)
        if not values:
            return
        for tracker in list(self.trackers):
            try:
                tracker.log(values, step)
            except Exception as exc:  # noqa: BLE001
                log.warning("experiment tracker failed; dropped", extra={"tracker": tracker.name, "error": str(exc)})
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("experiment tracker did not close", extra={"tracker": tracker.name, "error": str(exc)})
        self.trackers = []
