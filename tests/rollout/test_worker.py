"""The rollout worker on real Redis streams: poison tasks, retries, and a worker killed mid-task."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from services.common.schemas import RolloutTask, SamplingParams, TravelQuery
from services.common.streams import StreamNames, ensure_group, publish, read_all
from services.rollout.engines.base import EngineError
from services.rollout.engines.scripted import ScriptedEngine
from services.rollout.protocol import format_answer, format_tool_call
from services.rollout.service import RolloutService
from services.rollout.worker import GROUP, RolloutWorker

QUERY = TravelQuery(
    org="Sarasota",
    dest="Chicago",
    days=3,
    visiting_city_number=1,
    date=["2022-03-22", "2022-03-23", "2022-03-24"],
    people_number=1,
    budget=1900,
    query="A 3-day trip from Sarasota to Chicago.",
)


def task(n: int, group: int = 2, **kw) -> RolloutTask:
    return RolloutTask(
        run_id="run",
        task_id=f"task-{n}",
        prompt_id=f"p-{n}",
        query=QUERY,
        group_size=group,
        sampling=SamplingParams(
            seed=n, max_tokens_per_turn=kw.pop("max_tokens", 64), max_context_tokens=kw.pop("context", 4096)
        ),
        **kw,
    )


def run_until(worker: RolloutWorker, done, timeout: float = 30.0) -> None:
    threads = worker.start()
    deadline = time.monotonic() + timeout
    try:
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.stop.set()
        for t in threads:
            t.join(5)
    assert done(), "worker did not finish in time"


def test_tasks_become_trajectories_with_task_fields_and_poison_goes_dead(redis_client, tokenizer, local_tools, loop):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    script = [format_tool_call("SearchCity", {"state": "Illinois"}), format_answer("Day 1:\nCurrent City: Chicago")]
    engine = ScriptedEngine(tokenizer, lambda ids, turn: script[min(turn, 1)])
    service = RolloutService(engine, local_tools)
    publish(
        client, names.tasks, task(1, epoch=3, step=4, reward_kind="macro", eval_mode="official", preference_penalty=0.5)
    )
    publish(client, names.tasks, {"run_id": "run", "task_id": "broken"})  # not a RolloutTask
    publish(client, names.tasks, task(2))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w", claim_idle_ms=500)
    run_until(worker, lambda: client.xlen(names.trajectories) >= 4 and client.xlen(StreamNames.dead(names.tasks)) >= 1)
    trajs = [data for _, data in read_all(client, names.trajectories)]
    assert sorted((t["task_id"], t["sample_index"]) for t in trajs) == [
        ("task-1", 0),
        ("task-1", 1),
        ("task-2", 0),
        ("task-2", 1),
    ]
    first = next(t for t in trajs if t["task_id"] == "task-1")
    assert (first["epoch"], first["step"], first["reward_kind"], first["eval_mode"]) == (3, 4, "macro", "official")
    assert first["preference_penalty"] == 0.5  # the reward worker applies it
    assert next(t for t in trajs if t["task_id"] == "task-2")["preference_penalty"] == 0.0
    assert first["query"]["org"] == "Sarasota" and first["finish_reason"] == "answer"
    dead = [data for _, data in read_all(client, StreamNames.dead(names.tasks))]
    assert len(dead) == 1 and dead[0]["payload"]["task_id"] == "broken" and "not a RolloutTask" in dead[0]["error"]
    assert client.xpending(names.tasks, GROUP)["pending"] == 0


def test_a_task_whose_samples_all_fail_is_retried_then_dead_lettered(redis_client, tokenizer, local_tools, loop):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    engine = ScriptedEngine(tokenizer, lambda ids, turn: EngineError("engine core died"))
    service = RolloutService(engine, local_tools)
    publish(client, names.tasks, task(7))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w", claim_idle_ms=200, max_deliveries=2)
    run_until(worker, lambda: client.xlen(StreamNames.dead(names.tasks)) >= 1)
    dead = read_all(client, StreamNames.dead(names.tasks))[0][1]
    assert dead["deliveries"] == 2 and "engine core died" in dead["error"]
    assert client.xlen(names.trajectories) == 0 and len(engine.calls) == 4  # 2 attempts × 2 samples


def test_the_worker_loads_newer_announced_weights_before_a_task(
    redis_client, tokenizer, local_tools, loop, tmp_path, tiny_model
):
    import shutil

    from services.common.schemas import WeightsUpdate
    from services.common.settings import Settings
    from services.weights.manifest import write_manifest

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    version = tmp_path / "weights" / "v3"
    shutil.copytree(tiny_model, version)
    sha = write_manifest(version, 3)
    client.set(names.weights_latest, WeightsUpdate(version=3, uri=str(version), sha256=sha).model_dump_json())
    engine = ScriptedEngine(tokenizer, lambda ids, turn: format_answer("Day 1:"))
    service = RolloutService(engine, local_tools, settings=Settings(weights_root=tmp_path / "weights"))
    publish(client, names.tasks, task(3, min_policy_version=3))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w")
    run_until(worker, lambda: client.xlen(names.trajectories) >= 2)
    trajs = [d for _, d in read_all(client, names.trajectories)]
    assert engine.policy_version == 3 and {t["policy_version"] for t in trajs} == {3}


def _announce(client, names: StreamNames, folder, version: int, sha: str | None = None) -> None:
    from services.common.schemas import WeightsUpdate
    from services.weights.manifest import write_manifest

    written = write_manifest(folder, version)
    client.set(
        names.weights_latest, WeightsUpdate(version=version, uri=str(folder), sha256=sha or written).model_dump_json()
    )


def test_a_worker_started_on_another_model_loads_the_runs_version_0_before_it_samples(
    redis_client, tokenizer, local_tools, loop, tmp_path, tiny_model
):
    """An external fleet's worker runs the model it was started with; the run announces its starting
    weights as version 0. The same number is no reason to skip them: every sample is drawn by them."""
    import shutil

    from services.common.settings import Settings

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    start = tmp_path / "weights" / "v0"
    shutil.copytree(tiny_model, start)
    _announce(client, names, start, 0)
    engine = ScriptedEngine(tokenizer, lambda ids, turn: format_answer(f"Day 1: {engine.weights_path}"))
    service = RolloutService(engine, local_tools, settings=Settings(weights_root=tmp_path / "weights"))
    publish(client, names.tasks, task(1, min_policy_version=0))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w")
    run_until(worker, lambda: client.xlen(names.trajectories) >= 2)
    trajs = [d for _, d in read_all(client, names.trajectories)]
    assert service.loaded_version == 0 and engine.weights_path == str(start)
    assert {t["policy_version"] for t in trajs} == {0}
    assert all(f"Day 1: {start}" in t["messages"][-1]["content"] for t in trajs), [t["messages"][-1] for t in trajs]


def test_a_worker_that_cannot_load_the_announced_version_does_not_sample_with_its_own_model(
    redis_client, tokenizer, local_tools, loop, tmp_path, tiny_model
):
    import shutil

    from services.common.settings import Settings

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    start = tmp_path / "weights" / "v0"
    shutil.copytree(tiny_model, start)
    _announce(client, names, start, 0, sha="0" * 64)  # its manifest does not match: not loadable
    engine = ScriptedEngine(tokenizer, lambda ids, turn: format_answer("Day 1:"))
    service = RolloutService(engine, local_tools, settings=Settings(weights_root=tmp_path / "weights"))
    publish(client, names.tasks, task(2, min_policy_version=0))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w", claim_idle_ms=200, max_deliveries=2)
    run_until(worker, lambda: client.xlen(StreamNames.dead(names.tasks)) >= 1)
    dead = read_all(client, StreamNames.dead(names.tasks))[0][1]
    assert "announced but not loaded" in dead["error"], dead
    assert client.xlen(names.trajectories) == 0 and engine.calls == []


def test_checking_new_weights_does_not_hold_the_event_loop(tokenizer, local_tools, tmp_path, tiny_model, monkeypatch):
    """The check hashes every file of the version (hundreds of MB): on the loop it stalled every
    agent of the worker."""
    import shutil

    from services.common.schemas import WeightsUpdate
    from services.common.settings import Settings
    from services.rollout import service as service_module
    from services.weights.manifest import write_manifest

    version = tmp_path / "weights" / "v1"
    shutil.copytree(tiny_model, version)
    checked_on: list[int] = []
    check = service_module.check_weights

    def recording(*args):
        checked_on.append(threading.get_ident())
        return check(*args)

    monkeypatch.setattr(service_module, "check_weights", recording)
    service = RolloutService(
        ScriptedEngine(tokenizer, ["x"]), local_tools, settings=Settings(weights_root=tmp_path / "weights")
    )

    async def update() -> int:
        await service.update_weights(WeightsUpdate(version=1, uri=str(version), sha256=write_manifest(version, 1)))
        return threading.get_ident()

    loop_thread = asyncio.run(update())
    assert service.engine.policy_version == 1 and checked_on and loop_thread not in checked_on


def test_a_task_waiting_on_a_slow_weights_load_is_not_taken_by_a_second_worker(
    redis_client, tokenizer, local_tools, loop, tmp_path, tiny_model
):
    """Loading weights can outlast the claim timeout (a draining engine waits for its longest turn):
    the task must be heartbeated meanwhile, or another worker claims it and rolls it out again."""
    import shutil

    from services.common.schemas import WeightsUpdate
    from services.common.settings import Settings
    from services.weights.manifest import write_manifest

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    version = tmp_path / "weights" / "v1"
    shutil.copytree(tiny_model, version)
    client.set(
        names.weights_latest,
        WeightsUpdate(version=1, uri=str(version), sha256=write_manifest(version, 1)).model_dump_json(),
    )

    class SlowLoad(ScriptedEngine):
        async def _load_weights(self, path: str) -> None:
            await asyncio.sleep(1.5)  # three claim timeouts

    workers = []
    for name in ("slow", "idle"):
        engine = SlowLoad(tokenizer, lambda ids, turn: format_answer("Day 1:"))
        service = RolloutService(engine, local_tools, settings=Settings(weights_root=tmp_path / "weights"))
        if name == "idle":
            engine.policy_version = service.loaded_version = 1  # up to date: free to claim what looks abandoned
        workers.append(RolloutWorker(service, client, loop, names=names, consumer=name, claim_idle_ms=500))
    publish(client, names.tasks, task(5, min_policy_version=1))
    threads = workers[0].start()  # the slow worker reads the task first ...
    try:
        deadline = time.monotonic() + 10
        while not client.xpending(names.tasks, GROUP)["pending"] and time.monotonic() < deadline:
            time.sleep(0.02)
        run_until(
            workers[1],
            lambda: client.xlen(names.trajectories) >= 2 and client.xpending(names.tasks, GROUP)["pending"] == 0,
            timeout=15,
        )  # ... the other looks on
        time.sleep(0.5)
    finally:
        workers[0].stop.set()
        for t in threads:
            t.join(5)
    trajs = [d for _, d in read_all(client, names.trajectories)]
    assert sorted(t["sample_index"] for t in trajs) == [0, 1]  # one rollout, not two
    assert {t["policy_version"] for t in trajs} == {1}


def test_a_broken_engine_stops_its_worker_for_a_restart_instead_of_burying_tasks(
    redis_client, tokenizer, local_tools, loop, tiny_model
):
    """Ticks failing on every try (a CUDA error that repeats) must not fail task after task until
    each is dead-lettered: the worker stops, and its task stays pending for another worker."""
    from services.rollout.engines.hf import BROKEN_AFTER, TransformersEngine

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    engine = TransformersEngine(tiny_model, max_model_len=4096)

    def broken(batch):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    engine._decode_step = broken
    service = RolloutService(engine, local_tools)
    publish(client, names.tasks, task(8))
    worker = RolloutWorker(service, client, loop, names=names, consumer="w", claim_idle_ms=200, max_deliveries=20)
    run_until(worker, lambda: worker.stop.is_set())
    asyncio.run_coroutine_threadsafe(engine.close(), loop).result(5)
    assert worker.fatal and not engine.healthy and engine.failed_ticks >= BROKEN_AFTER
    assert client.xlen(StreamNames.dead(names.tasks)) == 0  # not buried:
    assert client.xpending(names.tasks, GROUP)["pending"] == 1  # left for a healthy worker
    assert client.xlen(names.trajectories) == 0


def _spawn_worker(env: dict[str, str], name: str, log_dir) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "services.rollout.worker"],
        env={**env, "STAR_ROLLOUT_CONSUMER": name},
        stdout=log,
        stderr=log,
    )


@pytest.mark.slow
def test_kill_9_mid_task_another_worker_finishes_it_nothing_lost_or_duplicated(
    redis_server_url, redis_client, official_world_url, tiny_model, tmp_path
):
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    env = {
        **os.environ,
        "STAR_REDIS_URL": redis_server_url,
        "STAR_STREAM_PREFIX": names.prefix,
        "STAR_DB_URL": official_world_url,
        "STAR_MODEL": str(tiny_model),
        "STAR_ROLLOUT_ENGINE": "transformers",
        "STAR_ROLLOUT_TOOLS": "local",
        "STAR_ROLLOUT_CLAIM_IDLE_MS": "1500",
        "STAR_ROLLOUT_CONCURRENCY": "1",
        "STAR_ROLLOUT_MAX_MODEL_LEN": "4096",
        "STAR_LOG_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
    }
    tasks = [task(n, group=2, max_tokens=48) for n in range(3)]
    ensure_group(client, names.tasks, GROUP)
    entry_task = {publish(client, names.tasks, t): t.task_id for t in tasks}
    victim = _spawn_worker(env, "victim", tmp_path)
    try:
        # Wait until the victim holds a task it has not finished, then kill it without warning.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            held = client.xpending_range(names.tasks, GROUP, min="-", max="+", count=10, consumername="victim-0")
            if held:
                break
            assert victim.poll() is None, (tmp_path / "victim.log").read_text()[-2000:]
            time.sleep(0.05)
        assert held, "the victim never took a task"
        time.sleep(0.3)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        done_before = client.xlen(names.trajectories)
        assert done_before < 2 * len(tasks)
        rescuer = _spawn_worker(env, "rescuer", tmp_path)
        try:
            deadline = time.monotonic() + 240
            while client.xlen(names.trajectories) < 2 * len(tasks) and time.monotonic() < deadline:
                assert rescuer.poll() is None, (tmp_path / "rescuer.log").read_text()[-2000:]
                time.sleep(0.2)
            time.sleep(2.0)  # anything duplicated would land now
        finally:
            rescuer.send_signal(signal.SIGTERM)
            rescuer.wait(30)
    finally:
        if victim.poll() is None:
            victim.kill()
    trajs = [d for _, d in read_all(client, names.trajectories)]
    keys = sorted((t["task_id"], t["sample_index"]) for t in trajs)
    assert keys == sorted((t.task_id, i) for t in tasks for i in range(2)), keys
    assert client.xpending(names.tasks, GROUP)["pending"] == 0
    assert client.xlen(StreamNames.dead(names.tasks)) == 0
    # The task the victim held was finished (by the rescuer, as the victim is dead).
    held_id = held[0]["message_id"]
    held_task = entry_task[held_id.decode() if isinstance(held_id, bytes) else held_id]
    assert sum(t["task_id"] == held_task for t in trajs) == 2
    assert all(len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) for t in trajs)


@pytest.fixture(scope="module")
def synthetic_world_url(tmp_path_factory):
    from services.sandbox.world.build import build_synthetic_world

    url = f"sqlite:///{tmp_path_factory.mktemp('world') / 'tiny.sqlite'}"
    build_synthetic_world(url, size="tiny", seed=0)
    return url


def test_while_the_sandbox_is_down_the_worker_takes_no_task_and_checks_it_with_backoff(
    redis_client, tokenizer, loop, synthetic_world_url, tmp_path
):
    from services.controller.launcher import ServiceProcess
    from services.rollout.tools import HttpToolClient
    from services.rollout.worker import SandboxCheck

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    sandbox = ServiceProcess(
        "sandbox",
        "services.sandbox.app:create_app",
        {"STAR_DB_URL": synthetic_world_url, "STAR_LOG_LEVEL": "WARNING"},
        tmp_path,
    ).start()
    script = [format_tool_call("SearchCity", {"state": "Illinois"}), format_answer("Day 1:\nCurrent City: Chicago")]
    engine = ScriptedEngine(tokenizer, lambda ids, turn: script[min(turn, 1)])
    service = RolloutService(engine, HttpToolClient(sandbox.url, retries=0))
    check = SandboxCheck(
        lambda: asyncio.run_coroutine_threadsafe(service.tools.reachable(), loop).result(),
        ttl_s=0.2,
        backoff_s=0.2,
        max_backoff_s=1.0,
    )
    worker = RolloutWorker(
        service, client, loop, names=names, consumer="w", claim_idle_ms=500, block_ms=200, sandbox=check
    )
    threads = worker.start()
    try:
        publish(client, names.tasks, task(1))
        wait_for(lambda: client.xlen(names.trajectories) >= 2)
        sandbox.stop()
        wait_for(lambda: not worker.sandbox.up())
        time.sleep(0.5)  # a read that was already waiting (block_ms) when the sandbox went ends first
        probes = worker.sandbox.probes
        publish(client, names.tasks, task(2))
        time.sleep(4.0)
        # nothing claimed: the task is neither pending nor handed to the engine, and no sample failed
        assert client.xpending(names.tasks, GROUP)["pending"] == 0 and worker.handled == 1
        assert client.xlen(names.trajectories) == 2 and client.xlen(StreamNames.dead(names.tasks)) == 0
        # backing off: 0.2, 0.4, 0.8, 1, 1 s between checks, not a check per read
        assert 3 <= worker.sandbox.probes - probes <= 7, worker.sandbox.probes - probes
        sandbox.start()  # the same port again
        wait_for(lambda: client.xlen(names.trajectories) >= 4)
    finally:
        worker.stop.set()
        for t in threads:
            t.join(5)
        sandbox.stop()
    trajs = [d for _, d in read_all(client, names.trajectories)]
    assert sorted(t["task_id"] for t in trajs) == ["task-1", "task-1", "task-2", "task-2"]
    assert {t["finish_reason"] for t in trajs} == {"answer"}


def wait_for(done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
