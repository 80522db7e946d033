"""A real RL stage (Redis, sandbox, rollout, reward and learner processes) with faults injected
while it runs, and the ledger that says afterwards whether anything was lost or trained twice.

The stage is `star train`'s own (services.controller.train.train with stages synth → rl); the test
wraps the controller's `drive` loop so a chaos thread gets the live Fleet (its process handles
and Redis). The streams are trimmed as they are consumed, so the ledger is kept by an `Audit`: one
more consumer group on each stream, created before the first task, that records every entry and
acknowledges it at once (trimming waits for every group, the audit's included).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from services.common.streams import StreamNames, decode, ensure_group, stream_depth, trim_consumed
from services.pipeline.config import PipelineConfig

STEPS, PROMPTS, G = 3, 2, 2


def tiny_rl_config(name: str) -> PipelineConfig:
    """The smallest RL stage that still has several steps, groups and a checkpoint to resume."""
    return PipelineConfig.model_validate(
        {
            "name": name,
            "seed": 0,
            "stages": ["synth", "rl"],
            "model": {"tiny": {"hidden": 64, "layers": 1, "heads": 1, "kv_heads": 1, "tokenizer": "travel"}},
            "world": {"source": "synthetic", "synthetic_size": "tiny"},
            "synth": {"sft_queries": 0, "rl_queries": 6, "val_queries": 0},
            "rl": {
                "algorithm": "grpo",
                "epochs": 1,
                "batch_prompts": PROMPTS,
                "group_size": G,
                "max_steps": STEPS,
                "lr": 1e-4,
                "reward": "sum",
                "sampling": {
                    "temperature": 1.0,
                    "max_tokens_per_turn": 32,
                    "max_context_tokens": 8192,
                    "max_tool_calls": 3,
                },
            },
            "services": {"engine": "transformers", "rollout_workers": 1, "reward_workers": 1, "zero_stage": 0},
        }
    )


def kill_group(pid: int) -> None:
    """SIGKILL one process of the fleet (they share one process group: killpg would take them all)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_pending(client: redis.Redis, stream: str, group: str) -> int:
    try:
        return stream_depth(client, stream, group)["pending"]
    except redis.RedisError:
        return 0


@dataclass
class Ledger:
    """What the streams and the learner's files say once every step has been trained."""

    tasks: list[str] = field(default_factory=list)  # task ids published
    trajectories: list[tuple[str, int]] = field(default_factory=list)  # (task id, sample) rolled out
    scored: list[tuple[str, int]] = field(default_factory=list)  # (task id, sample) scored
    scored_ids: list[str] = field(default_factory=list)  # scored stream entry ids
    dead: dict[str, int] = field(default_factory=dict)
    depth: dict[str, dict[str, int]] = field(default_factory=dict)
    length: dict[str, int] = field(default_factory=dict)  # entries left in each stream (trimmed: 0)
    weights_version: int = 0


AUDIT = "audit"


class Audit:
    """Records every entry of the pipeline's streams through a consumer group of its own."""

    def __init__(self, client: redis.Redis, names: StreamNames) -> None:
        self.client = client
        self.streams = (names.tasks, names.trajectories, names.scored)
        self.entries: dict[str, list[tuple[str, dict[str, Any]]]] = {s: [] for s in self.streams}
        self._seen: set[tuple[str, str]] = set()
        self._pending_first = False  # after a Redis error: entries delivered in a lost reply are pending
        for stream in self.streams:
            ensure_group(self.client, stream, AUDIT, "0")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="audit", daemon=True)
        self._thread.start()

    def drain(self) -> int:
        """Read and acknowledge what has arrived; returns how many entries. After a Redis error the
        auditor's own pending entries are read first: a reply lost to the restart left them delivered
        to it but never recorded (or recorded but not acknowledged: each entry is kept once)."""
        n = 0
        starts = ("0", ">") if self._pending_first else (">",)
        for stream in self.streams:
            for start in starts:
                reply = self.client.xreadgroup(AUDIT, "auditor", {stream: start}, count=1000)
                for entry, fields in reply[0][1] if reply else []:
                    if fields is None:
                        continue
                    if (stream, entry) not in self._seen:
                        self._seen.add((stream, entry))
                        self.entries[stream].append((entry.decode(), decode(fields)))
                    self.client.xack(stream, AUDIT, entry)
                    n += 1
        self._pending_first = False
        return n

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.drain():
                    self._stop.wait(0.05)
            except redis.RedisError:
                self._pending_first = True
                self._stop.wait(0.2)  # Redis restarting: the group resumes where it was

    def finish(self) -> None:
        self._stop.set()
        self._thread.join(10)
        while True:
            try:
                if not self.drain():
                    return
            except redis.RedisError:
                self._pending_first = True
                time.sleep(0.2)


