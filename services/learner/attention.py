"""Attention over packed rows by sequence boundaries, with no [T, T] mask.

A packed row holds several sequences, each restarting its position ids at 0. Given only the position
ids, transformers builds a [B, 1, T, T] boolean block mask for SDPA, which keeps SDPA off its flash
and cuDNN kernels and costs memory quadratic in the row. Here the row's boundaries are read once per
forward (`packed_kwargs`) and handed to every layer's attention, which runs one of two kernels:

- varlen: `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, CUDA, bf16/fp16), FlashAttention's
  varlen kernels forward and backward over all B·T tokens at once, split at cumulative lengths
  (`cu_seqlens`);
- per sequence: causal SDPA over each sequence in turn, the call transformers makes for the sequence
  alone (SDPA's own flash / cuDNN kernels on GPU; on CPU the only path, exact against unpacked rows).

`PACKED_ATTENTION` (the learner's `auto`) runs SDPA per sequence where a row's sequences are long (on average at
least `PER_SEQUENCE_MIN_MEAN` tokens: the recipes' trajectories), varlen where they are short and its kernel runs (a
CUDA GPU, bf16/fp16), and SDPA per sequence elsewhere (CPU). Per-sequence SDPA hands the kernel each sequence in
the plain path's layout (`sequence_layout`), gradients included: cuDNN reuses a length's backward plan for any
gradient layout, and a plan built for another layout gives wrong gradients (docs/gpu.md). In that layout its
gradients match an fp64 reference within bf16 on a GPU, plans warmed first or not (bench/attention_grads.py).
The other names force one kernel.
`VARLEN_GQA_ATTENTION` is varlen with K and V kept at their own head count (grouped-
query attention native in the kernel), where this torch's varlen_attn would have them repeated to the
query's heads. `warm_sequence_plans` builds cuDNN's plans for per-sequence SDPA's padded lengths up front
(bench/packed_attention.py's "plans at start").
Micro-batches whose rows hold one sequence each take SDPA's plain causal path.
All are registered with transformers' attention interface (`AttentionInterface`).
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PACKED_ATTENTION = "star_packed"  # the default: per sequence for long sequences and on CPU, else varlen
VARLEN_ATTENTION = "star_varlen"
VARLEN_GQA_ATTENTION = "star_varlen_gqa"  # varlen with K/V at their own head count
PER_SEQUENCE_ATTENTION = "star_per_sequence"
PACKED_IMPLEMENTATIONS = (PACKED_ATTENTION, VARLEN_ATTENTION, VARLEN_GQA_ATTENTION, PER_SEQUENCE_ATTENTION)
# A 32K row's cost per token against its sequences alone (bench/results/packed_attention*.md), 7B width:
# with the same lengths every pass (cuDNN's plans cached), three of ~11K tokens 1.00x per sequence, 1.12x
# varlen; eight of 4K 0.95x either way; 64 of 512 0.50x per sequence, 0.34x varlen (H100). With new lengths
# every pass, as a training step's trajectories have, 0.97x per sequence (padded as below; 1.23x unpadded)
# and 0.53x varlen (H200), SDPA building an execution plan for each new length; at 1.5B width with every
# padded length's plans built first, 0.95x per sequence against 1.08x varlen (1.06x with GQA native), and the
# learner's step on the recipe's rows 1.09x faster per sequence (H100, bench/results/packed_attention_gqa_1p5b_h100.md,
# learner_packed_h100.md).
# Per-sequence SDPA on a GPU pads each sequence to a multiple of this many tokens (zeros after its end, which
# no real token sees under the causal mask; their outputs are dropped): every new length would otherwise
# make cuDNN's attention build a new execution plan, and the recipes' trajectories have new lengths every step.
SEQUENCE_MULTIPLE = 256
# `auto` on a GPU: a row whose sequences average at least this many tokens runs per sequence, a row of shorter
# ones varlen (the 512-token rows above: one SDPA call per sequence costs more than varlen's one call).
PER_SEQUENCE_MIN_MEAN = 4096


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: where a sequence starts, i.e. each row's first token and every token whose position
    does not follow its left neighbour's (transformers reads packed rows the same way). Micro-batch
    padding continues its row's positions, so it joins the row's last sequence, after all of it."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts


def packed_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """The sequence boundaries of a [B, T] (or [T]) batch as attention keyword arguments, or {} when every
    row is one sequence: cumulative lengths over the B·T tokens on the batch's device (transformers'
    FlashAttention names) and, for the per-sequence path, each sequence's (row, start, end) on the host.
    One host copy of the position ids."""
    pos = position_ids.detach().to("cpu")
    pos = pos if pos.dim() == 2 else pos[None]
    starts = sequence_starts(pos)
    if int(starts.sum()) == starts.shape[0]:
        return {}
    first = starts.flatten().nonzero().flatten()
    cu = torch.cat([first, torch.tensor([starts.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    width = pos.shape[1]
    spans = tuple((a // width, a % width, (b - 1) % width + 1) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()))
    cu = cu.to(position_ids.device, non_blocking=True)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "sequence_spans": spans,
    }


@cache
def varlen_options() -> dict[str, bool] | None:
    """What this torch's varlen_attn takes (its keywords changed between releases), or None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return {"window": "window_size" in params, "gqa": "enable_gqa" in params, "scale": "scale" in params}


