"""The rollout service over real HTTP (transformers engine on a tiny Qwen2, sandbox over HTTP)."""

from __future__ import annotations

import shutil

import httpx
import pytest

from services.controller.launcher import ServiceProcess
from services.weights.manifest import write_manifest

TOKEN = "rollout-token"
QUERY = {
    "org": "Sarasota",
    "dest": "Chicago",
    "days": 3,
    "visiting_city_number": 1,
    "date": ["2022-03-22", "2022-03-23", "2022-03-24"],
    "people_number": 1,
    "budget": 1900,
    "query": "A 3-day trip from Sarasota to Chicago for one person, budget $1900.",
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(official_world_url, tiny_model, weights_root, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    sandbox = ServiceProcess(
        "sandbox",
        "services.sandbox.app:create_app",
        {"STAR_DB_URL": official_world_url, "STAR_LOG_LEVEL": "WARNING"},
        logs,
    ).start()
    env = {
        "STAR_SANDBOX_URL": sandbox.url,
        "STAR_MODEL": str(tiny_model),
        "STAR_ROLLOUT_ENGINE": "transformers",
        "STAR_ROLLOUT_MAX_MODEL_LEN": "4096",
        "STAR_API_TOKEN": TOKEN,
        "STAR_WEIGHTS_ROOT": str(weights_root),
        "STAR_LOG_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
    }
    try:
        rollout = ServiceProcess("rollout", "services.rollout.app:create_app", env, logs).start(timeout=180)
    except Exception:
        sandbox.stop()
        raise
    yield rollout
    rollout.stop()
    sandbox.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def test_rollouts_returns_g_trajectories_and_metrics_count_them(client):
    body = {
        "query": QUERY,
        "group_size": 2,
        "run_id": "r1",
        "task_id": "t1",
        "prompt_id": "p1",
        "sampling": {"seed": 4, "max_tokens_per_turn": 16, "max_context_tokens": 2048},
    }
    reply = client.post("/rollouts", json=body, headers=AUTH)
    assert reply.status_code == 200, reply.text
    trajs = reply.json()["trajectories"]
    assert [t["sample_index"] for t in trajs] == [0, 1] and {(t["group_id"], t["prompt_id"]) for t in trajs} == {
        ("t1", "p1")
    }
    for t in trajs:
        assert len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) <= 2048
        assert t["query"]["dest"] == "Chicago" and t["finish_reason"] in {"format_error", "context_limit"}
    metrics = client.get("/metrics").text
    assert 'star_rollout_trajectories_total{finish_reason="format_error"}' in metrics
    assert "star_rollout_sampled_tokens_total" in metrics and "star_rollout_weight_version 0.0" in metrics


def test_mutating_endpoints_need_the_token(client):
    assert client.post("/rollouts", json={"query": QUERY}).status_code == 401
    wrong = client.post(
        "/weights", json={"version": 1, "uri": "/x", "sha256": "0" * 64}, headers={"Authorization": "Bearer nope"}
    )
    assert wrong.status_code == 401 and wrong.headers["content-type"].startswith("application/problem+json")


@pytest.mark.parametrize(
    "body,where",
    [
        ({"query": {**QUERY, "days": 4}}, "days"),
        ({"query": QUERY, "group_size": 0}, "group_size"),
        ({"query": QUERY, "sampling": {"temperature": -1}}, "temperature"),
        ({"query": QUERY, "surprise": 1}, "surprise"),
    ],
)
def test_bad_rollout_requests_are_422_problems(client, body, where):
    reply = client.post("/rollouts", json=body, headers=AUTH)
    assert reply.status_code == 422 and where in reply.text and "Traceback" not in reply.text


def test_weights_are_checked_then_loaded(client, weights_root, tiny_model, tmp_path):
    assert client.get("/weights").json()["version"] == 0
    outside = tmp_path / "elsewhere"
    shutil.copytree(tiny_model, outside)
    sha = write_manifest(outside, 1)
    reply = client.post("/weights", json={"version": 1, "uri": str(outside), "sha256": sha}, headers=AUTH)
    assert reply.status_code == 403 and "outside the weights root" in reply.json()["detail"]
    sneaky = client.post(
        "/weights", json={"version": 1, "uri": str(weights_root / ".." / outside.name), "sha256": sha}, headers=AUTH
    )
    assert sneaky.status_code in (403, 404)
    v1 = weights_root / "v1"
    shutil.copytree(tiny_model, v1)
    sha = write_manifest(v1, 1)
    bad = client.post("/weights", json={"version": 1, "uri": str(v1), "sha256": "f" * 64}, headers=AUTH)
    assert bad.status_code == 422 and "sha256" in bad.json()["detail"]
    missing = client.post("/weights", json={"version": 1, "uri": str(weights_root / "v9"), "sha256": sha}, headers=AUTH)
    assert missing.status_code == 404
    ok = client.post("/weights", json={"version": 1, "uri": str(v1), "sha256": sha}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["reloaded"] and ok.json()["version"] == 1
    assert client.get("/weights").json()["version"] == 1
    assert "star_rollout_weight_version 1.0" in client.get("/metrics").text
    body = {"query": QUERY, "sampling": {"seed": 1, "max_tokens_per_turn": 4, "max_context_tokens": 2048}}
    assert client.post("/rollouts", json=body, headers=AUTH).json()["trajectories"][0]["policy_version"] == 1
    stale = client.post("/weights", json={"version": 0, "uri": str(v1), "sha256": sha}, headers=AUTH)
    assert stale.status_code == 409


def test_an_engine_that_reports_itself_broken_makes_the_service_not_ready_nor_alive(tokenizer, local_tools, tmp_path):
    """Readiness and liveness follow the engine: a broken one (ticks failing on a CUDA error) takes the
    replica out of its Service's endpoints, and its liveness probe gets the pod restarted."""
    from fastapi.testclient import TestClient

    from services.common.settings import Settings
    from services.rollout.app import create_app
    from services.rollout.engines.scripted import ScriptedEngine
    from services.rollout.service import RolloutService

    class Breakable(ScriptedEngine):
        broken = False

        @property
        def healthy(self) -> bool:
            return not self.broken

    engine = Breakable(tokenizer, ["x"])
    settings = Settings(home=tmp_path, weights_root=tmp_path / "weights", log_json=False, log_level="WARNING")
    with TestClient(create_app(settings, service=RolloutService(engine, local_tools, settings=settings))) as client:
        assert client.get("/readyz").status_code == 200
        engine.broken = True
        answer = client.get("/readyz")
        assert answer.status_code == 503 and answer.json()["status"] == "not ready"
        # liveness fails too, so Kubernetes restarts the pod instead of keeping a dead replica
        alive = client.get("/healthz")
        assert alive.status_code == 503 and alive.json()["status"] == "broken"
        engine.broken = False
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
