"""The learner's launch: torchrun for several ranks, refusals with numbers, ranks that stop together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.learner.launch import RankError, resolve_ranks, worker_argv

ROOT = Path(__file__).resolve().parents[2]


def test_one_rank_is_a_plain_process_several_go_under_torchrun(tmp_path):
    assert worker_argv("sft", tmp_path / "c.json", 1)[1:] == ["-m", "services.learner.worker", "sft",
                                                               str(tmp_path / "c.json")]
    argv = worker_argv("rl", "c.json", 4, max_steps=3)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert argv[argv.index("--nproc_per_node") + 1] == "4"
    assert argv[-5:] == ["-m", "services.learner.worker", "rl", "c.json", "3"]


def test_ranks_default_to_the_gpus_and_more_than_the_gpus_are_refused():
    assert resolve_ranks(None, gpus=0) == 1
    assert resolve_ranks(None, gpus=8) == 8
    assert resolve_ranks(3, gpus=0) == 3  # gloo ranks on CPU
    assert resolve_ranks(2, gpus=2) == 2
    with pytest.raises(RankError, match="asks for 4 ranks, one GPU each, but this machine shows 2 GPUs"):
        resolve_ranks(4, gpus=2)


def test_runs_api_refuses_more_ranks_than_gpus(tmp_path, tiny_model, monkeypatch):
    from services.learner import launch
    from services.learner.runs import RunConfigError, RunManager, RunRequest

    monkeypatch.setattr(launch, "visible_gpus", lambda: 1)
    manager = RunManager(tmp_path)
    request = RunRequest(kind="rl", config={"model": str(tiny_model), "engine": {"ranks": 2}})
    with pytest.raises(RunConfigError, match="asks for 2 ranks.*shows 1 GPU"):
        manager.start(request)
    assert list(tmp_path.iterdir()) == []  # nothing started, no run folder


def test_star_sft_refuses_more_ranks_than_gpus(tmp_path, tiny_model):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    config = tmp_path / "sft.json"
    config.write_text(f'{{"model": "{tiny_model}", "data": "{data}", "output_dir": "{tmp_path / "out"}", '
                      '"engine": {"ranks": 2}}')
    # this machine has no GPU (CPU ranks are allowed): the CLI runs in a process that sees one
    code = ("import sys; from services.learner import launch; launch.visible_gpus = lambda: 1; "
            "from services.cli import app; sys.argv = ['star', 'sft', sys.argv[1]]; app()")
    done = subprocess.run([sys.executable, "-c", code, str(config)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "asks for 2 ranks" in done.stderr and "shows 1 GPU" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_star_sft_runs_two_ranks_under_torchrun(tmp_path, tiny_model):
    import json
    import os

    from services.learner.trainer import read_status

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"plan a trip {i}"},
                                                     {"role": "assistant", "content": f"day {i}"}]}) + "\n"
                            for i in range(8)))
    config = tmp_path / "sft.json"
    config.write_text(json.dumps({"model": str(tiny_model), "data": str(data), "output_dir": str(tmp_path / "out"),
                                  "batch_size": 4, "engine": {"ranks": 2, "micro_batch_tokens": 64}}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "services.cli", "sft", str(config), "--max-steps", "2"], cwd=ROOT,
                          env={**env, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sft: 2 ranks under torchrun" in done.stderr
    status = read_status(tmp_path / "out")
    assert status["state"] == "finished" and status["step"] == 2
    assert (Path(status["export"]) / "config.json").is_file()
