"""Model FLOPs for tokens/s → MFU.

Per sequence of length s: 6·N·s for the dense layers (forward + backward, N counting the tied
embedding once, as the output projection) plus 6·L·d·s² for causal attention scores and values
(4·L·d·s² forward without the causal half, ×3 for backward). Activation recomputation is not
model FLOPs and is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s.
_PEAKS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
          "A10G": 125e12, "L4": 121e12, "B200": 2250e12}


def train_flops(n_params: int, layers: int, hidden: int, seq_lens: Iterable[int]) -> float:
    return float(sum(6.0 * n_params * s + 6.0 * layers * hidden * s * s for s in seq_lens))


def model_shape(config: Any) -> tuple[int, int]:
    return int(config.num_hidden_layers), int(config.hidden_size)


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
