"""Drives a running Compose fleet from inside it (piped into a service container by
scripts/compose-smoke): tools over HTTP, /score, and one RL step through the fleet's own Redis,
rollout worker, reward worker and learner. Prints one JSON line of timings and results."""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import redis

from services.common.schemas import SamplingParams
from services.common.settings import get_settings
from services.common.streams import StreamNames
from services.pipeline.scheduler import Schedule, TaskPublisher
from services.synth.queries import load_queries

settings = get_settings()
out: dict = {}
t0 = time.monotonic()

# -- tools over HTTP -------------------------------------------------------------------------------
subprocess.run(["star", "synth", "queries", "--n", "4", "--splits", "0:4:0:0", "--out", "/tmp/smoke-queries",
                "--db", settings.world_url], check=True, capture_output=True)
queries = load_queries("/tmp/smoke-queries/rl.jsonl")
query = queries[0]
with httpx.Client(timeout=60) as http:
    world = http.get(f"{settings.sandbox_url}/world").json()
    r = http.post(f"{settings.sandbox_url}/tools/call", json={"name": "SearchAccommodation",
                                                                "arguments": {"city": query.dest}})
    r.raise_for_status()
    out["tools"] = {"world": world["meta"].get("kind"), "counts": world["counts"], "ok": r.json()["ok"],
                    "chars": len(r.json()["text"])}
    # -- /score ------------------------------------------------------------------------------------
    r = http.post(f"{settings.reward_url}/score", json={"query": query.model_dump(mode="json"),
                                                          "plan_text": "no plan today", "mode": "official"})
    r.raise_for_status()
    out["score"] = {"status": r.status_code, "reward": r.json()["reward"]}
    out["seconds_http"] = round(time.monotonic() - t0, 1)

    # -- one RL step through the fleet ---------------------------------------------------------------
    t1 = time.monotonic()
    headers = {"Authorization": f"Bearer {settings.api_token}"}
    run = http.post(f"{settings.learner_url}/runs", headers=headers, json={
        "kind": "rl", "config": {"model": settings.model, "total_steps": 1, "max_steps": 1, "batch_prompts": 1,
                                 "group_size": 2, "lr": 1e-5, "weights_dir": str(settings.weights_dir),
                                 "stream_prefix": settings.stream_prefix}})
    assert run.status_code == 201, run.text
    run_id = run.json()["id"]
    client = redis.Redis.from_url(settings.redis_url)
    names = StreamNames(settings.stream_prefix)
    schedule = Schedule(tuple(queries[:1]), batch_prompts=1, group_size=2, epochs=1, max_steps=1)
    publisher = TaskPublisher(client, names, "compose-smoke", schedule,
                              SamplingParams(max_tokens_per_turn=32, max_tool_calls=2, max_context_tokens=4096))
    publisher.publish_ready(0, 0)
    deadline = time.monotonic() + float(os.environ.get("SMOKE_STEP_TIMEOUT_S", "1500"))
    state = {}
    while time.monotonic() < deadline:
        state = http.get(f"{settings.learner_url}/runs/{run_id}").json()
        if state["state"] in ("finished", "failed", "stopped"):
            break
        time.sleep(3)
    raw = client.get(names.weights_latest)
    out["rl"] = {"state": state.get("state"), "step": state.get("step"), "error": state.get("error"),
                 "weights_version": json.loads(raw)["version"] if raw else 0,
                 "seconds": round(time.monotonic() - t1, 1)}
# the smoke passes when every part answered and the fleet trained the step and published its weights
out["passed"] = (r.status_code == 200 and out["score"]["status"] == 200 and out["rl"]["state"] == "finished"
                 and out["rl"]["weights_version"] >= 1)
print("SMOKE " + json.dumps(out))
