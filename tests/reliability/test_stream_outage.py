"""A stream worker across a Redis restart (its own redis-server with AOF, stopped and started on the
same port and folder): results written exactly once, nothing lost, the worker never dies."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.common.streams import StreamConsumer, _settle, publish, read_all, run_worker, until_redis
from services.common.supervisor import alive, stop_pid
from services.controller import launcher


@pytest.fixture
def own_redis(tmp_path):
    """A restartable Redis: (client, restart(outage_s, how))."""
    state = {"proc": launcher.start_redis_at(tmp_path / "data", tmp_path / "logs")}
    # No client-side retries: redis-py's own (about 4 s of backoff) would hide a short outage here,
    # and a longer real one is what the worker code has to survive.
    client = redis.Redis(
        port=state["proc"].port, password=state["proc"].password, socket_timeout=5, retry=Retry(NoBackoff(), 0)
    )

    def stop(how: int = signal.SIGTERM) -> None:
        pid = state["proc"].pid
        os.killpg(pid, how)
        while alive(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.02)

    def start() -> None:
        state["proc"] = launcher.start_redis_at(tmp_path / "data", tmp_path / "logs", port=state["proc"].port)

    yield client, stop, start
    stop_pid(state["proc"].pid, 5)


def test_results_survive_a_restart_in_the_middle_of_a_worker(own_redis):
    client, stop, start = own_redis
    for i in range(20):
        publish(client, "in", {"n": i})
    consumer = StreamConsumer(client, "in", "g", "c1", claim_idle_ms=60_000)
    halt = threading.Event()
    seen: list[int] = []

    def handler(msg):
        seen.append(msg.data["n"])
        if msg.data["n"] == 5:  # Redis goes away while this message is being handled
            stop()
            threading.Timer(1.5, start).start()
        return {"n": msg.data["n"], "double": 2 * msg.data["n"]}

    worker = threading.Thread(target=run_worker, args=(consumer, handler, "out", halt), kwargs={"batch": 1})
    worker.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if client.xlen("out") >= 20:
                break
        except redis.ConnectionError:
            pass
        time.sleep(0.1)
    halt.set()
    worker.join(10)
    assert not worker.is_alive()
    out = [d["n"] for _, d in read_all(client, "out")]
    assert sorted(out) == list(range(20)), out  # each result once: none lost, none doubled
    assert client.xpending("in", "g")["pending"] == 0


def test_a_transaction_applied_whose_reply_was_lost_is_not_repeated(own_redis):
    client, *_ = own_redis
    publish(client, "in", {"n": 1})
    consumer = StreamConsumer(client, "in", "g", "c1")
    msg = consumer.read(1, 100)[0]
    calls = []

    def forward_then_lose_the_reply():
        calls.append(1)
        if len(calls) == 1:
            consumer.forward(msg, "out", {"n": 1})
            raise redis.ConnectionError("connection reset while reading the EXEC reply")
        consumer.forward(msg, "out", {"n": 1})

    _settle(consumer, msg, forward_then_lose_the_reply, threading.Event())
    assert len(calls) == 1 and client.xlen("out") == 1


def test_a_transaction_lost_with_the_connection_is_retried(own_redis):
    client, stop, start = own_redis
    publish(client, "in", {"n": 1})
    consumer = StreamConsumer(client, "in", "g", "c1")
    msg = consumer.read(1, 100)[0]
    stop()
    threading.Timer(1.0, start).start()
    _settle(consumer, msg, lambda: consumer.forward(msg, "out", {"n": 1}), threading.Event())
    assert client.xlen("out") == 1 and client.xpending("in", "g")["pending"] == 0


def test_until_redis_waits_for_the_server_and_gives_up_when_stopped(own_redis):
    client, stop, start = own_redis
    stop()
    threading.Timer(1.0, start).start()
    assert until_redis(lambda: client.set("k", "v")) is True and client.get("k") == b"v"
    stop(signal.SIGKILL)
    halt = threading.Event()
    halt.set()
    assert until_redis(lambda: client.set("k", "w"), halt) is None
    start()
