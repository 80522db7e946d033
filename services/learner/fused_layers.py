"""Decoder-layer pieces that keep only what their backward needs (`activation_memory: lean`).

Eager PyTorch saves, per token of a Llama-family layer, every intermediate its backward formulas name:
for the SwiGLU MLP the gate, SiLU(gate), up and their product (4 × intermediate width; the product is the
input down_proj saves), for each RMSNorm an fp32 copy of its input, its normalized bf16 form and its
output (the input the next projections save). Here:

- `SwiGLUDown` (one autograd.Function for SiLU(gate) · up → down_proj) saves gate and up only and recomputes
  the product in backward, where down_proj's weight gradient needs it (2 × intermediate width, not 4);
- `RMSNormFn` saves its input and the per-token 1/rms, and its output is not saved by the projections that
  read it: a saved-tensor hook around each decoder layer stores a recipe instead (input, 1/rms, weight) and
  rebuilds the output, bit for bit, when backward unpacks it.

The arithmetic is transformers' Llama-family code (services/learner/pointwise.py), applied to the same
model types (`FUSED_MODEL_TYPES`); parameter names stay transformers' (forwards are replaced on the instances).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from services.learner.pointwise import FUSED_MODEL_TYPES, _is_rms_norm, _is_swiglu, compile_once, model_type, say_once

# -- SwiGLU ---------------------------------------------------------------------------------------------


def swiglu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(gate) * up


def swiglu_grads(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d(SiLU(g) · u)/dg and /du times `grad`: SiLU'(g) = σ(g) (1 + g (1 - σ(g)))."""
    g = gate.float()
    sig = torch.sigmoid(g)
    grad_gate = grad.float() * up.float() * sig * (1 + g * (1 - sig))
    grad_up = grad * nn.functional.silu(gate)
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


class SwiGLUDown(torch.autograd.Function):
    """down_proj(SiLU(gate) · up) with down_proj's weight [d, I] (no bias); saves gate and up."""

    @staticmethod
    def forward(
        ctx: Any, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, kernels: tuple[Callable, Callable]
    ) -> torch.Tensor:
        product, _ = kernels
        ctx.save_for_backward(gate, up)
        # the parameter itself, not a saved tensor: under ZeRO-3 its data is gathered again for the backward
        ctx.weight, ctx.kernels = weight, kernels
        return nn.functional.linear(product(gate, up), weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        product, grads = ctx.kernels
        weight = ctx.weight
        grad_product = grad_out @ weight  # [..., I]
        grad_weight = None
        if weight.requires_grad:
            recomputed = product(gate, up)
            grad_weight = grad_out.flatten(0, -2).t() @ recomputed.flatten(0, -2)
        grad_gate, grad_up = grads(grad_product, gate, up)
        return grad_gate, grad_up, grad_weight, None


class SwiGLU(torch.autograd.Function):
    """SiLU(gate) · up, saving gate and up only (down_proj then saves the product, as its own input)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, kernels: tuple[Callable, Callable]) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.kernels = kernels
        return kernels[0](gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        return (*ctx.kernels[1](grad, gate, up), None)


# -- RMSNorm ----------------------------------------------------------------------------------------------


def norm_scale(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """1/rms of each token, fp32 [..., 1]."""
    return torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + eps)


def norm_output(hidden: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalized in fp32, scaled in the input's dtype."""
    return weight * (hidden.float() * rstd).to(hidden.dtype)


def norm_grads(
    grad: torch.Tensor, hidden: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    normed = hidden.float() * rstd
    grad_weight = (grad * normed.to(hidden.dtype)).flatten(0, -2).sum(0)
    grad_normed = (grad * weight).float()
    grad_hidden = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype)


class _Recipe:
    """What a saved norm output is rebuilt from: the norm's input, its 1/rms, its weight, and the view saved."""

    __slots__ = ("hidden", "rstd", "weight", "output", "view")

    def __init__(self, hidden: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, output: Callable) -> None:
        self.hidden, self.rstd, self.weight, self.output = hidden, rstd, weight, output
        self.view: tuple | None = None

    def rebuild(self) -> torch.Tensor:
        with torch.no_grad():
            out = self.output(self.hidden, self.rstd, self.weight)
        size, stride, offset = self.view
        return out.as_strided(size, stride, offset)


_made = threading.local()  # the norm outputs of the decoder layer now running forward, by storage address


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, eps: float, kernels: tuple[Callable, Callable, Callable]
    ) -> torch.Tensor:
        scale, output, _ = kernels
        rstd = scale(hidden, eps)
        ctx.save_for_backward(hidden, rstd)
        ctx.weight, ctx.kernels = weight, kernels
        out = output(hidden, rstd, weight)
        made = getattr(_made, "outputs", None)
        if made is not None:
            # the output itself is held until the layer's forward ends, so that no later tensor of the layer
            # takes its memory (and address) and is mistaken for it
            made[out.untyped_storage().data_ptr()] = (out, _Recipe(hidden, rstd, weight, output))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, rstd = ctx.saved_tensors
        grad_hidden, grad_weight = ctx.kernels[2](grad, hidden, rstd, ctx.weight)
        return grad_hidden, grad_weight if ctx.weight.requires_grad else None, None, None


