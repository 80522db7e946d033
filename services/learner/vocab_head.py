"""The vocabulary head fused with the log-probability of each target token.

Log-probs of sampled tokens (and the policy's entropy, as a metric) need the softmax over the whole
vocabulary, but never the [T, V] logits as a tensor that outlives one chunk: at 16K tokens and
Qwen2.5's 151,936-entry vocabulary those would be 5 GB in bf16 and 10 GB in fp32. `vocab_logprobs`
runs the head chunk by chunk under its own autograd function:

- forward: per chunk, the bf16 logits (one matmul) and, in one pass over them in fp32, the
  log-partition, the target's log-prob and the entropy; it keeps only the log-partition ([T]);
- backward: per chunk, the logits again (one matmul), the gradient of the log-probs with respect to
  them, `g · (onehot(target) − softmax) / temperature`, written once in bf16, and the two matmuls
  for the hidden states and the head's weight (the weight's gradient summed over chunks in fp32).

The fused head computes `hidden @ weightᵀ`, which is the model's logits only where the model adds
nothing after its output embedding: `fused_head_fits` allows the families in `FUSED_MODEL_TYPES`
(without a logit soft-cap or scale); elsewhere `model_logprobs` reads the model's own logits.

Compared with running the head under activation checkpointing, the forward is not run a second time
(no second entropy or log-partition), and the element-wise work is one read of the logits forward
and one read and one write backward. On GPU the element-wise functions are compiled (Inductor fuses
each into a few kernels); elsewhere they run eagerly, with the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from services.learner.pointwise import FUSED_MODEL_TYPES, compile_once, say_once

HeadKernels = Literal["auto", "compiled", "eager"]


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The head's arithmetic is at least fp32 (bf16 logits are read in fp32)."""
    return torch.promote_types(dtype, torch.float32)


def chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, inv_temp: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-partition, target log-prob and entropy ([n] each, at least fp32) of a chunk's logits ([n, V])."""
    x = logits.to(stats_dtype(logits.dtype)) * inv_temp
    logz = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets[:, None]).squeeze(-1) - logz
    if with_entropy:
        entropy = logz - (torch.exp(x - logz[:, None]) * x).sum(-1)
    else:
        entropy = torch.zeros_like(logz)
    return logz, logp, entropy


def chunk_logit_grad(
    logits: torch.Tensor, targets: torch.Tensor, logz: torch.Tensor, grad_logp: torch.Tensor, inv_temp: float
) -> torch.Tensor:
    """d(Σ g·logp)/d(logits) for a chunk, in the logits' dtype: g · (onehot(target) − softmax) / T."""
    x = logits.to(stats_dtype(logits.dtype)) * inv_temp
    softmax = torch.exp(x - logz[:, None])
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab[None, :] == targets[:, None]).to(softmax.dtype)
    return ((onehot - softmax) * (grad_logp * inv_temp)[:, None]).to(logits.dtype)


def kernels(compiled: bool) -> tuple[Callable, Callable]:
    """(chunk_stats, chunk_logit_grad), compiled once per process where asked (a second chunk length,
    a micro-batch's last chunk, makes the length symbolic rather than compiling once per length)."""
    if compiled:
        return compile_once(chunk_stats), compile_once(chunk_logit_grad)
    return chunk_stats, chunk_logit_grad


def fused_head_fits(config) -> bool:
    """Whether the model's logits are exactly its hidden states times the output embedding (said
    once in the log when they are not)."""
    kind = str(getattr(config, "model_type", None))
    plain = (
        kind in FUSED_MODEL_TYPES
        and not getattr(config, "final_logit_softcapping", None)
        and getattr(config, "logit_scale", None) in (None, 1.0)
    )
    if not plain:
        say_once("the fused vocabulary head", kind)
    return plain


def model_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target ([n]) and the entropy (no gradient) from the model's own logits ([n, V]),
    read in at least fp32: the head for models the fused head does not fit."""
    x = logits.to(stats_dtype(logits.dtype)) / temperature
    logp_all = torch.log_softmax(x, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logp, torch.zeros_like(logp).detach()
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def use_compiled(choice: HeadKernels, device: torch.device) -> bool:
    return choice == "compiled" or (choice == "auto" and device.type == "cuda")


class _VocabLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        inv_temp: float,
        with_entropy: bool,
        compiled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stats, _ = kernels(compiled)
        n = hidden.shape[0]
        logz = torch.empty(n, dtype=stats_dtype(hidden.dtype), device=hidden.device)
        logp = torch.empty_like(logz)
        entropy = torch.empty_like(logz)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = hidden[start:end] @ weight.t()
            logz[start:end], logp[start:end], entropy[start:end] = stats(
                logits, targets[start:end], inv_temp, with_entropy
            )
        ctx.save_for_backward(hidden, weight, targets, logz)
        ctx.chunk, ctx.inv_temp, ctx.compiled = chunk, inv_temp, compiled
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        hidden, weight, targets, logz = ctx.saved_tensors
        _, logit_grad = kernels(ctx.compiled)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=stats_dtype(weight.dtype), device=weight.device) if want_weight else None
        )
        grad_logp = grad_logp.contiguous()
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end]
            grad_logits = logit_grad(
                h @ weight.t(), targets[start:end], logz[start:end], grad_logp[start:end], ctx.inv_temp
            )
            if want_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if want_weight:
                grad_weight += grad_logits.t() @ h
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def vocab_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    head_kernels: HeadKernels = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target ([n]) under softmax(hidden @ weightᵀ / temperature), and the entropy of
    that distribution (no gradient), for hidden states [n, d] and a head weight [V, d]."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [n, d] and targets [n]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    compiled = use_compiled(head_kernels, hidden.device)
    return _VocabLogprob.apply(hidden, weight, targets, chunk, 1.0 / temperature, with_entropy, compiled)
