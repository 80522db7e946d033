"""Sandbox benchmark: tool latency in-process, HTTP throughput, and a pandas baseline, one run.

    .venv/bin/python bench/sandbox.py [--quick] [--db URL]

The world is full size: the real tables plus ~3.8 M generated flights (or a synthetic `full`
world when the real data is absent), built once into var/bench/. The baseline is the official
tools' approach, measured on the same rows: whole tables in pandas DataFrames, a boolean-mask
filter per call, and the same output text. Outputs of both are compared for equality, so the
speed-up is between two implementations of the same answer.

Targets (issue 2): in-process p99 ≤ 1 ms per call, SearchFlight ≥ 100× faster than the baseline,
HTTP ≥ 1,500 calls/s on 2 cores. Results: bench/results/sandbox.json, .md and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
from sqlalchemy import text
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loadgen import post_request, run_load, serve_app  # noqa: E402
from services.common.redis import free_port  # noqa: E402
from services.common.settings import get_settings  # noqa: E402
from services.sandbox.tools.toolbox import ToolBox  # noqa: E402
from services.sandbox.world import (
    World,  # noqa: E402
    build,  # noqa: E402
)

RESULTS = ROOT / "bench" / "results"
TOOLS = [
    "SearchCity",
    "SearchFlight",
    "GoogleDistanceMatrix",
    "SearchAccommodation",
    "SearchRestaurant",
    "SearchAttraction",
]


# --- the world ------------------------------------------------------------------------------
def full_world(url: str | None) -> World:
    url = url or f"sqlite:///{ROOT / 'var' / 'bench' / 'world-full.sqlite'}"
    world = World(url)
    if world.is_ready() and world.counts()["flights"] >= 3_800_000:
        return world
    settings = get_settings()
    database = settings.travelplanner_dir / "database"
    bar = tqdm(desc="building full world", unit=" rows", unit_scale=True)
    progress = lambda stage, n: (bar.set_postfix_str(stage), bar.update(n))  # noqa: E731
    if (database / "background").is_dir():
        ref = settings.travelplanner_dir / "train" / "train_ref_info.jsonl"
        build.build_official_world(url, database, seed=0, ref_info=[ref], flight_scale=1.0, progress=progress)
    else:
        build.build_synthetic_world(url, size="full", seed=0, progress=progress)
    bar.close()
    return World(url)


def workload(world: World, n: int, seed: int = 0) -> list[tuple[str, dict]]:
    """Realistic arguments: real cities and states, flight routes that exist and some that don't."""
    rng = random.Random(seed)
    cities = [c for c in world.cities() if c.searchable]
    states = sorted({c.state for c in cities})
    with world.engine.connect() as conn:
        max_id = conn.execute(text("select max(id) from flights")).scalar_one()
        triples = []
        for _ in range(n):
            row = conn.execute(
                text("select origin, dest, flight_date from flights where id = :i"), {"i": rng.randrange(max_id + 1)}
            ).first()
            if row:
                triples.append(tuple(row))
        pairs = [tuple(r) for r in conn.execute(text("select origin, destination from distances")).all()]
    calls: list[tuple[str, dict]] = []
    for i in range(n):
        city = rng.choice(cities).city
        o, d = rng.choice(pairs)
        if i % 4 == 3:  # a quarter of flight searches miss: a random pair on a random day
            a, b = rng.sample(cities, 2)
            ft = (a.city, b.city, f"2022-03-{rng.randrange(1, 32):02d}")
        else:
            ft = rng.choice(triples)
        calls += [
            ("SearchCity", {"state": rng.choice(states)}),
            ("SearchFlight", {"departure": ft[0], "destination": ft[1], "date": ft[2]}),
            ("GoogleDistanceMatrix", {"departure": o, "destination": d, "mode": rng.choice(["driving", "taxi"])}),
            ("SearchAccommodation", {"city": city}),
            ("SearchRestaurant", {"city": city}),
            ("SearchAttraction", {"city": city}),
        ]
    return calls


