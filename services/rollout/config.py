"""The rollout process's own settings: `RolloutConfig`, from a config file and `STAR_ROLLOUT_*`.

A rollout server or worker started with `--config FILE` (JSON, or YAML by its suffix) reads its settings
from that file, which the controller writes into the run folder for each process it starts
(`write_rollout_config`, through services.common.config_file); environment variables still set any field the
file leaves out, so a deployment (Compose, Helm) configures its rollout pods with `STAR_ROLLOUT_*` alone. The
shared `STAR_*` settings (addresses, the model, the Redis URL) come from services.common.settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.config_file import ConfigFileError, read_config_file, write_config_file
from services.common.schemas import VllmArgs
from services.rollout.chat import ChatOptions

SECRETS = {"openai_api_key"}  # never written to a config file


# A rollout config file that cannot be used, with a message fit for the command line (the rollout commands' name).
RolloutConfigError = ConfigFileError


class RolloutConfig(BaseSettings):
    """`STAR_ROLLOUT_*` settings (the shared `STAR_*` ones come from services.common.settings)."""

    model_config = SettingsConfigDict(env_prefix="STAR_ROLLOUT_", extra="ignore")

    engine: Literal["vllm", "transformers", "openai"] = "vllm"
    model: str | None = Field(
        None, description="HF folder (vllm/transformers) or served name (openai); default STAR_MODEL."
    )
    max_model_len: int = Field(32768, ge=256)
    dtype: str | None = Field(None, description="Model dtype; default bfloat16 for vllm, float32 for transformers.")
    max_batch: int = Field(16, ge=1, description="transformers: requests decoded together.")
    vllm: VllmArgs = Field(
        default_factory=VllmArgs, description="vllm: engine arguments (JSON), as a recipe's services.vllm."
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description=(
            "vllm: this engine's share of its GPUs' memory (set per worker by the recipe's placement); "
            "overrides vllm's."
        ),
    )
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="vllm: GPUs this engine shards over; overrides vllm's."
    )
    kv_cache_from_share: bool | None = Field(
        None,
        description=(
            "vllm: size the KV cache from the memory share (set per worker by placement where GPUs are shared); "
            "overrides vllm's."
        ),
    )
    rehash_weights: bool = Field(
        False,
        description="Re-hash every file of a published version before loading it "
        "(the manifest's own hash and the file sizes are always checked).",
    )
    openai_base_url: str | None = None
    openai_api_key: str | None = None
    tools: Literal["http", "local"] = Field("http", description="Sandbox over HTTP (STAR_SANDBOX_URL) or in-process.")
    tool_timeout_s: float = Field(30.0, gt=0)
    tool_retries: int = Field(3, ge=0)
    max_inflight_episodes: int | None = Field(
        None,
        ge=1,
        description=(
            "Worker: episodes in flight at once on its engine, over all its groups. None: derived from a vLLM "
            "engine's KV cache (its memory share) over episode_tokens (services/rollout/capacity.py); 16 without one."
        ),
    )
    episode_tokens: int | None = Field(
        None,
        ge=64,
        description=(
            "Worker: the context one episode is expected to reach, for the derived max_inflight_episodes "
            "(None: max_model_len)."
        ),
    )
    concurrency: int | None = Field(
        None,
        ge=1,
        description=(
            "Worker (deprecated: use max_inflight_episodes): groups in flight at once; maps to concurrency × "
            "group_size episodes."
        ),
    )
    group_size: int = Field(8, ge=1, description="Worker: the group size the deprecated concurrency multiplies.")
    claim_idle_ms: int = Field(
        120_000, ge=100, description="Worker: reclaim a dead worker's task after this idle time."
    )
    max_deliveries: int = Field(3, ge=1, description="Worker: attempts before a task is dead-lettered.")
    consumer: str | None = Field(
        None,
        description="Worker: its name in the tasks stream's consumer group (Helm: the pod's name); default host-pid.",
    )
    http_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Worker: also serve the rollout HTTP API (health, weights, NCCL weight group) on this port, on the "
            "worker's engine; unset: no server. The embedded fleet sets it when weights travel over NCCL."
        ),
    )
    http_host: str = Field("127.0.0.1", description="Worker: the address its HTTP API (http_port) listens on.")
    max_format_errors: int = Field(3, ge=1)
    chat: ChatOptions = Field(
        default_factory=ChatOptions,
        description=(
            "The conversation format (JSON): chat template or ChatML, tool-call format, thinking mode; as a recipe's "
            "services.chat."
        ),
    )
    weights_timeout_s: float = Field(
        120.0, gt=0, description="A weight group join or broadcast that takes longer fails."
    )

    @classmethod
    def from_file(cls, path: str | Path) -> RolloutConfig:
        """The settings in `path`, with `STAR_ROLLOUT_*` for the fields it leaves out (the file's win)."""
        return read_config_file(cls, path, "rollout")


def write_rollout_config(path: str | Path, config: RolloutConfig) -> Path:
    """Write the settings `config` was given (not its defaults) to `path` (JSON) for a rollout process started
    with `--config path`: the process's own `STAR_ROLLOUT_*` and defaults fill in the rest. A secret (the OpenAI
    key) stays out of the file, for the process's environment to carry."""
    return write_config_file(path, config, exclude=SECRETS)


def load_rollout_config(path: str | Path | None) -> RolloutConfig:
    """The process's settings: from `path` (and the environment) when given, else the environment's alone."""
    return RolloutConfig.from_file(path) if path is not None else RolloutConfig()
