"""Step time under a long tail: real rollout workers, a scripted engine whose episodes mostly end fast
and now and then take `--tail-factor` times longer, with and without over-sampling and deadlines.

    .venv/bin/python bench/rollout_tail.py [--quick] [--steps 8] [--batch 8] [-G 4] [--budget 32]

Each scenario runs one `RolloutWorker` (the real claim loop, episode slots, settling and deadlines) on
real Redis (`--redis-url`, a fresh stream prefix per scenario) and a controller-and-learner stand-in
that trains on-policy (max_staleness 0): it publishes a step's tasks (batch_prompts, plus the
over-sampled surplus), takes the first `--batch` groups to complete as the learner's GroupCollector
does (groups of earlier steps are stale at max_staleness 0: dropped), waits `--train-s` for the
optimizer step, and publishes the next. An episode's duration is drawn from its seed: `--turn-s`
times a log-normal jitter, and `--tail-share` of the episodes take `--tail-factor` times longer (the
slow tool call, the rambling model). With a deadline (`--episode-timeout`), such an episode ends as
`deadline` and its group is trained partially (rl.late_groups: partial), as a step need not wait.
Prints each step's time and a summary; writes bench/results/rollout_tail.json. CPU only; no model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.schemas import RolloutTask, SamplingParams, TravelQuery  # noqa: E402
from services.common.streams import StreamNames, ensure_group  # noqa: E402
from services.rollout.engines.scripted import ScriptedEngine  # noqa: E402
from services.rollout.protocol import format_answer  # noqa: E402
from services.rollout.service import RolloutService  # noqa: E402
from services.rollout.worker import GROUP, RolloutWorker, SandboxCheck  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "rollout_tail.json"
QUERY = TravelQuery(
    org="Sarasota",
    dest="Chicago",
    days=3,
    visiting_city_number=1,
    date=["2022-03-22", "2022-03-23", "2022-03-24"],
    people_number=1,
    budget=1900,
    query="A 3-day trip from Sarasota to Chicago.",
)


class NoTools:
    """The sandbox of an engine that answers at once: never called, always reachable."""

    async def call(self, name: str, arguments: dict[str, Any], *, fault_key: str | None = None):
        raise RuntimeError("the tail benchmark's episodes call no tool")

    async def reachable(self) -> bool:
        return True

    async def close(self) -> None:
        return None


def episode_seconds(seed: int | None, args: argparse.Namespace) -> float:
    """An episode's duration, a function of its turn's seed: log-normal around `turn_s`, and one in
    1/tail_share times `tail_factor` longer."""
    rng = random.Random(seed)
    base = args.turn_s * math.exp(rng.gauss(0.0, 0.3))
    return base * args.tail_factor if rng.random() < args.tail_share else base


def scenario(
    name: str,
    args: argparse.Namespace,
    tokenizer: Any,
    client: redis.Redis,
    *,
    oversample: float,
    episode_timeout: float | None,
) -> dict[str, Any]:
    names = StreamNames(f"tail-{uuid.uuid4().hex[:8]}")
    ensure_group(client, names.tasks, GROUP)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = ScriptedEngine(
        tokenizer,
        lambda ids, turn: format_answer("Day 1:\nCurrent City: Chicago"),
        delay_s=lambda params, _r: episode_seconds(params.seed, args),
    )
    worker = RolloutWorker(
        RolloutService(engine, NoTools()),
        client,
        loop,
        names=names,
        consumer=name,
        max_inflight_episodes=args.budget,
        block_ms=20,
        sandbox=SandboxCheck(lambda: True),
    )
    threads = worker.start()
    extra = math.ceil(args.batch * oversample - 1e-9)
    sampling = SamplingParams(
        max_tokens_per_turn=64,
        max_context_tokens=4096,
        episode_timeout_s=episode_timeout,
        group_timeout_s=None,
        turn_timeout_s=None,
    )
    groups: dict[str, list[dict]] = {}
    cursor = "0-0"
    steps: list[dict[str, float]] = []
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=True)
            for slot in range(args.batch + extra):
                task = RolloutTask(
                    run_id=name,
                    task_id=f"{name}/s{step:03d}/p{slot:03d}",
                    prompt_id=f"p{slot}",
                    query=QUERY,
                    group_size=args.group_size,
                    step=step,
                    sampling=sampling.model_copy(update={"seed": (step * 1000 + slot) * 1000}),
                )
                pipe.xadd(names.tasks, {b"payload": task.model_dump_json().encode()})
            pipe.execute()
            taken: list[str] = []
            cut = 0
            while len(taken) < args.batch:
                for _, entries in client.xread({names.trajectories: cursor}, block=50) or []:
                    for entry, fields in entries:
                        cursor = entry.decode()
                        t = json.loads(fields[b"payload"])
                        groups.setdefault(t["task_id"], []).append(t)
                for task_id, members in list(groups.items()):
                    if len(members) < args.group_size or len(taken) >= args.batch:
                        continue
                    if members[0]["step"] == step:  # on-policy: an earlier step's surplus is stale
                        taken.append(task_id)
                        cut += sum(m["finish_reason"] == "deadline" for m in members)
                    groups.pop(task_id)
            waited = time.perf_counter() - t0
            time.sleep(args.train_s)
            steps.append({"step": step, "wait_s": waited, "step_s": time.perf_counter() - t0, "episodes_cut": cut})
            print(f"  {name:>22} step {step}: waited {waited:6.2f} s for {args.batch} groups", flush=True)
    finally:
        worker.stop.set()
        for t in threads:
            t.join(5)
        loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(loop)])
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        for stream in (names.tasks, names.trajectories, StreamNames.dead(names.tasks)):
            client.delete(stream)
    waits = [s["wait_s"] for s in steps]
    return {
        "scenario": name,
        "oversample": oversample,
        "episode_timeout_s": episode_timeout,
        "median_wait_s": statistics.median(waits),
        "mean_wait_s": statistics.fmean(waits),
        "mean_step_s": statistics.fmean(s["step_s"] for s in steps),
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 steps a scenario (a smoke run)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="groups a step trains (batch_prompts)")
    ap.add_argument("-G", "--group-size", type=int, default=4)
    ap.add_argument("--budget", type=int, default=48, help="the worker's max_inflight_episodes")
    ap.add_argument("--turn-s", type=float, default=0.1, help="a typical episode's duration")
    ap.add_argument("--tail-share", type=float, default=0.05)
    ap.add_argument("--tail-factor", type=float, default=20.0)
    ap.add_argument("--train-s", type=float, default=0.2, help="the learner's step, during which nothing publishes")
    ap.add_argument("--oversample", type=float, default=0.25)
    ap.add_argument("--episode-timeout", type=float, default=None, help="default: 4 × --turn-s")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 3
    timeout = args.episode_timeout or 4 * args.turn_s
    from services.models import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    client = redis.Redis.from_url(args.redis_url)
    client.ping()
    runs = []
    for name, oversample, deadline in (
        ("baseline", 0.0, None),
        ("oversample", args.oversample, None),
        ("deadline", 0.0, timeout),
        ("oversample+deadline", args.oversample, timeout),
    ):
        print(f"{name}: oversample {oversample:g}, episode deadline {deadline or 'none'}", flush=True)
        runs.append(scenario(name, args, tokenizer, client, oversample=oversample, episode_timeout=deadline))
    base = runs[0]["mean_wait_s"]
    print(f"\n{'scenario':>22} {'median wait s':>14} {'mean wait s':>12} {'mean step s':>12} {'vs baseline':>12}")
    for r in runs:
        print(
            f"{r['scenario']:>22} {r['median_wait_s']:14.2f} {r['mean_wait_s']:12.2f} {r['mean_step_s']:12.2f} "
            f"{r['mean_wait_s'] / base:11.2f}×"
        )
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": {**settings, "episode_timeout": timeout}, "runs": runs}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
