"""`star up` / `status` / `down` as real processes: a detached fleet that outlives its command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import redis

from services.common.supervisor import alive

pytestmark = pytest.mark.slow


def _star(home, *args, check=True):
    env = {**os.environ, "STAR_HOME": str(home), "STAR_LOG_JSON": "false"}
    env.pop("STAR_REDIS_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], env=env, capture_output=True, text=True, timeout=300, check=check
    )


def test_up_status_down(tmp_path):
    _star(tmp_path, "world", "build", "--synthetic", "tiny")
    _star(tmp_path, "up", "--only", "sandbox")
    try:
        report = json.loads(_star(tmp_path, "status", "--json").stdout)
        assert report["running"]
        by_name = {p["name"]: p for p in report["processes"]}
        assert by_name["sandbox"]["health"] == "ready" and by_name["redis"]["health"] == "up"
        # the services answer for real after `star up` has exited
        r = httpx.post(
            by_name["sandbox"]["url"] + "/tools/call", json={"name": "SearchCity", "arguments": {"state": "x"}}
        )
        assert r.status_code == 200
        # the URL is printed without its password, which lives in a file of its own
        assert "***" in report["redis_url"]
        password = open(report["redis_password_file"]).read().strip()
        assert password not in json.dumps(report)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(report["redis_url"].replace(":***@", "@")).ping()
        assert redis.Redis.from_url(report["redis_url"].replace("***", password)).ping()
        assert set(report["streams"]) == {"star:tasks", "star:trajectories", "star:scored"}
        second = _star(tmp_path, "up", check=False)
        assert second.returncode == 1 and "already running" in second.stderr
        # the supervisor restarts a service that dies
        os.kill(by_name["sandbox"]["pid"], 9)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            again = {p["name"]: p for p in json.loads(_star(tmp_path, "status", "--json").stdout)["processes"]}
            if again["sandbox"]["pid"] != by_name["sandbox"]["pid"] and again["sandbox"]["health"] == "ready":
                break
            time.sleep(0.5)
        assert again["sandbox"]["health"] == "ready", again
    finally:
        out = _star(tmp_path, "down").stderr
    assert "sandbox" in out and "redis" in out
    pids = [p["pid"] for p in report["processes"]] + [again["sandbox"]["pid"]]
    assert not any(alive(pid) for pid in pids), "star down left a process running"
    gone = _star(tmp_path, "status", check=False)
    assert gone.returncode == 1 and "no fleet" in gone.stderr
