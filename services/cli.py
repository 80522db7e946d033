"""The `star` command."""

from __future__ import annotations

import typer

from services.embedded import demo
from services.sandbox.cli import sandbox_app, tool_command, world_app

app = typer.Typer(help="The STAR training system: synthesis → SFT → RL on TravelPlanner.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
app.add_typer(world_app, name="world")
app.add_typer(sandbox_app, name="sandbox")
app.command("tool", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(tool_command)
app.command("demo")(demo)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
