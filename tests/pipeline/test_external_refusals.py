"""`star train --fleet external` refuses, before any stage, a fleet it cannot reach: each part that is
down is named with its address, Redis's password never shown, and no stack trace."""

from __future__ import annotations

import json
import subprocess

import pytest
import redis

from services.common.redis import EmbeddedRedis, free_port
from services.common.streams import StreamConsumer, StreamNames
from services.pipeline.external import FleetAddress, foreign_progress, problems
from tests.pipeline.test_train_e2e import train_argv, train_env


def _star_train(tmp_path, fleet: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    env = train_env(tmp_path / "home", fleet)
    return subprocess.run(  # no wait for a fleet still starting: the recipe's controller.fleet_wait_s
        train_argv(tmp_path / "run", "--fleet", "external", "--set", "controller.fleet_wait_s=0", *extra),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_unreachable_fleet_is_refused_naming_each_part_with_the_password_redacted(tmp_path):
    redis_port, sandbox_port, learner_port = free_port(), free_port(), free_port()
    out = _star_train(
        tmp_path,
        {
            "STAR_REDIS_URL": f"redis://:s3cret-pw@127.0.0.1:{redis_port}/0",
            "STAR_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
            "STAR_LEARNER_URL": f"http://127.0.0.1:{learner_port}",
        },
    )
    assert out.returncode == 1, out.stderr
    text = " ".join(out.stderr.split())  # rich wraps long lines
    assert "external fleet is not reachable" in text
    assert f"redis (STAR_REDIS_URL) at redis://:***@127.0.0.1:{redis_port}/0" in text
    assert f"sandbox (STAR_SANDBOX_URL) at http://127.0.0.1:{sandbox_port}" in text
    assert f"learner (STAR_LEARNER_URL) at http://127.0.0.1:{learner_port}" in text
    assert "s3cret-pw" not in out.stderr + out.stdout and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "stages.json").exists()  # refused before the first stage


def test_unset_settings_are_named(tmp_path):
    out = _star_train(tmp_path, {})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    text = " ".join(out.stderr.split())
    for line in (
        "redis: STAR_REDIS_URL is not set",
        "sandbox (STAR_SANDBOX_URL): not set",
        "learner (STAR_LEARNER_URL): not set",
    ):
        assert line in text


def test_a_fleet_mode_that_does_not_exist_is_a_recipe_error(tmp_path):
    out = subprocess.run(
        train_argv(tmp_path / "run", "--fleet", "elsewhere"),
        env=train_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "deployment.fleet" in out.stderr and "Traceback" not in out.stderr


def test_a_fleet_without_workers_or_learner_is_reported_part_by_part(redis_client):
    client, prefix = redis_client
    url = client.connection_pool.connection_kwargs
    redis_url = f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}"
    learner = f"http://127.0.0.1:{free_port()}"
    address = FleetAddress(redis_url, None, learner, stream_prefix=prefix.rstrip(":"))
    found = problems(address)
    assert found == [
        f"rollout workers: none has read {prefix}tasks (group rollout) at {redis_url} within 60 s",
        f"reward workers: none has read {prefix}trajectories (group reward) at {redis_url} within 60 s",
        "sandbox (STAR_SANDBOX_URL): not set",
        f"learner (STAR_LEARNER_URL) at {learner}: not ready (GET /readyz)",
    ]
    # a worker that polls its stream counts as live
    names = StreamNames(prefix.rstrip(":"))
    StreamConsumer(client, names.tasks, "rollout", "rollout-0").read(block_ms=10)
    StreamConsumer(client, names.trajectories, "reward", "reward-0").read(block_ms=10)
    assert not any("workers" in line for line in problems(address))


def test_another_runs_progress_in_the_fleets_redis_is_found():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        names = StreamNames("fleet")
        assert foreign_progress(client, names) is None
        client.set(names.weights_latest, json.dumps({"version": 3, "uri": "/w/v3"}))
        client.set(names.learner_batches, 3)
        assert foreign_progress(client, names) == "weights v3, 3 batches consumed, under prefix 'fleet'"


@pytest.mark.parametrize("fleet", ["embedded", "external"])
def test_the_run_folder_resumes_whoever_runs_the_fleet(fleet):
    from services.controller.train import recipe_identity
    from services.pipeline.config import PipelineConfig

    base = PipelineConfig.model_validate({"name": "x", "model": {"path": "/m"}})
    other = PipelineConfig.model_validate({"name": "x", "model": {"path": "/m"}, "deployment": {"fleet": fleet}})
    assert recipe_identity(base) == recipe_identity(other)


def test_a_fault_rate_the_external_fleet_will_not_apply_is_said():
    from services.controller.preflight import external_fleet_note
    from services.pipeline.config import PipelineConfig

    def config(**deployment):
        return PipelineConfig.model_validate(
            {"name": "x", "model": {"path": "/m"}, "rl": {"fault_rate": 0.05}, "deployment": deployment}
        )

    assert "STAR_FAULT_RATE" in external_fleet_note(config(fleet="external"))
    assert external_fleet_note(config()) is None


@pytest.fixture
def learner_service(tmp_path):
    """The real learner service (its runs API), as a deployment runs it."""
    from services.common.supervisor import Supervisor, wait_ready
    from services.controller import launcher

    spec = next(s for s in launcher.SERVICES if s.name == "learner")
    port = free_port()
    sup = Supervisor(None)
    env = {**train_env(tmp_path / "learner-home"), "STAR_API_TOKEN": "fleet-token"}
    child = sup.add("learner", launcher.service_argv(spec, port), env, tmp_path / "learner.log")
    url = f"http://127.0.0.1:{port}"
    wait_ready("learner", child.proc, url, child.log, 120)
    yield url
    sup.stop_all()


@pytest.mark.slow
def test_a_learner_that_refuses_or_fails_the_run_fails_the_stage_with_its_words(tmp_path, learner_service):
    from services.controller.external_fleet import ExternalFleet
    from services.controller.learner_config import rl_config
    from services.pipeline.config import load_pipeline_config
    from services.pipeline.stage import Run, StageFailed
    from tests.pipeline.test_train_e2e import ROOT
    from tests.support.waiting import until

    run = Run(load_pipeline_config(ROOT / "configs" / "tiny.yaml", ["deployment.fleet=external"]), tmp_path / "run")
    run.folder.mkdir()

    def fleet(token: str = "fleet-token") -> ExternalFleet:
        return ExternalFleet(
            FleetAddress(None, None, learner_service, api_token=token), run.folder / "learner-run.json"
        )

    missing = rl_config(run, str(tmp_path / "nowhere"), StreamNames("fleet"), None, 2)
    with pytest.raises(StageFailed, match=r"refused the run \(422\): model folder .*nowhere does not exist"):
        fleet().start_learner(run, missing)
    with pytest.raises(StageFailed, match=r"refused the token \(STAR_API_TOKEN\)"):
        fleet("wrong").start_learner(run, missing)
    assert not (run.folder / "learner-run.json").exists()

    (tmp_path / "empty-model").mkdir()  # a folder, but no model in it: the run starts, then fails
    f = fleet()
    run_id = f.start_learner(run, rl_config(run, str(tmp_path / "empty-model"), StreamNames("fleet"), None, 2))
    assert json.loads((run.folder / "learner-run.json").read_text())["id"] == run_id
    report = until(
        lambda: (lambda r: r if not r.running else None)(f.learner_report()), 180, "the run to fail", poll_s=0.5
    )
    assert report.state == "failed"
    with pytest.raises(StageFailed, match=f"learner run {run_id} at {learner_service} ended failed: .*empty-model"):
        f.learner_ended(report)
    assert fleet().recorded_run() is None  # a failed run is not re-attached to: the next controller starts anew


def test_the_controller_says_what_of_the_fleet_cannot_work(redis_client, tmp_path):
    from services.controller.external_fleet import ExternalFleet

    client, prefix = redis_client
    kw = client.connection_pool.connection_kwargs
    address = FleetAddress(
        f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}", None, None, stream_prefix=prefix.rstrip(":")
    )
    names = address.names
    f = ExternalFleet(address, tmp_path / "learner-run.json")
    assert f.watch() == [
        f"rollout workers: none has joined {names.tasks} (group rollout)",
        f"reward workers: none has joined {names.trajectories} (group reward)",
    ]
    worker = StreamConsumer(client, names.tasks, "rollout", "host-0", max_deliveries=1)
    StreamConsumer(client, names.trajectories, "reward", "host-1").read(block_ms=10)
    client.xadd(names.tasks, {b"payload": b'{"n": 1}'})
    [msg] = worker.read(block_ms=10)
    worker.fail(msg, "weights v0 not loadable: size mismatch")  # one delivery allowed: buried
    assert f.watch() == [
        f"1 message(s) of {names.tasks} failed for good ({names.tasks}:dead); the last: "
        "weights v0 not loadable: size mismatch"
    ]
    assert f.watch() == []  # said once


