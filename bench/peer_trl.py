"""The peer-trainer benchmark: TRL's GRPOTrainer beside `star train`, the same work on one machine, one after
the other (issue #66).

    python bench/peer_trl.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --steps 40        # the GPU job (H200)
    python bench/peer_trl.py --config configs/tiny.yaml --steps 2 --heldout 4 --out DIR   # the CPU smoke

Phases (each recorded in WORK/state.json, so a rerun resumes after the last one done):
  convert      the GGUF policy → an HF folder at model.path (bench/gpu_proof.py's converter; GPU job only)
  sft          `star train --stage synth --stage sft` of the recipe (or `--sft-checkpoint` reuses a model)
  eval_before  the SFT checkpoint on the held-out queries (`star eval`, official, then the same answers strict)
  ours         `star train --stage rl` from that checkpoint, rl.max_steps = --steps
  eval_ours    our RL model, same queries, same sampling
  trl          bench/peer_trl_side.py in TRL's environment (--trl-python) against the episode API served here
               over the run's world: the prompts our side trained, in the order it trained them
  eval_trl     TRL's model, same queries, same sampling
  report       bench/results/peer_trl.{json,md,png} (--out): steps per hour, step times, tokens/s, GPU memory
               peak, held-out success before and after with bootstrap CIs, versions and the settings mapping

A step is one batch of `rl.batch_prompts × rl.group_size` rollouts trained, on both sides: ours does
`rl.mini_batches` optimizer updates in it, TRL `steps_per_generation` = mini_batches updates of
`per_device_train_batch_size` = batch / mini_batches samples each. The settings TRL cannot match are listed in
the record (`settings.mismatches`). GPU memory peak is the device's used memory sampled every second by
nvidia-smi while each side trains (both sides run several processes or allocators; the device total is the
one figure measured alike). Held-out success is our evaluator's final pass rate; its CI is a bootstrap over
the queries (2000 resamples), and `star eval compare` gives each side's paired after − before CI.

TRL and vLLM: TRL 1.16 accepts vLLM 0.22.0 … 0.31.0 (trl/import_utils.py), so the GPU run uses vLLM 0.26.0, the
version our GPU path runs, in TRL's one-GPU mode (`use_vllm=True, vllm_mode="colocate"`; see
bench/peer_trl_side.py). On CPU the TRL side generates with plain transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_proof import State, convert_gguf, stage_outputs  # noqa: E402 - after the path, as a script needs it

PHASES = ("convert", "sft", "eval_before", "ours", "eval_ours", "trl", "eval_trl", "report")
SIDES = ("ours", "trl")
RESAMPLES = 2000
READY_S = 180.0  # a served sandbox or episode API answers /readyz within this


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] peer: {msg}", flush=True)


def star(*argv: str, log_file: Path) -> None:
    """One `star` command (our CLI, in this Python), its output in `log_file`; a failure names the log."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as out:
        proc = subprocess.run([sys.executable, "-m", "services.cli", *argv], stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log_file.read_text()[-3000:]
        raise RuntimeError(f"star {argv[0]} failed ({proc.returncode}); {log_file}:\n{tail}")


def recipe(run: Path) -> dict[str, Any]:
    """The run's resolved recipe (every default filled in), as `star train` wrote it."""
    return yaml.safe_load((run / "config.yaml").read_text())


def gpu_machine() -> bool:
    """Whether this machine has an NVIDIA GPU (TRL's side then generates with vLLM)."""
    return shutil.which("nvidia-smi") is not None


# ---- GPU memory -------------------------------------------------------------------------------------


@contextmanager
def gpu_memory_peak() -> Iterator[dict[str, float | None]]:
    """The device's peak used memory (GiB, nvidia-smi every second) while the block runs; None without one."""
    found: dict[str, float | None] = {"peak_gib": None}
    if shutil.which("nvidia-smi") is None:
        yield found
        return
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                used = float(out.strip().splitlines()[0]) / 1024
                found["peak_gib"] = max(found["peak_gib"] or 0.0, used)
            except (ValueError, IndexError, subprocess.SubprocessError):
                pass
            stop.wait(1.0)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join(timeout=15)


# ---- held-out evaluation --------------------------------------------------------------------------


def evaluate(model: str, cfg: dict[str, Any], run: Path, split: str, limit: int, out: Path) -> dict[str, Any]:
    """`star eval` of `model` on the held-out split with the recipe's eval sampling: decoded once, scored
    official, and the same answers scored strict."""
    from services.evaluation.runfolder import RunFolder

    e, s, engine = cfg["eval"], cfg["eval"]["sampling"], cfg["services"]["engine"]
    world = f"sqlite:///{run / 'world.sqlite'}"
    argv = ["--split", split, "--db", world, "-n", str(limit)]
    t0 = time.perf_counter()
    decode = [
        "eval",
        "--model",
        model,
        "--engine",
        engine,
        *("--temperature", str(s["temperature"]), "--top-p", str(s["top_p"])),
        *("--max-context", str(s["max_context_tokens"]), "--max-tokens", str(s["max_tokens_per_turn"])),
        *("--max-tool-calls", str(s["max_tool_calls"]), "--concurrency", str(e["concurrency"])),
        *("--seed", str(cfg["seed"]), "--mode", "official", "--out", str(out / "official"), *argv),
    ]
    if engine == "vllm":
        decode += ["--vllm-args", json.dumps(cfg["services"]["vllm"])]
    star(*decode, log_file=out / "eval.log")
    decode_s = time.perf_counter() - t0
    predictions = out / "official" / "predictions.jsonl"
    star("eval", "--predictions", str(predictions), "--mode", "strict", "--out", str(out / "strict"), *argv,
         log_file=out / "eval.log")  # fmt: skip
    result: dict[str, Any] = {"model": model, "folder": str(out), "decode_s": decode_s}
    for mode in ("official", "strict"):
        folder = RunFolder(out / mode)
        result[mode] = success_with_ci([r.success for r in folder.records()])
    log(f"eval {model}: success official {result['official']['success']}, strict {result['strict']['success']}")
    return result


def success_with_ci(successes: list[bool], confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Success as a fraction of 1 with a percentile bootstrap CI over the queries."""
    import numpy as np

    if not successes:
        return {"success": None, "ci": None, "queries": 0}
    values = np.array(successes, dtype=float)
    draws = np.random.default_rng(seed).integers(0, len(values), size=(RESAMPLES, len(values)))
    alpha = (1 - confidence) / 2
    low, high = np.quantile(values[draws].mean(axis=1), [alpha, 1 - alpha])
    return {"success": float(values.mean()), "ci": [float(low), float(high)], "queries": len(values)}


def paired_gain(before: dict[str, Any], after: dict[str, Any], out: Path) -> dict[str, Any] | None:
    """`star eval compare` of the official scorings (after − before, paired bootstrap over the queries)."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "eval", "compare", f"{before['folder']}/official",
         f"{after['folder']}/official", "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        log(f"star eval compare failed: {proc.stderr[-500:]}")
        return None
    (out / "compare.json").write_text(proc.stdout)
    reply = json.loads(proc.stdout)
    row = next((r for r in reply["deltas"] if r.get("metric") == "final_pass_rate"), None)
    if row is None:
        return None
    return {"points": row["delta"], "ci_points": [row["low"], row["high"]], "p_after_better": row["p_b_better"]}


# ---- our side -------------------------------------------------------------------------------------------


def our_side(config: Path, run: Path, sets: list[str]) -> dict[str, Any]:
    """`star train --stage rl` in the SFT run's folder (the same overrides: the same recipe); its step times
    from the learner's metrics.jsonl."""
    t0 = time.time()
    with gpu_memory_peak() as memory:
        star("train", str(config), "--run-dir", str(run), "--stage", "rl", *sum((["--set", o] for o in sets), []),
             log_file=run.parent / "logs" / "ours.log")  # fmt: skip
    wall = time.time() - t0
    out = stage_outputs(run, "rl")
    rows = [json.loads(line) for line in Path(out["metrics"]).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("phase", "rl") == "rl" and "reward_mean" in r]
    times = [t0] + [r["time"] for r in rows]
    steps = [
        {
            "step": i + 1,
            "step_s": times[i + 1] - times[i],
            "wall_s": times[i + 1] - t0,
            "tokens": r.get("tokens"),
            "reward": r.get("reward_mean"),
        }
        for i, r in enumerate(rows)
    ]
    return {
        "model": out["model"],
        "steps": steps,
        "train_s": wall,
        "peak_gib": memory["peak_gib"],
        "order": trained_order(run / "rl" / "samples.jsonl"),
        "versions": versions(),  # the machine that trained, whichever one writes the report
    }


def trained_order(samples: Path) -> list[str]:
    """The prompt ids our side trained, batch by batch, in the order the groups came (rl/samples.jsonl holds
    every group's first sample when rl.samples_per_step = rl.batch_prompts)."""
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()] if samples.is_file() else []
    rows.sort(key=lambda r: r.get("batch", r.get("step", 0)))
    return [str(r["prompt_id"]) for r in rows]


# ---- the TRL side ------------------------------------------------------------------------------------------


def trl_settings(cfg: dict[str, Any], steps: int, gpu: bool) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The recipe's RL settings as GRPOConfig arguments, the episode options, and what cannot be matched."""
    r, s = cfg["rl"], cfg["rl"]["sampling"]
    per_step = r["batch_prompts"] * r["group_size"]
    mini = max(1, int(r.get("mini_batches") or 1))
    if per_step % mini:
        raise ValueError(f"rl.mini_batches {mini} does not divide the {per_step} rollouts of a step")
    grpo: dict[str, Any] = {
        "max_steps": steps * mini,
        "num_generations": r["group_size"],
        "per_device_train_batch_size": per_step // mini,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": mini,  # TRL's generation batch: per_device_train_batch_size × this = a step
        "num_iterations": 1,
        "learning_rate": r["lr"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "beta": r.get("kl_coef") or 0.0,
        "epsilon": r["eps_low"],
        "epsilon_high": r["eps_high"],
        "loss_type": "dapo" if r["loss_agg"] == "token-mean" else "grpo",
        "temperature": s["temperature"],
        "top_p": s["top_p"],
        # the most an episode of ours samples: every turn at its cap, within the context
        "max_completion_length": min(s["max_context_tokens"], s["max_tokens_per_turn"] * (s["max_tool_calls"] + 1)),
        "max_tool_calling_iterations": s["max_tool_calls"],
        "mask_truncated_completions": r.get("truncated") == "mask",
        "shuffle_dataset": False,
        "seed": cfg["seed"],
        "logging_steps": 1,
        "gradient_checkpointing": gpu,
        "bf16": gpu,
    }
    if gpu:
        grpo.update(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.3,
            vllm_max_model_length=s["max_context_tokens"] + 2048,
            # ours: per-token truncated (tis) or masked (mis) ratios of learner to sampler, bounded by is_high
            vllm_importance_sampling_correction=r.get("importance_sampling", "off") != "off",
            vllm_importance_sampling_mode="token_mask" if r.get("importance_sampling") == "mis" else "token_truncate",
            vllm_importance_sampling_clip_max=r.get("is_high", 2.0),
        )
    reward = r["reward"]
    episode = {"mode": r.get("eval_mode", "strict"), "reward": reward, "max_tool_calls": s["max_tool_calls"]}
    mismatches = [
        f"turn cap: ours caps each turn at {s['max_tokens_per_turn']} tokens and the episode at "
        f"{s['max_context_tokens']}; TRL has one cap, max_completion_length, over the whole completion "
        "(tool output included), set to the smaller of the context and every turn at its cap",
        "prompt tokens: TRL counts the rendered prompt outside max_completion_length, ours inside the context",
        f"asynchrony: ours samples up to rl.max_staleness={r.get('max_staleness', 0)} versions ahead of the "
        "learner; TRL's colocated vLLM generates and trains in turn (synchronous)",
        f"dual clip c={r.get('dual_clip_c')} and log-ratio clamp {r.get('log_ratio_clamp')}: TRL has neither",
        f"truncated={r.get('truncated')}: TRL masks truncated completions or trains them with the reward of their "
        "unfinished last message (our 'fail' gives 0; an unfinished plan scores 0 too, so they mostly agree)",
        f"reward kind {reward}: the episode API's reward of the same kind and mode"
        + (" (curriculum read at epoch 1 on both sides)" if reward == "curriculum" else ""),
        "chat format: TRL renders our chatml protocol through a Jinja template (bench/peer_trl_side.py) and "
        "parses turns with its Qwen3 response template; ours tokenizes turns by hand, never re-tokenizing samples",
    ]
    if not gpu:
        mismatches.append("CPU: TRL generates with transformers (no vLLM); ours with the recipe's engine")
    return grpo, episode, mismatches


def prompts_in_order(rl_queries: Path, order: list[str]) -> list[dict[str, Any]]:
    """The RL prompts our side trained, in its order, then the rest of the prompt file in the file's order (all of
    it in that order when our side has not run: our scheduler's seeded shuffle is not guessed here)."""
    queries = [json.loads(line) for line in rl_queries.read_text().splitlines() if line.strip()]
    by_id = {str(q.get("id")): q for q in queries}
    missing = [i for i in order if i not in by_id]
    if missing:
        raise RuntimeError(f"{len(missing)} trained prompt ids are not in {rl_queries}, e.g. {missing[0]}")
    trained = set(order)
    return [by_id[i] for i in order] + [q for q in queries if str(q.get("id")) not in trained]


def trl_side(args, cfg: dict[str, Any], run: Path, model: str, order: list[str], out: Path) -> dict[str, Any]:
    """bench/peer_trl_side.py in TRL's environment, against the episode API served here over the run's world."""
    gpu = gpu_machine()
    grpo, episode, mismatches = trl_settings(cfg, args.steps, gpu)
    prompts = prompts_in_order(Path(stage_outputs(run, "synth")["rl_queries"]), order)
    prompts = prompts[: args.steps * cfg["rl"]["batch_prompts"]]
    out.mkdir(parents=True, exist_ok=True)
    with served_episodes(f"sqlite:///{run / 'world.sqlite'}", out / "logs") as (url, token):
        spec = {
            "url": url,
            "token": token,
            "model": model,
            "out": str(out),
            "prompts": prompts,
            "grpo": grpo,
            "episode": episode,
            "epoch": 1,
            "steps": args.steps,
            "updates_per_step": grpo["steps_per_generation"],
            "time_cap_s": args.side_minutes * 60 if args.side_minutes else None,
        }
        (out / "spec.json").write_text(json.dumps(spec, indent=1))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
        t0 = time.time()
        with gpu_memory_peak() as memory, open(out / "trl.log", "w") as log_file:
            proc = subprocess.run(
                [str(args.trl_python), str(ROOT / "bench" / "peer_trl_side.py"), "--spec", str(out / "spec.json")],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"the TRL side failed ({proc.returncode}); {out / 'trl.log'}:\n{(out / 'trl.log').read_text()[-3000:]}"
        )
    side = json.loads((out / "side.json").read_text())
    return {
        "model": side["model"],
        "steps": trl_steps(side["steps"], side.get("log_history") or []),
        "train_s": wall,
        "peak_gib": memory["peak_gib"],
        "torch_peak_gib": side.get("torch_peak_memory_gib"),
        "versions": side["versions"],
        "grpo": grpo,
        "episode": episode,
        "mismatches": mismatches,
    }


def trl_steps(timed: list[dict[str, Any]], log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The TRL side's RL steps: each step's wall time from its timer, its reward and trajectory tokens from the
    generation TRL logged for it. TRL logs a generation's figures (reward, cumulative num_tokens) with the first
    optimizer update of its RL step, so the n-th log that has a reward belongs to the n-th RL step."""
    generations = [entry for entry in log_history if "reward" in entry]
    steps, seen = [], 0.0
    for i, step in enumerate(timed):
        generation = generations[i] if i < len(generations) else {}
        total = generation.get("num_tokens")
        steps.append(
            {
                **{k: v for k, v in step.items() if k not in ("num_tokens", "reward")},
                "reward": generation.get("reward"),
                "tokens": None if total is None else total - seen,
            }
        )
        seen = total if total is not None else seen
    return steps


@contextmanager
def served_episodes(world: str, logs: Path) -> Iterator[tuple[str, str]]:
    """The sandbox and the episode API over `world` (`star sandbox serve`, `star episodes serve`), with Redis
    at STAR_REDIS_URL or a private one, until the block ends: (url, token)."""
    import redis

    from services.common.redis import EmbeddedRedis, free_port
    from services.common.supervisor import wait_ready

    logs.mkdir(parents=True, exist_ok=True)
    token = os.urandom(12).hex()
    redis_url, embedded = os.environ.get("STAR_REDIS_URL", "redis://127.0.0.1:6379/0"), None
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=0.5).ping()
    except redis.ConnectionError:
        embedded = EmbeddedRedis()
        embedded.__enter__()
        redis_url = embedded.url
    env = {**os.environ, "STAR_API_TOKEN": token, "STAR_DB_URL": world, "STAR_LOG_JSON": "false",
           "STAR_STREAM_PREFIX": f"peer:{token[:8]}", "STAR_FORMATTER_LLM_URL": ""}  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        sandbox, episodes = free_port(), free_port()
        for name, argv in (
            ("sandbox", ["sandbox", "serve", "--port", str(sandbox), "--db", world]),
            ("episodes", ["episodes", "serve", "--port", str(episodes), "--db", world,
                          "--sandbox-url", f"http://127.0.0.1:{sandbox}", "--redis-url", redis_url]),
        ):  # fmt: skip
            with open(logs / f"{name}.log", "w") as out:
                procs.append(
                    subprocess.Popen([sys.executable, "-m", "services.cli", *argv], stdout=out, stderr=out, env=env)
                )
            url = f"http://127.0.0.1:{sandbox if name == 'sandbox' else episodes}"
            wait_ready(name, procs[-1], url, logs / f"{name}.log", READY_S)
        yield f"http://127.0.0.1:{episodes}", token
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if embedded is not None:
            embedded.__exit__(None, None, None)


# ---- the record -----------------------------------------------------------------------------------------


def side_summary(side: dict[str, Any], before: dict[str, Any], after: dict[str, Any] | None, gain) -> dict[str, Any]:
    step_s = [s["step_s"] for s in side["steps"]]
    tokens = [s.get("tokens") for s in side["steps"]]
    steady = step_s[1:] or step_s  # the first step holds the engines' start
    trajectory_tokens = sum(t for t in tokens if t) if all(t is not None for t in tokens) and tokens else None
    return {
        "steps": len(step_s),
        "steps_per_hour": 3600 * len(step_s) / side["train_s"] if step_s and side["train_s"] else 0.0,
        "steps_per_hour_steady": 3600 / statistics.median(steady) if steady else None,
        "train_s": side["train_s"],
        "step_s_median": statistics.median(step_s) if step_s else None,
        "step_s_spread": [min(step_s), max(step_s)] if step_s else None,
        "step_s_iqr": list(statistics.quantiles(step_s, n=4)[::2]) if len(step_s) >= 2 else None,
        "trajectory_tokens_per_s": trajectory_tokens / sum(step_s) if trajectory_tokens and sum(step_s) else None,
        "gpu_memory_peak_gib": side.get("peak_gib"),
        "heldout_success_before": before["official"]["success"],
        "heldout_success_after": (after or {}).get("official", {}).get("success"),
        "heldout": {"before": before, "after": after, "gain_official": gain},
        "curve": [{"wall_s": s["wall_s"], "step": s["step"], "reward": s.get("reward")} for s in side["steps"]],
        "model": side["model"],
    }


def report(state: dict[str, Any], out: Path, name: str, command: str) -> dict[str, Any]:
    before = state["eval_before"]
    sides = {}
    for label in SIDES:
        if label in state:
            after = state.get(f"eval_{label}")
            sides[label] = side_summary(state[label], before, after, (after or {}).get("gain_official"))
    trl = state.get("trl") or {}
    record: dict[str, Any] = {
        "command": command,
        "sides": sides,
        "goal": goal(sides, state["sft"].get("steps")),
        "settings": {
            "recipe": state["sft"].get("config"),
            "steps": state["sft"].get("steps"),
            "overrides": state["sft"].get("overrides"),
            "heldout_queries": before["official"]["queries"],
            "trl_grpo_config": trl.get("grpo"),
            "trl_episode": trl.get("episode"),
            "mismatches": trl.get("mismatches"),
            "step": "one batch of rl.batch_prompts × rl.group_size rollouts trained",
            "trl_vllm": "TRL 1.16.0 accepts vLLM 0.22.0-0.31.0 (trl/import_utils.py is_vllm_available), so the GPU "
            "run pairs it with vLLM 0.26.0, the version our GPU path runs, in vllm_mode='colocate' (TRL's one-GPU "
            "mode); on CPU TRL generates with transformers",
        },
        "versions": {"trl_side": trl.get("versions"), "ours": (state.get("ours") or {}).get("versions") or versions()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    (out / f"{name}.md").write_text(markdown(record))
    plot(sides, state, out / f"{name}.png")
    return record


def goal(sides: dict[str, Any], steps_asked: int | None) -> dict[str, Any] | None:
    """The issue's goal: ours ≥ 2× TRL's RL steps per hour, held-out success ≥ TRL's − 5 points, met only when
    both sides ran every step asked (a side stopped by --side-minutes compares less training)."""
    if set(sides) != set(SIDES):
        return None
    ours, trl = sides["ours"], sides["trl"]
    ratio = ours["steps_per_hour"] / trl["steps_per_hour"] if trl["steps_per_hour"] else None
    gap = (
        ours["heldout_success_after"] - trl["heldout_success_after"]
        if None not in (ours["heldout_success_after"], trl["heldout_success_after"])
        else None
    )
    short = [label for label in SIDES if steps_asked and sides[label]["steps"] < steps_asked]
    return {
        "steps_per_hour_ratio": ratio,
        "success_gap_points": None if gap is None else 100 * gap,
        "steps_asked": steps_asked,
        "sides_short_of_steps": short,
        "met": ratio is not None and gap is not None and ratio >= 2.0 and gap >= -0.05 and not short,
    }


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "transformers", "vllm", "deepspeed"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def markdown(record: dict[str, Any]) -> str:
    def fmt(v: Any, spec: str = ".2f") -> str:
        return "—" if v is None else format(v, spec)

    lines = ["# Peer trainer: TRL's GRPOTrainer beside `star train`", "", f"`{record['command']}`", ""]
    lines += ["| | ours | TRL |", "|---|---|---|"]
    sides = record["sides"]
    rows = (
        ("steps", "steps", "d"),
        ("RL steps per hour", "steps_per_hour", ".1f"),
        ("RL steps per hour (steady, 3600 / median)", "steps_per_hour_steady", ".1f"),
        ("step wall time, median (s)", "step_s_median", ".1f"),
        ("trajectory tokens / s", "trajectory_tokens_per_s", ".0f"),
        ("GPU memory peak (GiB)", "gpu_memory_peak_gib", ".1f"),
        ("held-out success before", "heldout_success_before", ".3f"),
        ("held-out success after", "heldout_success_after", ".3f"),
    )
    for label, key, spec in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(sides.get(s, {}).get(key), spec) for s in SIDES) + " |")
    for s in SIDES:
        heldout = (sides.get(s) or {}).get("heldout") or {}
        for when in ("before", "after"):
            for mode in ("official", "strict"):
                e = ((heldout.get(when) or {}).get(mode)) or {}
                if e.get("ci"):
                    lines.append(f"- {s} {when}, {mode}: {e['success']:.3f}, CI [{e['ci'][0]:.3f}, {e['ci'][1]:.3f}]")
    g = record.get("goal")
    if g:
        lines += ["", f"Goal (ours ≥ 2× TRL's steps per hour, success ≥ TRL's − 5 points): ratio "
                  f"{fmt(g['steps_per_hour_ratio'])}×, gap {fmt(g['success_gap_points'], '+.1f')} points: "
                  f"{'met' if g['met'] else 'not met'}."]  # fmt: skip
        for label in g.get("sides_short_of_steps") or []:
            lines.append(f"{label} ran {sides[label]['steps']} of the {g['steps_asked']} steps asked within its time "
                         "cap (--side-minutes): its figures are for less training than the other side's.")  # fmt: skip
    lines += ["", "## Settings TRL cannot match", ""] + [f"- {m}" for m in record["settings"].get("mismatches") or []]
    return "\n".join(lines) + "\n"


def plot(sides: dict[str, Any], state: dict[str, Any], path: Path) -> None:
    """Two panels against each side's RL wall-clock time: held-out success (the shared start, then each side's RL
    model at the end of its training, with its CI) and the training reward of each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (success, reward) = plt.subplots(1, 2, figsize=(11, 4))
    for label, side in sides.items():
        after = (side["heldout"].get("after") or {}).get("official") or {}
        before = side["heldout"]["before"]["official"]
        xs = [0.0, side["train_s"] / 60]
        ys = [before["success"], after.get("success")]
        name = f"{label} ({side['steps']} steps)"
        (line,) = success.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=name)
        if after.get("ci"):
            success.errorbar(
                xs[1],
                after["success"],
                yerr=[[after["success"] - after["ci"][0]], [after["ci"][1] - after["success"]]],
                capsize=4,
                color=line.get_color(),
            )
        curve = [c for c in side["curve"] if c.get("reward") is not None]
        reward.plot([c["wall_s"] / 60 for c in curve], [c["reward"] for c in curve], marker=".", label=name,
                    color=line.get_color())  # fmt: skip
    success.set(xlabel="RL wall-clock time (min)", ylabel="held-out success (official)", title="held-out success")
    success.set_ylim(bottom=0)
    success.legend()
    reward.set(xlabel="RL wall-clock time (min)", ylabel="mean reward of the step's rollouts", title="training reward")
    reward.set_ylim(bottom=0)
    reward.legend()
    fig.suptitle("ours vs TRL GRPOTrainer, the same work on one machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------------------


def python_command(given: Path) -> Path | None:
    """`--trl-python` as a file, or as a command found on PATH (the GPU job passes `python3`); None when neither."""
    if given.is_file():
        return given
    found = shutil.which(str(given)) if len(given.parts) == 1 else None
    return Path(found) if found else None


# What bench/peer_trl_side.py imports in TRL's Python (vllm only where a GPU is: TRL's colocated generation);
# `trl:GRPOTrainer` loads the trainer's own imports (pandas through datasets, accelerate), which `import trl` defers
TRL_SIDE_IMPORTS = ("torch", "transformers", "datasets", "accelerate", "httpx", "pydantic", "trl:GRPOTrainer")
TRL_SIDE_PROBE = """
import importlib, json, sys
failed = {}
for spec in sys.argv[1:]:
    module, _, name = spec.partition(":")
    try:
        loaded = importlib.import_module(module)
        if name:
            getattr(loaded, name)
    except Exception as exc:
        failed[spec] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps(failed))
"""


def trl_side_failures(python: Path, gpu: bool) -> dict[str, str]:
    """What the TRL side needs that `python` cannot import, with the reason (checked before any phase runs, so a
    broken environment fails in seconds rather than after our side's training)."""
    imports = [*TRL_SIDE_IMPORTS, *(["vllm"] if gpu else [])]
    proc = subprocess.run([str(python), "-c", TRL_SIDE_PROBE, *imports], capture_output=True, text=True, timeout=300)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {str(python): f"did not run the import check (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-proof.yaml")
    ap.add_argument("--work", type=Path, default=Path("/tmp/star-peer"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where peer_trl.{json,md,png} go")
    ap.add_argument("--name", default="peer_trl")
    ap.add_argument("--steps", type=int, default=40, help="RL steps on each side")
    ap.add_argument("--heldout", type=int, default=100, help="held-out queries evaluated")
    ap.add_argument("--side-minutes", type=float, default=None, help="cap on each side's RL time (0: none)")
    ap.add_argument("--gguf", type=Path, default=None, help="the SmolLM2 GGUF to convert (the GPU job)")
    ap.add_argument("--sft-checkpoint", default=None, help="reuse this SFT model (skips the sft stage's training)")
    ap.add_argument("--trl-python", type=Path, default=ROOT / ".venv-trl" / "bin" / "python")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a recipe field")
    ap.add_argument("--phases", default=",".join(PHASES))
    args = ap.parse_args()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        ap.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    if args.steps < 1 or args.heldout < 1:
        ap.error("--steps and --heldout must be at least 1")
    if args.side_minutes is not None and args.side_minutes < 0:
        ap.error(f"--side-minutes must be 0 (no cap) or more, not {args.side_minutes:g}")
    if "trl" in phases:
        found = python_command(args.trl_python)
        if found is None:
            ap.error(
                f"no TRL Python at {args.trl_python} (neither a file nor a command on PATH): "
                "scripts/install-adapters trl makes .venv-trl, or pass --trl-python"
            )
        args.trl_python = found
        failures = trl_side_failures(found, gpu=gpu_machine())
        if failures:
            ap.error(
                f"the TRL Python {found} cannot import what the TRL side needs: "
                + "; ".join(f"{k} ({v})" for k, v in failures.items())
                + ". scripts/install-adapters trl makes .venv-trl; on a GPU machine pack PEER_PACKAGES"
            )
    if not args.config.is_file():
        ap.error(f"no recipe at {args.config}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # several processes share one GPU (bench/gpu_proof.py): segments that shrink give their memory back
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.setdefault("STAR_HOME", str(args.work / "home"))
    args.work.mkdir(parents=True, exist_ok=True)
    run = args.work / "run"
    state = State(args.work)
    command = "python bench/peer_trl.py " + " ".join(sys.argv[1:])
    base = yaml.safe_load(args.config.read_text())
    batch = int((base.get("rl") or {}).get("batch_prompts") or 1)
    overrides = [*args.set, f"rl.max_steps={args.steps}", f"rl.samples_per_step={batch}", "rl.val_every=0",
                 f"eval.limit={args.heldout}"]  # fmt: skip
    if args.side_minutes:
        overrides.append(f"rl.max_minutes={args.side_minutes:g}")
    if args.sft_checkpoint:
        overrides.append(f"model.path={args.sft_checkpoint}")
    for phase in phases:
        if phase != "report" and state.done(phase):
            log(f"{phase}: done earlier")
            continue
        t0 = time.perf_counter()
        log(f"── {phase}")
        if phase == "convert":
            if args.gguf is None:
                result = {"skipped": "no --gguf: the recipe's model is used as it is"}
            else:
                result = convert_gguf(args.gguf, Path(base["model"]["path"]))
        elif phase == "sft":
            stages = ["--stage", "synth"] + ([] if args.sft_checkpoint else ["--stage", "sft"])
            star("train", str(args.config), "--run-dir", str(run), *stages, *sum((["--set", o] for o in overrides), []),
                 log_file=args.work / "logs" / "sft.log")  # fmt: skip
            model = args.sft_checkpoint or stage_outputs(run, "sft")["model"]
            result = {"model": model, "config": str(args.config), "steps": args.steps, "overrides": overrides}
        elif phase.startswith("eval_"):
            cfg, synth = recipe(run), stage_outputs(run, "synth")
            split = synth.get("heldout_queries") or synth["val_queries"]
            source = state.data["sft" if phase == "eval_before" else phase.removeprefix("eval_")]["model"]
            result = evaluate(source, cfg, run, split, args.heldout, args.work / phase)
            if phase != "eval_before":
                result["gain_official"] = paired_gain(state.data["eval_before"], result, args.work / phase)
        elif phase == "ours":
            result = our_side(args.config, run, overrides)
        elif phase == "trl":
            order = state.data["ours"]["order"] if "ours" in state.data else []
            result = trl_side(args, recipe(run), run, state.data["sft"]["model"], order, args.work / "trl")
        else:
            result = report(state.data, args.out, args.name, command)
            log(f"record: {args.out / args.name}.json (goal {result['goal']})")
        if phase != "report":
            result["phase_s"] = time.perf_counter() - t0
            state.save(phase, result)
        log(f"{phase}: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
