"""A colocated learner's step on every rank, as a script:
`torchrun --nproc_per_node N colocated_ranks.py OUT` (CPU, gloo, ZeRO-3 over the tiny policy).

Every rank runs what the trainer runs around a colocated step (services/learner/colocate.py): `sleep` (rank 0
asks the servers, every rank learns the outcome), the RL step, then `publish`, where every rank gathers each
parameter under ZeRO-3 and packs chunks whose handles are gathered to rank 0, which loads them into the servers
chunk by chunk. The servers are rank 0's recorder of what it was asked (their HTTP side is
tests/rollout/test_colocation.py) and the CUDA IPC packer is a CPU one that packs the same way (vLLM's needs a
GPU): each chunk's handle is a digest of the bytes the rank packed. Then a step where the servers refuse to
sleep: every rank must refuse it. Each rank writes OUT.rankN.json."""

from __future__ import annotations

import base64
import hashlib
import json
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.learner.batching import Sequence_  # noqa: E402
from services.learner.colocate import ColocatedSync, ColocationError  # noqa: E402
from services.learner.config import EngineConfig, ScheduleConfig  # noqa: E402
from services.learner.engine import PolicyEngine  # noqa: E402
from services.learner.steps import rl_step  # noqa: E402
from services.models import tiny_qwen2  # noqa: E402
from services.weights.buckets import parameter_layout  # noqa: E402
from services.weights.cuda_ipc import gather_handles  # noqa: E402


class Servers:
    """Rank 0's colocated servers, recording each call."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.refuse = False

    def recover(self) -> list[str]:
        return []

    def sleep(self) -> dict[str, float]:
        if self.refuse:
            raise ColocationError("refusing to train: 1 of 1 colocated rollout server(s) did not free their GPU")
        self.calls.append({"call": "sleep"})
        return {"colocate_sleep_s": 0.0}

    def wake(self, tags) -> None:
        self.calls.append({"call": "wake", "tags": tags})

    def load_chunk(self, body: dict) -> None:
        handles = pickle.loads(base64.b64decode(body["handles"])) if "handles" in body else {}
        self.calls.append(
            {
                "call": "load",
                "names": body.get("names", []),
                "first": body["first"],
                "last": body["last"],
                "handles": handles,
            }
        )


def cpu_chunks(tensors, buffer_bytes: int):
    """Packs as vLLM's IPC producer does (tensors in order into a buffer of `buffer_bytes`, a chunk when the next
    would not fit), each chunk's 'handle' the digest of the bytes this rank packed, gathered to rank 0."""

    def chunk(items):
        digest = hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for _, t in items))
        handles = gather_handles({f"gpu-{dist.get_rank()}": digest.hexdigest()})
        return {"names": [n for n, _ in items], "handles": base64.b64encode(pickle.dumps(handles)).decode()}

    items, size = [], 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if items and size + nbytes > buffer_bytes:
            yield chunk(items)
            items, size = [], 0
        items.append((name, tensor))
        size += nbytes
    if items:
        yield chunk(items)


def sequences() -> list[Sequence_]:
    g = torch.Generator().manual_seed(7)
    return [
        Sequence_(
            torch.randint(100, 5000, (n,), generator=g).tolist(),
            [0, 0] + [1] * (n - 2),
            None,
            advantage=1.0 if i % 2 else -0.5,
            index=i,
        )
        for i, n in enumerate([30, 22, 17, 40])
    ]


def main(out: Path) -> None:
    engine = PolicyEngine(
        tiny_qwen2(),
        EngineConfig(zero_stage=3, micro_batch_tokens=48, persistent_weights_gib=0.0),
        ScheduleConfig(lr=0.1),
        total_steps=10,
    )
    rank = engine.rank
    servers = Servers() if rank == 0 else None
    sync = ColocatedSync(
        None, servers, files_every=100, chunks=lambda tensors, _: cpu_chunks(tensors, buffer_bytes=256 * 1024)
    )
    sync.sleep()
    rl_step(engine, sequences(), eps_low=0.2, eps_high=0.28)
    metrics = sync.publish(1, engine.hf_model, zero3=True, buckets=lambda: iter(()), config=None, source_dir=None)
    refused = None
    if servers is not None:
        servers.refuse = True
    try:
        sync.sleep()
    except ColocationError as exc:
        refused = str(exc)
    dist.barrier()
    result = {
        "rank": rank,
        "world": engine.world_size,
        "metrics": sorted(metrics),
        "refused": refused,
        "asleep_after_refusal": sync.asleep,
        "names": parameter_layout(engine.hf_model)["names"],
        "calls": servers.calls if servers else None,
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
