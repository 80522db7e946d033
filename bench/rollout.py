"""Rollout benchmark: trajectories/min and sampled tokens/s on CPU for the vLLM and transformers
engines, and the agent loop's overhead against raw engine generation of the same turns.

    .venv/bin/python bench/rollout.py [--quick] [--engines vllm,transformers] [-G 4] [--queries 2]

Workload: the first `--queries` TravelPlanner train queries (the agent's real system prompt,
~1.5K tokens, plus the query), G samples each, all groups in flight at once, per-turn cap
`--max-tokens`, context 4,096, tools in-process over the real world. The policy is the tiny
random Qwen2 (Qwen2.5 vocabulary, head_dim 64), so turns are noise: every trajectory ends in a
format error after three turns and no tool is called. That isolates what the loop adds around
generation: decoding, turn parsing, segment tokenization and bookkeeping.

Baseline, measured in the same run on the same engine: every generate call the agent made is
recorded (prompt ids, seed, max tokens) and replayed with no agent around it, chains in the same
concurrency (one chain per trajectory, its turns in order). Seeds make the replay sample the same
tokens. Overhead = median agent wall time / median raw wall time − 1 (target ≤ 15%); the two
sides alternate in order, since other work on a shared 2-core machine moves both.

Results: bench/results/rollout.json, .md and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

from services.common.schemas import SamplingParams, TravelQuery  # noqa: E402
from services.common.settings import get_settings  # noqa: E402


class Recorder:
    """An engine proxy that records every generate call, keyed by trajectory."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: dict[str, list[tuple[list[int], Any]]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, prompt_ids, params, request_id=""):
        self.calls.setdefault(request_id, []).append((list(prompt_ids), params))
        return await self.engine.generate(prompt_ids, params, request_id=request_id)


def load_queries(n: int) -> list[TravelQuery]:
    path = get_settings().travelplanner_dir / "train" / "train.json"
    if path.is_file():
        rows = json.loads(path.read_text())
        rows = rows if isinstance(rows, list) else list(rows.values())
        return [TravelQuery.model_validate(r) for r in rows[:n]]
    return [
        TravelQuery(
            org="Sarasota",
            dest="Chicago",
            days=3,
            visiting_city_number=1,
            people_number=1,
            budget=1900,
            date=["2022-03-22", "2022-03-23", "2022-03-24"],
            query=f"Plan trip number {i}.",
        )
        for i in range(n)
    ]


def make_tools(db_url: str | None):
    from services.rollout.tools import LocalToolClient
    from services.sandbox.tools.toolbox import ToolBox
    from services.sandbox.world import World

    world = World(db_url or get_settings().world_url)
    problem = world.problem()
    if problem:
        raise SystemExit(f"{problem}\n(build one with `star world build`, or pass --db)")
    return LocalToolClient(ToolBox(world, cache_size=0))


async def measure(
    engine: Any, tools: Any, queries: list[TravelQuery], group: int, max_tokens: int, repeats: int
) -> dict[str, Any]:
    from services.rollout.agent import Agent
    from services.rollout.group import GroupMeta, sample_group

    rec = Recorder(engine)
    agent = Agent(rec, tools)
    sampling = SamplingParams(seed=1, temperature=1.0, max_tokens_per_turn=max_tokens, max_context_tokens=4096)

    async def agent_run() -> tuple[float, list]:
        rec.calls.clear()
        t0 = time.perf_counter()
        groups = await asyncio.gather(
            *(sample_group(agent, q, group, sampling, meta=GroupMeta(prompt_id=str(i))) for i, q in enumerate(queries))
        )
        return time.perf_counter() - t0, [t for g in groups for t in g]

    async def raw_run(chains: list[list[tuple[list[int], Any]]]) -> tuple[float, int]:
        async def chain(calls):
            n = 0
            for prompt, params in calls:
                n += len((await engine.generate(prompt, params)).token_ids)
            return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(chain(c) for c in chains))
        return time.perf_counter() - t0, sum(counts)

    await agent_run()  # warm-up (first batches, caches)
    agent_times, raw_times = [], []
    trajectories: list = []
    raw_tokens = 0
    chains = list(rec.calls.values())
    for i in range(repeats):
        # Alternate the order, so a load change on the shared machine hits both sides alike.
        if i % 2:
            elapsed, raw_tokens = await raw_run(chains)
            raw_times.append(elapsed)
        elapsed, trajectories = await agent_run()
        agent_times.append(elapsed)
        chains = list(rec.calls.values())
        if not i % 2:
            elapsed, raw_tokens = await raw_run(chains)
            raw_times.append(elapsed)
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    agent_s, raw_s = statistics.median(agent_times), statistics.median(raw_times)
    finish: dict[str, int] = {}
    for t in trajectories:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    return {
        "trajectories": len(trajectories),
        "turns": sum(len(c) for c in rec.calls.values()),
        "sampled_tokens": sampled,
        "raw_tokens": raw_tokens,
        "same_tokens": raw_tokens == sampled,
        "agent_s": agent_s,
        "raw_s": raw_s,
        "agent_runs_s": agent_times,
        "raw_runs_s": raw_times,
        "trajectories_per_min": len(trajectories) / agent_s * 60,
        "tokens_per_s": sampled / agent_s,
        "raw_tokens_per_s": raw_tokens / raw_s,
        "overhead": agent_s / raw_s - 1.0,
        "finish_reasons": finish,
    }


