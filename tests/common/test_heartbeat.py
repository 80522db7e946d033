"""Worker liveness by heartbeat, the same on every Redis: the shared test Redis, a Redis 7.0 (Debian's
`redis-server`, the version of the project's own Redis image) started here, and the embedded one."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
import uuid

import pytest
import redis

from services.common import heartbeat
from services.common.heartbeat import Heartbeat, last_beat_age, live_consumers
from services.common.redis import EmbeddedRedis, free_port
from services.common.streams import StreamConsumer, publish, run_worker
from tests.support.waiting import until

DEBIAN_REDIS = "/usr/bin/redis-server"  # Debian bookworm's package: Redis 7.0.15, as deploy/images/Dockerfile.redis


@pytest.fixture(scope="module")
def redis_7_0():
    """A Redis server from Debian's package on a port of its own."""
    if not shutil.which(DEBIAN_REDIS):
        pytest.skip(f"no {DEBIAN_REDIS} (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [DEBIAN_REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    until(lambda: _pings(client), 10, "redis 7.0 to answer")
    yield client
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def embedded_redis():
    with EmbeddedRedis() as server:
        yield redis.Redis.from_url(server.url)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture(params=["shared", "7.0", "embedded"])
def client(request, redis_client):
    if request.param == "shared":
        return redis_client[0]
    return request.getfixturevalue({"7.0": "redis_7_0", "embedded": "embedded_redis"}[request.param])


def _names() -> tuple[str, str]:
    return f"test:{uuid.uuid4().hex[:8]}:tasks", "rollout"


def test_a_consumer_polling_an_empty_stream_is_live_and_one_that_stopped_is_not(client):
    stream, group = _names()
    heartbeat_every, alive_s = 0.1, 2
    consumer = StreamConsumer(client, stream, group, "host-a-1-0")
    consumer.heartbeat.every_s = heartbeat_every
    polled = time.monotonic()
    while time.monotonic() - polled < 1.5:  # a worker on an empty stream: XREADGROUP returns nothing
        assert consumer.read(block_ms=100) == []
    assert live_consumers(client, stream, group, alive_s) == ["host-a-1-0"]
    version = client.info("server")["redis_version"]
    if version.startswith("7.0."):  # why XINFO cannot tell: its idle time grew the whole time it polled
        idle = {c["name"].decode(): c["idle"] for c in client.xinfo_consumers(stream, group)}
        assert idle["host-a-1-0"] >= 1000, (version, idle)
    time.sleep(alive_s + 1.1)  # it stopped reading
    assert live_consumers(client, stream, group, alive_s) == []
    assert last_beat_age(client, stream, group) >= alive_s
    client.delete(stream, heartbeat.beats_key(stream, group))


def test_a_consumer_working_on_a_long_message_keeps_beating(client, monkeypatch):
    stream, group = _names()
    monkeypatch.setattr("services.common.streams.BEAT_EVERY_S", 0.2)
    consumer = StreamConsumer(client, stream, group, "host-b-1-0", claim_idle_ms=600)
    consumer.heartbeat.every_s = 0.1
    publish(client, stream, {"n": 1})
    stop = threading.Event()
    seen: list[list[str]] = []

    def slow(msg):  # 3 s on one message, longer than the liveness window below
        for _ in range(6):
            time.sleep(0.5)
            seen.append(live_consumers(client, stream, group, 1))
        stop.set()

    run_worker(consumer, slow, None, stop, block_ms=100)
    assert seen and all(names == ["host-b-1-0"] for names in seen[1:]), seen
    client.delete(stream, heartbeat.beats_key(stream, group))


def test_a_worker_held_back_by_a_dependency_stops_beating(client):
    stream, group = _names()
    consumer = StreamConsumer(client, stream, group, "host-c-1-0")
    consumer.heartbeat.every_s = 0.1
    stop = threading.Event()
    down = threading.Event()

    def ready() -> bool:  # the sandbox is down: the worker claims nothing and waits
        if down.is_set():
            stop.wait(0.1)
            return False
        return True

    t = threading.Thread(
        target=run_worker,
        args=(consumer, lambda m: None, None, stop),
        kwargs={"block_ms": 100, "until_ready": ready},
        daemon=True,
    )
    t.start()
    until(lambda: live_consumers(client, stream, group, 1), 5, "the worker's first beat")
    down.set()
    time.sleep(2.2)
    assert live_consumers(client, stream, group, 1) == []
    stop.set()
    t.join(5)
    client.delete(stream, heartbeat.beats_key(stream, group))


def test_the_health_check_passes_only_for_this_hosts_consumers(redis_7_0, monkeypatch):
    port = redis_7_0.connection_pool.connection_kwargs["port"]
    prefix = f"hc{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("STAR_REDIS_URL", f"redis://127.0.0.1:{port}/0")
    monkeypatch.setenv("STAR_STREAM_PREFIX", prefix)
    from services.common.settings import get_settings

    get_settings.cache_clear()
    stream = f"{prefix}:trajectories"
    assert heartbeat.main(["trajectories", "reward"]) == 1  # nobody beats
    Heartbeat(redis_7_0, stream, "reward", "reward-otherhost-7").beat()
    assert heartbeat.main(["trajectories", "reward"]) == 1  # another container's worker
    Heartbeat(redis_7_0, stream, "reward", f"reward-{socket.gethostname()}-42").beat()
    assert heartbeat.main(["trajectories", "reward"]) == 0
    assert heartbeat.main(["trajectories"]) == 2
    get_settings.cache_clear()


def test_consumer_names_match_their_host_only():
    assert heartbeat.of_host("web-1-123-0", "web-1")
    assert heartbeat.of_host("reward-web-1-123", "web-1")
    assert not heartbeat.of_host("web-12-123-0", "web-1")
    assert not heartbeat.of_host("reward-web-12-5", "web-1")
