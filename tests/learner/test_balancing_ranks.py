"""Two ranks (gloo, ZeRO-3): dealing rows by work instead of by tokens changes which rank trains which
sequence, but not the step's loss or gradients.

Also the script both runs launch: `torchrun --nproc_per_node 2 test_balancing_ranks.py OUT BALANCE` makes one
RL step of the tiny policy with rows dealt by BALANCE (work or tokens); rank 0 saves the loss, the gradient
norm, every weight's change (≈ lr·gradient, adam_eps 1 as in zero_update.py) and each rank's sequences."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
LENGTHS = [40, 9, 30, 22, 17, 26, 12, 35, 6, 44, 19]
CAPACITY = 48


def _run(out: Path, balance: str) -> dict:
    from services.learner.engine import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve()),
        str(out),
        balance,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


@pytest.mark.slow
def test_dealing_by_work_keeps_the_loss_and_gradients_of_dealing_by_tokens(tmp_path, tiny_model):
    tokens, work = _run(tmp_path / "tokens.pt", "tokens"), _run(tmp_path / "work.pt", "work")
    assert tokens["world"] == work["world"] == 2
    assert tokens["ranks"] != work["ranks"]  # the dealings differ, so the comparison means something
    for dealt in (tokens["ranks"], work["ranks"]):
        assert sorted(i for rank in dealt for i in rank) == list(range(len(LENGTHS)))
    assert work["loss"] == pytest.approx(tokens["loss"], rel=1e-5, abs=1e-8)
    assert work["grad_norm"] == pytest.approx(tokens["grad_norm"], rel=1e-5)
    assert work["delta"].keys() == tokens["delta"].keys()
    moved = 0
    for name, d1 in tokens["delta"].items():
        d2 = work["delta"][name]
        scale = d1.norm().item()
        moved += scale > 0
        # the same gradient summed in another order (fp32): equal to its rounding, not bit for bit
        assert (d1 - d2).norm().item() <= 1e-4 * scale + 1e-12, name
    assert moved >= 10


def main(out: Path, balance: str) -> None:
    sys.path.insert(0, str(HERE.parents[1]))
    from services.learner.batching import Sequence_
    from services.learner.config import EngineConfig, ScheduleConfig
    from services.learner.engine import PolicyEngine
    from services.learner.steps import prepare_rows, rl_step
    from services.models import tiny_qwen2

    sys.path.insert(0, str(HERE))
    from zero_update import full_weights

    engine = PolicyEngine(
        tiny_qwen2(),
        EngineConfig(zero_stage=3, micro_batch_tokens=CAPACITY, adam_eps=1.0),
        ScheduleConfig(lr=0.1),
        total_steps=10,
    )
    before = full_weights(engine)
    g = torch.Generator().manual_seed(11)
    seqs = [
        Sequence_(
            torch.randint(100, 5000, (n,), generator=g).tolist(),
            [0, 0, 0] + [1] * (n - 3),
            None,
            advantage=(1.0 if i % 2 else -0.5) * (1 + i / 10),
            index=i,
            group=f"g{i % 3}",
        )
        for i, n in enumerate(LENGTHS)
    ]
    mine = sorted(
        {i for b in prepare_rows(engine, seqs, balance=balance) for i in b.seq_index.flatten().tolist() if i >= 0}
    )
    ranks: list = [None] * engine.world_size
    torch.distributed.all_gather_object(ranks, mine)
    metrics = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28, loss_agg="seq-mean-token-mean", balance=balance).metrics
    after = full_weights(engine)
    if engine.rank == 0:
        torch.save(
            {
                "delta": {n: after[n] - before[n] for n in after},
                "loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"],
                "world": engine.world_size,
                "ranks": ranks,
            },
            out,
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
