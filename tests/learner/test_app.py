"""The learner API: start an SFT run from a config over HTTP, follow it to the end, errors as problems."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from services.common.settings import Settings
from services.learner.app import create_app


@pytest.fixture
def client(tmp_path):
    app = create_app(Settings(home=tmp_path, log_json=False, api_token="secret"), runs_root=tmp_path / "runs")
    with TestClient(app) as c:
        c.headers["authorization"] = "Bearer secret"
        yield c


def _chats(path, n=4):
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "system", "content": "You plan trips."},
                            {"role": "user", "content": f"Trip {i}"},
                            {
                                "role": "assistant",
                                "content": f"<think>plan {i}</think><answer>Day 1: city {i}</answer>",
                            },
                        ]
                    }
                )
                + "\n"
            )
    return path


def test_bad_requests_are_clear_problems(client, tmp_path, tiny_model):
    r = client.post("/runs", json={"kind": "sft", "config": {"model": str(tiny_model)}})
    assert r.status_code == 422 and "data" in json.dumps(r.json()["detail"])
    r = client.post("/runs", json={"kind": "sft", "config": {"model": str(tmp_path / "none"), "data": "x"}})
    assert r.status_code == 422 and "does not exist" in r.json()["detail"]
    r = client.post("/runs", json={"kind": "ppo", "config": {}})
    assert r.status_code == 422
    assert client.get("/runs/nope").status_code == 404
    assert client.post("/runs/nope/stop").status_code == 404
    r = client.post("/runs", json={"kind": "sft", "config": {}}, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401


@pytest.mark.slow
def test_sft_run_over_http_finishes_with_metrics_and_export(client, tmp_path, tiny_model):
    data = _chats(tmp_path / "chats.jsonl")
    body = {
        "kind": "sft",
        "config": {
            "model": str(tiny_model),
            "data": str(data),
            "lr": 1e-3,
            "batch_size": 2,
            "epochs": 1,
            "warmup_ratio": 0.5,
            "engine": {"micro_batch_tokens": 128},
        },
    }
    r = client.post("/runs", json=body)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    deadline = time.time() + 600
    while time.time() < deadline:
        state = client.get(f"/runs/{run_id}").json()
        if state["state"] in ("finished", "failed", "stopped"):
            break
        time.sleep(2)
    assert state["state"] == "finished", state
    assert state["step"] == 2 and state["steps_logged"] == 2
    assert state["metrics"]["loss"] > 0 and state["metrics"]["loss_tokens"] > 0
    assert "export" in state
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(state["export"])
    assert [r["id"] for r in client.get("/runs").json()] == [run_id]