def run_engine(kind: str, model: Path, args) -> dict[str, Any]:
    from services.rollout.engines import build_engine

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on(coro, timeout=1800):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def build():
        options = {"max_model_len": 4096}
        if kind == "vllm":
            options.update(dtype="bfloat16", kv_cache_gib=1)
        return build_engine(kind, model, **options)

    t0 = time.perf_counter()
    engine = on(build())
    startup = time.perf_counter() - t0
    try:
        result = on(
            measure(engine, make_tools(args.db), load_queries(args.queries), args.group, args.max_tokens, args.repeats)
        )
    finally:
        on(engine.close())
        loop.call_soon_threadsafe(loop.stop)
    result["startup_s"] = startup
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(result["engines"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    x = range(len(engines))
    axes[0].bar([i - 0.2 for i in x], [result["engines"][e]["tokens_per_s"] for e in engines], 0.4, label="agent loop")
    axes[0].bar(
        [i + 0.2 for i in x], [result["engines"][e]["raw_tokens_per_s"] for e in engines], 0.4, label="raw engine"
    )
    axes[0].set_xticks(list(x), engines)
    axes[0].set_ylabel("sampled tokens / s")
    axes[0].legend()
    axes[1].bar(list(x), [100 * result["engines"][e]["overhead"] for e in engines], 0.5, color="tab:orange")
    axes[1].axhline(15, color="red", linestyle="--", label="target 15%")
    axes[1].set_xticks(list(x), engines)
    axes[1].set_ylabel("agent-loop overhead (%)")
    axes[1].legend()
    fig.suptitle("Rollout on CPU (tiny Qwen2, same turns replayed raw)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        "# Rollout benchmark",
        "",
        f"{r['machine']['cpus']} CPUs, load average before {r['machine']['load_before']}, "
        f"after {r['machine']['load_after']}; tiny random Qwen2 ({c['model']}); {c['queries']} queries × "
        f"G={c['group']}, ≤{c['max_tokens']} tokens per turn, median of {c['repeats']} runs "
        "(agent and raw replay alternating in order).",
        "",
        "| engine | start-up s | trajectories/min | tokens/s (agent) | tokens/s (raw) | agent s | raw s | overhead | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in r["engines"].items():
        lines.append(
            f"| {name} | {e['startup_s']:.1f} | {e['trajectories_per_min']:.1f} | {e['tokens_per_s']:.1f} | "
            f"{e['raw_tokens_per_s']:.1f} | {e['agent_s']:.2f} | {e['raw_s']:.2f} | "
            f"{100 * e['overhead']:+.1f}% | {e['same_tokens']} |"
        )
    lines += [
        "",
        "Overhead target: ≤ 15% (agent wall time over the raw replay of the same generate calls).",
        "Random weights: every trajectory is three format-error turns, no tool calls; the loop's own work "
        "(decode, parse, segment tokenization, bookkeeping) is what is measured.",
        "Per-run wall times (agent / raw), to judge the noise of a shared machine:",
    ]
    for name, e in r["engines"].items():
        lines.append(
            f"- {name}: " + ", ".join(f"{a:.1f}/{b:.1f} s" for a, b in zip(e["agent_runs_s"], e["raw_runs_s"]))
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:] == ["--report-only"]:  # re-render the .md from the recorded .json
        (RESULTS / "rollout.md").write_text(report(json.loads((RESULTS / "rollout.json").read_text())))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="vllm,transformers")
    parser.add_argument("-G", "--group", type=int, default=4)
    parser.add_argument("--queries", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--db", default=None, help="World database URL (default: STAR_DB_URL / var/world.sqlite).")
    parser.add_argument("--quick", action="store_true", help="G=2, 1 query, 24 tokens per turn, 1 repeat.")
    args = parser.parse_args()
    if args.quick:
        args.group, args.queries, args.max_tokens, args.repeats = 2, 1, 24, 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from services.models import tiny_qwen2

    model = tiny_qwen2()
    load_before = os.getloadavg()
    engines: dict[str, Any] = {}
    from tqdm import tqdm

    for kind in tqdm(args.engines.split(","), desc="engines"):
        engines[kind] = run_engine(kind.strip(), model, args)
        print(kind, json.dumps({k: v for k, v in engines[kind].items() if not k.endswith("runs_s")}, indent=1))
    result = {
        "config": {
            "group": args.group,
            "queries": args.queries,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "model": model.name,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
        },
        "engines": engines,
        "target_overhead": 0.15,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rollout.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "rollout.md").write_text(report(result))
    plot(result, RESULTS / "rollout.png")
    print(report(result))


if __name__ == "__main__":
    main()
