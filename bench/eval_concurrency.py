"""`star eval --model` with one episode at a time against several in flight, in the same run, on the
same model, queries and world.

    python bench/eval_concurrency.py                        # CPU: tiny random Qwen2, 16 train queries
    python bench/eval_concurrency.py --model DIR --queries 45 --concurrency 1,16

The runner calls the agent from `--concurrency` threads, and their episodes share the transformers
engine, which decodes their turns as one batch. A random policy writes no tool call, so each episode
is one turn of `--max-tokens` tokens ending in a format error: the figure is decode throughput under
the eval runner, not plan quality. Both settings score the same queries; their metrics must agree.
Results: bench/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"


def one_setting(
    model: Path, split: Path, world_url: str, out: Path, queries: int, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    from services.common.schemas import SamplingParams
    from services.evaluation.agents import rollout_agent
    from services.evaluation.formatting import StructuredParser
    from services.evaluation.runner import EvalRun, run_eval
    from services.reward.evaluator import Evaluator
    from services.sandbox.world import World

    sampling = SamplingParams(
        temperature=0.6, top_p=0.95, max_context_tokens=8192, max_tool_calls=4, max_tokens_per_turn=max_tokens, seed=0
    )
    agent, close = rollout_agent(
        str(model),
        sampling,
        engine="transformers",
        world_url=world_url,
        engine_options={"max_batch": concurrency, "max_model_len": 8192},
    )
    world = World(world_url)
    try:
        run = EvalRun(
            split_path=split,
            out=out,
            evaluator=Evaluator(world, "official"),
            formatter=StructuredParser(),
            source={"kind": "bench", "concurrency": concurrency},
            limit=queries,
            sampling=sampling,
            concurrency=concurrency,
        )
        t0 = time.perf_counter()
        result = run_eval(run, agent=agent, progress=True)
        wall = time.perf_counter() - t0
    finally:
        close()
        world.close()
    sampled = sum(
        len(json.loads(line)["trajectory"].get("token_ids") or [])
        for line in (out / "trajectories.jsonl").read_text().splitlines()
    )
    return {
        "concurrency": concurrency,
        "wall_s": wall,
        "queries_per_s": queries / wall,
        "trajectory_tokens": sampled,
        "metrics": result["metrics"],
        "finishes": result["trajectory"]["finish_reasons"],
    }


def report(r: dict[str, Any]) -> str:
    lines = [
        f"# `star eval --model`: episodes in flight ({r['device']})",
        "",
        f"Command: `{r['command']}`. Model: {r['model']}; {r['queries']} train queries; "
        f"{r['max_tokens']} tokens a turn.",
        "",
        "| concurrency | wall s | queries/s | speed-up | success % | finishes |",
        "|---|---|---|---|---|---|",
    ]
    base = r["runs"][0]["wall_s"]
    for run in r["runs"]:
        lines.append(
            f"| {run['concurrency']} | {run['wall_s']:.1f} | {run['queries_per_s']:.2f} | "
            f"{base / run['wall_s']:.2f}× | {run['metrics']['final_pass_rate']:.1f} | {run['finishes']} |"
        )
    lines += ["", f"Metrics equal across settings: {r['same_metrics']}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="HF folder (default: a tiny random Qwen2)")
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--concurrency", default="1,16", help="comma-separated; the first is the baseline")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--name", default="eval_concurrency")
    args = ap.parse_args()
    settings = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not settings or min(settings) < 1:
        ap.error("--concurrency takes positive integers, e.g. 1,16")

    import torch

    from services.common.settings import DEFAULT_TRAVELPLANNER_DIR
    from services.models import tiny_qwen2
    from services.sandbox.world.build import build_official_world

    data = DEFAULT_TRAVELPLANNER_DIR
    if not (data / "database").is_dir():
        ap.error(f"the TravelPlanner data is not at {data}")
    work = Path(tempfile.mkdtemp(prefix="eval-bench-"))
    world_url = f"sqlite:///{work / 'world.sqlite'}"
    print("building the official world …", flush=True)
    build_official_world(world_url, data / "database", seed=0, ref_info=[data / "train" / "train_ref_info.jsonl"])
    model = args.model or tiny_qwen2(work / "model", tokenizer="travel")
    runs = []
    for c in settings:
        print(f"── concurrency {c}", flush=True)
        runs.append(
            one_setting(
                model, data / "train" / "train.json", world_url, work / f"c{c}", args.queries, c, args.max_tokens
            )
        )
        print(f"   {runs[-1]['wall_s']:.1f} s, {runs[-1]['queries_per_s']:.2f} queries/s", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    result = {
        "device": device,
        "model": str(args.model or "tiny random Qwen2 (travel tokenizer)"),
        "queries": args.queries,
        "max_tokens": args.max_tokens,
        "command": "python bench/eval_concurrency.py " + " ".join(sys.argv[1:]),
        "runs": runs,
        "same_metrics": all(r["metrics"] == runs[0]["metrics"] for r in runs),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    text = report(result)
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
