"""From the scored stream to one RL step's groups (rank 0 of the learner).

`GroupCollector` reads `<prefix>:scored`, files each sample under its group, drops what must not be
trained (copies of a sample, groups already trained, payloads that are no ScoredTrajectory), notes
the groups whose rollout task was dead-lettered (lost), and decides when a step has its groups:
complete ones, its own step's first, enough of them to survive the staleness and DAPO filters.
Each step's choice goes to the journal (`journal.jsonl` in the run folder) before it is trained, so
a learner killed after the step replays exactly that batch. `TrainedRecord` is what every rank
keeps of the batches trained (message and group ids) and what the checkpoint holds of them.

Over-sampling (`oversample_groups`): the controller publishes more groups a step than it trains, so a
step takes its first `batch_prompts` complete groups; the surplus is taken by the next steps (oldest
step first) while fresh enough, and a surplus group too stale to train (every sample older than
`max_staleness` allows) is dropped before any step takes it. A group of a later step taken by an earlier
batch (after `straggler_wait_s`) counts towards its own step, which then does not wait for it again.

Dead letters are read beside the stream: a rollout task dead-lettered loses its whole group (the step
goes without it), and a sample dead-lettered before it reached the learner (the scorer could not score
it, or it is no trajectory) leaves its group complete without it. A step never waits for what cannot
come.

Late groups (episodes cut at their deadline, finish_reason `deadline`) go as `late_groups` says: dropped
(the step takes another group instead), trained with their finished episodes only (partial), or kept
whole (mask: the filters leave the cut episodes out of the loss). A dropped group is journaled with its
step, its messages are held and acknowledged with the step's, and it is recorded as settled like a
trained one: no group is trained twice, and none leaves without a count (`StepGroups.counts`).

Acknowledging is the trainer's call: the collector holds the messages of the batches it handed out
until `acknowledge_held`, which the trainer calls once a checkpoint holds those batches. Meanwhile it
keeps their claims fresh (`keep_held`), and those of the samples filed under groups still waiting, so
however long the checkpoint interval or the steps, they are neither re-claimed nor dead-lettered as
messages whose consumer died.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from services.common.schemas import ScoredTrajectory
from services.common.streams import REDIS_DOWN, StreamConsumer, StreamMessage, StreamNames, as_text, decode, until_redis
from services.learner import algorithms as alg
from services.learner.config import RLConfig

log = logging.getLogger(__name__)

CONSUMED_STEPS_KEPT = 16  # steps whose message ids stay in the checkpoint for de-duplication (at least save_every)
JOURNAL = "journal.jsonl"
HELD_CLAIMED_AT_ONCE = 1000  # message ids per XCLAIM when the held messages' claims are renewed
WAIT_REPORT_S = 60.0  # a step waiting for its groups longer than this says, every as long, what it waits for

Member = tuple[StreamMessage, ScoredTrajectory]


class NoData(TimeoutError):
    """No (complete) group arrived within the configured wait."""


class WeightsWanted(Exception):
    """A rollout server asked for the learner's current weights while the learner waited for data
    (`GroupCollector.weights_wanted`): the learner sends them, then collects the step again."""


@dataclass
class TrainedRecord:
    """The batches trained so far: the message ids of the last `keep` steps (a message trained but
    not yet acknowledged comes back after a restart, and is recognised by id) and the group ids of
    every step (a task rolled out again publishes its group under new ids, however late)."""

    keep: int = CONSUMED_STEPS_KEPT
    consumed: list[list[str]] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)

    @classmethod
    def kept_steps(cls, save_every: int) -> int:
        """Steps of message ids to keep: every step since the last checkpoint at least."""
        return max(CONSUMED_STEPS_KEPT, save_every + 1)

    def add(self, message_ids: list[str], groups: list[str]) -> None:
        self.consumed = (self.consumed + [list(message_ids)])[-self.keep :]
        self.groups = self.groups + [list(groups)]

    def restore(self, state: dict[str, Any]) -> None:
        """Take the record from a checkpoint's state."""
        self.consumed = [list(ids) for ids in state.get("consumed", [])]
        self.groups = [list(ids) for ids in state.get("groups", [])]

    def message_ids(self) -> set[str]:
        return {i for ids in self.consumed for i in ids}

    def group_ids(self) -> set[str]:
        return {g for ids in self.groups for g in ids}


