"""Reading vLLM's per-position log-prob rows: flat lists (what the engine asks for) and dicts agree."""

from __future__ import annotations

import math

import pytest

from services.rollout.engines.base import EngineError
from services.rollout.engines.vllm_engine import sampled_logprobs

# per position: the sampled id, its log-prob and rank, then the top-3 (id, log-prob) by rank
ROWS = [
    (7, -0.5, 1, [(7, -0.5), (9, -1.2), (4, -2.0)]),  # sampled token is the top-1
    (12, -4.0, 8, [(3, -0.3), (5, -1.9), (6, -2.5)]),  # sampled token outside the top-3
    (5, -1.1, 2, [(6, -0.9), (5, -1.1), (2, -math.inf)]),  # a cut left id 2 no chance
]


def as_vllm(flat: bool):
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs

    rows = create_sample_logprobs(flat)
    for sampled, lp, rank, top in ROWS:
        append_logprobs_for_next_position(
            rows, [sampled] + [t for t, _ in top], [lp] + [v for _, v in top], [None] * (1 + len(top)), rank, len(top)
        )
    return rows


@pytest.mark.parametrize("flat", [True, False])
def test_sampled_logprobs_and_alternatives_from_either_layout(flat):
    ids = [r[0] for r in ROWS]
    logprobs, top = sampled_logprobs(as_vllm(flat), ids, 3)
    assert logprobs == [r[1] for r in ROWS]
    assert top == [{t: v for t, v in r[3] if v > -math.inf} for r in ROWS]
    only, none = sampled_logprobs(as_vllm(flat), ids, 0)
    assert only == logprobs and none is None


def test_flat_rows_are_what_the_engine_requests():
    from vllm.logprobs import FlatLogprobs

    assert isinstance(as_vllm(True), FlatLogprobs)


def test_no_rows_and_mismatched_rows():
    assert sampled_logprobs(None, [1, 2], 0) == (None, None)
    with pytest.raises(EngineError, match="3 positions and 2 sampled"):
        sampled_logprobs(as_vllm(True), [7, 12], 0)
