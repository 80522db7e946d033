"""The scoring worker: trajectories stream → formatter → evaluator → rewards → scored stream.

Each trajectory is scored against the query, eval mode, reward kind and epoch it carries; the
`ScoredTrajectory` is written to the scored stream and the trajectory acknowledged in one Redis
transaction (`StreamConsumer.forward`), so a crash loses nothing and duplicates nothing.

A payload that can never be scored (not a trajectory, a newer schema, no query) goes straight to
the dead-letter stream with its reason; any other failure (the LLM formatter down, say) leaves the
message pending, to be retried after `claim_idle_ms`, and dead-lettered after `max_deliveries`.
A formatter outage (`llm_error`, `timeout`) is such a failure: the agent's answer was never read,
so it becomes no scored trajectory (no training sample with reward 0) until the formatter answers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import redis
from pydantic import ValidationError

from services.common.schemas import SCHEMA_VERSION, ScoredTrajectory, Trajectory
from services.common.streams import StreamConsumer, StreamMessage, StreamNames, ensure_group, run_worker
from services.reward.config import RewardConfig
from services.reward.evaluator.aggregate import FORMATTER_OUTAGES
from services.reward.scoring import ScoreError, Scorer

log = logging.getLogger(__name__)

GROUP = "reward"
DEFAULTS = RewardConfig.model_construct()  # the worker settings' defaults, declared once in RewardConfig
SLOW_SCORE_S = 10.0  # a trajectory scored slower than this is logged with its seconds


class PermanentError(ValueError):
    """The message can never be scored; retrying would only delay the dead letter."""


def read_trajectory(data: dict) -> Trajectory:
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise PermanentError(f"trajectory schema_version {version!r}; this scorer reads {SCHEMA_VERSION}")
    try:
        return Trajectory(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise PermanentError(f"not a trajectory: {where}: {first['msg']}") from None
    except TypeError as exc:
        raise PermanentError(f"not a trajectory: {exc}") from None


class FormatterOutage(RuntimeError):
    """The formatter could not read the answer (its API failed or timed out): retry later."""


class ScoreWorker:
    def __init__(
        self,
        scorer: Scorer,
        client: redis.Redis,
        names: StreamNames,
        *,
        group: str = GROUP,
        consumer: str | None = None,
        claim_idle_ms: int = DEFAULTS.claim_idle_ms,
        max_deliveries: int = DEFAULTS.max_deliveries,
        backend: str | None = None,
    ) -> None:
        self.scorer = scorer
        self.names = names
        self.backend = backend
        self.consumer = StreamConsumer(
            client,
            names.trajectories,
            group,
            consumer or f"reward-{socket.gethostname()}-{os.getpid()}",
            claim_idle_ms=claim_idle_ms,
            max_deliveries=max_deliveries,
        )
        self.scored = 0
        self.dead = 0

    def score(self, msg: StreamMessage) -> ScoredTrajectory:
        """The scored trajectory, its scoring seconds in `timings["score_s"]` (the learner's metrics
        summarize them; a scoring slower than SLOW_SCORE_S is logged)."""
        trajectory = read_trajectory(msg.data)
        started = time.monotonic()
        try:
            scored = self.scorer.score_trajectory(trajectory, self.backend)
        except ScoreError as exc:
            raise PermanentError(str(exc)) from None
        seconds = time.monotonic() - started
        scored.timings = {**scored.timings, "score_s": round(seconds, 3)}
        if seconds > SLOW_SCORE_S:
            log.warning(
                "slow scoring",
                extra={
                    "task": trajectory.task_id,
                    "sample": trajectory.sample_index,
                    "seconds": round(seconds, 1),
                    "formatter": scored.score.formatter_status,
                },
            )
        if scored.score.formatter_status in FORMATTER_OUTAGES:
            raise FormatterOutage(
                f"formatter {scored.score.formatter_status} on {trajectory.task_id}; left pending for a retry"
            )
        return scored

    def handle(self, msg: StreamMessage) -> ScoredTrajectory | None:
        """The payload to forward; None after dead-lettering a message that can never be scored."""
        try:
            out = self.score(msg)
        except PermanentError as exc:
            msg.deliveries = max(msg.deliveries, self.consumer.max_deliveries)  # no point retrying
            self.consumer.fail(msg, str(exc))
            self.dead += 1
            return None
        self.scored += 1
        return out

    def run(self, stop: threading.Event | None = None, *, batch: int = 8, block_ms: int = 1000) -> int:
        stop = stop or threading.Event()
        started = time.monotonic()
        handled = 0
        while not stop.is_set():
            try:
                handled += run_worker(
                    self.consumer, self.handle, self.names.scored, stop, batch=batch, block_ms=block_ms
                )
            except redis.ResponseError as exc:
                # The stream or its group was deleted under us (a reset of the run): recreate the
                # group and go on reading, rather than dying with a traceback.
                if "NOGROUP" not in str(exc) and "no longer exists" not in str(exc):
                    raise
                log.warning("trajectories stream or group vanished; recreating", extra={"error": str(exc)})
                stop.wait(0.5)
                ensure_group(self.consumer.client, self.consumer.stream, self.consumer.group)
        log.info(
            "scoring worker stopped",
            extra={
                "handled": handled,
                "scored": self.scored,
                "dead": self.dead,
                "seconds": round(time.monotonic() - started, 1),
            },
        )
        return handled
