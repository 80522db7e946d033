"""Bounded stream state, claims kept while working, and messages that kill their consumer, against
a real Redis."""

from __future__ import annotations

import threading
import time

from services.common.streams import (
    ClaimKeeper,
    StreamConsumer,
    StreamNames,
    consumed_below,
    publish,
    run_worker,
    trim_consumed,
)


def test_trim_keeps_what_any_group_still_needs(redis_client):
    client, prefix = redis_client
    stream = f"{prefix}trim"
    ids = [publish(client, stream, {"n": i}) for i in range(6)]
    fast = StreamConsumer(client, stream, "fast", "f")
    slow = StreamConsumer(client, stream, "slow", "s")
    for m in fast.read(6, None):
        fast.ack(m)
    # the slow group has read nothing: nothing may go
    assert trim_consumed(client, stream) == 0 and client.xlen(stream) == 6
    got = slow.read(3, None)
    slow.ack(got[0])
    slow.ack(got[2])  # got[1] stays pending: it and everything after it must stay
    assert consumed_below(client, stream) == ids[1]
    assert trim_consumed(client, stream) == 1
    assert [e.decode() for e, _ in client.xrange(stream)] == ids[1:]
    slow.ack(got[1])
    for m in slow.read(3, None):
        slow.ack(m)
    assert trim_consumed(client, stream) == 5 and client.xlen(stream) == 0


def test_a_stream_without_groups_is_never_trimmed(redis_client):
    client, prefix = redis_client
    stream = f"{prefix}nogroup"
    publish(client, stream, {"n": 1})
    assert consumed_below(client, stream) is None and trim_consumed(client, stream) == 0
    assert client.xlen(stream) == 1


def test_a_worker_trims_its_input_as_it_goes(redis_client):
    client, prefix = redis_client
    stream, out = f"{prefix}in", f"{prefix}out"
    for i in range(20):
        publish(client, stream, {"n": i})
    consumer = StreamConsumer(client, stream, "g", "w")
    stop = threading.Event()
    seen = []

    def handle(msg):
        seen.append(msg.data["n"])
        if len(seen) == 20:
            threading.Timer(1.2, stop.set).start()  # past TRIM_EVERY_S: one more trim
        return {"n": msg.data["n"]}

    run_worker(consumer, handle, out, stop, batch=5, block_ms=100)
    assert sorted(seen) == list(range(20)) and client.xlen(out) == 20
    assert client.xlen(stream) == 0


def test_a_message_that_kills_its_consumers_is_dead_lettered(redis_client):
    """No failure is ever recorded for it (its consumers die): it is buried when it comes round
    more than max_deliveries times, and the message behind it goes on."""
    client, prefix = redis_client
    stream = f"{prefix}poison"
    publish(client, stream, {"n": "poison"})
    publish(client, stream, {"n": "fine"})
    for life in range(3):  # three consumers each take it and die without a word
        consumer = StreamConsumer(client, stream, "g", f"c{life}", claim_idle_ms=0, max_deliveries=3)
        got = consumer.read(1, None)
        assert [m.data["n"] for m in got] == ["poison"], life
    survivor = StreamConsumer(client, stream, "g", "c9", claim_idle_ms=0, max_deliveries=3)
    got = survivor.read(1, None)
    assert [m.data["n"] for m in got] == ["fine"]
    dead = client.xrange(StreamNames.dead(stream))
    assert len(dead) == 1 and b"died while holding it" in dead[0][1][b"payload"]


def test_claims_are_kept_while_a_slow_handler_works(redis_client):
    client, prefix = redis_client
    stream = f"{prefix}slow"
    publish(client, stream, {"n": 1})
    worker = StreamConsumer(client, stream, "g", "slow-one", claim_idle_ms=300)
    thief = StreamConsumer(client, stream, "g", "thief", claim_idle_ms=300)
    stop = threading.Event()
    stolen = []

    def handle(msg):
        deadline = time.monotonic() + 1.5  # five claim timeouts
        while time.monotonic() < deadline:
            stolen.extend(thief.read(1, None))
            time.sleep(0.05)
        stop.set()
        return None

    run_worker(worker, handle, None, stop, block_ms=50)
    assert stolen == []
    # without the keeper the same wait loses the message
    publish(client, stream, {"n": 2})
    msg = worker.read(1, None)[0]
    time.sleep(0.4)
    assert [m.id for m in thief.read(1, None)] == [msg.id]


def test_the_last_messages_of_a_batch_are_kept_while_the_first_are_handled(redis_client):
    """A scorer reads 8 trajectories at once and scores them in turn. Its claims on those still waiting
    must stay fresh too: else, the first taking longer than the claim timeout, the last are re-claimed by
    the other scorers, each time counting a delivery, until they are dead-lettered (their group never
    completes for the learner)."""
    client, prefix = redis_client
    stream = f"{prefix}batch"
    for n in range(3):
        publish(client, stream, {"n": n})
    worker = StreamConsumer(client, stream, "g", "slow-one", claim_idle_ms=300)
    thief = StreamConsumer(client, stream, "g", "thief", claim_idle_ms=300)
    stop = threading.Event()
    stolen, handled = [], []

    def handle(msg):
        deadline = time.monotonic() + 0.5  # each longer than the claim timeout
        while time.monotonic() < deadline:
            stolen.extend(thief.read(1, None))
            time.sleep(0.05)
        handled.append(msg.data["n"])
        if len(handled) == 3:
            stop.set()
        return None

    run_worker(worker, handle, None, stop, batch=3, block_ms=50)
    assert handled == [0, 1, 2] and stolen == []


def test_claim_keeper_extends_only_what_it_holds(redis_client):
    client, prefix = redis_client
    stream = f"{prefix}keeper"
    publish(client, stream, {"n": 1})
    consumer = StreamConsumer(client, stream, "g", "c", claim_idle_ms=60_000)
    msg = consumer.read(1, None)[0]
    keeper = ClaimKeeper(client, 60_000)
    try:
        assert keeper.extend() == 0
        keeper.hold(consumer, msg)
        time.sleep(0.1)
        assert keeper.extend() == 1
        idle = client.xpending_range(stream, "g", min=msg.id, max=msg.id, count=1)[0]["time_since_delivered"]
        assert idle < 100
        keeper.release(msg)
        assert keeper.extend() == 0
    finally:
        keeper.close()


def test_a_pipeline_stream_waits_for_its_stage_to_join(redis_client):
    """Tasks published before any rollout worker has started must survive an audit (or any other)
    group that has already read them."""
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    publish(client, names.tasks, {"n": 1})
    audit = StreamConsumer(client, names.tasks, "audit", "a")
    for m in audit.read(5, None):
        audit.ack(m)
    assert trim_consumed(client, names.tasks) == 0 and client.xlen(names.tasks) == 1
    rollout = StreamConsumer(client, names.tasks, "rollout", "r")
    (msg,) = rollout.read(5, None)
    assert msg.data["n"] == 1
    rollout.ack(msg)
    assert trim_consumed(client, names.tasks) == 1