# --- the pandas baseline (the official tools' approach) -------------------------------------
class PandasTools:
    """Whole tables in DataFrames, filtered per call; star-dialect text, like Agent-STAR's tools."""

    def __init__(self, world: World) -> None:
        with world.engine.connect() as conn:

            def table(sql: str) -> pd.DataFrame:
                return pd.read_sql(text(sql), conn)

            self.flights = table(
                "select flight_number, price, dep_time, arr_time, elapsed, flight_date, origin, dest,"
                " distance from flights where visible order by id"
            )
            self.acc = table(
                "select name, price, room_type, house_rules, minimum_nights, maximum_occupancy,"
                " review_rate, city from accommodations where visible order by id"
            )
            self.rest = table(
                "select name, average_cost, cuisines, rating, city from restaurants where visible order by id"
            )
            self.attr = table(
                "select name, latitude, longitude, address, phone, website, city from attractions"
                " where visible order by id"
            )
            self.dist = table("select origin, destination, duration, distance from distances order by id")
            self.cities = table("select city, state from cities order by id")

    def call(self, name: str, a: dict) -> str:
        return getattr(self, name)(**a)

    def SearchFlight(self, departure: str, destination: str, date: str) -> str:  # noqa: N802
        f = self.flights
        rows = f[(f["origin"] == departure) & (f["dest"] == destination) & (f["flight_date"] == date)]
        if len(rows) == 0:
            return (
                f"There is no available flight from {departure} to {destination} on {date}. "
                "Please rethink your flight search and try again."
            )
        lines = [
            f"{i + 1}. [{r[0]}] ${r[1]}. Departure: {r[2]}, Arrival: {r[3]}, Actual Elapsed Time: {r[4]}, "
            f"Distance: {r[8]} miles\n"
            for i, r in enumerate(rows.itertuples(index=False))
        ]
        return (
            f"A SearchFlight for {departure} to {destination} on {date} found the following {len(rows)} flights:\n"
            + "\n".join(lines)
        )

    def SearchAccommodation(self, city: str) -> str:  # noqa: N802
        rows = self.acc[self.acc["city"] == city]
        if len(rows) == 0:
            return f"There is no accommodation in {city}. Please rethink your accommodation search and try again."
        lines = [
            f"{i + 1}. [{r[0]}] ${r[1]}. Room Type: {r[2]}, House Rules: {r[3]}, Minimum Nights: {r[4]}, "
            f"Maximum Occupancy: {r[5]}, Review Rate Number: {r[6]}\n"
            for i, r in enumerate(rows.itertuples(index=False))
        ]
        return f"A SearchAccommodation for {city} found the following {len(lines)} accommodations:\n" + "\n".join(lines)

    def SearchRestaurant(self, city: str) -> str:  # noqa: N802
        rows = self.rest[self.rest["city"] == city]
        if len(rows) == 0:
            return f"There is no restaurant in {city}. Please rethink your restaurant search and try again."
        lines = [
            f"{i + 1}. [{r[0]}] Avg. Cost ${r[1]}. Cuisines: {r[2]}. Rating: {r[3]}\n"
            for i, r in enumerate(rows.itertuples(index=False))
        ]
        return f"A SearchRestaurant for city {city} found the following {len(lines)} restaurants:\n" + "\n".join(lines)

    def SearchAttraction(self, city: str) -> str:  # noqa: N802
        rows = self.attr[self.attr["city"] == city]
        if len(rows) == 0:
            return f"There is no attraction in {city}. Please rethink your attraction search and try again."
        lines = [
            f"{i + 1}. [{r[0]}]({r[5]}) Address: {r[3]}. Contact: {r[4]}\n"
            for i, r in enumerate(rows.itertuples(index=False))
        ]
        return f"A SearchAttraction for city {city} found the following {len(lines)} attractions:\n" + "\n".join(lines)

    def SearchCity(self, state: str) -> str:  # noqa: N802
        found = self.cities[self.cities["state"] == state]["city"].tolist()
        if not found:
            return f"There is no city in {state}. Please rethink your city search and try again."
        return f"A SearchCity for state {state} found the following {len(found)} cities:\n" + ", ".join(found)

    def GoogleDistanceMatrix(self, departure: str, destination: str, mode: str = "driving") -> str:  # noqa: N802
        d = self.dist
        rows = d[(d["origin"] == departure) & (d["destination"] == destination)]
        if len(rows) == 0:
            return "No valid information found. Please rethink your distance search and try again."
        duration, distance = rows["duration"].values[0], rows["distance"].values[0]
        if duration is None or distance is None or pd.isna(duration) or pd.isna(distance):
            return f"Sorry, we cannot find the distance between {departure} and {destination}."
        km = float(distance.replace("km", "").replace(",", "").strip())
        cost = int(km * 0.05) if "driving" in mode else int(km)
        if "day" in duration:
            return (
                "The required time exceeds a single day, we cannot provide the cost. "
                "Please consider an alternative transportation instead."
            )
        return (
            f"A GoogleDistanceMatrix found the following information:\n{mode}, from {departure} to {destination}, "
            f"duration: {duration}, distance: {distance}, cost: ${cost}"
        )


