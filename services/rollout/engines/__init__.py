"""Inference engines behind one async interface (see base.py); `build_engine` picks one by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.rollout.engines.base import Engine, EngineError, Generation, TurnParams

ENGINES = ("vllm", "transformers", "openai")

__all__ = ["ENGINES", "Engine", "EngineError", "Generation", "TurnParams", "build_engine"]


def build_engine(kind: str, model: str | Path | None, **options: Any) -> Engine:
    """`vllm` / `transformers`: `model` is an HF folder; `openai`: `model` is the served model
    name and `base_url` (and optionally `api_key`) are required options."""
    if kind == "vllm":
        from services.rollout.engines.vllm_engine import VllmEngine

        return VllmEngine(_folder(model), **options)
    if kind == "transformers":
        from services.rollout.engines.hf import TransformersEngine

        return TransformersEngine(_folder(model), **options)
    if kind == "openai":
        from services.rollout.engines.openai_engine import OpenAIEngine

        if not options.get("base_url"):
            raise ValueError("the openai engine needs base_url (e.g. https://api.example.com/v1)")
        return OpenAIEngine(options.pop("base_url"), str(model or "default"), **options)
    raise ValueError(f"unknown engine {kind!r}; use one of {', '.join(ENGINES)}")


def _folder(model: str | Path | None) -> Path:
    if model is None:
        raise ValueError("this engine needs --model, a local HF model folder")
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not an HF model folder (no config.json)")
    return path
