"""Packed rows against the same sequences run one at a time, at a model's width (default: Qwen2.5-7B's).

    python bench/packed_attention.py                               # 7B width, 2 layers, a 32K row of 3 sequences
    python bench/packed_attention.py --lengths 12000,9000,11768 --layers 4
    python bench/packed_attention.py --hidden 256 --heads 4 --kv-heads 2 --intermediate 512 --lengths 96,64,40 \\
        --name packed_attention_cpu_smoke                          # CPU check (fp32, per-sequence SDPA)

What runs: decoder layers of a random-init Qwen2 (HF modeling code, bf16 on GPU), forward and backward
of a loss on the last hidden state, with the position ids the learner gives a packed row. Three ways:

- `alone`: each sequence in its own pass, plain causal SDPA (the reference cost);
- `packed varlen`: one row of all sequences through the learner's packed attention
  (services/learner/attention.py: FlashAttention's varlen kernel on GPU, SDPA per sequence elsewhere);
- `packed per-sequence`: the same row, causal SDPA over each sequence in turn on every device
  (the learner's default, `auto`, runs whichever of the two its rule picks for these lengths);
- `packed mask`: the same row through transformers' SDPA with the [1, 1, T, T] block mask it builds
  from the position ids (the learner's path before packed attention).

Times are medians of `--repeat` passes after `--warmup`; peak memory is the most allocated during a
pass. Target (issue 45): a packed row's time per token ≤ 1.1× the sequences alone.

`--fresh-lengths`: every pass draws new lengths (each of `--lengths` times 0.8-1.2), as a training step's
trajectories are; `alone` then pads each sequence to a multiple of 256 (as the learner stacks unpacked rows),
and `packed per-sequence, unpadded` runs SDPA on the exact lengths (services/learner/attention.py pads each
sequence to SEQUENCE_MULTIPLE on a GPU so that cuDNN sees few lengths); ms per 1K tokens count real tokens.
Results: bench/results/<name>.json and .md (default name packed_attention), or under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.learner.attention import (PACKED_ATTENTION, PER_SEQUENCE_ATTENTION, VARLEN_ATTENTION,  # noqa: E402
                                       varlen_options, packed_kwargs, uses_varlen_kernel)

TARGET = 1.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=18944)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lengths", default="12000,9000,11768",
                    help="the packed row's sequences, in tokens (default: 32,768 in three)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fresh-lengths", action="store_true", help="new lengths every pass (see above)")
    ap.add_argument("--name", default="packed_attention")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--lengths takes comma-separated token counts, got {args.lengths!r}")
    if not args.lengths or min(args.lengths) < 2:
        ap.error("--lengths needs at least one sequence of 2 or more tokens")
    if args.heads % args.kv_heads or args.hidden % args.heads:
        ap.error("--heads must divide --hidden and be a multiple of --kv-heads")
    return args


def build_layers(args: argparse.Namespace, impl: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers, vocab_size=1024,
                         max_position_embeddings=max(32768, max(args.lengths)), attn_implementation=impl)
    torch.manual_seed(0)
    return Qwen2Model(config).to(device=device, dtype=dtype).train()


def timed_pass(model: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor, packed: bool,
               device: torch.device) -> float:
    """One forward and backward; seconds."""
    kwargs = packed_kwargs(positions) if packed else {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = model(inputs_embeds=hidden, position_ids=positions, use_cache=False, **kwargs).last_hidden_state
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure(model: torch.nn.Module, batches, packed: bool, args: argparse.Namespace,
            device: torch.device) -> dict[str, float]:
    """Median seconds of running every batch once, and peak GiB over a pass. `batches`: a list of
    (hidden, positions), or a function of the pass's index giving that list and its real tokens."""
    times, per_token = [], []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.repeat):
        these, tokens = batches(i) if callable(batches) else (batches, sum(h.shape[1] for h, _ in batches))
        total = sum(timed_pass(model, h, p, packed, device) for h, p in these)
        model.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(total)
            per_token.append(total / tokens)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    seconds = statistics.median(times)
    return {"seconds": seconds, "ms_per_1k_tokens": statistics.median(per_token) * 1e6, "peak_gib": peak,
            "tokens": tokens}


def fresh_lengths(base: list[int], i: int) -> list[int]:
    """Pass `i`'s lengths: each of `base` times a factor drawn from 0.8-1.2 (seeded by `i`)."""
    g = torch.Generator().manual_seed(1000 + i)
    return [max(2, round(n * float(0.8 + 0.4 * torch.rand(1, generator=g)))) for n in base]


