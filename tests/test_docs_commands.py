"""Every `star …` command that the README and docs/ name exists in the CLI, and is not a hidden alias."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?$(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
# `star` as a command: at the start of a code line or span, after a prompt, a shell operator or `run --rm IMAGE`
COMMAND = re.compile(r"(?:^[ \t]*|[$;&|(][ \t]*)star((?: [a-z][a-z0-9-]*){1,2})\b(?![/.])", re.M)


def code_of(text: str) -> list[str]:
    """The fenced blocks and inline code spans of a Markdown text."""
    blocks = [m.group(1) for m in FENCE.finditer(text)]
    return blocks + INLINE.findall(FENCE.sub("", text))


def named_commands() -> dict[str, set[str]]:
    """Each `star WORD [WORD]` written in the docs' code, with the files that write it."""
    found: dict[str, set[str]] = {}
    for path in DOCS:
        for code in code_of(path.read_text(encoding="utf-8")):
            for match in COMMAND.finditer(code):
                found.setdefault(match.group(1).strip(), set()).add(path.relative_to(ROOT).as_posix())
    return found


def problem(cli: click.Group, words: list[str]) -> str | None:
    """Why `star WORDS` is not a visible command, or None (a second word after a plain command is its argument)."""
    command = cli.commands.get(words[0])
    if command is None:
        return f"`star {words[0]}` is no command"
    if command.hidden:
        return f"`star {words[0]}` is a hidden alias"
    if len(words) > 1 and hasattr(command, "commands"):  # a group: the second word is its command
        sub = command.commands.get(words[1])
        if sub is None:
            return f"`star {words[0]} {words[1]}` is no command"
        if sub.hidden:
            return f"`star {words[0]} {words[1]}` is a hidden alias"
    return None


@pytest.fixture(scope="module")
def cli() -> click.Group:
    from services.cli import app

    return typer.main.get_command(app)


def test_the_docs_name_commands_at_all():
    named = named_commands()
    assert {"train", "up", "eval submission"} <= set(named), sorted(named)


def test_every_command_the_docs_name_exists(cli):
    wrong = [
        f"{reason} ({', '.join(sorted(files))})"
        for words, files in sorted(named_commands().items())
        if (reason := problem(cli, words.split()))
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_catches_a_missing_and_a_hidden_command(cli):
    assert problem(cli, ["demo"]) == "`star demo` is no command"
    assert problem(cli, ["sft"]) == "`star sft` is a hidden alias"
    assert problem(cli, ["eval", "nothing"]) == "`star eval nothing` is no command"
    assert problem(cli, ["train", "configs"]) is None and problem(cli, ["learner", "sft"]) is None
    assert COMMAND.findall("$ star up && star eval compare a b") == [" up", " eval compare"]
    assert code_of("a `star x` b\n```\nstar y z\n```\n") == ["\nstar y z\n", "star x"]