LATE = "deadline"  # the finish reason of an episode cut at its deadline


@dataclass
class StepGroups:
    """One step's batch as rank 0 collected it: the messages and their trajectories (group by group),
    the ids of the groups it goes without because their task was lost, the time it waited, the groups
    it dropped (late or stale surplus: their messages are among `messages`, their samples are not
    trained) and the counts of late and surplus groups."""

    messages: list[StreamMessage]
    trajectories: list[ScoredTrajectory]
    lost: list[str]
    wait_s: float
    dropped: list[str] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)


def is_late(members: list[Member]) -> bool:
    return any(t.finish_reason == LATE for _, t in members)


class GroupCollector:
    """Rank 0's reader of the scored stream: `collect(batch, version)` returns the step's groups."""

    def __init__(
        self, cfg: RLConfig, redis_client: Any, trained: TrainedRecord, stop: threading.Event | None = None
    ) -> None:
        self.cfg = cfg
        self.redis = redis_client
        self.trained = trained
        self.stop = stop or threading.Event()
        self.names = StreamNames(cfg.stream_prefix)
        self.consumer = StreamConsumer(
            redis_client,
            self.names.scored,
            cfg.consumer_group,
            cfg.consumer_name,
            claim_idle_ms=600_000,
            max_deliveries=10,
        )
        self.journal = Path(cfg.output_dir) / JOURNAL
        self.groups: OrderedDict[str, list[Member]] = OrderedDict()  # arrived, not yet in a batch
        # Groups whose rollout task was dead-lettered (it failed on every attempt): group id → step.
        # A batch does not wait for them: they can never come, and the fleet would wait with it.
        self.lost: dict[str, int] = {}
        # Samples dead-lettered on their way (scoring failed for good): group id → their sample indexes.
        self.unscored: dict[str, set[int]] = {}
        self._dead_cursors: dict[str, str] = {}  # dead-letter stream → the last entry read
        self.taken_early: dict[int, int] = {}  # step → its groups that earlier batches trained
        self.duplicates = 0  # samples of already trained groups dropped since `take_duplicates`
        self.held: list[str] = []  # ids of the messages handed out since the last acknowledgement
        self._held_kept_at = time.monotonic()  # when the held messages' claims were last renewed
        self.replay: dict[int, dict[str, Any]] = {}  # journaled batches after the checkpoint, by number
        # polled while waiting: True when a rollout server asked for the weights (set with NCCL sync)
        self.weights_wanted: Callable[[], bool] | None = None

    @property
    def stream(self) -> str:
        return self.consumer.stream

    # -- journal -----------------------------------------------------------------------------------

    def load_journal(self, from_batch: int) -> None:
        """The batches journaled from `from_batch` on (those after the checkpoint), to replay."""
        if not self.journal.is_file():
            return
        for line in self.journal.read_text().splitlines():
            try:
                entry = json.loads(line)
                batch = int(entry["batch"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a kill
            if batch >= from_batch:
                self.replay[batch] = entry

    @property
    def replaying(self) -> bool:
        """Batches journaled since the checkpoint are still to be trained again."""
        return bool(self.replay)

    def _write_journal(self, batch: int, chosen: list[str], lost: list[str], dropped: list[str]) -> None:
        with open(self.journal, "a") as fh:
            fh.write(json.dumps({"batch": batch, "groups": chosen, "lost": lost, "dropped": dropped}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    # -- the step's groups -------------------------------------------------------------------------

    def collect(self, batch: int, version: int) -> StepGroups:
        """The groups of step batch `batch` for a learner at `version`: the journaled ones when the
        batch is replayed, else complete groups by `candidates` until `enough`. Raises NoData when
        stopped or when nothing comes for `wait_timeout_s`, and WeightsWanted when a rollout server
        asks for the weights meanwhile (nothing of the step is taken yet: it is collected again)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        chosen: list[str] = []
        dropped_late: list[str] = []  # late groups left out under late_groups "drop"
        dropped_stale: list[str] = []  # surplus groups of earlier steps too stale to train
        useful = 0
        started = time.monotonic()
        deadline = started + cfg.wait_timeout_s
        plan = self.replay.pop(batch, None)  # a batch trained before the last kill, to train again
        report_at = started + WAIT_REPORT_S
        while True:
            if self.weights_wanted is not None and self.weights_wanted():
                if plan is not None:
                    self.replay[batch] = plan
                raise WeightsWanted()
            self.read_lost(batch)
            if plan is not None:
                if self._arrived(plan["groups"]):
                    chosen = list(plan["groups"])
                    dropped_late = [g for g in plan.get("dropped", []) if g in self.groups]
                    break
            else:
                dropped_stale += self.stale_surplus(batch, version, chosen + dropped_stale)
                for g in self.candidates(batch, time.monotonic() - started):
                    if (
                        g in chosen
                        or g in dropped_late
                        or g in dropped_stale
                        or self.enough(batch, chosen, useful, len(dropped_late))
                    ):
                        continue
                    if cfg.late_groups == "drop" and is_late(self.groups[g]):
                        dropped_late.append(g)
                        continue
                    chosen.append(g)
                    useful += self.useful(self.groups[g], version)
                if self.enough(batch, chosen, useful, len(dropped_late)):
                    break
            if self.stop.is_set():
                raise NoData("stopped while waiting for data")
            if time.monotonic() > deadline:
                raise NoData(f"no complete group arrived within {cfg.wait_timeout_s:.0f} s")
            if time.monotonic() >= report_at:
                report_at += WAIT_REPORT_S
                log.info("a step is waiting for its groups", extra=self.waiting_for(batch, chosen, started))
            self.read_stream()
        # this step's lost groups are settled now (a late copy of one is dropped like a re-run)
        lost = list(plan["lost"]) if plan is not None else [g for g, s in self.lost.items() if s <= batch]
        for g in lost:
            self.lost.pop(g, None)
        dropped = dropped_late + dropped_stale  # and below, late groups with no finished episode
        if plan is None:
            self._write_journal(batch, chosen, lost, dropped)
        counts = {
            "groups_late": float(len(dropped_late) + sum(is_late(self.groups[g]) for g in chosen)),
            "groups_dropped_late": float(len(dropped_late)),
            "groups_partial": 0.0,
            "episodes_cut": float(
                sum(t.finish_reason == LATE for g in chosen + dropped_late for _, t in self.groups[g])
            ),
            "groups_surplus_dropped": float(len(dropped_stale)),
            "groups_surplus_trained": float(sum(self._step_of(g) < batch for g in chosen)),
            "groups_from_later_steps": float(self._count_taken_early(batch, chosen)),
            "samples_unscored": float(sum(len(self._unscored_of(g)) for g in chosen)),
        }
        messages, trajs = [], []
        for g in chosen:
            members = self.groups.pop(g)
            partial = cfg.late_groups == "partial" and is_late(members)
            counts["groups_partial"] += partial
            kept = [traj for _, traj in members if not (partial and traj.finish_reason == LATE)]
            messages += [msg for msg, _ in members]
            trajs += kept
            if not kept:  # every episode cut: nothing to train, settled as dropped
                dropped.append(g)
                counts["groups_dropped_late"] += 1
        for g in dropped_late + dropped_stale:
            messages += [msg for msg, _ in self.groups.pop(g)]
        for g in chosen + dropped_late + dropped_stale:
            self.unscored.pop(g, None)
        return StepGroups(messages, trajs, lost, time.perf_counter() - t0, dropped, counts)

    def waiting_for(self, batch: int, chosen: list[str], started: float) -> dict[str, Any]:
        """What a step that is still waiting has and lacks: its chosen groups, its own step's groups with
        samples missing (the first few named, with how many arrived), complete groups of later steps
        (taken once `straggler_wait_s` has passed), and the groups lost."""
        own_partial = {g: len(m) for g, m in self.groups.items() if not self._complete(g) and self._step_of(g) <= batch}
        later = [g for g in self.complete() if self._step_of(g) > batch]
        return {
            "batch": batch,
            "waited_s": round(time.monotonic() - started),
            "chosen": len(chosen),
            "wanted": self.cfg.batch_prompts,
            "own_groups_partial": len(own_partial),
            "partial_samples": dict(list(own_partial.items())[:5]),
            "later_groups_complete": len(later),
            "lost": self._lost_at(batch),
            "unscored_samples": sum(map(len, self.unscored.values())),
            "taken_early": self.taken_early.get(batch, 0),
            "straggler_wait_s": self.cfg.straggler_wait_s,
            **self._stream_state(),
        }

    def _stream_state(self) -> dict[str, Any]:
        """The scored stream as Redis sees it beside what this collector filed: samples filed and held,
        messages pending for the learner's group, and whether entries wait undelivered (a sample that
        is in Redis but neither filed nor undelivered was read and lost on the way)."""
        state: dict[str, Any] = {"filed": sum(len(m) for m in self.groups.values()), "held": len(self.held)}
        try:
            c = self.consumer
            state["pending"] = int(c.client.xpending(c.stream, c.group)["pending"])
            info = c.client.xinfo_stream(c.stream)
            group = next(g for g in c.client.xinfo_groups(c.stream) if as_text(g["name"]) == c.group)
            state["undelivered"] = as_text(info["last-generated-id"]) != as_text(group["last-delivered-id"])
        except (*REDIS_DOWN, StopIteration, KeyError, redis.ResponseError):
            pass  # the report goes without them
        return state

    def stale_surplus(self, batch: int, version: int, seen: list[str]) -> list[str]:
        """Complete groups of earlier steps (over-sampling's surplus) none of whose samples the staleness
        filter would keep at `version`: dropped rather than taking a place in the batch."""
        if not self.cfg.oversample_groups:
            return []
        f = self.cfg.filters
        return [
            g
            for g in self.complete()
            if g not in seen
            and self._step_of(g) < batch
            and not alg.split_stale([t.policy_version for _, t in self.groups[g]], version, f.max_staleness)[0]
        ]

    def complete(self) -> list[str]:
        """The groups that have all their samples (less those dead-lettered on the way), in arrival order."""
        return [g for g in self.groups if self._complete(g)]

    def _complete(self, group: str) -> bool:
        members = self.groups.get(group, [])
        if not members:
            return False
        arrived = {t.sample_index for _, t in members}
        return len(arrived | self._unscored_of(group)) >= self.cfg.group_size

    def _unscored_of(self, group: str) -> set[int]:
        return self.unscored.get(group, set())

    def _arrived(self, groups: list[str]) -> bool:
        return all(self._complete(g) for g in groups)

    def _count_taken_early(self, batch: int, chosen: list[str]) -> int:
        """Note the later steps' groups this batch took (returns how many); forget the counts of steps
        now past."""
        later = [step for g in chosen if (step := self._step_of(g)) > batch]
        for step in later:
            self.taken_early[step] = self.taken_early.get(step, 0) + 1
        self.taken_early = {s: n for s, n in self.taken_early.items() if s > batch}
        return len(later)

    def _step_of(self, group: str) -> int:
        step = self.groups[group][0][1].step
        return -1 if step is None else step

    def candidates(self, batch: int, waited_s: float) -> list[str]:
        """Complete groups batch `batch` may take, oldest step first. A later step's groups wait
        while this step's are still coming: with several steps in flight the later step's fast
        groups finish first, and taken now they would leave this step's slow groups to the next
        batch, one version staler and, at the staleness bound, dropped (up to half of a
        batch's samples). After `straggler_wait_s`, or when refilling (DAPO reads beyond the
        step), any complete group goes, so a lost group cannot stall the run."""
        complete = sorted(self.complete(), key=self._step_of)  # stable: arrival order within a step
        if self.cfg.filters.refill or waited_s >= self.cfg.straggler_wait_s:
            return complete
        return [g for g in complete if self._step_of(g) <= batch]

    def useful(self, members: list[Member], version: int) -> bool:
        """Would this group survive the staleness and DAPO filters at `version`? (Refill reads until
        enough do.)"""
        f = self.cfg.filters
        trajs = [t for _, t in members]
        if not alg.split_stale([t.policy_version for t in trajs], version, f.max_staleness)[0]:
            return False
        if f.dynamic_sampling:
            rewards = [alg.effective_reward(t.reward, t.finish_reason, f.zero_reward_finish_reasons) for t in trajs]
            return not alg.is_flat(rewards, f.zero_variance_eps)
        return True

    def enough(self, batch: int, chosen: list[str], useful: int, dropped: int = 0) -> bool:
        """Without refill a step takes the next `batch_prompts` groups (filters may shrink it), less
        those of its own that were lost, dropped late or trained by an earlier batch beyond the
        over-sampled surplus; with refill it reads on until that many groups survive, at most
        max_refill_rounds batches more."""
        n, f = self.cfg.batch_prompts, self.cfg.filters
        if not f.refill:
            missing = self._lost_at(batch) + dropped + self.taken_early.get(batch, 0)
            missing = max(0, missing - self.cfg.oversample_groups)
            return len(chosen) + missing >= n
        if useful >= n:
            return True
        return f.max_refill_rounds > 0 and len(chosen) >= n * (1 + f.max_refill_rounds)

    # -- lost groups -------------------------------------------------------------------------------

    def _lost_at(self, step: int) -> int:
        return sum(1 for s in self.lost.values() if s == step)

    def read_lost(self, batch: int) -> None:
        """Note what was dead-lettered since the last look: training tasks of step `batch` or later (their
        groups are lost) and samples that failed on their way here for good (scoring, or not a trajectory):
        their groups complete without them, and a group with none left is lost."""
        for task in self._dead_since(self.names.tasks):
            group, step = task.get("task_id"), task.get("step")
            if isinstance(step, int) and step >= batch and group not in self.groups:
                self.lost[group] = step
                log.warning(
                    "a rollout task was dead-lettered; its step goes without it", extra={"group": group, "step": step}
                )
        trained = None
        for stream in (self.names.trajectories, self.names.scored):
            for sample in self._dead_since(stream):
                group, index, step = sample.get("group_id"), sample.get("sample_index"), sample.get("step")
                if not isinstance(group, str) or not isinstance(index, int):
                    continue  # not a sample of a group
                trained = self.trained.group_ids() if trained is None else trained
                if group in trained:
                    continue
                self.unscored.setdefault(group, set()).add(index)
                log.warning(
                    "a sample was dead-lettered on its way; its group goes without it",
                    extra={"group": group, "sample": index, "stream": stream},
                )
                gone = len(self.unscored[group]) >= self.cfg.group_size and group not in self.groups
                if gone and isinstance(step, int) and step >= batch:
                    self.lost[group] = step

    def _dead_since(self, stream: str) -> list[dict[str, Any]]:
        """The payloads dead-lettered from `stream` since the last call (none while Redis is down)."""
        dead = StreamNames.dead(stream)
        try:
            entries = self.redis.xrange(dead, min=f"({self._dead_cursors.get(dead, '0-0')}", count=1000)
        except REDIS_DOWN:
            return []
        payloads = []
        for entry, fields in entries:
            self._dead_cursors[dead] = as_text(entry)
            try:
                payload = decode(fields)["payload"]
            except (KeyError, TypeError, ValueError):
                continue
            if isinstance(payload, dict):
                payloads.append(payload)
        return payloads

    # -- reading the stream ------------------------------------------------------------------------

    def read_stream(self) -> int:
        """Read up to a batch's samples from the stream (waiting up to `read_block_ms`) and file them;
        returns how many messages came."""
        cfg = self.cfg
        try:
            self.keep_held()
            arrived = self.consumer.read(count=cfg.group_size * cfg.batch_prompts, block_ms=cfg.read_block_ms)
        except REDIS_DOWN as exc:
            # Redis restarting: what was read stays pending there, so wait and read on
            log.warning("redis unavailable; waiting for data", extra={"error": str(exc)})
            self.stop.wait(1.0)
            return 0
        seen = _Seen(self.trained.message_ids(), self.trained.group_ids(), set(self.held))
        for msg in arrived:
            self._file(msg, seen)
        return len(arrived)

    def _file(self, msg: StreamMessage, seen: _Seen) -> None:
        """File one message under its group, or settle it: acknowledged when it was trained already or
        is a copy, dead-lettered when it is no trajectory."""
        if msg.id in seen.held:
            return  # ours, held unacknowledged until the next checkpoint (re-claimed after idling)
        if msg.id in seen.messages:
            until_redis(lambda: self.consumer.ack(msg), what="acknowledging")  # trained before a crash
            return
        try:
            traj = ScoredTrajectory.model_validate(msg.data)
        except ValueError as exc:
            msg.deliveries = self.consumer.max_deliveries  # a bad payload never gets better
            self.consumer.fail(msg, f"not a ScoredTrajectory: {str(exc)[:500]}")
            return
        if traj.group_id in seen.groups:
            # the whole group was trained from another run of its task: acknowledged, dropped
            until_redis(lambda: self.consumer.ack(msg), what="acknowledging a re-run group")
            self.duplicates += 1
            return
        members = self.groups.setdefault(traj.group_id, [])
        same = next((m for m, t in members if t.sample_index == traj.sample_index), None)
        if same is not None:
            # The same sample again: our own pending message re-delivered after idling while we
            # waited (the copy we hold stands), or a task that ran twice (this copy is
            # acknowledged now, never trained).
            if same.id != msg.id:
                until_redis(lambda: self.consumer.ack(msg), what="acknowledging a duplicate")
            return
        members.append((msg, traj))

    # -- after the step ----------------------------------------------------------------------------

    def take_duplicates(self) -> int:
        """Samples of already trained groups dropped since the last call."""
        n, self.duplicates = self.duplicates, 0
        return n

    def hold(self, messages: list[StreamMessage]) -> None:
        """Keep these messages unacknowledged until the next checkpoint holds their batch."""
        self.held += [m.id for m in messages]

    def keep_held(self) -> int:
        """Renew the claims of the messages this learner keeps pending (XCLAIM JUSTID: the delivery
        count stays) once a third of the claim timeout has passed, before the read that would otherwise
        re-claim them: every XAUTOCLAIM counts a delivery, and after `max_deliveries` a message is
        dead-lettered. Kept are the held messages (trained, waiting for the next checkpoint: a long
        checkpoint interval would lose trained batches) and those filed under a group still waiting for
        its other samples or for a step (slow steps, surplus groups from over-sampling). Returns how
        many were renewed."""
        kept = self.held + self.waiting_ids()
        if not kept or time.monotonic() - self._held_kept_at < self.consumer.claim_idle_ms / 3000:
            return 0
        c = self.consumer
        for i in range(0, len(kept), HELD_CLAIMED_AT_ONCE):
            c.client.xclaim(
                c.stream,
                c.group,
                c.consumer,
                min_idle_time=0,
                message_ids=kept[i : i + HELD_CLAIMED_AT_ONCE],
                justid=True,
            )
        self._held_kept_at = time.monotonic()
        return len(kept)

    def waiting_ids(self) -> list[str]:
        """Ids of the messages filed under groups not yet in a batch."""
        return [msg.id for members in self.groups.values() for msg, _ in members]

    def acknowledge_held(self) -> None:
        """Acknowledge the messages held since the last call (a checkpoint holds their batches, so a
        learner that dies waiting for Redis here skips them by id on resume)."""
        if self.held:
            held = self.held
            until_redis(
                lambda: self.consumer.client.xack(self.consumer.stream, self.consumer.group, *held),
                what="acknowledging the messages since the last checkpoint",
            )
        self.held = []


@dataclass(frozen=True)
class _Seen:
    """What the messages of one read are de-duplicated against."""

    messages: set[str]  # ids of messages in trained batches
    groups: set[str]  # ids of trained (or lost) groups
    held: set[str]  # ids of our messages handed out and not yet acknowledged
