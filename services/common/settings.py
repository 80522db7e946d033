"""Settings read from `STAR_*` environment variables (and an optional `.env`).

One object for every service keeps names consistent across Compose, Helm and the embedded
mode: `STAR_DB_URL` means the same thing to the sandbox and to the reward scorer.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Real TravelPlanner tables live beside the checkout, never inside it.
DEFAULT_TRAVELPLANNER_DIR = PROJECT_ROOT.parent / "shared" / "travelplanner"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STAR_", env_file=".env", extra="ignore")

    home: Path = Field(default=PROJECT_ROOT / "var", description="Where worlds, weights and runs are written.")
    db_url: str | None = Field(default=None, description="SQLAlchemy URL of the travel world; default: SQLite under home.")
    redis_url: str | None = Field(default=None, description="Redis URL; unset starts an embedded Redis server.")
    travelplanner_dir: Path = Field(default=DEFAULT_TRAVELPLANNER_DIR, description="Official TravelPlanner data.")

    api_token: str | None = Field(default=None, description="Bearer token required by mutating endpoints.")
    max_body_bytes: int = Field(default=64 * 1024, description="Largest request body a service accepts.")
    log_level: str = "INFO"
    log_json: bool = True

    # sandbox
    tool_dialect: str = Field(default="star", description="Tool output dialect: star | official.")
    fault_rate: float = Field(default=0.0, ge=0.0, le=1.0, description="Per-call tool failure probability.")
    fault_seed: int = 0
    tool_cache_size: int = Field(default=4096, ge=0, description="Rendered tool results kept in memory (0: off).")

    @property
    def world_url(self) -> str:
        return self.db_url or f"sqlite:///{self.home / 'world.sqlite'}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
