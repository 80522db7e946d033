"""The rollout worker: RolloutTask from the tasks stream → G trajectories on the trajectories stream.

Delivery (services/common/streams.py): the trajectories are written and the task acknowledged
in one Redis transaction, so a worker killed at any point leaves either both or neither; a dead
worker's task stays pending and another worker claims it after `claim_idle_ms`. While a task
runs, `run_worker`'s claim keeper re-claims it every `claim_idle_ms / 3`, so a slow but live
worker is never robbed of its task (which would duplicate its trajectories): loading new weights
can take as long as the claim timeout (an engine that drains waits for its longest turn).

Sandbox: a consumer takes a task only while the sandbox answers its readiness check (`SandboxCheck`,
cached for a couple of seconds); while it does not, the consumer claims nothing and checks again
with a growing pause, so an outage leaves tasks in the stream instead of turning them into
`engine_error` samples. A read already waiting when the sandbox goes, or a check's cached answer,
can still let one task through, and a sandbox lost in the middle of a task fails that task (retried).

Failures: a payload that is not a RolloutTask is dead-lettered at once (retrying cannot fix
it); a task whose every sample ended in `engine_error`, or that needs newer weights than can
be loaded, is failed and retried, and dead-lettered after `max_deliveries` attempts. An engine
that reports itself broken (`Engine.healthy`, e.g. ticks failing on a CUDA error) stops the worker
with exit status 1 instead: its supervisor starts a fresh process, other workers take its tasks. So
does a weight receive (or group join) over NCCL that timed out or failed (`RolloutService.fatal`,
exit status `STUCK_EXIT`, 75; a watchdog thread ends the process where the event loop itself is stuck):
the engine core may be blocked in the collective for ever, and a paused engine must not go on
holding (and re-claiming) tasks. A worker ended outright leaves nothing behind: a guard process
(services/common/reaper.py) kills what it started (vLLM's engine core, which would keep its GPU). A
load from files that failed partway leaves the process up but takes no task (`broken`) until a whole
version loads; the groups sampled across it are refused.

Weights: before a task, the worker loads the version announced under `{prefix}:weights:latest`
when it is newer than its own (the learner writes that key whenever it writes a version's files:
every step, or with NCCL only now and then); an engine that loads in place (vLLM) also polls the
key while its turns run, so a new version arrives mid-episode. With weights over NCCL the learner
broadcasts most versions straight into the engine through the worker's HTTP face (below): the
engine's own version is then what counts, a file version older than it is never loaded (the
engine refuses it even when it was waiting behind the broadcast), and a worker whose engine lacks
the newest version the learner recorded (`{prefix}:weights:version`) takes no task until it has it
(every task asks for that version, so it could only fail them), loading any newer files meanwhile
and asking the learner to send the version again (`{prefix}:weights:wanted`). The model a worker
was started with is no published version: once a version is announced (an external fleet's run
announces its starting weights as version 0 before its first task), a worker that has not loaded
one fails its tasks rather than sample them with its own model.

HTTP face: with `STAR_ROLLOUT_HTTP_PORT` set the worker also serves the rollout API (health,
`GET /weights`, the NCCL weight group and broadcasts; `services.rollout.app`) on the same service
and event loop; unset, it has no server.

Scheduling: the engine lives on the asyncio loop of the main thread, and the unit of concurrency
is the episode, not the group. The worker keeps up to `max_inflight_episodes` episodes in flight
on its engine (`EpisodeSlots`, shared by every group on the loop): one claim thread takes a new
task whenever the episodes running, waiting for a slot and claimed but not yet started are fewer
than that, and the task's G episodes start as slots free up, each giving its slot back when it
ends, so a group's slot no longer idles until its slowest episode ends. A task's group is written,
with the task's acknowledgement in the same transaction, when its last episode ends (a small pool
of settling threads does the Redis writes); the claim keeper re-claims every task in flight. The
budget's default derives from the engine's KV cache and the episodes' context (`capacity.py`).

Deadlines: each task's sampling carries wall-clock limits per turn, episode and group
(`SamplingParams.*_timeout_s`); a cut episode ends as `deadline` and its group is written with the
others; what the learner does with such a group is the recipe's `rl.late_groups`.
Run: `star rollout worker [--config FILE]` or `python -m services.rollout.worker [--config FILE]` (the settings:
services/rollout/config.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from services.common.schemas import RolloutTask, Trajectory, WeightsUpdate
from services.common.settings import Settings, get_settings
from services.common.streams import (
    REDIS_DOWN,
    TRIM_EVERY_S,
    ClaimKeeper,
    StreamConsumer,
    StreamMessage,
    StreamNames,
    _settle,
    trim_consumed,
    until_redis,
)
from services.rollout.capacity import engine_for_budget, inflight_budget
from services.rollout.config import RolloutConfig, RolloutConfigError, load_rollout_config
from services.rollout.group import EpisodeSlots
from services.rollout.service import STUCK_EXIT, RolloutService
from services.weights.manifest import WeightsError

log = logging.getLogger(__name__)
GROUP = "rollout"
FATAL_EXIT_S = 60.0  # a worker stopping for a restart that has not exited by then ends at once
ADMIT_POLL_S = 0.01  # how often a full worker looks for a free episode slot
SETTLE_THREADS = 4  # threads writing finished groups (and failures) to Redis


class TaskFailed(RuntimeError):
    """The task could not be rolled out now; it is retried (and dead-lettered in the end)."""


class SandboxCheck:
    """Whether the sandbox can serve tool calls, asked at most once per `ttl_s` however many consumer
    threads ask, and a wait that backs off (`backoff_s` doubling up to `max_backoff_s`) while it cannot."""

    def __init__(
        self, probe: Callable[[], bool], *, ttl_s: float = 2.0, backoff_s: float = 0.5, max_backoff_s: float = 10.0
    ) -> None:
        self.probe = probe
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.probes = 0  # checks made
        self._lock = threading.Lock()
        self._checked_at = -math.inf
        self._up = True

    def up(self) -> bool:
        """The last answer while younger than `ttl_s`, else a new check (one thread checks, the others wait)."""
        with self._lock:
            if time.monotonic() - self._checked_at >= self.ttl_s:
                was_up, self._up = self._up, self._probe()
                self._checked_at = time.monotonic()
                self.probes += 1
                if was_up and not self._up:
                    log.warning("sandbox unreachable; taking no tasks until it answers")
                elif self._up and not was_up:
                    log.info("sandbox reachable again; taking tasks")
            return self._up

    def wait_until_up(self, stop: threading.Event) -> bool:
        """Block until the sandbox is up (True) or `stop` is set (False)."""
        delay = self.backoff_s
        while not stop.is_set():
            if self.up():
                return True
            stop.wait(delay)
            delay = min(2 * delay, self.max_backoff_s)
        return False

    def _probe(self) -> bool:
        try:
            return bool(self.probe())
        except Exception as exc:  # noqa: BLE001 - a check that cannot run says the sandbox is down
            log.warning("sandbox check failed", extra={"error": f"{type(exc).__name__}: {exc}"})
            return False


class RolloutWorker:
    def __init__(
        self,
        service: RolloutService,
        client: redis.Redis,
        loop: asyncio.AbstractEventLoop,
        *,
        names: StreamNames | None = None,
        consumer: str | None = None,
        max_inflight_episodes: int = 16,
        claim_idle_ms: int = 120_000,
        max_deliveries: int = 3,
        block_ms: int = 500,
        sandbox: SandboxCheck | None = None,
    ) -> None:
        self.service = service
        self.client = client
        self.loop = loop
        self.names = names or StreamNames(get_settings().stream_prefix)
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.slots = EpisodeSlots(max_inflight_episodes)
        self._reserved = 0  # episodes of tasks claimed whose group has not begun on the loop yet
        self._lock = threading.Lock()
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.block_ms = block_ms
        self.sandbox = sandbox or SandboxCheck(lambda: self._on_loop(service.tools.reachable()))
        self.stop = threading.Event()
        self.waiting_for: int | None = None  # the version this worker waits for before taking tasks
        self.handled = 0
        self.on_fatal: Any = None  # called when a consumer thread dies (main() stops the loop)
        self.fatal = False  # stopped because something broke: main() exits non-zero (`exit_status`)
        # a weight receive that timed out or failed leaves an engine nothing here can mend: stop
        service.on_fatal = lambda reason: self._stop_for_restart()

    # -- one task ----------------------------------------------------------------------------

    def _on_loop(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def accept(self, consumer: StreamConsumer, msg: StreamMessage) -> RolloutTask | None:
        """The task `msg` carries, once the weights it needs are loaded (TaskFailed: not now); None when
        it is no task (dead-lettered at once: no retry can make it one)."""
        try:
            task = RolloutTask.model_validate(msg.data)
        except ValidationError as exc:
            msg.deliveries = max(msg.deliveries, consumer.max_deliveries)
            reason = f"not a RolloutTask: {exc.errors()[:3]}"
            _settle(consumer, msg, lambda: consumer.fail(msg, reason), self.stop)
            return None
        announced = self.sync_weights()
        if announced is not None and self.service.loaded_version is None:
            raise TaskFailed(
                f"weights v{announced.version} are announced but not loaded: this worker holds only "
                "the model it was started with"
            )
        if self.service.engine.policy_version < task.min_policy_version:
            raise TaskFailed(
                f"task needs policy version ≥ {task.min_policy_version}; loaded {self.service.engine.policy_version}"
            )
        return task

    async def _rollout(self, task: RolloutTask) -> list[Trajectory]:
        """The task's group on the loop; its reserved episodes become slot holders or waiters now."""
        with self._lock:
            self._reserved -= task.group_size
        return await self.service.rollout(task, self.slots)

    def admits(self) -> bool:
        """Whether to claim another task: the episodes running, waiting for a slot and claimed but not
        yet begun are fewer than the budget (a task may start with one free slot; the rest follow)."""
        with self._lock:
            reserved = self._reserved
        return self.slots.used + self.slots.waiting + reserved < self.slots.capacity

    def checked(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """A finished group, or TaskFailed when every sample failed (stopping a broken engine's worker)."""
        if trajectories and all(t.finish_reason == "engine_error" for t in trajectories):
            if not self.service.engine.healthy:
                log.error(
                    "the engine is broken; stopping the worker for a restart",
                    extra={"error": (trajectories[0].error or "")[:500]},
                )
                self._stop_for_restart()
            raise TaskFailed(f"every sample failed: {trajectories[0].error}")
        return trajectories

    def _stop_for_restart(self) -> None:
        """Stop the process, which main() then ends with status 1: the supervisor (the RL controller,
        Kubernetes) starts a fresh one, and the other workers claim this one's pending tasks meanwhile."""
        self.fatal = True
        self.stop.set()
        if self.on_fatal:
            self.on_fatal()

    @property
    def exit_status(self) -> int:
        """The process's exit status once stopped: STUCK_EXIT when a weight transfer left the engine
        stuck, 1 for another failure, 0 for a plain stop."""
        if not self.fatal:
            return 0
        return STUCK_EXIT if self.service.fatal else 1

    def sync_weights(self) -> WeightsUpdate | None:
        """Load the announced version unless a published version at least as new is loaded: the model
        the worker was started with counts as none, so a run's version 0 (its starting weights, which
        an external fleet's workers were not started on) is loaded too. Returns the announcement (None:
        none, or Redis unavailable)."""
        try:
            raw = self.client.get(self.names.weights_latest)
        except REDIS_DOWN:
            return None  # Redis restarting: keep the loaded weights; the version check below the call still holds
        if not raw:
            return None
        try:
            update = WeightsUpdate.model_validate_json(raw)
        except ValidationError:
            log.warning("ignoring an unreadable weights announcement", extra={"key": self.names.weights_latest})
            return None
        loaded = self.service.loaded_version
        if loaded is not None and update.version <= loaded and not self.service.broken:
            return update
        try:
            self._on_loop(self.service.update_weights(update))
        except WeightsError as exc:
            log.error("announced weights not loadable", extra={"version": update.version, "error": exc.message})
        return update

    def newest_version(self) -> int:
        """The newest version the learner recorded (`weights:version`, written over NCCL); 0 when
        none is recorded or Redis does not answer (the claim loop waits for Redis itself)."""
        try:
            raw = self.client.get(self.names.weights_version)
        except REDIS_DOWN:
            return 0
        try:
            return int(raw) if raw else 0
        except ValueError:
            return 0

    def weights_ready(self) -> bool:
        """Whether the engine can serve the fleet's tasks: whole (no broadcast failed halfway) and
        holding the newest version, after loading newer files where some exist."""
        if not self.service.healthy:
            log.error(
                "the engine cannot serve again; stopping the worker for a restart",
                extra={"error": (self.service.fatal or "engine unhealthy")[:500]},
            )
            self._stop_for_restart()
            return False
        needed = self.newest_version()
        if self.service.engine.policy_version < needed or self.service.broken:
            self.sync_weights()  # a whole version from files mends a failed load
        ready = self.service.broken is None and self.service.engine.policy_version >= needed
        if ready and self.waiting_for is not None:
            log.info("weights in place; taking tasks", extra={"version": self.service.engine.policy_version})
        elif not ready and self.waiting_for is None:
            log.warning(
                "taking no task until the learner's weights arrive",
                extra={"loaded": self.service.engine.policy_version, "needed": needed, "broken": self.service.broken},
            )
        self.waiting_for = None if ready else needed
        if not ready:
            self._ask_for_weights(needed)
        return ready

    def _ask_for_weights(self, needed: int) -> None:
        """Ask the learner to send its current version again (`weights:wanted`, for a minute): it
        answers while it waits for data, which a fleet whose only worker restarted never sends it."""
        try:
            self.client.set(self.names.weights_wanted, needed, ex=60)
        except REDIS_DOWN:
            pass

    def wait_for_weights(self, interval_s: float = 0.5) -> bool:
        """Block until `weights_ready` (True) or `stop` is set (False)."""
        while not self.stop.is_set():
            if self.weights_ready():
                return True
            self.stop.wait(interval_s)
        return False

    def ready(self) -> bool:
        """The claim loop's gate: the sandbox answers and the weights are in place."""
        return self.sandbox.wait_until_up(self.stop) and self.wait_for_weights()

    # -- running -----------------------------------------------------------------------------

    def _watch_weights(self, interval_s: float = 0.5) -> None:
        """An engine that loads in place (vLLM) takes each announced version as it comes, while its
        turns are in flight, instead of at its next task."""
        while not self.stop.wait(interval_s):
            try:
                self.sync_weights()
            except Exception as exc:  # noqa: BLE001 - the next poll tries again; tasks check the version too
                log.warning("weights watch failed", extra={"error": f"{type(exc).__name__}: {exc}"})

    def _consume(self) -> None:
        try:
            consumer = until_redis(
                lambda: StreamConsumer(
                    self.client,
                    self.names.tasks,
                    GROUP,
                    f"{self.consumer}-0",
                    claim_idle_ms=self.claim_idle_ms,
                    max_deliveries=self.max_deliveries,
                ),
                self.stop,
                "joining the rollout group",
            )
            if consumer is not None:
                self._claim_loop(consumer)
        except Exception:
            # A claim thread that died would leave a live process doing nothing: stop the
            # process instead, so its supervisor restarts it (its pending tasks are re-read then).
            log.exception("rollout consumer failed; stopping the worker")
            self._stop_for_restart()

    def _claim_loop(self, consumer: StreamConsumer) -> None:
        """Claim tasks while the episode budget admits one and the gates are open; each runs on the
        loop and is settled (written and acknowledged, or failed) by a settling thread when it ends."""
        keeper = ClaimKeeper(consumer.client, consumer.claim_idle_ms, self.stop)
        settling = ThreadPoolExecutor(SETTLE_THREADS, thread_name_prefix="rollout-settle")
        trimmed_at = 0.0
        try:
            while not self.stop.is_set():
                if not self.admits():
                    self.stop.wait(ADMIT_POLL_S)
                    continue
                if not self.ready():
                    continue
                try:
                    messages = consumer.read(1, self.block_ms)
                    if time.monotonic() - trimmed_at >= TRIM_EVERY_S:
                        trimmed_at = time.monotonic()
                        trim_consumed(consumer.client, consumer.stream)
                except REDIS_DOWN as exc:
                    log.warning("redis unavailable; retrying", extra={"error": str(exc)})
                    self.stop.wait(1.0)
                    continue
                for msg in messages:
                    self._start_task(consumer, keeper, settling, msg)
        finally:
            keeper.close()
            settling.shutdown(wait=False)

    def _start_task(
        self, consumer: StreamConsumer, keeper: ClaimKeeper, settling: ThreadPoolExecutor, msg: StreamMessage
    ) -> None:
        keeper.hold(consumer, msg)
        try:
            task = self.accept(consumer, msg)
        except Exception as exc:  # noqa: BLE001 - recorded on the message: retried, then dead-lettered
            log.warning("task not started", extra={"id": msg.id, "error": f"{type(exc).__name__}: {exc}"})
            reason = f"{type(exc).__name__}: {exc}"
            _settle(consumer, msg, lambda: consumer.fail(msg, reason), self.stop)
            keeper.release(msg)
            return
        if task is None:
            keeper.release(msg)
            return
        with self._lock:
            self._reserved += task.group_size
        group = asyncio.run_coroutine_threadsafe(self._rollout(task), self.loop)
        group.add_done_callback(lambda done: settling.submit(self._settle_task, consumer, keeper, msg, done))

    def _settle_task(self, consumer: StreamConsumer, keeper: ClaimKeeper, msg: StreamMessage, group: Future) -> None:
        """Write a finished group and acknowledge its task in one transaction, or record the failure."""
        try:
            trajectories = self.checked(group.result())
        except Exception as exc:  # noqa: BLE001 - any failure is recorded on the message
            log.warning("task failed", extra={"id": msg.id, "error": f"{type(exc).__name__}: {exc}"})
            reason = f"{type(exc).__name__}: {exc}"
            _settle(consumer, msg, lambda: consumer.fail(msg, reason), self.stop)
        else:
            _settle(consumer, msg, lambda: consumer.forward(msg, self.names.trajectories, trajectories), self.stop)
            self.handled += 1
            log.info("group written", extra=group_summary(trajectories))
        finally:
            keeper.release(msg)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._consume, name="rollout-claim", daemon=True)]
        if not self.service.engine.drains_on_update:
            threads.append(threading.Thread(target=self._watch_weights, name="rollout-weights", daemon=True))
        for t in threads:
            t.start()
        return threads


