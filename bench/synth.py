"""Synthesis benchmark: oracle queries/s on the real tables (2 cores), against a naive baseline.

    .venv/bin/python bench/synth.py [--db URL] [--candidates 2000] [--naive 30] [--n 1000]

1. Index build time (once per process).
2. Oracle (`Oracle.cheapest`, the feasibility check of synthesis) on `--candidates` sampled
   candidate queries (4:3:3 levels, as synthesis draws them), one process: queries/s and per-query
   ms by trip length.
3. Baseline in the same run: `naive_cheapest` (every route × night split × per-leg mode ×
   accommodation, no bounds or arrays) on a small sample of the same candidates; the oracle on
   that same sample, and a check that both find the same cost.
4. End to end: `QuerySynthesizer.generate` for `--n` feasible queries with 2 worker processes
   (what `star synth queries --n 1000` does), wall time.
Target (issue 6): thousands of candidate queries validated on 2 cores in minutes.
Results: bench/results/synth.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.settings import get_settings  # noqa: E402
from services.controller.launcher import ensure_world  # noqa: E402
from services.sandbox.world import World  # noqa: E402
from services.synth.baseline import naive_cheapest  # noqa: E402
from services.synth.index import SynthIndex  # noqa: E402
from services.synth.oracle import Oracle  # noqa: E402
from services.synth.queries import LEVELS, ElementSampler, QuerySynthesizer, allocate  # noqa: E402


def candidates(index: SynthIndex, n: int, seed: int) -> list:
    sampler = ElementSampler(index, random.Random(seed))
    out = []
    for level, k in zip(LEVELS, allocate(n, (4, 3, 3))):
        out += [sampler.query(level) for _ in range(k)]
    random.Random(seed).shuffle(out)
    return out


def timed(fn, items, desc: str) -> tuple[list, list[float]]:
    results, ms = [], []
    for q in tqdm(items, desc=desc, leave=False):
        t0 = time.perf_counter()
        results.append(fn(q))
        ms.append((time.perf_counter() - t0) * 1000)
    return results, ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="world URL (default: the STAR_HOME world, built if absent)")
    ap.add_argument("--candidates", type=int, default=2000)
    ap.add_argument("--naive", type=int, default=30, help="baseline sample size (3/5-day and small-state 7-day)")
    ap.add_argument("--n", type=int, default=1000, help="feasible queries for the end-to-end run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    url = args.db or get_settings().world_url
    ensure_world(url)
    world = World(url)
    t0 = time.perf_counter()
    index = SynthIndex.build(world)
    build_s = time.perf_counter() - t0
    oracle = Oracle(index)

    cands = candidates(index, args.candidates, args.seed)
    results, ms = timed(oracle.cheapest, cands, "oracle")
    ms_arr = np.array(ms)
    by_days = {d: [m for q, m in zip(cands, ms) if q.days == d] for d in (3, 5, 7)}
    feasible = sum(r.feasible for r in results)

    # baseline on a small sample it can finish: 3/5-day trips and 7-day trips into states of <= 8 cities
    small = [q for q in cands if q.days < 7 or len(index.state_cities.get(q.dest, [])) <= 8][: args.naive]
    naive_costs, naive_ms = timed(lambda q: naive_cheapest(index, q), small, "naive")
    fresh = Oracle(index)  # no warm caches from the big run
    oracle_small, oracle_small_ms = timed(fresh.cheapest, small, "oracle (sample)")
    agree = sum(
        (r.cost if r.feasible else float("inf")) == c or (r.feasible and abs(r.cost - c) < 1e-6)
        for r, c in zip(oracle_small, naive_costs)
    )

    t0 = time.perf_counter()
    synth = QuerySynthesizer(Oracle(index), seed=args.seed, workers=2)
    queries, report = synth.generate(dict(zip(LEVELS, allocate(args.n, (4, 3, 3)))))
    e2e_s = time.perf_counter() - t0

    result = {
        "world": world.meta().get("flights"),
        "flight_legs": len(index.flights),
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
        "index_build_s": round(build_s, 2),
        "oracle": {
            "candidates": len(cands),
            "feasible": feasible,
            "seconds": round(float(ms_arr.sum() / 1000), 2),
            "queries_per_s": round(float(len(cands) / (ms_arr.sum() / 1000)), 1),
            "p50_ms": round(float(np.percentile(ms_arr, 50)), 3),
            "p99_ms": round(float(np.percentile(ms_arr, 99)), 3),
            "mean_ms_by_days": {d: round(float(np.mean(v)), 3) for d, v in by_days.items() if v},
        },
        "baseline": {
            "sample": len(small),
            "naive_mean_ms": round(float(np.mean(naive_ms)), 2),
            "naive_max_ms": round(float(np.max(naive_ms)), 2),
            "oracle_mean_ms": round(float(np.mean(oracle_small_ms)), 3),
            "speedup": round(float(np.mean(naive_ms)) / float(np.mean(oracle_small_ms)), 1),
            "same_cost": f"{agree}/{len(small)}",
        },
        "end_to_end": {
            "feasible_queries": len(queries),
            "workers": 2,
            "seconds": round(e2e_s, 2),
            "candidates_tried": sum(report.attempts.values()),
            "feasibility": round(report.feasibility(), 3),
            "candidates_per_s": round(sum(report.attempts.values()) / e2e_s, 1),
        },
        "target": "thousands of candidate queries in minutes on 2 cores",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    result["ok"] = bool(result["oracle"]["queries_per_s"] * 60 >= 1000)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "synth.json").write_text(json.dumps(result, indent=2) + "\n")
    o, b, e = result["oracle"], result["baseline"], result["end_to_end"]
    lines = [
        f"# Synthesis benchmark ({result['measured_at']}, {result['cpus']} CPUs, load {result['loadavg'][0]:.2f})",
        "",
        f"World: {result['world']}; {result['flight_legs']:,} flight legs. Index built once in {result['index_build_s']} s.",
        "",
        "| what | queries | seconds | queries/s | mean ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
        f"| oracle (1 process, all candidates) | {o['candidates']:,} | {o['seconds']} | {o['queries_per_s']:,} | "
        f"{o['seconds'] * 1000 / o['candidates']:.2f} | {o['p99_ms']} |",
        f"| naive enumeration (baseline, sample) | {b['sample']} | {b['naive_mean_ms'] * b['sample'] / 1000:.2f} | "
        f"{1000 / b['naive_mean_ms']:.1f} | {b['naive_mean_ms']} | max {b['naive_max_ms']} |",
        f"| oracle on the same sample | {b['sample']} | {b['oracle_mean_ms'] * b['sample'] / 1000:.3f} | "
        f"{1000 / b['oracle_mean_ms']:.1f} | {b['oracle_mean_ms']} | |",
        f"| synthesis end to end (2 workers) | {e['candidates_tried']:,} tried → {e['feasible_queries']:,} kept | "
        f"{e['seconds']} | {e['candidates_per_s']:,} | | |",
        "",
        f"Oracle vs naive on the sample: {b['speedup']}× faster, same least cost on {b['same_cost']}. "
        f"Mean oracle ms by trip length: {o['mean_ms_by_days']}. Feasible candidates: {o['feasible']:,} of "
        f"{o['candidates']:,}. Target (thousands of candidates in minutes on 2 cores): "
        f"{'OK' if result['ok'] else 'MISSED'}.",
    ]
    (out / "synth.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for d, v in by_days.items():
            if v:
                ax.hist(v, bins=np.logspace(-1, 3, 50), alpha=0.6, label=f"{d}-day")
        ax.set_xscale("log")
        ax.set_xlabel("oracle ms per candidate query")
        ax.set_ylabel("queries")
        ax.legend()
        ax.set_title("Oracle time per query (real tables)")
        fig.tight_layout()
        fig.savefig(out / "synth.png", dpi=120)
    except Exception as exc:  # noqa: BLE001 - the plot is optional
        print(f"(no plot: {exc})")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
