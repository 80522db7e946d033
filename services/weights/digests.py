"""A sha256 of every parameter, to prove a weight sync complete: the engine's parameters against the
learner's, byte for byte, not a sample of them (`check_engine_weights`).

vLLM holds some projections fused (`packed_modules_mapping`: q, k and v as one `qkv_proj`, gate and
up as one `gate_up_proj`, stacked along dim 0 on one rank), so the learner's side is put in the
engine's layout before hashing (`engine_layout_digests`); both sides hash the tensor's bytes in the
engine's dtype. One engine rank holds whole tensors only without tensor parallelism. Tensors are
hashed on a few threads (sha256 and the copy to the host release the GIL): at 7B, 14 GiB hashed on
one thread took tens of seconds a side.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HASH_THREADS = min(8, os.cpu_count() or 1)


def tensor_digest(tensor: Any) -> str:
    """sha256 of a tensor's bytes (row-major, as stored; on the host)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def tensor_digests(named: Iterable[tuple[str, Any]], threads: int = HASH_THREADS) -> dict[str, str]:
    """`tensor_digest` of every (name, tensor), several at a time."""
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        futures = {name: pool.submit(tensor_digest, tensor) for name, tensor in named}
        return {name: f.result() for name, f in futures.items()}


def fused_name(name: str, packed: Mapping[str, list[str]]) -> tuple[str, int] | None:
    """The engine's name of a fused parameter `name` belongs to, and its place in the stack; None
    when `name` is not a part of one (`packed`: vLLM's packed_modules_mapping)."""
    for fused, parts in packed.items():
        for i, part in enumerate(parts):
            if f".{part}." in f".{name}":
                return f".{name}".replace(f".{part}.", f".{fused}.", 1)[1:], i
    return None


def engine_layout_digests(
    named: Iterable[tuple[str, Any]], packed: Mapping[str, list[str]], dtype: Any
) -> dict[str, str]:
    """Digests of the learner's full tensors (`named`: name, tensor, in any order) as an engine
    without tensor parallelism holds them: cast to its `dtype`, fused parts stacked in order."""
    import torch

    futures: dict[str, Future] = {}
    parts: dict[str, dict[int, Any]] = {}
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        for name, tensor in named:
            fused = fused_name(name, packed)
            if fused is None:
                futures[name] = pool.submit(tensor_digest, tensor.detach().to(dtype).cpu())  # off the device at once
                continue
            target, index = fused
            parts.setdefault(target, {})[index] = tensor.detach().to(dtype).cpu()
            expected = len(next(p for f, p in packed.items() if f".{f}." in f".{target}"))
            if len(parts[target]) == expected:
                stack = parts.pop(target)
                futures[target] = pool.submit(
                    lambda s=stack, n=expected: tensor_digest(torch.cat([s[i] for i in range(n)], dim=0))
                )
        out = {name: f.result() for name, f in futures.items()}
    if parts:
        raise ValueError(f"fused parameters with parts missing: {sorted(parts)[:3]}")
    return out


def digest_mismatches(ours: Mapping[str, str], theirs: Mapping[str, str]) -> dict[str, list[str]]:
    """Names whose digests differ, that only the learner has, that only the engine has."""
    return {
        "differ": sorted(n for n in ours.keys() & theirs.keys() if ours[n] != theirs[n]),
        "missing": sorted(ours.keys() - theirs.keys()),
        "unexpected": sorted(theirs.keys() - ours.keys()),
    }


def check_engine_weights(model: torch.nn.Module, engine: dict[str, Any], *, zero3: bool = False) -> dict[str, Any]:
    """Compare a sha256 of every parameter the engine holds (`engine`: its GET /weights/digests) with
    the learner's `model` put in the engine's layout and dtype (every rank walks the parameters under
    ZeRO-3). `equal` only when every tensor matches and neither side has one the other lacks."""
    return compare_engine_digests(learner_digests(model, engine["packed"], engine["dtype"], zero3=zero3), engine)


def learner_digests(
    model: torch.nn.Module, packed: dict[str, list[str]], dtype: str, *, zero3: bool = False
) -> dict[str, str]:
    """The learner's side of `check_engine_weights`: a sha256 of every parameter in an engine's fused
    layout (`packed`) and dtype (its name), without asking the engine (it may hash at the same time)."""
    import torch

    from services.weights.buckets import iter_full_parameters

    return engine_layout_digests(iter_full_parameters(model, zero3=zero3), packed, getattr(torch, dtype))


def compare_engine_digests(ours: dict[str, str], engine: dict[str, Any]) -> dict[str, Any]:
    """The verdict of `check_engine_weights` on digests already taken on both sides."""
    opaque = set(engine.get("opaque") or [])  # held by the engine in a form it cannot read back
    wrong = digest_mismatches(ours, engine["digests"])
    wrong["missing"] = [n for n in wrong["missing"] if n not in opaque]
    wrong["unverifiable"] = sorted(opaque)
    return {
        "tensors_checked": len(ours),
        "tensors_equal": len(ours) - len(wrong["differ"]) - len(wrong["missing"]) - len(opaque),
        "equal": not any(wrong.values()),
        **{k: v[:10] for k, v in wrong.items()},
        "digests": ours,
    }
