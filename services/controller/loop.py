"""The RL stage: the real services as separate processes, joined by Redis Streams.

    controller ──tasks──▶ rollout workers ──trajectories──▶ reward workers ──scored──▶ learner
        ▲                     │ (sandbox over HTTP)                                    │
        └─────────── weights version (Redis key), batches consumed ◀───────────────────┘

The controller publishes each step's tasks when the learner is close enough (`max_staleness`),
watches the fleet, and ends the stage when every step has been trained. Who runs the fleet is the
recipe's `deployment.fleet`: embedded, the stage starts it (`embedded_fleet`) and stops it at the end;
external, it drives a running fleet (`external_fleet`) and owns only the learner run it starts there.
Both go through one loop, `drive`, over the one fleet interface (`fleet.Fleet`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from services.common.redis import redact
from services.common.settings import get_settings
from services.common.streams import StreamNames, trim_consumed
from services.controller import preflight
from services.controller.embedded_fleet import start_fleet
from services.controller.external_fleet import connect
from services.controller.fleet import Fleet
from services.controller.learner_config import rl_config
from services.controller.preflight import Dependencies
from services.controller.scheduler import Schedule, TaskPublisher
from services.controller.validation import Validation, print_validations
from services.pipeline.external import FleetAddress
from services.pipeline.stage import Run, StageFailed, console
from services.synth.queries import load_queries


def weights_version(client: redis.Redis, names: StreamNames) -> int:
    """The newest policy version published: the newest with files (`weights:latest`) or, over NCCL, a
    newer one the learner broadcast without writing files (`weights:version`). Tasks ask for it."""
    raw, broadcast = client.mget(names.weights_latest, names.weights_version)
    return max(int(json.loads(raw)["version"]) if raw else 0, int(broadcast) if broadcast else 0)


def learner_progress(client: redis.Redis, names: StreamNames) -> int:
    """Batches consumed; falls back to the weights version for a learner that does not count."""
    raw = client.get(names.learner_batches)
    return max(int(raw) if raw else 0, weights_version(client, names))


def fleet_streams(run: Run) -> StreamNames:
    """The streams of the run's fleet: an embedded fleet's are the run's own; an external fleet's are
    the ones its workers read (STAR_STREAM_PREFIX)."""
    if run.config.deployment.fleet == "external":
        return StreamNames(get_settings().stream_prefix)
    return StreamNames(f"star:{run.config.name}")


def learner_record(run: Run) -> Path:
    """The learner run an external fleet's learner service runs for this folder."""
    return run.folder / "learner-run.json"


def open_fleet(run: Run, model: str, names: StreamNames) -> Fleet:
    """The RL stage's fleet: started here (embedded) or found running (external)."""
    if run.config.deployment.fleet == "external":
        address = FleetAddress.from_settings(get_settings(), wait_s=run.config.controller.fleet_wait_s)
        return connect(address, names, learner_record(run))
    return start_fleet(run, model, names)


def stage_rl(run: Run, model: str, synth: dict[str, Any]) -> dict[str, Any]:
    r = run.config.rl
    curriculum = r.schedule()
    prompts_file = synth.get("rl_queries")
    if not prompts_file or not Path(prompts_file).is_file():
        raise StageFailed("rl needs the RL prompt set of the synth stage (data/rl.jsonl)")
    prompts = tuple(load_queries(prompts_file))
    schedule = Schedule(prompts, r.batch_prompts, r.group_size, r.epochs, seed=run.config.seed, max_steps=r.max_steps)
    if curriculum is not None:
        console.print(f"reward: curriculum {curriculum.describe()} (by {curriculum.unit})")
    if run.weight_sync is not None:
        console.print(run.weight_sync.describe())
    for note in preflight.notes(run, curriculum, schedule.total_steps):
        console.print(f"[yellow]{note}[/]")
    deadline = time.monotonic() + r.max_minutes * 60 if r.max_minutes else None  # the fleet's start counts
    names = fleet_streams(run)
    sampling = r.sampling if r.sampling.seed is not None else r.sampling.model_copy(update={"seed": run.config.seed})
    later = bool(run.placement and run.placement.validations_after)
    validation = (
        Validation(run, synth["val_queries"], r.val_every, after_fleet=later, keep=r.keep_validated)
        if r.val_every and synth.get("val_queries")
        else None
    )
    try:
        f = open_fleet(run, model, names)
        try:
            if validation and not validation.seen(0):
                validation.submit(0, model, keep=False)  # the starting model: the curve's baseline, same queries
            f.start_learner(run, rl_config(run, model, names, None, schedule.total_steps, f.weight_servers()))
            client = redis.Redis.from_url(f.redis_url)
            publisher = TaskPublisher(
                client,
                names,
                run.config.name,
                schedule,
                sampling,
                reward_kind=r.reward,
                preference_penalty=r.preference_penalty,
                curriculum=curriculum,
                eval_mode=r.eval_mode,
                max_staleness=r.max_staleness,
                arpo=r.arpo if r.algorithm == "arpo" else None,
                oversample_groups=r.oversample_groups,
                await_start_weights=f.awaits_start_weights,
            )
            ended = drive(run, f, client, names, publisher, schedule, validation=validation, deadline=deadline)
            if ended.reason == "budget":
                # the learner may publish once more while it stops: read the weights after it has
                f.stop_learner()
                ended = Ending("budget", learner_progress(client, names))
            latest = client.get(names.weights_latest)
        finally:
            f.stop()
        update = json.loads(latest) if latest else None
        if validation:  # after the fleet, whose engines have given the GPU back
            if update and not validation.seen(update["version"]):
                validation.submit(update["version"], update["uri"])  # the final policy is a candidate too
            print_validations(validation.wait())
    except BaseException:  # a failing or interrupted stage leaves no validation running
        if validation:
            validation.stop()
        raise
    best = validation.best() if validation else None
    ending = {"ended": ended.reason, "steps_trained": ended.steps, **f.outputs()}
    if best:
        return {
            "model": best["model"],
            "version": best["version"],
            "best_success": best["success"],
            "last_version": update["version"] if update else 0,
            "steps": schedule.total_steps,
            **ending,
            "metrics": str(run.folder / "rl" / "metrics.jsonl"),
            "validation": str(run.folder / "validation"),
        }
    return {
        "model": update["uri"] if update else model,
        "version": update["version"] if update else 0,
        "steps": schedule.total_steps,
        **ending,
        "metrics": str(run.folder / "rl" / "metrics.jsonl"),
        "learner_restarts": f.learner.restarts if f.learner else 0,
        "worker_restarts": {w.name: w.restarts for w in f.workers if w.restarts},
    }


