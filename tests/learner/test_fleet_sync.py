"""Weight sync over NCCL with the store as its fallback (the broadcast itself runs on GPUs:
bench/weight_sync_gpu.py). Here no group can form, so every version must reach the store."""

from __future__ import annotations

import json

import torch

from services.weights.buckets import iter_full_parameters, parameter_layout
from services.weights.files import StorePublisher
from services.weights.nccl import FleetSync, NcclPublisher


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )


def _buckets(model):
    from services.learner.engine import iter_weight_buckets

    return lambda: iter_weight_buckets(model, dtype=torch.bfloat16)


def test_layout_matches_what_is_sent_and_skips_the_tied_head():
    model = _model()
    layout = parameter_layout(model)
    sent = list(iter_full_parameters(model))
    assert [n for n, _ in sent] == layout["names"] and "lm_head.weight" not in layout["names"]
    assert [list(t.shape) for _, t in sent] == layout["shapes"]
    assert set(layout["dtype_names"]) == {"float32"}


def test_a_version_no_broadcast_could_deliver_goes_to_the_store(tmp_path):
    model = _model()
    store = StorePublisher(tmp_path / "weights", servers=["http://127.0.0.1:9"], keep=5, timeout_s=2)
    nccl = NcclPublisher(["http://127.0.0.1:9"], master_port=29990, timeout_s=2)
    sync = FleetSync(store, nccl, files_every=10)
    metrics = sync.publish(3, model, zero3=False, buckets=_buckets(model), config=model.config, source_dir=None)
    assert metrics["sync_nccl_failed"] == 1.0
    assert json.loads((tmp_path / "weights" / "v3" / "manifest.json").read_text())["version"] == 3
    assert metrics["sync_servers_failed"] == 1.0  # the server was told, and could not be reached
    assert store.servers == ["http://127.0.0.1:9"]  # the store's own list is kept


def test_every_nth_version_reaches_the_store_without_nccl(tmp_path):
    model = _model()
    store = StorePublisher(tmp_path / "weights", keep=5)
    sync = FleetSync(store, None, files_every=2)
    for v in (1, 2, 3, 4):
        sync.publish(v, model, zero3=False, buckets=_buckets(model), config=model.config, source_dir=None)
    assert store.versions() == [2, 4]
