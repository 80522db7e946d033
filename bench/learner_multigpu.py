"""Learner on several GPUs: our RL step under ZeRO-3 against plain DeepSpeed ZeRO-3 on HF's model with
HF's loss, same ranks, same run.

    torchrun --nproc_per_node 2 bench/learner_multigpu.py                 # Qwen2.5-1.5B shape, 16K tokens
    python bench/learner_multigpu.py --nproc 2                            # the same, launching torchrun itself
    python bench/learner_multigpu.py --nproc 2 --shape tiny --seq 256 --device cpu --steps 2 --warmup 1 \\
        --name learner_multigpu_cpu_smoke                                  # the script end to end on CPU (gloo)

Both sides: random-init weights of the shape, one sequence of `--seq` tokens per rank per step, ZeRO-3 over
the ranks (parameters built sharded under deepspeed.zero.Init), bf16 with fp32 gradient accumulation,
overlap_comm, AdamW; median over the timed steps. Gradients are reduced in fp32 by ours (`--grad-reduce`) and
in bf16 by the baseline (DeepSpeed's default).

- ours: services.learner's PolicyEngine and rl_step (the clipped policy loss on rollout logprobs): the
  vocabulary head is fused with the log-prob (services/learner/vocab_head.py) and runs in chunks of
  `--chunk` tokens, so the 16K × 152K logits never exist at once; `--recompute` picks none, mlp (selective: each
  layer's MLP recomputed in backward, attention kept) or layers (full gradient checkpointing); auto,
  the default, takes the first of these that fits in memory (each attempt recorded).
- baseline: HF Qwen2ForCausalLM (the same shape, random init) with `labels=ids` (HF's cross-entropy over the full
  logits) under a plain DeepSpeed ZeRO-3 engine, as ../shared/tools/deepspeed_zero3_probe.py; without gradient
  checkpointing first, and where that runs out of memory again with it (both attempts recorded).

MFU (services/learner/flops.py): PaLM count (6·N + 12·L·d·s per token) and causal-half beside it,
against the card's dense bf16 peak. Targets (issue 33): ours ≥ 1.1× the baseline's tokens/s and
≥ 50 % MFU (PaLM) within 80 GB. Results: bench/results/<name>.json (rank 0 writes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_shapes import SHAPES, qwen2_config  # noqa: E402


RECOMPUTE = ("none", "mlp", "layers")


def _recompute_order(text: str) -> tuple[str, ...]:
    """`--recompute`: the recomputation modes to try, in order, until one fits in memory."""
    order = RECOMPUTE if text == "auto" else tuple(t.strip() for t in text.split(","))
    bad = [t for t in order if t not in RECOMPUTE]
    if bad or not order:
        raise argparse.ArgumentTypeError(f"{text!r}: give auto or a comma-separated list of {', '.join(RECOMPUTE)}")
    return order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--seq", type=int, default=16384, help="tokens per sequence, one sequence per rank and step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--recompute", type=_recompute_order, default="auto",
                    help="none, mlp or layers, or several tried in order until one fits (e.g. mlp,layers); auto: "
                         "none,mlp,layers (every attempt recorded)")
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per chunk of the vocabulary head")
    ap.add_argument("--head-kernels", choices=["auto", "compiled", "eager"], default="auto",
                    help="the fused vocabulary head's element-wise work (auto: compiled on GPU)")
    ap.add_argument("--grad-reduce", choices=["fp32", "bf16"], default="fp32",
                    help="ours: the gradient reduction's dtype, accumulation staying fp32 (fp32: the learner's default)")
    ap.add_argument("--fuse-pointwise", choices=["auto", "on", "off"], default="auto",
                    help="ours: RMSNorm, rotary and SwiGLU as compiled functions (services/learner/pointwise.py); "
                         "auto: on GPU")
    ap.add_argument("--layer-units", choices=["on", "off"], default="on",
                    help="ours: each decoder layer one ZeRO-3 unit (DeepSpeed leaf module; EngineConfig.zero3_layer_units)")
    ap.add_argument("--persist-gib", type=float, default=None,
                    help="ours: GiB per rank of weights ZeRO-3 keeps whole (EngineConfig.persistent_weights_gib; "
                         "default: the learner's; 0: shard all)")
    ap.add_argument("--nccl-proto", default=None, help="ours: NCCL_PROTO (EngineConfig.nccl_protocol; default: the "
                    "learner's; 'nccl': NCCL's own choice). The baseline keeps NCCL's choice.")
    ap.add_argument("--reduce-bucket", type=float, default=50, help="ours: ZeRO reduce bucket, millions of elements")
    ap.add_argument("--sdpa", default="cudnn+flash", help="SDPA kernel order on GPU ('default': PyTorch's)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (ours)")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--profile", action="store_true", help="profile one more step of ours (bench/results/<name>_profile.txt)")
    ap.add_argument("--baseline-checkpointing", choices=["auto", "off", "on"], default="auto",
                    help="auto: without, then with gradient checkpointing on OOM (in the same processes)")
    ap.add_argument("--skip-ours", action="store_true", help="measure the baseline alone (in processes of its own, "
                    "so nothing of ours holds memory) and complete the record ours left under --name")
    ap.add_argument("--nproc", type=int, default=None, help="not under torchrun: launch this many ranks under it")
    ap.add_argument("--name", default="learner_multigpu", help="results file stem under bench/results/")
    ap.add_argument("--plot", nargs="+", metavar="LABEL=JSON", default=None,
                    help="draw bench/results/<name>.png and exit: the first record with its baseline, then other runs "
                         "of ours from the same machine, each labelled")
    ap.add_argument("--workdir", default=None, help="where the random-init model is written (default: a temp dir)")
    return ap.parse_args(argv)


def launched() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def relaunch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script under torchrun with --nproc ranks (the wrapper form of the single command)."""
    from services.learner.engine import free_port

    rest = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")
            and not a.startswith("--nproc=")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(Path(__file__).resolve()), *rest]
    return subprocess.call(cmd)


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def setup(args: argparse.Namespace) -> tuple[int, int, bool]:
    import torch

    on_gpu = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
    if not on_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the engine picks gloo and fp32 on a machine without CUDA
    import deepspeed

    if on_gpu and not args.skip_ours:
        # NCCL reads its protocol when the first collective makes a communicator, so ours sets it here;
        # a baseline in these processes shares it (recorded), one run with --skip-ours keeps NCCL's choice
        from services.learner.config import EngineConfig
        from services.learner.nccl_env import set_learner_protocol

        set_learner_protocol(EngineConfig(**engine_options(args)).nccl_protocol)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), on_gpu