def uses_varlen_kernel(query: torch.Tensor) -> bool:
    """Whether packed rows of this query run FlashAttention's varlen kernel (else SDPA per sequence)."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and varlen_options() is not None


def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    longest: int,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of [N, H, D] tokens split at `cu`; `window`: each token sees itself and the
    `window - 1` before it (transformers' sliding_window)."""
    from torch.nn.attention.varlen import varlen_attn

    opts = varlen_options()
    kwargs: dict[str, Any] = (
        {"window_size": (window - 1 if window else -1, 0)} if opts["window"] else {"is_causal": True}
    )
    if k.shape[1] != q.shape[1]:
        if opts["gqa"]:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if opts["scale"]:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError("this torch's varlen_attn takes no scale; the model's attention scale is not 1/sqrt(head_dim)")
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)


class FlashVarlenGQA(torch.autograd.Function):
    """FlashAttention-2's varlen kernels (aten's `_flash_attention_forward` / `_backward`, which varlen_attn
    wraps) on K and V at their own head count: the kernel shares each K/V head among its group of query heads
    and sums their K/V gradients itself. For a torch whose varlen_attn takes no `enable_gqa` (2.11), where
    K and V would otherwise be repeated to the query's heads in every layer."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu: torch.Tensor,
        longest: int,
        scale: float | None,
        window: int | None,
    ) -> torch.Tensor:
        left = window - 1 if window else -1
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale, window_size_left=left, window_size_right=0
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.longest, ctx.scale, ctx.left = longest, scale, left
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu,
            cu,
            ctx.longest,
            ctx.longest,
            0.0,
            True,
            seed,
            offset,
            scale=ctx.scale,
            window_size_left=ctx.left,
            window_size_right=0,
        )
        return dq, dk, dv, None, None, None, None


def _varlen_gqa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    longest: int,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """As `_varlen`, never repeating K/V: varlen_attn's own `enable_gqa` where this torch has it, else
    `FlashVarlenGQA`."""
    if k.shape[1] == q.shape[1] or varlen_options()["gqa"]:
        return _varlen(q, k, v, cu, longest, scale, window)
    return FlashVarlenGQA.apply(q, k.contiguous(), v.contiguous(), cu, longest, scale, window)


class CausalLayer(nn.Module):
    """What transformers' SDPA function reads of the layer calling it: causal, and its GQA grouping."""

    is_causal = True

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads


