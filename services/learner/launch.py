"""Starting a training run as one process per learner rank: torchrun for several, a plain process for one.

Every place that starts the learner (`star train`'s SFT and RL stages, `star sft`, `star learner rl`, the
learner's runs API and so the Helm learner) builds its command here, so a recipe's rank count means the
same everywhere. Under torchrun a rank that dies takes the others down (torchrun stops the survivors and
exits non-zero, naming the failed rank and its error); SIGTERM to torchrun reaches every rank, and the
ranks agree on stopping at the next step boundary (services.learner.trainer)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import Settings

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


@dataclass(frozen=True)
class Nodes:
    """This learner node's place in a multi-node learner: `count` nodes, this one `rank`, meeting at the
    c10d rendezvous `rendezvous` (host:port of node 0, which hosts its store). One node: no rendezvous."""

    count: int = 1
    rank: int = 0
    rendezvous: str | None = None

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.rank < self.count:
            raise ValueError(f"learner node rank {self.rank} of {self.count} nodes")
        if self.count > 1 and not self.rendezvous:
            raise ValueError(f"a learner of {self.count} nodes needs STAR_LEARNER_RENDEZVOUS (host:port of node 0)")

    @classmethod
    def from_settings(cls, settings: Settings) -> "Nodes":
        return cls(settings.learner_nodes, settings.learner_node_rank, settings.learner_rendezvous)


def worker_argv(kind: str, config: str | Path, ranks: int, max_steps: int | None = None,
                nodes: Nodes = Nodes(), run_id: str = "") -> list[str]:
    """The command that runs `python -m services.learner.worker KIND CONFIG [MAX_STEPS]` as `ranks` ranks
    on this node; on a multi-node learner, as this node's part of run `run_id` (every node names the same)."""
    tail = [kind, str(config), *([str(max_steps)] if max_steps else [])]
    if ranks == 1 and nodes.count == 1:
        return [sys.executable, "-m", "services.learner.worker", *tail]
    if nodes.count == 1:
        where = ["--standalone", "--nnodes", "1"]
    else:
        # torchrun orders the nodes of a c10d rendezvous by their host names (node_rank is only read by
        # the static backend); node 0 hosts the store, so no node guesses from DNS whether it is the host.
        if not run_id:
            raise ValueError("a multi-node run needs the run id its nodes share")
        where = ["--nnodes", str(nodes.count), "--rdzv_backend", "c10d", "--rdzv_endpoint", str(nodes.rendezvous),
                 "--rdzv_id", run_id, "--rdzv_conf", f"is_host={int(nodes.rank == 0)}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node", str(ranks),
            "--max_restarts", "0", "-m", "services.learner.worker", *tail]


def worker_env(ranks: int, nodes: Nodes = Nodes()) -> dict[str, str]:
    """What the launcher needs beside the caller's environment."""
    if ranks == 1 and nodes.count == 1:
        return {}
    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(STOP_GRACE_S)}
