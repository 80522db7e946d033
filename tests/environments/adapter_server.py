"""A live episode API for adapter tests that run in a library's own virtual environment.

NeMo Gym and TRL pin packages our environment cannot hold, so their tests run in `.venv-nemogym` / `.venv-trl`,
which have the adapters and the episode client but not our servers' dependencies. `served_episodes` starts the
server side with the main environment's Python (`STAR_MAIN_PYTHON`, default `.venv/bin/python`): it builds the
official world over the tests' data, starts the sandbox and the episode service (`tests.support.episode_plans`),
scores every plan case with `star score --json` in both modes, writes that as JSON and serves until the test's end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "travelplanner"
MAIN_PYTHON = Path(os.environ.get("STAR_MAIN_PYTHON", ROOT / ".venv" / "bin" / "python"))
START_TIMEOUT_S = 600.0

# Runs under the main environment: argv = out folder, data folder, query limit.
_SERVE = r"""
import json, os, sys
from pathlib import Path

import redis
from typer.testing import CliRunner

from services.cli import app
from services.common.redis import EmbeddedRedis
from services.sandbox.world.build import build_official_world
from tests.support.episode_plans import plan_cases, running_episode_server

out, data, limit = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
world = f"sqlite:///{out / 'world.sqlite'}"
build_official_world(world, data / "database", seed=0, ref_info=[data / "train" / "train_ref_info.jsonl"])
runner = CliRunner()


def star_score(case, mode):
    q, p = out / "query.json", out / "plan.json"
    q.write_text(json.dumps(case.query))
    p.write_text(json.dumps(case.plan))
    result = runner.invoke(app, ["score", "--query", str(q), "--plan", str(p), "--mode", mode, "--db", world,
                                 "--json"])
    if result.exit_code != 0:
        raise SystemExit(f"star score failed on {case.name}: {result.output}")
    return json.loads(result.stdout)["reward"]


cases = [{"name": c.name, "query_id": c.query_id, "query": c.query, "plan": c.plan, "breaks": c.breaks,
          "query_changed": c.query_changed, "star_score": {m: star_score(c, m) for m in ("official", "strict")}}
         for c in plan_cases(data, limit or None)]
redis_url = os.environ.get("STAR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
embedded = None
try:
    redis.Redis.from_url(redis_url, socket_connect_timeout=0.5).ping()
except redis.ConnectionError:
    embedded = EmbeddedRedis().__enter__()
    redis_url = embedded.url
with running_episode_server(world, redis_url, out / "logs", travelplanner_dir=data) as server:
    (out / "served.tmp").write_text(json.dumps({"url": server.url, "token": server.token, "cases": cases}))
    (out / "served.tmp").rename(out / "served.json")
    sys.stdin.read()
if embedded is not None:
    embedded.__exit__(None, None, None)
"""


@dataclass(frozen=True)
class ServedEpisodes:
    """The episode API's URL and token, and the plan cases with `star score`'s reward in each mode."""

    url: str
    token: str
    cases: list[dict[str, Any]]

    def client(self, **options: Any):
        """An `EpisodeClient` of this server (a context manager)."""
        from services.episodes.client import EpisodeClient

        return EpisodeClient(self.url, self.token, **options)


def fixture_query_ids() -> set[str]:
    """The train ids the parity cases cover: the fixture's queries (the first STAR_ADAPTER_QUERIES, when set)."""
    count = len(json.loads((FIXTURE_DIR / "train" / "train.json").read_text()))
    return {str(i) for i in range(1, min(count, int(os.environ.get("STAR_ADAPTER_QUERIES") or count)) + 1)}


def main_python_problem() -> str | None:
    """Why the server side cannot start here (None: it can)."""
    if not MAIN_PYTHON.exists():
        return f"the main environment's Python is not at {MAIN_PYTHON} (run scripts/install, or set STAR_MAIN_PYTHON)"
    return None


@contextmanager
def served_episodes(out: Path, travelplanner_dir: Path, *, limit: int = 0) -> Iterator[ServedEpisodes]:
    """The episode API over `travelplanner_dir`'s train queries (the first `limit`; 0: all), until the block ends."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "server.log", "w")  # noqa: SIM115 - closed below, after the process
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(
        [str(MAIN_PYTHON), "-c", _SERVE, str(out), str(travelplanner_dir), str(limit)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        served = _wait_served(out / "served.json", proc, out / "server.log")
        yield ServedEpisodes(served["url"], served["token"], served["cases"])
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_served(path: Path, proc: subprocess.Popen, log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"the episode server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"the episode server did not start in {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")


if __name__ == "__main__":  # a manual check: serve the fixture's first query until Enter
    with served_episodes(Path(sys.argv[1]), Path(sys.argv[2]), limit=1) as s:
        print(s.url, len(s.cases), "cases")
        input()
