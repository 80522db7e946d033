"""The episode API's chaos case (`bench/chaos.py episodes`): the sandbox and the episode service (which scores
in-process) each SIGKILLed mid-episode, then started again, while clients play whole episodes.

    .venv/bin/python bench/chaos.py episodes [--episodes 24] [--kills 2]

Servers: the sandbox and the episode service as real processes (tests/support/episode_plans.py) over one world
(bench/episodes.py's, built once into var/bench/),
episodes in the Redis at 127.0.0.1:6379 (or an embedded one). Clients: one thread per episode, each a real
`EpisodeClient` that retries what the API says is retryable (503 with Retry-After, and a request the dead
service never answered); each starts a train query, makes `--tool-calls` calls and finishes with the gold plan,
two finishes at once. Faults, `--kills` rounds of each: the sandbox killed during the tool calls (restarted
after 1 s), then the episode service killed while the finishes are scoring (restarted at once).

Checked per episode from its Redis hash and the replies: it finished; it was scored once (one result stored;
a claim taken by a killed scorer lapses and is counted apart); every finish reply and the state's result are
the same; no tool call was counted without a reply beyond those in flight at a kill of the episode service.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.settings import get_settings  # noqa: E402
from services.episodes.client import EpisodeClient, EpisodeError  # noqa: E402
from tests.support.episode_plans import gold_plan, running_episode_server, train_records  # noqa: E402

CALLS = [
    ("SearchCity", {"state": "Texas"}),
    ("SearchAttraction", {"city": "Chicago"}),
    ("SearchRestaurant", {"city": "Chicago"}),
    ("SearchAccommodation", {"city": "Chicago"}),
]


def kill(server: Any, name: str) -> float:
    proc = server.processes[name].proc
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    return time.monotonic()


def patient(call, until: float):
    """`call()` again after any retryable failure (503, no reply, a reply cut off by a kill) until `until`."""
    while True:
        try:
            return call()
        except EpisodeError as exc:
            if exc.status not in (0, 503) or time.monotonic() > until:
                raise
            time.sleep(0.2)


class Player(threading.Thread):
    """One episode: start, tool calls, then two finishes at once."""

    def __init__(
        self, server: Any, query_id: str, plan: list[dict], tool_calls: int, phase: dict[str, Any], deadline: float
    ) -> None:
        super().__init__(daemon=True)
        self.server, self.query_id, self.plan, self.tool_calls = server, query_id, plan, tool_calls
        self.phase, self.deadline = phase, deadline
        self.episode_id: str | None = None
        self.replies: list[dict] = []
        self.answered_calls = 0
        self.cut_calls = 0  # replies lost to a kill of the episode service (the call may have counted)
        self.unavailable_calls = 0  # 503s while the sandbox was away (not counted)
        self.error: str | None = None

    def run(self) -> None:
        try:
            with EpisodeClient(self.server.url, self.server.token, retries=0, timeout_s=60) as client:
                self.episode_id = patient(
                    lambda: client.start(query_id=self.query_id, split="train", max_tool_calls=self.tool_calls * 3),
                    self.deadline,
                ).episode_id
                for i in range(self.tool_calls):
                    name, arguments = CALLS[i % len(CALLS)]
                    self._call_tool(client, name, arguments)
                    time.sleep(0.05)
                self.phase["ready"].wait(120)
                finishers = [threading.Thread(target=self._finish) for _ in range(2)]
                for t in finishers:
                    t.start()
                for t in finishers:
                    t.join(180)
        except Exception as exc:  # noqa: BLE001 - reported per episode
            self.error = f"{type(exc).__name__}: {exc}"

    def _call_tool(self, client: EpisodeClient, name: str, arguments: dict) -> None:
        while True:
            try:
                client.call_tool(self.episode_id, name, arguments)
                self.answered_calls += 1
                return
            except EpisodeError as exc:
                if exc.status == 0:
                    self.cut_calls += 1
                elif exc.status == 503:
                    self.unavailable_calls += 1
                else:
                    raise
                if time.monotonic() > self.deadline:
                    raise
                time.sleep(0.2)

    def _finish(self) -> None:
        with EpisodeClient(self.server.url, self.server.token, retries=0, timeout_s=60) as client:
            result = patient(lambda: client.finish(self.episode_id, plan=self.plan), self.deadline)
            self.replies.append(result.model_dump(mode="json"))


def ledger(redis_client: Any, server: Any, episode_id: str) -> dict[str, Any]:
    fields = redis_client.hgetall(f"{server.prefix}:episodes:{episode_id}")
    return {k.decode(): v.decode() for k, v in fields.items() if k in (b"used", b"claims", b"stores", b"status")}


def scoring_now(redis_client: Any, server: Any, until: float) -> int:
    """Wait until some finish holds its scoring claim; how many do."""
    while time.monotonic() < until:
        held = sum(1 for _ in redis_client.scan_iter(match=f"{server.prefix}:episodes:*:lock"))
        if held:
            return held
        time.sleep(0.002)
    return 0


def one_round(server: Any, redis_client: Any, n: int, tool_calls: int, records: list[dict]) -> dict[str, Any]:
    phase = {"ready": threading.Event()}
    deadline = time.monotonic() + 300
    players = [
        Player(server, str(i % len(records) + 1), gold_plan(records[i % len(records)]), tool_calls, phase, deadline)
        for i in range(n)
    ]
    events = []
    for p in players:
        p.start()
    time.sleep(0.4)  # the tool calls are under way
    events.append({"killed": "sandbox", "at": round(time.monotonic() - deadline + 300, 2)})
    kill(server, "sandbox")
    time.sleep(1.0)
    server.processes["sandbox"].start(timeout=120)
    events.append({"restarted": "sandbox", "at": round(time.monotonic() - deadline + 300, 2)})
    while any(p.is_alive() and p.answered_calls < tool_calls for p in players) and time.monotonic() < deadline:
        time.sleep(0.05)
    phase["ready"].set()
    scoring = scoring_now(redis_client, server, time.monotonic() + 20)
    killed_at = kill(server, "episodes")
    events.append({"killed": "episodes", "at": round(killed_at - deadline + 300, 2), "scoring_at_kill": scoring})
    server.processes["episodes"].start(timeout=120)
    events.append({"restarted": "episodes", "recovery_s": round(time.monotonic() - killed_at, 2)})
    for p in players:
        p.join(240)
    rows = []
    with EpisodeClient(server.url, server.token) as client:
        for p in players:
            row: dict[str, Any] = {
                "episode": p.episode_id,
                "error": p.error,
                "replies": len(p.replies),
                "answered_calls": p.answered_calls,
                "cut_calls": p.cut_calls,
                "unavailable_calls": p.unavailable_calls,
            }
            if p.episode_id:
                row.update(ledger(redis_client, server, p.episode_id))
                state = client.state(p.episode_id).model_dump(mode="json")
                row["same_result"] = bool(p.replies) and all(r == state["result"] for r in p.replies)
                row["reward"] = state["result"]["reward"] if state["result"] else None
            rows.append(row)
    return {"events": events, "episodes": rows}


def verdict(rows: list[dict[str, Any]], tool_calls: int) -> dict[str, Any]:
    finished = sum(r.get("status") == "finished" and r["replies"] == 2 for r in rows)
    scored_twice = sum(int(r.get("stores", 0)) > 1 for r in rows)
    never_scored = sum(int(r.get("stores", 0)) == 0 for r in rows)
    lapsed = sum(max(0, int(r.get("claims", 0)) - int(r.get("stores", 0))) for r in rows)
    differing = sum(not r.get("same_result") for r in rows)
    overcounted = sum(int(r.get("used", 0)) > tool_calls + r["cut_calls"] for r in rows)
    undercounted = sum(int(r.get("used", 0)) < tool_calls for r in rows)
    return {
        "episodes": len(rows),
        "finished": finished,
        "scored_twice": scored_twice,
        "never_scored": never_scored,
        "lapsed_claims": lapsed,
        "differing_replies": differing,
        "calls_overcounted": overcounted,
        "calls_undercounted": undercounted,
        "calls_503_while_sandbox_away": sum(r["unavailable_calls"] for r in rows),
        "errors": [r["error"] for r in rows if r["error"]][:5],
        "passed": finished == len(rows)
        and scored_twice == never_scored == differing == overcounted == undercounted == 0,
    }


def chaos_episodes(episodes: int = 24, kills: int = 2, tool_calls: int = 6, db: str | None = None) -> dict[str, Any]:
    import redis

    from bench.episodes import world_url
    from services.common.redis import EmbeddedRedis

    data = get_settings().travelplanner_dir
    records = train_records(data)
    with tempfile.TemporaryDirectory(prefix="star-episodes-chaos-") as tmp:
        url = world_url(db, data)
        redis_url = "redis://127.0.0.1:6379/0"
        embedded = None
        try:
            redis.Redis.from_url(redis_url, socket_connect_timeout=0.5).ping()
        except redis.ConnectionError:
            embedded = EmbeddedRedis().start()
            redis_url = embedded.url
        try:
            with running_episode_server(
                url, redis_url, Path(tmp) / "servers", travelplanner_dir=data, timeout=180
            ) as server:
                client = redis.Redis.from_url(redis_url)
                rounds = []
                for k in range(kills):
                    print(f"episodes chaos: round {k + 1} of {kills}", flush=True)
                    rounds.append(one_round(server, client, episodes, tool_calls, records))
                client.close()
        finally:
            if embedded is not None:
                embedded.stop()
    rows = [r for rnd in rounds for r in rnd["episodes"]]
    return {
        "kills": {"sandbox": kills, "episodes": kills},
        "episodes_per_round": episodes,
        "tool_calls": tool_calls,
        **verdict(rows, tool_calls),
        "events": [e for rnd in rounds for e in rnd["events"]],
        "rewards": sorted({r.get("reward") for r in rows if r.get("reward") is not None}),
    }


if __name__ == "__main__":
    print(json.dumps(chaos_episodes(int(sys.argv[1]) if len(sys.argv) > 1 else 8, 1), indent=1))
