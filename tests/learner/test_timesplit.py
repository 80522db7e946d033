"""An RL step's wall time split into rollout, scoring, training, sync and idle (services/learner/timesplit.py)."""

from __future__ import annotations

import pytest

from services.learner.timesplit import SPLIT_KEYS, step_split, stream_seconds


def test_stream_ids_are_milliseconds():
    assert stream_seconds("1700000000123-4") == pytest.approx(1_700_000_000.123)
    assert stream_seconds("not-an-id") is None


def test_the_wait_splits_at_the_last_episode_and_the_last_score():
    # waited 10 s until t=110: the last episode ended at 106, its score arrived at 108
    split = step_split(
        wall_s=20.0,
        wait_s=10.0,
        waited_until=110.0,
        episode_ends=[101.0, 106.0],
        scored_at=[103.0, 108.0],
        training_s=7.0,
        sync_s=2.0,
    )
    assert split["split_rollout_s"] == pytest.approx(6.0)
    assert split["split_scoring_s"] == pytest.approx(2.0)
    assert split["split_idle_s"] == pytest.approx(3.0)  # 2 s of the wait after the last score, 1 s outside it
    assert sum(split[k] for k in SPLIT_KEYS) == pytest.approx(split["time_step_wall_s"]) == pytest.approx(20.0)


def test_episodes_ended_before_the_wait_are_not_the_steps_rollout():
    # asynchronous: the step's episodes all ended while the learner trained the previous step
    split = step_split(
        wall_s=9.0, wait_s=1.0, waited_until=100.0, episode_ends=[90.0], scored_at=[99.5], training_s=6.0, sync_s=1.0
    )
    assert split["split_rollout_s"] == 0.0
    assert split["split_scoring_s"] == pytest.approx(0.5)
    assert split["split_idle_s"] == pytest.approx(1.5)


def test_no_stamps_leave_the_wait_idle():
    split = step_split(
        wall_s=5.0, wait_s=3.0, waited_until=50.0, episode_ends=[None], scored_at=[], training_s=1.5, sync_s=0.5
    )
    assert split["split_rollout_s"] == split["split_scoring_s"] == 0.0
    assert split["split_idle_s"] == pytest.approx(3.0)
