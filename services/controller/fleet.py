"""The fleet: the processes an RL stage trains with, behind one interface the loop drives.

Embedded (`embedded_fleet.EmbeddedFleet`), the stage starts it through the launcher (Redis, sandbox,
workers, the learner under one supervisor), restarts what dies and stops it at the end; external
(`external_fleet.ExternalFleet`), it runs already (Compose, Helm, `star up`) and the stage owns only
the learner run it starts there. `loop.drive` is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.pipeline.stage import Run


@dataclass
class LearnerReport:
    """The learner's state as the controller reads it: `running` while it trains (or cannot be told)."""

    state: str
    running: bool
    exit_code: int | None = None
    error: str | None = None


class Fleet(Protocol):
    """What the RL stage asks of its fleet."""

    awaits_start_weights: bool  # its rollout workers run another model until the learner announces its own
    workers: list[Any]  # the worker processes it supervises (restart counts), none when it supervises none
    learner: Any  # the learner process it supervises, or None

    @property
    def redis_url(self) -> str: ...

    @property
    def redis_log(self) -> Path | None: ...

    @property
    def sandbox_url(self) -> str: ...

    def dependencies(self) -> dict[str, str]:
        """The services no step is published without (name → URL, probed on /readyz)."""
        ...

    def weight_servers(self) -> list[str]:
        """The rollout servers the learner's config names for weights over NCCL or IPC."""
        ...

    def start_learner(self, run: Run, config: Path) -> Any: ...

    def keep_alive(self) -> list[str]:
        """Restart what died (not the learner); returns what was restarted."""
        ...

    def learner_report(self) -> LearnerReport: ...

    def learner_ended(self, report: LearnerReport) -> None:
        """The learner stopped before every step was trained: restart it, or fail the stage."""
        ...

    def stop_learner(self) -> None: ...

    def outputs(self) -> dict[str, Any]:
        """What the stage's outputs record of the fleet."""
        ...

    def stop(self) -> None: ...
