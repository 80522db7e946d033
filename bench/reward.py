"""Reward benchmark: plans scored per second per core, in-process and over HTTP, both modes,
against a pandas baseline measured in the same run.

    .venv/bin/python bench/reward.py [--quick] [--db URL] [--perturbed-per-gold N]

Plans: the 45 official train gold plans plus N perturbed copies of each (wrong or unknown
venues, repeated restaurants, unknown flights, conflicting transport, dropped days, moved
cities, tighter budgets, added constraints; 1–3 perturbations stacked), so most checks both pass
and fail. World: full size (the real tables plus ~3.8 M flights, built once into var/bench/,
shared with bench/sandbox.py).

Baseline: the official evaluator's approach to the database, measured on the same rows: whole
tables as pandas DataFrames and a boolean-mask filter (substring name match within the city,
flight number over the full flights table) for every lookup each check makes. Only the lookups
are timed, none of the verdict logic, so the baseline's rate is an upper bound on the official
evaluator's and the speed-up a lower bound.

Timings are single-threaded, so plans/s is plans/s per core. HTTP: one uvicorn worker (one core)
serving POST /score (one plan per request) and POST /score/batch (64 plans per request), with
the load generator on the other core.

Target (issue 3): ≥ 1,000 plans/s/core in-process in official mode. Results:
bench/results/reward.json, .md and .png.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import copy
import json
import os
import platform
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd
from sqlalchemy import text
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loadgen import post_request, run_load, serve_app  # noqa: E402
from bench.sandbox import full_world  # noqa: E402
from services.common.redis import free_port  # noqa: E402
from services.common.schemas import TravelQuery  # noqa: E402
from services.common.settings import get_settings  # noqa: E402
from services.reward import Evaluator  # noqa: E402
from services.reward.evaluator.parsing import before_paren, from_to, name_city  # noqa: E402
from services.sandbox.world import World  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGET_PLANS_PER_S = 1000.0
MEALS = ("breakfast", "lunch", "dinner")


# --- the plans ----------------------------------------------------------------------------------
def gold_plans(travelplanner_dir: Path) -> tuple[list[dict], list[TravelQuery], list[list[dict]]]:
    records = json.loads((travelplanner_dir / "train" / "train.json").read_text(encoding="utf-8"))
    return records, [TravelQuery(**r) for r in records], [ast.literal_eval(r["annotated_plan"])[1] for r in records]


def _days(plan: list[dict]) -> list[dict]:
    return [d for d in plan if d]


def _perturb(
    plan: list[dict], query: TravelQuery, rng: random.Random, pool: dict[str, list[str]]
) -> tuple[list[dict], TravelQuery]:
    """One random change that makes one or more checks fail (or, sometimes, still pass)."""
    plan = copy.deepcopy(plan)
    days = _days(plan)
    d = rng.choice(days)
    kind = rng.randrange(12)
    if kind == 0:  # a restaurant from another trip (another city, or not in the world at all)
        d[rng.choice(MEALS)] = rng.choice(pool["meals"])
    elif kind == 1:  # the same restaurant twice
        meals = [(x, m) for x in days for m in MEALS if x.get(m, "-") != "-"]
        if meals:
            x, m = rng.choice(meals)
            rng.choice(days)[rng.choice(MEALS)] = x[m]
    elif kind == 2:  # a flight that does not exist
        flights = [x for x in days if "Flight Number: " in x.get("transportation", "")]
        if flights:
            x = rng.choice(flights)
            x["transportation"] = re.sub(r"F\d+", f"F{rng.randrange(10**6, 10**7)}", x["transportation"])
    elif kind == 3:  # drive instead (may conflict with a flight on another day)
        travel = [x for x in days if x["current_city"].startswith("from ")]
        if travel:
            x = rng.choice(travel)
            a, b = from_to(x["current_city"])
            x["transportation"] = f"Self-driving, from {a} to {b}, duration: 5 hours, distance: 500 km, cost: 25"
    elif kind == 4:  # the last day dropped
        plan = plan[: len(days) - 1]
    elif kind == 5:  # a lodging that does not exist
        d["accommodation"] = f"Nowhere Inn {rng.randrange(1000)}, {before_paren(d['current_city']).split(' to ')[-1]}"
    elif kind == 6:  # an attraction from another trip, or the same one twice
        d["attraction"] = rng.choice(pool["attractions"]) + ";" + d.get("attraction", "-").replace("-", "")
    elif kind == 7:  # the stay moved to another city
        if not d["current_city"].startswith("from "):
            d["current_city"] = rng.choice(pool["cities"])
    elif kind == 8:  # a taxi on a flight day
        if "Flight Number: " in d.get("transportation", ""):
            d["transportation"] = "Taxi, " + d["transportation"]
    elif kind == 9:  # a field left out
        d.pop(rng.choice(["breakfast", "lunch", "attraction", "accommodation"]), None)
    elif kind == 10:  # a budget the plan cannot meet
        query = query.model_copy(update={"budget": max(0, query.budget // 3)})
    else:  # a constraint the query did not have
        lc = query.local_constraint.model_copy(
            update=rng.choice(
                [
                    {"cuisine": ["Mexican", "French"]},
                    {"room_type": "shared room"},
                    {"house_rule": "pets"},
                    {"transportation": "no flight"},
                ]
            )
        )
        query = query.model_copy(update={"local_constraint": lc})
    return plan, query


def plan_set(
    queries: list[TravelQuery], plans: list[list[dict]], per_gold: int, seed: int = 0
) -> tuple[list[TravelQuery], list[list[dict]]]:
    rng = random.Random(seed)
    pool: dict[str, list[str]] = {"meals": [], "attractions": [], "cities": []}
    for p in plans:
        for d in _days(p):
            pool["meals"] += [d[m] for m in MEALS if d.get(m, "-") != "-"]
            pool["attractions"] += [a for a in d.get("attraction", "-").split(";") if a.strip() and a != "-"]
            if not d["current_city"].startswith("from "):
                pool["cities"].append(d["current_city"])
    out_q, out_p = list(queries), [copy.deepcopy(p) for p in plans]
    for _ in range(per_gold):
        for q, p in zip(queries, plans):
            for _ in range(rng.choice((1, 1, 2, 3))):
                p, q = _perturb(p, q, rng, pool)
            out_q.append(q)
            out_p.append(p)
    return out_q, out_p


# --- in-process ---------------------------------------------------------------------------------
def in_process(world: World, queries, plans, rounds: int) -> dict[str, Any]:
    out = {}
    for mode in ("official", "strict"):
        ev = Evaluator(world, mode=mode)
        t0 = time.perf_counter()
        for q, p in zip(queries, plans):
            ev.score(q, p)
        cold = time.perf_counter() - t0
        per_plan: list[float] = []
        for _ in tqdm(range(rounds), desc=f"in-process {mode}", leave=False):
            for q, p in zip(queries, plans):
                s = time.perf_counter()
                ev.score(q, p)
                per_plan.append(time.perf_counter() - s)
        ms = np.asarray(per_plan) * 1000
        successes = sum(ev.score(q, p).success for q, p in zip(queries, plans))
        out[mode] = {
            "plans": len(plans),
            "rounds": rounds,
            "cold_plans_per_s": round(len(plans) / cold, 1),
            "plans_per_s": round(1000 / float(ms.mean()), 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 4),
            "p99_ms": round(float(np.percentile(ms, 99)), 4),
            "passing_plans": int(successes),
        }
    return out


# --- the pandas baseline (the official evaluator's lookups) -------------------------------------
class PandasLookups:
    """Whole tables in DataFrames; every lookup a boolean mask over a table, as the official
    evaluator's checks do (`get_valid_name_city` + `str.contains` within the city)."""

    def __init__(self, world: World) -> None:
        with world.engine.connect() as conn:

            def table(sql: str) -> pd.DataFrame:
                return pd.read_sql(text(sql), conn)

            self.flights = table(
                'select flight_number as "Flight Number", price as "Price", '
                'origin as "OriginCityName", dest as "DestCityName" from flights where visible'
            )
            self.acc = table(
                'select name as "NAME", price, room_type, house_rules, minimum_nights, '
                "maximum_occupancy, city from accommodations where visible"
            )
            self.rest = table(
                'select name as "Name", average_cost as "Average Cost", cuisines as "Cuisines", '
                'city as "City" from restaurants where visible'
            )
            self.attr = table('select name as "Name", city as "City" from attractions where visible')
            self.dist = table("select origin, destination, duration, distance from distances")

    def venue(self, df: pd.DataFrame, name_col: str, city_col: str, value: str) -> int:
        name, city = name_city(value)
        return len(df[(df[name_col].astype(str).str.contains(re.escape(name))) & (df[city_col] == city)])

    def plan(self, query: TravelQuery, plan: list[dict]) -> int:
        """The lookups of one plan: sandbox check, cost, minimum nights, cuisine, room rule/type."""
        found = 0
        for d in _days(plan)[: query.days]:
            t = d.get("transportation") or "-"
            if "Flight Number: " in t:
                number = t.split("Flight Number: ")[1].split(",")[0]
                for _ in range(2):  # sandbox, cost
                    found += len(self.flights[self.flights["Flight Number"] == number])
            elif t != "-":
                a, b = from_to(t)
                for _ in range(2):
                    found += len(self.dist[(self.dist["origin"] == a) & (self.dist["destination"] == b)])
            for m in MEALS:
                if d.get(m, "-") not in ("-", None):
                    for _ in range(3):  # sandbox, cost, cuisine
                        found += self.venue(self.rest, "Name", "City", d[m])
            for item in (d.get("attraction") or "-").split(";")[:-1]:
                if item.strip() and item != "-":
                    found += self.venue(self.attr, "Name", "City", item)
            if d.get("accommodation", "-") not in ("-", None):
                for _ in range(4):  # sandbox, cost, minimum nights, room rule / room type
                    found += self.venue(self.acc, "NAME", "city", d["accommodation"])
        return found


