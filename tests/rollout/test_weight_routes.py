"""The rollout service's token route and NCCL weight routes, and the vLLM engine's arguments, on CPU.

The NCCL transfer itself needs GPUs (tests/rollout/test_vllm_gpu.py, bench/weight_sync_gpu.py); here:
what a server says when it cannot take part, a broadcast that fails leaving the server refusing to
sample, and how a recipe's `services.vllm` becomes vLLM's engine arguments or is refused."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.common.schemas import VllmArgs
from services.common.settings import Settings
from services.rollout.app import create_app
from services.rollout.engines.scripted import ScriptedEngine
from services.rollout.engines.vllm_engine import engine_kwargs
from services.rollout.service import RolloutService

LAYOUT = {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[64]]}


@pytest.fixture
def app_client(tokenizer, local_tools, tmp_path):
    def make(engine):
        settings = Settings(home=tmp_path, weights_root=tmp_path / "weights", log_json=False, log_level="WARNING")
        return TestClient(create_app(settings, service=RolloutService(engine, local_tools, settings=settings)))

    return make


def test_generate_returns_the_sampled_ids_with_their_version(tokenizer, app_client):
    engine = ScriptedEngine(tokenizer, ["hello there"])
    with app_client(engine) as client:
        r = client.post("/generate", json={"prompt_ids": [1, 2, 3], "max_tokens": 8})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["token_ids"] and body["policy_version"] == 0 and body["finish"] in ("stop", "length")
        assert engine.calls[-1]["prompt_ids"] == [1, 2, 3]
        bad = client.post("/generate", json={"prompt_ids": [], "max_tokens": 8})
        assert bad.status_code == 422
        negative = client.post("/generate", json={"prompt_ids": [-1], "max_tokens": 8})
        assert negative.status_code == 422


def test_an_engine_without_nccl_says_so(tokenizer, app_client):
    with app_client(ScriptedEngine(tokenizer, ["x"])) as client:
        assert client.get("/weights").json()["weight_ranks"] == 0
        join = client.post(
            "/weights/group",
            json={"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2},
        )
        assert join.status_code == 409 and "NCCL" in join.text
        send = client.post("/weights/broadcast", json={"version": 1, **LAYOUT})
        assert send.status_code == 409


def test_a_broadcast_with_mismatched_layout_is_refused(tokenizer, app_client):
    with app_client(ScriptedEngine(tokenizer, ["x"])) as client:
        r = client.post(
            "/weights/broadcast",
            json={"version": 1, "names": ["a", "b"], "dtype_names": ["bfloat16"], "shapes": [[1], [2]]},
        )
        assert r.status_code == 422 and "same length" in r.text


class HalfLoading(ScriptedEngine):
    """Receives over 'NCCL' and fails halfway, as a dropped connection would."""

    async def join_weight_group(self, *args) -> None:
        return None

    async def receive_weights(self, names, dtype_names, shapes, version):
        raise RuntimeError("connection reset after 3 of 7 buckets")


def test_a_failed_broadcast_stops_sampling_until_a_full_version_loads(tokenizer, app_client, tiny_model, tmp_path):
    import shutil

    from services.weights.manifest import write_manifest

    engine = HalfLoading(tokenizer, ["x"] * 10)
    with app_client(engine) as client:
        assert (
            client.post(
                "/weights/group",
                json={"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2},
            ).status_code
            == 200
        )
        r = client.post("/weights/broadcast", json={"version": 3, **LAYOUT})
        assert r.status_code == 503 and "will not sample" in r.text
        assert client.get("/weights").json()["broken"]
        # nor will this process serve again: its liveness probe fails, so it is restarted
        assert client.get("/healthz").status_code == 503 and client.get("/readyz").status_code == 503
        refused = client.post("/generate", json={"prompt_ids": [1], "max_tokens": 2})
        assert refused.status_code == 503
        # a whole version from files mends it (the scripted engine "loads" any folder)
        version = tmp_path / "weights" / "v4"
        shutil.copytree(tiny_model, version)

        async def load(path: str) -> None:
            return None

        engine._load_weights = load
        ok = client.post("/weights", json={"version": 4, "uri": str(version), "sha256": write_manifest(version, 4)})
        assert ok.status_code == 200, ok.text
        assert client.get("/weights").json()["broken"] is None
        assert client.post("/generate", json={"prompt_ids": [1], "max_tokens": 2}).json()["policy_version"] == 4


def test_engine_kwargs_on_a_gpu_and_on_a_cpu():
    gpu = engine_kwargs(
        VllmArgs(
            tensor_parallel_size=2,
            gpu_memory_utilization=0.4,
            max_num_seqs=128,
            kv_cache_dtype="fp8",
            weight_transfer="nccl",
            extra={"block_size": 32},
        ),
        model="m",
        max_model_len=8192,
        dtype="bfloat16",
        seed=3,
        on_cpu=False,
    )
    assert gpu["enforce_eager"] is False and gpu["tensor_parallel_size"] == 2
    assert gpu["gpu_memory_utilization"] == 0.4 and gpu["max_num_seqs"] == 128 and gpu["kv_cache_dtype"] == "fp8"
    assert gpu["weight_transfer_config"] == {"backend": "nccl"} and gpu["block_size"] == 32
    # compiled: mixed prefill+decode steps replay piecewise graphs up to 2048 tokens, vLLM's other defaults kept
    assert gpu["compilation_config"] == {"max_cudagraph_capture_size": 2048} and "enable_chunked_prefill" not in gpu
    assert gpu["performance_mode"] == "interactivity" and gpu["prefix_caching_hash_algo"] == "xxhash"
    balanced = engine_kwargs(
        VllmArgs(performance_mode="balanced", prefix_caching_hash_algo="sha256"),
        model="m",
        max_model_len=8192,
        dtype="bfloat16",
        seed=0,
        on_cpu=False,
    )
    assert balanced["performance_mode"] == "balanced" and balanced["prefix_caching_hash_algo"] == "sha256"
    fast = engine_kwargs(VllmArgs(compile=False), model="m", max_model_len=8192, dtype="bfloat16", seed=0, on_cpu=False)
    assert fast["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    mixed = engine_kwargs(
        VllmArgs(
            compile=False, cudagraph_mode="FULL", extra={"compilation_config": {"max_cudagraph_capture_size": 1024}}
        ),
        model="m",
        max_model_len=8192,
        dtype="bfloat16",
        seed=0,
        on_cpu=False,
    )
    assert mixed["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL", "max_cudagraph_capture_size": 1024}
    compiled = engine_kwargs(
        VllmArgs(cudagraph_mode="FULL"), model="m", max_model_len=8192, dtype="bfloat16", seed=0, on_cpu=False
    )
    assert compiled["compilation_config"] == {"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 2048}
    whole = engine_kwargs(
        VllmArgs(compile=False, cudagraph_mode="FULL", max_cudagraph_capture_size=4096),
        model="m",
        max_model_len=8192,
        dtype="bfloat16",
        seed=0,
        on_cpu=False,
    )
    assert whole["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL", "max_cudagraph_capture_size": 4096}
    no_graphs = engine_kwargs(
        VllmArgs(cudagraph_mode="NONE"), model="m", max_model_len=8192, dtype="bfloat16", seed=0, on_cpu=False
    )
    assert no_graphs["compilation_config"] == {"cudagraph_mode": "NONE"}
    listed = engine_kwargs(
        VllmArgs(extra={"compilation_config": {"cudagraph_capture_sizes": [1, 8, 64]}}),
        model="m",
        max_model_len=8192,
        dtype="bfloat16",
        seed=0,
        on_cpu=False,
    )
    assert listed["compilation_config"] == {"cudagraph_capture_sizes": [1, 8, 64]}  # no maximum beside the list
    # engines sharing a GPU keep vLLM's smaller graphs, whose memory stays taken while they sleep
    for shared in (VllmArgs(kv_cache_from_share=True), VllmArgs(enable_sleep_mode=True)):
        assert "compilation_config" not in engine_kwargs(
            shared, model="m", max_model_len=8192, dtype="bfloat16", seed=0, on_cpu=False
        )
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        VllmArgs(max_cudagraph_capture_size=0)
    with pytest.raises(ValueError, match="PIECEWISE needs compile: true"):
        VllmArgs(compile=False, cudagraph_mode="PIECEWISE")
    cpu = engine_kwargs(VllmArgs(), model="m", max_model_len=8192, dtype="float32", seed=0, on_cpu=True)
    assert cpu["enforce_eager"] is True and cpu["enable_chunked_prefill"] is False
    assert cpu["max_num_batched_tokens"] >= 8192 and "gpu_memory_utilization" not in cpu
    assert "performance_mode" not in cpu  # vLLM's own default on a CPU
    assert "compilation_config" not in engine_kwargs(
        VllmArgs(cudagraph_mode="FULL"), model="m", max_model_len=8192, dtype="float32", seed=0, on_cpu=True
    )  # eager: no graphs


def test_an_engine_beside_others_sizes_its_kv_cache_from_its_share():
    from services.rollout.engines.base import EngineError
    from services.rollout.engines.vllm_engine import ENGINE_RESERVE_BYTES, kv_cache_bytes_from_share

    gib = 2**30
    # 0.12 of an 80 GiB card is 9.6 GiB: less 0.5 GiB of weights and the 2 GiB reserve
    assert kv_cache_bytes_from_share(0.12, 80 * gib, gib // 2) == int(0.12 * 80 * gib) - gib // 2 - ENGINE_RESERVE_BYTES
    # tensor parallel: each GPU holds its slice of the weights
    assert kv_cache_bytes_from_share(0.5, 80 * gib, 16 * gib, 2) == 40 * gib - 8 * gib - ENGINE_RESERVE_BYTES
    with pytest.raises(
        EngineError, match=r"gpu_memory_utilization 0.05 of a 80.0 GiB card is 4.00 GiB.*raise the share"
    ):
        kv_cache_bytes_from_share(0.05, 80 * gib, 3 * gib)
    sized = engine_kwargs(
        VllmArgs(gpu_memory_utilization=0.12),
        model="m",
        max_model_len=8192,
        dtype="bfloat16",
        seed=0,
        on_cpu=False,
        kv_cache_bytes=5 * gib,
    )
    assert sized["kv_cache_memory_bytes"] == 5 * gib
    measured = engine_kwargs(VllmArgs(), model="m", max_model_len=8192, dtype="bfloat16", seed=0, on_cpu=False)
    assert "kv_cache_memory_bytes" not in measured


def test_a_recipe_with_a_bad_engine_argument_is_refused_naming_it(tmp_path):
    from services.pipeline.config import ConfigError, load_pipeline_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nmodel: {path: /m}\nservices:\n  vllm:\n    extra: {max_num_seqz: 4}\n")
    with pytest.raises(ConfigError, match="services.vllm.*max_num_seqz is not an argument"):
        load_pipeline_config(recipe)
    recipe.write_text("name: r\nmodel: {path: /m}\nservices:\n  vllm:\n    gpu_memory_utilization: 1.5\n")
    with pytest.raises(ConfigError, match="services.vllm.gpu_memory_utilization"):
        load_pipeline_config(recipe)
    recipe.write_text("name: r\nmodel: {path: /m}\nservices:\n  vllm:\n    tensor_parallel_size: 2\n")
    assert load_pipeline_config(recipe).services.vllm.tensor_parallel_size == 2
