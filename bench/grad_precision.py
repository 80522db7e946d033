"""How much of a step's gradient the learner's reduction and accumulation dtypes lose, measured with
DeepSpeed ZeRO-3 itself (bf16 weights, two ranks over gloo on CPU).

    python bench/grad_precision.py                       # 128 micro-batches, 2 ranks (about 2 minutes)
    python bench/grad_precision.py --micro-batches 256

Every configuration runs the same micro-batches through the same bf16 model, so each rank's bf16
gradient of each micro-batch is the same bits in all of them; only what happens after differs:

- `fp32 accumulation, fp32 reduction` (the reference): the reduce-scatter sums the ranks' gradients in
  fp32 and each rank's partition accumulates in fp32; run a second time, it gives the noise floor;
- `fp32 accumulation, bf16 reduction`: the sum over ranks is rounded to bf16 once per micro-batch, then
  accumulated in fp32 (DeepSpeed's default, and the plain baseline's in bench/learner_multigpu.py);
- `bf16 accumulation, bf16 reduction`: the partition itself is bf16, so every micro-batch's addition rounds.

Per configuration, after the last micro-batch and before any optimizer step: the relative error of the
whole accumulated gradient against the reference (‖g − g_ref‖ / ‖g_ref‖), and the share of elements whose
error passes 1 %. Over two ranks a bf16 reduction is one rounding of one addition; a ring over N ranks
rounds at every hop, so this is a lower bound for larger worlds.

Results: bench/results/<name>.json and .md (`--results` for another folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "fp32 accumulation, fp32 reduction": {"fp32_grad_accum": True, "grad_reduce_dtype": "fp32"},
    # the reference again, in processes of its own: the noise floor (0 when the runs are bitwise repeatable)
    "fp32 accumulation, fp32 reduction, run again": {"fp32_grad_accum": True, "grad_reduce_dtype": "fp32"},
    "fp32 accumulation, bf16 reduction": {"fp32_grad_accum": True, "grad_reduce_dtype": "bf16"},
    "bf16 accumulation, bf16 reduction": {"fp32_grad_accum": False, "grad_reduce_dtype": "bf16"},
}
REFERENCE = "fp32 accumulation, fp32 reduction"


def accumulate(args: argparse.Namespace, config: str, out: Path) -> None:
    """Under torchrun: every rank runs its share of the micro-batches; rank 0 saves the full gradient."""
    import torch
    from deepspeed.utils import safe_get_full_grad

    from services.learner.batching import PackedRow
    from services.learner.config import EngineConfig, ScheduleConfig
    from services.learner.engine import PolicyEngine
    from services.learner.worker import leave_process_group
    from services.models import tiny_qwen2

    cfg = EngineConfig(
        zero_stage=3,
        precision="bf16",
        micro_batch_tokens=args.tokens,
        logprob_chunk_tokens=args.tokens,
        **CONFIGS[config],
    )
    engine = PolicyEngine(
        tiny_qwen2(tokenizer="travel", hidden=args.hidden, layers=args.layers),
        cfg,
        ScheduleConfig(lr=1e-5),
        total_steps=10,
    )
    vocab = engine.lm_config.vocab_size
    for k in range(args.micro_batches):
        g = torch.Generator().manual_seed(1000 * k + engine.rank)
        ids = torch.randint(0, vocab, (args.tokens + 1,), generator=g)
        n = args.tokens
        zeros = torch.zeros(n)
        row = PackedRow(
            input_ids=ids[:-1],
            position_ids=torch.arange(n),
            targets=ids[1:],
            mask=zeros + 1,
            old_logp=zeros,
            has_old=zeros.bool(),
            advantages=zeros,
            seq_index=torch.zeros(n, dtype=torch.long),
        )
        logp, _ = engine.logprobs(row, grad=True, with_entropy=False)
        engine.backward(-logp.float().sum() / (n * args.micro_batches))
    grads = {}
    for name, param in engine.hf_model.named_parameters():
        full = safe_get_full_grad(param)  # every rank joins the gather
        if full is not None:
            grads[name] = full.detach().double().cpu()
    if engine.rank == 0:
        torch.save(grads, out)
    engine.close()
    leave_process_group()  # together: a rank that exits first aborts its peer's gloo threads


def compare(ref: dict, other: dict) -> dict:
    num = den = 0.0
    over, total = 0, 0
    for name, g_ref in ref.items():
        diff = other[name] - g_ref
        num += float(diff.pow(2).sum())
        den += float(g_ref.pow(2).sum())
        big = g_ref.abs() > 1e-3 * g_ref.abs().max()  # elements that carry the gradient
        over += int(((diff.abs() > 0.01 * g_ref.abs()) & big).sum())
        total += int(big.sum())
    return {
        "relative_error": (num / den) ** 0.5 if den else None,
        "elements_over_1pct": over / total if total else None,
        "elements": total,
        "max_abs_grad": float(max(g.abs().max() for g in ref.values()).item()) if ref else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="tokens per micro-batch and rank")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--name", default="grad_precision")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"), help="folder for <name>.json and .md")
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.config:
        accumulate(args, args.config, Path(args.out))
        return
    if args.micro_batches < 1 or args.tokens < 2 or args.ranks < 1:
        p.error("--micro-batches ≥ 1, --tokens ≥ 2 and --ranks ≥ 1")
    import torch

    from services.learner.engine import free_port

    work = Path(tempfile.mkdtemp(prefix="grad-precision-"))
    grads, seconds = {}, {}
    for k, config in enumerate(CONFIGS):
        out = work / f"{k}.pt"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={args.ranks}",
            f"--master_port={free_port()}",
            __file__,
            "--config",
            config,
            "--out",
            str(out),
            "--micro-batches",
            str(args.micro_batches),
            "--tokens",
            str(args.tokens),
            "--hidden",
            str(args.hidden),
            "--layers",
            str(args.layers),
        ]
        print(
            f"[{time.strftime('%H:%M:%S')}] {config}: {args.ranks} ranks × {args.micro_batches} micro-batches",
            flush=True,
        )
        t0 = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"{config} failed:\n{run.stderr[-3000:]}")
        seconds[config] = round(time.perf_counter() - t0, 1)
        grads[config] = torch.load(out)
    rows = {c: {**compare(grads[REFERENCE], grads[c]), "seconds": seconds[c]} for c in CONFIGS}
    record = {
        "bench": "grad_precision",
        "ranks": args.ranks,
        "micro_batches": args.micro_batches,
        "tokens_per_micro_batch": args.tokens,
        "model": f"tiny Qwen2, hidden {args.hidden}, {args.layers} layers",
        "zero_stage": 3,
        "weights": "bf16",
        "reference": REFERENCE,
        "configs": rows,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        f"# Gradient precision of the learner's reduction and accumulation ({args.name})",
        "",
        f"DeepSpeed ZeRO-3, bf16 weights, {args.ranks} ranks over gloo (CPU), {args.micro_batches} micro-batches of "
        f"{args.tokens} tokens a rank, {record['model']}; the accumulated gradient before the optimizer step "
        f"against `{REFERENCE}` (`bench/grad_precision.py`).",
        "",
        "| configuration | relative error of the gradient | elements off by more than 1 % |",
        "|---|---|---|",
    ]
    for config, r in rows.items():
        lines.append(f"| {config} | {r['relative_error']:.2e} | {100 * r['elements_over_1pct']:.2f} % |")
    (results / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2 :]))


if __name__ == "__main__":
    main()
