"""Attention gradients of each GPU kernel against an fp64 reference, at the learner's model shapes.

    python bench/attention_grads.py --out DIR          # on a GPU: attention_grads.{json,md} in DIR

For each shape (query heads, K/V heads, head dim: SmolLM2-135M, Qwen2.5-1.5B, Qwen2.5-7B) and each causal
sequence length, random bf16 Q, K, V and an upstream gradient go through causal SDPA under one kernel at a time
(cuDNN, FlashAttention, memory-efficient; GQA native through `enable_gqa` and with K/V repeated to the query's
heads), torch's varlen kernel (the learner's `varlen`), and the learner's per-sequence packed attention over a
row of several sequences (and, in a fresh process, the same row after the learner's plan warm-up, then a single
sequence through transformers' path at a warmed length); each output and input gradient is compared with SDPA's math kernel in fp64 on the
same bf16 inputs. Reported per case: the largest error relative to the reference's largest magnitude, and the
cosine similarity. A kernel within bf16 rounding shows ~1e-2 and cosine ~1.0; a wrong gradient shows neither.
Needs only torch and transformers (no wheels beyond the GPU image's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128)}
LENGTHS = (512, 1000, 2304, 4099)
PACKED_ROW = (700, 1536, 2049, 300)  # the packed row's sequences: three padded on a GPU, one a whole multiple
TENSORS = ("out", "dq", "dk", "dv")


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    got, ref = got.double().flatten(), ref.double().flatten()
    scale = ref.abs().max().clamp_min(1e-30)
    return {
        "rel_max_err": float((got - ref).abs().max() / scale),
        "cosine": float(F.cosine_similarity(got, ref, dim=0)),
    }


def sdpa_grads(q, k, v, grad, backend, gqa: str) -> list[torch.Tensor]:
    """Output and (dq, dk, dv) of causal SDPA under one kernel; `gqa`: native (enable_gqa) or repeat."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    kk, vv = k, v
    if gqa == "repeat" and k.shape[1] != q.shape[1]:
        kk, vv = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa == "native")
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def reference(q, k, v, grad) -> list[torch.Tensor]:
    from torch.nn.attention import SDPBackend

    return sdpa_grads(*(t.double() for t in (q, k, v, grad)), SDPBackend.MATH, "repeat")


def case(q, k, v, grad, ref, run) -> dict[str, Any]:
    try:
        got = run(q, k, v, grad)
    except Exception as exc:  # a kernel that refuses the shape is a row of the record, not a crash
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {name: compare(g, r) for name, g, r in zip(TENSORS, got, ref)}


def varlen_grads(q, k, v, grad) -> list[torch.Tensor]:
    """torch's varlen kernel over one sequence as the learner calls it ([T, H, D], K/V repeated)."""
    from services.learner.attention import _varlen

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    n = q.shape[2]
    tok = lambda x: x[0].transpose(0, 1)  # noqa: E731 - [1, H, T, D] → [T, H, D]
    cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    out = _varlen(tok(q), tok(k), tok(v), cu, n, None, None)  # [T, H, D]
    out = out.transpose(0, 1)[None]
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def transformers_grads(q, k, v, grad, backend) -> list[torch.Tensor]:
    """Causal SDPA as the learner's layers call it (transformers' `sdpa_attention_forward`, GQA as it decides),
    under one kernel: its output comes back transposed to [B, T, H, D] and contiguous, so the gradient that reaches
    SDPA has that layout's strides, not the output's."""
    from torch.nn.attention import sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from services.learner.attention import CausalLayer

    layer = CausalLayer(q.shape[1], k.shape[1])
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel([backend]):
        out, _ = sdpa_attention_forward(layer, q, k, v, None, scaling=q.shape[-1] ** -0.5)  # [1, T, H, D]
    out.backward(grad.transpose(1, 2).contiguous())
    return [out.detach().transpose(1, 2), q.grad, k.grad, v.grad]


