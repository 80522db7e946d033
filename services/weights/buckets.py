"""Parameters in the order and groups every transport sends them, and tensors packed into one buffer.

`iter_full_parameters` walks the learner's parameters in one fixed order (gathered a group at a time
under ZeRO-3, a tied output head left out); `parameter_layout` names what it yields, for a receiver
that needs the layout before the tensors (NCCL). `FlatBucket` lays several tensors out in one byte
buffer: one device→host copy and one shard write for the files transport.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

_ALIGN = 64  # every tensor starts on a 64-byte boundary inside a shard's data


@dataclass
class FlatBucket:
    """Several tensors laid out in one byte buffer: one device→host copy, one write, one broadcast."""

    entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]  # name, dtype, shape, start, end
    data: torch.Tensor  # uint8, 1-D

    @property
    def nbytes(self) -> int:
        return self.entries[-1][4] if self.entries else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.data[a:b].view(dtype).view(shape) for name, dtype, shape, a, b in self.entries}


def layout(named: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> tuple[list, int]:
    """Byte offsets for (name, dtype, shape, numel) entries, each aligned; returns (entries, total bytes)."""
    entries, pos = [], 0
    for name, dtype, shape, numel in named:
        pos = (pos + _ALIGN - 1) // _ALIGN * _ALIGN
        size = numel * dtype.itemsize
        entries.append((name, dtype, tuple(shape), pos, pos + size))
        pos += size
    return entries, pos


def flatten(
    named: list[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
) -> FlatBucket:
    """Copy tensors (any device) into one uint8 buffer `out` (e.g. pinned host memory) or a new one
    on the tensors' device."""
    entries, total = layout([(n, dtype or t.dtype, tuple(t.shape), t.numel()) for n, t in named])
    device = named[0][1].device if named else torch.device("cpu")
    staging = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), (_, dt, _, a, b) in zip(named, entries):
        staging[a:b].copy_(t.detach().to(dt).reshape(-1).view(torch.uint8))
    if out is None:
        return FlatBucket(entries, staging)
    target = out[:total]
    target.copy_(staging, non_blocking=staging.is_cuda and target.is_pinned())
    if staging.is_cuda:
        torch.cuda.current_stream(staging.device).synchronize()
    return FlatBucket(entries, target)


def tied_head(model: torch.nn.Module, name: str) -> bool:
    """Whether `name` is an output head tied to the embeddings (no tensor of its own to send or load)."""
    return name == "lm_head.weight" and bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def parameter_groups(
    named: list[tuple[str, torch.nn.Parameter]], limit_bytes: int, dtype: torch.dtype | None = None
) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive groups of about `limit_bytes` (full sizes, as `dtype` when given): what one ZeRO-3
    gather holds at a time."""
    groups: list[list[tuple[str, torch.nn.Parameter]]] = [[]]
    size = 0
    for name, p in named:
        if size >= limit_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += getattr(p, "ds_numel", p.numel()) * (dtype.itemsize if dtype is not None else p.element_size())
    return [g for g in groups if g]


def sent_parameters(model: torch.nn.Module, skip_tied: bool = True) -> list[tuple[str, torch.nn.Parameter]]:
    """What a weight sync sends, in order: every parameter once, a tied output head left out."""
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=True) if not (skip_tied and tied_head(model, n))]


def iter_full_parameters(
    model: torch.nn.Module, *, zero3: bool = False, group_bytes: int = 512 * 2**20, skip_tied: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter, in a fixed order. Under ZeRO-3 the parameters are
    gathered a group of about `group_bytes` at a time: every rank must iterate (the gather is a
    collective). Tied output heads are skipped (`skip_tied`): the engine ties them itself."""
    named = sent_parameters(model, skip_tied)
    for group in parameter_groups(named, group_bytes):
        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
                # copies: a consumer may hold tensors past the gather (vLLM's packer batches ~1 GiB)
                copies = [(name, p.detach().clone()) for name, p in group]
            yield from copies
        else:
            for name, p in group:
                yield name, p.detach()


def parameter_layout(model: torch.nn.Module, *, skip_tied: bool = True) -> dict[str, list]:
    """Names, dtype names and full shapes of what `iter_full_parameters` yields (no gather needed)."""
    named = sent_parameters(model, skip_tied)
    return {
        "names": [n for n, _ in named],
        "dtype_names": [str(p.dtype).removeprefix("torch.") for _, p in named],
        "shapes": [list(getattr(p, "ds_shape", p.shape)) for _, p in named],
    }
