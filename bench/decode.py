"""Decode benchmark: the transformers engine with continuous batching against static batching,
under an agent-shaped load, in the same run on the same model.

    python bench/decode.py                                   # GPU: SmolLM2-135M shape, bf16, 16 agents
    python bench/decode.py --size tiny --agents 4 --turns 2 --prompt 64 --short 8 --long 32 --name decode_cpu_smoke

Workload (closed loop, like rollout workers): `--agents` agents run at once; each starts from a
`--prompt`-token context and takes `--turns` model turns. A turn is a short tool call (`--short`
tokens) or, with probability `--long-share`, a long plan (`--long` tokens); between turns the agent
appends `--tool-tokens` of tool response, so the context grows as a real trajectory's does. The
policy is random (weights from a seed, the Qwen2.5 vocabulary), so turns run to their `max_tokens`
and both modes decode the same number of tokens; both use the same seeds.

`--step-probe` instead times single decode steps (no agents): for each batch size in
`--probe-batches`, prefill that many `--prompt`-token rows, then time `--probe-steps` decode steps
(ms/step, tokens/s), and profile the largest batch's steps (host vs device time per op). This is
the number that bounds an episode's speed: a turn of n tokens costs about n steps. The baseline,
timed in the same run at the same rows and context with the engine's sampler: the model's own
forward over HF's DynamicCache (what the engine decoded with before its slot pool; the cache grows by
concatenation, so every step copies it).

Modes: `static` admits new requests only when the running batch is empty (a batch runs until its
last row ends: the engine's behaviour before continuous batching); `continuous` admits them between
decode steps. Reported: sampled tokens/s, wall time, and turn latency (p50/p99) for short and long
turns. Results: bench/results/<name>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

SIZES = {  # head_dim 64 throughout
    "smollm": dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536),  # SmolLM2-135M's shape
    "tiny": dict(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def workload(args) -> list[list[tuple[int, int]]]:
    """Per agent, per turn: (max_tokens, seed). Same for both modes."""
    rng = random.Random(args.seed)
    return [
        [(args.long if rng.random() < args.long_share else args.short, rng.randrange(2**31)) for _ in range(args.turns)]
        for _ in range(args.agents)
    ]


async def run_agents(engine: Any, plan: list[list[tuple[int, int]]], args) -> dict[str, Any]:
    from services.rollout.engines.base import TurnParams

    turns: list[dict[str, float]] = []

    async def agent(i: int, steps: list[tuple[int, int]]) -> int:
        rng = random.Random(1000 + i)
        vocab = engine.model.config.vocab_size
        context = [rng.randrange(1000, vocab) for _ in range(args.prompt)]
        sampled = 0
        for max_tokens, seed in steps:
            t0 = time.perf_counter()
            gen = await engine.generate(
                context, TurnParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed)
            )
            turns.append(
                {
                    "kind": "long" if max_tokens == args.long else "short",
                    "s": time.perf_counter() - t0,
                    "tokens": len(gen.token_ids),
                }
            )
            sampled += len(gen.token_ids)
            context = context + gen.token_ids + [rng.randrange(1000, vocab) for _ in range(args.tool_tokens)]
        return sampled

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(agent(i, steps) for i, steps in enumerate(plan)))
    wall = time.perf_counter() - t0

    def pct(kind: str, q: float) -> float | None:
        xs = sorted(t["s"] for t in turns if t["kind"] == kind)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    return {
        "wall_s": wall,
        "tokens": sum(counts),
        "tokens_per_s": sum(counts) / wall,
        "short_p50_s": pct("short", 0.5),
        "short_p99_s": pct("short", 0.99),
        "long_p50_s": pct("long", 0.5),
        "long_p99_s": pct("long", 0.99),
        "turns": len(turns),
        "admitted_groups": None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="smollm")
    p.add_argument("--model", default=None, help="an HF model folder to decode with instead of a random --size model")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--prompt", type=int, default=1500)
    p.add_argument("--tool-tokens", type=int, default=150)
    p.add_argument("--short", type=int, default=60)
    p.add_argument("--long", type=int, default=450)
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating static/continuous")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="decode")
    p.add_argument("--step-probe", action="store_true", help="time single decode steps per batch size instead")
    p.add_argument("--probe-batches", default="1,8,32,64")
    p.add_argument("--probe-steps", type=int, default=32)
    args = p.parse_args()

    import torch

    from services.models import tiny_qwen2
    from services.rollout.engines.hf import TransformersEngine

    on_gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_gpu else f"CPU ({platform.machine()})"
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    folder = (
        Path(args.model)
        if args.model
        else tiny_qwen2(
            Path(tempfile.mkdtemp(prefix="decode-bench-")) / "model", **SIZES[args.size], max_positions=32768
        )
    )
    # the step probe holds its largest batch at once: one slot per row
    max_batch = max([args.max_batch] + ([int(b) for b in args.probe_batches.split(",")] if args.step_probe else []))
    max_model_len = probe_context(args) if args.step_probe else 32768
    engine = TransformersEngine(folder, max_model_len=max_model_len, max_batch=max_batch, dtype=dtype)
    params_m = sum(p.numel() for p in engine.model.parameters()) / 1e6
    args.size = folder.name if args.model else args.size  # what the reports name
    log(f"device {device}; model {args.size} ({params_m:.0f} M params, {dtype})")
    if args.step_probe:
        step_probe(engine, args, device, dtype, params_m)
        return
    plan = workload(args)

    async def run_all() -> dict[str, list[dict[str, Any]]]:
        # warm-up: kernels, allocator
        engine.continuous = True
        await run_agents(engine, [steps[:1] for steps in plan[:2]], args)
        runs: dict[str, list[dict[str, Any]]] = {"static": [], "continuous": []}
        for r in range(args.repeats):
            for mode in ("static", "continuous") if r % 2 == 0 else ("continuous", "static"):
                engine.continuous = mode == "continuous"
                before = len(engine.batches)
                res = await run_agents(engine, plan, args)
                res["admitted_groups"] = len(engine.batches) - before
                runs[mode].append(res)
                log(
                    f"{mode}: {res['tokens_per_s']:.0f} tokens/s, wall {res['wall_s']:.1f} s, short turn p50 "
                    f"{res['short_p50_s']:.2f} s, long turn p50 {res['long_p50_s'] or float('nan'):.2f} s"
                )
        return runs

    runs = asyncio.run(run_all())

    def med(mode: str, key: str) -> float | None:
        xs = [r[key] for r in runs[mode] if r[key] is not None]
        return statistics.median(xs) if xs else None

    summary = {mode: {k: med(mode, k) for k in runs[mode][0] if k != "turns"} for mode in runs}
    speedup = summary["continuous"]["tokens_per_s"] / summary["static"]["tokens_per_s"]
    record = {
        "device": device,
        "torch": torch.__version__,
        "args": vars(args),
        "params_m": params_m,
        "dtype": dtype,
        "runs": runs,
        "median": summary,
        "speedup_tokens_per_s": speedup,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    write_markdown(record, args)
    plot(record, RESULTS / f"{args.name}.png")
    log(f"continuous / static tokens/s: {speedup:.2f}×")


def probe_context(args) -> int:
    """Context the step probe's rows reach: the prompt plus every decode step it runs on them (the
    admission tick, a warm-up and the timed ticks, the profile), with a margin. The probe's rows ask
    for unlimited tokens, so the engine sizes its slot pool to this rather than to its whole context
    (at 32,768 a 128-row probe would want ~96 GiB of KV cache)."""
    from services.rollout.engines.hf import STEPS_PER_TICK

    ticks = max(1, args.probe_steps // STEPS_PER_TICK)
    steps = STEPS_PER_TICK * (1 + (1 + ticks) + 2)
    return args.prompt + steps + 256


def step_probe(engine: Any, args, device: str, dtype: str, params_m: float) -> None:
    """ms per decode step at each batch size, and where the largest batch's step time goes.

    Steps run through the engine's own tick (what the scheduler calls), so the probe measures the
    serving path with its attention-kernel choice, not a bare model call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from services.rollout.engines.base import TurnParams
    from services.rollout.engines.hf import STEPS_PER_TICK, _Batch, _Request

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    table = ""
    sizes = [int(b) for b in args.probe_batches.split(",")]
    ticks = max(1, args.probe_steps // STEPS_PER_TICK)
    for n in sizes:
        batch = _Batch()
        joining = [
            _Request(
                [rng.randrange(1000, engine.model.config.vocab_size) for _ in range(args.prompt)],
                TurnParams(max_tokens=10**6, temperature=1.0, top_p=0.95, seed=i),
                None,
            )
            for i in range(n)
        ]
        sync()
        t0 = time.perf_counter()
        engine._tick(batch, joining)  # prefill, then the tick's decode steps
        sync()
        prefill = time.perf_counter() - t0
        step = tick_step_s(engine, batch, ticks, sync)
        if n == sizes[-1]:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                for _ in range(2):
                    engine._tick(batch, [])
                sync()
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=25)
        engine._reset()
        del batch
        base = dynamic_cache_step_s(engine, n, args.prompt, args.probe_steps, sync)
        rows.append(
            {
                "batch": n,
                "prefill_s": prefill,
                "step_ms": 1000 * step,
                "tokens_per_s": n / step,
                "dynamic_cache_step_ms": 1000 * base,
                "speedup": base / step,
            }
        )
        log(
            f"batch {n}: admission tick {prefill:.3f} s, {1000 * step:.1f} ms/step, {n / step:,.0f} tokens/s; "
            f"DynamicCache forward {1000 * base:.1f} ms/step ({base / step:.2f}×)"
        )
    print(table, flush=True)
    record = {
        "device": device,
        "dtype": dtype,
        "params_m": params_m,
        "args": vars(args),
        "steps": rows,
        "profile": table,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    lines = [
        f"# Decode step probe ({args.name})",
        "",
        f"Device: {device}. Model: {'`' + args.model + '`' if args.model else 'random Qwen2'}, `{args.size}` shape ({params_m:.0f} M parameters), {dtype}; "
        f"{args.prompt}-token context per row; mean of {ticks * STEPS_PER_TICK} steps after one warm-up "
        f"tick; the admission tick is the prefill plus {STEPS_PER_TICK} decode steps.",
        "",
        "| rows | admission tick s | ms / decode step | tokens/s | DynamicCache forward ms / step | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} | {r['prefill_s']:.3f} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
        f"{r['dynamic_cache_step_ms']:.1f} | {r['speedup']:.2f}× |"
        for r in rows
    ]
    lines += ["", f"Profile of {2 * STEPS_PER_TICK} steps at {sizes[-1]} rows:", "", "```", table, "```", ""]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines))


