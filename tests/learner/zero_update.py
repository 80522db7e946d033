"""One RL step of the tiny policy under ZeRO-2, as a script: `torchrun --nproc_per_node N zero_update.py OUT`.

Rank 0 saves the weight change of every parameter to OUT, for the 1-vs-2-process comparison."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.models import tiny_qwen2  # noqa: E402
from services.learner.batching import Sequence_  # noqa: E402
from services.learner.config import EngineConfig, ScheduleConfig  # noqa: E402
from services.learner.engine import PolicyEngine  # noqa: E402
from services.learner.steps import rl_step  # noqa: E402


def main(out: Path) -> None:
    # adam_eps 1: Adam's first update is lr·g/(|g| + 1) ≈ lr·g, so the weight change is the gradient
    # itself. With the default eps it is ≈ lr·sign(g), where a gradient near eps flips with the
    # summation order (1 rank against a reduce over 2) and the comparison becomes a coin toss.
    engine = PolicyEngine(tiny_qwen2(), EngineConfig(zero_stage=2, micro_batch_tokens=48, adam_eps=1.0),
                          ScheduleConfig(lr=0.1), total_steps=10)
    before = {n: p.detach().clone() for n, p in engine.hf_model.named_parameters()}
    g = torch.Generator().manual_seed(7)
    seqs = [Sequence_(torch.randint(100, 5000, (n,), generator=g).tolist(), [0, 0, 0] + [1] * (n - 3), None,
                      advantage=(1.0 if i % 2 else -0.5) * (1 + i / 10), index=i)
            for i, n in enumerate([30, 22, 17, 40, 9, 26])]
    metrics = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28).metrics
    if engine.rank == 0:
        delta = {n: p.detach() - before[n] for n, p in engine.hf_model.named_parameters()}
        torch.save({"delta": delta, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                    "world": engine.world_size}, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
