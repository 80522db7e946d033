"""Over-sampling and late groups at the learner: a step takes its first complete groups, the surplus
trains later or is dropped with a count, and groups cut at their deadline go as `late_groups` says."""

from __future__ import annotations

import json

import pytest

from services.learner.config import FilterConfig
from services.learner.groups import JOURNAL
from tests.learner.test_groups import _groups, _pending, _send, _traj, stream  # noqa: F401 - the fixture


def _cut(group: str, index: int, **kw):
    return _traj(group, index, **kw).model_copy(update={"finish_reason": "deadline"})


def _journal(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / JOURNAL).read_text().splitlines()]


def test_the_surplus_of_a_step_trains_at_the_next_while_fresh(stream):
    client, prefix, make = stream
    collector = make(oversample_groups=1, filters=FilterConfig(max_staleness=1))
    _send(client, prefix, _traj("c", 0), _traj("c", 1), _traj("a", 0), _traj("a", 1), _traj("b", 0), _traj("b", 1))
    first = collector.collect(batch=0, version=0)
    assert _groups(first) == ["c", "a"] and first.counts["groups_surplus_trained"] == 0
    _send(client, prefix, _traj("d", 0, step=1, version=1), _traj("d", 1, step=1, version=1))
    second = collector.collect(batch=1, version=1)
    assert _groups(second) == ["b", "d"]  # the surplus first: the oldest step's groups go first
    assert second.counts["groups_surplus_trained"] == 1 and second.dropped == []


def test_a_surplus_group_too_stale_to_train_is_dropped_counted_and_settled(stream, tmp_path):
    client, prefix, make = stream
    collector = make(oversample_groups=1)  # max_staleness 0: a step-0 group is stale at version 1
    _send(client, prefix, *(_traj(g, i) for g in "abc" for i in range(2)))
    collector.collect(batch=0, version=0)
    _send(client, prefix, *(_traj(g, i, step=1, version=1) for g in "de" for i in range(2)))
    step = collector.collect(batch=1, version=1)
    assert _groups(step) == ["d", "e"]
    assert step.dropped == ["c"] and step.counts["groups_surplus_dropped"] == 1
    # its messages go with the step's, to be acknowledged with them; it is journaled as dropped
    assert sorted(m.data["group_id"] for m in step.messages) == ["c", "c", "d", "d", "e", "e"]
    assert _journal(tmp_path)[-1] == {"batch": 1, "groups": ["d", "e"], "lost": [], "dropped": ["c"]}
    assert "c" not in collector.groups


def test_without_over_sampling_a_stale_group_still_takes_its_place(stream):
    # the filters count it (samples_stale) as before: only an over-sampled surplus is dropped up front
    client, prefix, make = stream
    collector = make()
    _send(client, prefix, *(_traj(g, i) for g in "abc" for i in range(2)))
    collector.collect(batch=0, version=0)
    _send(client, prefix, *(_traj(g, i, step=1, version=1) for g in "de" for i in range(2)))
    assert _groups(collector.collect(batch=1, version=1)) == ["c", "d"]


@pytest.mark.parametrize(
    "policy, groups, samples, counts",
    [
        ("drop", ["b", "c"], 4, {"groups_late": 1, "groups_dropped_late": 1, "groups_partial": 0, "episodes_cut": 1}),
        (
            "partial",
            ["a", "b"],
            3,
            {"groups_late": 1, "groups_dropped_late": 0, "groups_partial": 1, "episodes_cut": 1},
        ),
        ("mask", ["a", "b"], 4, {"groups_late": 1, "groups_dropped_late": 0, "groups_partial": 0, "episodes_cut": 1}),
    ],
)
def test_a_late_group_goes_as_the_policy_says(stream, policy, groups, samples, counts):
    client, prefix, make = stream
    collector = make(late_groups=policy, oversample_groups=1)
    _send(client, prefix, _traj("a", 0), _cut("a", 1), *(_traj(g, i) for g in "bc" for i in range(2)))
    step = collector.collect(batch=0, version=0)
    assert _groups(step) == groups and len(step.trajectories) == samples
    assert {k: step.counts[k] for k in counts} == counts
    assert ("a" in step.dropped) == (policy == "drop")


def test_a_dropped_late_group_needs_no_replacement_beyond_the_surplus(stream):
    # without over-sampling a step whose late group is dropped goes without it, as with a lost group
    client, prefix, make = stream
    collector = make(late_groups="drop", wait_timeout_s=2.0)
    _send(client, prefix, _cut("a", 0), _traj("a", 1), _traj("b", 0), _traj("b", 1))
    step = collector.collect(batch=0, version=0)
    assert _groups(step) == ["b"] and step.dropped == ["a"]


def test_a_late_group_with_every_episode_cut_is_settled_as_dropped_under_partial(stream):
    client, prefix, make = stream
    collector = make(late_groups="partial")
    _send(client, prefix, _cut("a", 0), _cut("a", 1), _traj("b", 0), _traj("b", 1))
    step = collector.collect(batch=0, version=0)
    assert _groups(step) == ["b"] and step.dropped == ["a"] and step.counts["groups_dropped_late"] == 1


def test_a_replayed_batch_drops_the_groups_its_journal_dropped(stream, tmp_path):
    client, prefix, make = stream
    _send(client, prefix, _cut("a", 0), _traj("a", 1), *(_traj(g, i) for g in "bc" for i in range(2)))
    before = make(late_groups="drop", oversample_groups=1).collect(batch=0, version=0)
    again = make(late_groups="drop", oversample_groups=1)
    again.load_journal(from_batch=0)
    replayed = again.collect(batch=0, version=0)
    assert _groups(replayed) == _groups(before) == ["b", "c"] and replayed.dropped == ["a"]
    assert sorted(m.id for m in replayed.messages) == sorted(m.id for m in before.messages)
    assert _pending(client, prefix) == 6  # acknowledged only once a checkpoint holds the batch


@pytest.mark.slow
def test_the_learner_counts_late_and_surplus_groups_in_its_step_metrics(tmp_path, tiny_model, redis_server_url):
    import uuid

    import redis

    from services.common.streams import StreamNames, publish
    from services.learner.runlog import read_metrics
    from tests.learner.conftest import scored_batch
    from tests.learner.test_resume import _config, _run

    client = redis.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    step0 = scored_batch(tiny_model, 3, 2, seed=0, version=0, step=0)  # one group more than the batch
    step0[1] = step0[1].model_copy(update={"finish_reason": "deadline"})
    step1 = scored_batch(tiny_model, 2, 2, seed=1, version=1, step=1)
    try:
        for t in step0 + step1:
            publish(client, StreamNames(prefix).scored, t)
        config = _config(
            tmp_path, "tail", tiny_model, redis_server_url, prefix, oversample_groups=1, late_groups="partial"
        )
        done = _run(config, 2)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = read_metrics(tmp_path / "tail")
        assert [m["samples_trained"] for m in metrics] == [3.0, 4.0]  # the cut episode left step 0
        assert [(m["groups_late"], m["groups_partial"], m["episodes_cut"]) for m in metrics] == [(1, 1, 1), (0, 0, 0)]
        # step 0's surplus group is one version stale at step 1 (max_staleness 0): dropped, counted
        assert [m["groups_surplus_dropped"] for m in metrics] == [0.0, 1.0]
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)
