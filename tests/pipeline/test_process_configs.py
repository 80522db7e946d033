"""The embedded fleet's processes read their settings from files of their own in the run folder (sandbox.json,
reward/worker-<i>.json), their environment carrying addresses only; the controller's waits come from the recipe."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.common.settings import Settings
from services.common.streams import StreamNames
from services.pipeline.config import PipelineConfig
from services.pipeline.stage import Run


def _run(tmp_path, **sections) -> Run:
    config = PipelineConfig.model_validate({"name": "p", "model": {"tiny": {}}, "seed": 11, **sections})
    return Run(config, tmp_path, env={"STAR_DB_URL": "sqlite:///world.sqlite"})


def test_the_fleet_writes_each_process_its_file_and_keeps_settings_out_of_the_environment(tmp_path, monkeypatch):
    from services.controller import embedded_fleet, launcher

    started: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {}

    def start_service(sup, service, env, logs, *, name=None, args=(), stop_timeout=None):
        started[name or service.name] = (dict(env), tuple(args))
        return SimpleNamespace(name=name or service.name), 9

    monkeypatch.setattr(launcher, "start_redis", lambda *a: "redis://127.0.0.1:1/0")
    monkeypatch.setattr(launcher, "start_service", start_service)
    monkeypatch.setattr(embedded_fleet, "ensure_group", lambda *a: None)
    monkeypatch.setenv("STAR_FAULT_RATE", "0.9")  # the controller's own: not the run's
    run = _run(tmp_path, rl={"fault_rate": 0.05}, services={"reward_workers": 2, "engine": "transformers"})
    embedded_fleet.start_fleet(run, "model", StreamNames("star:p"))

    def config_of(name: str) -> dict:
        args = started[name][1]
        return json.loads(Path(args[args.index("--config") + 1]).read_text())

    assert config_of("sandbox") == {"fault_rate": 0.05, "fault_seed": 11}
    assert (tmp_path / "sandbox.json").is_file()
    assert [config_of(f"reward-{i}") for i in range(2)] == [{"consumer": "reward-0"}, {"consumer": "reward-1"}]
    assert (tmp_path / "reward" / "worker-1.json").is_file()
    for name, (env, args) in started.items():
        assert not any(k.startswith("STAR_FAULT_") for k in env), name
        assert "--db" not in args and "--consumer" not in args, name
    assert started["reward-0"][0]["STAR_DB_URL"] == "sqlite:///world.sqlite"  # the world's address


def test_the_controllers_waits_come_from_the_recipe(tmp_path):
    from services.controller.preflight import Dependencies
    from services.controller.train import recipe_identity
    from services.pipeline.external import FleetAddress, FleetUnreachable, check_reachable

    default = _run(tmp_path).config.controller
    assert (default.redis_down_limit_s, default.sandbox_down_limit_s, default.fleet_wait_s) == (300, 300, 30)
    config = _run(tmp_path, controller={"sandbox_down_limit_s": 0.01, "fleet_wait_s": 0}).config
    address = FleetAddress.from_settings(Settings(), wait_s=config.controller.fleet_wait_s)
    assert address.wait_s == 0 and FleetAddress.from_settings(Settings()).wait_s == 30
    with pytest.raises(FleetUnreachable):  # no wait at all
        check_reachable(FleetAddress(None, None, None, wait_s=0))
    deps = Dependencies({"sandbox": "http://127.0.0.1:1"}, config.controller.sandbox_down_limit_s)
    deps.check()
    deps.down_since["sandbox"] -= 1
    with pytest.raises(Exception, match="has not been ready"):
        deps.check()
    # a run folder resumes under other waits: they are not what it trains
    assert recipe_identity(config) == recipe_identity(_run(tmp_path).config)


def test_a_bad_wait_in_the_recipe_is_refused():
    with pytest.raises(ValueError, match="redis_down_limit_s"):
        PipelineConfig.model_validate({"name": "p", "model": {"tiny": {}}, "controller": {"redis_down_limit_s": 0}})
