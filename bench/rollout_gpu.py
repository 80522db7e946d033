"""Rollout engines on one GPU: vLLM against the transformers engine, same agent-shaped load, same run.

    python bench/rollout_gpu.py --shapes smollm,1.5b          # on a GPU machine, vLLM installed
    python bench/rollout_gpu.py --shapes tiny --agents 4 --turns 2 --ctx-min 64 --ctx-max 128 \
        --short 8 --long 16 --tool-min 8 --tool-max 16 --name rollout_gpu_cpu_smoke   # CPU smoke

Load (closed loop, like the rollout workers): `--agents` agents at once, each from its own random
context of `--ctx-min`..`--ctx-max` tokens, taking `--turns` model turns; a turn is a tool call
(`--short` tokens) or, with probability `--long-share`, a plan (`--long` tokens), and between turns
the agent appends a tool response of `--tool-min`..`--tool-max` tokens. Weights are random (a seed),
so turns run to their max_tokens and both engines sample about the same number of tokens. Each
engine runs in a process of its own, one after the other, and has the GPU alone.

Per shape and engine: sampled tokens/s (prefill included in the wall time), turn latency p50/p99.
vLLM also: the reload time of its weights from a published folder (idle, and under the same load with
updates every `--update-every` seconds: the fleet is paused in place, not drained), and the
log-prob agreement of its sampled tokens with a bf16 forward of the same ids (the learner's view):
mean and max absolute difference and the mismatch KL (k3 estimate of KL(sampler ‖ learner)).

Results: bench/results/<name>.json (merged by shape, so shapes can be measured in separate calls),
.md and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

from bench.gpu_shapes import SHAPES, model_folder  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def workload(args) -> list[dict[str, Any]]:
    """Per agent: its context length, and per turn (max_tokens, tool tokens after it, seed)."""
    rng = random.Random(args.seed)
    plan = []
    for _ in range(args.agents):
        turns = [
            (
                args.long if rng.random() < args.long_share else args.short,
                rng.randint(args.tool_min, args.tool_max),
                rng.randrange(2**31),
            )
            for _ in range(args.turns)
        ]
        plan.append({"context": rng.randint(args.ctx_min, args.ctx_max), "turns": turns})
    return plan


def vllm_settings(items: list[str]) -> dict[str, Any]:
    """`--vllm-set KEY=VALUE` items as VllmArgs fields (a value is read as JSON where it parses)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--vllm-set {item!r}: give KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def max_model_len(args) -> int:
    return args.ctx_max + args.turns * (args.long + args.tool_max) + 64


def device_record(path: Path) -> dict[str, Any]:
    """The record at `path` to add this device's shapes to (a fresh one when it holds another device's),
    stamped with the device and the torch and vLLM versions."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    record = json.loads(path.read_text()) if path.is_file() else {}
    if record.get("device") not in (None, device):
        log(f"the recorded shapes were measured on {record['device']}; starting a fresh record on {device}")
        record = {}
    record.update(device=device, vllm_version=vllm_version, torch=torch.__version__)
    return record


async def run_agents(
    engine: Any,
    plan: list[dict[str, Any]],
    args,
    vocab: int,
    *,
    updates: Any = None,
    keep: int = 0,
    until: float | None = None,
    timeline: list | None = None,
    inflight: int | None = None,
) -> dict[str, Any]:
    """The closed-loop agent load on `engine` (anything with `generate(ids, TurnParams)`). `until`: a
    perf_counter time after which no agent starts another turn; `timeline` gets (end time, tokens) of
    every turn; `inflight`: at most this many episodes run at once, the others waiting for a slot as a
    rollout worker's do (None: all at once)."""
    from services.rollout.engines.base import TurnParams

    turns: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    slots = asyncio.Semaphore(inflight or len(plan) or 1)

    async def agent(i: int, spec: dict[str, Any]) -> int:
        async with slots:
            return await episode(i, spec)

    async def episode(i: int, spec: dict[str, Any]) -> int:
        rng = random.Random(1000 + i)
        context = [rng.randrange(3, vocab) for _ in range(spec["context"])]
        sampled = 0
        for k, (max_tokens, tool, seed) in enumerate(spec["turns"]):
            if until is not None and time.perf_counter() >= until:
                break
            t0 = time.perf_counter()
            gen = await engine.generate(
                context, TurnParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=seed)
            )
            turns.append(
                {
                    "kind": "long" if max_tokens == args.long else "short",
                    "s": time.perf_counter() - t0,
                    "tokens": len(gen.token_ids),
                    "mid_update": gen.stats.get("updated_mid_turn", 0.0),
                }
            )
            if timeline is not None:
                timeline.append((time.perf_counter(), len(gen.token_ids)))
            if k == 0 and i < keep and gen.logprobs is not None:
                samples.append({"prompt": list(context), "ids": list(gen.token_ids), "logprobs": list(gen.logprobs)})
            sampled += len(gen.token_ids)
            context = context + gen.token_ids + [rng.randrange(3, vocab) for _ in range(tool)]
        return sampled

    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(agent(i, spec)) for i, spec in enumerate(plan)]
    reloads: list[float] = []
    if updates is not None:
        reloads = await updates(tasks)
    counts = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0

    def pct(q: float, kind: str | None = None) -> float | None:
        xs = sorted(t["s"] for t in turns if kind is None or t["kind"] == kind)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    return {
        "wall_s": wall,
        "tokens": sum(counts),
        "tokens_per_s": sum(counts) / wall,
        "turns": len(turns),
        "turn_p50_s": pct(0.5),
        "turn_p99_s": pct(0.99),
        "short_p50_s": pct(0.5, "short"),
        "short_p99_s": pct(0.99, "short"),
        "long_p50_s": pct(0.5, "long"),
        "long_p99_s": pct(0.99, "long"),
        "turns_updated_mid_turn": sum(1 for t in turns if t["mid_update"]),
        "reloads_s": reloads,
        "inflight": min(inflight or len(plan), len(plan)),
        "samples": samples,
    }


