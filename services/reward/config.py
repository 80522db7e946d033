"""The reward worker's own settings: `RewardConfig`, from a config file and `STAR_REWARD_*`.

`star reward worker --config FILE` (JSON, or YAML by its suffix) reads them from that file, which the embedded
fleet's controller writes into the run folder for each worker it starts (reward/worker-<i>.json); the
`STAR_REWARD_*` variables set what the file leaves out, and the command's flags set what they say over both. How a
trajectory is scored (evaluator mode, reward kind, epoch, preference penalty) is no worker setting: each
trajectory carries its own. The world's address (STAR_DB_URL), the Redis URL and the formatter's API are shared
settings (services.common.settings).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.config_file import read_config_file, write_config_file


class RewardConfig(BaseSettings):
    """`STAR_REWARD_*` settings of a scoring worker (the shared `STAR_*` ones come from services.common.settings)."""

    model_config = SettingsConfigDict(env_prefix="STAR_REWARD_", extra="ignore")

    consumer: str | None = Field(
        None, description="Its name in the trajectories stream's consumer group (Helm: the pod's); default host-pid."
    )
    batch: int = Field(8, ge=1, description="Trajectories read per round.")
    threads: int = Field(
        1, ge=1, le=64, description="Consumers in the process (more when an LLM formats: each waits on the API)."
    )
    claim_idle_ms: int = Field(60_000, ge=100, description="Reclaim a dead worker's trajectory after this idle time.")
    max_deliveries: int = Field(3, ge=1, description="Attempts before a trajectory is dead-lettered.")

    @classmethod
    def from_file(cls, path: str | Path) -> RewardConfig:
        """The settings in `path`, with `STAR_REWARD_*` for the fields it leaves out (the file's win)."""
        return read_config_file(cls, path, "reward")

    def consumers(self, fallback: str) -> list[str]:
        """The consumer name of each of the process's `threads` (`fallback` when the settings name none)."""
        base = self.consumer or fallback
        return [base] if self.threads == 1 else [f"{base}-{i}" for i in range(self.threads)]


def write_reward_config(path: str | Path, config: RewardConfig) -> Path:
    """Write the settings `config` was given (not its defaults) to `path` (JSON), for `star reward worker
    --config path`."""
    return write_config_file(path, config)


def load_reward_config(path: str | Path | None) -> RewardConfig:
    """The worker's settings: from `path` (and the environment) when given, else the environment's alone."""
    return RewardConfig.from_file(path) if path is not None else RewardConfig()
