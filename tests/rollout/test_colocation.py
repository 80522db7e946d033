"""Colocation's protocol on CPU: a rollout server that sleeps for the learner's step (holding new turns,
draining those in flight), wakes with weights by 'CUDA IPC', refuses what it cannot do; and the learner's
side, which refuses to train when a server does not sleep. vLLM's sleep mode needs a GPU
(bench/colocate_gpu.py runs the real one); here an engine that records what it is asked stands in."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from services.common.schemas import IpcWeights, SleepRequest, VllmArgs, WakeRequest
from services.common.settings import Settings
from services.learner.colocate import ColocatedServers, ColocatedSync, ColocationError
from services.rollout.app import create_app
from services.rollout.engines.base import TurnParams
from services.rollout.engines.scripted import ScriptedEngine
from services.rollout.engines.vllm_engine import engine_kwargs
from services.rollout.service import RolloutService

CHUNK = {
    "names": ["model.norm.weight"],
    "dtype_names": ["bfloat16"],
    "shapes": [[64]],
    "tensor_sizes": [128],
    "handles": "aGFuZGxl",
}


class Sleepy(ScriptedEngine):
    """A scripted engine with vLLM's sleep-mode surface: it records sleeps, wakes and IPC chunks; a turn
    can be made to block (`gate`) to stand for a long turn in flight."""

    def __init__(self, tokenizer, script, **kw) -> None:
        super().__init__(tokenizer, script, **kw)
        self.events: list[tuple] = []
        self.gate: asyncio.Event | None = None

    @property
    def supports_sleep(self) -> bool:
        return True

    async def _generate(self, prompt_ids, params, request_id):
        if self.gate is not None:
            await self.gate.wait()
        return await super()._generate(prompt_ids, params, request_id)

    async def sleep(self, level: int) -> None:
        self.events.append(("sleep", level))

    async def wake(self, tags=None) -> None:
        self.events.append(("wake", tuple(tags or ())))

    async def receive_ipc(self, chunk, *, first, last, version):
        self.events.append(("ipc", version, first, last, tuple(chunk["names"])))
        if not last:
            return {}
        return await self.load_version(version, f"ipc:v{version}", lambda: asyncio.sleep(0))


def service(engine, local_tools, tmp_path) -> RolloutService:
    settings = Settings(home=tmp_path, weights_root=tmp_path / "weights", log_json=False, log_level="WARNING")
    return RolloutService(engine, local_tools, settings=settings)


PARAMS = TurnParams(max_tokens=8)


def test_a_server_whose_engine_cannot_sleep_says_so(tokenizer, local_tools, tmp_path):
    settings = Settings(home=tmp_path, weights_root=tmp_path / "weights", log_json=False, log_level="WARNING")
    svc = RolloutService(ScriptedEngine(tokenizer, ["x"]), local_tools, settings=settings)
    with TestClient(create_app(settings, service=svc)) as client:
        assert client.get("/weights").json()["can_sleep"] is False
        r = client.post("/sleep", json={"level": 1, "timeout_s": 5})
        assert r.status_code == 409 and "cannot sleep" in r.text
        r = client.post("/weights/ipc", json={"version": 1, **CHUNK, "first": True})
        assert r.status_code == 409 and "CUDA IPC" in r.text


@pytest.mark.parametrize("drains_on_update", [True, False], ids=["draining", "in-place (vLLM)"])
def test_sleep_holds_new_turns_until_the_engine_is_awake_with_the_new_version(
    tokenizer, local_tools, tmp_path, drains_on_update
):
    async def go() -> None:
        engine = Sleepy(tokenizer, ["hello"] * 4)
        engine.drains_on_update = drains_on_update
        svc = service(engine, local_tools, tmp_path)
        reply = await svc.sleep(SleepRequest(level=1, timeout_s=5))
        assert reply["slept"] and reply["asleep"] and engine.events == [("sleep", 1)]
        held = asyncio.ensure_future(engine.generate([1, 2, 3], PARAMS, "t"))
        await asyncio.sleep(0.05)
        assert not held.done()  # no new turn on a sleeping engine
        await svc.wake(WakeRequest(tags=["weights"]))
        await svc.receive_ipc(IpcWeights(version=1, **CHUNK, first=True))
        out = await svc.receive_ipc(IpcWeights(version=1, last=True))
        assert out["version"] == 1 and svc.weights_info()["version"] == 1
        await asyncio.sleep(0.05)
        assert not held.done()  # loaded, but the KV cache still asleep: the turn waits for the wake
        await svc.wake(WakeRequest())
        gen = await asyncio.wait_for(held, 2)
        assert gen.policy_version == 1  # the held turn ran on the new weights
        assert engine.events == [
            ("sleep", 1),
            ("wake", ("weights",)),
            ("ipc", 1, True, False, ("model.norm.weight",)),
            ("ipc", 1, False, True, ()),
            ("wake", ("kv_cache",)),
        ]
        assert not svc.sleep_state.asleep

    asyncio.run(go())


def test_a_turn_that_outlasts_the_sleep_deadline_keeps_the_engine_awake(tokenizer, local_tools, tmp_path):
    from services.weights.manifest import WeightsError

    async def go() -> None:
        engine = Sleepy(tokenizer, ["hello"] * 4)
        engine.gate = asyncio.Event()
        svc = service(engine, local_tools, tmp_path)
        long_turn = asyncio.ensure_future(engine.generate([1, 2], PARAMS, "long"))
        await asyncio.sleep(0.01)
        with pytest.raises(WeightsError) as err:
            await svc.sleep(SleepRequest(level=2, timeout_s=0.1))
        assert err.value.status == 503 and "1 turn(s) still in flight" in err.value.message
        assert not svc.sleep_state.asleep and ("sleep", 2) not in engine.events
        engine.gate.set()  # the engine serves as before: the long turn and new ones finish
        await asyncio.wait_for(long_turn, 2)
        await asyncio.wait_for(engine.generate([1], PARAMS, "next"), 2)

    asyncio.run(go())


def test_an_asleep_server_refuses_other_weight_loads_and_out_of_order_chunks(tokenizer, local_tools, tmp_path):
    settings = Settings(home=tmp_path, weights_root=tmp_path / "weights", log_json=False, log_level="WARNING")
    svc = RolloutService(Sleepy(tokenizer, ["x"]), local_tools, settings=settings)
    with TestClient(create_app(settings, service=svc)) as client:
        assert client.post("/sleep", json={"level": 1, "timeout_s": 5}).status_code == 200
        r = client.post("/weights", json={"version": 1, "uri": "v1", "sha256": "0" * 64})
        assert r.status_code == 409 and "asleep" in r.text  # never loaded into freed memory
        r = client.post(
            "/weights/broadcast", json={"version": 1, "names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[1]]}
        )
        assert r.status_code == 409 and "asleep" in r.text
        r = client.post("/weights/ipc", json={"version": 1, **CHUNK, "first": True})
        assert r.status_code == 409 and "weights are asleep" in r.text
        assert client.post("/wake", json={"tags": ["weights"]}).status_code == 200
        r = client.post("/weights/ipc", json={"version": 1, **CHUNK})
        assert r.status_code == 409 and "without its first chunk" in r.text
        assert client.post("/weights/ipc", json={"version": 1, **CHUNK, "first": True}).status_code == 200
        r = client.post("/wake", json={"tags": None})
        assert r.status_code == 409 and "still loading" in r.text
        assert client.post("/weights/ipc", json={"version": 1, "last": True}).status_code == 200
        assert client.post("/wake", json={}).json()["asleep"] is False
        bad = client.post("/weights/ipc", json={"version": 2, "names": ["a"]})
        assert bad.status_code == 422


class Routed:
    """ColocatedServers' transport over in-process apps: url → TestClient."""

    def __init__(self, clients: dict[str, TestClient]) -> None:
        self.clients = clients
        self.calls: list[tuple[str, str]] = []

    def __call__(self, url: str, path: str, body, timeout_s: float):
        self.calls.append((url, path))
        r = self.clients[url].post(path, json=body)
        if r.status_code >= 300:
            raise ColocationError(f"{url}{path}: HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    def get(self, url: str, path: str):
        return self.clients[url].get(path).json()

    def servers(self, **kw) -> ColocatedServers:
        return ColocatedServers(list(self.clients), post=self, get=self.get, **kw)


@pytest.fixture
def two_servers(tokenizer, local_tools, tmp_path):
    def make(second_sleeps: bool = True):
        settings = Settings(home=tmp_path, weights_root=tmp_path / "weights", log_json=False, log_level="WARNING")
        engines = [Sleepy(tokenizer, ["x"] * 4), (Sleepy if second_sleeps else ScriptedEngine)(tokenizer, ["x"] * 4)]
        services = [RolloutService(e, local_tools, settings=settings) for e in engines]
        return (
            engines,
            services,
            {f"http://s{i}": TestClient(create_app(settings, service=s)) for i, s in enumerate(services)},
        )

    return make


def test_the_learner_refuses_to_train_when_a_server_does_not_sleep(two_servers):
    engines, services, clients = two_servers(second_sleeps=False)
    with clients["http://s0"], clients["http://s1"]:
        sync = ColocatedSync(None, Routed(clients).servers(timeout_s=5))
        with pytest.raises(ColocationError) as err:
            sync.sleep()
        message = str(err.value)
        assert "refusing to train" in message and "http://s1" in message and "cannot sleep" in message
        assert not sync.asleep
        assert engines[0].events == [("sleep", 1), ("wake", ("weights", "kv_cache"))]  # the one that slept woke again
        assert not services[0].sleep_state.asleep


def test_a_step_sleeps_every_server_then_wakes_it_with_the_version_by_ipc(two_servers):
    engines, services, clients = two_servers()

    def chunks(tensors, buffer_bytes):  # vLLM's packed IPC producer stands in: two chunks, no CUDA
        names = [n for n, _ in tensors]
        for part in (names[:1], names[1:]):
            yield {
                "names": part,
                "dtype_names": ["float32"] * len(part),
                "shapes": [[1]] * len(part),
                "tensor_sizes": [4] * len(part),
                "handles": "aGFuZGxl",
            }

    import torch

    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    with clients["http://s0"], clients["http://s1"]:
        sync = ColocatedSync(None, Routed(clients).servers(level=2, timeout_s=5), files_every=100, chunks=chunks)
        slept = sync.sleep()
        assert sync.asleep and "colocate_sleep_s" in slept
        assert all(s.sleep_state.level == 2 for s in services)
        metrics = sync.publish(3, model, zero3=False, buckets=lambda: iter(()), config=None, source_dir=None)
        assert {"colocate_wake_s", "colocate_weights_s", "time_sync_s"} <= set(metrics)
        for engine, svc in zip(engines, services):
            kinds = [e[0] for e in engine.events]
            assert kinds == ["sleep", "wake", "ipc", "ipc", "ipc", "wake"]
            assert [e[2:4] for e in engine.events if e[0] == "ipc"] == [(True, False), (False, False), (False, True)]
            assert svc.weights_info()["version"] == 3 and not svc.sleep_state.asleep
        assert sync.wake(None) == {}  # awake already: nothing to do


def test_a_batch_without_gradient_wakes_the_engines_as_they_were(two_servers):
    engines, services, clients = two_servers()
    with clients["http://s0"], clients["http://s1"]:
        sync = ColocatedSync(None, Routed(clients).servers(timeout_s=5))
        sync.sleep()
        assert "colocate_wake_s" in sync.wake(None)
        assert all(not s.sleep_state.asleep and s.weights_info()["version"] == 0 for s in services)


def test_vllm_engines_start_able_to_sleep_on_a_gpu_only():
    args = VllmArgs(enable_sleep_mode=True)
    gpu = engine_kwargs(args, model="m", max_model_len=1024, dtype="bfloat16", seed=0, on_cpu=False)
    cpu = engine_kwargs(args, model="m", max_model_len=1024, dtype="bfloat16", seed=0, on_cpu=True)
    assert gpu["enable_sleep_mode"] is True and "enable_sleep_mode" not in cpu
    assert "enable_sleep_mode" not in engine_kwargs(
        VllmArgs(), model="m", max_model_len=1024, dtype="bfloat16", seed=0, on_cpu=False
    )


def test_a_new_learner_wakes_servers_left_asleep_and_a_level_2_one_restarts(two_servers):
    engines, services, clients = two_servers()
    ended: list[str] = []
    services[1].on_fatal = ended.append
    with clients["http://s0"], clients["http://s1"]:
        ColocatedSync(None, Routed({"http://s0": clients["http://s0"]}).servers(level=1)).sleep()
        ColocatedSync(None, Routed({"http://s1": clients["http://s1"]}).servers(level=2)).sleep()
        assert all(s.sleep_state.asleep for s in services)  # the learner that slept them died here
        ColocatedSync(None, Routed(clients).servers())  # its successor starts
        assert not services[0].sleep_state.asleep and services[0].broken is None  # level 1: its weights came back
        assert ended and "weights are gone" in ended[0]  # level 2: nothing to sample on, the process ends
        assert services[1].broken and not services[1].healthy


def test_a_server_restarting_is_waited_for_before_the_step_not_refused(two_servers, monkeypatch):
    """A server its supervisor is restarting refuses connections until its engine is up: the learner
    keeps asking within sleep_timeout_s, then refuses, naming it, once that has passed."""
    import httpx

    from services.learner import colocate

    monkeypatch.setattr(colocate, "CONNECT_RETRY_S", 0.05)
    engines, services, clients = two_servers()
    with clients["http://s0"], clients["http://s1"]:
        routed = Routed(clients)
        refusals = {"left": 3}

        def restarting(url, path, body, timeout_s):
            if url == "http://s1" and refusals["left"]:
                refusals["left"] -= 1
                raise httpx.ConnectError("[Errno 111] Connection refused")
            return routed(url, path, body, timeout_s)

        sync = ColocatedSync(None, ColocatedServers(list(clients), post=restarting, get=routed.get, timeout_s=5))
        assert "colocate_sleep_s" in sync.sleep()
        assert refusals["left"] == 0 and all(s.sleep_state.asleep for s in services)
        sync.wake(None)

        def down(url, path, body, timeout_s):
            if url == "http://s1":
                raise httpx.ConnectError("[Errno 111] Connection refused")
            return routed(url, path, body, timeout_s)

        gone = ColocatedSync(None, ColocatedServers(list(clients), post=down, get=routed.get, timeout_s=0.3))
        with pytest.raises(ColocationError, match="http://s1: \\[Errno 111\\] Connection refused"):
            gone.sleep()
        assert not services[0].sleep_state.asleep  # the one that slept was woken again
