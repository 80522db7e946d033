"""What every `star` sub-command does on bad input: one red line on stderr and exit code 2,
never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

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


# Options that several commands share, so that one thing has one flag name and one help text everywhere.


def host_option() -> Any:
    return typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0: every interface).")


def port_option(default: int) -> Any:
    return typer.Option(default, help="TCP port to listen on.")


def temperature_option(default: float) -> Any:
    return typer.Option(default, "--temperature", help="Sampling temperature.")


def top_p_option(default: float) -> Any:
    return typer.Option(
        default, "--top-p", help="Nucleus sampling: the smallest token set holding this much probability."
    )


def max_context_option(default: int) -> Any:
    return typer.Option(default, "--max-context", help="Context budget of one episode, in tokens.")


def max_tool_calls_option(default: int) -> Any:
    return typer.Option(default, "--max-tool-calls", help="Tool calls one episode may make.")


def seed_option(default: int | None, meaning: str = "Seed of the sampling (episode i uses seed + i).") -> Any:
    return typer.Option(default, "--seed", help=meaning)
