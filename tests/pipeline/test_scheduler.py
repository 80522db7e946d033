"""The RL task schedule: the paper's step arithmetic, epochs, staleness pacing, exactly-once publishing."""

from __future__ import annotations

import pytest

from services.common.schemas import RolloutTask, SamplingParams, TravelQuery
from services.common.streams import StreamNames, read_all
from services.controller.scheduler import Schedule, TaskPublisher, publishable
from services.reward.rewards import Curriculum


def _queries(n):
    return tuple(
        TravelQuery(
            id=f"q{i}",
            org="A",
            dest="B",
            days=3,
            visiting_city_number=1,
            date=["2022-03-01", "2022-03-02", "2022-03-03"],
            people_number=1,
            budget=1000,
        )
        for i in range(n)
    )


def test_paper_arithmetic_155_steps():
    s = Schedule(_queries(1000), batch_prompts=32, group_size=8, epochs=5)
    assert s.steps_per_epoch == 31 and s.total_steps == 155
    assert s.epoch_of(0) == 1 and s.epoch_of(30) == 1 and s.epoch_of(31) == 2 and s.epoch_of(154) == 5


def test_each_epoch_visits_distinct_prompts_in_a_new_order():
    s = Schedule(_queries(10), batch_prompts=5, group_size=2, epochs=2, seed=3)
    e1 = [i for step in (0, 1) for i, _ in s.batch(step)]
    e2 = [i for step in (2, 3) for i, _ in s.batch(step)]
    assert sorted(e1) == sorted(e2) == list(range(10))
    assert e1 != e2
    assert [i for i, _ in s.batch(0)] == [i for i, _ in Schedule(_queries(10), 5, 2, 2, seed=3).batch(0)]
    with pytest.raises(IndexError):
        s.batch(4)


def test_small_prompt_set_wraps_and_max_steps_caps():
    s = Schedule(_queries(3), batch_prompts=4, group_size=2, epochs=2, max_steps=1)
    assert s.total_steps == 1 and len(s.batch(0)) == 4


@pytest.mark.parametrize(
    "step,version,k,ok",
    [(0, 0, 0, True), (1, 0, 0, False), (1, 1, 0, True), (2, 1, 1, True), (3, 1, 1, False), (5, 2, 3, True)],
)
def test_publishable(step, version, k, ok):
    assert publishable(step, version, k) is ok


def test_publisher_paces_by_version_and_never_repeats(redis_client):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    sched = Schedule(_queries(8), batch_prompts=2, group_size=4, epochs=2)  # 8 steps
    pub = TaskPublisher(
        client,
        names,
        "run1",
        sched,
        SamplingParams(seed=7),
        reward_kind="curriculum",
        curriculum=Curriculum.parse("sum:1-1,success:2"),
        max_staleness=1,
    )
    assert pub.publish_ready(0) == [0, 1]
    assert pub.publish_ready(0) == []
    # a restarted controller (new object) continues from Redis
    again = TaskPublisher(
        client,
        names,
        "run1",
        sched,
        SamplingParams(seed=7),
        reward_kind="curriculum",
        curriculum=Curriculum.parse("sum:1-1,success:2"),
        max_staleness=1,
    )
    assert again.publish_ready(2, version=1) == [2, 3]
    assert again.publish_ready(10) == [4, 5, 6, 7]
    assert again.done_publishing()
    tasks = [RolloutTask.model_validate(d) for _, d in read_all(client, names.tasks)]
    assert len(tasks) == 16 and len({t.task_id for t in tasks}) == 16
    assert {t.reward_kind for t in tasks if t.epoch == 1} == {"sum"}
    assert {t.reward_kind for t in tasks if t.epoch == 2} == {"success"}
    assert all(t.group_size == 4 for t in tasks)
    assert len({t.sampling.seed for t in tasks}) == 16
    assert tasks[4].min_policy_version == 1  # the version the controller saw
    assert tasks[8].min_policy_version == 3  # default: step 4 - staleness 1
    assert [t.step for t in tasks] == [s for s in range(8) for _ in range(2)]  # the learner batches by it


