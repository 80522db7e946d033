"""The paper's 1.5B recipe end to end on one GPU: `star train configs/qwen2.5-1.5b-arpo-macro.yaml` with the
teacher's episode shapes, deadlines and over-sampling on and off, and the engine's closed-loop ceiling for the
same episodes, all in one job.

    # one H200 (about 11 minutes): vLLM + DeepSpeed from bench/gpu_device.sh; the Qwen2.5 tokenizer carried as .qwen-tok
    python bench/recipe_1p5b.py --tokenizer .qwen-tok --budget-s 660
    python bench/recipe_1p5b.py --smoke      # CPU: configs/tiny.yaml, the transformers engine, 2 RL steps a variant

What runs (bench/recipe_7b.py's method and functions): a random-init Qwen2.5-1.5B folder (bench/gpu_shapes.py, the
real Qwen2.5 tokenizer beside it) stands in for the SFT model; `star train` runs stages synth and rl on the synthetic
world at the benchmark's scale with real Redis, sandbox over HTTP, rollout and reward workers and the DeepSpeed
learner, placed from the machine (the recipe leaves the learner's ranks unset: one GPU colocated). The episodes are
forced (`rl.sampling.forced_turns`, benchmarking only) to the teacher's shape: tool calls, turn and answer lengths
drawn per episode from the fit to the oracle teacher's trajectories (services/rollout/episode_shapes.py), long tail
included, so rows pack unevenly, lone long trajectories and slow groups occur. The recipe's batch is 32 prompts × 8;
here `--prompts` (default 4) × 8 a step, so that ten steps and both variants fit one job; the time model predicts that
batch.

Variants, one `star train` each, in this order (the second only where `--budget-s` leaves time for it):
- on: the recipe's late-group policy (`rl.late_groups: partial`) with a group deadline short enough to cut the tail
  (`rl.sampling.group_timeout_s`, `--group-timeout-s`) and over-sampling (`rl.oversample`, `--oversample`): a step
  trains the first groups to complete;
- off: no over-sampling and the recipe's own deadlines (hours: never reached).

The closed-loop ceiling (bench/rollout_limit.py `closed_loop`): the episodes the run trained (each group's first, from
samples.jsonl: prompt length, each turn's sampled tokens, the tokens the environment added after it) driven straight
on vLLM's AsyncLLM, built as the rollout worker builds its engine (same engine arguments, memory share and episode
budget), each turn after the first waiting a tool call drawn from the sandbox's measured HTTP latency. As many
episodes as the run kept in flight (two steps' worth under max_staleness 1), admitted by the worker's budget.

Recorded in bench/results/<name>.{json,md,png} (--smoke: under WORK): device, placement as printed, per variant its
steps (wall time and split: rollout, scoring, training, sync, idle; the split's shares; packed rows; the
trajectory-length histogram; agent tokens/s during rollout; late, partial and surplus groups), `idle_share` (idle over
wall time, steps after the first), `measured_step_s`; `rollout_efficiency` (the run's agent tokens/s over the ceiling's),
`predicted_step_s` (bench/time_model.py for this machine, placement and batch) and their ratio; the variants' step
times side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import recipe_7b as base  # noqa: E402
from bench.recipe_7b import SPLIT, TARGET, log  # noqa: E402

RECIPE = "configs/qwen2.5-1.5b-arpo-macro.yaml"
RESULTS = ROOT / "bench" / "results"
HIST = "trajectory_tokens/"
GROUP = 8  # the recipe's group size


def variant_items(name: str, args: argparse.Namespace) -> list[str]:
    """The variant's `--set` items: deadlines and over-sampling on (a short group deadline, partial groups trained,
    surplus prompts) or off (none, the recipe's deadlines)."""
    if name == "on":
        return [
            f"rl.oversample={args.oversample}",
            f"rl.sampling.group_timeout_s={args.group_timeout_s}",
            "rl.late_groups=partial",
        ]
    return ["rl.oversample=0"]


def published(prompts: int, oversample: float) -> int:
    return math.ceil(prompts * (1 + oversample) - 1e-9)


def run_items(args: argparse.Namespace, model: Path | None, variant: str, steps: int) -> list[str]:
    """All `--set` items of one variant's run: bench/recipe_7b.py's, the teacher's shape, the batch, the variant."""
    forced = {"shape": "teacher"}
    run_args = argparse.Namespace(**{**vars(args), "steps": steps, "set": []})
    oversample = args.oversample if variant == "on" else 0.0
    prompts = published(args.prompts, oversample) + 1
    items = base.overrides(run_args, model, forced=forced, prompts=prompts)
    items += [f"rl.batch_prompts={args.prompts}", "rl.samples_per_step=64"]
    if args.smoke:  # the tiny recipe on CPU: short drawn turns, few calls
        items += ["rl.sampling.max_tool_calls=2", "rl.sampling.max_tokens_per_turn=4"]
    return items + variant_items(variant, args) + list(args.set)


# the learner's counts of a step's late, partial, cut and surplus groups (services/learner/groups.py)
TAIL_COUNTS = (
    "groups_late",
    "groups_partial",
    "groups_dropped_late",
    "episodes_cut",
    "groups_surplus_trained",
    "groups_surplus_dropped",
)


def step_figures(rl_dir: Path) -> list[dict[str, Any]]:
    """bench/recipe_7b.py's steps, each with the split's shares, its length histogram, the tokens its
    trajectories sampled and the agent tokens/s of its rollout wait, and its late, partial and surplus groups."""
    from services.learner.runlog import read_metrics

    rows = [r for r in read_metrics(rl_dir) if r.get("phase", "rl") == "rl" and "time_step_wall_s" in r]
    steps = base.steps_from_metrics(rl_dir)
    for step, row in zip(steps, rows):
        wall = step["wall_s"] or 1.0
        step["split_share"] = {k: step["split_s"][k] / wall for k in SPLIT}
        step["length_histogram"] = {k[len(HIST) :]: int(v) for k, v in row.items() if k.startswith(HIST)}
        sampled = (row.get("rollout/sampled_tokens_mean") or 0.0) * (row.get("samples_trained") or 0.0)
        step["sampled_tokens"] = sampled
        rollout = step["split_s"]["rollout"]
        step["agent_tokens_per_s"] = sampled / rollout if rollout > 1.0 else None
        step["longest_episode_s"] = row.get("rollout/total_s_max")
        step["groups"] = {k: row.get(k, 0.0) for k in TAIL_COUNTS}
    return steps


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the steps after the first (the first also starts the engines): mean step, idle share, the agent
    tokens/s of the rollout waits (sampled tokens over rollout seconds)."""
    later = steps[1:] or steps
    if not later:
        return {"measured_step_s": None, "idle_share": None, "agent_tokens_per_s": None}
    wall = sum(s["wall_s"] - s.get("checkpoint_s", 0.0) for s in later)
    rollout = sum(s["split_s"]["rollout"] for s in later)
    sampled = sum(s["sampled_tokens"] for s in later)
    return {
        "measured_step_s": wall / len(later),
        "idle_share": sum(s["split_s"]["idle"] for s in later) / wall,
        "agent_tokens_per_s": sampled / rollout if rollout > 1.0 else None,
        "measured_over": "steps after the first" if len(steps) > 1 else "all steps",
    }


def tail(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """What the long tail met over a variant's steps: groups late, trained partially, dropped late, episodes cut at
    the deadline, groups trained from an earlier step's surplus and surplus dropped as stale (each summed over the
    steps), the slowest episode of each step (median and most), and whether the deadline fired at all."""
    total = {k: sum(s.get("groups", {}).get(k, 0.0) for s in steps) for k in TAIL_COUNTS}
    slowest = [s["longest_episode_s"] for s in steps if s.get("longest_episode_s") is not None]
    return {
        **total,
        "slowest_episode_s_median": statistics.median(slowest) if slowest else None,
        "slowest_episode_s_max": max(slowest) if slowest else None,
        "deadline_fired": any(total[k] for k in ("groups_late", "groups_partial", "episodes_cut")),
    }


# -- the closed-loop ceiling ---------------------------------------------------------------------------


def episode_scripts(rl_dir: Path, tokenizer: Any) -> list[dict[str, Any]]:
    """The trained episodes' turn scripts (samples.jsonl: each group's first sample): the prompt's tokens, and per
    turn (sampled tokens, tokens the environment added after it, seed), as bench/rollout_gpu.py's workload."""
    from services.common.files import iter_jsonl

    scripts = []
    path = rl_dir / "samples.jsonl"
    for _, row in iter_jsonl(path, skip_bad=True) if path.is_file() else []:
        messages = row.get("messages") or []
        turns, env, opening = [], 0, 0
        for m in messages:
            size = m.get("tokens") if m.get("role") == "assistant" else None
            if size is not None:
                if turns:
                    turns[-1] = (turns[-1][0], env, turns[-1][2])
                turns.append((int(size), 0, len(scripts) * 1000 + len(turns)))
                env = 0
            else:
                tokens = len(tokenizer(str(m.get("content", "")))["input_ids"]) + 5  # role header and end
                if turns:
                    env += tokens
                else:
                    opening += tokens
        if turns:
            scripts.append({"context": opening, "turns": turns})
    return scripts