def build_model(args: argparse.Namespace, folder: Path, rank: int, on_gpu: bool) -> Path:
    """Rank 0 writes the random-init model once; the others wait for it."""
    import torch
    from transformers import Qwen2ForCausalLM

    if rank == 0 and not (folder / "config.json").is_file():
        config = qwen2_config(args.shape, max(32768, args.seq))
        torch.manual_seed(0)
        with torch.device("cuda" if on_gpu else "cpu"):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16 if on_gpu else torch.float32)
        model.save_pretrained(folder, safe_serialization=True)
        del model
    torch.distributed.barrier()
    return folder


def host_facts(on_gpu: bool) -> dict:
    """What differs between machines of one kind and moves a host-bound step: the CPU model, the GPUs'
    clocks and power limit (nvidia-smi), NCCL settings from the environment."""
    facts: dict = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                   "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if on_gpu:
        query = "clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu,pstate"
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20)
            facts["gpus"] = [dict(zip(query.split(","), (v.strip() for v in line.split(","))))
                             for line in done.stdout.strip().splitlines()]
        except (OSError, subprocess.SubprocessError):
            pass
    return facts


def peak_gib(on_gpu: bool) -> float | None:
    """The largest per-rank peak of allocated GPU memory (None on CPU)."""
    import torch

    if not on_gpu:
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return round(float(peak.item()), 2)


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def release(on_gpu: bool) -> None:
    import torch

    gc.collect()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def summary(step_s: list[float], tokens: int, flops: float, flops_half: float, world: int, peak: float | None,
            mem: float | None) -> dict:
    s = statistics.median(step_s)
    return {"step_s": round(s, 4), "tokens_per_s": round(tokens / s, 1),
            "mfu": round(flops / s / (peak * world), 4) if peak else None,
            "mfu_causal_half": round(flops_half / s / (peak * world), 4) if peak else None,
            "peak_gib": mem, "steps_s": [round(x, 4) for x in step_s]}


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the options given on the command line (the rest stay the learner's)."""
    out: dict = {}
    if args.persist_gib is not None:
        out["persistent_weights_gib"] = args.persist_gib
    if args.nccl_proto is not None:
        out["nccl_protocol"] = None if args.nccl_proto == "nccl" else args.nccl_proto
    return out


def run_ours(args: argparse.Namespace, model_dir: Path, rank: int, world: int, on_gpu: bool,
             recompute: str) -> dict:
    from bench.learner_gpu import sequences
    from services.learner.config import EngineConfig, ScheduleConfig
    from services.learner.engine import PolicyEngine
    from services.learner.flops import model_shape, peak_flops, train_flops
    from services.learner.steps import rl_step

    cfg = EngineConfig(zero_stage=3, precision="auto", micro_batch_tokens=args.seq, micro_batch_rows=1,
                       pad_to_multiple=256 if on_gpu else 1, logprob_chunk_tokens=args.chunk, head_kernels=args.head_kernels,
                       gradient_checkpointing=recompute == "layers", recompute_mlp=recompute == "mlp",
                       attn_implementation="sdpa", sdpa_backends=None if args.sdpa == "default" else
                       args.sdpa.split("+"), compile_layers=args.compile, zero_init=True, grad_reduce_dtype=args.grad_reduce,
                       fuse_pointwise={"on": True, "off": False}.get(args.fuse_pointwise),
                       overlap_comm=on_gpu, reduce_bucket_size=int(args.reduce_bucket * 1e6),
                       zero3_layer_units=args.layer_units == "on", **engine_options(args))
    engine = PolicyEngine(model_dir, cfg, ScheduleConfig(lr=2e-6), total_steps=100)
    n_params = engine.num_parameters()
    layers, width = model_shape(engine.lm_config)
    log(rank, f"ours: {n_params / 1e9:.3f} B params, {world} ranks, ZeRO-3, bf16={engine.bf16}, "
              f"recompute={recompute}")
    times = []
    try:
        for k in range(args.warmup + args.steps):
            # one sequence per rank: rl_step hands each rank its rows
            seqs = sequences(world, args.seq, seed=k, vocab=engine.lm_config.vocab_size)
            m = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28).metrics
            log(rank, f"ours step {k}: {m['time_compute_s']:.3f} s, {m['tokens_per_s']:.0f} tok/s, "
                      f"mfu {m.get('mfu', float('nan')):.3f}, loss {m['loss']:.4f}")
            if k >= args.warmup:
                times.append(m["time_compute_s"])
        if args.profile:
            profile_step(engine, world, args, rank, on_gpu)
        tokens = world * args.seq
        flops = train_flops(n_params, layers, width, [args.seq] * world)
        half = train_flops(n_params, layers, width, [args.seq] * world, causal_half=True)
        out = summary(times, tokens, flops, half, world, peak_flops() if on_gpu else None, peak_gib(on_gpu))
        return {"params": n_params, "recompute": recompute, "chunk": args.chunk, "head_kernels": args.head_kernels,
                "grad_reduce": args.grad_reduce, "compile_layers": args.compile,
                "fuse_pointwise": args.fuse_pointwise, "reduce_bucket_m": args.reduce_bucket,
                "layer_units": args.layer_units, "persistent_weights_gib": cfg.persistent_weights_gib,
                "nccl_proto": os.environ.get("NCCL_PROTO"), **out}
    finally:
        engine.close()
        del engine
        release(on_gpu)