def test_rl_progress_is_said_line_by_line_where_there_is_no_terminal(capsys):
    from services.controller.loop import say_progress

    said = say_progress(0, 2, "published 1/2 · weights v0", "")
    said = say_progress(0, 2, "published 1/2 · weights v0", said)
    said = say_progress(1, 2, "published 2/2 · weights v1", said)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rl ")]
    assert lines == [
        "rl 0/2 steps trained · published 1/2 · weights v0",
        "rl 1/2 steps trained · published 2/2 · weights v1",
    ]


@pytest.mark.slow
def test_sft_runs_on_the_fleets_learner_to_its_end_or_fails_the_stage_with_its_error(tmp_path, learner_service, capsys):
    """An external run's SFT goes to the learner service (in the gpu profile, the GPU learner), not the
    controller's own machine; its steps are said as they come."""
    from services.models import tiny_qwen2
    from services.pipeline.external import train_on_learner
    from services.pipeline.stage import StageFailed

    tiny_model = tiny_qwen2(tmp_path / "model", tokenizer="travel")
    address = FleetAddress(None, None, learner_service, api_token="fleet-token")
    data = tmp_path / "chats.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "You plan trips."},
                        {"role": "user", "content": f"Trip {i}"},
                        {"role": "assistant", "content": f"<think>plan {i}</think><answer>Day 1: city {i}</answer>"},
                    ]
                }
            )
            + "\n"
            for i in range(4)
        )
    )
    config = {
        "model": str(tiny_model),
        "data": str(data),
        "output_dir": str(tmp_path / "sft"),
        "lr": 1e-3,
        "batch_size": 2,
        "epochs": 1,
        "engine": {"micro_batch_tokens": 128},
    }
    run = train_on_learner(address, "sft", config, poll_s=0.5)
    assert run["state"] == "finished" and run["step"] == 2 and (tmp_path / "sft" / "status.json").is_file()
    said = " ".join(capsys.readouterr().err.split())
    assert f"on the learner at {learner_service}" in said and "sft finished · step 2" in said
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        StageFailed, match=f"(?s)sft run .* on the learner at {learner_service} ended failed: .*tokenizer"
    ):
        train_on_learner(
            address,
            "sft",
            {**config, "model": str(tmp_path / "empty"), "output_dir": str(tmp_path / "sft2")},
            poll_s=0.5,
        )