def group_summary(trajectories: list[Trajectory]) -> dict[str, Any]:
    """A written group in one log line: its id and step, how its episodes ended, the policy versions
    that sampled them and its slowest episode's seconds (what a stalled step's groups are traced by)."""
    if not trajectories:
        return {"episodes": 0}
    first = trajectories[0]
    ends: dict[str, int] = {}
    for t in trajectories:
        ends[t.finish_reason] = ends.get(t.finish_reason, 0) + 1
    slowest = max((t.timings.get("total_s", 0.0) for t in trajectories), default=0.0)
    return {
        "group": first.group_id,
        "step": first.step,
        "episodes": len(trajectories),
        "finish": ends,
        "versions": sorted({t.policy_version for t in trajectories}),
        "slowest_s": round(slowest, 1),
    }


@dataclass
class HttpFace:
    """The worker's rollout API (`STAR_ROLLOUT_HTTP_PORT`): a uvicorn server running as a task on the
    worker's event loop, beside the engine it serves."""

    server: Any
    task: asyncio.Task
    url: str

    def close(self, loop: asyncio.AbstractEventLoop, timeout_s: float = 10.0) -> None:
        """Stop serving (the loop itself stopped already): requests in flight get `timeout_s`."""
        self.server.should_exit = True
        loop.run_until_complete(asyncio.wait({self.task}, timeout=timeout_s))
        if not self.task.done():
            self.task.cancel()


