"""The learner's packed attention on a GPU against an fp64 reference (bench/attention_grads.py's comparison): varlen
(`auto` there) and per-sequence SDPA keep a packed row's output and every input gradient within bf16 at the shapes
of the models the recipes train. Comparing with SDPA over the sequences alone in the same process is not enough:
per-sequence SDPA in another layout than the plain path's passed that comparison with wrong gradients."""

from __future__ import annotations

import pytest
import torch

from bench.attention_grads import PACKED_ROW, SHAPES, packed_row_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("mode", ["varlen", "per-sequence"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_packed_attention_matches_fp64_on_a_gpu(shape, mode):
    result = packed_row_case(SHAPES[shape], list(PACKED_ROW), mode, torch.device("cuda"))
    assert "error" not in result, result
    for tensor in ("out", "dq", "dk", "dv"):
        assert result[tensor]["cosine"] > 0.9999 and result[tensor]["rel_max_err"] < 2e-2, (tensor, result[tensor])
