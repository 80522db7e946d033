"""`star train --fleet external` against a fleet it did not start: Redis, the sandbox, rollout and reward
workers (as the RL stage starts them) and the learner service with its runs API, all started here. The
controller starts the RL run on the learner service, publishes the steps (the first once the learner has
announced the SFT model as version 0: the workers were started on the base model), validates, writes the
report, and leaves the fleet running; SIGTERM stops its learner run and nothing else; a controller killed
outright is replaced by one that re-attaches to its learner run (going on, or finished meanwhile) rather
than start another."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import redis

from services.common.redis import free_port
from services.common.streams import StreamNames
from services.common.supervisor import wait_ready
from services.controller import launcher
from services.controller.embedded_fleet import EmbeddedFleet, start_fleet
from services.controller.train import prepare_model
from services.pipeline.config import load_pipeline_config
from services.pipeline.stage import Run
from tests.pipeline.test_train_e2e import _train, train_argv, train_env
from tests.support.waiting import until

pytestmark = pytest.mark.slow
TOKEN = "fleet-token"
PREFIX = "fleet"
SMALL = [
    "--set",
    "sft.max_steps=1",
    "--set",
    "rl.max_steps=2",
    "--set",
    "rl.val_every=1",
    "--set",
    "synth.heldout_queries=2",
    "--set",
    "eval.limit=1",
    "--set",
    "eval.sampling.max_tool_calls=2",
]
RL = [*SMALL, "--stage", "rl", "--stage", "eval", "--fleet", "external"]


def _start_learner_service(f: EmbeddedFleet, folder: Path, home: Path) -> str:
    """The learner service beside the fleet, as a deployment runs it (its own home, token and weights store)."""
    spec = next(s for s in launcher.SERVICES if s.name == "learner")
    port = free_port()
    env = {
        **train_env(home),
        "STAR_REDIS_URL": f.redis_url,
        "STAR_API_TOKEN": TOKEN,
        "STAR_WEIGHTS_ROOT": str(folder / "weights"),
    }
    child = f.sup.add("learner-service", launcher.service_argv(spec, port), env, folder / "logs" / "learner.log")
    url = f"http://127.0.0.1:{port}"
    wait_ready("learner", child.proc, url, child.log, 120)
    return url


def _same_weights(a: str | Path, b: str | Path) -> bool:
    import torch

    from services.weights.files import load_state_dict

    x, y = load_state_dict(Path(a)), load_state_dict(Path(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _learner_runs(url: str) -> dict[str, dict]:
    return {r["id"]: r for r in httpx.get(f"{url}/runs", timeout=10).json()}


def _recorded(run: Path) -> str | None:
    path = run / "learner-run.json"
    return json.loads(path.read_text())["id"] if path.is_file() else None


def _running(url: str, run_id: str) -> bool:
    return _learner_runs(url).get(run_id, {}).get("state") == "running"


def _assert_fleet_runs(f: EmbeddedFleet, learner_url: str) -> None:
    assert all(child.exited() is None for child in f.sup.children.values()), {
        name: child.exited() for name, child in f.sup.children.items()
    }
    assert redis.Redis.from_url(f.redis_url).ping()
    for url in (f.sandbox_url, learner_url):
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200


def _stop_learner_runs(url: str) -> None:
    """Teardown: a learner run outlives its service by design; a failing test must not leave one."""
    try:
        for run_id, r in _learner_runs(url).items():
            if r["state"] in ("starting", "running"):
                httpx.post(f"{url}/runs/{run_id}/stop", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
        until(
            lambda: all(r["state"] not in ("starting", "running") for r in _learner_runs(url).values()),
            120,
            "the learner runs to stop",
            poll_s=0.5,
        )
    except (httpx.HTTPError, AssertionError):
        pass


@pytest.mark.timeout(2400)
def test_star_train_drives_a_fleet_it_did_not_start(tmp_path):
    home, run = tmp_path / "home", tmp_path / "run"
    prep = _train(home, run, *SMALL, "--stage", "synth", "--stage", "sft")
    assert prep.returncode == 0, prep.stderr[-3000:]
    sft_model = json.loads((run / "stages.json").read_text())["sft"]["outputs"]["model"]

    # the fleet, started the way the RL stage starts its own, but by us: its rollout workers start on the
    # recipe's base model, not on the SFT model the RL stage starts from
    folder = tmp_path / "fleet"
    world = f"sqlite:///{run / 'world.sqlite'}"
    recipe = load_pipeline_config(run / "config.yaml")
    base_model = prepare_model(recipe)
    assert not _same_weights(base_model, sft_model)
    deployment = Run(
        recipe, folder, world_url=world, env={"STAR_HOME": str(home), "STAR_DB_URL": world, "STAR_LOG_JSON": "false"}
    )
    f = start_fleet(deployment, base_model, StreamNames(PREFIX))
    learner_url = ""
    try:
        learner_url = _start_learner_service(f, folder, tmp_path / "learner-home")
        env = {
            "STAR_REDIS_URL": f.redis_url,
            "STAR_SANDBOX_URL": f.sandbox_url,
            "STAR_LEARNER_URL": learner_url,
            "STAR_DB_URL": world,  # the fleet's world, which the controller takes
            "STAR_STREAM_PREFIX": PREFIX,
            "STAR_API_TOKEN": TOKEN,
        }
        password = redis.Redis.from_url(f.redis_url).connection_pool.connection_kwargs["password"]

        # SIGTERM: the controller stops the learner run it started, and nothing of the fleet
        with open(tmp_path / "first.log", "w") as log:
            controller = subprocess.Popen(train_argv(run, *RL), env=train_env(home, env), stdout=log, stderr=log)
            first = until(lambda: _recorded(run), 300, "the first learner run", poll_s=0.5)
            until(lambda: _running(learner_url, first), 300, "the first learner run to train", poll_s=0.5)
            controller.send_signal(signal.SIGTERM)
            assert controller.wait(300) == 130, (tmp_path / "first.log").read_text()[-3000:]
        # (the controller waits a bounded while for the learner to finish its step and checkpoint)
        stopped = until(
            lambda: _learner_runs(learner_url)[first]["state"] not in ("starting", "running"),
            300,
            "the first learner run to stop",
            poll_s=0.5,
        )
        assert stopped and _learner_runs(learner_url)[first]["state"] == "stopped"
        _assert_fleet_runs(f, learner_url)

        # killed outright, a controller leaves its learner run going: the next one re-attaches to it
        with open(tmp_path / "second.log", "w") as log:
            controller = subprocess.Popen(train_argv(run, *RL), env=train_env(home, env), stdout=log, stderr=log)
            second = until(
                lambda: _recorded(run) not in (None, first) and _recorded(run),
                300,
                "the second learner run",
                poll_s=0.5,
            )
            until(lambda: _running(learner_url, second), 300, "the second learner run to train", poll_s=0.5)
            controller.kill()
            controller.wait(30)
        done = _train(home, run, *RL, fleet=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"re-attached to learner run {second}" in " ".join(done.stderr.split()), done.stderr[-3000:]
        runs = _learner_runs(learner_url)
        assert set(runs) == {first, second} and runs[second]["state"] == "finished", runs  # no third run

        # the steps were trained by the fleet's workers and the learner service, once each
        stages = json.loads((run / "stages.json").read_text())
        rl = stages["rl"]["outputs"]
        assert stages["rl"]["state"] == stages["eval"]["state"] == "done"
        assert (rl["ended"], rl["steps_trained"], rl["learner_run"]) == ("done", 2, second)
        metrics = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2] and [m["samples_in"] for m in metrics] == [4.0, 4.0]
        assert rl["last_version"] == 2
        # the weights went to the fleet's store, which its rollout workers read, not into the run folder
        latest = json.loads(redis.Redis.from_url(f.redis_url).get(f"{PREFIX}:weights:latest"))
        assert latest["version"] == 2 and Path(latest["uri"]).is_relative_to(folder / "weights")
        # version 0, which the workers loaded before the first step, is the SFT model the stage started from
        assert _same_weights(folder / "weights" / "v0", sft_model)
        assert not (run / "weights").exists()
        # validated: the starting model and the final version (a version published while no controller ran
        # is not looked back for)
        history = json.loads((run / "validation" / "history.json").read_text())
        assert {0, 2} <= {h["version"] for h in history}
        report = (run / "report.md").read_text()
        assert "## RL" in report and "## Evaluation" in report
        assert password not in done.stderr + done.stdout + (tmp_path / "first.log").read_text()

        # and the fleet it did not start is still running
        _assert_fleet_runs(f, learner_url)
    finally:
        if learner_url:
            _stop_learner_runs(learner_url)
        f.stop()
