"""The GPU chaos benchmark's own logic (bench/chaos.py gpu), on CPU: each fault's recipe and layout, the
fault moments, the restart and recovery reads and the end-of-run checks of the rollout servers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from bench import chaos
from services.pipeline.config import load_pipeline_config
from services.pipeline.placement import plan, weight_sync

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fault", list(chaos.GPU_FAULTS))
def test_each_faults_recipe_puts_the_learner_and_one_engine_on_gpus_of_their_own_with_weights_over_nccl(fault):
    config = load_pipeline_config(ROOT / "configs" / "tiny.yaml", chaos.gpu_sets(fault, "/models/smollm"))
    assert config.model.path == "/models/smollm" and config.model.tiny is None
    assert config.services.engine == "vllm" and config.rl.sampling.forced_turns is not None
    ranks = chaos.GPU_FAULTS[fault]
    assert config.deployment.learner_ranks == ranks == (2 if fault == "learner_rank1" else 1)
    gpus = [str(i) for i in range(ranks + 1)]  # the GPUs the benchmark hands the run
    placement = plan(config.deployment, config.services.rollout_workers, gpus)
    assert placement.learner_devices == tuple(gpus[:ranks]) and placement.engine_devices == ((gpus[-1],),)
    assert weight_sync(config.deployment, config.services.engine, placement).method == "nccl"


def test_on_two_gpus_the_2_rank_fault_puts_its_engine_beside_rank_1_and_keeps_nccl():
    assert chaos.gpus_needed("learner_rank1", 4) == (3, False)
    assert chaos.gpus_needed("learner_rank1", 2) == (2, True)
    assert chaos.gpus_needed("learner_broadcast", 2) == (2, False)
    config = load_pipeline_config(
        ROOT / "configs" / "tiny.yaml", chaos.gpu_sets("learner_rank1", "/models/smollm", share=True)
    )
    placement = plan(config.deployment, config.services.rollout_workers, ["0", "1"])
    assert placement.learner_devices == ("0", "1") and placement.engine_devices == (("1",),)
    assert weight_sync(config.deployment, config.services.engine, placement).method == "nccl"


def test_the_cpu_smoke_keeps_the_tiny_policy_on_the_transformers_engine():
    config = load_pipeline_config(ROOT / "configs" / "tiny.yaml", chaos.gpu_sets("learner_rank1", None, smoke=True))
    assert config.model.tiny is not None and config.services.engine == "transformers"
    assert config.deployment.learner_ranks == 2 and config.deployment.weight_sync == "auto"


def test_rank_of_reads_torchruns_rank_from_an_environ_block():
    assert chaos.rank_of(b"PATH=/bin\0LOCAL_RANK=0\0RANK=1\0WORLD_SIZE=2\0") == 1
    assert chaos.rank_of(b"PATH=/bin\0LOCAL_RANK=1\0") is None  # LOCAL_RANK is not RANK
    assert chaos.rank_of(b"RANK=x\0") is None


def test_restarted_names_the_processes_replaced_or_gone():
    before = {"learner": 10, "rollout-0": 11, "reward-0": 12}
    assert chaos.restarted(before, {"learner": 20, "rollout-0": 11, "reward-0": 12}) == ["learner"]
    assert chaos.restarted(before, {"learner": 10, "reward-0": 12}) == ["rollout-0"]
    assert chaos.restarted(before, dict(before)) == []


def test_a_step_is_under_way_once_a_whole_batch_beyond_the_consumed_ones_is_scored():
    assert not chaos.step_under_way(batches=2, scored=11, per_step=4)
    assert chaos.step_under_way(batches=2, scored=12, per_step=4)


SERVER = "http://127.0.0.1:9"


def test_server_problems_flag_silent_broken_paused_and_behind_servers():
    ok = {"version": 5, "broken": None, "receiving": None}
    assert chaos.server_problems({SERVER: ok}, 5) == []
    assert chaos.server_problems({SERVER: None}, 5) == [f"{SERVER}: never answered"]
    assert "broken" in chaos.server_problems({SERVER: {**ok, "broken": "a broadcast failed"}}, 5)[0]
    assert (
        "left receiving version 6"
        in chaos.server_problems({SERVER: {**ok, "receiving": {"version": 6, "via": "nccl"}}}, 5)[0]
    )
    assert chaos.server_problems({SERVER: ok}, 6) == [f"{SERVER}: on version 5, not 6"]


def test_recovered_needs_training_past_the_kill_and_every_server_on_the_published_version():
    ok = {"version": 7, "broken": None, "receiving": None}
    assert chaos.recovered(5, 4, {SERVER: ok}, 7)
    assert not chaos.recovered(4, 4, {SERVER: ok}, 7)  # no step trained since the kill
    assert not chaos.recovered(5, 4, {SERVER: None}, 7)  # the server is restarting
    assert not chaos.recovered(5, 4, {SERVER: {**ok, "version": 6}}, 7)  # it lags the learner


def test_the_gpu_pool_hands_out_disjoint_sets_and_a_run_waits_for_enough():
    pool = chaos.GpuPool(["0", "1", "2", "3"])
    a, b = pool.take(2), pool.take(2)
    assert set(a).isdisjoint(b) and sorted(a + b) == ["0", "1", "2", "3"]
    got: list[list[str]] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(3)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # 3 GPUs are not free yet
    pool.give(a)
    time.sleep(0.1)
    assert not got
    pool.give(b)
    waiter.join(5)
    assert got == [["0", "1", "2"]]


def test_the_report_has_a_row_per_fault_with_its_verdict():
    row = {
        "fault": "rollout_receive",
        "learner_ranks": 1,
        "gpus": ["2", "3"],
        "steps": 12,
        "injected": True,
        "killed": "rollout-0",
        "injected_s": 80.2,
        "injected_at_step": 3,
        "restarted": ["learner", "rollout-0"],
        "recovery_s": 151.0,
        "steps_trained": 12,
        "lost": 0,
        "duplicated": 0,
        "servers_at_end": "ok",
        "exit_code": 0,
        "passed": True,
    }
    text = chaos.report_gpu(
        {
            "faults": {
                "rollout_receive": row,
                "learner_rank1": {"fault": "learner_rank1", "error": "boom", "passed": False},
            },
            "steps": 12,
            "model": "m",
            "engine": "vLLM",
            "machine": "4× H100",
        }
    )
    assert (
        "| rollout_receive | 1 + 1 (2,3) | rollout-0 | 80.2, 3 | learner, rollout-0 | 151.0 | 12 / 12 | 0 | 0 | ok"
        in text
    )
    assert "| learner_rank1 |" in text and "boom" in text and "learner_broadcast |" not in text
