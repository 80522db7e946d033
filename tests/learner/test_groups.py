"""The learner's batch assembly on its own, against real Redis: which groups make a step, what is
dropped or acknowledged as a copy, lost groups, and the journal that replays a step exactly."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from services.common.schemas import RolloutTask, SamplingParams, Score, ScoredTrajectory, TravelQuery
from services.common.streams import StreamConsumer, StreamNames, publish
from services.learner.config import FilterConfig, RLConfig
from services.learner.groups import JOURNAL, GroupCollector, NoData, TrainedRecord


def _traj(
    group: str, index: int, *, step: int | None = 0, version: int = 0, reward: float | None = None
) -> ScoredTrajectory:
    return ScoredTrajectory(
        run_id="r",
        task_id=group,
        prompt_id=f"p-{group}",
        group_id=group,
        sample_index=index,
        policy_version=version,
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        finish_reason="answer",
        score=Score(),
        reward=float(index) if reward is None else reward,
        step=step,
    )


@pytest.fixture
def stream(redis_client, tmp_path):
    """(client, prefix, make): `make(**cfg)` builds a collector on a fresh prefix's scored stream."""
    client, prefix = redis_client
    prefix = prefix.rstrip(":")

    def make(trained: TrainedRecord | None = None, **kw) -> GroupCollector:
        defaults = {"group_size": 2, "batch_prompts": 2, "read_block_ms": 50, "wait_timeout_s": 5.0}
        cfg = RLConfig(model="m", output_dir=str(tmp_path), stream_prefix=prefix, **{**defaults, **kw})
        return GroupCollector(cfg, client, trained or TrainedRecord())

    return client, prefix, make


def _send(client, prefix: str, *trajs: ScoredTrajectory) -> list[str]:
    return [publish(client, StreamNames(prefix).scored, t) for t in trajs]


def _pending(client, prefix: str) -> int:
    return client.xpending(StreamNames(prefix).scored, "learner")["pending"]


def _groups(step) -> list[str]:
    return list(dict.fromkeys(t.group_id for t in step.trajectories))


def test_a_step_takes_complete_groups_and_leaves_a_partial_one_waiting(stream, tmp_path):
    client, prefix, make = stream
    collector = make()
    _send(client, prefix, _traj("a", 0), _traj("b", 0), _traj("a", 1), _traj("c", 0), _traj("c", 1))
    step = collector.collect(batch=0, version=0)
    assert _groups(step) == ["a", "c"]
    assert [(t.group_id, t.sample_index) for t in step.trajectories] == [("a", 0), ("a", 1), ("c", 0), ("c", 1)]
    assert [m.data["group_id"] for m in step.messages] == ["a", "a", "c", "c"]
    assert list(collector.groups) == ["b"]  # still waiting for its second sample
    journal = [json.loads(line) for line in (tmp_path / JOURNAL).read_text().splitlines()]
    assert journal == [{"batch": 0, "groups": ["a", "c"], "lost": [], "dropped": []}]
    # nothing is acknowledged until the trainer says a checkpoint holds the batch
    assert _pending(client, prefix) == 5
    collector.hold(step.messages)
    collector.acknowledge_held()
    assert _pending(client, prefix) == 1 and collector.held == []


def test_a_copy_of_a_sample_is_acknowledged_and_never_trained(stream):
    client, prefix, make = stream
    collector = make(batch_prompts=1)
    _send(client, prefix, _traj("a", 0), _traj("a", 0), _traj("a", 1))
    step = collector.collect(batch=0, version=0)
    assert [(t.group_id, t.sample_index) for t in step.trajectories] == [("a", 0), ("a", 1)]
    assert _pending(client, prefix) == 2  # the copy acknowledged, the batch's two held


def test_trained_groups_and_trained_messages_are_dropped(stream):
    client, prefix, make = stream
    first = _send(client, prefix, _traj("old", 0))
    trained = TrainedRecord()
    trained.add(first, ["old"])
    collector = make(trained=trained, batch_prompts=1)
    # a message trained before a crash (by id), a re-run of a trained group (new ids), a fresh group
    _send(client, prefix, _traj("old", 0), _traj("old", 1), _traj("new", 0), _traj("new", 1))
    step = collector.collect(batch=1, version=0)
    assert _groups(step) == ["new"]
    assert collector.take_duplicates() == 2 and collector.take_duplicates() == 0
    assert _pending(client, prefix) == 2  # the old message and the re-run acknowledged


def test_a_payload_that_is_no_trajectory_is_dead_lettered(stream):
    client, prefix, make = stream
    collector = make(batch_prompts=1)
    publish(client, StreamNames(prefix).scored, {"not": "a trajectory"})
    _send(client, prefix, _traj("a", 0), _traj("a", 1))
    assert _groups(collector.collect(batch=0, version=0)) == ["a"]
    assert client.xlen(StreamNames.dead(StreamNames(prefix).scored)) == 1