def test_a_controller_waiting_for_the_fleet_says_what_it_waits_on(capsys):
    from services.pipeline.external import FleetUnreachable, check_reachable

    with pytest.raises(FleetUnreachable):
        check_reachable(FleetAddress(None, None, None), wait_s=1.0, poll_s=0.2)
    said = capsys.readouterr().err
    assert said.count("waiting (up to") == 1 and "redis: STAR_REDIS_URL is not set" in said


def test_an_external_runs_sft_goes_to_the_learner_service_and_its_eval_to_the_rollout_servers(tmp_path, monkeypatch):
    """Where each stage's model work runs in external mode: nothing of SFT or eval in the controller's process."""
    from services.common.settings import get_settings
    from services.pipeline import stages
    from services.pipeline.config import load_pipeline_config
    from services.pipeline.stage import Run, eval_argv
    from tests.pipeline.test_train_e2e import ROOT

    monkeypatch.setenv("STAR_LEARNER_URL", "http://learner:8000")
    get_settings.cache_clear()
    run = Run(
        load_pipeline_config(
            ROOT / "configs" / "tiny.yaml", ["deployment.fleet=external", "services.chat.tool_format=react"]
        ),
        tmp_path / "run",
    )
    run.folder.mkdir()
    run.base_model = str(tmp_path / "model")
    sent = []
    monkeypatch.setattr(
        stages,
        "train_on_learner",
        lambda address, kind, config: (
            sent.append((address.learner_url, kind, config["output_dir"])) or configs.append(config)
        ),
    )
    configs = []
    monkeypatch.setattr(stages, "run_process", lambda *a, **k: pytest.fail("SFT ran in the controller"))
    monkeypatch.setattr("services.learner.trainer.read_status", lambda out: {"export": str(out / "export")})
    out = stages.stage_sft(run, {"sft_data": str(tmp_path / "sft.jsonl")})
    get_settings.cache_clear()
    assert sent == [("http://learner:8000", "sft", str(run.folder / "sft"))]
    assert configs[0]["chat"]["tool_format"] == "react"  # SFT renders chats in the rollout's format
    assert out["model"] == str(run.folder / "sft" / "export")
    argv = eval_argv(run, None, tmp_path / "split.jsonl", tmp_path / "eval", 4)
    assert "--fleet" in argv and "--model" not in argv and "--engine" not in argv


