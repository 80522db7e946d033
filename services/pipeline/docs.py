"""docs/configuration.md, generated from the typed recipe (PipelineConfig) and the `STAR_*` settings.

    python -m services.pipeline.docs           # rewrite docs/configuration.md
    python -m services.pipeline.docs --check   # exit 1 when the file differs from the code

The reference is read off the pydantic models (fields, types, defaults, bounds, descriptions), so a
field added to a recipe section or to Settings appears here once the command runs; a test fails
while the committed file is stale.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from services.common.settings import PROJECT_ROOT, Settings
from services.pipeline.config import PipelineConfig
from services.reward.config import RewardConfig
from services.rollout.config import RolloutConfig
from services.sandbox.config import SandboxConfig

OUTPUT = PROJECT_ROOT / "docs" / "configuration.md"
REQUIRED = object()

HEADER = """\
# Configuration reference

Generated from the code by `python -m services.pipeline.docs`; do not edit by hand (a test fails when this
file and the code differ). Three kinds of configuration exist:

- **The recipe**: one YAML file per run (`configs/*.yaml`), read by `star train CONFIG` into
  `PipelineConfig` (`services/pipeline/config.py`). Unknown keys are refused. Any key can be overridden on
  the command line: `star train configs/tiny.yaml --set rl.max_steps=4 --set services.rollout_workers=2`.
- **Settings**: `STAR_*` environment variables (or a `.env` file), read by every service into `Settings`
  (`services/common/settings.py`). They say where things are (database, Redis, data) and how a service
  behaves; a recipe says what a run trains.
- **A process's config file**: a process the controller starts reads its own settings from the file given to
  `--config` (JSON or YAML), which the controller writes into the run folder: `RolloutConfig`
  (`services/rollout/config.py`) for `star rollout worker|serve` (rollout/worker-<i>.json), `SandboxConfig`
  (`services/sandbox/config.py`) for `star sandbox serve` (sandbox.json), `RewardConfig`
  (`services/reward/config.py`) for `star reward worker` (reward/worker-<i>.json). A file's keys are the
  variables below in lower case without their prefix (`STAR_ROLLOUT_`, `STAR_`, `STAR_REWARD_`); the variables
  set what a file leaves out, so a deployment (Compose, Helm) needs no file. The environment of the processes
  the controller starts carries only addresses, ports and secrets.

`<checkout>` below is the repository's root folder.
"""


def model_class(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (`Spec`, `Spec | None`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [model_class(a) for a in typing.get_args(annotation)]
        return next((m for m in found if m is not None), None)
    return None


def type_name(annotation: Any) -> str:
    """A short reader's form of a type: `int`, `float | None`, `grpo | dapo | arpo`, `list[3 | 5 | 7]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("…" if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def bounds(field: FieldInfo) -> str:
    """The field's numeric and length bounds, as `≥ 0`, `< 1`, `length ≥ 1`."""
    signs = {
        Ge: ("≥", "ge"),
        Gt: (">", "gt"),
        Le: ("≤", "le"),
        Lt: ("<", "lt"),
        MinLen: ("length ≥", "min_length"),
        MaxLen: ("length ≤", "max_length"),
    }
    parts = []
    for item in field.metadata:
        for kind, (sign, attr) in signs.items():
            if isinstance(item, kind):
                parts.append(f"{sign} {getattr(item, attr)}")
    return ", ".join(parts)


def shown(value: Any) -> str:
    """A default as a recipe would write it, with the checkout's own path left out."""
    if value is REQUIRED:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, tuple):
        value = list(value)
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    text = text.replace(str(PROJECT_ROOT), "<checkout>").replace(str(PROJECT_ROOT.parent), "<checkout>/..")
    return f"`{text}`"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def default_of(field: FieldInfo) -> Any:
    return REQUIRED if field.is_required() else field.get_default(call_default_factory=True)


def sections(cls: type[BaseModel], instance: BaseModel | None, key: str) -> Iterator[tuple[str, str, list[str]]]:
    """(dotted key, section docstring, table rows) for a recipe section and every section inside it,
    with the defaults the enclosing section gives them (eval.sampling's differ from rl.sampling's)."""
    rows, nested = [], []
    for name, field in cls.model_fields.items():
        value = getattr(instance, name) if instance is not None else default_of(field)
        dotted = f"{key}.{name}" if key else name
        sub = model_class(field.annotation)
        if sub is not None:
            optional = "optional section" if value is None else "section"
            rows.append(f"| `{name}` | [{optional}](#{anchor(dotted)}) | | | {cell(field.description or '')} |")
            nested.append((sub, value if isinstance(value, sub) else None, dotted))
        else:
            rows.append(
                f"| `{name}` | {cell(type_name(field.annotation))} | {cell(shown(value))} | "
                f"{cell(bounds(field))} | {cell(field.description or '')} |"
            )
    yield key, (cls.__doc__ or "").strip() if cls.__doc__ != BaseModel.__doc__ else "", rows
    for sub, value, dotted in nested:
        yield from sections(sub, value, dotted)


def anchor(key: str) -> str:
    return "recipe-" + key.replace(".", "-").replace("_", "-") if key else "recipe"


def recipe_reference() -> list[str]:
    lines = ["## The recipe (`PipelineConfig`)", ""]
    for key, doc, rows in sections(PipelineConfig, None, ""):
        title = f"`{key}:`" if key else "top level"
        lines += [f'<a id="{anchor(key)}"></a>', "", f"### {title}", ""]
        if doc and key:
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | bounds | description |", "|---|---|---|---|---|", *rows, ""]
    return lines


def settings_reference(cls: type[BaseSettings], title: str) -> list[str]:
    prefix = cls.model_config.get("env_prefix", "")
    lines = [title, "", "| variable | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        lines.append(
            f"| `{prefix}{name.upper()}` | {cell(type_name(field.annotation))} | "
            f"{cell(shown(default_of(field)))} | {cell(bounds(field))} | {cell(field.description or '')} |"
        )
    return lines + [""]


def render() -> str:
    return (
        "\n".join(
            [
                HEADER,
                *recipe_reference(),
                *settings_reference(Settings, "## Settings (`STAR_*` environment variables)"),
                *settings_reference(
                    RolloutConfig,
                    "## Rollout settings (`--config FILE` or `STAR_ROLLOUT_*`: rollout servers and workers)",
                ),
                *settings_reference(
                    SandboxConfig, "## Sandbox settings (`--config FILE` or `STAR_*`: `star sandbox serve`)"
                ),
                *settings_reference(
                    RewardConfig, "## Reward worker settings (`--config FILE` or `STAR_REWARD_*`: `star reward worker`)"
                ),
            ]
        ).rstrip()
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when the file is stale instead of writing it")
    ap.add_argument("--out", type=Path, default=OUTPUT, help="where the reference goes (default: %(default)s)")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is stale: run `python -m services.pipeline.docs`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
