"""Group sampling: G trajectories of one prompt, concurrently, plus ARPO branching.

Plain groups run G independent episodes at once (asyncio), sample i seeded `seed + i`. Given
`EpisodeSlots` (a worker's budget of episodes in flight on its engine), each episode waits for a
slot and gives it back when it ends, so the slots of a group's finished episodes go to other
groups while its slowest one runs (an ARPO group, which branches as it goes, holds G slots).

Deadlines: each episode ends as `deadline` past `SamplingParams.episode_timeout_s` from its start,
or past the group's `group_timeout_s` from the group's start, whichever comes first.

ARPO (agent-star.md §4.6, after the RUC-NLPIR reference): `initial_rollouts` episodes start from
scratch; the other G − initial slots are filled by branches. Episodes advance in rounds of one
turn each. Each turn is sampled with top-`top_logprobs` log-probs, and its entropy H is the mean
normalised entropy of its first `entropy_tokens` tokens; the first H of an episode is its
H_init. After a round in which an episode made a tool call, for each of `beam_size − 1` possible
branches while slots are free, draw U ~ U(0,1) and branch when
`clip(U − entropy_weight·(H − H_init), 0, 1) ≤ branch_probability`: a turn that was more
uncertain than the episode's start branches more often. A branch copies the ids, mask, log-probs
and tool counter at that point (the tool response included) and continues with its own seed.
When no episode is active and slots remain, a new episode starts from scratch.
Branches record `arpo_parent` and `arpo_branch_token` in their timings.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from services.common.schemas import ArpoParams, SamplingParams, Trajectory, TravelQuery
from services.rollout.agent import Agent, Episode, Limits, to_trajectory

# The task payload carries it, so it lives with the other stream contracts.
ArpoConfig = ArpoParams


@dataclass
class GroupMeta:
    run_id: str = "adhoc"
    task_id: str = "adhoc"
    prompt_id: str = "adhoc"
    epoch: int = 1
    step: int | None = None
    reward_kind: str = "sum"
    preference_penalty: float = 0.0
    eval_mode: str = "strict"

    def fields(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "task_id": self.task_id,
            "prompt_id": self.prompt_id,
            # One group per task: the same prompt rolled out at two steps (or twice in one
            # wrapped-around batch) must never merge into one group at the learner.
            "group_id": self.task_id,
            "epoch": self.epoch,
            "step": self.step,
            "reward_kind": self.reward_kind,
            "preference_penalty": self.preference_penalty,
            "eval_mode": self.eval_mode,
        }


class EpisodeSlots:
    """A budget of episodes in flight at once, shared by the groups on one engine (FIFO). `used` and
    `waiting` are plain counters a claim thread may read to decide whether to take another task."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an episode budget must be at least 1, not {capacity}")
        self.capacity = capacity
        self.used = 0
        self.waiting = 0  # episodes waiting for a slot
        self._sem: asyncio.Semaphore | None = None  # made on the engine's loop, at first use

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def admits(self) -> bool:
        """Whether a new group could start an episode now (nothing waits and a slot is free)."""
        return self.waiting == 0 and self.used < self.capacity

    @asynccontextmanager
    async def hold(self, n: int = 1) -> AsyncIterator[None]:
        n = min(n, self.capacity)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.capacity)
        self.waiting += n
        taken = 0
        try:
            for _ in range(n):
                await self._sem.acquire()
                taken += 1
                self.waiting -= 1
                self.used += 1
            yield
        finally:
            self.waiting -= n - taken
            self.used -= taken
            for _ in range(taken):
                self._sem.release()


def sample_seed(sampling: SamplingParams, index: int) -> int | None:
    return None if sampling.seed is None else sampling.seed + index


async def sample_group(
    agent: Agent,
    query: TravelQuery | str,
    group_size: int,
    sampling: SamplingParams,
    limits: Limits | None = None,
    *,
    arpo: ArpoConfig | None = None,
    meta: GroupMeta | None = None,
    slots: EpisodeSlots | None = None,
) -> list[Trajectory]:
    """G trajectories of `query`, ordered by sample index."""
    limits = limits or Limits.from_sampling(sampling)
    meta = meta or GroupMeta()
    request = uuid.uuid4().hex[:12]
    group_deadline = None if sampling.group_timeout_s is None else time.monotonic() + sampling.group_timeout_s
    if arpo is None:
        episodes = [agent.start(query, i, sample_seed(sampling, i)) for i in range(group_size)]

        async def run(ep: Episode) -> None:
            async with _slot(slots, 1):
                ep.arm(limits, group_deadline)
                await agent.run_episode(ep, sampling, limits, request)

        await asyncio.gather(*(run(ep) for ep in episodes))
    else:
        async with _slot(slots, group_size):
            episodes = await _arpo(agent, query, group_size, sampling, limits, arpo, request, group_deadline)
    q = query if isinstance(query, TravelQuery) else None
    return [to_trajectory(ep, q, **meta.fields()) for ep in sorted(episodes, key=lambda e: e.sample_index)]


@asynccontextmanager
async def _slot(slots: EpisodeSlots | None, n: int) -> AsyncIterator[None]:
    if slots is None:
        yield
    else:
        async with slots.hold(n):
            yield


async def _arpo(
    agent: Agent,
    query: TravelQuery | str,
    group_size: int,
    sampling: SamplingParams,
    limits: Limits,
    cfg: ArpoConfig,
    request: str,
    group_deadline: float | None = None,
) -> list[Episode]:
    rng = random.Random(cfg.seed if cfg.seed is not None else sampling.seed)
    initial = min(group_size, cfg.initial_rollouts or max(1, group_size // 2))
    episodes = [agent.start(query, i, sample_seed(sampling, i)) for i in range(initial)]
    for ep in episodes:
        ep.arm(limits, group_deadline)

    def new_index() -> int:
        return len(episodes)

    while True:
        active = [ep for ep in episodes if not ep.done]
        if not active:
            if len(episodes) >= group_size:
                break
            episodes.append(agent.start(query, new_index(), sample_seed(sampling, new_index())))
            episodes[-1].arm(limits, group_deadline)
            continue
        before = {id(ep): ep.tool_calls for ep in active}
        await asyncio.gather(
            *(
                agent.step(ep, sampling, limits, f"{request}-{ep.sample_index}", top_logprobs=cfg.top_logprobs)
                for ep in active
            )
        )
        for ep in active:
            if ep.done or ep.tool_calls == before[id(ep)]:
                continue
            for _ in range(cfg.beam_size - 1):
                if len(episodes) >= group_size:
                    break
                if should_branch(rng.random(), ep.last_entropy, ep.initial_entropy, cfg):
                    index = new_index()
                    episodes.append(ep.fork(index, sample_seed(sampling, index)))
    return episodes


def should_branch(u: float, entropy: float | None, initial: float | None, cfg: ArpoConfig) -> bool:
    delta = 0.0 if entropy is None or initial is None else entropy - initial
    p = min(1.0, max(0.0, u - cfg.entropy_weight * delta))
    return p <= cfg.branch_probability
