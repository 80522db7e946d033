"""A process's own config file: a typed settings model written by the controller and read back by the process.

The controller writes each process it starts a file of its own in the run folder (`write_config_file`) and starts
it with `--config FILE`; the process reads it (`read_config_file`, JSON or YAML by the suffix) into its settings
model, whose environment variables fill in what the file leaves out, so a deployment (Compose, Helm) configures
the same process by its environment alone. A bad file is a `ConfigFileError` whose message names the file and
each bad field, for the command line to print.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Config = TypeVar("Config", bound=BaseModel)
YAML_SUFFIXES = (".yaml", ".yml")


class ConfigFileError(ValueError):
    """A config file that cannot be used, with a message fit for the command line."""


def read_config_file(cls: type[Config], path: str | Path, role: str) -> Config:
    """The `role` process's settings (`cls`) from `path`, the environment's for what it leaves out (the file's
    win). Refuses a missing or unreadable file, a key `cls` has no field for, and a bad value, naming each."""
    path = Path(path)
    data = _mapping(path, role)
    unknown = sorted(set(data) - set(cls.model_fields))
    if unknown:
        raise ConfigFileError(f"{path}: unknown {role} settings {', '.join(unknown)}")
    try:
        return cls(**data)  # a settings model's init values take precedence over its environment's
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()]
        raise ConfigFileError(f"{path} is not a valid {role} config:\n" + "\n".join(lines)) from None


def given_settings(cls: type[Config], values: Mapping[str, Any]) -> Config:
    """`cls` with `values` alone set, validated: what the controller writes into a process's file. A settings
    model validated the usual way also reads the environment, and the controller's is not the process's."""
    checked = cls.model_validate(dict(values))
    return cls.model_construct(_fields_set=set(values), **{name: getattr(checked, name) for name in values})


def write_config_file(path: str | Path, config: BaseModel, *, exclude: Collection[str] = ()) -> Path:
    """Write the settings `config` was given (not its defaults) to `path` as JSON, for a process started with
    `--config path`: its own environment and defaults fill in the rest. `exclude` (secrets) stays out of the
    file, for the process's environment to carry."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = config.model_dump_json(indent=2, exclude=set(exclude), exclude_unset=True)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def _mapping(path: Path, role: str) -> dict:
    if not path.is_file():
        raise ConfigFileError(f"no {role} config file at {path}")
    yaml_file = path.suffix in YAML_SUFFIXES
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text) if yaml_file else json.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"cannot read {path}: {exc}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"{path} is not valid {'YAML' if yaml_file else 'JSON'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path} must hold a mapping of {role} settings")
    return data
