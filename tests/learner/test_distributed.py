"""Several processes: ZeRO-2 and ZeRO-3 over 2 ranks (gloo) make the same update as 1 rank, and ZeRO-3's
exported weights are the whole, gathered ones; the broadcast weight path copies a version into a
receiver's live model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.learner.engine import free_port

HERE = Path(__file__).resolve().parent


def _torchrun(n: int, out: Path, stage: int = 2) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["DS_ACCELERATOR"] = "cpu"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(HERE / "zero_update.py"), str(out), str(stage)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def _same_update(one: dict, two: dict) -> None:
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    assert one["delta"].keys() == two["delta"].keys()
    moved = 0
    for name, d1 in one["delta"].items():
        d2 = two["delta"][name]
        assert d1.shape == d2.shape, name  # whole weights, not a rank's shard
        scale = d1.norm().item()
        moved += scale > 0
        # the update is ≈ lr·g (zero_update.py), so the two agree as their gradient sums do: to the
        # rounding of a different summation order, not bit for bit
        assert (d1 - d2).norm().item() <= 1e-4 * scale + 1e-12, name
    assert moved >= 10  # the step changed the weights, so the comparison means something


@pytest.mark.slow
def test_zero2_two_ranks_match_one(tmp_path, tiny_model):
    one, two = _torchrun(1, tmp_path / "one.pt"), _torchrun(2, tmp_path / "two.pt")
    assert (one["world"], two["world"]) == (1, 2)
    _same_update(one, two)


@pytest.mark.slow
def test_zero3_two_ranks_match_one_rank_and_export_whole_weights(tmp_path, tiny_model):
    from services.learner.weights import load_state_dict

    one = _torchrun(1, tmp_path / "one.pt", stage=2)
    three = _torchrun(2, tmp_path / "three.pt", stage=3)
    assert (three["world"], three["stage"]) == (2, 3)
    assert three["partitioned"]  # ZeRO-3 really sharded the parameters (built under zero.Init)
    _same_update(one, three)
    # the exported HF folder holds the gathered weights, equal to the unsharded run's
    exported = load_state_dict(Path(three["export"]))
    reference = load_state_dict(Path(one["export"]))
    assert exported.keys() == reference.keys() and len(exported) >= 10
    for name, tensor in reference.items():
        assert exported[name].shape == tensor.shape, name
        assert torch.allclose(exported[name], tensor, rtol=0, atol=1e-5), name
        assert torch.equal(exported[name], three["after"][name]), name
