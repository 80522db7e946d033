"""The external fleet: one that `star train` did not start (Docker Compose, Helm, `star up`).

The RL stage drives it through the settings its services read (services/pipeline/external.py's
`FleetAddress`) and owns only the learner run it starts through the learner service's runs API:
stopping the stage stops that run, never the fleet. The run's id is kept in the run folder, so a
controller started again re-attaches to a run still going instead of starting a second one. While
the stage runs, workers without a heartbeat and new dead letters are said in the controller's log.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from services.common.heartbeat import last_beat_age, live_consumers
from services.common.redis import redact
from services.common.streams import StreamNames, decode
from services.controller.fleet import LearnerReport
from services.pipeline.external import ACTIVE, FleetAddress, check_reachable, foreign_progress, response_detail
from services.pipeline.stage import Run, StageFailed, console

WATCH_EVERY_S = 20.0  # how often the controller looks for workers that cannot work
LEARNER_STOP_S = 120.0  # the learner finishes its step and checkpoints before it stops


@dataclass
class ExternalFleet:
    """The RL stage's view of a fleet it did not start: it owns the learner run alone."""

    address: FleetAddress
    record: Path  # the learner run this run folder started: {"id", "url"}
    run_id: str | None = None
    workers: list[Any] = field(default_factory=list)  # none of ours
    learner: Any = None  # no process of ours
    redis_log: Path | None = None  # the deployment keeps Redis's log
    watched_at: float = 0.0
    dead_seen: dict[str, int] = field(default_factory=dict)  # dead letters already reported, per stream
    _client: redis.Redis | None = None
    awaits_start_weights = True  # its workers run the fleet's model until the learner announces the run's

    def weight_servers(self) -> list[str]:
        return []  # the learner service names the fleet's rollout servers itself (STAR_ROLLOUT_URLS)

    def outputs(self) -> dict[str, Any]:
        return {"learner_run": self.run_id}

    @property
    def redis_url(self) -> str:
        return self.address.redis_url or ""

    @property
    def sandbox_url(self) -> str:
        return self.address.sandbox_url or ""

    def dependencies(self) -> dict[str, str]:
        return {"sandbox": self.sandbox_url, "learner": self.address.learner_url or ""}

    # -- the learner run ----------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return f"{self.address.learner_url}{path}"

    def _describe(self, run_id: str) -> dict[str, Any] | None:
        """GET /runs/{id}; None when the learner service does not know the run."""
        r = httpx.get(self._url(f"/runs/{run_id}"), headers=self.address.headers(), timeout=10)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def recorded_run(self) -> dict[str, Any] | None:
        """The learner run of an earlier controller of this folder, while it runs or once it has
        finished (it may train the last steps alone); None when there is none to follow."""
        try:
            run_id = json.loads(self.record.read_text())["id"]
        except (OSError, ValueError, KeyError):
            return None
        try:
            run = self._describe(run_id)
        except httpx.HTTPError:
            return None
        return run if run and run.get("state") in (*ACTIVE, "finished") else None

    def start_learner(self, run: Run, config: Path) -> str:
        """Re-attach to this folder's learner run if it runs or has finished, else (none, or one that
        failed or was stopped) start one from `config` (an RLConfig file) with POST /runs, which resumes
        from the checkpoint in the run folder; returns the run's id. (The learner service places it:
        `run`'s placement is this machine's.)"""
        attached = self.recorded_run()
        if attached is not None:
            self.run_id = attached["id"]
            console.print(
                f"re-attached to learner run {self.run_id} at {self.address.learner_url} "
                f"({attached['state']}, step {attached.get('step', 0)})"
            )
            return self.run_id
        # The fleet's rollout workers run the model they were started with: the learner announces the run's
        # starting weights as version 0 before the controller sends any task, and the workers load them.
        settings = {**json.loads(config.read_text()), "publish_start": True}
        config.write_text(json.dumps(settings, indent=2))
        body = {"kind": "rl", "config": settings}
        try:
            r = httpx.post(self._url("/runs"), json=body, headers=self.address.headers(), timeout=60)
        except httpx.HTTPError as exc:
            raise StageFailed(f"the learner at {self.address.learner_url} did not take the run: {exc}") from None
        if r.status_code == 401:
            raise StageFailed(f"the learner at {self.address.learner_url} refused the token (STAR_API_TOKEN)")
        if r.status_code != 201:
            raise StageFailed(
                f"the learner at {self.address.learner_url} refused the run ({r.status_code}): {response_detail(r)}"
            )
        self.run_id = r.json()["id"]
        tmp = self.record.with_suffix(".tmp")  # whole or absent, however the controller ends
        tmp.write_text(json.dumps({"id": self.run_id, "url": self.address.learner_url}))
        tmp.replace(self.record)
        console.print(f"learner run {self.run_id} started at {self.address.learner_url}")
        return self.run_id

    def learner_report(self) -> LearnerReport:
        try:
            run = self._describe(self.run_id) if self.run_id else None
        except httpx.HTTPError:  # the service is down: the dependency check counts how long
            return LearnerReport("unknown", running=True)
        if run is None:
            return LearnerReport("lost", running=False, error=f"the learner service no longer knows run {self.run_id}")
        return LearnerReport(
            run["state"], running=run["state"] in ACTIVE, exit_code=run.get("exit_code"), error=run.get("error")
        )

    def learner_ended(self, report: LearnerReport) -> None:
        """A learner run that ended before every step was trained fails the stage with its error."""
        error = (report.error or "").strip()
        raise StageFailed(
            f"learner run {self.run_id} at {self.address.learner_url} ended {report.state}"
            + (f": {error[-2000:]}" if error else "")
        )

    def stop_learner(self, timeout_s: float = LEARNER_STOP_S) -> None:
        """POST /runs/{id}/stop and wait (bounded) for it to checkpoint and end."""
        if not self.run_id:
            return
        try:
            r = httpx.post(self._url(f"/runs/{self.run_id}/stop"), headers=self.address.headers(), timeout=30)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            console.print(f"[yellow]could not stop learner run {self.run_id} at {self.address.learner_url}: {exc}[/]")
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.learner_report().running:
            time.sleep(0.5)

    # -- the fleet ----------------------------------------------------------------------------

    def keep_alive(self) -> list[str]:
        """Nothing to restart (the deployment restarts its own services); what of the fleet cannot work
        is said in the controller's log, at most every WATCH_EVERY_S."""
        now = time.monotonic()
        if now - self.watched_at >= WATCH_EVERY_S:
            self.watched_at = now
            for line in self.watch():
                console.print(f"[yellow]{line}[/]")
        return []

    def watch(self) -> list[str]:
        """Workers with no heartbeat within ALIVE_S and messages newly buried as dead letters, one line each."""
        try:
            client = self._client or redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=5)
            self._client = client
            lines = []
            for stream, group, what in (
                (self.address.names.tasks, "rollout", "rollout workers"),
                (self.address.names.trajectories, "reward", "reward workers"),
            ):
                if not live_consumers(client, stream, group):
                    age = last_beat_age(client, stream, group)
                    lines.append(
                        f"{what}: none has read {stream} for {age:.0f} s (they cannot work: see their logs)"
                        if age is not None
                        else f"{what}: none has joined {stream} (group {group})"
                    )
                dead = StreamNames.dead(stream)
                count = client.xlen(dead)
                if count > self.dead_seen.get(dead, 0):
                    newest = client.xrevrange(dead, count=1)
                    error = str(decode(newest[0][1]).get("error", "")) if newest else ""
                    lines.append(
                        f"{count - self.dead_seen.get(dead, 0)} message(s) of {stream} failed for good "
                        f"({dead}); the last: {error[:500]}"
                    )
                    self.dead_seen[dead] = count
            return lines
        except redis.RedisError:
            return []  # the stage's own loop reports Redis down

    def stop(self) -> None:
        """Stop the learner run this stage started (or re-attached to); the fleet keeps running."""
        if self.run_id and self.learner_report().running:
            console.print(f"stopping learner run {self.run_id}")
            self.stop_learner()


def connect(address: FleetAddress, names: StreamNames, record: Path) -> ExternalFleet:
    """The external fleet, once every part answers and its Redis holds no other run's progress."""
    check_reachable(address)
    fleet = ExternalFleet(address, record)
    if not record.is_file():  # progress of a run this folder started is its own
        found = foreign_progress(redis.Redis.from_url(address.redis_url), names)
        if found:
            raise StageFailed(
                f"the fleet's Redis at {redact(address.redis_url)} holds another run's RL progress "
                f"({found}); its rollout workers would not load this run's weights: start the "
                "fleet afresh, or give it another STAR_STREAM_PREFIX"
            )
    return fleet