def serve_http(
    loop: asyncio.AbstractEventLoop, service: RolloutService, settings: Settings, config: RolloutConfig
) -> HttpFace | None:
    """Serve the rollout API on `service` when `config.http_port` is set, returning once it listens
    (a port that cannot be bound ends the process, as uvicorn does); None when no port is set."""
    if config.http_port is None:
        return None
    from services.rollout.app import embedded_server

    server = embedded_server(service, settings, config.http_host, config.http_port)
    task = loop.create_task(server.serve())

    async def listening() -> None:
        while not server.started and not task.done():
            await asyncio.sleep(0.02)

    loop.run_until_complete(listening())
    if task.done():
        task.result()  # what stopped it
        raise RuntimeError(f"the rollout API on port {config.http_port} stopped as it started")
    url = f"http://{config.http_host}:{config.http_port}"
    log.info("rollout API serving", extra={"url": url})
    return HttpFace(server, task, url)


def main(settings: Settings | None = None, config: RolloutConfig | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT."""
    from services.common.logging import configure_logging
    from services.common.redis import connect_redis

    settings = settings or get_settings()
    config = config or RolloutConfig()
    configure_logging("rollout-worker", settings.log_level, settings.log_json)
    # a worker killed outright (SIGKILL, or os._exit after a stuck transfer) would leave its engine's own
    # processes (vLLM's engine core) holding the GPU its restarted successor needs
    from services.common.reaper import guard_descendants

    guard_descendants()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    budget = inflight_budget(config, config.model or settings.model)
    config = engine_for_budget(config, budget)

    async def build() -> RolloutService:
        return RolloutService.from_settings(settings, config)

    service = loop.run_until_complete(build())
    if not settings.redis_url:
        raise SystemExit("STAR_REDIS_URL is not set: a worker joins the fleet's Redis")
    client, _ = connect_redis(settings.redis_url)
    worker = RolloutWorker(
        service,
        client,
        loop,
        names=StreamNames(settings.stream_prefix),
        consumer=config.consumer,
        max_inflight_episodes=budget,
        claim_idle_ms=config.claim_idle_ms,
        max_deliveries=config.max_deliveries,
    )
    http = serve_http(loop, service, settings, config)
    if http is not None:  # the app configured logging as its own service's
        configure_logging("rollout-worker", settings.log_level, settings.log_json)

    def shutdown(*_: Any) -> None:
        worker.stop.set()
        if http is not None:
            http.server.should_exit = True
        loop.call_soon_threadsafe(loop.stop)

    def stop_for_restart(*_: Any) -> None:
        # an engine stuck in a weight transfer may never shut down, nor free the loop: the process ends
        # after FATAL_EXIT_S regardless, from this timer's thread
        ender = threading.Timer(FATAL_EXIT_S, lambda: os._exit(worker.exit_status))
        ender.daemon = True  # a shutdown that does finish exits at once
        ender.start()
        shutdown()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    worker.on_fatal = stop_for_restart
    threads = worker.start()
    log.info(
        "rollout worker running",
        extra={
            "consumer": worker.consumer,
            "max_inflight_episodes": worker.slots.capacity,
            "max_num_seqs": config.vllm.max_num_seqs,
        },
    )
    loop.run_forever()
    for t in threads:
        t.join(timeout=5)
    if http is not None:
        http.close(loop)
    loop.run_until_complete(service.close())
    if worker.fatal:
        raise SystemExit(worker.exit_status)


def cli(argv: list[str] | None = None) -> None:
    """`python -m services.rollout.worker [--config FILE]`: a worker on the settings in FILE (and STAR_ROLLOUT_*)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m services.rollout.worker", description=cli.__doc__)
    ap.add_argument("--config", help="JSON (or YAML) file of rollout settings; STAR_ROLLOUT_* fill the rest")
    args = ap.parse_args(argv)
    try:
        config = load_rollout_config(args.config)
    except RolloutConfigError as exc:
        ap.exit(2, f"error: {exc}\n")
    main(config=config)


if __name__ == "__main__":
    cli()