# --- measurements ---------------------------------------------------------------------------
def latencies(fn, calls: list[tuple[str, dict]], desc: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {t: [] for t in TOOLS}
    for name, args in tqdm(calls, desc=desc, leave=False):
        t0 = time.perf_counter()
        fn(name, args)
        out[name].append((time.perf_counter() - t0) * 1000)
    return out


def summary(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {
        "n": int(a.size),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
    }


def http_throughput(
    db_url: str, calls: list[tuple[str, dict]], *, workers: int, cache: int, seconds: float, connections: int
) -> dict:
    port = free_port()
    env = {"STAR_DB_URL": db_url, "STAR_TOOL_CACHE_SIZE": str(cache), "STAR_LOG_LEVEL": "WARNING"}
    with serve_app("services.sandbox.app:create_app", port, env, workers=workers):
        requests = [
            post_request("127.0.0.1", port, "/tools/call", orjson.dumps({"name": n, "arguments": a})) for n, a in calls
        ]
        asyncio.run(run_load("127.0.0.1", port, requests, connections=connections, seconds=2.0))  # warm-up
        res = asyncio.run(run_load("127.0.0.1", port, requests, connections=connections, seconds=seconds))
        lat = np.asarray(res.latencies_ms)
        return {
            "workers": workers,
            "tool_cache": cache,
            "connections": connections,
            "seconds": round(res.seconds, 2),
            "requests": res.requests,
            "errors": res.errors,
            "calls_per_s": round(res.rps, 1),
            "latency_p50_ms": round(float(np.percentile(lat, 50)), 3),
            "latency_p99_ms": round(float(np.percentile(lat, 99)), 3),
        }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(TOOLS))
    ours = [result["in_process"]["star"][t]["p50_ms"] for t in TOOLS]
    ours99 = [result["in_process"]["star"][t]["p99_ms"] for t in TOOLS]
    base = [result["baseline_pandas"][t]["p50_ms"] for t in TOOLS]
    ax1.bar(x - 0.27, ours, 0.27, label="SQL p50")
    ax1.bar(x, ours99, 0.27, label="SQL p99")
    ax1.bar(x + 0.27, base, 0.27, label="pandas baseline p50")
    ax1.set_yscale("log")
    ax1.set_xticks(x, [t.replace("Search", "").replace("GoogleDistanceMatrix", "Distance") for t in TOOLS], rotation=20)
    ax1.set_ylabel("ms per call (log)")
    ax1.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax1.set_title("In-process tool latency (cache off)")
    ax1.legend(fontsize=8)
    runs = result["http"]
    labels = [f"{r['workers']}w, cache {'on' if r['tool_cache'] else 'off'}" for r in runs]
    ax2.bar(labels, [r["calls_per_s"] for r in runs], color="tab:green")
    ax2.axhline(1500, color="red", ls="--", lw=0.8, label="target 1,500/s")
    ax2.set_ylabel("calls / s")
    ax2.set_title("HTTP throughput (POST /tools/call, 2 cores shared with the client)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="world URL (default: var/bench/world-full.sqlite, built on first use)")
    ap.add_argument("--quick", action="store_true", help="fewer calls and shorter HTTP runs")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per HTTP run")
    args = ap.parse_args()
    n = 200 if args.quick else 2000
    seconds = args.seconds or (4.0 if args.quick else 10.0)

    world = full_world(args.db)
    counts = world.counts()
    print(f"world: {world.url}  " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    calls = workload(world, n)

    result: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_at_start": os.getloadavg(),
        },
        "world": {"url": world.url, "counts": counts, "meta": world.meta()},
        "in_process": {},
        "targets": {"in_process_p99_ms": 1.0, "flight_speedup": 100, "http_calls_per_s": 1500},
    }
    for dialect in ("star", "official"):
        box = ToolBox(world, dialect=dialect, cache_size=0)
        for name, a in calls[:60]:
            box.call(name, a)  # warm the SQLite page cache and statement caches
        lat = latencies(lambda nm, a: box.call(nm, a), calls, f"in-process {dialect}")
        result["in_process"][dialect] = {t: summary(v) for t, v in lat.items()}

    t0 = time.perf_counter()
    pandas_tools = PandasTools(world)
    result["baseline_load_s"] = round(time.perf_counter() - t0, 2)
    box = ToolBox(world, dialect="star", cache_size=0)
    sample = calls[: 6 * (30 if args.quick else 100)]  # the baseline is slow: a prefix of the same workload
    mismatches = [c for c in sample if pandas_tools.call(*c) != box.call(*c).text]
    result["baseline_mismatches"] = len(mismatches)
    base = latencies(pandas_tools.call, sample, "pandas baseline")
    result["baseline_pandas"] = {t: summary(v) for t, v in base.items()}
    result["speedup_p50"] = {
        t: round(result["baseline_pandas"][t]["p50_ms"] / result["in_process"]["star"][t]["p50_ms"], 1) for t in TOOLS
    }

    result["http"] = []
    for workers, cache in ((1, 4096), (2, 4096), (2, 0)):
        r = http_throughput(world.url, calls, workers=workers, cache=cache, seconds=seconds, connections=32)
        print(f"HTTP workers={workers} cache={cache}: {r['calls_per_s']:,.0f} calls/s (p99 {r['latency_p99_ms']} ms)")
        result["http"].append(r)

    worst_p99 = max(v["p99_ms"] for v in result["in_process"]["star"].values())
    best_http = max(r["calls_per_s"] for r in result["http"])
    result["verdict"] = {
        "in_process_p99_ms_worst_tool": round(worst_p99, 3),
        "in_process_ok": worst_p99 <= 1.0,
        "flight_speedup": result["speedup_p50"]["SearchFlight"],
        "flight_ok": result["speedup_p50"]["SearchFlight"] >= 100,
        "http_calls_per_s_best": best_http,
        "http_ok": best_http >= 1500,
        "baseline_outputs_equal": not mismatches,
    }
    result["machine"]["loadavg_at_end"] = os.getloadavg()  # other work on the box skews every figure
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    result["measured_at"] = stamp
    (RESULTS / "sandbox.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "sandbox.png")
    (RESULTS / "sandbox.md").write_text(report(result))
    print(report(result))


def report(r: dict) -> str:
    load = r["machine"].get("loadavg_at_start", ["?"])[0]
    lines = [
        f"# Sandbox benchmark ({r['measured_at']}, {r['machine']['cpus']} CPUs, load {load} at start)",
        "",
        f"World: {r['world']['counts']['flights']:,} flights, {r['world']['meta'].get('flights', '')}",
        "",
        "| tool | star p50 ms | star p99 ms | official p99 ms | pandas p50 ms | speed-up (p50) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for t in TOOLS:
        s, o, b = r["in_process"]["star"][t], r["in_process"]["official"][t], r["baseline_pandas"][t]
        lines.append(
            f"| {t} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {o['p99_ms']:.3f} | {b['p50_ms']:.2f} | "
            f"{r['speedup_p50'][t]}× |"
        )
    lines += ["", "| HTTP | calls/s | p50 ms | p99 ms | errors |", "|---|---:|---:|---:|---:|"]
    for h in r["http"]:
        lines.append(
            f"| {h['workers']} worker(s), tool cache {'on' if h['tool_cache'] else 'off'}, "
            f"{h['connections']} conns | {h['calls_per_s']:,.0f} | {h['latency_p50_ms']} | {h['latency_p99_ms']} | "
            f"{h['errors']} |"
        )
    v = r["verdict"]
    lines += [
        "",
        f"Verdict: in-process worst p99 {v['in_process_p99_ms_worst_tool']} ms (target ≤ 1): "
        f"{'OK' if v['in_process_ok'] else 'MISSED'}; SearchFlight {v['flight_speedup']}× the baseline "
        f"(target ≥ 100): {'OK' if v['flight_ok'] else 'MISSED'}; HTTP {v['http_calls_per_s_best']:,.0f} calls/s "
        f"(target ≥ 1,500): {'OK' if v['http_ok'] else 'MISSED'}; baseline outputs identical: "
        f"{v['baseline_outputs_equal']} (baseline load {r['baseline_load_s']} s).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
