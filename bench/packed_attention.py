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
Under --fresh-lengths the variants are (issue 63, item 2): `packed varlen` (today's: on a torch whose
varlen_attn has no enable_gqa, K and V repeated to the query's heads), `packed varlen, GQA native`
(`packed_attention: varlen-gqa`), per-sequence SDPA unpadded, padded with cuDNN's plans built as the passes
meet the lengths, and padded with every length's plans built first (`warm_sequence_plans`, as the learner
does under `packed_attention: per-sequence`), FlashAttention-4's varlen where flash-attn-4 is installed
(no FlashAttention-3 wheel is on PyPI), and `alone` last; each with its largest difference from the
unpacked rows (outputs, input and weight gradients), all under `--sdpa`'s kernel priority. The record
names the fastest variant within tolerance (bf16 2e-2, fp32 1e-4 relative to the largest magnitude).

    python bench/packed_attention.py --fresh-lengths --repeat 50 --name packed_attention_gqa_7b
    python bench/packed_attention.py --fresh-lengths --repeat 50 --hidden 1536 --heads 12 --kv-heads 2 \
        --intermediate 8960 --lengths 12000,9000,11768 --name packed_attention_gqa_1p5b

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

from services.learner.attention import (  # noqa: E402
    PACKED_ATTENTION,
    PER_SEQUENCE_ATTENTION,
    VARLEN_ATTENTION,
    VARLEN_GQA_ATTENTION,
    auto_kernel,
    packed_kwargs,
    uses_varlen_kernel,
    varlen_options,
    warm_sequence_plans,
)
from services.learner.engine import sdpa_priority  # noqa: E402

FA4_ATTENTION = "bench_fa4_varlen"

TARGET = 1.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=18944)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--lengths", default="12000,9000,11768", help="the packed row's sequences, in tokens (default: 32,768 in three)"
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fresh-lengths", action="store_true", help="new lengths every pass (see above)")
    ap.add_argument(
        "--sdpa",
        default="cudnn,flash",
        help="SDPA kernels in priority order on GPU (the learner's sdpa_backends); 'default': PyTorch's",
    )
    ap.add_argument("--name", default="packed_attention")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--lengths takes comma-separated token counts, got {args.lengths!r}")
    if not args.lengths or min(args.lengths) < 2:
        ap.error("--lengths needs at least one sequence of 2 or more tokens")
    args.sdpa = None if args.sdpa == "default" else [b for b in args.sdpa.split(",") if b]
    if args.sdpa and set(args.sdpa) - {"cudnn", "flash", "efficient", "math"}:
        ap.error(f"--sdpa takes cudnn, flash, efficient, math or default, got {','.join(args.sdpa)}")
    if args.heads % args.kv_heads or args.hidden % args.heads:
        ap.error("--heads must divide --hidden and be a multiple of --kv-heads")
    return args


def build_layers(args: argparse.Namespace, impl: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        vocab_size=1024,
        max_position_embeddings=max(32768, max(args.lengths)),
        attn_implementation=impl,
    )
    torch.manual_seed(0)
    return Qwen2Model(config).to(device=device, dtype=dtype).train()


def timed_pass(
    model: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor, packed: bool, device: torch.device
) -> float:
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


def measure(
    model: torch.nn.Module, batches, packed: bool, args: argparse.Namespace, device: torch.device
) -> dict[str, float]:
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
    return {
        "seconds": seconds,
        "ms_per_1k_tokens": statistics.median(per_token) * 1e6,
        "peak_gib": peak,
        "tokens": tokens,
    }


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
            row = (
                torch.cat(seqs, dim=1).to(device, dtype),
                torch.cat([torch.arange(n) for n in lengths])[None].to(device),
            )
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
        with sdpa_priority(args.sdpa if device.type == "cuda" else None):
            return fresh_run(args, model, device, dtype)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(1, n, args.hidden, generator=g) * 0.02 for n in args.lengths]
    alone = [(s.to(device, dtype), torch.arange(s.shape[1], device=device)[None]) for s in seqs]
    row = (
        torch.cat(seqs, dim=1).to(device, dtype),
        torch.cat([torch.arange(n) for n in args.lengths])[None].to(device),
    )
    variants = {"alone": measure(model, alone, False, args, device)}
    varlen = uses_varlen_kernel(row[0])
    kernel = "varlen_attn" if varlen else "SDPA per sequence"
    for name, impl, used in (
        ("packed varlen", VARLEN_ATTENTION, kernel),
        ("packed varlen, GQA native", VARLEN_GQA_ATTENTION, kernel),
        ("packed per-sequence", PER_SEQUENCE_ATTENTION, "SDPA per sequence"),
    ):
        model.config._attn_implementation = impl
        variants[name] = {**measure(model, [row], True, args, device), "kernel": used}
    model.config._attn_implementation = "sdpa"
    try:
        variants["packed mask"] = measure(model, [row], False, args, device)
    except torch.OutOfMemoryError:
        variants["packed mask"] = {"error": "OOM"}
    return record_of(args, device, dtype, variants, auto_pick(args.lengths, varlen, "packed per-sequence"))


