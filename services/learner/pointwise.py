"""Fused point-wise work of a decoder layer: RMSNorm, rotary embedding and the SwiGLU product.

In eager PyTorch each of these is a chain of small kernels over [tokens, width] tensors (RMSNorm
alone is a cast, a square, a mean, a reciprocal square root and two multiplies, forward and backward),
and at 16K-token rows they cost the learner more kernel time than attention's forward. Here each
becomes one `torch.compile`d function, the same arithmetic as transformers' Llama-family code, that
Inductor fuses into a kernel or two per direction.

The arithmetic is proven equal to the model's own only for the families in `FUSED_MODEL_TYPES`
(tests/learner/test_pointwise.py runs each): other models (interleaved or partial rotary, Gemma's
`1 + weight` norms, ...) keep their own code, and the log says so once per model type.

Only pure tensor functions are compiled, never a module: the modules keep their forward hooks
(ZeRO-3 gathers a module's parameters in them), which compiled modules would trace and recompile
around. Liger-Kernel ships hand-written kernels for the same three, but patches transformers'
modules by their internal layout per release; these functions depend on PyTorch alone.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import cache

import torch
from torch import nn

log = logging.getLogger(__name__)

# Model types whose RMSNorm, rotary embedding and SwiGLU are transformers' Llama arithmetic.
FUSED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
_said: set[tuple[str, str]] = set()


def model_type(lm: nn.Module) -> str:
    return str(getattr(getattr(lm, "config", None), "model_type", None))


def say_once(what: str, kind: str) -> None:
    """Log once per process and model type that a fused path is off (the model's own code runs)."""
    if (what, kind) not in _said:
        _said.add((what, kind))
        log.info(
            "%s off for model type %r (not one of %s): the model's own code runs",
            what,
            kind,
            ", ".join(sorted(FUSED_MODEL_TYPES)),
        )


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm: normalized in fp32, scaled in the input's dtype."""
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@cache
def compile_once(fn: Callable) -> Callable:
    """`fn` under torch.compile, one wrapper per function and process. dynamic=None: compiled for the
    first shapes seen, then once more with the lengths symbolic when they change."""
    return torch.compile(fn, dynamic=None)


def _is_rms_norm(module: nn.Module) -> bool:
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
    )


def _is_swiglu(module: nn.Module) -> bool:
    # transformers' ACT2FN["silu"] is its own SiLUActivation module
    act = type(getattr(module, "act_fn", None)).__name__
    return all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")) and act in ("SiLU", "SiLUActivation")


def fuse_pointwise(lm: nn.Module) -> dict[str, int]:
    """Route `lm`'s RMSNorms, SwiGLU MLPs and rotary embedding through the compiled functions (the
    forwards are replaced on the instances; parameter names stay transformers'). Returns the counts:
    all 0 for a model type outside `FUSED_MODEL_TYPES`, which is left as it is."""
    counts = {"rms_norm": 0, "swiglu": 0, "rotary": 0}
    if model_type(lm) not in FUSED_MODEL_TYPES:
        say_once("fused point-wise functions", model_type(lm))
        return counts
    norm, product = compile_once(rms_norm), compile_once(silu_product)
    for module in lm.modules():
        if _is_rms_norm(module):
            module.forward = lambda x, _m=module: norm(x, _m.weight, _m.variance_epsilon)
            counts["rms_norm"] += 1
        elif _is_swiglu(module):
            module.forward = lambda x, _m=module: _m.down_proj(product(_m.gate_proj(x), _m.up_proj(x)))
            counts["swiglu"] += 1
    # The attention modules call their modeling file's apply_rotary_pos_emb by its global name.
    for name in {type(m).__module__ for m in lm.modules() if type(m).__name__.endswith("Attention")}:
        modeling = sys.modules.get(name)
        if modeling is not None and callable(getattr(modeling, "apply_rotary_pos_emb", None)):
            modeling.apply_rotary_pos_emb = compile_once(rotary)
            counts["rotary"] += 1
    return counts