def tick_step_s(engine: Any, batch: Any, ticks: int, sync: Any) -> float:
    """Seconds per decode step over `ticks` ticks of the engine, after one warm-up tick."""
    from services.rollout.engines.hf import STEPS_PER_TICK

    engine._tick(batch, [])
    sync()
    t0 = time.perf_counter()
    for _ in range(ticks):
        engine._tick(batch, [])
    sync()
    return (time.perf_counter() - t0) / (ticks * STEPS_PER_TICK)


def dynamic_cache_step_s(engine: Any, rows: int, context: int, steps: int, sync: Any) -> float:
    """Seconds per decode step of the model's own forward over a DynamicCache, `rows` rows of
    `context` tokens, sampling as the engine does (its own sampler, temperature 1.0, top-p 0.95):
    the baseline the slot pool replaced."""
    import torch

    from services.rollout.engines.base import TurnParams
    from services.rollout.engines.hf import _Request, _Row, attention_backends

    model, device = engine.model, engine.device
    samplers = [
        _Row(
            _Request([], TurnParams(max_tokens=10**6, temperature=1.0, top_p=0.95, seed=i), None),
            torch.Generator(device=device).manual_seed(i),
            10**6,
        )
        for i in range(rows)
    ]
    with torch.inference_mode(), attention_backends():
        ids = torch.randint(1000, model.config.vocab_size, (rows, context), device=device)
        mask = torch.ones_like(ids)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, engine._sample(samplers, out.logits[:, -1])

        def step() -> None:
            nonlocal mask, cache, token
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], 1)
            out = model(
                input_ids=token[:, None], attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1
            )
            cache, token = out.past_key_values, engine._sample(samplers, out.logits[:, -1])

        step()  # warm-up
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        elapsed = (time.perf_counter() - t0) / steps
    del cache, out
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return elapsed


