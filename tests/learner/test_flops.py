"""Model FLOPs and MFU in both conventions (PaLM: attention in full; causal: attention at half), by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.learner import steps
from services.learner.flops import model_shape, peak_flops, train_flops


def test_train_flops_by_hand():
    # N = 100, L = 2, d = 8, sequences of 10 and 4 tokens: 6·N·14 = 8,400 dense;
    # attention Σ s² = 116, so PaLM 12·2·8·116 = 22,272 and causal-half 6·2·8·116 = 11,136.
    assert train_flops(100, 2, 8, [10, 4]) == 8_400 + 22_272
    assert train_flops(100, 2, 8, [10, 4], causal_half=True) == 8_400 + 11_136
    assert train_flops(100, 2, 8, []) == 0.0


def test_palm_per_token_formula_at_the_bench_shape():
    # PaLM appendix B: 6N + 12·L·H·Q·T per token; the 0.5B bench shape, 8K tokens (H·Q = 14 × 64 = 896)
    n, layers, width, s = 494_032_768, 24, 896, 8192
    per_token = 6 * n + 12 * layers * width * s
    assert train_flops(n, layers, width, [s]) == pytest.approx(per_token * s, rel=1e-12)
    assert per_token == 2_964_196_608 + 2_113_929_216


def test_attention_width_is_query_heads_times_head_dim():
    qwen = SimpleNamespace(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2)
    assert model_shape(qwen) == (24, 896)  # GQA shares K/V heads but scores are per query head
    wide = SimpleNamespace(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, head_dim=32)
    assert model_shape(wide) == (4, 128)


def test_peaks_by_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("Some CPU") is None


def test_step_metrics_report_both_conventions(monkeypatch):
    monkeypatch.setattr(steps, "peak_flops", lambda: 1e3)
    config = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2)
    engine = SimpleNamespace(lm_config=config, num_parameters=lambda: 100, world_size=2)
    m = steps._mfu_metrics(engine, [10, 4], seconds=2.0)
    assert m["tokens"] == 14 and m["tokens_per_s"] == 7.0
    assert m["tflops_per_s"] == pytest.approx(30_672 / 2 / 1e12)
    assert m["mfu"] == pytest.approx(30_672 / 2 / (1e3 * 2))
    assert m["mfu_causal_half"] == pytest.approx(19_536 / 2 / (1e3 * 2))
    monkeypatch.setattr(steps, "peak_flops", lambda: None)
    assert "mfu" not in steps._mfu_metrics(engine, [10, 4], seconds=2.0)