def fresh_batches(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, packed: bool):
    """The pass-index → (batches, real tokens) function of --fresh-lengths: one packed row, or each sequence
    alone padded to a multiple of 256 with positions continuing (the learner's unpacked rows)."""
    def make(i: int):
        lengths = fresh_lengths(args.lengths, i)
        g = torch.Generator().manual_seed(i)
        seqs = [torch.randn(1, n, args.hidden, generator=g) * 0.02 for n in lengths]
        if packed:
            row = (torch.cat(seqs, dim=1).to(device, dtype),
                   torch.cat([torch.arange(n) for n in lengths])[None].to(device))
            return [row], sum(lengths)
        alone = []
        for s in seqs:
            width = -(-s.shape[1] // 256) * 256
            h = torch.nn.functional.pad(s, (0, 0, 0, width - s.shape[1]))
            alone.append((h.to(device, dtype), torch.arange(width, device=device)[None]))
        return alone, sum(lengths)
    return make


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_layers(args, PACKED_ATTENTION, device, dtype)
    if args.fresh_lengths:
        return fresh_run(args, model, device, dtype)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(1, n, args.hidden, generator=g) * 0.02 for n in args.lengths]
    alone = [(s.to(device, dtype), torch.arange(s.shape[1], device=device)[None]) for s in seqs]
    row = (torch.cat(seqs, dim=1).to(device, dtype),
           torch.cat([torch.arange(n) for n in args.lengths])[None].to(device))
    variants = {"alone": measure(model, alone, False, args, device)}
    varlen = uses_varlen_kernel(row[0])
    kernel = "varlen_attn" if varlen else "SDPA per sequence"
    for name, impl, used in (("packed varlen", VARLEN_ATTENTION, kernel),
                             ("packed per-sequence", PER_SEQUENCE_ATTENTION, "SDPA per sequence")):
        model.config._attn_implementation = impl
        variants[name] = {**measure(model, [row], True, args, device), "kernel": used}
    model.config._attn_implementation = "sdpa"
    try:
        variants["packed mask"] = measure(model, [row], False, args, device)
    except torch.OutOfMemoryError:
        variants["packed mask"] = {"error": "OOM"}
    return record_of(args, device, dtype, variants, "packed varlen" if varlen else "packed per-sequence")


def record_of(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, variants: dict, auto_picks: str,
              **extra) -> dict:
    """The run's record: each variant's cost per token against `alone`, and whether it meets the target."""
    base = variants["alone"]["ms_per_1k_tokens"]
    for v in variants.values():
        if "ms_per_1k_tokens" in v:
            v["per_token_vs_alone"] = v["ms_per_1k_tokens"] / base
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__, "dtype": str(dtype),
        "shape": {"hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                  "intermediate": args.intermediate, "layers": args.layers},
        "lengths": args.lengths, **extra, "warmup": args.warmup, "repeat": args.repeat, "variants": variants,
        "varlen_options": varlen_options(), "auto_picks": auto_picks, "target_per_token_vs_alone": TARGET,
        "meets_target": {name: v["per_token_vs_alone"] <= TARGET for name, v in variants.items()
                         if name != "alone" and "per_token_vs_alone" in v},
    }


def fresh_run(args: argparse.Namespace, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict:
    """--fresh-lengths: every variant on new lengths each pass."""
    from services.learner import attention

    variants = {"alone": measure(model, fresh_batches(args, device, dtype, False), False, args, device)}
    row = fresh_batches(args, device, dtype, True)
    kept = attention.SEQUENCE_MULTIPLE
    for name, impl, multiple in (("packed per-sequence", PER_SEQUENCE_ATTENTION, kept),
                                 ("packed per-sequence, unpadded", PER_SEQUENCE_ATTENTION, 1),
                                 ("packed varlen", VARLEN_ATTENTION, kept)):
        model.config._attn_implementation = impl
        attention.SEQUENCE_MULTIPLE = multiple
        try:
            variants[name] = {**measure(model, row, True, args, device), "kernel": impl}
        finally:
            attention.SEQUENCE_MULTIPLE = kept
    varlen = uses_varlen_kernel(torch.empty(1, device=device, dtype=dtype))
    return record_of(args, device, dtype, variants, "packed varlen" if varlen else "packed per-sequence",
                     fresh_lengths=[fresh_lengths(args.lengths, i) for i in range(args.warmup + args.repeat)])


def markdown(record: dict, command: str) -> str:
    s = record["shape"]
    lines = [
        f"# Packed rows against their sequences alone ({record['device']})", "",
        f"torch {record['torch']}, transformers {record['transformers']}, {record['dtype']}. Qwen2 decoder layers at "
        f"hidden {s['hidden']}, {s['heads']} heads ({s['kv_heads']} KV), MLP {s['intermediate']}, {s['layers']} layers; "
        f"one row of {len(record['lengths'])} sequences ({', '.join(f'{n:,}' for n in record['lengths'])} tokens, "
        f"{sum(record['lengths']):,} in all{'; new lengths every pass, each 0.8-1.2× these' if record.get('fresh_lengths') else ''}); "
        f"forward + backward, median of {record['repeat']} after {record['warmup']} warm-up.", "",
        "| | fwd+bwd ms | ms per 1K tokens | per token vs alone | peak GiB |",
        "|---|---|---|---|---|",
    ]
    for name, v in record["variants"].items():
        if "error" in v:
            lines.append(f"| {name} | {v['error']} | | | |")
            continue
        label = f"{name} ({v['kernel']})" if "kernel" in v else name
        peak = "n/a" if v["peak_gib"] is None else f"{v['peak_gib']:.2f}"
        lines.append(f"| {label} | {v['seconds'] * 1e3:.1f} | {v['ms_per_1k_tokens']:.2f} | "
                     f"{v['per_token_vs_alone']:.3f}× | {peak} |")
    verdicts = ", ".join(f"{name} {'met' if ok else 'NOT met'} ({record['variants'][name]['per_token_vs_alone']:.3f}×)"
                         for name, ok in record["meets_target"].items())
    lines += ["", f"Target: packed per-token cost ≤ {record['target_per_token_vs_alone']}× the sequences alone: "
              f"{verdicts}. The learner's default (`packed_attention: auto`) runs {record['auto_picks']} here.",
              "", f"Command: `{command}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = run(args)
    command = "python bench/packed_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    text = markdown(record, command.strip())
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
