"""A model's shape, from its HF folder's config.json: what must agree for one model's weights to load
into an engine started on another (the vocabulary above all: a 4K-row embedding does not fit a
152K-row one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def model_shape(folder: str | Path) -> dict[str, Any] | None:
    """The shape keys of the HF model in `folder` (None: no readable config.json there)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {k: config.get(k) for k in SHAPE_KEYS}


def shape_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """`key ours ≠ theirs` for each shape key the two disagree on."""
    return [f"{k} {ours.get(k)} ≠ {theirs.get(k)}" for k in SHAPE_KEYS if ours.get(k) != theirs.get(k)]


def model_config(folder: str | Path) -> dict[str, Any] | None:
    """The whole config.json of the HF model in `folder` (None: none readable there)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