def test_an_external_runs_eval_runs_here_only_where_the_fleet_cannot_take_it(tmp_path, monkeypatch, capsys):
    from services.common.settings import get_settings
    from services.pipeline import stages
    from services.pipeline.config import load_pipeline_config
    from services.pipeline.stage import Run
    from tests.pipeline.test_train_e2e import ROOT

    run = Run(load_pipeline_config(ROOT / "configs" / "tiny.yaml", ["deployment.fleet=external"]), tmp_path / "run")
    run.folder.mkdir()
    evaluated = []
    monkeypatch.setattr(stages, "evaluate_model", lambda run, model, *a: evaluated.append(model) or {})
    monkeypatch.setattr(stages, "fleet_weights", lambda address: "v2 (/w/v2)")
    synth = {"heldout_queries": str(tmp_path / "heldout.jsonl")}

    def eval_with(rollout_urls: str | None, rl: dict) -> dict:
        monkeypatch.delenv("STAR_ROLLOUT_URLS", raising=False)
        if rollout_urls:
            monkeypatch.setenv("STAR_ROLLOUT_URLS", rollout_urls)
        get_settings.cache_clear()
        try:
            return stages.stage_eval(run, "/run/rl/model", synth, rl)
        finally:
            get_settings.cache_clear()

    assert eval_with("http://rollout:8000", {})["model"] == "v2 (/w/v2)"  # on the fleet: no model of ours
    eval_with(None, {})  # no rollout server to send the episodes to
    eval_with("http://rollout:8000", {"best_success": 0.5})  # validation picked an older version
    assert evaluated == [None, "/run/rl/model", "/run/rl/model"]
    said = " ".join(capsys.readouterr().err.split())
    assert "names no rollout server" in said and "validation picked a version the fleet no longer holds" in said
