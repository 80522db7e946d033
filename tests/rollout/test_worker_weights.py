"""The stream worker with weights over NCCL: its HTTP face (STAR_ROLLOUT_HTTP_PORT), and how it
counts versions when most of them arrive by broadcast, without files. The broadcast is faked by an
engine that "receives" at once (the NCCL transfer needs GPUs: bench/weight_sync_gpu.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.common.redis import free_port
from services.common.schemas import WeightsBroadcast, WeightsUpdate
from services.common.settings import Settings
from services.common.streams import StreamNames, ensure_group, publish, read_all
from services.rollout.config import RolloutConfig
from services.rollout.engines.scripted import ScriptedEngine
from services.rollout.protocol import format_answer
from services.rollout.service import RolloutService
from services.rollout.worker import GROUP, RolloutWorker, serve_http
from services.weights.manifest import WeightsError, write_manifest
from tests.rollout.test_worker import task

LAYOUT = {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[64]]}


class Receiving(ScriptedEngine):
    """A scripted engine that joins any group and takes a broadcast version as vLLM's would (under the
    update lock); `gate`, when set, holds the receive until it opens."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.gate: asyncio.Event | None = None

    async def join_weight_group(self, *args) -> None:
        return None

    async def receive_weights(self, names, dtype_names, shapes, version):
        async def load() -> None:
            if self.gate is not None:
                await self.gate.wait()

        return await self.load_version(version, f"nccl:v{version}", load)

    async def _load_weights(self, path: str) -> None:  # a files version "loads" at once
        return None


def _answering(tokenizer, cls=ScriptedEngine):
    return cls(tokenizer, lambda ids, turn: format_answer("Day 1:"))


def _on(loop, coro, timeout: float = 30.0):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


# ---- the HTTP face ------------------------------------------------------------------------------


@pytest.fixture
def http_face(tmp_path):
    """Serve a service's rollout API the way the worker's main() does: on the loop its engine uses."""
    started = []

    def start(service: RolloutService) -> str:
        loop = asyncio.new_event_loop()
        port = free_port()
        face = serve_http(loop, service, service.settings, RolloutConfig(http_port=port))
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        started.append((loop, thread, face))
        return face.url

    yield start
    for loop, thread, face in started:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        face.close(loop)
        loop.close()


def _settings(tmp_path) -> Settings:
    return Settings(home=tmp_path, weights_root=tmp_path / "weights", log_json=False, log_level="WARNING")


def test_no_port_no_server(tokenizer, local_tools, tmp_path):
    service = RolloutService(_answering(tokenizer), local_tools, settings=_settings(tmp_path))
    assert serve_http(asyncio.new_event_loop(), service, service.settings, RolloutConfig()) is None


