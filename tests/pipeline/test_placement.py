"""Placement: the devices each process of a run gets for several layouts, and the refusals with numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.pipeline.config import DeploymentSpec
from services.pipeline.placement import PlacementError, plan

GPUS8 = [str(i) for i in range(8)]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_cpu_machine_puts_everything_on_cpu():
    p = plan(DeploymentSpec(learner_ranks=2), engines=3, gpus=[])
    assert p.accelerator == "cpu" and p.learner_ranks == 2
    assert p.learner_env() == {"DS_ACCELERATOR": "cpu"}
    assert p.engine_devices_env(0) == {} and p.engine_settings(0) == {}


def test_dedicated_gpus_learner_first_then_engines_by_tensor_parallel_groups():
    p = plan(DeploymentSpec(learner_ranks=2, engine_tensor_parallel=2), engines=3, gpus=GPUS8)
    assert not p.shared
    assert p.learner_devices == ("0", "1")
    assert p.engine_devices == (("2", "3"), ("4", "5"), ("6", "7"))
    assert p.learner_env() == {"DS_ACCELERATOR": "cuda", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert p.engine_devices_env(2) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    engine = p.engine_settings(2)
    assert engine["tensor_parallel_size"] == 2
    assert engine["gpu_memory_utilization"] == pytest.approx(0.9)
    assert "kv_cache_from_share" not in engine  # a GPU of its own: vLLM measures


def test_ids_follow_the_callers_visible_devices():
    p = plan(DeploymentSpec(learner_ranks=1), engines=1, gpus=["4", "6"])
    assert p.learner_devices == ("4",) and p.engine_devices == (("6",),)


def test_one_gpu_box_shares_by_memory():
    p = plan(DeploymentSpec(), engines=2, gpus=["0"])
    assert p.shared
    assert p.learner_devices == ("0",) and p.engine_devices == (("0",), ("0",))
    # the learner keeps 0.4, the two engines split the rest
    assert p.engine_memory_share == pytest.approx(0.3)
    assert p.engine_devices_env(1)["CUDA_VISIBLE_DEVICES"] == "0"
    # beside the learner, vLLM's start-up measurement would count the learner's allocations as its own
    assert p.engine_settings(1)["kv_cache_from_share"] is True


def test_sharing_fills_gpus_without_the_learner_first():
    p = plan(DeploymentSpec(learner_ranks=2), engines=4, gpus=["0", "1", "2", "3"])
    assert p.shared  # 2 + 4 > 4
    # then beside rank 1 before rank 0, whose GPU the weights' NCCL group cannot share
    assert p.engine_devices == (("2",), ("3",), ("1",), ("0",))
    assert p.engine_memory_share == pytest.approx(0.6)  # the learner's GPUs are the fullest


def test_explicit_share_that_overfills_a_gpu_is_refused_with_the_numbers():
    with pytest.raises(PlacementError) as err:
        plan(DeploymentSpec(engine_memory_share=0.5), engines=2, gpus=["0"])
    text = str(err.value)
    assert "2 engine(s) × 0.50" in text and "learner 0.40" in text and "1.40" in text and "0.30" in text


def test_too_many_learner_ranks_refused():
    with pytest.raises(PlacementError, match=r"learner_ranks 4 needs 4 GPUs.*shows 2"):
        plan(DeploymentSpec(learner_ranks=4), engines=1, gpus=["0", "1"])


def test_dedicated_layout_that_does_not_fit_refused():
    with pytest.raises(PlacementError) as err:
        plan(DeploymentSpec(learner_ranks=2, share_gpus=False), engines=8, gpus=GPUS8)
    assert "2 learner GPU(s) + 8 engine(s) × 1 GPU(s) = 10 GPUs" in str(err.value)
    assert "shows 8" in str(err.value)


def test_tensor_parallel_wider_than_the_machine_refused():
    with pytest.raises(PlacementError, match="engine_tensor_parallel 4 needs 4 GPUs per engine; this machine shows 2"):
        plan(DeploymentSpec(engine_tensor_parallel=4), engines=1, gpus=["0", "1"])


def test_too_many_engines_on_one_gpu_refused():
    with pytest.raises(PlacementError, match=r"puts 16 engine\(s\) on GPU 0, leaving each 0\.03"):
        plan(DeploymentSpec(), engines=16, gpus=["0"])


def test_recipe_section_is_typed():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        DeploymentSpec(learner_ranks=0)
    with pytest.raises(ValidationError):
        DeploymentSpec(gpu_count=3)  # unknown key


def test_the_recipe_deployment_reaches_the_learner_launch_and_its_config(tmp_path):
    from services.common.streams import StreamNames
    from services.controller.learner_config import rl_config
    from services.learner.config import RLConfig
    from services.pipeline.config import load_pipeline_config
    from services.pipeline.placement import placement_for
    from services.pipeline.stage import Run

    # the recipe's ranks set: the deployment's own plan (left unset, the machine decides: test_placement_derived.py)
    config = load_pipeline_config(CONFIGS / "qwen2.5-7b-grpo-sum.yaml", ["deployment.learner_ranks=4"])
    placement = placement_for(config.deployment, config.services.rollout_workers, GPUS8)
    run = Run(config, tmp_path, placement=placement)
    path = rl_config(run, "model", StreamNames("t"), "redis://x", total_steps=4)
    engine = RLConfig.model_validate_json(path.read_text()).engine
    assert engine.ranks == 4 and engine.gradient_checkpointing and engine.zero_stage == 3
    argv, env = run.learner_launch("rl", path)
    assert "services.learner.launch" in argv and argv[argv.index("--nproc_per_node") + 1] == "4"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and env["DS_ACCELERATOR"] == "cuda"
    assert placement.engine_devices_env(0)["CUDA_VISIBLE_DEVICES"] == "4"


def test_star_train_refuses_a_layout_the_machine_cannot_hold_before_starting(tmp_path, monkeypatch):
    from services.controller.train import StageFailed, prepare
    from services.pipeline import placement as placement_module
    from services.pipeline.config import load_pipeline_config

    monkeypatch.setattr(placement_module, "visible_gpu_ids", lambda: ["0", "1"])
    config = load_pipeline_config(CONFIGS / "tiny.yaml", ["deployment.learner_ranks=3"])
    with pytest.raises(StageFailed, match="learner_ranks 3 needs 3 GPUs, one per rank; this machine shows 2"):
        prepare(config, tmp_path / "run")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_validations_run_on_the_first_engines_gpus():
    dedicated = plan(DeploymentSpec(learner_ranks=2, engine_tensor_parallel=2), engines=2, gpus=GPUS8)
    assert dedicated.validation_env() == {"CUDA_VISIBLE_DEVICES": "2,3"}
    shared = plan(DeploymentSpec(learner_ranks=2), engines=4, gpus=["0", "1", "2", "3"])
    assert shared.validation_env() == {"CUDA_VISIBLE_DEVICES": "2"}  # a GPU without the learner
    assert plan(DeploymentSpec(), engines=1, gpus=[]).validation_env() == {}


def test_a_validation_process_gets_its_devices_from_the_placement(tmp_path, monkeypatch):
    """The `star eval` a validation starts sees only the devices the placement gives it."""
    import sys

    from services.controller.validation import Validation
    from services.pipeline import stage
    from services.pipeline.config import load_pipeline_config
    from services.pipeline.stage import Run

    probe = "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))"
    seen = tmp_path / "devices.txt"
    monkeypatch.setattr(
        stage,
        "eval_argv",
        lambda run, model, split, out, limit, memory_share=None: [sys.executable, "-c", probe, str(seen)],
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = load_pipeline_config(CONFIGS / "tiny.yaml", ["services.rollout_workers=2"])
    run = Run(config, tmp_path / "run", placement=plan(config.deployment, 2, ["0", "1", "2"]))
    validation = Validation(run, "val.jsonl", every=1)
    validation.submit(0, str(tmp_path), keep=False)
    validation.running[2].proc.wait(30)
    assert seen.read_text() == "1"


def test_validations_count_as_one_more_engine_beside_the_first():
    p = plan(DeploymentSpec(), engines=1, gpus=["0"], validations=True)
    # the learner keeps 0.4; the engine and a validation's engine split the rest
    assert p.engine_memory_share == pytest.approx(0.3) and p.validation_memory_share == pytest.approx(0.3)
    alone = plan(DeploymentSpec(learner_ranks=2), engines=2, gpus=["0", "1", "2", "3"], validations=True)
    assert not alone.shared and alone.engine_memory_share == pytest.approx(0.45)
    assert plan(DeploymentSpec(), engines=1, gpus=["0"]).validation_memory_share is None


def test_a_validation_share_of_its_own_is_kept_before_the_engines_split_the_rest():
    p = plan(DeploymentSpec(validation_memory_share=0.12), engines=1, gpus=["0"], validations=True)
    assert p.engine_memory_share == pytest.approx(0.48) and p.validation_memory_share == pytest.approx(0.12)
    assert "validations beside engine 0 at 0.12" in p.describe()


def test_a_validation_that_overfills_the_first_engines_gpu_is_refused_with_the_numbers():
    spec = DeploymentSpec(engine_memory_share=0.5, validation_memory_share=0.2)
    assert plan(spec, engines=1, gpus=["0"]).engine_memory_share == pytest.approx(0.5)  # no validations: fits
    with pytest.raises(PlacementError) as err:
        plan(spec, engines=1, gpus=["0"], validations=True)
    assert "1 engine(s) × 0.50 + learner 0.40 + validation 0.20 = 1.10" in str(err.value)
