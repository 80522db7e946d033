"""The sandbox's own settings: `SandboxConfig`, from a config file and the `STAR_*` variables under it.

`star sandbox serve --config FILE` (JSON, or YAML by its suffix) reads the tools' settings from that file, which
the embedded fleet's controller writes into the run folder (sandbox.json: the recipe's fault rate and seed). The
`STAR_TOOL_DIALECT`, `STAR_FAULT_RATE`, `STAR_FAULT_SEED`, `STAR_PER_TOOL_FAULT_RATES` and
`STAR_TOOL_CACHE_SIZE` variables set what the file leaves out, so a deployment (Compose, Helm) configures its
sandbox by its environment alone, as before. The world's address and the API token are shared settings
(services.common.settings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.config_file import read_config_file, write_config_file
from services.common.settings import Settings
from services.sandbox.tools.registry import resolve_tool, tool_names
from services.sandbox.tools.toolbox import check_dialect

# Each field the shared Settings also has is declared there once, its default and bounds included.
_SHARED = Settings.model_fields


class SandboxConfig(BaseSettings):
    """The tools' settings: their output dialect, the run-level fault injection and the result cache."""

    model_config = SettingsConfigDict(env_prefix="STAR_", env_file=".env", extra="ignore")

    tool_dialect: str = _SHARED["tool_dialect"]
    fault_rate: float = _SHARED["fault_rate"]
    fault_seed: int = _SHARED["fault_seed"]
    per_tool_fault_rates: dict[str, float] = Field(
        default_factory=dict,
        description="Failure probability (0-1) by tool name (official aliases too), overriding fault_rate there.",
    )
    tool_cache_size: int = _SHARED["tool_cache_size"]

    @field_validator("tool_dialect")
    @classmethod
    def _known_dialect(cls, dialect: str) -> str:
        return check_dialect(dialect)

    @field_validator("per_tool_fault_rates")
    @classmethod
    def _known_tools_and_rates(cls, rates: dict[str, float]) -> dict[str, float]:
        unknown = sorted(name for name in rates if resolve_tool(name) is None)
        if unknown:
            raise ValueError(f"unknown tools {', '.join(unknown)}; known: {', '.join(tool_names())}")
        outside = sorted(name for name, rate in rates.items() if not 0.0 <= rate <= 1.0)
        if outside:
            raise ValueError(f"rates of {', '.join(outside)} outside 0-1")
        return rates

    @classmethod
    def from_file(cls, path: str | Path) -> SandboxConfig:
        """The settings in `path`, with the `STAR_*` variables for the fields it leaves out (the file's win)."""
        return read_config_file(cls, path, "sandbox")

    def toolbox_options(self) -> dict[str, Any]:
        """The ToolBox keyword arguments these settings give."""
        return {
            "dialect": self.tool_dialect,
            "fault_rate": self.fault_rate,
            "fault_seed": self.fault_seed,
            "per_tool_fault_rates": self.per_tool_fault_rates,
            "cache_size": self.tool_cache_size,
        }

    def environment(self) -> dict[str, str]:
        """These settings as the `STAR_*` variables this model reads: how `star sandbox serve` hands them to its
        uvicorn worker processes, which are started from an import string and take no object."""
        prefix = self.model_config["env_prefix"]
        values = self.model_dump(mode="json")
        return {
            f"{prefix}{name.upper()}": value if isinstance(value, str) else json.dumps(value)
            for name, value in values.items()
        }


def write_sandbox_config(path: str | Path, config: SandboxConfig) -> Path:
    """Write the settings `config` was given (not its defaults) to `path` (JSON), for `star sandbox serve
    --config path`."""
    return write_config_file(path, config)


def load_sandbox_config(path: str | Path | None) -> SandboxConfig:
    """The sandbox's settings: from `path` (and the environment) when given, else the environment's alone."""
    return SandboxConfig.from_file(path) if path is not None else SandboxConfig()