def layout_order_rows(shape_name: str, shape: tuple[int, int, int], dev) -> list[dict[str, Any]]:
    """Does a cuDNN call's gradient depend on which gradient layout first met its length? At a length no kernel has
    met (768): the transformers layout first, then a contiguous gradient; at one the kernel rows met first with a
    contiguous gradient (512): the transformers layout after it."""
    from torch.nn.attention import SDPBackend

    h, hk, d = shape
    cudnn = SDPBackend.CUDNN_ATTENTION
    out = []
    for n, steps in (
        (768, (("cudnn via transformers, first at this length", "transformers"),
               ("cudnn contiguous gradient, after the transformers layout", "contiguous"))),
        (512, (("cudnn via transformers, after a contiguous gradient", "transformers"),)),
    ):  # fmt: skip
        g = torch.Generator(device=dev).manual_seed(10_000 + n)
        q, k, v = (torch.randn(1, m, n, d, device=dev, dtype=torch.bfloat16, generator=g) for m in (h, hk, hk))
        grad = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16, generator=g)
        ref = reference(q, k, v, grad)
        for label, layout in steps:
            if layout == "transformers":
                run = lambda q, k, v, gr: transformers_grads(q, k, v, gr, cudnn)  # noqa: E731
            else:
                run = lambda q, k, v, gr: sdpa_grads(q, k, v, gr, cudnn, "native")  # noqa: E731
            out.append({"shape": shape_name, "length": n, "kernel": label, **case(q, k, v, grad, ref, run)})
    return out


def packed_row_case(shape: tuple[int, int, int], lengths: list[int], mode: str, dev) -> dict[str, Any]:
    """The learner's packed attention (`mode`: per-sequence or varlen) over one row of `lengths`, against each
    sequence alone in fp64."""
    from services.learner import attention as att

    h, hk, d = shape
    t = sum(lengths)
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(1, n, t, d, device=dev, dtype=torch.bfloat16, generator=g) for n in (h, hk, hk))
    grad = torch.randn(1, t, h, d, device=dev, dtype=torch.bfloat16, generator=g)
    name = {"per-sequence": att.PER_SEQUENCE_ATTENTION, "varlen": att.VARLEN_ATTENTION}[mode]
    fn = att.FUNCTIONS[name]
    position_ids = torch.cat([torch.arange(n, device=dev) for n in lengths])[None]
    kwargs = att.packed_kwargs(position_ids)

    try:
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out, _ = fn(att.CausalLayer(h, hk), *leaves, None, scaling=d**-0.5, **dict(kwargs))
        out.backward(grad)
        got = [out.detach(), *(x.grad for x in leaves)]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    result: dict[str, Any] = {}
    start = 0
    refs: list[list[torch.Tensor]] = [[], [], [], []]
    for n in lengths:
        sl = slice(start, start + n)
        r = reference(q[:, :, sl], k[:, :, sl], v[:, :, sl], grad[:, sl].transpose(1, 2))
        refs[0].append(r[0].transpose(1, 2))  # [1, n, H, D] as the function returns
        for i in (1, 2, 3):
            refs[i].append(r[i])
        start += n
    ref = [torch.cat(refs[0], dim=1), *(torch.cat(refs[i], dim=2) for i in (1, 2, 3))]
    for name_, gt, rf in zip(TENSORS, got, ref):
        result[name_] = compare(gt, rf)
    return result