@dataclass(frozen=True)
class Ending:
    """Why the RL stage stopped: "done" (every step trained) or "budget" (`rl.max_minutes` spent),
    and how many steps the learner had trained by then."""

    reason: str
    steps: int


def drive(
    run: Run,
    f: Fleet,
    client: redis.Redis,
    names: StreamNames,
    publisher: TaskPublisher,
    schedule: Schedule,
    poll_s: float = 0.5,
    validation: Validation | None = None,
    deadline: float | None = None,
) -> Ending:
    """Publish, watch, restart, until the learner has consumed every step (it counts a step once
    that step's weights are out) or, past `deadline` (time.monotonic()), at once: the steps under
    way are dropped and the latest published weights are the stage's result. The fleet says how its
    learner is doing and what it restarts; the loop is the same for an embedded and an external one."""
    total = schedule.total_steps
    columns = (
        TextColumn("[bold]rl"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("rl", total=total, info="")
        redis_down_since: float | None = None
        said = ""
        limits = run.config.controller
        deps = Dependencies(f.dependencies(), limits.sandbox_down_limit_s)
        while True:
            try:
                progress = learner_progress(client, names)
                down = deps.check()
                version = weights_version(client, names)
                if not down:
                    publisher.publish_ready(progress, version)
                latest_raw = client.get(names.weights_latest)
                published = publisher.next_step()
                trim_streams(client, names)
                if redis_down_since is not None:
                    console.print(f"redis is back after {time.monotonic() - redis_down_since:.0f} s")
                    redis_down_since = None
            except (redis.ConnectionError, redis.TimeoutError):
                # Redis restarting (its AOF brings the streams back): keep the processes alive and
                # wait, up to controller.redis_down_limit_s; then fail, naming it, rather than wait forever
                now = time.monotonic()
                if redis_down_since is None:
                    redis_down_since = now
                    console.print(f"[yellow]redis at {redact(f.redis_url)} unavailable; waiting for it to come back[/]")
                elif now - redis_down_since > limits.redis_down_limit_s:
                    log = f"; see {f.redis_log}" if f.redis_log else ""
                    raise StageFailed(
                        f"redis at {redact(f.redis_url)} unreachable for {now - redis_down_since:.0f} s{log}"
                    )
                f.keep_alive()
                time.sleep(poll_s)
                continue
            validating = f" · validating v{validation.running[0]}" if validation and validation.running else ""
            info = f"published {published}/{total} · weights v{version}{validating}"
            bar.update(task, completed=min(progress, total), info=info)
            said = say_progress(min(progress, total), total, info, said)
            if validation is not None:
                latest = json.loads(latest_raw) if latest_raw else None
                if latest and validation.due(latest["version"]):
                    validation.submit(latest["version"], latest["uri"])
                print_validations(validation.poll())
            if progress >= total:
                _await_last_publication(f)
                return Ending("done", progress)
            if deadline is not None and time.monotonic() >= deadline:
                console.print(f"[yellow]rl.max_minutes spent: stopping after {progress} of {total} steps[/]")
                return Ending("budget", progress)
            for name in f.keep_alive():
                console.print(f"[yellow]{name} died; restarted[/]")
            report = f.learner_report()
            if not report.running:
                if report.state == "finished":
                    final = _progress_or(client, names, progress)
                    if final >= total:
                        return Ending("done", final)
                f.learner_ended(report)
            time.sleep(poll_s)


def say_progress(done: int, total: int, info: str, said: str) -> str:
    """A line per change of the RL progress where the console is no terminal (a container's log, a
    file), which a progress bar reaches only when it ends; returns the line now said."""
    line = f"rl {done}/{total} steps trained · {info}"
    if line != said and not console.is_terminal:
        console.print(line, soft_wrap=True)
    return line


def trim_streams(client: redis.Redis, names: StreamNames) -> None:
    """Drop what every consumer group has acknowledged: the streams stay as long as the work in
    flight, not the run."""
    for stream in (names.tasks, names.trajectories, names.scored):
        try:
            trim_consumed(client, stream)
        except (redis.ResponseError, ValueError) as exc:  # housekeeping: never worth the stage
            console.print(f"[yellow]could not trim {stream}: {exc}[/]")


def _await_last_publication(f: Fleet, timeout_s: float = 120.0) -> None:
    """The learner counts the last batch once its weights are out; give it a while to write its
    final status and exit before the fleet stops. Bounded, so that a learner stuck in its
    teardown cannot hang the run."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = f.learner_report()
        if not report.running or report.state == "finished":
            return
        time.sleep(0.5)


def _progress_or(client: redis.Redis, names: StreamNames, fallback: int) -> int:
    try:
        return learner_progress(client, names)
    except (redis.ConnectionError, redis.TimeoutError):
        return fallback