def test_a_curriculum_by_step_switches_within_an_epoch(redis_client):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    sched = Schedule(_queries(8), batch_prompts=2, group_size=2, epochs=1)  # 4 steps, one epoch
    pub = TaskPublisher(
        client,
        names,
        "run-steps",
        sched,
        SamplingParams(seed=7),
        reward_kind="curriculum",
        curriculum=Curriculum.parse("sum@1,macro@2,success@4", unit="step"),
        max_staleness=3,
    )
    assert pub.publish_ready(0) == [0, 1, 2, 3]
    tasks = [RolloutTask.model_validate(d) for _, d in read_all(client, names.tasks)]
    assert {t.epoch for t in tasks} == {1}
    kinds = {t.step: t.reward_kind for t in tasks}
    assert kinds == {0: "sum", 1: "macro", 2: "macro", 3: "success"}  # stage numbers count steps from 1


def test_arpo_settings_travel_with_the_tasks(redis_client):
    from services.common.schemas import ArpoParams

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    pub = TaskPublisher(
        client, names, "r", Schedule(_queries(2), 2, 4, 1), SamplingParams(), arpo=ArpoParams(beam_size=3)
    )
    pub.publish_ready(0)
    tasks = [RolloutTask.model_validate(d) for _, d in read_all(client, names.tasks)]
    assert [t.arpo.beam_size for t in tasks] == [3, 3]


def test_preference_penalty_travels_with_the_tasks(redis_client):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    pub = TaskPublisher(client, names, "r", Schedule(_queries(2), 2, 4, 1), SamplingParams(), preference_penalty=1.0)
    pub.publish_ready(0)
    tasks = [RolloutTask.model_validate(d) for _, d in read_all(client, names.tasks)]
    assert [t.preference_penalty for t in tasks] == [1.0, 1.0]


def test_a_publisher_awaiting_the_start_weights_sends_no_step_before_they_are_announced(redis_client):
    """An external fleet's rollout workers run a model of their own until they load the run's version 0:
    a step sent before the learner announced it would be sampled by that model."""
    from services.common.schemas import WeightsUpdate

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    sched = Schedule(_queries(4), batch_prompts=2, group_size=2, epochs=1)
    pub = TaskPublisher(client, names, "run1", sched, SamplingParams(seed=7), max_staleness=1, await_start_weights=True)
    assert pub.publish_ready(0) == [] and client.xlen(names.tasks) == 0
    client.set(names.weights_latest, WeightsUpdate(version=0, uri="/w/v0", sha256="0" * 64).model_dump_json())
    assert pub.publish_ready(0, version=0) == [0, 1]
    tasks = [RolloutTask.model_validate(d) for _, d in read_all(client, names.tasks)]
    assert {t.min_policy_version for t in tasks} == {0}
    # the embedded fleet's workers start on the starting model: its publisher does not wait
    assert TaskPublisher(client, names, "run2", sched, SamplingParams(seed=7)).publish_ready(0) == [0]


def test_over_sampling_publishes_extra_prompts_a_step_each_a_group_of_its_own(redis_client):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    sched = Schedule(_queries(6), batch_prompts=2, group_size=4, epochs=1, seed=1)  # 3 steps
    assert [i for i, _ in sched.batch(0, extra=1)] == [i for i, _ in sched.batch(0)] + [sched.batch(1)[0][0]]
    last = sched.batch(2, extra=2)  # past the epoch's end: wraps to its first prompts
    assert [i for i, _ in last[2:]] == [i for i, _ in sched.batch(0)]
    pub = TaskPublisher(client, names, "run1", sched, SamplingParams(seed=7), oversample_groups=1)
    assert pub.publish_ready(10) == [0, 1, 2]
    tasks = [RolloutTask.model_validate(d) for _, d in read_all(client, names.tasks)]
    assert [t.step for t in tasks] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len({t.task_id for t in tasks}) == 9 and len({t.sampling.seed for t in tasks}) == 9