def auto_pick(lengths: list[int], varlen_runs: bool, per_sequence: str) -> str:
    """The variant the learner's `auto` is for a row of these lengths (services/learner/attention.py's rule)."""
    return "packed varlen" if varlen_runs and auto_kernel(sum(lengths), len(lengths)) == "varlen" else per_sequence


def record_of(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, variants: dict, auto_picks: str, **extra
) -> dict:
    """The run's record: each variant's cost per token against `alone`, and whether it meets the target."""
    base = variants["alone"]["ms_per_1k_tokens"]
    for v in variants.values():
        if "ms_per_1k_tokens" in v:
            v["per_token_vs_alone"] = v["ms_per_1k_tokens"] / base
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": str(dtype),
        "shape": {
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "intermediate": args.intermediate,
            "layers": args.layers,
        },
        "lengths": args.lengths,
        **extra,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "variants": variants,
        "varlen_options": varlen_options(),
        "auto_picks": auto_picks,
        "target_per_token_vs_alone": TARGET,
        "meets_target": {
            name: v["per_token_vs_alone"] <= TARGET
            for name, v in variants.items()
            if name != "alone" and "per_token_vs_alone" in v
        },
    }


def fa4_varlen():
    """FlashAttention-4's varlen function (the flash-attn-4 package, `flash_attn.cute`; forward and backward on
    Hopper), registered as an attention implementation of packed rows, or None where it is not installed.
    No FlashAttention-3 wheel is published on PyPI (flash-attn-3 has no distribution there)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - absent or unbuildable here: the variant is left out, and said so
        return None
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fa4(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
        cu, longest = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("max_length_q", None)
        kwargs.pop("sequence_spans", None)
        if cu is None:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        b, h, t, d = query.shape
        q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=int(longest),
            max_seqlen_k=int(longest),
            softmax_scale=scaling,
            causal=True,
        )
        out = out[0] if isinstance(out, tuple) else out
        return out.view(b, t, h, d), None

    AttentionInterface.register(FA4_ATTENTION, fa4)
    return FA4_ATTENTION


def exactness(model: torch.nn.Module, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """A packed row of `--lengths` against each sequence alone (plain causal SDPA): the largest differences of
    the outputs, of the inputs' gradients and of the parameters' gradients, each relative to the largest
    magnitude of the unpacked side's."""
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randn(1, n, args.hidden, generator=g).to(device, dtype) * 0.02 for n in args.lengths]
    impl = model.config._attn_implementation

    def run(batches: list[tuple[torch.Tensor, torch.Tensor]], packed: bool):
        model.zero_grad(set_to_none=True)
        outs, grads = [], []
        for h, p in batches:
            h = h.clone().requires_grad_()
            out = model(
                inputs_embeds=h, position_ids=p, use_cache=False, **(packed_kwargs(p) if packed else {})
            ).last_hidden_state
            (out.float().square().sum() * 1e-3).backward()  # the same weight per token packed or alone
            outs.append(out.detach().float())
            grads.append(h.grad.float())
        params = torch.cat([q.grad.float().flatten() for q in model.parameters() if q.grad is not None])
        return torch.cat(outs, dim=1), torch.cat(grads, dim=1), params

    row = [(torch.cat(seqs, dim=1), torch.cat([torch.arange(n) for n in args.lengths])[None].to(device))]
    packed = run(row, True)
    model.config._attn_implementation = "sdpa"
    alone = run([(s, torch.arange(s.shape[1], device=device)[None]) for s in seqs], False)
    model.config._attn_implementation = impl
    out = {
        name: float((p - a).abs().max() / a.abs().max())
        for name, p, a in zip(("output", "input_grad", "param_grad"), packed, alone)
    }
    model.zero_grad(set_to_none=True)
    return out


