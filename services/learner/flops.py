"""Model FLOPs for tokens/s → MFU, in two conventions.

Per sequence of length s, with N parameters (the tied embedding counted once, as the output
projection), L layers and attention width d = heads × head_dim:

- `mfu` (default, `causal_half=False`): 6·N·s + 12·L·d·s², the PaLM definition (Chowdhery et al.
  2022, appendix B: 6N + 12·L·H·Q·T per token), also Megatron's and torchtitan's. The attention
  scores and values count in full (4·L·d·s² forward, ×3 for forward + backward), although a
  causal kernel skips the masked half. Compare with published MFU figures in this convention.
- `mfu_causal_half` (`causal_half=True`): 6·N·s + 6·L·d·s², causal attention at half (only the
  unmasked triangle is needed), so the stricter number.

Activation recomputation is not model FLOPs and is not counted in either.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s.
_PEAKS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "B200": 2250e12,
}


def train_flops(
    n_params: int, layers: int, attn_width: int, seq_lens: Iterable[int], *, causal_half: bool = False
) -> float:
    """Forward + backward model FLOPs of one step over sequences of these lengths."""
    attn = 6.0 if causal_half else 12.0
    return float(sum(6.0 * n_params * s + attn * layers * attn_width * s * s for s in seq_lens))


def model_shape(config: Any) -> tuple[int, int]:
    """(layers, attention width = query heads × head_dim): the query width, which GQA keeps."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return int(config.num_hidden_layers), heads * int(head_dim)


def peak_flops(device_name: str | None = None) -> float | None:
    """bf16 peak of the current GPU (by name), None on CPU or an unknown part."""
    import torch

    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key, value in _PEAKS.items():
        if key in device_name.upper():
            # The PCIe H100 is slower than the SXM part.
            if key == "H100" and "PCIE" in device_name.upper():
                return 756e12
            return value
    return None


@dataclass(frozen=True)
class TrajectoryCost:
    """The PaLM model FLOPs of training one trajectory of each length (`train_flops` per sequence), as the
    work by which rows are packed and dealt (balancing.py)."""

    n_params: int
    layers: int
    attn_width: int

    def __call__(self, lengths: Any) -> np.ndarray:
        s = np.asarray(lengths, dtype=np.float64)
        return 6.0 * self.n_params * s + 12.0 * self.layers * self.attn_width * s * s


# Qwen2.5-1.5B (tied embedding counted once; 28 layers, 12 query heads x 128): the work of rows whose
# caller names no model, the recipes' smallest learner.
QWEN25_1P5B_COST = TrajectoryCost(1_543_714_304, 28, 1536)
