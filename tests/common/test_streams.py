"""Redis Streams helpers against a real Redis: delivery, atomic hand-off, reclaim, dead letters."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.schemas import SamplingParams
from services.common.streams import (
    PAYLOAD,
    StreamConsumer,
    StreamNames,
    publish,
    read_all,
    run_worker,
    stream_depth,
)


@pytest.fixture
def names(redis_client):
    client, prefix = redis_client
    return client, StreamNames(prefix.rstrip(":"))


def test_publish_read_forward_is_atomic_and_complete(names):
    client, s = names
    for i in range(5):
        publish(client, s.tasks, {"n": i})
    consumer = StreamConsumer(client, s.tasks, "rollout", "w1")
    got = consumer.read(count=10, block_ms=100)
    assert [m.data["n"] for m in got] == [0, 1, 2, 3, 4]
    for m in got:
        consumer.forward(m, s.trajectories, [{"n": m.data["n"], "k": 0}, {"n": m.data["n"], "k": 1}])
    out = read_all(client, s.trajectories)
    assert len(out) == 10
    assert stream_depth(client, s.tasks, "rollout")["pending"] == 0
    assert consumer.read(count=1, block_ms=50) == []


def test_pydantic_payloads_round_trip(names):
    client, s = names
    publish(client, s.tasks, SamplingParams(temperature=0.6, seed=3))
    msg = StreamConsumer(client, s.tasks, "g", "c").read(1, 100)[0]
    assert SamplingParams.model_validate(msg.data) == SamplingParams(temperature=0.6, seed=3)


def test_dead_consumer_messages_are_reclaimed(names):
    client, s = names
    publish(client, s.tasks, {"n": 1})
    dead = StreamConsumer(client, s.tasks, "g", "dead", claim_idle_ms=50)
    assert len(dead.read(1, 100)) == 1  # taken, never acknowledged: the worker "died"
    alive = StreamConsumer(client, s.tasks, "g", "alive", claim_idle_ms=50)
    assert alive.read(1, 10) == []  # not idle long enough yet
    time.sleep(0.1)
    got = alive.read(1, 10)
    assert [m.data["n"] for m in got] == [1]
    assert got[0].deliveries == 2
    alive.ack(got[0])
    assert stream_depth(client, s.tasks, "g")["pending"] == 0


def test_restarted_consumer_resumes_its_own_pending(names):
    client, s = names
    publish(client, s.tasks, {"n": 7})
    StreamConsumer(client, s.tasks, "g", "w").read(1, 100)
    again = StreamConsumer(client, s.tasks, "g", "w")  # same name after a restart
    assert [m.data["n"] for m in again.read(1, 10)] == [7]


def test_poison_message_goes_to_dead_letter_after_max_deliveries(names):
    client, s = names
    publish(client, s.tasks, {"n": "poison"})
    consumer = StreamConsumer(client, s.tasks, "g", "w", claim_idle_ms=1, max_deliveries=3)
    attempts = 0
    while True:
        msgs = consumer.read(1, 10)
        if not msgs:
            if client.xlen(StreamNames.dead(s.tasks)):
                break
            time.sleep(0.005)
            continue
        attempts += 1
        assert attempts <= 3
        buried = consumer.fail(msgs[0], "ValueError: bad task")
        assert buried == (attempts == 3)
    dead = read_all(client, StreamNames.dead(s.tasks))
    assert len(dead) == 1
    assert dead[0][1]["error"] == "ValueError: bad task"
    assert dead[0][1]["payload"] == {"n": "poison"}
    assert dead[0][1]["deliveries"] == 3
    assert stream_depth(client, s.tasks, "g")["pending"] == 0


def test_undecodable_entry_is_dead_lettered_not_crashing(names):
    client, s = names
    client.xadd(s.tasks, {PAYLOAD: b"{not json"})
    client.xadd(s.tasks, {b"other": b"x"})
    publish(client, s.tasks, {"n": 1})
    got = StreamConsumer(client, s.tasks, "g", "w").read(5, 100)
    assert [m.data for m in got] == [{"n": 1}]
    assert client.xlen(StreamNames.dead(s.tasks)) == 2


def test_run_worker_forwards_and_survives_handler_errors(names):
    client, s = names
    for i in range(6):
        publish(client, s.trajectories, {"n": i})
    consumer = StreamConsumer(client, s.trajectories, "reward", "w", claim_idle_ms=1, max_deliveries=2)
    stop = threading.Event()

    def handler(msg):
        if msg.data["n"] == 3:
            raise RuntimeError("cannot score")
        if msg.data["n"] == 5:
            stop.set()
        return {"n": msg.data["n"], "scored": True}

    thread = threading.Thread(target=run_worker, args=(consumer, handler, s.scored, stop), kwargs={"block_ms": 20})
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    # the failing message keeps being retried until dead-lettered, so drain it
    deadline = time.monotonic() + 5
    while client.xlen(StreamNames.dead(s.trajectories)) == 0 and time.monotonic() < deadline:
        for m in consumer.read(1, 10):
            consumer.fail(m, "RuntimeError: cannot score")
    scored = sorted(d["n"] for _, d in read_all(client, s.scored))
    assert scored == [0, 1, 2, 4, 5]
    assert client.xlen(StreamNames.dead(s.trajectories)) == 1