def fresh_run(args: argparse.Namespace, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict:
    """--fresh-lengths: every variant on new lengths each pass. The SDPA variants' plans (cuDNN builds one per
    new length and keeps it for the process) are built as the passes meet their lengths, except in
    `packed per-sequence, plans at start`, run after `warm_sequence_plans` built every padded length's;
    `alone` runs last, with those plans too."""
    from services.learner import attention

    row = fresh_batches(args, device, dtype, True)
    kept = attention.SEQUENCE_MULTIPLE
    longest = max(max(ls) for ls in (fresh_lengths(args.lengths, i) for i in range(args.warmup + args.repeat)))
    variants, tolerance = {}, {}
    runs = [
        ("packed varlen", VARLEN_ATTENTION, kept),
        ("packed varlen, GQA native", VARLEN_GQA_ATTENTION, kept),
        ("packed per-sequence, unpadded", PER_SEQUENCE_ATTENTION, 1),
        ("packed per-sequence, plans as met", PER_SEQUENCE_ATTENTION, kept),
        ("packed per-sequence, plans at start", PER_SEQUENCE_ATTENTION, kept),
    ]
    fa4 = fa4_varlen() if device.type == "cuda" else None
    if fa4:
        runs.append(("packed FlashAttention-4 varlen", fa4, kept))
    for name, impl, multiple in runs:
        model.config._attn_implementation = impl
        attention.SEQUENCE_MULTIPLE = multiple
        try:
            extra = {}
            if name.endswith("plans at start") and device.type == "cuda":
                t0 = time.perf_counter()
                cfg = model.config
                built = warm_sequence_plans(
                    cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    cfg.hidden_size // cfg.num_attention_heads,
                    longest,
                    device,
                    dtype,
                )
                torch.cuda.synchronize(device)
                extra = {"plans_built": len(built), "plans_seconds": time.perf_counter() - t0}
            variants[name] = {
                **measure(model, row, True, args, device),
                "kernel": impl,
                **extra,
                "exactness": exactness(model, args, device, dtype),
            }
        except Exception as e:  # noqa: BLE001 - a kernel this GPU or torch does not run: recorded, the rest still run
            variants[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        finally:
            attention.SEQUENCE_MULTIPLE = kept
    model.config._attn_implementation = PACKED_ATTENTION
    variants = {"alone": measure(model, fresh_batches(args, device, dtype, False), False, args, device), **variants}
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4  # fp32: rounding of matmuls of other shapes
    exact = {n: max(v["exactness"].values()) <= tolerance for n, v in variants.items() if "exactness" in v}
    timed = {n: v["ms_per_1k_tokens"] for n, v in variants.items() if n != "alone" and exact.get(n)}
    return record_of(
        args,
        device,
        dtype,
        variants,
        auto_pick(
            args.lengths,
            uses_varlen_kernel(torch.empty(0, device=device, dtype=dtype)),
            "packed per-sequence, plans at start" if device.type == "cuda" else "packed per-sequence, plans as met",
        ),
        fresh_lengths=[fresh_lengths(args.lengths, i) for i in range(args.warmup + args.repeat)],
        exactness_tolerance=tolerance,
        exact=exact,
        fastest_exact=min(timed, key=timed.get) if timed else None,
        fa4=fa4 is not None,
        sdpa_backends=args.sdpa if device.type == "cuda" else None,
    )


def markdown(record: dict, command: str) -> str:
    s = record["shape"]
    lines = [
        f"# Packed rows against their sequences alone ({record['device']})",
        "",
        f"torch {record['torch']}, transformers {record['transformers']}, {record['dtype']}. Qwen2 decoder layers at "
        f"hidden {s['hidden']}, {s['heads']} heads ({s['kv_heads']} KV), MLP {s['intermediate']}, {s['layers']} layers; "
        f"one row of {len(record['lengths'])} sequences ({', '.join(f'{n:,}' for n in record['lengths'])} tokens, "
        f"{sum(record['lengths']):,} in all{'; new lengths every pass, each 0.8-1.2× these' if record.get('fresh_lengths') else ''}); "
        f"forward + backward, median of {record['repeat']} after {record['warmup']} warm-up.",
        "",
        "| | fwd+bwd ms | ms per 1K tokens | per token vs alone | peak GiB | largest difference from unpacked "
        "(output / input grad / weight grad, relative) |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in record["variants"].items():
        if "error" in v:
            lines.append(f"| {name} | {v['error']} | | | | |")
            continue
        label = f"{name} ({v['kernel']})" if "kernel" in v else name
        if "plans_built" in v:
            label += f"; {v['plans_built']} plans built in {v['plans_seconds']:.1f} s"
        peak = "n/a" if v["peak_gib"] is None else f"{v['peak_gib']:.2f}"
        diff = " / ".join(f"{x:.1e}" for x in v["exactness"].values()) if "exactness" in v else ""
        lines.append(
            f"| {label} | {v['seconds'] * 1e3:.1f} | {v['ms_per_1k_tokens']:.2f} | "
            f"{v['per_token_vs_alone']:.3f}× | {peak} | {diff} |"
        )
    verdicts = ", ".join(
        f"{name} {'met' if ok else 'NOT met'} ({record['variants'][name]['per_token_vs_alone']:.3f}×)"
        for name, ok in record["meets_target"].items()
    )
    lines += [
        "",
        f"Target: packed per-token cost ≤ {record['target_per_token_vs_alone']}× the sequences alone: "
        f"{verdicts}. The learner's default (`packed_attention: auto`) runs {record['auto_picks']} here.",
    ]
    if "exact" in record:
        lines += [
            "",
            f"Within {record['exactness_tolerance']:g} of the unpacked rows: "
            f"{', '.join(n for n, ok in record['exact'].items() if ok) or 'none'}; the fastest of them: "
            f"{record['fastest_exact']}. SDPA priority: {record['sdpa_backends'] or 'PyTorch order'}; "
            f"FlashAttention-4 {'measured' if record['fa4'] else 'not installed (left out)'}; no "
            "FlashAttention-3 wheel is published on PyPI.",
        ]
    lines += ["", f"Command: `{command}`", ""]
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
