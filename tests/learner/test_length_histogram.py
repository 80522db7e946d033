"""The trajectory-length histogram each RL step's metrics carry (services/learner/trainer.py length_histogram)."""

from __future__ import annotations

from types import SimpleNamespace

from services.learner.trainer import TOKEN_BUCKETS, length_histogram


def test_each_trajectory_counts_once_in_the_smallest_bucket_that_holds_it():
    trajs = [SimpleNamespace(token_ids=[0] * n) for n in (10, 1024, 1025, 9000, 30_000, 40_000, 40_001)]
    hist = length_histogram(trajs)
    assert sum(hist.values()) == len(trajs)
    assert hist["trajectory_tokens/le_1024"] == 2 and hist["trajectory_tokens/le_2048"] == 1
    assert hist["trajectory_tokens/le_16384"] == 1 and hist["trajectory_tokens/le_32768"] == 1
    assert hist["trajectory_tokens/over"] == 2 and hist["trajectory_tokens/le_4096"] == 0
    assert len(hist) == len(TOKEN_BUCKETS) + 1
