"""Colocated weight publication's store side: the engines take each version by CUDA IPC on waking
(tests/rollout/test_colocation.py, bench/colocate_gpu.py), the store every `files_every`-th version,
without telling the servers (they have it already)."""

from __future__ import annotations

import json

import torch

from services.learner.colocate import ColocatedSync, buffer_bytes_for, IPC_BUFFER_BYTES
from services.learner.weights import StorePublisher


def _model(vocab: int = 64):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))


def test_every_nth_version_reaches_the_store_and_no_server_is_told(tmp_path):
    from services.learner.engine import iter_weight_buckets

    model = _model()
    store = StorePublisher(tmp_path / "weights", servers=["http://127.0.0.1:9"], keep=5, timeout_s=2)
    sync = ColocatedSync(store, None, files_every=2)  # awake engines: no wake, no IPC
    for v in (1, 2, 3):
        metrics = sync.publish(v, model, zero3=False, buckets=lambda: iter_weight_buckets(model, dtype=torch.bfloat16),
                               config=model.config, source_dir=None)
        assert "colocate_weights_s" not in metrics
    assert store.versions() == [2]
    assert json.loads((tmp_path / "weights" / "v2" / "manifest.json").read_text())["version"] == 2
    assert store.servers == ["http://127.0.0.1:9"]  # its list is kept, and was not posted to
    assert sync.write_files(2, buckets=lambda: iter(()), config=model.config, source_dir=None) == {}


def test_the_ipc_buffer_holds_the_largest_tensor():
    assert buffer_bytes_for(_model()) == IPC_BUFFER_BYTES
    big = torch.nn.Embedding(2**19 + 1, 1024, device="meta")  # bf16 just over 1 GiB, as a 7B embedding is
    assert buffer_bytes_for(big) > IPC_BUFFER_BYTES
