"""Stop paths of a 2-rank learner under torchrun (gloo on CPU): none may leave a rank hanging.

- no data reaches rank 0: every rank is told and the run ends as failed (not rank 0 alone), also when the
  wait outlasts the process group's default timeout, in which the other ranks sit in a broadcast;
- SIGTERM: the ranks agree on stopping at the step boundary, the run ends as stopped, the launcher exits 0;
- a rank killed outright: torchrun takes the other down and exits non-zero, naming the failure."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from services.learner.config import EngineConfig, RLConfig
from services.learner.launch import worker_argv, worker_env
from services.learner.trainer import read_status

ROOT = Path(__file__).resolve().parents[2]


def _start(
    tmp: Path, model: Path, redis_url: str, wait_s: float, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path]:
    cfg = RLConfig(
        model=str(model),
        output_dir=str(tmp / "rl"),
        group_size=2,
        batch_prompts=2,
        total_steps=5,
        redis_url=redis_url,
        stream_prefix=f"test:{uuid.uuid4().hex[:8]}",
        wait_timeout_s=wait_s,
        read_block_ms=200,
        publish_weights=False,
        engine=EngineConfig(micro_batch_tokens=64, ranks=2),
    )
    path = tmp / "rl.json"
    path.write_text(cfg.model_dump_json())
    env = {**os.environ, **worker_env(2), "DS_ACCELERATOR": "cpu", **(env_extra or {})}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    log = open(tmp / "log.txt", "wb")
    proc = subprocess.Popen(
        worker_argv("rl", path, 2), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, tmp / "rl"


def _ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    return [
        c
        for c in psutil.Process(proc.pid).children(recursive=True)
        if "services.learner.worker" in " ".join(c.cmdline())
    ]


def _leftover(config: Path) -> list[int]:
    """Processes still running this run's config (ranks left behind)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if str(config) in " ".join(p.info["cmdline"] or []):
            out.append(p.info["pid"])
    return out


def _wait_running(proc: subprocess.Popen, out: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while read_status(out).get("state") != "running":
        assert proc.poll() is None, (out.parent / "log.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "the learner did not start"
        time.sleep(1)


def _finish(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the ranks hung for more than {timeout:.0f} s")


@pytest.mark.slow
def test_no_data_on_rank_zero_ends_every_rank(tmp_path, tiny_model, redis_server_url):
    proc, out = _start(tmp_path, tiny_model, redis_server_url, wait_s=5)
    rc = _finish(proc, 500)
    log = (tmp_path / "log.txt").read_text()
    assert rc != 0, log[-3000:]
    status = read_status(out)
    assert status["state"] == "failed" and "no complete group arrived within 5 s" in status["metrics"]["error"]
    assert not _leftover(tmp_path / "rl.json")


@pytest.mark.slow
def test_sigterm_stops_both_ranks_at_a_step_boundary(tmp_path, tiny_model, redis_server_url):
    proc, out = _start(tmp_path, tiny_model, redis_server_url, wait_s=3600)
    _wait_running(proc, out)
    ranks = _ranks(proc)
    assert len(ranks) == 2
    # the signal reaches one rank first (as from a launcher that delivers late to the other)
    ranks[1].send_signal(signal.SIGTERM)
    time.sleep(2)
    os.kill(proc.pid, signal.SIGTERM)
    t0 = time.monotonic()
    rc = _finish(proc, 200)
    log = (tmp_path / "log.txt").read_text()
    assert read_status(out)["state"] == "stopped", log[-3000:]
    assert rc == 0, log[-3000:]  # a clean stop is a clean exit, of the launcher too
    # both ranks ended on their own, before torchrun's grace ran out and it killed them
    assert time.monotonic() - t0 < 100, log[-3000:]
    assert "SIGKILL" not in log, log[-3000:]
    assert not _leftover(tmp_path / "rl.json")


@pytest.mark.slow
def test_a_killed_rank_takes_the_run_down(tmp_path, tiny_model, redis_server_url):
    proc, out = _start(tmp_path, tiny_model, redis_server_url, wait_s=3600)
    _wait_running(proc, out)
    ranks = _ranks(proc)
    victim = next(r for r in ranks if "RANK=1" in "".join(f"{k}={v}" for k, v in r.environ().items() if k == "RANK"))
    victim.kill()
    rc = _finish(proc, 200)
    assert rc != 0
    log = (tmp_path / "log.txt").read_text()
    assert "Signal 9" in log or "SIGKILL" in log, log[-3000:]  # torchrun names the failed rank's end
    time.sleep(1)
    assert not _leftover(tmp_path / "rl.json")


@pytest.mark.slow
def test_ranks_waiting_in_a_broadcast_outlast_the_default_collective_timeout(tmp_path, tiny_model, redis_server_url):
    """DeepSpeed's process-group timeout cut to 1 minute (its least), rank 0 waiting 66 s for data: rank 1
    waits in the step's broadcast all that time, and the run ends on rank 0's NoData, not on a collective
    timeout."""
    proc, out = _start(tmp_path, tiny_model, redis_server_url, wait_s=66, env_extra={"DEEPSPEED_TIMEOUT": "1"})
    rc = _finish(proc, 600)
    log = (tmp_path / "log.txt").read_text()
    assert rc != 0, log[-3000:]
    status = read_status(out)
    assert "no complete group arrived within 66 s" in status["metrics"]["error"], log[-3000:]
    assert "Timed out" not in log and not _leftover(tmp_path / "rl.json")