def write_worker_config(config: Any, placement: Any, model: Path, path: Path) -> Path:
    """The settings file the embedded fleet gives rollout worker 0 (services.controller.embedded_fleet): its
    engine arguments, memory share, context and episode budget."""
    from services.controller.embedded_fleet import rollout_worker_config
    from services.rollout.config import write_rollout_config

    return write_rollout_config(
        path, rollout_worker_config(config, placement, str(model), 0, colocated=placement.colocated)
    )


def ceiling_child(args: argparse.Namespace) -> None:
    """In its own process, with the worker's settings file and devices: the worker's engine, then the episodes
    straight on its AsyncLLM; the result as JSON at `args.ceiling_out`."""
    from transformers import AutoTokenizer

    from bench.rollout_limit import ToolLatency, closed_loop, counters_during, engine_counters, sandbox_latency
    from services.common.settings import get_settings
    from services.rollout.capacity import engine_for_budget, inflight_budget
    from services.rollout.config import load_rollout_config
    from services.rollout.service import make_engine

    spec = json.loads(Path(args.ceiling_in).read_text())
    config = load_rollout_config(args.ceiling_config)
    budget = inflight_budget(config, config.model or get_settings().model)
    config = engine_for_budget(config, budget)
    tokenizer = AutoTokenizer.from_pretrained(config.model or get_settings().model)
    scripts = spec["scripts"]
    plan = [scripts[i % len(scripts)] for i in range(spec["episodes"])]
    # a distinct prompt per episode: run_agents draws each one's ids from its index
    loop_args = argparse.Namespace(long=-1)
    p50, p99 = sandbox_latency()

    async def measure() -> dict[str, Any]:
        t0 = time.perf_counter()
        engine = make_engine(get_settings(), config)
        started = time.perf_counter() - t0
        try:
            warm = [dict(plan[0], turns=plan[0]["turns"][:1])]
            await closed_loop(engine.llm, warm, loop_args, tokenizer.vocab_size)
            before = engine_counters()
            res = await closed_loop(
                engine.llm,
                plan,
                loop_args,
                tokenizer.vocab_size,
                latency=ToolLatency(p50, p99, seed=1),
                inflight=budget,
            )
            res["engine"] = counters_during(before, engine_counters())
        finally:
            await engine.close()
        return {
            **res,
            "start_s": started,
            "episodes": len(plan),
            "inflight": budget,
            "max_num_seqs": config.vllm.max_num_seqs,
            "tool_latency_p50_s": p50,
            "tool_latency_p99_s": p99,
            "vllm_args": config.vllm.model_dump(),
            "gpu_memory_utilization": config.gpu_memory_utilization,
        }

    Path(args.ceiling_out).write_text(json.dumps(asyncio.run(measure()), indent=1))