def periodic_updates(engine: Any, folder: Path, every: float) -> Any:
    """For `run_agents(updates=...)`: reload `folder` into `engine` as its next version every `every`
    seconds until the agents' tasks are done; returns each reload's seconds."""

    async def updates(tasks: list[asyncio.Future]) -> list[float]:
        times = []
        while True:
            _, running = await asyncio.wait(tasks, timeout=every)  # the load may end before the next reload
            if not running:
                break
            t = time.perf_counter()
            await engine.update_weights(folder, engine.policy_version + 1)
            times.append(time.perf_counter() - t)
        return times

    return updates


def child(args) -> None:
    """One engine, one shape: the measurement, written to --result as JSON."""
    import torch
    from transformers import AutoTokenizer

    folder = Path(args.folder)
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = SHAPES[args.shape]["vocab_size"]
    on_gpu = torch.cuda.is_available()
    plan = workload(args)
    out: dict[str, Any] = {"engine": args.child}
    t0 = time.perf_counter()
    if args.child == "vllm":
        from services.common.schemas import VllmArgs
        from services.rollout.engines.vllm_engine import VllmEngine

        vargs = VllmArgs.model_validate(
            {
                "compile": args.vllm_compile,
                "gpu_memory_utilization": args.gpu_memory,
                "max_num_seqs": max(args.agents, 8),
                **vllm_settings(args.vllm_set),
            }
        )
        engine = VllmEngine(
            folder,
            max_model_len=max_model_len(args),
            dtype="bfloat16" if on_gpu else "float32",
            args=vargs,
            tokenizer=tok,
            kv_cache_gib=4,
        )
        out["vllm_args"] = vargs.model_dump()
    else:
        from services.rollout.engines.hf import TransformersEngine

        engine = TransformersEngine(
            folder,
            max_model_len=max_model_len(args),
            max_batch=args.agents,
            dtype="bfloat16" if on_gpu else "float32",
            tokenizer=tok,
        )
    out["start_s"] = time.perf_counter() - t0
    log(f"{args.child}: started in {out['start_s']:.1f} s")

    async def measure() -> None:
        await run_agents(engine, [dict(p, turns=p["turns"][:1]) for p in plan[:4]], args, vocab)  # warm-up
        res = await run_agents(engine, plan, args, vocab, keep=args.keep_samples if args.child == "vllm" else 0)
        out.update(res)
        log(
            f"{args.child}: {res['tokens_per_s']:.0f} tokens/s, turn p50 {res['turn_p50_s']:.2f} s, "
            f"p99 {res['turn_p99_s']:.2f} s"
        )
        if args.child != "vllm":
            return
        idle = []
        for v in range(1, 4):
            timing = await engine.update_weights(folder, v)
            idle.append(timing["drain_s"] + timing["load_s"])
        out["reload_s"] = statistics.median(idle)
        out["reload_idle_s"] = idle
        log(f"vllm: reload from the folder {out['reload_s']:.2f} s (idle)")

        modes = [m for m in args.inflight_modes.split(",") if m]
        for mode in modes:
            engine.args = engine.args.model_copy(update={"inflight_update": mode})
            busy = await run_agents(
                engine, plan, args, vocab, updates=periodic_updates(engine, folder, args.update_every)
            )
            busy.pop("samples")
            out.setdefault("under_updates_by_mode", {})[mode] = busy
            log(
                f"vllm under updates ({mode}): {busy['tokens_per_s']:.0f} tokens/s, {len(busy['reloads_s'])} reloads "
                f"(median {statistics.median(busy['reloads_s']) if busy['reloads_s'] else float('nan'):.2f} s), "
                f"{busy['turns_updated_mid_turn']} turns updated mid-turn"
            )
        if modes:
            out["under_updates"] = out["under_updates_by_mode"][modes[0]]

    try:
        asyncio.run(measure())
    finally:
        Path(args.result).write_text(json.dumps(out))
        if args.child == "vllm":
            asyncio.run(engine.close())


