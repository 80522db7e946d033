"""`star learner ...` and `star sft ...`: the learner for people."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from services.common.cli import fail as _fail, host_option, port_option
from rich.console import Console

console = Console(stderr=True)
learner_app = typer.Typer(help="Train the policy: RL runs and the learner service.", no_args_is_help=True)


@learner_app.command("serve")
def serve(host: str = host_option(), port: int = port_option(8005)) -> None:
    """Serve the learner API (POST /runs, GET /runs/{id}, POST /runs/{id}/stop)."""
    import uvicorn

    from services.learner.app import create_app

    uvicorn.run(create_app(), host=host, port=port, log_level="warning")


@learner_app.command("rl")
def rl(config: Path = typer.Argument(..., help="RLConfig as JSON or YAML."),
       max_steps: Optional[int] = typer.Option(None, help="Stop after this many optimizer steps.")) -> None:
    """Run GRPO/DAPO on the scored stream in this process (torchrun it for several ranks)."""
    _run("rl", config, max_steps)


def sft(config: Path = typer.Argument(..., help="SFTConfig as JSON or YAML."),
        max_steps: Optional[int] = typer.Option(None, help="Override the number of optimizer steps.")) -> None:
    """Supervised fine-tuning on chat trajectories (loss on assistant turns only)."""
    _run("sft", config, max_steps)


def _run(kind: str, config: Path, max_steps: int | None) -> None:
    from pydantic import ValidationError

    from services.learner.config import RLConfig, SFTConfig, load_config

    if not config.is_file():
        _fail(f"config file {config} does not exist")
    try:
        cfg = load_config(config, SFTConfig if kind == "sft" else RLConfig)
    except (ValidationError, ValueError) as exc:
        _fail(f"{config}: {exc}")
    if not Path(cfg.model).exists():
        _fail(f"model folder {cfg.model} does not exist")
    if kind == "sft" and not Path(cfg.data).is_file():
        _fail(f"data file {cfg.data} does not exist")
    if kind == "sft" and max_steps:
        cfg.max_steps = max_steps
    from services.learner.worker import run_file

    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        fh.write(cfg.model_dump_json())
    result = run_file(kind, Path(fh.name), max_steps if kind == "rl" else None)
    console.print(json.dumps({k: (str(v) if isinstance(v, Path) else v) for k, v in result.items()
                              if k != "metrics"}))
    if result["state"] == "failed":
        raise typer.Exit(1)
