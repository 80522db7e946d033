"""`rl.max_minutes`: the controller ends the RL stage once its wall-clock budget is spent, with the
latest published weights, and otherwise runs every step. Real Redis, a real TaskPublisher and a
learner process; the learner's progress is what the real learner writes to Redis. A Redis that goes
away between any two of the controller's commands is ridden out."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from services.common.schemas import SamplingParams, TravelQuery
from services.common.streams import StreamNames
from services.controller.embedded_fleet import EmbeddedFleet
from services.controller.loop import drive
from services.controller.scheduler import Schedule, TaskPublisher
from services.controller.validation import Managed
from services.pipeline.config import PipelineConfig


def _queries(n: int) -> tuple[TravelQuery, ...]:
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


@pytest.fixture
def setup(redis_client, tmp_path: Path):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    schedule = Schedule(_queries(8), batch_prompts=2, group_size=2, epochs=1)  # 4 steps
    publisher = TaskPublisher(client, names, "budget-test", schedule, SamplingParams(), max_staleness=1)
    learner = Managed(
        "learner", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "learner.log"
    ).start()
    run = type(
        "RunStub",
        (),
        {
            "folder": tmp_path,
            "config": PipelineConfig.model_validate({"name": "budget-test", "model": {"path": "/nowhere"}}),
        },
    )()
    # what `drive` watches of the controller's fleet: no supervisor, no workers, one learner process
    fleet = EmbeddedFleet(None, "", learner=learner, status_path=tmp_path / "rl" / "status.json")
    yield client, names, schedule, publisher, fleet, run
    learner.stop(5)


def _learner_trains(client, names: StreamNames, steps: int, every_s: float) -> threading.Thread:
    def work() -> None:
        for step in range(1, steps + 1):
            time.sleep(every_s)
            client.set(names.weights_latest, json.dumps({"version": step, "uri": f"/w/v{step}"}))
            client.set(names.learner_batches, step)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(30)
def test_budget_spent_stops_at_the_latest_weights(setup):
    client, names, schedule, publisher, fleet, run = setup
    _learner_trains(client, names, 1, 0.2)  # one step, then the learner stalls
    t0 = time.monotonic()
    ended = drive(run, fleet, client, names, publisher, schedule, poll_s=0.05, deadline=t0 + 1.5)
    assert ended.reason == "budget" and ended.steps == 1
    assert 1.5 <= time.monotonic() - t0 < 5
    assert publisher.next_step() == 3  # steps 0-2 published (staleness 1 after one trained), step 3 never
    assert fleet.learner.exited() is None  # stopping the fleet is the stage's job, not drive's


@pytest.mark.timeout(30)
def test_without_budget_every_step_runs(setup):
    client, names, schedule, publisher, fleet, run = setup
    _learner_trains(client, names, schedule.total_steps, 0.1)
    (run.folder / "rl").mkdir()
    (run.folder / "rl" / "status.json").write_text(json.dumps({"state": "finished"}))
    ended = drive(run, fleet, client, names, publisher, schedule, poll_s=0.05, deadline=time.monotonic() + 60)
    assert ended.reason == "done" and ended.steps == schedule.total_steps == 4
    assert publisher.next_step() == 4


class FlakyRedis(redis.Redis):
    """A client on the real server whose commands fail one at a time as if the server had gone: the
    n-th failure comes after n commands that pass, so over a run the failures land at every point
    of the controller's loop."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        super().__init__(connection_pool=pool)
        self.failures = 0
        self.passed_since = 0

    def execute_command(self, *args, **options):
        if self.passed_since >= self.failures:
            self.failures += 1
            self.passed_since = 0
            raise redis.ConnectionError("Connection closed by server.")
        self.passed_since += 1
        return super().execute_command(*args, **options)


@pytest.mark.timeout(60)
def test_redis_going_away_at_any_command_of_the_loop_is_ridden_out(setup):
    client, names, schedule, _, fleet, run = setup
    flaky = FlakyRedis(client.connection_pool)
    publisher = TaskPublisher(flaky, names, "flaky-test", schedule, SamplingParams(), max_staleness=1)
    _learner_trains(client, names, schedule.total_steps, 0.3)
    (run.folder / "rl").mkdir()
    (run.folder / "rl" / "status.json").write_text(json.dumps({"state": "finished"}))
    ended = drive(run, fleet, flaky, names, publisher, schedule, poll_s=0.01, deadline=time.monotonic() + 50)
    assert ended.reason == "done" and ended.steps == schedule.total_steps
    assert flaky.failures > 20  # the failures did reach every point of the loop
    steady = TaskPublisher(client, names, "flaky-test", schedule, SamplingParams(), max_staleness=1)
    assert steady.next_step() == schedule.total_steps  # read back past the faults: every step published once


def test_max_minutes_must_be_positive():
    with pytest.raises(ValueError, match="max_minutes"):
        PipelineConfig.model_validate({"name": "x", "model": {"path": "/m"}, "rl": {"max_minutes": 0}})


def test_a_run_folder_resumes_under_another_budget_but_not_another_recipe():
    from services.controller.train import recipe_identity

    base = PipelineConfig.model_validate({"name": "x", "model": {"path": "/m"}, "rl": {"max_minutes": 20}})
    other_budget = base.model_copy(update={"rl": base.rl.model_copy(update={"max_minutes": 5})})
    other_lr = base.model_copy(update={"rl": base.rl.model_copy(update={"lr": 1e-4})})
    assert recipe_identity(base) == recipe_identity(other_budget)
    assert recipe_identity(base) != recipe_identity(other_lr)