def logprob_agreement(folder: Path, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The sampler's log-probs of its own tokens against a bf16 forward of the same ids."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    diffs: list[float] = []
    k3: list[float] = []
    for s in samples:
        ids = torch.tensor([s["prompt"] + s["ids"]], device=device)
        with torch.no_grad():
            logits = model(ids).logits[0, len(s["prompt"]) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s["ids"], device=device)[:, None])[:, 0]
        sampler = torch.tensor(s["logprobs"], device=device)
        r = (lp - sampler).double()
        diffs += r.abs().tolist()
        k3 += (torch.exp(r) - 1 - r).tolist()
    del model
    return {
        "tokens": len(diffs),
        "sequences": len(samples),
        "mean_abs_diff": statistics.fmean(diffs) if diffs else None,
        "max_abs_diff": max(diffs) if diffs else None,
        "mismatch_kl_k3": statistics.fmean(k3) if k3 else None,
        "learner_dtype": str(dtype).removeprefix("torch."),
    }


def measure_shape(shape: str, args) -> dict[str, Any]:
    import torch

    work = Path(args.work)
    folder = model_folder(work / shape, shape)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    params = _params(cfg)
    entry: dict[str, Any] = {"params": params, "config": SHAPES[shape], "engines": {}}
    for engine in args.engines.split(","):
        result = work / f"{shape}-{engine}.json"
        result.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            __file__,
            "--child",
            engine,
            "--shape",
            shape,
            "--folder",
            str(folder),
            "--result",
            str(result),
            *sys.argv[1:],
        ]
        log(f"{shape}: {engine} …")
        try:
            rc = subprocess.run(cmd, timeout=args.child_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        data = json.loads(result.read_text()) if result.is_file() else {}
        data["rc"] = rc
        samples = data.pop("samples", [])
        if samples:
            entry["logprob_agreement"] = logprob_agreement(folder, samples)
            log(f"{shape}: log-prob agreement {entry['logprob_agreement']}")
        entry["engines"][engine] = data
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    e = entry["engines"]
    if e.get("vllm", {}).get("tokens_per_s") and e.get("transformers", {}).get("tokens_per_s"):
        entry["vllm_over_transformers"] = e["vllm"]["tokens_per_s"] / e["transformers"]["tokens_per_s"]
    return entry


def _params(cfg: Any) -> int:
    h, L, i, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i + 2 * h + h + 2 * kv  # q,o + k,v + mlp + norms + biases
    return L * per_layer + v * h * (1 if cfg.tie_word_embeddings else 2) + h


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm,1.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--engines", default="vllm,transformers")
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--ctx-min", type=int, default=3000)
    p.add_argument("--ctx-max", type=int, default=6000)
    p.add_argument("--short", type=int, default=80, help="tokens of a tool-call turn")
    p.add_argument("--long", type=int, default=400, help="tokens of a plan turn")
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--tool-min", type=int, default=100)
    p.add_argument("--tool-max", type=int, default=300)
    p.add_argument("--vllm-compile", action="store_true", help="torch.compile vLLM's model (minutes of start-up)")
    p.add_argument("--gpu-memory", type=float, default=0.6, help="vLLM's gpu_memory_utilization")
    p.add_argument(
        "--vllm-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a VllmArgs field for the vLLM engine, e.g. max_num_batched_tokens=2048 (repeatable)",
    )
    p.add_argument("--update-every", type=float, default=10.0, help="seconds between weight loads under load")
    p.add_argument(
        "--inflight-modes", default="recompute,keep", help="vLLM inflight_update modes measured under load ('': none)"
    )
    p.add_argument("--keep-samples", type=int, default=8, help="first turns kept for the log-prob check")
    p.add_argument("--child-timeout", type=float, default=420)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "rollout-gpu"))
    p.add_argument("--name", default="rollout_gpu")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.child and args.vllm_set:
        from pydantic import ValidationError

        from services.common.schemas import VllmArgs

        try:  # a bad field is refused here, before any engine starts
            VllmArgs.model_validate(vllm_settings(args.vllm_set))
        except ValidationError as exc:
            p.error(f"--vllm-set: {exc}")
    if args.child:
        child(args)
        return
    path = RESULTS / f"{args.name}.json"
    record = device_record(path)
    record.update(
        {
            "load": {
                k: getattr(args, k)
                for k in (
                    "agents",
                    "turns",
                    "ctx_min",
                    "ctx_max",
                    "short",
                    "long",
                    "long_share",
                    "tool_min",
                    "tool_max",
                    "vllm_compile",
                    "gpu_memory",
                    "vllm_set",
                    "update_every",
                    "inflight_modes",
                )
            }
        }
    )
    record.setdefault("shapes", {})
    for shape in args.shapes.split(","):
        record["shapes"][shape] = measure_shape(shape, args)
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
    write_markdown(record, RESULTS / f"{args.name}.md")
    plot(record, RESULTS / f"{args.name}.png")
    log(f"wrote {path}")


