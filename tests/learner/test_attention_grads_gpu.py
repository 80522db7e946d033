"""The learner's packed attention on a GPU against an fp64 reference (bench/attention_grads.py's comparison): the
default (`auto`, varlen there) keeps a packed row's output and every input gradient within bf16 at the shapes of
the models the recipes train. Comparing with SDPA over the sequences alone in the same process is not enough: the
per-sequence path passed that comparison with wrong gradients."""

from __future__ import annotations

import pytest
import torch

from bench.attention_grads import PACKED_ROW, SHAPES, packed_row_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_default_packed_attention_matches_fp64_on_a_gpu(shape):
    result = packed_row_case(SHAPES[shape], list(PACKED_ROW), "varlen", torch.device("cuda"))
    assert "error" not in result, result
    for tensor in ("out", "dq", "dk", "dv"):
        assert result[tensor]["cosine"] > 0.9999 and result[tensor]["rel_max_err"] < 2e-2, (tensor, result[tensor])