def test_a_batch_waits_for_its_own_step_and_takes_later_steps_after_the_straggler_wait(stream):
    client, prefix, make = stream
    collector = make(straggler_wait_s=60.0)
    # arrival order: step 2 complete, step 1 complete, step 1 incomplete, an unscheduled group, step 0
    _send(
        client,
        prefix,
        _traj("s2", 0, step=2),
        _traj("s2", 1, step=2),
        _traj("s1a", 0, step=1),
        _traj("s1a", 1, step=1),
        _traj("s1b", 0, step=1),
        _traj("adhoc", 0, step=None),
        _traj("adhoc", 1, step=None),
        _traj("s0", 0, step=0),
        _traj("s0", 1, step=0),
    )
    while collector.read_stream():
        pass
    assert collector.candidates(1, waited_s=0.0) == ["adhoc", "s0", "s1a"]  # oldest first; step 2 waits
    assert collector.candidates(1, waited_s=61.0) == ["adhoc", "s0", "s1a", "s2"]  # a lost group cannot stall it
    refill = make(filters=FilterConfig(refill=True))
    refill.groups = collector.groups
    assert refill.candidates(1, waited_s=0.0) == ["adhoc", "s0", "s1a", "s2"]


def test_a_step_waiting_long_says_which_of_its_groups_lack_samples(stream, monkeypatch, caplog):
    import services.learner.groups as groups_module

    client, prefix, make = stream
    collector = make(straggler_wait_s=60.0, wait_timeout_s=0.5)
    monkeypatch.setattr(groups_module, "WAIT_REPORT_S", 0.1)
    _send(
        client,
        prefix,
        _traj("s1a", 0, step=1),
        _traj("s1a", 1, step=1),
        _traj("s1b", 0, step=1),
        _traj("s2", 0, step=2),
        _traj("s2", 1, step=2),
    )
    with caplog.at_level("INFO", logger="services.learner.groups"), pytest.raises(NoData):
        collector.collect(batch=1, version=1)
    reports = [r for r in caplog.records if r.getMessage() == "a step is waiting for its groups"]
    assert reports, "no report while the step waited"
    last = reports[-1]
    assert (last.batch, last.chosen, last.wanted) == (1, 1, 2)
    assert last.own_groups_partial == 1 and last.partial_samples == {"s1b": 1}
    assert last.later_groups_complete == 1 and last.straggler_wait_s == 60.0
    # Redis beside the collector: every sample sent was delivered, filed and is pending
    assert (last.filed, last.held, last.pending, last.undelivered) == (5, 0, 5, False)


def test_refill_reads_past_a_stale_group_until_enough_groups_are_fresh(stream):
    client, prefix, make = stream
    collector = make(batch_prompts=1, filters=FilterConfig(refill=True, max_staleness=0, max_refill_rounds=3))
    _send(
        client,
        prefix,
        _traj("stale", 0, version=1),
        _traj("stale", 1, version=1),
        _traj("fresh", 0, version=2),
        _traj("fresh", 1, version=2),
    )
    step = collector.collect(batch=2, version=2)
    assert _groups(step) == ["stale", "fresh"]  # the stale group alone would leave the step empty
    assert not collector.useful([(None, t) for t in step.trajectories[:2]], version=2)
    assert collector.useful([(None, t) for t in step.trajectories[:2]], version=1)


def test_dapo_refill_counts_a_flat_group_as_useless(stream):
    client, prefix, make = stream
    collector = make(batch_prompts=1, filters=FilterConfig(refill=True, dynamic_sampling=True))
    _send(
        client,
        prefix,
        _traj("flat", 0, reward=1.0),
        _traj("flat", 1, reward=1.0),
        _traj("mixed", 0, reward=0.0),
        _traj("mixed", 1, reward=1.0),
    )
    assert _groups(collector.collect(batch=0, version=0)) == ["flat", "mixed"]


def _dead_letter_task(client, prefix: str, group: str, step: int) -> None:
    names = StreamNames(prefix)
    query = TravelQuery(
        org="Sarasota",
        dest="Chicago",
        days=3,
        visiting_city_number=1,
        date=["2022-03-22", "2022-03-23", "2022-03-24"],
        people_number=1,
        budget=1900,
        query="A trip.",
    )
    publish(
        client,
        names.tasks,
        RolloutTask(
            run_id="r", task_id=group, prompt_id="p", query=query, group_size=2, sampling=SamplingParams(), step=step
        ),
    )
    tasks = StreamConsumer(client, names.tasks, "rollout", "w", max_deliveries=1)
    (msg,) = tasks.read(count=1, block_ms=100)
    assert tasks.fail(msg, "every sample failed")


