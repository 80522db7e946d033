"""Episode API load benchmark: episodes/s and tool calls/s with their p99, against the stateless services
they sit on, measured in the same run.

    .venv/bin/python bench/episodes.py [--seconds 20] [--concurrency 8] [--tool-calls 10] [--db URL]

Servers (real processes, one uvicorn worker each): the sandbox, the episode service (episodes in the Redis at
127.0.0.1:6379, or an embedded one) and the reward service, over one world (the operator's TravelPlanner
tables with generated flights, built once into var/bench/). Load: `--concurrency` clients on one keep-alive
connection each (a small asyncio HTTP/1.1 client: httpx would spend more CPU than the servers), every client
running whole episodes back to back: start a train query by id, `--tool-calls` tool calls on its cities
(flights, places to stay, restaurants, attractions, distances), finish with its gold plan (scored in both
modes).

Baselines, with the same clients and plans: the reward service's stateless `POST /score` of the same gold
plans (one mode per request: a finish scores two), and the sandbox's `POST /tools/call` of the same calls (what
a tool call costs without an episode around it).

Results: bench/results/episodes.json and docs/lab/results/episodes.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.redis import EmbeddedRedis  # noqa: E402
from services.common.settings import get_settings  # noqa: E402
from tests.support.episode_plans import gold_plan, query_of, running_episode_server, train_records  # noqa: E402

RESULTS = ROOT / "bench" / "results"
REPORTS = ROOT / "docs" / "lab" / "results"  # the readable reports; the figures stay in RESULTS
WORLD = ROOT / "var" / "bench" / "episodes-world.sqlite"
TOKEN = "bench-token"


# -- a small keep-alive HTTP/1.1 client ----------------------------------------------------------------------


class Connection:
    def __init__(self, host: str, port: int, token: str | None = None) -> None:
        self.host, self.port = host, port
        self.auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        payload = orjson.dumps(body) if body is not None else b""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: keep-alive\r\n\r\n"
        )
        assert self.writer is not None and self.reader is not None
        self.writer.write(head.encode() + payload)
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split(b" ", 2)[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        data = await self.reader.readexactly(length) if length else b""
        return status, (orjson.loads(data) if data else None)


def split_url(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    return host, int(port)


# -- workload ------------------------------------------------------------------------------------------------


def episodes_of(travelplanner_dir: Path) -> list[dict[str, Any]]:
    """Per train query: its id, record, gold plan, and a cycle of tool calls on its cities."""
    out = []
    for position, record in enumerate(train_records(travelplanner_dir), 1):
        query = query_of(record, position)
        plan = gold_plan(record)
        cities = sorted(
            {part.strip() for day in plan for part in day["current_city"].replace("from ", "").split(" to ")} - {""}
        )
        dest = [c for c in cities if c != query["org"]] or [query["dest"]]
        calls = [
            ("SearchFlight", {"departure": query["org"], "destination": dest[0], "date": query["date"][0]}),
            ("SearchAccommodation", {"city": dest[0]}),
            ("SearchRestaurant", {"city": dest[0]}),
            ("SearchAttraction", {"city": dest[0]}),
            ("GoogleDistanceMatrix", {"departure": query["org"], "destination": dest[0], "mode": "driving"}),
        ]
        calls += [("SearchAccommodation", {"city": c}) for c in dest[1:]]
        out.append({"query_id": str(position), "query": query, "plan": plan, "calls": calls})
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(latencies_ms: list[float], count: int, seconds: float) -> dict[str, Any]:
    return {
        "count": count,
        "per_s": round(count / seconds, 1) if seconds else None,
        "p50_ms": _round(percentile(latencies_ms, 50)),
        "p99_ms": _round(percentile(latencies_ms, 99)),
        "mean_ms": _round(statistics.fmean(latencies_ms) if latencies_ms else None),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


async def run_clients(url: str, token: str | None, concurrency: int, seconds: float, body) -> tuple[dict, float, int]:
    """`body(conn, record, stats)` run back to back by every client until `seconds` pass."""
    host, port = split_url(url)
    stats: dict[str, list[float]] = {}
    errors = [0]
    stop = time.monotonic() + seconds

    async def client(i: int) -> None:
        conn = await Connection(host, port, token).open()
        try:
            counter = itertools.count(i)
            while time.monotonic() < stop:
                if not await body(conn, next(counter), stats):
                    errors[0] += 1
        finally:
            await conn.close()

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return stats, time.monotonic() - started, errors[0]


def timed(stats: dict[str, list[float]], name: str, started: float) -> None:
    stats.setdefault(name, []).append((time.perf_counter() - started) * 1000)


def episode_body(workload: list[dict[str, Any]], tool_calls: int):
    async def body(conn: Connection, n: int, stats: dict[str, list[float]]) -> bool:
        item = workload[n % len(workload)]
        t0 = time.perf_counter()
        status, started = await conn.request(
            "POST", "/v1/episodes", {"query_id": item["query_id"], "split": "train", "max_tool_calls": tool_calls}
        )
        timed(stats, "start", t0)
        if status != 201:
            return False
        episode = started["episode_id"]
        for name, arguments in itertools.islice(itertools.cycle(item["calls"]), tool_calls):
            t = time.perf_counter()
            status, _ = await conn.request(
                "POST", f"/v1/episodes/{episode}/tool_calls", {"name": name, "arguments": arguments}
            )
            timed(stats, "tool_call", t)
            if status != 200:
                return False
        t = time.perf_counter()
        status, result = await conn.request("POST", f"/v1/episodes/{episode}/finish", {"plan": item["plan"]})
        timed(stats, "finish", t)
        if status != 200 or not result["success"]["strict"]:
            return False
        timed(stats, "episode", t0)
        return True

    return body


def score_body(workload: list[dict[str, Any]]):
    async def body(conn: Connection, n: int, stats: dict[str, list[float]]) -> bool:
        item = workload[n % len(workload)]
        t = time.perf_counter()
        status, reply = await conn.request(
            "POST", "/score", {"query": item["query"], "plan": item["plan"], "mode": ("strict", "official")[n % 2]}
        )
        timed(stats, "score", t)
        return status == 200 and reply["score"]["success"] == 1

    return body


def tool_body(workload: list[dict[str, Any]]):
    async def body(conn: Connection, n: int, stats: dict[str, list[float]]) -> bool:
        item = workload[n % len(workload)]
        name, arguments = item["calls"][n % len(item["calls"])]
        t = time.perf_counter()
        status, _ = await conn.request("POST", "/tools/call", {"name": name, "arguments": arguments})
        timed(stats, "tool_call", t)
        return status == 200

    return body


# -- the run -------------------------------------------------------------------------------------------------


def world_url(db: str | None, travelplanner_dir: Path) -> str:
    from services.sandbox.world import World
    from services.sandbox.world.build import build_official_world

    url = db or f"sqlite:///{WORLD}"
    if World(url).problem() is None:
        return url
    WORLD.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the world into {url} ...", flush=True)
    build_official_world(
        url, travelplanner_dir / "database", seed=0, ref_info=[travelplanner_dir / "train" / "train_ref_info.jsonl"]
    )
    return url


@contextlib.contextmanager
def redis_url() -> Any:
    import redis

    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_connect_timeout=0.5).ping()
        yield "redis://127.0.0.1:6379/0"
    except redis.ConnectionError:
        with EmbeddedRedis() as server:
            yield server.url


def phase(name: str, url: str, token: str | None, args: argparse.Namespace, body) -> dict[str, Any]:
    stats, seconds, errors = asyncio.run(run_clients(url, token, args.concurrency, args.seconds, body))
    out = {
        "seconds": round(seconds, 2),
        "errors": errors,
        "load_average_1m_after": round(os.getloadavg()[0], 2),
        **{k: summary(v, len(v), seconds) for k, v in sorted(stats.items())},
    }
    print(
        f"{name}: "
        + ", ".join(f"{k} {v['per_s']}/s p99 {v['p99_ms']} ms" for k, v in out.items() if isinstance(v, dict))
        + f"; errors {errors}",
        flush=True,
    )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from services.controller.launcher import ServiceProcess

    travelplanner_dir = args.data or get_settings().travelplanner_dir
    workload = episodes_of(travelplanner_dir)
    url = world_url(args.db, travelplanner_dir)
    with tempfile.TemporaryDirectory(prefix="star-episodes-bench-") as tmp, redis_url() as redis:
        reward = ServiceProcess(
            "reward",
            "services.reward.app:create_app",
            {"STAR_DB_URL": url, "STAR_LOG_LEVEL": "WARNING", "STAR_FORMATTER_LLM_URL": "", "STAR_API_TOKEN": TOKEN},
            Path(tmp),
        ).start(timeout=180)
        try:
            with running_episode_server(
                url, redis, Path(tmp) / "episodes", travelplanner_dir=travelplanner_dir, token=TOKEN, timeout=180
            ) as server:
                results = {
                    "score_baseline": phase(
                        "POST /score (reward service)", reward.url, TOKEN, args, score_body(workload)
                    ),
                    "tool_baseline": phase(
                        "POST /tools/call (sandbox)", server.sandbox_url, TOKEN, args, tool_body(workload)
                    ),
                    "episodes": phase("episodes", server.url, TOKEN, args, episode_body(workload, args.tool_calls)),
                }
        finally:
            reward.stop()
    return results


def write_markdown(data: dict[str, Any], path: Path) -> None:
    meta, r = data["meta"], data["results"]
    ep, score, tools = r["episodes"], r["score_baseline"], r["tool_baseline"]

    def row(name: str, s: dict[str, Any] | None) -> str:
        if not s:
            return f"| {name} | - | - | - | - |"
        return f"| {name} | {s['count']} | {s['per_s']} | {s['p50_ms']} | {s['p99_ms']} |"

    lines = [
        "# Episode API load",
        "",
        f"{meta['concurrency']} clients, each on one keep-alive connection, for {meta['seconds']} s per phase; "
        f"every client runs whole episodes back to back: start a train query by id, {meta['tool_calls']} tool "
        f"calls, finish with the gold plan (scored in both modes). One uvicorn worker per service, the "
        f"load generator beside them. Baselines in the same run: the reward service's stateless `POST /score` "
        f"of the same gold plans (one mode each; a finish scores two) and the sandbox's `POST /tools/call` of "
        f"the same calls.",
        "",
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs; {meta['date']}; `{meta['command']}`; "
        f"{meta['queries']} train queries.",
        "",
        "| what | count | per s | p50 (ms) | p99 (ms) |",
        "|---|---:|---:|---:|---:|",
        row("episodes (start → finish)", ep.get("episode")),
        row("episode starts", ep.get("start")),
        row("episode tool calls", ep.get("tool_call")),
        row("episode finishes (both modes)", ep.get("finish")),
        row("baseline: POST /score (one mode)", score.get("score")),
        row("baseline: sandbox POST /tools/call", tools.get("tool_call")),
        "",
        f"Errors (a reply that was not the expected success): episodes {ep['errors']}, /score {score['errors']}, "
        f"tool calls {tools['errors']}. The machine's 1-minute load average after each phase (other jobs "
        f"share its cores): /score {score.get('load_average_1m_after')}, tool calls "
        f"{tools.get('load_average_1m_after')}, episodes {ep.get('load_average_1m_after')}.",
    ]
    if ep.get("tool_call") and tools.get("tool_call"):
        lines += [
            "",
            f"A tool call inside an episode takes {ep['tool_call']['p50_ms']} ms at the median against "
            f"{tools['tool_call']['p50_ms']} ms straight to the sandbox (the episode's Redis script and "
            f"the extra hop); a finish {ep['finish']['p50_ms']} ms against {score['score']['p50_ms']} ms "
            f"for one /score (a finish scores both modes and stores the result once).",
        ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="Length of each phase.")
    parser.add_argument("--concurrency", type=int, default=8, help="Clients at once.")
    parser.add_argument("--tool-calls", type=int, default=10, help="Tool calls per episode.")
    parser.add_argument("--db", default=None, help="SQLAlchemy URL of a built world (default: var/bench/).")
    parser.add_argument("--data", type=Path, default=None, help="TravelPlanner folder (default: settings).")
    parser.add_argument("--out", type=Path, default=RESULTS / "episodes.json")
    args = parser.parse_args()
    results = run(args)
    meta = {
        "seconds": args.seconds,
        "concurrency": args.concurrency,
        "tool_calls": args.tool_calls,
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "bench/episodes.py " + " ".join(sys.argv[1:]),
        "queries": len(train_records(args.data or get_settings().travelplanner_dir)),
    }
    data = {"meta": meta, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    REPORTS.mkdir(parents=True, exist_ok=True)
    write_markdown(
        data, REPORTS / args.out.with_suffix(".md").name if args.out.parent == RESULTS else args.out.with_suffix(".md")
    )
    return 0 if all(r["errors"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