def test_the_http_face_of_a_transformers_worker_says_it_cannot_join_a_weight_group(
    tiny_model, local_tools, tmp_path, http_face
):
    from services.rollout.engines import build_engine

    engine = build_engine("transformers", tiny_model, max_model_len=512)
    url = http_face(RolloutService(engine, local_tools, settings=_settings(tmp_path)))
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    info = httpx.get(f"{url}/weights", timeout=10).json()
    assert info["engine"] == "transformers" and info["weight_ranks"] == 0 and info["version"] == 0
    join = httpx.post(
        f"{url}/weights/group",
        json={"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2},
        timeout=10,
    )
    assert join.status_code == 409 and "cannot receive weights over NCCL" in join.text


def test_the_http_face_takes_a_broadcast_into_the_workers_engine(tokenizer, local_tools, tmp_path, http_face):
    engine = _answering(tokenizer, Receiving)
    url = http_face(RolloutService(engine, local_tools, settings=_settings(tmp_path)))
    join = httpx.post(
        f"{url}/weights/group",
        json={"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "group_id": "g1"},
        timeout=10,
    )
    assert join.status_code == 200, join.text
    assert httpx.get(f"{url}/weights", timeout=10).json()["weight_group"] == "g1"
    sent = httpx.post(f"{url}/weights/broadcast", json={"version": 4, **LAYOUT}, timeout=10)
    assert sent.status_code == 200 and sent.json()["version"] == 4
    assert engine.policy_version == 4 and httpx.get(f"{url}/weights", timeout=10).json()["version"] == 4


@pytest.mark.slow
def test_a_worker_process_serves_its_http_face_and_stops_on_sigterm(
    redis_server_url, redis_client, official_world_url, tiny_model, tmp_path
):
    client, prefix = redis_client
    port = free_port()
    env = {
        **os.environ,
        "STAR_REDIS_URL": redis_server_url,
        "STAR_STREAM_PREFIX": prefix.rstrip(":"),
        "STAR_DB_URL": official_world_url,
        "STAR_MODEL": str(tiny_model),
        "STAR_ROLLOUT_ENGINE": "transformers",
        "STAR_ROLLOUT_TOOLS": "local",
        "STAR_ROLLOUT_MAX_MODEL_LEN": "1024",
        "STAR_LOG_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
        "STAR_ROLLOUT_HTTP_PORT": str(port),
        "STAR_ROLLOUT_CONSUMER": "face",
    }
    log = open(tmp_path / "worker.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.rollout.worker"], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        ready = None
        while time.monotonic() < deadline and ready != 200:
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
            try:
                ready = httpx.get(f"{url}/readyz", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.2)
        assert ready == 200
        info = httpx.get(f"{url}/weights", timeout=5).json()
        assert info["engine"] == "transformers" and info["weight_ranks"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "worker.log").read_text()[-2000:]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/readyz", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- versions --------------------------------------------------------------------------------------


def test_a_worker_takes_no_task_until_its_engine_has_the_broadcast_version(
    redis_client, tokenizer, local_tools, loop, tmp_path
):
    """The learner recorded v2, sent over NCCL: the worker (at v0, no files of v2 to load) leaves the
    task alone instead of failing it, and takes it once the broadcast lands, sampling as v2."""
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    engine = _answering(tokenizer, Receiving)
    service = RolloutService(engine, local_tools, settings=_settings(tmp_path))
    ensure_group(client, names.tasks, GROUP)
    client.set(names.weights_version, 2)
    publish(client, names.tasks, task(1, min_policy_version=2))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w", claim_idle_ms=300, max_deliveries=1)
    threads = worker.start()
    try:
        time.sleep(1.5)
        assert client.xlen(names.trajectories) == 0 and client.xlen(StreamNames.dead(names.tasks)) == 0
        assert client.xpending(names.tasks, GROUP)["pending"] == 0  # not even claimed
        assert worker.waiting_for == 2
        _on(loop, service.receive_weights(WeightsBroadcast(version=2, **LAYOUT)))
        deadline = time.monotonic() + 30
        while client.xlen(names.trajectories) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.stop.set()
        for t in threads:
            t.join(5)
    trajs = [d for _, d in read_all(client, names.trajectories)]
    assert len(trajs) == 2 and {t["policy_version"] for t in trajs} == {2}
    assert worker.waiting_for is None and client.xlen(StreamNames.dead(names.tasks)) == 0


def test_without_a_recorded_version_the_worker_is_ready(redis_client, tokenizer, local_tools, loop, tmp_path):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    service = RolloutService(_answering(tokenizer), local_tools, settings=_settings(tmp_path))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w")
    assert worker.weights_ready()
    assert client.get(names.weights_wanted) is None
    client.set(names.weights_version, 1)
    assert not worker.weights_ready() and worker.waiting_for == 1
    # and it asks the learner to send that version again, for a minute
    assert int(client.get(names.weights_wanted)) == 1 and 0 < client.ttl(names.weights_wanted) <= 60


def _files_version(tmp_path, tiny_model, version: int) -> WeightsUpdate:
    folder = tmp_path / "weights" / f"v{version}"
    shutil.copytree(tiny_model, folder)
    return WeightsUpdate(version=version, uri=str(folder), sha256=write_manifest(folder, version))


def test_an_older_files_version_never_replaces_a_newer_broadcast(
    redis_client, tokenizer, local_tools, loop, tmp_path, tiny_model
):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    engine = _answering(tokenizer, Receiving)
    service = RolloutService(engine, local_tools, settings=_settings(tmp_path))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w")
    _on(loop, service.receive_weights(WeightsBroadcast(version=13, **LAYOUT)))
    client.set(names.weights_latest, _files_version(tmp_path, tiny_model, 10).model_dump_json())
    client.set(names.weights_version, 13)
    worker.sync_weights()
    assert engine.policy_version == 13 and engine.weights_path == "nccl:v13"
    assert worker.weights_ready()  # v13 over NCCL counts as v13


def test_a_files_load_waiting_behind_a_broadcast_is_refused(tokenizer, local_tools, loop, tmp_path, tiny_model):
    """The file watch saw v10 while the engine was at v9 and queued its load; a broadcast of v11 held
    the update lock meanwhile. Loaded after it, v10 would have undone v11."""
    engine = _answering(tokenizer, Receiving)
    service = RolloutService(engine, local_tools, settings=_settings(tmp_path))
    files = _files_version(tmp_path, tiny_model, 10)

    async def race() -> tuple[object, object]:
        engine.gate = asyncio.Event()
        receive = asyncio.ensure_future(service.receive_weights(WeightsBroadcast(version=11, **LAYOUT)))
        await asyncio.sleep(0.05)  # the broadcast holds the lock
        load = asyncio.ensure_future(service.update_weights(files))
        await asyncio.sleep(0.3)  # the file check is done; the load waits for the lock
        engine.gate.set()
        return await asyncio.gather(receive, load, return_exceptions=True)

    received, loaded = _on(loop, race())
    assert received["version"] == 11
    assert isinstance(loaded, WeightsError) and loaded.status == 409 and "older" in loaded.message
    assert engine.policy_version == 11 and engine.weights_path == "nccl:v11"


def test_a_receive_whose_sender_died_ends_the_process_at_once(tokenizer, local_tools, http_face, tmp_path):
    """The learner killed mid-broadcast: its HTTP request to the server breaks at once, while NCCL on the
    server would wait for it until the deadline (60 s here). The receive ends within a few seconds."""
    engine = _answering(tokenizer, Receiving)
    engine.gate = asyncio.Event()  # the broadcast never completes
    service = RolloutService(
        engine, local_tools, settings=_settings(tmp_path), config=RolloutConfig(weights_timeout_s=60)
    )
    ended = threading.Event()
    reasons: list[str] = []
    service.on_fatal = lambda reason: (reasons.append(reason), ended.set())
    url = http_face(service)
    with pytest.raises(httpx.TimeoutException):  # the "learner" gives up and closes its connection
        httpx.post(f"{url}/weights/broadcast", json={"version": 2, **LAYOUT}, timeout=0.5)
    assert ended.wait(10), "the receive waited on for its dead sender"
    assert "connection closed" in reasons[0]
    assert service.weights_info()["broken"] and service.weights_info()["weight_group"] is None


def test_within_ends_when_the_other_side_is_gone_and_otherwise_at_its_deadline(loop):
    from services.rollout.service import SenderGone, within

    async def forever() -> None:
        await asyncio.Event().wait()

    async def gone_after(n: list[int]) -> bool:
        n.append(1)
        return len(n) >= 2

    with pytest.raises(SenderGone):
        _on(loop, within(forever(), 30, gone=lambda n=[]: gone_after(n), poll_s=0.05), timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        _on(loop, within(forever(), 0.2), timeout=5)
    assert time.monotonic() - t0 < 2
    assert _on(loop, within(asyncio.sleep(0, result=7), 5, gone=lambda: asyncio.sleep(0, result=True))) == 7


def test_a_worker_whose_broadcast_failed_takes_no_task(redis_client, tokenizer, local_tools, loop, tmp_path):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))

    class Failing(Receiving):
        async def receive_weights(self, *args):
            raise RuntimeError("connection reset")

    service = RolloutService(_answering(tokenizer, Failing), local_tools, settings=_settings(tmp_path))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w")
    with pytest.raises(WeightsError):
        _on(loop, service.receive_weights(WeightsBroadcast(version=1, **LAYOUT)))
    assert service.weights_info()["weight_group"] is None
    assert not worker.weights_ready()


class LoadsInPlace(Receiving):
    """Loads between turns as vLLM does (no drain); its turns wait for `turns` to open, and a load from
    files fails while `failing` (a disk error after some shards went in)."""

    drains_on_update = False

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.turns = asyncio.Event()
        self.failing = True

    async def _generate(self, prompt_ids, params, request_id):
        await self.turns.wait()
        return await super()._generate(prompt_ids, params, request_id)

    async def _load_weights(self, path: str) -> None:
        if self.failing:
            raise RuntimeError("read error after 3 of 7 shards")


def test_a_group_sampled_across_a_failed_files_load_is_not_kept(
    redis_client, tokenizer, local_tools, loop, tmp_path, tiny_model
):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    engine = _answering(tokenizer, LoadsInPlace)
    service = RolloutService(engine, local_tools, settings=_settings(tmp_path))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w")

    async def load_under_a_group():
        group = asyncio.ensure_future(service.rollout(task(1)))
        await asyncio.sleep(0.1)  # the group's turns are in flight
        loaded = await asyncio.gather(
            service.update_weights(_files_version(tmp_path, tiny_model, 1)), return_exceptions=True
        )
        engine.turns.set()
        return loaded[0], (await asyncio.gather(group, return_exceptions=True))[0]

    loaded, group = _on(loop, load_under_a_group())
    assert isinstance(loaded, WeightsError) and loaded.status == 422 and "will not sample" in loaded.message
    # the group finished, but on weights a failed load may have mixed: refused, so its task is retried
    assert isinstance(group, WeightsError) and group.status == 503 and "not kept" in group.message
    assert service.broken and service.healthy and engine.policy_version == 0
    with pytest.raises(WeightsError):
        _on(loop, service.rollout(task(2)))
    # the worker takes no task while broken, and mends itself from the files announced
    engine.failing = False
    client.set(names.weights_latest, _files_version(tmp_path, tiny_model, 2).model_dump_json())
    assert worker.weights_ready()
    assert service.broken is None and engine.policy_version == 2 and not worker.fatal