def test_a_step_goes_without_its_lost_group_at_once(stream, tmp_path):
    client, prefix, make = stream
    _dead_letter_task(client, prefix, "lost", step=0)
    _dead_letter_task(client, prefix, "later", step=1)  # another step's: not this one's business
    collector = make(straggler_wait_s=600.0, wait_timeout_s=30.0)
    _send(client, prefix, _traj("kept", 0), _traj("kept", 1))
    step = collector.collect(batch=0, version=0)
    assert _groups(step) == ["kept"] and step.lost == ["lost"]
    assert step.wait_s < 10  # not the straggler wait, nor the timeout
    assert collector.lost == {"later": 1}
    last = json.loads((tmp_path / JOURNAL).read_text().splitlines()[-1])
    assert last == {"batch": 0, "groups": ["kept"], "lost": ["lost"], "dropped": []}


def _dead_letter_sample(client, prefix: str, traj: ScoredTrajectory) -> None:
    """What the scoring stage does with a trajectory it can never score: dead-letters it."""
    names = StreamNames(prefix)
    publish(client, names.trajectories, traj.model_dump(mode="json"))
    scoring = StreamConsumer(client, names.trajectories, "reward", "s", max_deliveries=1)
    (msg,) = scoring.read(count=1, block_ms=100)
    assert scoring.fail(msg, "formatter timeout")


def test_a_group_completes_without_a_sample_the_scorer_dead_lettered(stream):
    client, prefix, make = stream
    collector = make(batch_prompts=2, straggler_wait_s=600.0, wait_timeout_s=30.0)
    _dead_letter_sample(client, prefix, _traj("short", 1))
    _send(client, prefix, _traj("short", 0), _traj("whole", 0), _traj("whole", 1))
    step = collector.collect(batch=0, version=0)
    assert step.wait_s < 10  # not the straggler wait for a sample that cannot come
    assert _groups(step) == ["short", "whole"] and len(step.trajectories) == 3
    assert step.counts["samples_unscored"] == 1.0 and collector.unscored == {}


def test_a_group_whose_every_sample_was_dead_lettered_is_lost(stream):
    client, prefix, make = stream
    collector = make(batch_prompts=2, straggler_wait_s=600.0, wait_timeout_s=30.0)
    for i in range(2):
        _dead_letter_sample(client, prefix, _traj("gone", i, step=0))
    _send(client, prefix, _traj("kept", 0), _traj("kept", 1))
    step = collector.collect(batch=0, version=0)
    assert _groups(step) == ["kept"] and step.lost == ["gone"] and step.wait_s < 10


def test_a_group_taken_by_an_earlier_batch_is_not_waited_for_again(stream):
    """One group of step 1 never completes. Batch 1 takes a step-2 group after the straggler wait; batch 2
    then has one group of its own fewer to come, and must not wait the straggler time for it as well
    (else every later step waits it, each taking one group of the next)."""
    client, prefix, make = stream
    collector = make(batch_prompts=2, straggler_wait_s=1.0, wait_timeout_s=30.0)
    _send(
        client,
        prefix,
        _traj("s1a", 0, step=1),
        _traj("s1a", 1, step=1),
        _traj("s1b", 0, step=1),
        *(_traj(g, i, step=2) for g in ("s2a", "s2b") for i in range(2)),
    )
    first = collector.collect(batch=1, version=1)
    assert _groups(first) == ["s1a", "s2a"] and first.wait_s >= 1.0
    assert first.counts["groups_from_later_steps"] == 1.0
    second = collector.collect(batch=2, version=2)
    assert _groups(second) == ["s2b"] and second.wait_s < 0.9
    assert collector.taken_early == {}


def test_a_task_lost_for_a_past_step_is_not_waited_for(stream):
    client, prefix, make = stream
    _dead_letter_task(client, prefix, "gone", step=0)
    collector = make()
    collector.read_lost(batch=1)
    assert collector.lost == {}


def test_a_replayed_batch_takes_the_journaled_groups_not_the_first_complete_ones(stream, tmp_path):
    client, prefix, make = stream
    _send(client, prefix, *(_traj(g, i) for g in "abcd" for i in range(2)))
    first = make()
    before = first.collect(batch=0, version=0)
    assert _groups(before) == ["a", "b"]
    # killed before a checkpoint: nothing was acknowledged. The journal also says what batch 1 took
    # (not the first complete groups), and a line cut by the kill is ignored.
    with open(tmp_path / JOURNAL, "a") as fh:
        fh.write(json.dumps({"batch": 1, "groups": ["d", "c"], "lost": ["x"]}) + "\n" + '{"batch": 2, "gro')
    again = make()
    again.load_journal(from_batch=0)
    assert again.replaying and sorted(again.replay) == [0, 1]
    replayed = again.collect(batch=0, version=0)
    assert _groups(replayed) == ["a", "b"]
    assert [m.id for m in replayed.messages] == [m.id for m in before.messages]
    second = again.collect(batch=1, version=0)
    assert _groups(second) == ["d", "c"] and second.lost == ["x"]
    assert not again.replaying
    assert len((tmp_path / JOURNAL).read_text().splitlines()) == 3  # replays are not journaled again


