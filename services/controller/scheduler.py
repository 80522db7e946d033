"""The RL task schedule: which prompts each step rolls out, and when they may be published.

Step s (0-based) belongs to epoch `s // steps_per_epoch + 1`; each epoch visits the prompt set
in a fresh seeded order and drops the last partial batch (1K prompts / 32 = 31 steps, 155 over
5 epochs, as in the paper). Policy version v is the number of optimizer steps done, so step s is
trained into version s + 1. With `max_staleness = k`, step s may be published once version
s - k is out: k = 0 is synchronous on-policy RL, k ≥ 1 lets rollout run ahead of the learner.
Version 0 is the starting model: rollout workers started on it sample the first steps as they are;
for workers started on another model (an external fleet), the learner announces it as a version
and no step goes out before that (`await_start_weights`).
The next step to publish lives in Redis, so a restarted controller neither skips nor repeats one.
Over-sampling (`oversample_groups`) publishes that many more prompts a step (the next ones of the
epoch's order, wrapping around): the learner trains the first `batch_prompts` groups to complete
and the surplus at a later step, or drops it (services/learner/groups.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import redis

from services.common.schemas import ArpoParams, RolloutTask, SamplingParams, TravelQuery
from services.common.streams import StreamNames
from services.reward.rewards import Curriculum


@dataclass(frozen=True)
class Schedule:
    prompts: tuple[TravelQuery, ...]
    batch_prompts: int
    group_size: int
    epochs: int
    seed: int = 0
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("the RL prompt set is empty")
        if self.batch_prompts < 1 or self.group_size < 1 or self.epochs < 1:
            raise ValueError("batch_prompts, group_size and epochs must be at least 1")

    @property
    def steps_per_epoch(self) -> int:
        return max(1, len(self.prompts) // self.batch_prompts)

    @property
    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.epochs
        return min(total, self.max_steps) if self.max_steps else total

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch + 1

    def batch(self, step: int, extra: int = 0) -> list[tuple[int, TravelQuery]]:
        """(index in the prompt set, query) of the prompts rolled out at `step`, and `extra` more (the
        prompts after them in the epoch's order, wrapping around: over-sampling)."""
        if not 0 <= step < self.total_steps:
            raise IndexError(f"step {step} is outside 0..{self.total_steps - 1}")
        epoch = self.epoch_of(step)
        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        start = (step % self.steps_per_epoch) * self.batch_prompts
        want = self.batch_prompts + extra
        picked = [order[(start + k) % len(order)] for k in range(want)]  # fewer prompts than that: wrap around
        return [(i, self.prompts[i]) for i in picked]


def publishable(step: int, progress: int, max_staleness: int) -> bool:
    """May step `step` be rolled out once the learner has consumed `progress` batches?"""
    return progress >= step - max_staleness


@dataclass
class TaskPublisher:
    """Publishes each step's RolloutTasks exactly once, paced by the published policy version."""

    client: redis.Redis
    names: StreamNames
    run_id: str
    schedule: Schedule
    sampling: SamplingParams
    reward_kind: str = "sum"
    preference_penalty: float = 0.0
    curriculum: Curriculum | None = None
    eval_mode: str = "strict"
    max_staleness: int = 0
    arpo: ArpoParams | None = None
    # publish nothing until a weights version is announced: the learner's starting weights, which rollout
    # workers started on another model (an external fleet's) load before they sample the first step
    await_start_weights: bool = False
    oversample_groups: int = 0  # prompts published a step beyond the batch

    @property
    def _cursor_key(self) -> str:
        return f"{self.names.prefix}:run:{self.run_id}:next_step"

    def next_step(self) -> int:
        raw = self.client.get(self._cursor_key)
        return int(raw) if raw else 0

    def tasks(self, step: int, min_version: int | None = None) -> list[RolloutTask]:
        """The step's tasks. `min_version`: the oldest weights that may sample them (default: the
        version the schedule expects, step - max_staleness; the controller passes the version
        actually published, which lags when the learner skipped a step without an update)."""
        epoch = self.schedule.epoch_of(step)
        kind = self.reward_kind
        if kind == "curriculum" and self.curriculum is not None:
            kind = self.curriculum.kind_for(epoch, step)  # resolved here, so the scorer needs no schedule
        base_seed = self.sampling.seed if self.sampling.seed is not None else 0
        out = []
        for slot, (index, query) in enumerate(self.schedule.batch(step, self.oversample_groups)):
            task_id = f"{self.run_id}/s{step:05d}/p{slot:03d}"
            sampling = self.sampling.model_copy(update={"seed": base_seed + (step * 1000 + slot) * 1000})
            out.append(
                RolloutTask(
                    run_id=self.run_id,
                    task_id=task_id,
                    prompt_id=query.id or f"prompt-{index}",
                    query=query,
                    group_size=self.schedule.group_size,
                    sampling=sampling,
                    epoch=epoch,
                    step=step,
                    reward_kind=kind,
                    preference_penalty=self.preference_penalty,
                    eval_mode=self.eval_mode,
                    arpo=self.arpo,
                    min_policy_version=max(0, step - self.max_staleness) if min_version is None else min_version,
                )
            )
        return out

    def publish_ready(self, progress: int, version: int | None = None) -> list[int]:
        """Publish every step that the learner's progress (batches consumed) now allows; returns
        the steps published. `version` is the weights version the fleet has now."""
        published: list[int] = []
        if self.await_start_weights and not self.client.exists(self.names.weights_latest):
            return published
        step = self.next_step()
        while step < self.schedule.total_steps and publishable(step, progress, self.max_staleness):
            pipe = self.client.pipeline(transaction=True)
            for task in self.tasks(step, version):
                pipe.xadd(self.names.tasks, {b"payload": task.model_dump_json().encode()})
            pipe.set(self._cursor_key, step + 1)
            pipe.execute()
            published.append(step)
            step += 1
        return published

    def done_publishing(self) -> bool:
        return self.next_step() >= self.schedule.total_steps
