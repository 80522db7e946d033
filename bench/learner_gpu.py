"""Learner GPU benchmark: RL training throughput (tokens/s, MFU) and weight publish + reload time.

    python bench/learner_gpu.py                       # ~0.5B Qwen2 (Qwen2.5-0.5B shape), 8K-token sequences
    python bench/learner_gpu.py --compile --micro-rows 1,2,4 --profile     # rows per forward/backward
    python bench/learner_gpu.py --size tiny --seq 128 --steps 2 --name learner_gpu_cpu_smoke   # CPU check

What runs: our DeepSpeed engine (ZeRO-2, bf16 on GPU) doing the real RL step (clipped policy
loss with rollout logprobs, token-mean) on random-init weights and random tokens, once per
variant (SDPA kernel order × rows per micro-batch × ZeRO bucket size; a variant that runs out of
memory is recorded as OOM and the run goes on); against a baseline measured in the same run at
the best variant's rows per micro-batch: a plain PyTorch step (HF model, bf16 autocast, its own
cross-entropy, fused AdamW). Then weight sync on the store path: gather full weights bucket by
bucket, write sharded safetensors + manifest, and reload into a live bf16 model the way a
rollout server does (verify hashes, copy in place). With 2+ GPUs the NCCL broadcast path is
timed too. Targets (issue 5): MFU ≥ 40 %, publish + reload ≤ 1 s. MFU is reported in both
conventions of services/learner/flops.py (PaLM: attention in full; and causal attention at half).

Results: bench/results/<name>.json and .md (default name learner_gpu).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SIZES = {
    # Qwen2.5-0.5B's shape: 494 M parameters with the tied 151,936-token embedding.
    "0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    # SmolLM2-135M's shape (its own 49,152-token vocabulary): the policy of the GPU learning proof.
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    ),
    "tiny": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    ),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(size: str, folder: Path, seq: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = {"vocab_size": 151936, **SIZES[size]}
    config = Qwen2Config(
        max_position_embeddings=max(32768, seq),
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        bos_token_id=0,
        eos_token_id=1,
        **shape,
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def sequences(n: int, seq: int, seed: int, seq_min: int | None = None, vocab: int = 151936):
    """`n` random trajectories of `seq` tokens, or of lengths drawn from [seq_min, seq] (as RL and
    SFT batches are: every step brings new lengths)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = seq if not seq_min else int(torch.randint(seq_min, seq + 1, (), generator=g))
        out.append(_trajectory(i, length, g, vocab))
    return out


