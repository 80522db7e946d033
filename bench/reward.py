"""Evaluator benchmark: in-process scoring time per plan, both modes, on the 45 train gold plans.

    .venv/bin/python bench/reward.py [--db URL] [--rounds N]

Cold = the first score of each plan (per-city caches empty); warm = later rounds. Target
(issue 3): ≤ 5 ms per plan in-process. Results: bench/results/reward.json and .md.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.schemas import TravelQuery  # noqa: E402
from services.common.settings import get_settings  # noqa: E402
from services.embedded import ensure_world  # noqa: E402
from services.reward import Evaluator  # noqa: E402
from services.sandbox.world import World  # noqa: E402


def gold_plans(travelplanner_dir: Path) -> tuple[list[TravelQuery], list[list[dict]]]:
    records = json.loads((travelplanner_dir / "train" / "train.json").read_text(encoding="utf-8"))
    return [TravelQuery(**r) for r in records], [ast.literal_eval(r["annotated_plan"])[1] for r in records]


def per_plan_ms(evaluator: Evaluator, queries, plans) -> list[float]:
    out = []
    for q, p in zip(queries, plans):
        t0 = time.perf_counter()
        evaluator.score(q, p)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="world URL (default: the STAR_HOME world, built if absent)")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    settings = get_settings()
    url = args.db or settings.world_url
    ensure_world(url)
    queries, plans = gold_plans(settings.travelplanner_dir)
    result: dict = {"plans": len(plans), "rounds": args.rounds, "loadavg": os.getloadavg(), "modes": {}}
    for mode in ("official", "strict"):
        ev = Evaluator(World(url), mode=mode)
        cold = per_plan_ms(ev, queries, plans)
        warm = [ms for _ in range(args.rounds) for ms in per_plan_ms(ev, queries, plans)]
        result["modes"][mode] = {
            "cold_mean_ms": round(float(np.mean(cold)), 3),
            "warm_p50_ms": round(float(np.percentile(warm, 50)), 3),
            "warm_p99_ms": round(float(np.percentile(warm, 99)), 3),
            "warm_plans_per_s": round(1000 / float(np.mean(warm)), 1),
            "target_ms": 5.0,
            "ok": float(np.percentile(warm, 99)) <= 5.0,
        }
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "reward.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Evaluator benchmark ({result['measured_at']}, load {result['loadavg'][0]:.2f})", "",
             "| mode | cold mean ms | warm p50 ms | warm p99 ms | plans/s | ≤ 5 ms |", "|---|---:|---:|---:|---:|---|"]
    for mode, m in result["modes"].items():
        lines.append(f"| {mode} | {m['cold_mean_ms']} | {m['warm_p50_ms']} | {m['warm_p99_ms']} | "
                     f"{m['warm_plans_per_s']:,} | {'OK' if m['ok'] else 'MISSED'} |")
    (out / "reward.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
