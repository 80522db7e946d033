"""The CUDA IPC transport: weights from a learner rank into the colocated engine on its own GPU.

Sending (every learner rank): the new version's full tensors (gathered under ZeRO-3) are packed into
one CUDA buffer of the rank's own, vLLM's packed IPC layout, chunk by chunk; the ranks' IPC handles are
gathered to rank 0, which posts each chunk to every colocated server (`POST /weights/ipc`). The buffer
is reused, so no rank packs the next chunk before rank 0's post of this one returns.

Receiving (inside each vLLM worker, through `collective_rpc`): the worker opens the handle of its own
GPU and loads the chunk through vLLM's layerwise reload, started by the first chunk and finished by the
last. These are the calls of vLLM's IPCWeightTransferEngine, made here because that module imports ray,
which the GPU machines do not have. A level-2 sleep drops buffers no checkpoint holds (the rotary
caches): `keep_buffers` keeps a host copy before it, and the last chunk puts them back.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch

from services.weights.buckets import iter_full_parameters

IPC_BUFFER_BYTES = 2**30  # vLLM's default packed buffer; raised to the largest tensor where one is bigger


# ---- the sending side: the learner's ranks --------------------------------------------------------


def gather_handles(handle: dict[str, tuple]) -> dict[str, tuple]:
    """Every rank's {GPU UUID: IPC args} merged, on rank 0 (each rank packs on its own GPU); a single
    process's own. Every rank calls it (a collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return handle
    gathered: list[dict[str, tuple] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, handle)
    merged: dict[str, tuple] = {}
    for h in gathered:
        merged.update(h or {})
    return merged


def ipc_chunks(tensors: Iterator[tuple[str, torch.Tensor]], buffer_bytes: int) -> Iterator[dict[str, Any]]:
    """vLLM's packed IPC producer over `tensors` (one reusable CUDA buffer on this rank's GPU): each
    chunk's layout and the merged handles, pickled for HTTP. The caller must have the chunk loaded
    before asking for the next one (the buffer is reused)."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_producer

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    for chunk in packed_ipc_producer(tensors, uuid, lambda item: item[1], buffer_bytes):
        handles = gather_handles(chunk.ipc_handle)
        yield {
            "names": chunk.names,
            "dtype_names": chunk.dtype_names,
            "shapes": chunk.shapes,
            "tensor_sizes": chunk.tensor_sizes,
            "handles": base64.b64encode(pickle.dumps(handles)).decode(),
        }


def buffer_bytes_for(model: torch.nn.Module) -> int:
    """The IPC buffer: vLLM's 1 GiB, or the largest parameter where one is bigger (a 7B embedding)."""
    largest = max((getattr(p, "ds_numel", p.numel()) * 2 for p in model.parameters()), default=0)
    return max(IPC_BUFFER_BYTES, largest)


def send_version(
    version: int,
    model: torch.nn.Module,
    *,
    zero3: bool,
    load_chunk: Callable[[dict[str, Any]], None] | None,
    chunks: Callable[[Iterator[tuple[str, torch.Tensor]], int], Iterator[dict[str, Any]]] = ipc_chunks,
) -> None:
    """`model`'s weights as `version`, chunk by chunk, to `load_chunk` (rank 0's post to the servers;
    None on the other ranks, which pack and gather their handles). Every rank calls it (the gathers are
    collective); the last call, with no tensors, finishes the load."""
    first = True
    for chunk in chunks(iter_full_parameters(model, zero3=zero3), buffer_bytes_for(model)):
        if load_chunk is not None:
            load_chunk({"version": version, **chunk, "first": first, "last": False})
        first = False
        _barrier()  # the buffer is reused: no rank packs the next chunk before rank 0's load returns
    if load_chunk is not None:
        load_chunk({"version": version, "first": first, "last": True})
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        # the IPC buffer and the gathered weights back to the driver: the KV cache wakes into that memory
        torch.cuda.empty_cache()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---- the receiving side: inside a colocated vLLM engine's workers -----------------------------------


def keep_buffers(worker: Any) -> int:
    """Runs inside the vLLM worker: a host copy of every buffer of the model, for after a level-2 sleep."""
    model = worker.model_runner.model
    worker._star_buffers = {n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers()}
    return len(worker._star_buffers)


def receive_chunk(
    worker: Any,
    *,
    names: list[str],
    dtype_names: list[str],
    shapes: list[list[int]],
    tensor_sizes: list[int],
    handles: str,
    first: bool,
    last: bool,
) -> dict[str, Any]:
    """Runs inside the vLLM worker: rebuild the learner's packed CUDA buffer from its IPC handle (this
    GPU's entry), load its tensors through vLLM's layerwise reload (started by the first chunk, finished
    by the last), and after the last put back the buffers kept before a level-2 sleep, checking them."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_consumer
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.model
    if first:
        initialize_layerwise_reload(model)
    if names:
        weights = packed_ipc_consumer(
            ipc_handle=pickle.loads(base64.b64decode(handles)),
            names=names,
            shapes=shapes,
            dtype_names=dtype_names,
            tensor_sizes=tensor_sizes,
            device_index=worker.device.index,
        )
        model.load_weights(weights)
        del weights
    out: dict[str, Any] = {}
    if last:
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        kept = getattr(worker, "_star_buffers", None)
        if kept:
            restored = 0
            for name, buffer in model.named_buffers():
                if name in kept:
                    buffer.data.copy_(kept[name].to(buffer.device))
                    restored += 1
            differ = [n for n, b in model.named_buffers() if n in kept and not torch.equal(b.cpu(), kept[n])]
            worker._star_buffers = None
            out = {"buffers_restored": restored, "buffers_differ": differ[:10]}
        torch.cuda.synchronize()
    return out