def write_markdown(record: dict[str, Any], path: Path) -> None:
    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return "–" if x is None else fmt.format(x)

    lines = [
        f"# Rollout engines on one GPU ({record['device']}, vLLM {record['vllm_version']})",
        "",
        "Agent-shaped load (`bench/rollout_gpu.py`): " + ", ".join(f"{k} {v}" for k, v in record["load"].items()),
        "",
        "| shape | params | engine | start s | tokens/s | turn p50 s | turn p99 s | reload s (idle) | "
        "tokens/s under updates | reloads under load, median s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, entry in record["shapes"].items():
        for name, e in entry["engines"].items():
            modes = e.get("under_updates_by_mode") or {"": e.get("under_updates") or {}}
            for mode, busy in modes.items():
                reloads = busy.get("reloads_s") or []
                label = (
                    name + (f" ({e['decode']})" if e.get("decode") else "") + (f", in flight: {mode}" if mode else "")
                )
                lines.append(
                    f"| {shape} | {entry['params'] / 1e6:.0f} M | {label} "
                    f"| {f(e.get('start_s'), '{:.1f}')} | {f(e.get('tokens_per_s'), '{:,.0f}')} | {f(e.get('turn_p50_s'))} "
                    f"| {f(e.get('turn_p99_s'))} | {f(e.get('reload_s'))} | {f(busy.get('tokens_per_s'), '{:,.0f}')} "
                    f"| {f(statistics.median(reloads) if reloads else None)} |"
                )
    notes = [f"- {shape}: {entry['note']}" for shape, entry in record["shapes"].items() if entry.get("note")]
    lines += ["", *notes] if notes else []
    lines += [
        "",
        "| shape | vLLM / transformers tokens/s | log-prob tokens | mean abs diff | max abs diff | mismatch KL (k3) |",
        "|---|---|---|---|---|---|",
    ]
    for shape, entry in record["shapes"].items():
        a = entry.get("logprob_agreement") or {}
        lines.append(
            f"| {shape} | {f(entry.get('vllm_over_transformers'))}× | {a.get('tokens', '–')} | "
            f"{f(a.get('mean_abs_diff'), '{:.4f}')} | {f(a.get('max_abs_diff'), '{:.3f}')} | "
            f"{f(a.get('mismatch_kl_k3'), '{:.2e}')} |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(record["shapes"])
    engines = sorted({e for s in shapes for e in record["shapes"][s]["engines"]})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(len(engines), 1)
    for k, engine in enumerate(engines):
        ys = [record["shapes"][s]["engines"].get(engine, {}).get("tokens_per_s") or 0 for s in shapes]
        ax.bar([i + k * width for i in range(len(shapes))], ys, width, label=engine)
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(shapes))], shapes)
    ax.set_ylabel("sampled tokens/s")
    ax.set_title(f"Agent load on {record['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
