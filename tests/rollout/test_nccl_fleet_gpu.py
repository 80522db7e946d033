"""Weights over NCCL into a rollout stream worker, as `star train` wires it: the worker process serves
its HTTP face (STAR_ROLLOUT_HTTP_PORT) on its vLLM engine (GPU 1), the learner's publisher runs here
(GPU 0). A broadcast lands in the engine; a restarted worker is noticed before the next broadcast and
the group is formed again. Marked `gpu`: it needs 2 GPUs and GPU vLLM (`bench/gpu_device.sh`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu_shapes import model_folder  # noqa: E402
from services.common.supervisor import wait_ready  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return model_folder(tmp_path_factory.mktemp("gpu-model") / "smollm", "smollm", max_positions=4096)


def _start_worker(folder: Path, port: int, redis_url: str, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "1",
        "STAR_MODEL": str(folder),
        "STAR_ROLLOUT_ENGINE": "vllm",
        "STAR_ROLLOUT_VLLM": json.dumps({"weight_transfer": "nccl", "compile": False, "gpu_memory_utilization": 0.3}),
        "STAR_ROLLOUT_MAX_MODEL_LEN": "2048",
        "STAR_ROLLOUT_HTTP_PORT": str(port),
        "STAR_REDIS_URL": redis_url,
        "STAR_STREAM_PREFIX": "gpu-nccl",
        "STAR_SANDBOX_URL": "http://127.0.0.1:9",
        "STAR_LOG_LEVEL": "WARNING",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "STAR_ROLLOUT_CONSUMER": "gpu",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "services.rollout.worker"], env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT
    )


def test_a_broadcast_reaches_the_worker_and_a_restarted_worker_rejoins(folder, redis_server_url, tmp_path):
    import httpx
    from transformers import AutoModelForCausalLM

    from services.common.redis import free_port
    from services.weights.buckets import iter_full_parameters, parameter_layout
    from services.weights.digests import check_engine_weights
    from services.weights.nccl import NcclPublisher

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "worker.log"
    worker = _start_worker(folder, port, redis_server_url, log)
    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    pub = NcclPublisher([url], master_port=free_port(), timeout_s=300)

    def step_and_publish(version: int) -> None:
        with torch.no_grad():
            for p in model.parameters():  # every tensor changes
                p.mul_(1.0 + 0.01 * version).add_(1e-3 * version)
        pub.publish(version, parameter_layout(model), iter_full_parameters(model))

    def every_tensor_equal() -> None:
        engine = httpx.get(f"{url}/weights/digests", timeout=120).json()
        verdict = check_engine_weights(model, engine)
        assert verdict["equal"] and verdict["tensors_equal"] == len(engine["digests"]) > 100, verdict

    try:
        wait_ready("rollout worker", worker, url, log, 600)
        assert httpx.get(f"{url}/weights", timeout=10).json()["weight_ranks"] == 1
        step_and_publish(1)
        info = httpx.get(f"{url}/weights", timeout=10).json()
        assert info["version"] == 1 and info["weight_group"] == pub.group_id and pub.missed == []
        every_tensor_equal()
        first_group, first_port = pub.group_id, pub.group_port

        step_and_publish(2)  # the same group
        assert pub.group_id == first_group

        worker.send_signal(signal.SIGKILL)  # a worker that died; its supervisor starts it again on its port
        worker.wait(30)
        worker = _start_worker(folder, port, redis_server_url, log)
        wait_ready("rollout worker", worker, url, log, 600)
        assert httpx.get(f"{url}/weights", timeout=10).json()["weight_group"] is None
        step_and_publish(3)
        info = httpx.get(f"{url}/weights", timeout=10).json()
        assert info["version"] == 3 and info["weight_group"] == pub.group_id != first_group
        assert pub.group_port != first_port
        every_tensor_equal()
        gen = httpx.post(
            f"{url}/generate", json={"prompt_ids": [5, 6, 7], "max_tokens": 2, "temperature": 0.0}, timeout=60
        ).json()
        assert gen["policy_version"] == 3

        worker.send_signal(signal.SIGTERM)
        assert worker.wait(120) == 0, log.read_text()[-3000:]
    finally:
        pub.close()
        if worker.poll() is None:
            worker.kill()