def warm_sequence_plans(
    heads: int,
    kv_heads: int,
    head_dim: int,
    longest: int,
    device: torch.device,
    dtype: torch.dtype,
    multiple: int = SEQUENCE_MULTIPLE,
) -> list[int]:
    """Run per-sequence attention forward and backward once at every padded length it can meet (multiples of
    `multiple` up to `longest`), so that cuDNN builds each length's execution plans here, once, and not in the
    training steps whose trajectories bring new lengths. Each call goes through the training path itself: a
    sequence one token short of the length (so it is padded, as training's are), transformers' SDPA function
    with the layers' head counts, and a gradient laid out as the output projection hands it back. cuDNN reuses
    a length's plan for any later gradient layout, and a plan built for another layout gives wrong gradients
    (docs/gpu.md). Under the caller's SDPA priority (the kernels the steps will take). Returns the lengths run."""
    lengths = list(range(multiple, -(-longest // multiple) * multiple + 1, multiple))
    layer = CausalLayer(heads, kv_heads)
    with torch.enable_grad():
        for n in lengths:
            length = max(n - 1, 1) if multiple > 1 else n
            # [1, heads, L, D] views of [1, L, heads, D], as a layer's projections hand them over
            q, k, v = (
                torch.zeros(1, length, m, head_dim, device=device, dtype=dtype, requires_grad=True)
                for m in (heads, kv_heads, kv_heads)
            )
            out = _per_sequence(layer, *(t.transpose(1, 2) for t in (q, k, v)), ((0, 0, length),), None, padded=n)
            torch.autograd.grad(out, [q, k, v], grad_outputs=torch.ones_like(out))
    return lengths


def window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[1, 1, L, L] bool (True: attend) for causal attention within a sliding window, or None where the
    window covers the whole sequence (plain causal)."""
    if window is None or length <= window:
        return None
    i = torch.arange(length, device=device)
    back = i[:, None] - i[None, :]
    return ((back >= 0) & (back < window))[None, None]


def pad_multiple(query: torch.Tensor, window: int | None) -> int:
    """What per-sequence SDPA pads each sequence's length to a multiple of: SEQUENCE_MULTIPLE on a GPU, 1 (no
    padding) on CPU, whose SDPA builds no plans, and on sliding-window layers, whose mask is built per length."""
    return SEQUENCE_MULTIPLE if query.is_cuda and window is None else 1


def sequence_layout(heads_first: torch.Tensor, extra: int) -> torch.Tensor:
    """One sequence's [heads, L, D] slice as SDPA gets it in a layer's own call: [1, heads, L + extra, D] laid out
    [L, heads, D] in memory (the projections' layout; padded after its end). So each per-sequence call has the
    plain path's strides, and its output gradient the output's, whatever the slice was: cuDNN reuses a length's
    plans across layouts, and a plan built for another layout gives wrong gradients (docs/gpu.md)."""
    tokens_first = heads_first.transpose(0, 1)  # [L, heads, D]
    tokens_first = nn.functional.pad(tokens_first, (0, 0, 0, 0, 0, extra)) if extra else tokens_first.contiguous()
    return tokens_first.transpose(0, 1)[None]


def _per_sequence(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: tuple[tuple[int, int, int], ...],
    scale: float | None,
    window: int | None = None,
    padded: int | None = None,
) -> torch.Tensor:
    """Causal SDPA of each sequence alone (within `window` on sliding-window layers), sliced from
    [B, heads, T, D] as transformers hands an unpacked row to SDPA → [B·T, H, D]. Each sequence is padded to a
    multiple of pad_multiple (or to `padded` tokens: the plan warm-up's lengths)."""
    parts = []
    multiple = pad_multiple(query, window)
    for row, start, end in spans:
        length = end - start
        extra = padded - length if padded is not None else -length % multiple
        one = [sequence_layout(t[row, :, start:end], extra) for t in (query, key, value)]
        out, _ = sdpa_attention_forward(module, *one, window_mask(length, window, query.device), scaling=scale)
        parts.append(out[0, :length])  # [L, H, D]
    return torch.cat(parts)


def auto_kernel(tokens: int, sequences: int) -> str:
    """The kernel `auto` runs a packed pass of `sequences` over `tokens` with: per-sequence where they average at
    least PER_SEQUENCE_MIN_MEAN tokens, else varlen (which falls back to per-sequence where its kernel cannot run)."""
    return "per-sequence" if tokens >= PER_SEQUENCE_MIN_MEAN * sequences else "varlen"


def _packed(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    kwargs: dict[str, Any],
    mode: str,
) -> tuple[torch.Tensor, None]:
    spans = kwargs.pop("sequence_spans", None)
    cu, longest = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("max_length_q", None)
    # a sliding-window layer (Gemma 3, Mistral's early releases): transformers hands attention functions
    # other than its own the window, not a mask, so it is applied here
    window = sliding_window or getattr(module, "sliding_window", None)
    if spans is None:
        if attention_mask is None and query.shape[2] == key.shape[2]:
            attention_mask = window_mask(query.shape[2], window, query.device)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if attention_mask is not None or dropout:
        raise ValueError("packed attention takes no attention mask or dropout")
    b, h, t, d = query.shape

    def tokens(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(b * t, x.shape[1], d)  # [B·T, heads, D]

    if mode == "auto":
        mode = auto_kernel(b * t, len(spans))
    if mode == "varlen" and uses_varlen_kernel(query) and (window is None or varlen_options()["window"]):
        out = _varlen(tokens(query), tokens(key), tokens(value), cu, int(longest), scaling, window)
    elif mode == "varlen-gqa" and uses_varlen_kernel(query):
        out = _varlen_gqa(tokens(query), tokens(key), tokens(value), cu, int(longest), scaling, window)
    else:
        out = _per_sequence(module, query, key, value, spans, scaling, window)
    return out.view(b, t, h, d), None


def attention_function(mode: str, doc: str):
    """A transformers attention function (query [B, H, T, D], key and value [B, H_kv, T, D] → ([B, T, H, D], no
    weights)) that runs packed rows by `mode` of `_packed`; rows of one sequence take SDPA's plain causal path."""

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        return _packed(module, query, key, value, attention_mask, dropout, scaling, sliding_window, kwargs, mode)

    attention.__doc__ = doc
    return attention


packed_attention = attention_function(
    "auto", "Packed rows: causal SDPA per sequence where they are long or off the GPU, else the varlen kernel."
)
varlen_attention = attention_function(
    "varlen", "Packed rows: FlashAttention's varlen kernel where it runs, else causal SDPA per sequence."
)
varlen_gqa_attention = attention_function(
    "varlen-gqa", "As `varlen_attention`, with K and V never repeated to the query's heads in the varlen kernel."
)
per_sequence_attention = attention_function(
    "per-sequence", "Packed rows as causal SDPA over each sequence, on every device (the learner's path on CPU)."
)


# the names `attn_implementation` takes for each `packed_attention` setting of the learner
IMPLEMENTATIONS = {
    "auto": PACKED_ATTENTION,
    "varlen": VARLEN_ATTENTION,
    "varlen-gqa": VARLEN_GQA_ATTENTION,
    "per-sequence": PER_SEQUENCE_ATTENTION,
}
# each name's function (`auto` names the rule by sequence length), registered with transformers
FUNCTIONS = {
    PACKED_ATTENTION: packed_attention,
    VARLEN_ATTENTION: varlen_attention,
    VARLEN_GQA_ATTENTION: varlen_gqa_attention,
    PER_SEQUENCE_ATTENTION: per_sequence_attention,
}
for _name, _function in FUNCTIONS.items():
    AttentionInterface.register(_name, _function)


def runs_per_sequence(setting: str) -> bool:
    """Whether the learner's `packed_attention` setting runs packed rows (some or all) as SDPA per sequence, so
    that its plans are worth building before the first step."""
    return FUNCTIONS.get(IMPLEMENTATIONS.get(setting, "")) in (per_sequence_attention, packed_attention)
