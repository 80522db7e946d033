"""One RL step of the tiny policy under ZeRO, as a script:
`torchrun --nproc_per_node N zero_update.py OUT [STAGE [PRECISION [RECOMPUTE [PERSIST_GIB]]]]` (STAGE 2, precision
auto, RECOMPUTE none (or mlp, layers) and PERSIST_GIB 0 (every weight sharded) unless given;
`DS_ACCELERATOR=cuda` runs it on the GPUs, one per rank).

Rank 0 saves the full weights before and after the step (gathered, under ZeRO-3), their change, and
the exported HF folder of the new weights (every rank joins its gather), for the comparisons of
test_distributed.py."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from deepspeed.utils import get_z3_leaf_modules

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.learner.batching import Sequence_  # noqa: E402
from services.learner.config import EngineConfig, ScheduleConfig  # noqa: E402
from services.learner.engine import PolicyEngine  # noqa: E402
from services.learner.steps import rl_step  # noqa: E402
from services.learner.trainer import export_model  # noqa: E402
from services.models import tiny_qwen2  # noqa: E402


def full_weights(engine: PolicyEngine) -> dict[str, torch.Tensor]:
    """Every HF-named weight, whole, as rank 0 receives it (every rank must call this)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in engine.iter_weight_buckets(bucket_bytes=2**20):
        out.update({n: t.detach().float().cpu().clone() for n, t in bucket.tensors().items()})
    return out


def main(out: Path, stage: int, precision: str = "auto", recompute: str = "none", persist_gib: float = 0.0) -> None:
    # adam_eps 1: Adam's first update is lr·g/(|g| + 1) ≈ lr·g, so the weight change is the gradient
    # itself. With the default eps it is ≈ lr·sign(g), where a gradient near eps flips with the
    # summation order (1 rank against a reduce over 2) and the comparison becomes a coin toss.
    engine = PolicyEngine(
        tiny_qwen2(),
        EngineConfig(
            zero_stage=stage,
            micro_batch_tokens=48,
            adam_eps=1.0,
            precision=precision,
            recompute_mlp=recompute == "mlp",
            gradient_checkpointing=recompute == "layers",
            persistent_weights_gib=persist_gib,
        ),
        ScheduleConfig(lr=0.1),
        total_steps=10,
    )
    before = full_weights(engine)
    g = torch.Generator().manual_seed(7)
    seqs = [
        Sequence_(
            torch.randint(100, 5000, (n,), generator=g).tolist(),
            [0, 0, 0] + [1] * (n - 3),
            None,
            advantage=(1.0 if i % 2 else -0.5) * (1 + i / 10),
            index=i,
        )
        for i, n in enumerate([30, 22, 17, 40, 9, 26])
    ]
    metrics = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28).metrics
    after = full_weights(engine)
    export = export_model(engine, out.parent / f"{out.stem}-export", engine.step_count)
    if engine.rank == 0:
        torch.save(
            {
                "delta": {n: after[n] - before[n] for n in after},
                "after": after,
                "loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"],
                "world": engine.world_size,
                "stage": stage,
                "device": str(next(engine.hf_model.parameters()).device),
                "bf16": engine.bf16,
                "partitioned": any(hasattr(p, "ds_id") for p in engine.hf_model.parameters()),
                "layer_units": len(get_z3_leaf_modules(engine.hf_model)),
                "layers": engine.lm_config.num_hidden_layers,
                "whole": sum(getattr(p, "ds_persist", False) for p in engine.hf_model.parameters()),
                "weights": sum(1 for _ in engine.hf_model.parameters()),
                "export": str(export),
            },
            out,
        )


if __name__ == "__main__":
    if torch.cuda.is_available():
        # fp32 means fp32: no TF32 matmuls, so 1 and 2 ranks differ only by the summation order
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    main(
        Path(sys.argv[1]),
        int(sys.argv[2]) if len(sys.argv) > 2 else 2,
        sys.argv[3] if len(sys.argv) > 3 else "auto",
        sys.argv[4] if len(sys.argv) > 4 else "none",
        float(sys.argv[5]) if len(sys.argv) > 5 else 0.0,
    )