def warmed_rows(dev) -> list[dict[str, Any]]:
    """In a process of its own (no plan cached by the other rows): per-sequence attention's plans built first as
    the learner would build them (`warm_sequence_plans`, through the per-sequence path itself), then its packed
    row, then a single sequence through transformers' path at one of the warmed lengths, each against fp64."""
    from torch.nn.attention import SDPBackend

    from services.learner.attention import warm_sequence_plans

    rows = []
    lengths = list(PACKED_ROW)
    for shape_name, (h, hk, d) in SHAPES.items():
        warm_sequence_plans(h, hk, d, max(lengths), dev, torch.bfloat16)
        row = packed_row_case((h, hk, d), lengths, "per-sequence", dev)
        rows.append({"shape": shape_name, "length": "+".join(map(str, lengths)),
                     "kernel": "packed per-sequence, its plans warmed first (fresh process)", **row})  # fmt: skip
        n = 1536
        g = torch.Generator(device=dev).manual_seed(20_000 + n)
        q, k, v = (torch.randn(1, m, n, d, device=dev, dtype=torch.bfloat16, generator=g) for m in (h, hk, hk))
        grad = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16, generator=g)
        run = lambda q, k, v, gr: transformers_grads(q, k, v, gr, SDPBackend.CUDNN_ATTENTION)  # noqa: E731
        rows.append({"shape": shape_name, "length": n, "kernel": "cudnn via transformers, after the warmed plans",
                     **case(q, k, v, grad, reference(q, k, v, grad), run)})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default="attention_grads")
    ap.add_argument("--warmed-rows", type=Path, default=None, help=argparse.SUPPRESS)  # internal: warmed_rows → JSON
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_grads: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend

    dev = torch.device("cuda")
    if args.warmed_rows is not None:
        args.warmed_rows.write_text(json.dumps(warmed_rows(dev)))
        return 0
    kernels = {
        "cudnn gqa-native": (SDPBackend.CUDNN_ATTENTION, "native"),
        "cudnn repeat": (SDPBackend.CUDNN_ATTENTION, "repeat"),
        "flash gqa-native": (SDPBackend.FLASH_ATTENTION, "native"),
        "flash repeat": (SDPBackend.FLASH_ATTENTION, "repeat"),
        "efficient repeat": (SDPBackend.EFFICIENT_ATTENTION, "repeat"),
    }
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for shape_name, (h, hk, d) in SHAPES.items():
        for n in LENGTHS:
            g = torch.Generator(device=dev).manual_seed(n)
            q, k, v = (torch.randn(1, m, n, d, device=dev, dtype=torch.bfloat16, generator=g) for m in (h, hk, hk))
            grad = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16, generator=g)
            ref = reference(q, k, v, grad)
            for kernel, (backend, gqa) in kernels.items():
                run = lambda q, k, v, gr, b=backend, m=gqa: sdpa_grads(q, k, v, gr, b, m)  # noqa: E731
                rows.append({"shape": shape_name, "length": n, "kernel": kernel, **case(q, k, v, grad, ref, run)})
            rows.append(
                {"shape": shape_name, "length": n, "kernel": "varlen", **case(q, k, v, grad, ref, varlen_grads)}
            )
            print(f"[{time.perf_counter() - t0:.0f} s] {shape_name} {n}", flush=True)
        rows += layout_order_rows(shape_name, (h, hk, d), dev)
        for mode in ("per-sequence", "varlen"):
            lengths = list(PACKED_ROW)
            row = packed_row_case((h, hk, d), lengths, mode, dev)
            rows.append({"shape": shape_name, "length": "+".join(map(str, lengths)), "kernel": f"packed {mode}", **row})
    args.out.mkdir(parents=True, exist_ok=True)
    warmed = args.out / f"{args.name}_warmed.json"
    proc = subprocess.run([sys.executable, __file__, "--warmed-rows", str(warmed)], capture_output=True, text=True)
    if proc.returncode == 0:
        rows += json.loads(warmed.read_text())
        warmed.unlink()
    else:
        rows.append({"shape": "all", "length": "-", "kernel": "per-sequence, plans warmed first",
                     "error": proc.stderr.strip()[-200:]})  # fmt: skip
    record = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "reference": "SDPA math kernel in fp64 on the same bf16 inputs",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    lines = [
        f"# Attention gradients against fp64 ({record['device']}, torch {record['torch']}, cuDNN {record['cudnn']})",
        "",
        "Largest error relative to the reference's largest magnitude (cosine similarity in brackets).",
        "",
        "| shape | length | kernel | out | dq | dk | dv |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            "error: " + r["error"] if "error" in r and t == "out" else ("" if "error" in r else
            f"{r[t]['rel_max_err']:.1e} ({r[t]['cosine']:.4f})")
            for t in TENSORS
        ]  # fmt: skip
        lines.append(f"| {r['shape']} | {r['length']} | {r['kernel']} | " + " | ".join(cells) + " |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
