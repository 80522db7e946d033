"""`star learner ...` and `star sft ...`: the learner for people."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from services.common.cli import fail as _fail, host_option, port_option

console = Console(stderr=True)
learner_app = typer.Typer(help="Train the policy: RL runs and the learner service.", no_args_is_help=True)


@learner_app.command("serve")
def serve(host: str = host_option(), port: int = port_option(8005)) -> None:
    """Serve the learner API (POST /runs, GET /runs/{id}, POST /runs/{id}/stop)."""
    import uvicorn

    from services.learner.app import create_app

    uvicorn.run(create_app(), host=host, port=port, log_level="warning")


@learner_app.command("rl")
def rl(
    config: Path = typer.Argument(..., help="RLConfig as JSON or YAML."),
    max_steps: int | None = typer.Option(None, help="Stop after this many optimizer steps."),
) -> None:
    """Run GRPO/DAPO on the scored stream (engine.ranks > 1: that many ranks under torchrun)."""
    _run("rl", config, max_steps)


def sft(
    config: Path = typer.Argument(..., help="SFTConfig as JSON or YAML."),
    max_steps: int | None = typer.Option(None, help="Override the number of optimizer steps."),
) -> None:
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
    from services.learner.launch import RankError, resolve_ranks

    try:
        ranks = resolve_ranks(cfg.engine.ranks)
    except RankError as exc:
        _fail(f"{config}: {exc}")
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        fh.write(cfg.model_dump_json())
    steps = max_steps if kind == "rl" else None
    if ranks > 1:
        raise typer.Exit(_run_ranks(kind, Path(fh.name), ranks, steps))
    from services.learner.worker import run_file

    result = run_file(kind, Path(fh.name), steps)
    console.print(json.dumps({k: (str(v) if isinstance(v, Path) else v) for k, v in result.items() if k != "metrics"}))
    if result["state"] == "failed":
        raise typer.Exit(1)


def _run_ranks(kind: str, config: Path, ranks: int, max_steps: int | None) -> int:
    """The run as `ranks` processes under torchrun, in the foreground; its exit code (a failed rank's
    error is in torchrun's summary). Ctrl-C / SIGTERM reach every rank through the launcher."""
    import os
    import signal
    import subprocess

    from services.learner.launch import worker_argv, worker_env

    console.print(f"{kind}: {ranks} ranks under torchrun")
    proc = subprocess.Popen(worker_argv(kind, config, ranks, max_steps), env={**os.environ, **worker_env(ranks)})
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        return proc.wait()