def write_markdown(record: dict[str, Any], args) -> None:
    m = record["median"]

    def f(x: float | None, fmt: str = "{:.2f}") -> str:
        return fmt.format(x) if x is not None else "–"

    lines = [
        f"# Decode benchmark ({args.name})",
        "",
        f"Device: {record['device']}; torch {record['torch']}. Model: random Qwen2, `{args.size}` shape "
        f"({record['params_m']:.0f} M parameters, Qwen2.5 vocabulary), {record['dtype']}; the transformers engine, "
        f"at most {args.max_batch} rows decoding at once.",
        f"Load: {args.agents} agents at once, {args.turns} turns each, {args.prompt}-token start context, "
        f"{args.tool_tokens} tool tokens appended per turn; turns of {args.short} tokens, or {args.long} with "
        f"probability {args.long_share}; temperature 1.0, top-p 0.95, same seeds in both modes. "
        f"Median of {args.repeats} runs per mode, alternating.",
        "",
        "| mode | tokens/s | wall s | short turn p50 s | short p99 s | long turn p50 s | long p99 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in ("static", "continuous"):
        r = m[mode]
        lines.append(
            f"| {mode} | {r['tokens_per_s']:,.0f} | {f(r['wall_s'], '{:.1f}')} | {f(r['short_p50_s'])} | "
            f"{f(r['short_p99_s'])} | {f(r['long_p50_s'])} | {f(r['long_p99_s'])} |"
        )
    lines += ["", f"Continuous batching: **{record['speedup_tokens_per_s']:.2f}×** the static batch's tokens/s.", ""]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines))


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = record["median"]
    modes = ["static", "continuous"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(modes, [m[x]["tokens_per_s"] for x in modes], color=["#999999", "#2b7bba"])
    a.set_ylabel("sampled tokens/s")
    a.set_title(f"throughput ({record['speedup_tokens_per_s']:.2f}×)")
    width = 0.35
    xs = range(2)
    for k, (mode, color) in enumerate(zip(modes, ["#999999", "#2b7bba"])):
        vals = [m[mode]["short_p50_s"] or 0, m[mode]["long_p50_s"] or 0]
        b.bar([x + k * width for x in xs], vals, width, label=mode, color=color)
    b.set_xticks([x + width / 2 for x in xs], ["short turn p50", "long turn p50"])
    b.set_ylabel("seconds")
    b.set_title("turn latency")
    b.legend()
    fig.suptitle(f"transformers engine decode, {record['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