def baseline(world: World, queries, plans, sample: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    base = PandasLookups(world)
    load_s = time.perf_counter() - t0
    idx = random.Random(1).sample(range(len(plans)), min(sample, len(plans)))
    per_plan = []
    for i in tqdm(idx, desc="pandas baseline", leave=False):
        s = time.perf_counter()
        base.plan(queries[i], plans[i])
        per_plan.append(time.perf_counter() - s)
    ms = np.asarray(per_plan) * 1000
    return {
        "plans": len(idx),
        "table_load_s": round(load_s, 1),
        "plans_per_s": round(1000 / float(ms.mean()), 2),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
    }


# --- over HTTP ----------------------------------------------------------------------------------
def http(db_url: str, records: list[dict], queries, plans, *, seconds: float, batch: int) -> dict[str, Any]:
    port = free_port()
    env = {"STAR_DB_URL": db_url, "STAR_LOG_LEVEL": "WARNING", "STAR_FORMATTER_LLM_URL": ""}
    with serve_app("services.reward.app:create_app", port, env):
        out: dict[str, Any] = {"workers": 1}
        items = [{"query": q.model_dump(mode="json"), "plan": p} for q, p in zip(queries, plans)]
        for mode in ("official", "strict"):
            singles = [post_request("127.0.0.1", port, "/score", orjson.dumps({**it, "mode": mode})) for it in items]
            batches = [
                post_request(
                    "127.0.0.1",
                    port,
                    "/score/batch",
                    orjson.dumps({"items": [{**it, "mode": mode} for it in items[i : i + batch]]}),
                )
                for i in range(0, len(items) - batch + 1, batch)
            ]
            asyncio.run(run_load("127.0.0.1", port, singles, connections=4, seconds=1.5))  # warm-up
            one = asyncio.run(run_load("127.0.0.1", port, singles, connections=4, seconds=seconds))
            many = asyncio.run(run_load("127.0.0.1", port, batches, connections=2, seconds=seconds))
            out[mode] = {
                "score": {
                    "plans_per_s": round(one.rps, 1),
                    "requests": one.requests,
                    "errors": one.errors,
                    "p50_ms": round(float(np.percentile(one.latencies_ms, 50)), 2),
                    "p99_ms": round(float(np.percentile(one.latencies_ms, 99)), 2),
                },
                "score_batch": {
                    "batch": batch,
                    "plans_per_s": round(many.rps * batch, 1),
                    "requests": many.requests,
                    "errors": many.errors,
                    "p50_ms": round(float(np.percentile(many.latencies_ms, 50)), 2),
                },
            }
        return out


# --- report -------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colors = [], [], []
    for mode in ("official", "strict"):
        labels += [f"in-process\n{mode}", f"HTTP /score\n{mode}", f"HTTP batch\n{mode}"]
        values += [
            result["in_process"][mode]["plans_per_s"],
            result["http"][mode]["score"]["plans_per_s"],
            result["http"][mode]["score_batch"]["plans_per_s"],
        ]
        colors += ["tab:blue", "tab:green", "tab:olive"]
    labels.append("pandas\nbaseline")
    values.append(result["baseline_pandas"]["plans_per_s"])
    colors.append("tab:red")
    fig, ax = plt.subplots(figsize=(11, 4.8))
    ax.bar(labels, values, color=colors)
    ax.set_yscale("log")
    ax.axhline(TARGET_PLANS_PER_S, color="grey", ls="--", lw=0.8, label="target 1,000 plans/s/core (in-process)")
    for i, v in enumerate(values):
        ax.text(i, v * 1.08, f"{v:,.0f}" if v >= 10 else f"{v:.2f}", ha="center", fontsize=8)
    ax.set_ylabel("plans / s / core (log)")
    ax.set_title(f"Scoring throughput, {result['plans']} plans (45 gold + perturbed), full-size world")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(r: dict) -> str:
    ip, b = r["in_process"], r["baseline_pandas"]
    lines = [
        f"# Reward benchmark ({r['measured_at']})",
        "",
        f"Machine: {r['machine']}, load average before the run {r['loadavg'][0]:.2f}. World: {r['world']}.",
        f"Plans: {r['plans']} = 45 gold + {r['plans'] - 45} perturbed ({r['passing']['official']} pass in official "
        f"mode, {r['passing']['strict']} in strict). Single-threaded timings, so plans/s is per core.",
        "",
        "| path | mode | plans/s/core | p50 ms | p99 ms | vs baseline |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode in ("official", "strict"):
        m = ip[mode]
        lines.append(
            f"| in-process (warm) | {mode} | {m['plans_per_s']:,.0f} | {m['p50_ms']} | {m['p99_ms']} | "
            f"{m['plans_per_s'] / b['plans_per_s']:,.0f}× |"
        )
        lines.append(f"| in-process (cold caches) | {mode} | {m['cold_plans_per_s']:,.0f} | | | |")
    for mode in ("official", "strict"):
        h = r["http"][mode]
        lines.append(
            f"| HTTP POST /score, 1 worker | {mode} | {h['score']['plans_per_s']:,.0f} | {h['score']['p50_ms']} | "
            f"{h['score']['p99_ms']} | {h['score']['plans_per_s'] / b['plans_per_s']:,.0f}× |"
        )
        lines.append(
            f"| HTTP POST /score/batch ({h['score_batch']['batch']}/request), 1 worker | {mode} | "
            f"{h['score_batch']['plans_per_s']:,.0f} | | | {h['score_batch']['plans_per_s'] / b['plans_per_s']:,.0f}× |"
        )
    lines.append(
        f"| baseline: pandas lookups ({b['plans']} plans; tables load in {b['table_load_s']} s) | official | "
        f"{b['plans_per_s']:,.2f} | {b['p50_ms']} | {b['p99_ms']} | 1× |"
    )
    t = r["target"]
    lines += [
        "",
        f"Target ≥ {t['plans_per_s']:,.0f} plans/s/core in-process, official mode: "
        f"**{'MET' if t['met'] else 'MISSED'}** ({ip['official']['plans_per_s']:,.0f}).",
        "",
        "The baseline times only the database lookups the official evaluator makes per plan (pandas masks "
        "over whole tables, flight numbers over all flights), no verdict logic: it is an upper bound on the "
        "official evaluator's rate, so each speed-up is a lower bound. HTTP runs share the machine's cores "
        "with the load generator.",
        "",
        "![throughput](reward.png)",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="world URL (default: var/bench/world-full.sqlite, built on first use)")
    ap.add_argument("--perturbed-per-gold", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="warm in-process rounds over all plans")
    ap.add_argument("--baseline-plans", type=int, default=60)
    ap.add_argument("--seconds", type=float, default=8.0, help="HTTP load per measurement")
    ap.add_argument("--quick", action="store_true", help="small run to check the script")
    args = ap.parse_args()
    if args.quick:
        args.perturbed_per_gold, args.rounds, args.baseline_plans, args.seconds = 2, 1, 5, 2.0
    loadavg = os.getloadavg()
    world = full_world(args.db)
    counts = world.counts()
    settings = get_settings()
    records, queries, gold = gold_plans(settings.travelplanner_dir)
    qs, ps = plan_set(queries, gold, args.perturbed_per_gold)
    result: dict[str, Any] = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "loadavg": loadavg,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "world": f"{counts['flights']:,} flights, {counts['restaurants']:,} restaurants, "
        f"{counts['accommodations']:,} accommodations",
        "plans": len(ps),
    }
    result["in_process"] = in_process(world, qs, ps, args.rounds)
    result["passing"] = {m: result["in_process"][m]["passing_plans"] for m in ("official", "strict")}
    result["baseline_pandas"] = baseline(world, qs, ps, args.baseline_plans)
    result["http"] = http(world.url, records, qs, ps, seconds=args.seconds, batch=64)
    result["target"] = {
        "plans_per_s": TARGET_PLANS_PER_S,
        "met": result["in_process"]["official"]["plans_per_s"] >= TARGET_PLANS_PER_S,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reward.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "reward.png")
    (RESULTS / "reward.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
