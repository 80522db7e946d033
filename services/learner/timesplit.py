"""Where an RL step's wall time went: rollout, scoring, training, sync and idle.

The learner sees its step as a wait for data, then training, then the weights' sync. The wait is split
by two stamps its data carries: when each episode ended (the agent's `timings["ended_at"]`, wall clock)
and when its score entered the scored stream (the Redis stream id's milliseconds). Within the wait, the
time until the step's last episode ended is rollout, from then until its last score arrived is scoring,
and the rest (reading and decoding the stream, waiting on nothing the step needed) is idle. Under
asynchronous RL most of a step's rollout ran while the learner trained the step before: only what the
learner waited for counts, so the five parts add up to the step's wall time (`time_step_wall_s`).
"""

from __future__ import annotations

from collections.abc import Iterable

SPLIT_KEYS = ("split_rollout_s", "split_scoring_s", "split_training_s", "split_sync_s", "split_idle_s")


def stream_seconds(message_id: str) -> float | None:
    """The wall-clock second a Redis stream entry was added (its id's milliseconds), None if unreadable."""
    ms, _, _ = str(message_id).partition("-")
    return int(ms) / 1000 if ms.isdigit() else None


def step_split(
    *,
    wall_s: float,
    wait_s: float,
    waited_until: float,
    episode_ends: Iterable[float],
    scored_at: Iterable[float],
    training_s: float,
    sync_s: float,
) -> dict[str, float]:
    """The step's wall time in five parts that add up to `wall_s`. `waited_until` is the wall-clock
    second the wait for data ended; `episode_ends` and `scored_at` are the step's episodes' end stamps
    and their scores' arrival stamps (either may be empty: that part is then 0 and its time idle)."""
    start = waited_until - wait_s
    ends = [t for t in episode_ends if t is not None]
    scored = [t for t in scored_at if t is not None]
    rollout = min(max(max(ends) - start, 0.0), wait_s) if ends else 0.0
    scoring = min(max(max(scored) - (start + rollout), 0.0), wait_s - rollout) if scored else 0.0
    idle = max(wall_s - rollout - scoring - training_s - sync_s, 0.0)
    return {
        "split_rollout_s": rollout,
        "split_scoring_s": scoring,
        "split_training_s": training_s,
        "split_sync_s": sync_s,
        "split_idle_s": idle,
        "time_step_wall_s": rollout + scoring + training_s + sync_s + idle,
    }