def test_the_journal_before_the_checkpoint_is_not_replayed(stream, tmp_path):
    _client, _prefix, make = stream
    (tmp_path / JOURNAL).write_text(json.dumps({"batch": 0, "groups": ["a"], "lost": []}) + "\n")
    collector = make()
    collector.load_journal(from_batch=1)
    assert not collector.replaying


def test_no_data_within_the_wait_and_a_stop_end_the_wait(stream):
    _client, _prefix, make = stream
    with pytest.raises(NoData, match="no complete group arrived within 0 s"):
        make(wait_timeout_s=0.2).collect(batch=0, version=0)
    stopped = make()
    stopped.stop = threading.Event()
    stopped.stop.set()
    with pytest.raises(NoData, match="stopped"):
        stopped.collect(batch=0, version=0)


def test_the_trained_record_keeps_recent_message_ids_and_every_group(tmp_path: Path):
    record = TrainedRecord(keep=TrainedRecord.kept_steps(save_every=0))
    assert record.keep == 16 and TrainedRecord.kept_steps(save_every=20) == 21
    record = TrainedRecord(keep=2)
    for step in range(3):
        record.add([f"{step}-0", f"{step}-1"], [f"g{step}"])
    assert record.message_ids() == {"1-0", "1-1", "2-0", "2-1"}
    assert record.group_ids() == {"g0", "g1", "g2"}
    restored = TrainedRecord(keep=2)
    restored.restore({"consumed": record.consumed, "groups": record.groups})
    assert restored == record


def test_held_messages_are_never_dead_lettered_however_long_until_the_checkpoint(stream):
    """Held (trained, not yet acknowledged) messages sit idle until the next checkpoint. Re-claimed by
    the learner's own XAUTOCLAIM after each claim timeout, each time counting a delivery, they would be
    dead-lettered after `max_deliveries` timeouts: with 10 min and 10, a checkpoint every 100 min lost
    them. Here the timeout is 0.3 s and the limit 2, over several timeouts of waiting."""
    import time

    client, prefix, make = stream
    collector = make(batch_prompts=1)
    collector.consumer.claim_idle_ms, collector.consumer.max_deliveries = 300, 2
    _send(client, prefix, _traj("a", 0), _traj("a", 1))
    step = collector.collect(batch=0, version=0)
    collector.hold(step.messages)
    deadline = time.monotonic() + 2.0  # the learner trains on, reading now and then
    while time.monotonic() < deadline:
        collector.read_stream()
        time.sleep(0.2)
    scored = StreamNames(prefix).scored
    assert client.xlen(StreamNames.dead(scored)) == 0
    assert _pending(client, prefix) == 2
    delivered = client.xpending_range(scored, "learner", min="-", max="+", count=10)
    assert {d["times_delivered"] for d in delivered} == {1}
    collector.acknowledge_held()  # the checkpoint holds them now
    assert _pending(client, prefix) == 0 and client.xlen(StreamNames.dead(scored)) == 0


def test_samples_waiting_for_their_group_are_never_dead_lettered_however_slow_the_steps(stream):
    """Samples filed under a group that is not complete yet (or not yet taken by a step) stay pending in
    this learner's name. Without their claims renewed, its own XAUTOCLAIM re-delivers them after each
    timeout and dead-letters them after `max_deliveries`, while they still wait in memory to be trained."""
    import time

    client, prefix, make = stream
    collector = make(batch_prompts=1)
    collector.consumer.claim_idle_ms, collector.consumer.max_deliveries = 300, 2
    _send(client, prefix, _traj("a", 0))  # one sample of two: its group waits
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        collector.read_stream()
        time.sleep(0.2)
    scored = StreamNames(prefix).scored
    assert client.xlen(StreamNames.dead(scored)) == 0
    assert collector.waiting_ids() and _pending(client, prefix) == 1
    delivered = client.xpending_range(scored, "learner", min="-", max="+", count=10)
    assert {d["times_delivered"] for d in delivered} == {1}
    _send(client, prefix, _traj("a", 1))  # the group completes and is trained as usual
    step = collector.collect(batch=0, version=0)
    assert _groups(step) == ["a"] and len(step.messages) == 2