def profile_step(engine, world: int, args: argparse.Namespace, rank: int, on_gpu: bool) -> None:
    """One more step of ours under torch.profiler: where its time goes, by operator (rank 0's view),
    written to bench/results/<name>_profile.txt."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.learner_gpu import sequences
    from services.learner.steps import rl_step

    seqs = sequences(world, args.seq, seed=10_000, vocab=engine.lm_config.vocab_size)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        seconds = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28).metrics["time_compute_s"]
    if rank == 0:
        key = "cuda_time_total" if on_gpu else "cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70)
        path = ROOT / "bench" / "results" / f"{args.name}_profile.txt"
        path.write_text(f"# one step of ours under torch.profiler ({seconds:.3f} s with the profiler on), "
                        f"shape {args.shape}, seq {args.seq}, {world} ranks, sorted by {key}\n\n{table}\n")
        log(rank, f"profile: {path}")


def run_baseline(args: argparse.Namespace, model_dir: Path, rank: int, world: int, on_gpu: bool,
                 checkpointing: bool) -> dict:
    """Plain DeepSpeed ZeRO-3: HF's model and HF's loss (full logits), as the probe in ../shared/tools."""
    import deepspeed
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    from services.learner.flops import model_shape, peak_flops, train_flops

    bf16 = on_gpu
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": bf16},
              "zero_optimization": {"stage": 3, "overlap_comm": on_gpu, "contiguous_gradients": True,
                                    "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5},
              "optimizer": {"type": "AdamW", "params": {"lr": 2e-6, "torch_adam": True, "adam_w_mode": True}},
              "steps_per_print": 10**9}
    if bf16:
        ds_cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    config = AutoConfig.from_pretrained(model_dir, attn_implementation="sdpa")
    # Built as the probe builds it: random init, each parameter partitioned as it is created. (Loaded
    # through from_pretrained instead, the first step's full fp32 logits ran out of memory on 80 GB.)
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg, dtype=torch.bfloat16 if bf16 else torch.float32):
        model = Qwen2ForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    device = engine.device
    g = torch.Generator(device="cpu").manual_seed(rank)
    times = []
    log(rank, f"baseline: HF model + HF loss, ZeRO-3, checkpointing={checkpointing}")
    try:
        for k in range(args.warmup + args.steps):
            ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=g).to(device)
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            if on_gpu:
                torch.cuda.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(dt, op=torch.distributed.ReduceOp.MAX)  # the slowest rank's step
            log(rank, f"baseline step {k}: {dt.item():.3f} s, loss {loss.item():.4f}")
            if k >= args.warmup:
                times.append(float(dt.item()))
        layers, width = model_shape(config)
        flops = train_flops(n_params, layers, width, [args.seq] * world)
        half = train_flops(n_params, layers, width, [args.seq] * world, causal_half=True)
        out = summary(times, world * args.seq, flops, half, world, peak_flops() if on_gpu else None,
                      peak_gib(on_gpu))
        return {"params": n_params, "gradient_checkpointing": checkpointing,
                "nccl_proto": os.environ.get("NCCL_PROTO"), **out}
    finally:
        engine.destroy()
        del engine, model
        release(on_gpu)


def attempt(fn, *a, **kw) -> dict:
    """Run a side; an out-of-memory is recorded, not fatal (the ranks run the same shapes, so they run
    out together)."""
    error = None
    try:
        result = fn(*a, **kw)
    except Exception as exc:
        if not is_oom(exc):
            raise
        error, result = f"OOM: {str(exc)[:200]}", {}
    return {"oom": True, "error": error} if error else result


def plot_runs(items: list[str], path: Path) -> None:
    """Tokens/s of each run of ours (LABEL=JSON) and of the first record's baseline, MFU written on each
    bar, with the tokens/s that 50 % MFU takes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for item in items:
        label, _, file = item.partition("=")
        if not file:
            raise SystemExit(f"--plot {item!r}: give LABEL=JSON")
        runs.append((label, json.loads(Path(file).read_text())))
    first = runs[0][1]
    bars = [(label, r["tokens_per_s"], r["mfu"]) for label, r in runs]
    if first.get("baseline"):
        base = first["baseline"]
        bars.append(("plain ZeRO-3 (HF model + loss" + (", checkpointing)" if base.get("gradient_checkpointing")
                     else ")"), base["tokens_per_s"], base["mfu"]))
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(bars) + 1.4))
    ys = list(range(len(bars)))[::-1]
    ax.barh(ys, [b[1] for b in bars], color=["tab:blue"] * len(runs) + ["tab:gray"] * (len(bars) - len(runs)))
    for y, (_, tps, mfu) in zip(ys, bars):
        ax.text(tps, y, f" {tps / 1000:.1f}K, {100 * mfu:.1f} %", va="center", fontsize=8)
    ax.axvline(first["tokens_per_s"] * 0.5 / first["mfu"], color="tab:red", ls="--", lw=1, label="50 % MFU (PaLM)")
    ax.set_yticks(ys, [b[0] for b in bars], fontsize=8)
    ax.set_xlabel("tokens/s, both ranks")
    ax.set_xlim(0, max(b[1] for b in bars) * 1.3)
    ax.set_title(f"Learner, {first['shape']} shape, ZeRO-3, {first['seq']:,} tokens a rank\n"
                 f"{first['world_size']}× {first['device']}, one job", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.plot:
        path = ROOT / "bench" / "results" / f"{args.name}.png"
        plot_runs(args.plot, path)
        print(f"wrote {path}")
        return 0
    if not launched():
        if args.nproc:
            return relaunch(args, argv)
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
        from services.learner.engine import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    rank, world, on_gpu = setup(args)
    import tempfile

    import torch

    work = Path(args.workdir or tempfile.gettempdir()) / f"star-learner-multigpu-{args.shape}"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(args, work / "model", rank, on_gpu)
    ours: dict = {}
    ours_attempts = []
    out = ROOT / "bench" / "results" / f"{args.name}.json"
    kept = ("params", "mfu", "mfu_causal_half", "tokens_per_s", "peak_gib", "step_s", "recompute", "chunk", "head_kernels",
            "grad_reduce", "compile_layers", "fuse_pointwise", "reduce_bucket_m", "layer_units",
            "persistent_weights_gib", "nccl_proto")
    prev: dict = {}
    if args.skip_ours:
        prev = json.loads(out.read_text())
        ours, ours_attempts = {k: prev.get(k) for k in kept}, prev.get("attempts", [])
    for recompute in (() if args.skip_ours else args.recompute):
        result = attempt(run_ours, args, model_dir, rank, world, on_gpu, recompute)
        ours_attempts.append({"recompute": recompute, **result})
        if not result.get("oom"):
            ours = result
            break
    baseline: dict = {}
    attempts = []
    if not args.skip_baseline:
        choice = {"auto": (False, True), "off": (False,), "on": (True,)}[args.baseline_checkpointing]
        for checkpointing in choice:
            result = attempt(run_baseline, args, model_dir, rank, world, on_gpu, checkpointing)
            attempts.append({"gradient_checkpointing": checkpointing, **result})
            if not result.get("oom"):
                baseline = result
                break
    if rank == 0:
        device = torch.cuda.get_device_name(0) if on_gpu else f"cpu ({platform.processor() or platform.machine()})"
        common = {"device": device, "world_size": world, "zero_stage": 3, "seq": args.seq}
        this_command = f"torchrun --nproc_per_node {world} bench/learner_multigpu.py {' '.join(argv)}"
        host = host_facts(on_gpu)
        record = {**common, "shape": args.shape, **{k: ours.get(k) for k in kept},
                  "baseline": {**common, **baseline} if baseline else None,
                  "attempts": ours_attempts,
                  "baseline_attempts": attempts,
                  "speedup_tokens_per_s": (round(ours["tokens_per_s"] / baseline["tokens_per_s"], 3)
                                           if baseline and ours.get("tokens_per_s") else None),
                  "targets": {"speedup_min": 1.1, "mfu_min": 0.5, "peak_gib_max": 80},
                  # each side's own command where they ran apart (--skip-baseline, then --skip-ours)
                  "command": prev.get("command") or this_command,
                  "baseline_command": this_command if baseline else None,
                  "host": host, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps({k: record[k] for k in ("device", "world_size", "tokens_per_s", "mfu", "peak_gib",
                                                 "speedup_tokens_per_s")}), flush=True)
        print(f"wrote {out}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