def _trajectory(i: int, seq: int, g: torch.Generator, vocab: int):
    from services.learner.batching import Sequence_

    prompt = min(512, seq // 8)
    ids = torch.randint(0, vocab - 900, (seq,), generator=g).tolist()
    mask = [0] * prompt + [1] * (seq - prompt)
    # behaviour logprobs near a random policy's (-log V, ≈ -11.9 for Qwen's vocabulary): ratios near 1, some clipped
    near = torch.full((seq - prompt,), -math.log(vocab)) + 0.05 * torch.randn(seq - prompt, generator=g)
    return Sequence_(ids, mask, [None] * prompt + near.tolist(), advantage=1.0 if i % 2 == 0 else -1.0, index=i)


def parse_sdpa(spec: str) -> list[str] | None:
    """'default' → PyTorch's own order; 'cudnn+flash' → that priority list."""
    return None if spec == "default" else spec.split("+")


@dataclass(frozen=True)
class Variant:
    sdpa: str  # SDPA kernel order ('default' or e.g. 'cudnn+flash')
    micro_rows: int  # packed rows per forward/backward
    bucket_m: float  # ZeRO reduce / all-gather bucket, millions of elements
    pad: int = 1  # each pass's length rounded up to a multiple of this

    @property
    def label(self) -> str:
        padding = f", lengths padded to ×{self.pad}" if self.pad > 1 else ""
        return f"SDPA `{self.sdpa}`, {self.micro_rows} row(s)/micro-batch, buckets {self.bucket_m:g}M{padding}"


def variants(args) -> list[Variant]:
    return [
        Variant(sdpa, int(rows), float(bucket), int(pad))
        for sdpa, rows, bucket, pad in itertools.product(
            args.sdpa_variants.split(","),
            args.micro_rows.split(","),
            args.reduce_bucket_m.split(","),
            args.pad_multiple.split(","),
        )
    ]


def is_oom(e: BaseException) -> bool:
    # cuDNN / cuBLAS report a failed allocation as a plain RuntimeError
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def free_memory() -> None:
    """Between variants: drop what the last one left, and dynamo's compiled graphs, so that the next
    variant compiles for its own shapes instead of recompiling the shared layer code with dynamic
    (slower) shapes after a batch-size change."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median(steps: list[dict], key: str) -> float | None:
    return statistics.median(s[key] for s in steps) if key in steps[0] else None


def bench_engine(args, model_dir: Path, variant: Variant, profile: bool = False) -> tuple[dict, object]:
    from services.learner.config import EngineConfig, ScheduleConfig
    from services.learner.engine import PolicyEngine

    bucket = int(variant.bucket_m * 1e6)
    cfg = EngineConfig(
        zero_stage=args.zero,
        precision="auto",
        gradient_checkpointing=args.grad_ckpt,
        micro_batch_tokens=args.seq,
        micro_batch_rows=variant.micro_rows,
        pad_to_multiple=variant.pad,
        logprob_chunk_tokens=args.chunk,
        head_kernels=args.head_kernels,
        attn_implementation="sdpa",
        compile_layers=args.compile,
        sdpa_backends=parse_sdpa(variant.sdpa),
        reduce_bucket_size=bucket,
        allgather_bucket_size=bucket,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    engine = PolicyEngine(model_dir, cfg, ScheduleConfig(lr=2e-6), total_steps=100)
    log(
        f"engine up ({variant.label}): {engine.num_parameters() / 1e6:.1f} M params, bf16={engine.bf16}, "
        f"zero={args.zero}"
    )
    try:
        result = measure_engine(args, engine, variant, profile)
    except BaseException:
        engine.close()  # its hooks and buffers would otherwise keep the memory the next variant needs
        raise
    return result, engine


def measure_engine(args, engine, variant: Variant, profile: bool) -> dict:
    from services.learner.steps import rl_step

    steps = []
    for k in range(args.warmup + args.steps):
        seqs = sequences(args.rows, args.seq, seed=k, seq_min=args.seq_min, vocab=engine.lm_config.vocab_size)
        m = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28).metrics
        log(
            f"rl step {k} ({variant.label}): {m['time_compute_s']:.3f} s, {m['tokens_per_s']:.0f} tok/s, "
            f"mfu {m.get('mfu', float('nan')):.3f} (causal half {m.get('mfu_causal_half', float('nan')):.3f}), "
            f"loss {m['loss']:.4f}, clip {m['clip_fraction']:.3f}"
        )
        if k >= args.warmup:
            steps.append(m)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    kernels = profile_step(engine, args) if profile else None
    return {
        **asdict(variant),
        "label": variant.label,
        "kernels": kernels,
        "params_m": engine.num_parameters() / 1e6,
        "tokens_per_step": median(steps, "tokens"),
        "step_s_median": median(steps, "time_compute_s"),
        "tokens_per_s": median(steps, "tokens_per_s"),
        "tflops_per_s": median(steps, "tflops_per_s"),
        "mfu": median(steps, "mfu"),
        "mfu_causal_half": median(steps, "mfu_causal_half"),
        "peak_memory_gib": peak_mem,
        "steps": [
            {k: s[k] for k in ("time_compute_s", "tokens_per_s", "loss", "clip_fraction", "grad_norm")} for s in steps
        ],
    }


KERNEL_KINDS = (  # first match wins; names as CUDA kernels are called on Hopper with torch 2.11
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copies", ("memcpy", "memset", "copy_", "fill")),
    ("fused elementwise / reductions", ("triton", "elementwise", "reduce", "softmax", "vectorized")),
)


def profile_step(engine, args) -> dict:
    """One RL step under torch.profiler: GPU time per kernel kind, the top kernels, and how much
    of the step's wall time the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile

    from services.learner.steps import rl_step

    if not torch.cuda.is_available():
        return {}
    batch = sequences(args.rows, args.seq, seed=999, seq_min=args.seq_min, vocab=engine.lm_config.vocab_size)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rl_step(engine, batch, eps_low=0.2, eps_high=0.28)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rows = [
        (e.key, e.device_time_total / 1e6, e.count)
        for e in prof.key_averages()
        if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"
    ]
    total = sum(t for _, t, _ in rows)
    kinds: dict[str, float] = {}
    for name, t, _ in rows:
        low = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(x in low for x in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + t
    top = sorted(rows, key=lambda r: -r[1])[:15]
    return {
        "wall_s": wall,
        "gpu_busy_s": total,
        "by_kind_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top": [{"kernel": n[:120], "s": t, "calls": c} for n, t, c in top],
    }


def bench_baseline(args, model_dir: Path, micro_rows: int) -> dict:
    """Plain PyTorch: HF forward with labels (its own loss), bf16 autocast, fused AdamW; `micro_rows`
    sequences stacked per forward/backward."""
    from transformers import AutoModelForCausalLM

    from services.learner.flops import model_shape, peak_flops, train_flops

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-6, fused=on_gpu)
    n_params = sum(p.numel() for p in model.parameters())
    layers, attn_width = model_shape(model.config)
    times = []
    for k in range(args.warmup + args.steps):
        batch = sequences(args.rows, args.seq, seed=100 + k)
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        groups = [batch[i : i + micro_rows] for i in range(0, len(batch), micro_rows)]
        for group in groups:  # every sequence is args.seq long: no padding
            ids = torch.tensor([s.token_ids for s in group], device=device)
            labels = torch.tensor(
                [[t if m else -100 for t, m in zip(s.token_ids, s.loss_mask)] for s in group], device=device
            )
            with torch.autocast(device, dtype=torch.bfloat16, enabled=on_gpu):
                loss = model(input_ids=ids, labels=labels).loss / len(groups)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        log(f"baseline step {k}: {dt:.3f} s")
        if k >= args.warmup:
            times.append(dt)
    step_s = statistics.median(times)
    seq_lens = [args.seq] * args.rows
    flops = train_flops(n_params, layers, attn_width, seq_lens)
    half = train_flops(n_params, layers, attn_width, seq_lens, causal_half=True)
    peak = peak_flops()
    return {
        "micro_rows": micro_rows,
        "step_s_median": step_s,
        "tokens_per_s": args.rows * args.seq / step_s,
        "tflops_per_s": flops / step_s / 1e12,
        "mfu": flops / step_s / peak if peak else None,
        "mfu_causal_half": half / step_s / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
    }


def bench_weights(args, engine, model_dir: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.weights.files import StorePublisher, load_into

    root = Path(args.weights_dir) / f"bench-{os.getpid()}"
    publisher = StorePublisher(root, keep=2, threads=args.threads)
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    # The rollout side: a live model of the same shape, as a server holds it.
    with torch.device("cuda" if on_gpu else "cpu"):
        live = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    rounds = []
    for v in range(1, args.publish_rounds + 1):
        t0 = time.perf_counter()
        res = publisher.publish(
            v,
            engine.iter_weight_buckets(bucket_bytes=args.bucket_mb * 2**20, dtype=dtype),
            config=engine.lm_config,
            source_dir=model_dir,
        )
        publish_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        load_into(live, Path(res.update.uri), sha256=res.update.sha256, verify=True)
        if on_gpu:
            torch.cuda.synchronize()
        reload_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        load_into(live, Path(res.update.uri), sha256=res.update.sha256, verify=False)
        if on_gpu:
            torch.cuda.synchronize()
        reload_noverify_s = time.perf_counter() - t2
        same = all(
            torch.equal(p.detach().to(dtype).cpu(), q.detach().cpu())
            for (_, p), (_, q) in zip(sorted(engine.hf_model.named_parameters()), sorted(live.named_parameters()))
            if p.shape == q.shape
        )
        r = {
            "version": v,
            "gather_s": res.gather_s,
            "write_s": res.write_s,
            "publish_s": publish_s,
            "reload_verified_s": reload_s,
            "reload_manifest_only_s": reload_noverify_s,
            "publish_plus_reload_s": publish_s + reload_s,
            "bytes": res.bytes,
            "weights_equal": same,
        }
        log(
            f"publish v{v}: gather {res.gather_s:.3f} s, write {res.write_s:.3f} s, reload {reload_s:.3f} s "
            f"(no file hashes {reload_noverify_s:.3f} s), {res.bytes / 2**20:.0f} MiB, equal={same}"
        )
        rounds.append(r)
    shutil.rmtree(root, ignore_errors=True)
    keys = [k for k in rounds[0] if k.endswith("_s")]
    return {
        "rounds": rounds,
        "median": {k: statistics.median(r[k] for r in rounds) for k in keys},
        "bytes": rounds[0]["bytes"],
        "bucket_mb": args.bucket_mb,
        "dir": str(args.weights_dir),
    }


def write_results(args, record: dict) -> None:
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    t, b = record["train"], record["baseline"]
    lengths = f"{args.seq_min}–{args.seq} (drawn anew each step)" if args.seq_min else str(args.seq)

    def pct(x):
        return f"{100 * x:.1f} %" if x is not None else "n/a (CPU)"

    def gib(x):
        return f"{x:.1f}" if x is not None else "n/a"

    def row(label: str, r: dict) -> str:
        if "error" in r:
            return f"| {label} | {r['error'][:160]} | | | | | |"
        return (
            f"| {label} | {r['tokens_per_s']:,.0f} | {r['tflops_per_s']:.1f} | {pct(r['mfu'])} | "
            f"{pct(r['mfu_causal_half'])} | {r['step_s_median']:.3f} | {gib(r['peak_memory_gib'])} |"
        )

    lines = [
        f"# Learner benchmark ({args.name})",
        "",
        f"Device: {record['device']}; torch {record['torch']}, transformers {record['transformers']}, "
        f"deepspeed {record['deepspeed']}.",
        f"Model: Qwen2 architecture, {t['params_m']:.0f} M parameters (random init, size `{args.size}`); "
        f"{args.rows} sequences × {lengths} tokens per step; ZeRO-{args.zero}, bf16 on GPU; "
        f"gradient checkpointing {'on' if args.grad_ckpt else 'off'}; fused logprob head in chunks of {args.chunk} tokens "
        f"({args.head_kernels} kernels); decoder layers "
        f"{'compiled (torch.compile, ours and the baseline)' if args.compile else 'eager'}; median of {args.steps} "
        f"steps after {args.warmup} warm-up. Same run, same GPU for every row.",
        "",
        "| | tokens/s | TFLOP/s | MFU (PaLM) | MFU (causal ½) | step s | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in record["variants"]:
        lines.append(row(f"our RL step (DeepSpeed, clipped PG, token-mean), {v['label']}", v))
    if b:
        label = f"baseline: plain PyTorch (HF loss, autocast, fused AdamW), {b['micro_rows']} row(s)/micro-batch"
        if b["oom_at"]:
            label += f" (OOM at {', '.join(map(str, b['oom_at']))})"
        lines.append(row(label, b))
    lines += ["", f"Best: {t['label']}: {pct(t['mfu'])} MFU (PaLM), {pct(t['mfu_causal_half'])} (causal ½).", ""]
    profiled = [v for v in record["variants"] if v.get("kernels")]
    if profiled:
        kinds = list(dict.fromkeys(k for v in profiled for k in v["kernels"]["by_kind_s"]))
        lines += [
            "Where the GPU time of one profiled step goes, per variant (GPU seconds by kernel kind; the profiler "
            "slows the step, so read busy against wall only roughly):",
            "",
            "| variant | wall s | GPU busy s | " + " | ".join(kinds) + " |",
            "|---" * (3 + len(kinds)) + "|",
        ]
        for v in profiled:
            prof = v["kernels"]
            lines.append(
                f"| {v['label']} | {prof['wall_s']:.3f} | {prof['gpu_busy_s']:.3f} | "
                + " | ".join(f"{prof['by_kind_s'].get(k, 0.0):.3f}" for k in kinds)
                + " |"
            )
        lines.append("")
    prof = t.get("kernels") or {}
    if prof:
        lines += [f"Top kernels of the best variant ({t['label']}):", "", "| kernel | GPU s | calls |", "|---|---|---|"]
        lines += [f"| `{k['kernel'][:90]}` | {k['s']:.3f} | {k['calls']} |" for k in prof["top"][:10]]
        lines.append("")
    w = record["weights"]
    if w.get("rounds"):
        m = w["median"]
        lines += [
            f"Weight sync, store path ({w['bytes'] / 2**20:.0f} MiB bf16, buckets of {w['bucket_mb']} MiB, written "
            f"under {w['dir']}; median of {args.publish_rounds}):",
            "",
            "| gather | write (shards + manifest) | publish total | reload, hashes verified | reload, manifest only | "
            "publish + reload |",
            "|---|---|---|---|---|---|",
            f"| {m['gather_s']:.3f} s | {m['write_s']:.3f} s | {m['publish_s']:.3f} s | {m['reload_verified_s']:.3f} s "
            f"| {m['reload_manifest_only_s']:.3f} s | {m['publish_plus_reload_s']:.3f} s |",
            "",
        ]
    lines += [
        "Targets (issue 5): MFU ≥ 40 %, publish + reload ≤ 1 s. MFU counts model FLOPs only (no recomputation) "
        "against the dense bf16 peak. MFU (PaLM) is the PaLM paper's definition (appendix B; also Megatron's and "
        "torchtitan's), 6·N·s + 12·L·d·s² per sequence of s tokens, attention counted in full; MFU (causal ½) counts "
        "causal attention at half (6·L·d·s²), the stricter figure. TFLOP/s is in the PaLM count.",
    ]
    if record.get("nccl"):
        lines += ["", f"NCCL broadcast path: {record['nccl']}"]
    else:
        lines += [
            "",
            "NCCL broadcast path: not timed here (it needs 2 GPUs; the code path is tested on CPU with gloo).",
        ]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")


def run_variants(args, model_dir: Path) -> tuple[list[dict], dict | None]:
    """Every variant in turn (OOM or a kernel this GPU does not take is recorded, and the run goes
    on); the weight-sync timing uses the first engine that ran."""
    results, weights = [], None
    for variant in variants(args):
        try:
            result, engine = bench_engine(args, model_dir, variant, profile=args.profile)
        except Exception as e:
            log(f"variant {variant.label} failed: {e!r}")
            results.append({**asdict(variant), "label": variant.label, "error": "OOM" if is_oom(e) else repr(e)[:500]})
        else:
            results.append(result)
            if weights is None and not args.skip_weights:
                weights = bench_weights(args, engine, model_dir)
            engine.close()
            del engine
        free_memory()
    return results, weights


def run_baseline(args, model_dir: Path, micro_rows: int) -> dict:
    """The baseline at `micro_rows`, halved while it runs out of memory: its HF loss keeps fp32 logits
    of every row for backward, about twice our memory per row."""
    oom_at: list[int] = []
    while True:
        try:
            return {**bench_baseline(args, model_dir, micro_rows), "oom_at": oom_at}
        except Exception as e:
            log(f"baseline at {micro_rows} row(s)/micro-batch failed: {e!r}")
            if not is_oom(e) or micro_rows == 1:
                return {"micro_rows": micro_rows, "error": "OOM" if is_oom(e) else repr(e)[:500], "oom_at": oom_at}
            oom_at.append(micro_rows)
            micro_rows //= 2
        finally:
            free_memory()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument(
        "--seq-min",
        type=int,
        default=None,
        help="draw each sequence's length from [seq-min, seq], new every step (default: all of --seq)",
    )
    p.add_argument("--rows", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--chunk", type=int, default=8192, help="tokens per logprob chunk")
    p.add_argument(
        "--head-kernels",
        choices=["auto", "compiled", "eager"],
        default="auto",
        help="the fused head's element-wise work (auto: compiled on GPU)",
    )
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (ours and the baseline)")
    p.add_argument("--publish-rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=256, help="weight-publication bucket, MiB")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--weights-dir", default=tempfile.gettempdir())
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--skip-weights", action="store_true")
    p.add_argument(
        "--sdpa-variants",
        default="default",
        help="comma-separated SDPA priority lists to measure, e.g. default,cudnn+flash (best one is reported)",
    )
    p.add_argument(
        "--micro-rows", default="1", help="comma-separated packed rows per forward/backward to measure, e.g. 1,2,4"
    )
    p.add_argument(
        "--reduce-bucket-m",
        default="50",
        help="comma-separated ZeRO reduce / all-gather bucket sizes in millions of elements "
        "(DeepSpeed counts elements, not bytes; 50 is the engine's default)",
    )
    p.add_argument("--pad-multiple", default="1", help="comma list: round each pass's length up to a multiple")
    p.add_argument(
        "--profile", action="store_true", help="profile one extra step per variant (GPU time per kernel kind)"
    )
    p.add_argument("--name", default="learner_gpu")
    args = p.parse_args()
    if args.seq_min and not args.skip_baseline:
        p.error("--seq-min needs --skip-baseline: the plain-PyTorch baseline stacks sequences of one length")

    import deepspeed
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86_64'})"
    log(f"device: {device}")
    work = Path(tempfile.mkdtemp(prefix="learner-bench-"))
    model_dir = build_model(args.size, work / "model", args.seq)
    log("model saved")
    results, weights = run_variants(args, model_dir)
    ok = [v for v in results if "error" not in v]
    if not ok:
        raise SystemExit(f"every variant failed: {[v['error'] for v in results]}")
    train = max(ok, key=lambda v: v["tokens_per_s"])
    # The baseline stacks as many sequences per pass as our best variant, so the two compare like for like.
    baseline = {} if args.skip_baseline else run_baseline(args, model_dir, train["micro_rows"])
    weights = weights or {"median": {"publish_plus_reload_s": float("nan")}, "rounds": [], "bytes": 0}
    record = {
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "deepspeed": deepspeed.__version__,
        "args": vars(args),
        "train": train,
        "variants": results,
        "baseline": baseline,
        "weights": weights,
        "nccl": None,
        "targets": {"mfu": 0.40, "publish_plus_reload_s": 1.0},
        "met": {
            "mfu": (train["mfu"] or 0) >= 0.40,
            "publish_plus_reload_s": weights["median"]["publish_plus_reload_s"] <= 1.0,
        },
    }
    write_results(args, record)
    log(
        json.dumps(
            {
                "train": {
                    k: train[k]
                    for k in ("label", "tokens_per_s", "mfu", "mfu_causal_half", "step_s_median", "peak_memory_gib")
                },
                "baseline": baseline,
                "weights": weights["median"],
            },
            default=str,
        )
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
