"""`star up`, `star down`, `star status`, `star train`: the system for people."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from services.common.settings import get_settings

console = Console(stderr=True)


def up_command(only: list[str] | None = typer.Option(None, "--only", help="Start just these services.")) -> None:
    """Start Redis and every service as local processes on 127.0.0.1 (embedded mode)."""
    from services.controller import local
    from services.controller.launcher import ensure_world

    settings = get_settings()
    ensure_world(settings.world_url)
    try:
        state = local.up(
            settings, only=only, on_start=lambda p: console.print(f"[green]up[/] {p.name:<14} {p.url or ''}")
        )
    except RuntimeError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    from services.common.redis import redact

    console.print(
        f"redis {redact(state.redis_url)} (password in {settings.home / 'redis' / 'redis.password'}); "
        f"state in {local.state_path(settings)}"
    )
    console.print("clients: " + " ".join(f"{k}={redact(v)}" for k, v in state.env().items()))


def down_command() -> None:
    """Stop the embedded fleet."""
    from services.controller import local

    stopped = local.down()
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


def status_command(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Each service's health, the queue depths and the published weight version."""
    from services.controller import local

    report = local.status()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    if not report["running"]:
        console.print("no fleet is running (start one with `star up`)")
        raise typer.Exit(1)
    table = Table("service", "pid", "url", "health")
    for p in report["processes"]:
        color = {"ready": "green", "up": "green"}.get(p["health"], "red")
        table.add_row(p["name"], str(p["pid"]), p["url"] or "-", f"[{color}]{p['health']}[/]")
    console.print(table)
    streams = Table("stream", "length", "pending", "lag", "dead")
    for name, d in report["streams"].items():
        if isinstance(d, dict):
            streams.add_row(name, *(str(d.get(k, "-")) for k in ("length", "pending", "lag", "dead")))
    console.print(streams)
    w = report["weights"]
    console.print(f"weights: version {w['version']} at {w['uri']}" if w else "weights: none published yet")


def train_command(
    config: str = typer.Argument(..., help="Recipe file, e.g. configs/tiny.yaml."),
    run_dir: str | None = typer.Option(None, "--run-dir", help="Run folder (default: STAR_HOME/runs/<name>)."),
    stage: list[str] | None = typer.Option(None, "--stage", help="Run only these stages (synth, sft, rl, eval)."),
    override: list[str] | None = typer.Option(None, "--set", help="Override a recipe value: section.key=value."),
    fleet: str | None = typer.Option(
        None,
        "--fleet",
        help="embedded: start the RL stage's own fleet; external: drive a running one (Compose, "
        "Helm) through STAR_REDIS_URL and the STAR_*_URL settings. Default: the recipe's deployment.fleet.",
    ),
) -> None:
    """Run the STAR pipeline (synthesis → SFT → RL → eval) as configured; rerun to resume."""
    from pathlib import Path

    from services.controller.train import StageFailed, train
    from services.pipeline.config import ConfigError, load_pipeline_config
    from services.pipeline.external import FleetUnreachable

    overrides = list(override or [])
    if stage:
        overrides.append(f"stages={json.dumps(list(stage))}")
    if fleet:
        overrides.append(f"deployment.fleet={json.dumps(fleet)}")
    try:
        cfg = load_pipeline_config(config, overrides)
    except ConfigError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    folder = Path(run_dir) if run_dir else get_settings().home / "runs" / cfg.name
    import signal

    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt  # unwinds through the stages, which stop their processes

    # SIGTERM (a supervisor), SIGHUP (the terminal closed) and SIGINT (Ctrl-C) all stop the fleet
    # in order; even a SIGKILL stops it (each process dies with the controller) and a rerun
    # stops whatever was left (services/common/supervisor.py).
    # (SIGINT too: a shell starting us in the background may have left it ignored)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _interrupt)
    try:
        run = train(cfg, folder)
    except FleetUnreachable as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    except StageFailed as exc:
        console.print(f"[red]stage failed:[/] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted[/]; rerun the same command to resume from {folder}")
        raise typer.Exit(130) from None
    console.print(f"run folder: {run.folder} (report: {run.folder / 'report.md'})")
