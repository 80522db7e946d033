"""How many episodes a rollout engine can keep in flight: its KV cache over one episode's context.

An episode holds its whole context in the engine's KV cache while it runs (and between turns, while
its prefix stays cached), so an engine whose cache holds T tokens runs about T / C episodes of C
tokens without vLLM pre-empting (recomputing) any. T comes from the engine's memory share as vLLM
sizes it (`kv_cache_bytes_from_share`: the share less the weights and a reserve) over the model's
KV bytes per token (2 · layers · kv_heads · head_dim · dtype bytes); C is the recipe's context
(`max_context_tokens`), or `episode_tokens` where most episodes end well before it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
DEFAULT_INFLIGHT_EPISODES = 16  # without a GPU engine to measure (CPU, transformers, a remote model)
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_bytes_per_token(model_config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """KV cache bytes one token takes across the model's layers (keys and values)."""
    try:
        layers = int(model_config["num_hidden_layers"])
        heads = int(model_config["num_attention_heads"])
        kv_heads = int(model_config.get("num_key_value_heads") or heads)
        head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the model config lacks a shape field for its KV cache: {exc}") from None
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def episodes_for_kv(kv_cache_bytes: int, per_token: int, episode_tokens: int) -> int:
    """Episodes of `episode_tokens` whose KV caches fit in `kv_cache_bytes` together (at least 1)."""
    if per_token <= 0 or episode_tokens <= 0:
        raise ValueError(f"KV bytes per token ({per_token}) and episode tokens ({episode_tokens}) must be positive")
    return max(1, kv_cache_bytes // (per_token * episode_tokens))


def engine_episodes(
    model: str | Path,
    *,
    share: float,
    card_bytes: int,
    tensor_parallel: int,
    episode_tokens: int,
    kv_cache_dtype: str = "auto",
) -> int:
    """The episode budget of a vLLM engine of `model` taking `share` of each of its `tensor_parallel`
    cards of `card_bytes`: each card's KV cache holds its slice (kv_heads / tp) of every token."""
    from services.rollout.engines.vllm_engine import kv_cache_bytes_from_share, weights_bytes

    config = json.loads((Path(model) / "config.json").read_text())
    per_token = kv_bytes_per_token(config, KV_DTYPE_BYTES.get(kv_cache_dtype, 2))
    per_card = kv_cache_bytes_from_share(share, card_bytes, weights_bytes(model), tensor_parallel)
    return episodes_for_kv(per_card * tensor_parallel, per_token, episode_tokens)


def inflight_budget(config: Any, model: str | None, card_bytes: int | None = None) -> int:
    """A worker's `max_inflight_episodes`: the setting where given; else the deprecated `concurrency`
    (groups) times `group_size`; else derived from its vLLM engine's KV budget on the GPU (`card_bytes`,
    read from the first visible card when not given); else `DEFAULT_INFLIGHT_EPISODES`."""
    if config.max_inflight_episodes is not None:
        return config.max_inflight_episodes
    if config.concurrency is not None:
        return config.concurrency * config.group_size
    if config.engine == "transformers":
        return config.max_batch
    if config.engine != "vllm" or model is None:
        return DEFAULT_INFLIGHT_EPISODES
    if card_bytes is None:
        card_bytes = _card_bytes()
        if card_bytes is None:
            return DEFAULT_INFLIGHT_EPISODES
    share = config.gpu_memory_utilization or config.vllm.gpu_memory_utilization
    tp = config.tensor_parallel_size or config.vllm.tensor_parallel_size
    tokens = config.episode_tokens or config.max_model_len
    try:
        n = engine_episodes(
            model,
            share=share,
            card_bytes=card_bytes,
            tensor_parallel=tp,
            episode_tokens=tokens,
            kv_cache_dtype=config.vllm.kv_cache_dtype,
        )
    except (OSError, ValueError) as exc:
        log.warning(
            "episode budget not derivable; using the default",
            extra={"error": str(exc), "default": DEFAULT_INFLIGHT_EPISODES},
        )
        return DEFAULT_INFLIGHT_EPISODES
    log.info("episode budget from the KV cache", extra={"episodes": n, "episode_tokens": tokens, "share": share})
    return n


def engine_for_budget(config: Any, episodes: int) -> Any:
    """The worker's config with its vLLM engine sized to the worker's episode budget where the recipe
    leaves `max_num_seqs` to vLLM: the worker never has more than `episodes` requests on its engine at
    once (one turn per episode), whereas vLLM's default for an H100/H200 is 1,024 sequences, and an
    engine's per-step work and reserved sampler memory grow with that bound, not with the load."""
    if config.engine != "vllm" or config.vllm.max_num_seqs is not None:
        return config
    tp = config.tensor_parallel_size or config.vllm.tensor_parallel_size
    seqs = max(episodes, tp)  # vLLM wants at least one sequence per tensor-parallel rank
    return config.model_copy(update={"vllm": config.vllm.model_copy(update={"max_num_seqs": seqs})})


def _card_bytes() -> int | None:
    """The first visible card's memory, read as vLLM reads it (NVML where it can): the worker sizes
    its engine before starting it, and a CUDA context made here first would take memory on the card
    and make vLLM spawn its engine process rather than fork it."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cuda():
            return int(current_platform.get_device_total_memory(0))
    except Exception:  # noqa: BLE001 - no vLLM, or NVML unusable: ask torch
        pass
    try:
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no usable CUDA here: the default budget
        return None