def measure_ceiling(
    args: argparse.Namespace, work: Path, config: Any, placement: Any, model: Path, rl_dir: Path
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    scripts = episode_scripts(rl_dir, AutoTokenizer.from_pretrained(model))
    if not scripts:
        return {"error": f"no trained episodes in {rl_dir / 'samples.jsonl'}"}
    episodes = published(args.prompts, args.oversample) * GROUP * (1 + config.rl.max_staleness)
    spec, out = work / "ceiling_in.json", work / "ceiling.json"
    spec.write_text(json.dumps({"scripts": scripts, "episodes": episodes}))
    out.unlink(missing_ok=True)
    settings = write_worker_config(config, placement, model, work / "ceiling_worker.json")
    env = {**os.environ, **placement.engine_devices_env(0)}
    cmd = [sys.executable, __file__, "--ceiling-child", "--ceiling-in", str(spec), "--ceiling-out", str(out)]
    cmd += ["--ceiling-config", str(settings)]
    log(f"closed-loop ceiling: {episodes} episodes from {len(scripts)} trained scripts")
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.ceiling_timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    res = json.loads(out.read_text()) if out.is_file() else {}
    return {**res, "rc": rc, "scripts": len(scripts)}


# -- the record -----------------------------------------------------------------------------------


def record(
    args: argparse.Namespace,
    config: Any,
    variants: dict[str, Any],
    ceiling: dict[str, Any] | None,
    placement_text: list[str],
) -> dict[str, Any]:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    main = variants.get("on") or next(iter(variants.values()), {})
    steps = main.get("steps", [])
    mode = base.placement_mode(placement_text)
    calls = main.get("trajectories", {}).get("mean_tool_calls")
    prediction = None
    if not args.smoke and steps:
        try:
            prediction = base.predict(config, steps, device, max(args.gpus, 1), mode, tool_calls=calls, shape="1.5b")
        except (SystemExit, OSError, KeyError) as exc:  # the record keeps why there is no prediction
            prediction = {"error": str(exc), "seconds": None}
    predicted = (prediction or {}).get("seconds") and prediction["seconds"]["step"]
    measured = main.get("measured_step_s")
    agent = main.get("agent_tokens_per_s")
    ceiling_tps = (ceiling or {}).get("tokens_per_s")
    on, off = variants.get("on", {}).get("measured_step_s"), variants.get("off", {}).get("measured_step_s")
    from bench.gpu_shapes import shape_params

    return {
        "recipe": RECIPE if not args.smoke else "configs/tiny.yaml",
        "device": device,
        "gpus": args.gpus,
        "placement": placement_text,
        "placement_mode": mode,
        "params": None if args.smoke else shape_params("1.5b"),
        "batch": {
            "prompts": args.prompts,
            "group": GROUP,
            "recipe_prompts": 32,
            "published_on": published(args.prompts, args.oversample),
        },
        "episode_shape": "teacher (services/rollout/episode_shapes.py)",
        "steps": steps,
        "idle_share": main.get("idle_share"),
        "measured_step_s": measured,
        "measured_over": main.get("measured_over"),
        "agent_tokens_per_s": agent,
        "ceiling": ceiling,
        "ceiling_tokens_per_s": ceiling_tps,
        "rollout_efficiency": agent / ceiling_tps if agent and ceiling_tps else None,
        "prediction": prediction,
        "predicted_step_s": predicted,
        "ratio": measured / predicted if measured and predicted else None,
        "within_target": bool(measured and predicted and abs(measured / predicted - 1) <= TARGET),
        "target": TARGET,
        "variants": variants,
        "deadlines_effect": {
            "on_step_s": on,
            "off_step_s": off,
            "on_over_off": on / off if on and off else None,
            **{name: tail(v["steps"]) for name, v in variants.items() if v.get("steps")},
        },
    }


def markdown(rec: dict[str, Any]) -> str:
    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return "–" if x is None else fmt.format(x)

    lines = [
        f"# `star train {rec['recipe']}` on {rec['gpus']}× {rec['device']}",
        "",
        "`python bench/recipe_1p5b.py` (method in its docstring). Placement as printed:",
        "",
        "```",
        *rec["placement"],
        "```",
        "",
        f"Batch: {rec['batch']['prompts']} prompts × {rec['batch']['group']} a step (the recipe's "
        f"{rec['batch']['recipe_prompts']}; with over-sampling {rec['batch']['published_on']} published); "
        f"episodes of the teacher's shape.",
        "",
    ]
    for name, v in rec["variants"].items():
        lines += [f"## Variant {name}: {' '.join(v.get('settings', [])) or 'the recipe'}", ""]
        if v.get("skipped"):
            lines += [f"Not run: {v['skipped']}", ""]
            continue
        lines += [
            "| step | wall (s) | rollout | scoring | training | sync | idle | packed rows | agent tokens/s | "
            "late / partial / cut | lengths (≤1K/2K/4K/8K/16K/32K/over) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in v["steps"]:
            sp, g, h = s["split_s"], s.get("groups", {}), s.get("length_histogram", {})
            hist = "/".join(
                str(h.get(k, 0)) for k in ("le_1024", "le_2048", "le_4096", "le_8192", "le_16384", "le_32768", "over")
            )
            lines.append(
                f"| {s['step']} | {s['wall_s']:.1f} | "
                + " | ".join(f"{sp[k]:.1f}" for k in SPLIT)
                + f" | {s.get('packed_rows') or 0:.0f} | {f(s.get('agent_tokens_per_s'), '{:,.0f}')} | "
                f"{g.get('groups_late', 0):.0f} / {g.get('groups_partial', 0):.0f} / "
                f"{g.get('episodes_cut', 0):.0f} | {hist} |"
            )
        lines += [
            "",
            f"Mean step {f(v.get('measured_step_s'), '{:.1f}')} s ({v.get('measured_over')}), idle "
            f"{f(v.get('idle_share'), '{:.1%}')} of it; agent {f(v.get('agent_tokens_per_s'), '{:,.0f}')} "
            f"tokens/s during rollout; `star train` rc {v.get('rc')}.",
            "",
        ]
    c = rec.get("ceiling") or {}
    lines += [
        "## Closed-loop ceiling",
        "",
        f"{c.get('episodes', '–')} episodes from {c.get('scripts', '–')} trained scripts, at most "
        f"{c.get('inflight', '–')} in flight, tool calls waiting {f(c.get('tool_latency_p50_s'), '{:.3f}')} s "
        f"(p50) to {f(c.get('tool_latency_p99_s'), '{:.3f}')} s (p99): {f(c.get('tokens_per_s'), '{:,.0f}')} "
        f"tokens/s (rc {c.get('rc', '–')}{', ' + c['error'] if c.get('error') else ''}). Rollout efficiency "
        f"(the run's agent tokens/s over it): {f(rec.get('rollout_efficiency'))} (target 0.85).",
        "",
    ]
    p = rec.get("prediction")
    if p and p.get("seconds"):
        pred = p["seconds"]
        lines += [
            "## Time model",
            "",
            f"Predicted ({p['machine']['placement']}, this batch): {pred['step']:.1f} s a "
            f"step (rollout {pred['rollout']:.1f}, scoring {pred['scoring']:.1f}, training {pred['training']:.1f}, "
            f"sync {pred['weight_sync']:.1f}); measured {f(rec['measured_step_s'], '{:.1f}')} s: ratio "
            f"{f(rec['ratio'])} ({'within' if rec['within_target'] else 'outside'} ±{rec['target']:.0%}).",
            "",
        ]
        if p.get("note"):
            lines += [p["note"], ""]
    d = rec["deadlines_effect"]
    lines += [
        "## Deadlines and over-sampling",
        "",
        f"Mean step with them {f(d['on_step_s'], '{:.1f}')} s, without "
        f"{f(d['off_step_s'], '{:.1f}')} s (ratio {f(d['on_over_off'])}).",
        "",
        "| variant | groups late | partial | dropped late | episodes cut | surplus trained | surplus dropped | "
        "slowest episode a step, median / most (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in rec["variants"]:
        if t := d.get(name):
            lines.append(
                f"| {name} | " + " | ".join(f"{t[k]:.0f}" for k in TAIL_COUNTS) + f" | "
                f"{f(t['slowest_episode_s_median'], '{:.1f}')} / {f(t['slowest_episode_s_max'], '{:.1f}')} |"
            )
    if (t := d.get("on")) and not t["deadline_fired"]:
        lines += ["", "The group deadline never fired: no step's slowest episode reached it."]
    lines.append("")
    return "\n".join(lines)


def plot(rec: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in rec["variants"].items() if v.get("steps")}
    if not ran:
        return
    fig, axes = plt.subplots(1, len(ran), figsize=(5 * len(ran), 3.6), squeeze=False)
    for ax, (name, v) in zip(axes[0], ran.items()):
        xs = [s["step"] for s in v["steps"]]
        bottom = [0.0] * len(xs)
        for k in SPLIT:
            ys = [s["split_s"][k] for s in v["steps"]]
            ax.bar(xs, ys, bottom=bottom, label=k)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.set_title(f"{name}: split by step ({rec['device']})", fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_ylabel("seconds")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the job --------------------------------------------------------------------------------------


def run_variant(
    args: argparse.Namespace,
    work: Path,
    model: Path | None,
    name: str,
    steps: int,
    env: dict[str, str],
    minutes: float | None = None,
) -> dict[str, Any]:
    """One variant's `star train`; `minutes`: the RL stage's wall-clock budget (rl.max_minutes), so that a slow run
    still leaves the job its later parts."""
    run_dir = work / f"run-{name}"
    items = run_items(args, model, name, steps) + ([f"rl.max_minutes={minutes:.2f}"] if minutes else [])
    run_args = argparse.Namespace(**{**vars(args), "recipe": args.recipe})
    t0 = time.monotonic()
    rc, output = base.run_train(run_args, run_dir, items, env)
    (work / f"train-{name}.log").write_text(output)
    figures = step_figures(run_dir / "rl")
    return {
        "settings": variant_items(name, args),
        "overrides": items,
        "steps_asked": steps,
        "rc": rc,
        "train_s": time.monotonic() - t0,
        "steps": figures,
        **summary(figures),
        "placement": base.placement_lines(output),
        "failures": base.failures(run_dir, output, rc),
        "trajectories": base.trajectory_shape(run_dir / "rl"),
    }


FIRST_SHARE = 0.6  # of the job's budget, the first variant's RL stage at most


def write(
    args: argparse.Namespace,
    work: Path,
    config: Any,
    variants: dict[str, Any],
    ceiling: dict[str, Any] | None,
    t_start: float,
) -> dict[str, Any]:
    """The record so far, rewritten after each part (a job cut short keeps what was done)."""
    placement_text = next((v["placement"] for v in variants.values() if v.get("placement")), [])
    rec = record(args, config, variants, ceiling, placement_text)
    rec["job_s"] = time.monotonic() - t_start
    out = work if args.smoke else RESULTS
    name = f"{args.name}_smoke" if args.smoke else args.name
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown(rec))
    try:
        plot(rec, out / f"{name}.png")
    except ImportError as exc:  # a machine without matplotlib still gets the JSON and Markdown
        log(f"no PNG: {exc}")
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs the run sees (CUDA_VISIBLE_DEVICES 0..N-1)")
    ap.add_argument("--steps", type=int, default=10, help="RL steps of the first variant (rl.max_steps)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts a step (rl.batch_prompts; the recipe's is 32)")
    ap.add_argument("--variants", default="on,off", help="which variants, in order (on, off)")
    ap.add_argument("--oversample", type=float, default=0.25, help="variant on: rl.oversample")
    ap.add_argument(
        "--group-timeout-s",
        type=float,
        default=24.0,
        help="variant on: rl.sampling.group_timeout_s (a step's slowest episode took 15-45 s, median 20-24 s, on an "
        "H100 and an H200: 24 s cuts the slower steps' tails, 60 s never fired)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall seconds the job has: a later variant runs only with the steps that fit what is left",
    )
    ap.add_argument("--min-steps", type=int, default=3, help="fewest steps a later variant is worth running")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="skip the closed-loop ceiling")
    ap.add_argument("--ceiling-timeout-s", type=float, default=240)
    ap.add_argument("--max-learner-restarts", type=int, default=2)
    ap.add_argument("--tokenizer", default=None, help="a saved Qwen2.5 tokenizer folder (default: built here)")
    ap.add_argument("--work", default="/tmp/recipe-1p5b")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="more recipe overrides")
    ap.add_argument("--smoke", action="store_true", help="CPU: configs/tiny.yaml, 2 steps a variant, no ceiling")
    ap.add_argument("--name", default="recipe_1p5b_h200")
    ap.add_argument("--ceiling-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ceiling-in", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ceiling-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ceiling-config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ceiling_child:
        ceiling_child(args)
        return 0
    names = [v for v in args.variants.split(",") if v]
    if bad := [v for v in names if v not in ("on", "off")] or not names:
        ap.error(f"--variants: give on and/or off, not {bad or args.variants!r}")
    t_start = time.monotonic()
    args.recipe = RECIPE
    if args.smoke:
        args.recipe, args.gpus, args.steps, args.ceiling = "configs/tiny.yaml", 0, 2, False
        args.prompts = min(args.prompts, 2)
        args.group_timeout_s = max(args.group_timeout_s, 300.0)  # a loaded CPU decodes a few tokens a second
        args.work = args.work if args.work != "/tmp/recipe-1p5b" else "/tmp/recipe-1p5b-smoke"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "COLUMNS": "240"}
    model = None
    if not args.smoke:  # the GPUs given (a job's lane), else the first --gpus
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(args.gpus))))
        os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        log("writing the random-init Qwen2.5-1.5B folder")
        model = base.model_folder(work, args.tokenizer, "1.5b")
    from services.pipeline.config import load_pipeline_config

    config = load_pipeline_config(ROOT / args.recipe, run_items(args, model, names[0], args.steps))
    variants: dict[str, Any] = {}
    ceiling = None
    for i, name in enumerate(names):
        steps = args.steps
        if i and args.budget_s is not None:
            first = variants[names[0]]
            per_step = first.get("measured_step_s") or first["train_s"] / max(args.steps, 1)
            start = first["train_s"] - per_step * len(first["steps"])
            left = args.budget_s - (time.monotonic() - t_start) - 30
            steps = min(args.steps, int((left - start) // per_step)) if per_step > 0 else 0
            if steps < args.min_steps:
                variants[name] = {
                    "settings": variant_items(name, args),
                    "skipped": (
                        f"{left:.0f} s left of --budget-s {args.budget_s:.0f}: {max(steps, 0)} steps of "
                        f"{per_step:.0f} s after a {start:.0f} s start fit, fewer than {args.min_steps}"
                    ),
                }
                log(variants[name]["skipped"])
                continue
        minutes = None
        if args.budget_s is not None:  # the first run keeps room for the ceiling and the second variant
            left = args.budget_s - (time.monotonic() - t_start)
            minutes = max(1.0, (FIRST_SHARE * left if i == 0 and len(names) > 1 else left - 30) / 60)
        log(f"variant {name}: {steps} steps" + (f", at most {minutes:.1f} minutes of RL" if minutes else ""))
        variants[name] = run_variant(args, work, model, name, steps, env, minutes)
        write(args, work, config, variants, ceiling, t_start)
        if i == 0 and args.ceiling and model is not None:
            from services.pipeline.placement import placement_for_recipe

            placement = placement_for_recipe(config)  # this machine's, as `star train` derived it
            ceiling = measure_ceiling(args, work, config, placement, model, work / f"run-{name}" / "rl")
            log(f"ceiling: {ceiling.get('tokens_per_s')} tokens/s (rc {ceiling.get('rc')})")
            write(args, work, config, variants, ceiling, t_start)
    print(markdown(write(args, work, config, variants, ceiling, t_start)))
    first = variants[names[0]]
    return 0 if first.get("rc") == 0 and len(first.get("steps", [])) >= first.get("steps_asked", 1) else 1


if __name__ == "__main__":
    sys.exit(main())
