"""An external fleet's first RL step is sampled by the run's starting model, not by the model its
rollout workers were started on.

The pieces of `star train --fleet external` that decide it, for real: the learner service (runs API
over HTTP) started by the external fleet's `start_learner`, Redis, the weights store, the controller's
task publisher and a rollout worker started on model A, while the run starts from model B. The worker's
engine answers with a fingerprint of the weights it holds, so each trajectory says which model sampled it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from services.common.redis import free_port
from services.common.schemas import SamplingParams, ToolResult, TravelQuery
from services.common.settings import Settings
from services.common.streams import StreamNames, read_all
from services.common.supervisor import wait_ready
from services.controller import launcher
from services.controller.external_fleet import ExternalFleet
from services.controller.loop import learner_progress, weights_version
from services.controller.scheduler import Schedule, TaskPublisher
from services.learner.config import EngineConfig, RLConfig
from services.pipeline.external import FleetAddress
from services.rollout.engines.scripted import ScriptedEngine
from services.rollout.protocol import format_answer
from services.rollout.service import RolloutService
from services.rollout.worker import RolloutWorker, SandboxCheck
from tests.pipeline.test_train_e2e import train_env
from tests.support.waiting import until

pytestmark = pytest.mark.slow
GROUP = 2
QUERY = TravelQuery(
    id="q0",
    org="Sarasota",
    dest="Chicago",
    days=3,
    visiting_city_number=1,
    date=["2022-03-22", "2022-03-23", "2022-03-24"],
    people_number=1,
    budget=1900,
    query="A 3-day trip from Sarasota to Chicago.",
)


def fingerprint(folder: Path) -> str:
    """The sum of a model folder's embedding table: tells two random tiny models (and their copies) apart."""
    from safetensors import safe_open

    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            if "model.embed_tokens.weight" in f.keys():
                return f"{f.get_tensor('model.embed_tokens.weight').double().sum().item():.6f}"
    raise AssertionError(f"no embedding table in {folder}")


class Fingerprinted(ScriptedEngine):
    """Answers with the fingerprint of the weights it holds: the model it was started on until it loads a version."""

    def __init__(self, tokenizer, model: Path) -> None:
        super().__init__(tokenizer, lambda ids, turn: format_answer(f"Day 1: weights {self.fingerprint}"))
        self.fingerprint = fingerprint(model)

    async def _load_weights(self, path: str) -> None:
        self.fingerprint = fingerprint(Path(path))


class NoTools:
    """The scripted answers call no tool."""

    async def call(self, name, arguments, *, fault_key=None) -> ToolResult:
        raise AssertionError(f"unexpected tool call {name}")

    async def reachable(self) -> bool:
        return True

    async def close(self) -> None:
        return None


@pytest.mark.timeout(900)
def test_the_first_step_is_sampled_by_the_runs_starting_model_not_the_workers_own(
    tmp_path, redis_client, redis_server_url, loop
):
    from services.models import qwen_tokenizer, tiny_qwen2

    fleet_model, start_model = tiny_qwen2(), tiny_qwen2(seed=1)  # A: the fleet's; B: the run's (its SFT model)
    assert fingerprint(fleet_model) != fingerprint(start_model)
    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    store = tmp_path / "weights"

    # the learner service, as a deployment runs it
    spec = next(s for s in launcher.SERVICES if s.name == "learner")
    port = free_port()
    log = tmp_path / "learner.log"
    env = {**train_env(tmp_path / "learner-home"), "STAR_REDIS_URL": redis_server_url, "STAR_WEIGHTS_ROOT": str(store)}
    with open(log, "w") as out:
        service = subprocess.Popen(launcher.service_argv(spec, port), env=env, stdout=out, stderr=out)
    learner_url = f"http://127.0.0.1:{port}"
    fleet = ExternalFleet(
        FleetAddress(redis_server_url, None, learner_url, stream_prefix=names.prefix), tmp_path / "learner-run.json"
    )
    worker = None
    threads = []
    try:
        wait_ready("learner", service, learner_url, log, 120)
        # the rollout worker, started on its own model A
        engine = Fingerprinted(qwen_tokenizer(), fleet_model)
        rollout = RolloutService(engine, NoTools(), settings=Settings(weights_root=store))
        worker = RolloutWorker(rollout, client, loop, names=names, consumer="w", sandbox=SandboxCheck(lambda: True))
        threads = worker.start()

        # the controller: the RL stage's learner config starts from model B
        config = tmp_path / "rl.json"
        config.write_text(
            RLConfig(
                model=str(start_model),
                output_dir=str(tmp_path / "rl"),
                group_size=GROUP,
                batch_prompts=1,
                lr=1e-3,
                total_steps=1,
                redis_url=redis_server_url,
                stream_prefix=names.prefix,
                wait_timeout_s=600,
                read_block_ms=200,
                engine=EngineConfig(micro_batch_tokens=64),
            ).model_dump_json()
        )
        publisher = TaskPublisher(
            client,
            names,
            "run",
            Schedule((QUERY,), 1, GROUP, 1),
            SamplingParams(seed=3, max_tokens_per_turn=64, max_context_tokens=4096),
            await_start_weights=True,
        )
        assert publisher.publish_ready(0) == []  # nothing announced yet: no task may go out
        fleet.start_learner(None, config)

        # what `drive` does: publish what the learner's progress allows, with the version the fleet has
        def published() -> list[int]:
            return publisher.publish_ready(learner_progress(client, names), weights_version(client, names))

        assert until(published, 300, "the first step to go out", poll_s=0.5) == [0]
        until(lambda: client.xlen(names.trajectories) >= GROUP, 120, "the first step's trajectories")
        trajs = [data for _, data in read_all(client, names.trajectories)]
        answers = [t["messages"][-1]["content"] for t in trajs]
        assert {t["policy_version"] for t in trajs} == {0}
        assert all(f"weights {fingerprint(start_model)}" in a for a in answers), answers
        # version 0 is the run's starting model, from the fleet's store
        latest = json.loads(client.get(names.weights_latest))
        assert latest["version"] == 0 and Path(latest["uri"]) == (store / "v0").resolve()
        assert fingerprint(store / "v0") == fingerprint(start_model)
    finally:
        if worker is not None:
            worker.stop.set()
            for t in threads:
                t.join(5)
        try:
            fleet.stop_learner(timeout_s=60)
        except httpx.HTTPError:
            pass
        service.terminate()
        try:
            service.wait(30)
        except subprocess.TimeoutExpired:
            service.kill()
