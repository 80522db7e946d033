"""The learner's NCCL protocol: set for the learner's own collectives, and kept out of the groups it forms with
processes that do not share its environment (the rollout fleet's vLLM workers). Every member of an NCCL
communicator must pick the same protocol, and an engine never sees the learner's setting."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_set_here: str | None = None  # the NCCL_PROTO this process set for itself (None: the environment's own)


def set_learner_protocol(protocol: str | None) -> None:
    """Set NCCL_PROTO unless the environment chose one. NCCL reads it when a communicator is made, so this
    must run before the learner's process group makes its first."""
    global _set_here
    if protocol and "NCCL_PROTO" not in os.environ:
        os.environ["NCCL_PROTO"] = protocol
        _set_here = protocol


@contextmanager
def peer_protocol() -> Iterator[None]:
    """While a communicator with outside processes is made: NCCL's own choice, as on their side, unless the
    operator set NCCL_PROTO (then it is theirs to set on both sides)."""
    value = os.environ.get("NCCL_PROTO")
    ours = _set_here is not None and value == _set_here
    if ours:
        del os.environ["NCCL_PROTO"]
    try:
        yield
    finally:
        if ours:
            os.environ["NCCL_PROTO"] = value
