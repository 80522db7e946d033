"""Colocated weight publication: the store side (the engines take each version by CUDA IPC on waking
(tests/rollout/test_colocation.py, bench/colocate_gpu.py), the store every `files_every`-th version,
without telling the servers, who have it already), and the collectives of a step on several ranks."""

from __future__ import annotations

import json

import pytest
import torch

from services.learner.colocate import ColocatedSync
from services.weights.cuda_ipc import IPC_BUFFER_BYTES, buffer_bytes_for
from services.weights.files import StorePublisher


def _model(vocab: int = 64):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )


def test_every_nth_version_reaches_the_store_and_no_server_is_told(tmp_path):
    from services.learner.engine import iter_weight_buckets

    model = _model()
    store = StorePublisher(tmp_path / "weights", servers=["http://127.0.0.1:9"], keep=5, timeout_s=2)
    sync = ColocatedSync(store, None, files_every=2)  # awake engines: no wake, no IPC
    for v in (1, 2, 3):
        metrics = sync.publish(
            v,
            model,
            zero3=False,
            buckets=lambda: iter_weight_buckets(model, dtype=torch.bfloat16),
            config=model.config,
            source_dir=None,
        )
        assert "colocate_weights_s" not in metrics
    assert store.versions() == [2]
    assert json.loads((tmp_path / "weights" / "v2" / "manifest.json").read_text())["version"] == 2
    assert store.servers == ["http://127.0.0.1:9"]  # its list is kept, and was not posted to
    assert sync.write_files(2, buckets=lambda: iter(()), config=model.config, source_dir=None) == {}


def test_the_ipc_buffer_holds_the_largest_tensor():
    assert buffer_bytes_for(_model()) == IPC_BUFFER_BYTES
    big = torch.nn.Embedding(2**19 + 1, 1024, device="meta")  # bf16 just over 1 GiB, as a 7B embedding is
    assert buffer_bytes_for(big) > IPC_BUFFER_BYTES


@pytest.mark.slow
def test_a_colocated_step_on_two_ranks_sleeps_trains_and_loads_every_ranks_chunks(tmp_path, tiny_model):
    """The collectives of a colocated step on several ranks (tests/learner/colocated_ranks.py): each chunk the
    servers load carries every rank's handle for the same bytes, the chunks cover every weight once, in
    order, between one wake of the weights and one of the KV cache; a refused sleep stops every rank."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from services.learner.engine import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    script = Path(__file__).resolve().parent / "colocated_ranks.py"
    out = tmp_path / "colocated"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(script),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"colocated.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    for r in ranks:  # the refusal reached the rank that asked and the one that did not
        assert r["refused"] and "did not free their GPU" in r["refused"] and not r["asleep_after_refusal"]
        assert {"colocate_wake_s", "colocate_weights_s"} <= set(r["metrics"])
    calls = ranks[0]["calls"]
    assert [c["call"] for c in calls[:2]] == ["sleep", "wake"] and calls[1]["tags"] == ["weights"]
    assert calls[-1] == {"call": "wake", "tags": None}
    loads = [c for c in calls if c["call"] == "load"]
    data, end = loads[:-1], loads[-1]
    assert len(data) >= 2 and data[0]["first"] and not any(c["first"] for c in data[1:]) and end["last"]
    assert [n for c in data for n in c["names"]] == ranks[0]["names"]  # every weight once, in order
    for c in data:  # both ranks packed the same gathered bytes into their own buffer
        assert set(c["handles"]) == {"gpu-0", "gpu-1"} and c["handles"]["gpu-0"] == c["handles"]["gpu-1"]
