"""Several processes: ZeRO-2 and ZeRO-3 over 2 ranks (gloo) make the same update as 1 rank, and ZeRO-3's
exported weights are the whole, gathered ones; the broadcast weight path copies a version into a
receiver's live model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.learner.engine import free_port

HERE = Path(__file__).resolve().parent


def _torchrun(
    n: int,
    out: Path,
    stage: int = 2,
    accelerator: str = "cpu",
    precision: str = "auto",
    recompute: str = "none",
    persist_gib: float = 0.0,
) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["DS_ACCELERATOR"] = accelerator
    if accelerator == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(n),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(HERE / "zero_update.py"),
        str(out),
        str(stage),
        precision,
        recompute,
        str(persist_gib),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def _same_update(one: dict, two: dict, rel: float = 1e-4) -> float:
    """The same step: loss, gradient norm and every weight's change, to `rel` of its size (the rounding
    of a different summation order in fp32; bf16 weights round each change to 8 bits)."""
    assert two["loss"] == pytest.approx(one["loss"], rel=rel / 10, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=rel)
    assert one["delta"].keys() == two["delta"].keys()
    moved, worst = 0, 0.0
    for name, d1 in one["delta"].items():
        d2 = two["delta"][name]
        assert d1.shape == d2.shape, name  # whole weights, not a rank's shard
        scale = d1.norm().item()
        moved += scale > 0
        # the update is ≈ lr·g (zero_update.py), so the two agree as their gradient sums do: to the
        # rounding of a different summation order, not bit for bit
        gap = (d1 - d2).norm().item()
        assert gap <= rel * scale + 1e-12, name
        worst = max(worst, gap / scale if scale else 0.0)
    assert moved >= 10  # the step changed the weights, so the comparison means something
    return worst


@pytest.mark.slow
def test_zero2_two_ranks_match_one(tmp_path, tiny_model):
    one, two = _torchrun(1, tmp_path / "one.pt"), _torchrun(2, tmp_path / "two.pt")
    assert (one["world"], two["world"]) == (1, 2)
    _same_update(one, two)


@pytest.mark.slow
def test_zero3_two_ranks_match_one_rank_and_export_whole_weights(tmp_path, tiny_model):
    from services.weights.files import load_state_dict

    one = _torchrun(1, tmp_path / "one.pt", stage=2)
    three = _torchrun(2, tmp_path / "three.pt", stage=3)
    assert (three["world"], three["stage"]) == (2, 3)
    assert three["partitioned"]  # ZeRO-3 really sharded the parameters (built under zero.Init)
    assert three["layer_units"] == three["layers"] > 0  # each decoder layer gathered and reduced as one unit
    assert 0 < three["whole"] < three["weights"]  # only the small ones (norms) stay whole; the rest are gathered
    _same_update(one, three)
    # the exported HF folder holds the gathered weights, equal to the unsharded run's
    exported = load_state_dict(Path(three["export"]))
    reference = load_state_dict(Path(one["export"]))
    assert exported.keys() == reference.keys() and len(exported) >= 10
    for name, tensor in reference.items():
        assert exported[name].shape == tensor.shape, name
        assert torch.allclose(exported[name], tensor, rtol=0, atol=1e-5), name
        assert torch.equal(exported[name], three["after"][name]), name


@pytest.mark.slow
def test_zero3_whole_weights_and_layer_units_under_gradient_checkpointing_match_one_rank(tmp_path, tiny_model):
    """ZeRO-3 with the weights kept whole within a budget (gradients and Adam state still sharded), each
    decoder layer one unit, while backward runs each layer's forward again (the GPU recipes' gradient
    checkpointing): the same update as one rank, the updated whole weights gathered again after the step."""
    one = _torchrun(1, tmp_path / "one.pt", stage=2)
    three = _torchrun(2, tmp_path / "three.pt", stage=3, recompute="layers", persist_gib=4.0)
    assert three["layer_units"] == three["layers"] > 0
    assert three["whole"] == three["weights"]  # the tiny model fits the budget whole
    _same_update(one, three)
    for name, tensor in three["after"].items():  # what the next step computes with is the updated weight
        assert torch.allclose(tensor, one["after"][name], rtol=0, atol=1e-5), name


@pytest.mark.gpu
@pytest.mark.parametrize("precision,rel", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_zero3_on_two_gpus_matches_one_gpu(tmp_path, tiny_model, precision, rel):
    """The same ZeRO-3 step over NCCL on two GPUs as on one (fp32 without TF32: to the summation order;
    bf16: to its rounding), and the export whole."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from services.weights.files import load_state_dict

    one = _torchrun(1, tmp_path / "one.pt", stage=3, accelerator="cuda", precision=precision)
    two = _torchrun(2, tmp_path / "two.pt", stage=3, accelerator="cuda", precision=precision)
    assert (one["world"], two["world"], two["stage"]) == (1, 2, 3)
    assert two["device"].startswith("cuda") and two["bf16"] == (precision == "bf16") and two["partitioned"]
    worst = _same_update(one, two, rel=rel)
    print(
        json.dumps(
            {
                "precision": precision,
                "loss": [one["loss"], two["loss"]],
                "grad_norm": [one["grad_norm"], two["grad_norm"]],
                "max_rel_weight_change_gap": worst,
            }
        )
    )
    exported = load_state_dict(Path(two["export"]))
    assert exported.keys() == two["after"].keys()
    for name, tensor in two["after"].items():
        assert torch.equal(exported[name].float(), tensor), name
