"""Starting a training run as one process per learner rank: torchrun for several, a plain process for one.

Every place that starts the learner (`star train`'s SFT and RL stages, `star sft`, `star learner rl`, the
learner's runs API and so the Helm learner) builds its command here, so a recipe's rank count means the
same everywhere. Several ranks run under torchrun, started by `python -m services.learner.launch`
(torchrun's own arguments): a rank that dies takes the others down (torchrun stops the survivors and
exits non-zero, naming the failed rank and its error). SIGTERM or SIGINT to the launcher is passed on
to every rank, and the ranks agree on stopping at the next step boundary (services.learner.trainer);
torchrun itself does not take the signal, so its exit status is the ranks' verdict: 0 when every rank
stopped cleanly. (Taking it, torchrun exits 1 after any signal, whatever its ranks did.)"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import Settings
from services.common.supervisor import proc_stat

# Seconds the ranks get to stop after a stop signal before they are killed: a rank finishes its current
# step and checkpoints first. Passed to torchrun too (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; its own default is
# 30 s), where it bounds the teardown after a rank died, when a survivor may sit in a collective.
STOP_GRACE_S = 120
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        raise RankError(
            f"the learner asks for {requested} ranks, one GPU each, but this machine shows "
            f"{gpus} GPU{'s' if gpus != 1 else ''}{where}"
        )
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
    def from_settings(cls, settings: Settings) -> Nodes:
        return cls(settings.learner_nodes, settings.learner_node_rank, settings.learner_rendezvous)


def worker_argv(
    kind: str, config: str | Path, ranks: int, max_steps: int | None = None, nodes: Nodes = Nodes(), run_id: str = ""
) -> list[str]:
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
        where = [
            "--nnodes",
            str(nodes.count),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            str(nodes.rendezvous),
            "--rdzv_id",
            run_id,
            "--rdzv_conf",
            f"is_host={int(nodes.rank == 0)}",
        ]
    return [
        sys.executable,
        "-m",
        "services.learner.launch",
        *where,
        "--nproc_per_node",
        str(ranks),
        "--max_restarts",
        "0",
        "-m",
        "services.learner.worker",
        *tail,
    ]


def worker_env(ranks: int, nodes: Nodes = Nodes()) -> dict[str, str]:
    """What the launcher needs beside the caller's environment."""
    if ranks == 1 and nodes.count == 1:
        return {}
    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(STOP_GRACE_S)}


def child_pids(parent: int) -> set[int]:
    """The processes whose parent is `parent` (torchrun's ranks are its direct children)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))) is not None and int(fields[1]) == parent:
            out.add(int(entry.name))
    return out


class RankStopper:
    """Passes the first stop signal on to this process's children (the ranks), including ranks started
    after it, and kills whatever is left after `grace_s`: torchrun then sees a failed rank."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.requested: int | None = None

    def __call__(self, signum: int, _frame: object = None) -> None:
        if self.requested is None:
            self.requested = signum
            print(f"learner launcher: {signal.Signals(signum).name}: stopping the ranks", file=sys.stderr, flush=True)
            threading.Thread(target=self._stop_ranks, name="rank-stopper", daemon=True).start()

    def _stop_ranks(self) -> None:
        told: set[int] = set()
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            for pid in child_pids(os.getpid()) - told:
                _signal(pid, self.requested)
                told.add(pid)
            time.sleep(0.5)
        left = child_pids(os.getpid())
        if left:
            print(
                f"learner launcher: ranks {sorted(left)} did not stop within {self.grace_s:.0f} s; killing them",
                file=sys.stderr,
                flush=True,
            )
        for pid in left:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    """torchrun with `argv`, in this process, the stop signals handled by a `RankStopper`."""
    grace = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", STOP_GRACE_S))
    stopper = RankStopper(grace)
    for sig in STOP_SIGNALS:
        signal.signal(sig, stopper)
    # torchrun's --signals-to-handle (torch >= 2.9; older ones take every signal themselves): the
    # signals it handles by killing its ranks. Not the stop signals, whose handler is ours.
    os.environ["PET_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    from torch.distributed import run as torchrun

    torchrun.main(sys.argv[1:] if argv is None else argv)  # raises (exit 1) when a rank failed
    return 0


if __name__ == "__main__":
    sys.exit(main())
