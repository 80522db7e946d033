"""One world and one model for an external run: the controller takes the fleet's world (its sandbox and
its scorer must read the same one, and so must the controller), refuses a recipe naming another world,
naming both, and refuses a starting model the fleet's engines cannot load, saying what to set. The
sandbox, reward and rollout services are the real ones, over HTTP."""

from __future__ import annotations

import pytest

from services.common.redis import free_port
from services.common.supervisor import Supervisor, wait_ready
from services.controller import launcher
from services.pipeline.config import WorldSpec
from services.pipeline.external import FleetAddress, engines_take, fleet_world
from services.pipeline.stage import StageFailed
from tests.pipeline.test_train_e2e import train_env


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Two built worlds: synthetic tiny and synthetic small, seed 0."""
    from services.sandbox.world.build import build_synthetic_world

    folder = tmp_path_factory.mktemp("worlds")
    urls = {size: f"sqlite:///{folder / f'{size}.sqlite'}" for size in ("tiny", "small")}
    for size, url in urls.items():
        build_synthetic_world(url, size=size, seed=0)
    return urls


@pytest.fixture(scope="module")
def services(worlds, tmp_path_factory):
    """name -> URL: the sandbox and a scorer on the tiny world, a scorer on the small one, and a rollout
    server (transformers engine) on a tiny Qwen2 of the Qwen2.5 vocabulary, as Compose's `model` job
    once made it."""
    from services.models import tiny_qwen2

    home = tmp_path_factory.mktemp("home")
    specs = {s.name: s for s in launcher.SERVICES}
    sup = Supervisor(None)
    qwen = tiny_qwen2(home / "qwen-vocab", tokenizer="qwen")
    wanted = {
        "sandbox": ("sandbox", worlds["tiny"], {}),
        "reward": ("reward", worlds["tiny"], {}),
        "reward-small": ("reward", worlds["small"], {}),
        "rollout": (
            "rollout",
            worlds["tiny"],
            {"STAR_MODEL": str(qwen), "STAR_ROLLOUT_ENGINE": "transformers", "STAR_ROLLOUT_TOOLS": "local"},
        ),
    }
    urls = {}
    for name, (kind, world, extra) in wanted.items():
        port = free_port()
        env = {**train_env(home), "STAR_DB_URL": world, **extra}
        child = sup.add(name, launcher.service_argv(specs[kind], port), env, home / f"{name}.log")
        urls[name] = f"http://127.0.0.1:{port}"
    for name, child in sup.children.items():
        wait_ready(name, child.proc, urls[name], child.log, 300)
    urls["qwen-model"] = str(qwen)
    yield urls
    sup.stop_all()


def _address(services, reward: str = "reward") -> FleetAddress:
    return FleetAddress(None, services["sandbox"], None, (services["rollout"],), services[reward])


@pytest.mark.slow
def test_the_run_takes_the_fleets_world(services, worlds):
    got = fleet_world(_address(services), WorldSpec(source="synthetic", synthetic_size="tiny"), 0, worlds["tiny"])
    assert got["source"] == "synthetic world tiny (seed 0)" and len(got["world_hash"]) == 16


def test_a_recipe_naming_another_world_is_refused_naming_both(services, worlds):
    with pytest.raises(StageFailed) as refused:
        fleet_world(_address(services), WorldSpec(source="synthetic", synthetic_size="small"), 0, worlds["small"])
    text = str(refused.value)
    assert "the recipe names synthetic world small (seed 0)" in text
    assert f"the sandbox at {services['sandbox']} serves synthetic world tiny (seed 0)" in text
    assert "--set world.source=synthetic --set world.synthetic_size=tiny" in text
    with pytest.raises(StageFailed, match="the recipe names the official tables.*--set world.source=synthetic"):
        fleet_world(_address(services), WorldSpec(source="official"), 0, worlds["tiny"])


def test_a_scorer_on_another_world_or_a_controller_reading_another_is_refused(services, worlds):
    with pytest.raises(
        StageFailed,
        match=r"read different worlds: .*synthetic world tiny.*the scorer at .* "
        r"synthetic world small",
    ):
        fleet_world(
            _address(services, "reward-small"), WorldSpec(source="synthetic", synthetic_size="tiny"), 0, worlds["tiny"]
        )
    with pytest.raises(
        StageFailed,
        match=r"controller's world database \(STAR_DB_URL\) holds synthetic world "
        r"small .*give the controller the fleet's STAR_DB_URL",
    ):
        fleet_world(_address(services), WorldSpec(source="synthetic", synthetic_size="tiny"), 0, worlds["small"])


def test_a_model_the_engines_cannot_load_is_refused_saying_what_to_set(services, tmp_path):
    from services.models import tiny_qwen2

    travel = tiny_qwen2(tmp_path / "travel-vocab", tokenizer="travel")  # the tiny recipe's model
    with pytest.raises(StageFailed) as refused:
        engines_take(_address(services), str(travel))
    text = str(refused.value)
    assert f"the rollout server at {services['rollout']} runs {services['qwen-model']}" in text
    assert "vocab_size 4096 ≠ 151936" in text
    assert f"--set model.path={services['qwen-model']} --set model.tiny=null" in text
    engines_take(_address(services), services["qwen-model"])  # the fleet's own model loads


def test_eval_on_the_fleet_runs_each_episode_on_its_rollout_servers(services, worlds, tmp_path):
    """`star eval --fleet` (an external run's eval stage): the episodes run on the fleet's rollout server,
    on the engine and weights it holds; the controller only scores."""
    import json
    import subprocess
    import sys

    import httpx

    from services.pipeline.external import fleet_weights

    env = {**train_env(tmp_path / "home"), "STAR_DB_URL": worlds["tiny"], "STAR_ROLLOUT_URLS": services["rollout"]}
    queries = tmp_path / "queries"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "synth",
            "queries",
            "--n",
            "2",
            "--splits",
            "0:0:2:0",
            "--out",
            str(queries),
            "--db",
            worlds["tiny"],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    served_before = httpx.get(f"{services['rollout']}/metrics", timeout=10).text.count("\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "eval",
            "--fleet",
            "--split",
            str(queries / "validation.jsonl"),
            "--out",
            str(tmp_path / "eval"),
            "--db",
            worlds["tiny"],
            "--max-tokens",
            "16",
            "--max-tool-calls",
            "2",
            "--max-context",
            "4096",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics, metrics
    source = json.loads((tmp_path / "eval" / "manifest.json").read_text())["scoring"]["source"]
    assert source["kind"] == "fleet" and source["rollout_urls"] == [services["rollout"]]
    rollouts = [
        line
        for line in httpx.get(f"{services['rollout']}/metrics", timeout=10).text.splitlines()
        if line.startswith("star_rollout_trajectories_total")
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in rollouts) >= 2, rollouts  # the server ran them
    assert served_before > 0
    assert fleet_weights(_address(services)) == f"v0 ({services['qwen-model']})"
