"""What every `star` sub-command does on bad input: one red line on stderr and exit code 2,
never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

errors = Console(stderr=True, soft_wrap=True)


def fail(message: str) -> NoReturn:
    errors.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def read_text(path: Path) -> str:
    """A UTF-8 file the user named, or a clear CLI error."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        fail(f"{path} is not UTF-8 text")
