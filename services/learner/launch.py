"""Starting a training run as one process per learner rank: torchrun for several, a plain process for one.

Every place that starts the learner (`star train`'s SFT and RL stages, `star sft`, `star learner rl`, the
learner's runs API and so the Helm learner) builds its command here, so a recipe's rank count means the
same everywhere. Under torchrun a rank that dies takes the others down (torchrun stops the survivors and
exits non-zero, naming the failed rank and its error); SIGTERM to torchrun reaches every rank, and the
ranks agree on stopping at the next step boundary (services.learner.trainer)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Seconds torchrun gives its ranks after forwarding SIGTERM before it kills them: a rank finishes its
# current step and checkpoints first (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; torchrun's own default is 30 s).
# The same wait bounds the teardown after a rank died, when a survivor may sit in a collective.
STOP_GRACE_S = 120


class RankError(ValueError):
    """More learner ranks than this machine can give a GPU each."""


def visible_gpus() -> int:
    """CUDA devices this process may use (after CUDA_VISIBLE_DEVICES), counted without creating a CUDA
    context here: the ranks we start need the memory."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # pragma: no cover - no usable driver
        return 0


def resolve_ranks(requested: int | None, gpus: int | None = None) -> int:
    """The number of ranks to start: `requested`, or every visible GPU (1 without GPUs). On a GPU machine
    a rank needs a GPU of its own, so asking for more is refused with the numbers; on CPU any number
    of gloo ranks runs."""
    gpus = visible_gpus() if gpus is None else gpus
    if requested is None:
        return max(gpus, 1)
    if gpus and requested > gpus:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise RankError(f"the learner asks for {requested} ranks, one GPU each, but this machine shows "
                        f"{gpus} GPU{'s' if gpus != 1 else ''}{where}")
    return requested


def worker_argv(kind: str, config: str | Path, ranks: int, max_steps: int | None = None) -> list[str]:
    """The command that runs `python -m services.learner.worker KIND CONFIG [MAX_STEPS]` as `ranks` ranks."""
    tail = [kind, str(config), *([str(max_steps)] if max_steps else [])]
    if ranks == 1:
        return [sys.executable, "-m", "services.learner.worker", *tail]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(ranks), "--max_restarts", "0", "-m", "services.learner.worker", *tail]


def worker_env(ranks: int) -> dict[str, str]:
    """What the launcher needs beside the caller's environment."""
    if ranks == 1:
        return {}
    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(STOP_GRACE_S)}