def _outer_hooks() -> tuple[Callable, Callable] | None:
    """The saved-tensor hooks already in force (an offload to host, a test's count), which the norms' hooks
    hand every other tensor on to: only the innermost pair of hooks runs."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _norm_hooks(made: dict[int, tuple[torch.Tensor, _Recipe]]) -> tuple[Callable, Callable]:
    outer = _outer_hooks()

    def pack(t: torch.Tensor) -> Any:
        entry = made.get(t.untyped_storage().data_ptr()) if made and t.layout == torch.strided else None
        if entry is None:
            return outer[0](t) if outer else t
        recipe = entry[1]
        saved = _Recipe(recipe.hidden, recipe.rstd, recipe.weight, recipe.output)
        saved.view = (t.size(), t.stride(), t.storage_offset())
        return saved

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _Recipe):
            return saved.rebuild()
        return outer[1](saved) if outer else saved

    return pack, unpack


def _recomputing_norms(forward: Callable) -> Callable:
    """A decoder layer's forward under which its norms' outputs are saved as recipes, not tensors."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or getattr(_made, "outputs", None) is not None:
            return forward(*args, **kwargs)
        _made.outputs = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(*_norm_hooks(_made.outputs)):
                return forward(*args, **kwargs)
        finally:
            _made.outputs.clear()  # the outputs held during the forward
            _made.outputs = None

    return run


# -- patching a model -------------------------------------------------------------------------------------


def _kernels(compiled: bool) -> dict[str, tuple[Callable, ...]]:
    fn = compile_once if compiled else (lambda f: f)
    return {"swiglu": (fn(swiglu_product), fn(swiglu_grads)), "norm": (fn(norm_scale), fn(norm_output), fn(norm_grads))}


def lean_activations(
    lm: nn.Module, *, recompute_norms: bool = True, fold_down: bool = True, compiled: bool = False
) -> dict[str, int]:
    """Route `lm`'s SwiGLU MLPs through `SwiGLUDown` (`fold_down`: down_proj's weight read directly, which
    under ZeRO-3 needs each decoder layer to be one unit; else `SwiGLU`, down_proj kept) and its RMSNorms
    through `RMSNormFn`; `recompute_norms`: each decoder layer saves its norms' outputs as recipes (not under
    whole-layer recomputation, whose own saved-tensor hooks these would replace). `compiled`: the point-wise
    pieces under torch.compile (GPU). Returns the counts; all 0 outside `FUSED_MODEL_TYPES`."""
    counts = {"swiglu": 0, "rms_norm": 0, "layers": 0}
    if model_type(lm) not in FUSED_MODEL_TYPES:
        say_once("lean activations", model_type(lm))
        return counts
    kernels = _kernels(compiled)
    for module in lm.modules():
        if _is_swiglu(module) and getattr(module.down_proj, "bias", None) is None:
            if fold_down:
                module.forward = lambda x, _m=module: SwiGLUDown.apply(
                    _m.gate_proj(x), _m.up_proj(x), _m.down_proj.weight, kernels["swiglu"]
                )
            else:
                module.forward = lambda x, _m=module: _m.down_proj(
                    SwiGLU.apply(_m.gate_proj(x), _m.up_proj(x), kernels["swiglu"])
                )
            counts["swiglu"] += 1
        elif _is_rms_norm(module):
            module.forward = lambda x, _m=module: RMSNormFn.apply(x, _m.weight, _m.variance_epsilon, kernels["norm"])
            counts["rms_norm"] += 1
    if recompute_norms:
        for layer in getattr(lm.get_decoder(), "layers", []):
            layer.forward = _recomputing_norms(layer.forward)
            counts["layers"] += 1
    return counts
