"""The scoring worker on real Redis: trajectories in, scored trajectories out, ack only after the write."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.schemas import Plan, PlanDay, ScoredTrajectory, Trajectory
from services.common.streams import StreamNames, publish, read_all, stream_depth
from services.formatter.structured import render_plan
from services.reward.scoring import Scorer
from services.reward.worker import GROUP, ScoreWorker


@pytest.fixture()
def names(redis_client):
    client, prefix = redis_client
    return client, StreamNames(prefix.rstrip(":"))


def trajectory(gold, i: int, **kw) -> Trajectory:
    text = render_plan(Plan(days=[PlanDay(**d) for d in gold.plans[i] if d]))
    base = dict(
        run_id="run",
        task_id=f"task-{i}",
        prompt_id=f"p{i}",
        group_id=f"g{i}",
        sample_index=0,
        finish_reason="answer",
        answer=f"<answer>{text}</answer>",
        query=gold.queries[i],
        epoch=1,
        reward_kind="sum",
        eval_mode="official",
    )
    return Trajectory(**(base | kw))


def run_until(worker: ScoreWorker, done, timeout: float = 30.0) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, kwargs={"stop": stop, "block_ms": 100}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not done():
            assert time.monotonic() < deadline, "worker did not finish in time"
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(10)


def test_trajectories_become_scored_trajectories(names, gold, official):
    client, streams = names
    sent = [
        trajectory(gold, 0),
        trajectory(gold, 1, eval_mode="strict", reward_kind="curriculum", epoch=5),
        trajectory(gold, 2, finish_reason="tool_budget", answer=None),
        trajectory(gold, 3, answer="I wander around and then go home."),
    ]
    for t in sent:
        publish(client, streams.trajectories, t)
    worker = ScoreWorker(Scorer(official), client, streams, consumer="w1")
    run_until(worker, lambda: len(read_all(client, streams.scored)) == 4)

    scored = [ScoredTrajectory(**data) for _, data in read_all(client, streams.scored)]
    assert [s.task_id for s in scored] == ["task-0", "task-1", "task-2", "task-3"]
    assert [s.reward for s in scored] == [5.0, 1.0, 0.0, 0.0]
    assert scored[1].score.mode == "strict" and scored[1].rewards["curriculum"] == 1.0
    assert scored[0].plan is not None and len(scored[0].plan.days) == 3
    assert scored[2].score.formatter_status == "tool_budget"
    assert scored[3].score.formatter_status == "invalid_output" and scored[3].plan is None
    assert all(0.0 <= s.timings["score_s"] < 60.0 for s in scored)  # each carries its scoring time
    assert stream_depth(client, streams.trajectories, GROUP)["pending"] == 0
    assert worker.scored == 4 and worker.dead == 0


def test_unscorable_payloads_are_dead_lettered_at_once(names, gold, official):
    client, streams = names
    publish(client, streams.trajectories, {"hello": "world"})
    publish(client, streams.trajectories, trajectory(gold, 0, query=None))
    publish(client, streams.trajectories, trajectory(gold, 0).model_dump(mode="json") | {"schema_version": 99})
    publish(client, streams.trajectories, trajectory(gold, 4))
    worker = ScoreWorker(Scorer(official), client, streams, consumer="w1")
    dead_stream = StreamNames.dead(streams.trajectories)
    run_until(worker, lambda: len(read_all(client, dead_stream)) == 3 and len(read_all(client, streams.scored)) == 1)
    errors = [data["error"] for _, data in read_all(client, dead_stream)]
    assert "not a trajectory" in errors[0] and "run_id" in errors[0]
    assert "carries no query" in errors[1]
    assert "schema_version 99" in errors[2]
    assert stream_depth(client, streams.trajectories, GROUP)["pending"] == 0


class FlakyScorer:
    """Fails the first `n` trajectories (a formatter outage), then scores normally."""

    def __init__(self, scorer: Scorer, n: int) -> None:
        self.scorer, self.n = scorer, n

    def score_trajectory(self, t, backend=None):
        if self.n > 0:
            self.n -= 1
            raise RuntimeError("formatter API unreachable")
        return self.scorer.score_trajectory(t, backend)


def test_a_failed_attempt_is_not_acknowledged_and_is_retried(names, gold, official):
    client, streams = names
    publish(client, streams.trajectories, trajectory(gold, 5))
    flaky = ScoreWorker(
        FlakyScorer(Scorer(official), 1),
        client,
        streams,
        consumer="w1",  # type: ignore[arg-type]
        claim_idle_ms=60_000,
    )
    msg = flaky.consumer.read(1, 100)[0]
    with pytest.raises(RuntimeError):
        flaky.handle(msg)
    flaky.consumer.fail(msg, "formatter API unreachable")
    # nothing written, the trajectory still pending on the dead worker
    assert read_all(client, streams.scored) == []
    assert stream_depth(client, streams.trajectories, GROUP)["pending"] == 1
    # another worker takes it over once it has been idle long enough
    time.sleep(0.2)
    healthy = ScoreWorker(Scorer(official), client, streams, consumer="w2", claim_idle_ms=100)
    run_until(healthy, lambda: len(read_all(client, streams.scored)) == 1)
    assert ScoredTrajectory(**read_all(client, streams.scored)[0][1]).reward == 5.0
    assert stream_depth(client, streams.trajectories, GROUP)["pending"] == 0


def test_worker_survives_its_stream_being_deleted(names, gold, official, caplog):
    client, streams = names
    worker = ScoreWorker(Scorer(official), client, streams, consumer="w1")
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, kwargs={"stop": stop, "block_ms": 200}, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        client.delete(streams.trajectories)  # a reset of the run while the worker blocks on it
        time.sleep(1.0)
        assert thread.is_alive()
        publish(client, streams.trajectories, trajectory(gold, 6))
        deadline = time.monotonic() + 20
        while not read_all(client, streams.scored):
            assert time.monotonic() < deadline, "worker did not recover"
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(10)
    assert ScoredTrajectory(**read_all(client, streams.scored)[0][1]).reward == 5.0
    assert "vanished; recreating" in caplog.text


def test_star_reward_worker_process(redis_server_url, names, gold, official_world_url, tmp_path):
    """The fleet's command: `python -m services.cli reward worker`, two consumer threads, SIGTERM."""
    import os
    import signal
    import subprocess
    import sys

    client, streams = names
    for i in range(4):
        publish(client, streams.trajectories, trajectory(gold, i))
    env = {
        **os.environ,
        "STAR_REDIS_URL": redis_server_url,
        "STAR_STREAM_PREFIX": streams.prefix,
        "STAR_DB_URL": official_world_url,
        "STAR_LOG_JSON": "false",
        "STAR_LOG_LEVEL": "WARNING",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "reward", "worker", "--threads", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(read_all(client, streams.scored)) < 4:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "worker did not score in time"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert "stopped: 4 scored, 0 dead-lettered" in output and "Traceback" not in output
    assert sorted(ScoredTrajectory(**d).task_id for _, d in read_all(client, streams.scored)) == [
        f"task-{i}" for i in range(4)
    ]


def test_a_formatter_outage_is_retried_never_a_sample(names, gold, official):
    """The formatter's LLM answers 500: the trajectory is not scored 0 and trained on; it stays
    pending, and is scored once a formatter answers."""
    from services.formatter.core import Formatter
    from services.formatter.llm import LLMFormatter
    from services.reward.worker import FormatterOutage
    from tests.support.fake_openai import FakeOpenAI, Reply

    client, streams = names
    publish(client, streams.trajectories, trajectory(gold, 3, answer="I fly to Chicago and sleep at Cozy Room."))
    with FakeOpenAI(lambda _body: Reply(status=500), api_key="sk-x") as llm:
        formatter = Formatter(
            LLMFormatter(
                llm.base_url, "fmt", api_key="sk-x", max_attempts=1, request_timeout_s=5, deadline_s=10, backoff_s=0.01
            )
        )
        down = ScoreWorker(Scorer(official, formatter), client, streams, consumer="w1", claim_idle_ms=60_000)
        msg = down.consumer.read(1, 100)[0]
        with pytest.raises(FormatterOutage, match="llm_error"):
            down.handle(msg)
        down.consumer.fail(msg, "formatter outage")
        assert llm.requests
    assert read_all(client, streams.scored) == []
    assert stream_depth(client, streams.trajectories, GROUP)["pending"] == 1
    time.sleep(0.2)
    healthy = ScoreWorker(Scorer(official), client, streams, consumer="w2", claim_idle_ms=100)
    run_until(healthy, lambda: len(read_all(client, streams.scored)) == 1)
    assert ScoredTrajectory(**read_all(client, streams.scored)[0][1]).score.formatter_status == "invalid_output"