def read_ledger(client: redis.Redis, names: StreamNames, audit: Audit) -> Ledger:
    audit.finish()
    led = Ledger()
    led.tasks = [d["task_id"] for _, d in audit.entries[names.tasks]]
    led.trajectories = [(d["task_id"], d["sample_index"]) for _, d in audit.entries[names.trajectories]]
    scored = audit.entries[names.scored]
    led.scored = [(d["task_id"], d["sample_index"]) for _, d in scored]
    led.scored_ids = [i for i, _ in scored]
    for stream in (names.tasks, names.trajectories, names.scored):
        led.dead[stream] = client.xlen(StreamNames.dead(stream))
    for stream, group in ((names.tasks, "rollout"), (names.trajectories, "reward"), (names.scored, "learner")):
        led.depth[group] = stream_depth(client, stream, group)
        trim_consumed(client, stream)
        led.length[stream] = client.xlen(stream)
    raw = client.get(names.weights_latest)
    led.weights_version = json.loads(raw)["version"] if raw else 0
    return led


Fault = Callable[["ChaosContext"], str | None]


@dataclass
class ChaosContext:
    fleet: Any  # services.controller.fleet.Fleet
    client: redis.Redis
    names: StreamNames
    stop: threading.Event

    def wait_for(self, condition: Callable[[], bool], timeout: float, poll: float = 0.01) -> bool:
        deadline = time.monotonic() + timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                if condition():
                    return True
            except redis.RedisError:
                pass
            time.sleep(poll)
        return False

    def worker(self, prefix: str):
        return next(w for w in self.fleet.workers if w.name.startswith(prefix))

    def version(self) -> int:
        raw = self.client.get(self.names.weights_latest)
        return json.loads(raw)["version"] if raw else 0


@dataclass
class ChaosRun:
    """Runs train() with `fault` acting on the live fleet; keeps what it saw."""

    fault: Fault
    events: list[str] = field(default_factory=list)
    ledger: Ledger | None = None
    restarts: dict[str, int] = field(default_factory=dict)
    error: BaseException | None = None

    def install(self, monkeypatch) -> None:
        from services.controller import loop

        original = loop.drive

        def drive(run, f, client, names, publisher, schedule, **kwargs):
            ctx = ChaosContext(f, client, names, threading.Event())
            audit = Audit(client, names)

            def act() -> None:
                try:
                    note = self.fault(ctx)
                    if note:
                        self.events.append(note)
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    self.error = exc

            thread = threading.Thread(target=act, name="chaos", daemon=True)
            thread.start()
            try:
                ended = original(run, f, client, names, publisher, schedule, **kwargs)
            finally:
                ctx.stop.set()
                thread.join(30)
            self.ledger = read_ledger(client, names, audit)
            self.restarts = {w.name: w.restarts for w in f.workers}
            self.restarts["learner"] = f.learner.restarts if f.learner else 0
            self.restarts["redis"] = f.redis_proc.restarts
            self.restarts["sandbox"] = f.sup.children["sandbox"].restarts
            return ended

        monkeypatch.setattr(loop, "drive", drive)


def learner_checkpoint_state(rl_folder: Path) -> dict[str, Any]:
    """The client state of the learner's latest checkpoint (step, version, consumed ids)."""
    import torch

    ckpt = rl_folder / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    state = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: state[k] for k in ("step", "version", "consumed", "batches") if k in state}


def metrics_lines(rl_folder: Path) -> list[dict[str, Any]]:
    path = rl_folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_nothing_lost_or_trained_twice(run_folder: Path, ledger: Ledger) -> None:
    """Every task's G trajectories were scored exactly once, and the learner trained each once."""
    expected_tasks = STEPS * PROMPTS
    assert len(ledger.tasks) == len(set(ledger.tasks)) == expected_tasks, ledger.tasks
    want = Counter((t, i) for t in ledger.tasks for i in range(G))
    scored = Counter(ledger.scored)
    assert scored == want, f"scored stream differs: missing {want - scored}, extra {scored - want}"
    # a rollout or reward worker killed mid-message must not leave a duplicate upstream either
    assert Counter(ledger.trajectories) == want, Counter(ledger.trajectories) - want
    assert all(n == 0 for n in ledger.dead.values()), ledger.dead
    for group, depth in ledger.depth.items():
        # (Redis cannot always tell a group's lag; everything delivered is counted above instead)
        assert depth["pending"] == 0, (group, depth)
    # bounded state: once every group has acknowledged everything, trimming leaves nothing
    assert all(n == 0 for n in ledger.length.values()), ledger.length

    rl = run_folder / "rl"
    lines = metrics_lines(rl)
    steps = [m["step"] for m in lines]
    assert sorted(steps) == list(range(1, STEPS + 1)), f"metrics.jsonl steps {steps}: each step once"
    assert sum(m["samples_in"] for m in lines) == expected_tasks * G
    assert ledger.weights_version == STEPS == lines[-1]["version"]
    state = learner_checkpoint_state(rl)
    assert state["step"] == STEPS and state["version"] == STEPS
    consumed = [i for ids in state["consumed"] for i in ids]
    assert len(consumed) == len(set(consumed)) == expected_tasks * G, "a scored message was trained twice"
    assert set(consumed) == set(ledger.scored_ids)
