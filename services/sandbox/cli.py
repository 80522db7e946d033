"""`star world ...`, `star sandbox ...` and `star tool ...`: the sandbox for people."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.common.cli import fail, host_option, port_option
from services.common.redis import redact
from services.common.settings import get_settings

console = Console(stderr=True)
world_app = typer.Typer(help="Build and inspect the travel world database.", no_args_is_help=True)
sandbox_app = typer.Typer(help="Serve the sandbox tool service.", no_args_is_help=True)


def _db_url(db: str | None) -> str:
    return db or get_settings().world_url


@world_app.command("build")
def world_build(
    source: Path | None = typer.Option(
        None, "--from", help="Official database directory (TravelPlanner or flat Agent-STAR layout)."
    ),
    synthetic: str | None = typer.Option(None, help="Build a synthetic world of this size (tiny|small|medium|full)."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL (default: SQLite under STAR_HOME)."),
    seed: int = typer.Option(0, help="Seed for generated flights / synthetic worlds."),
    flights_csv: Path | None = typer.Option(None, help="A real flights CSV in the official schema."),
    flight_scale: float | None = typer.Option(
        None, help="Generated flight density (1.0 = official size, ~3.8 M rows)."
    ),
    ref_info: list[Path] = typer.Option([], help="*_ref_info.jsonl files whose real flight rows are merged."),
    if_missing: bool = typer.Option(
        False,
        "--if-missing",
        help="Keep a complete world already in the database "
        "(a deployment's one-shot job, started again under live services).",
    ),
) -> None:
    """Build the world from the official tables (default: ../shared/travelplanner) or synthetically."""
    from services.sandbox.world import World, build

    url = _db_url(db)
    if source is not None and synthetic is not None:
        raise typer.BadParameter("give either --from DIR or --synthetic SIZE, not both")
    if if_missing:
        world = World(url)
        try:
            kept = world.identity() if world.problem() is None else None
        finally:
            world.close()
        if kept is not None:
            console.print(f"kept the world in {redact(url)}: {kept['source']}, hash {kept['world_hash']}")
            return
    with _progress() as bar:
        task = bar.add_task("world", total=None, stage="start")

        def progress(stage: str, n: int) -> None:
            bar.update(task, advance=n, stage=stage)

        try:
            if synthetic is not None:
                meta = build.build_synthetic_world(url, size=synthetic, seed=seed, progress=progress)
            else:
                settings = get_settings()
                directory = source or settings.travelplanner_dir / "database"
                refs = list(ref_info)
                default_ref = settings.travelplanner_dir / "train" / "train_ref_info.jsonl"
                if not refs and source is None and default_ref.is_file():
                    refs = [default_ref]
                kwargs = {"flight_scale": flight_scale} if flight_scale is not None else {}
                meta = build.build_official_world(
                    url, directory, seed=seed, flights_csv=flights_csv, ref_info=refs, progress=progress, **kwargs
                )
        except (ValueError, FileNotFoundError) as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None
    _print_world(url)
    console.print(f"built in {meta.get('seconds', '?')} s → {redact(url)}")


@world_app.command("info")
def world_info(db: str | None = typer.Option(None, help="SQLAlchemy URL.")) -> None:
    """Show what a world database holds."""
    _print_world(_db_url(db))


def _print_world(url: str) -> None:
    from services.sandbox.world import World

    world = World(url)
    if problem := world.problem():
        console.print(f"[red]error:[/red] {problem}")
        raise typer.Exit(2)
    table = Table(title=f"world at {redact(url)}")
    table.add_column("table")
    table.add_column("visible rows", justify="right")
    for name, n in world.counts().items():
        table.add_row(name, f"{n:,}")
    console.print(table)
    console.print_json(json.dumps(world.meta()))
    world.close()


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.fields[stage]:<15}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f} rows"),
        TimeElapsedColumn(),
        console=console,
    )


@sandbox_app.command("serve")
def sandbox_serve(
    host: str = host_option(),
    port: int = port_option(8001),
    workers: int = typer.Option(1, help="Worker processes."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL of the world."),
    dialect: str | None = typer.Option(None, help="Default tool dialect: star | official."),
    fault_rate: float | None = typer.Option(None, help="Run-level tool failure probability."),
    fault_seed: int | None = typer.Option(None, help="Seed of the run-level failure draws."),
    config: Path | None = typer.Option(
        None, "--config", help="JSON (or YAML) file of sandbox settings; STAR_* set what it leaves out."
    ),
) -> None:
    """Serve the tools over HTTP (OpenAPI docs at /docs)."""
    import uvicorn

    tools = _sandbox_config(config, tool_dialect=dialect, fault_rate=fault_rate, fault_seed=fault_seed)
    # uvicorn's workers are started from an import string: the settings reach them through their environment
    os.environ.update(tools.environment())
    if db is not None:
        os.environ["STAR_DB_URL"] = db
    get_settings.cache_clear()
    uvicorn.run(
        "services.sandbox.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="warning",
        access_log=False,
    )


def _sandbox_config(path: Path | None, **flags: object):
    """The sandbox's settings: `--config` (and the STAR_* variables), the flags given over it; or a clear error
    naming the bad field."""
    from pydantic import ValidationError

    from services.common.config_file import ConfigFileError
    from services.sandbox.config import SandboxConfig, load_sandbox_config

    try:
        loaded = load_sandbox_config(path)
        given = {name: value for name, value in flags.items() if value is not None}
        return SandboxConfig.model_validate({**loaded.model_dump(), **given}) if given else loaded
    except ConfigFileError as exc:
        fail(str(exc))
    except ValidationError as exc:
        fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))


def tool_command(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Tool name, e.g. SearchFlight."),
    url: str | None = typer.Option(None, help="Call a running sandbox at this URL instead of in-process."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL of the world (in-process)."),
    dialect: str | None = typer.Option(None, help="star | official."),
) -> None:
    """Run one tool: `star tool SearchFlight --departure "St. Petersburg" --destination Rockford --date 2022-03-16`."""
    arguments = _parse_tool_args(ctx.args)
    if url:
        import httpx

        resp = httpx.post(
            f"{url.rstrip('/')}/tools/call", json={"name": name, "arguments": arguments, "dialect": dialect}, timeout=30
        )
        if resp.status_code != 200:
            console.print(f"[red]error {resp.status_code}:[/red] {resp.json().get('detail', resp.text)}")
            raise typer.Exit(2)
        text = resp.json()["text"]
    else:
        from services.sandbox.tools.toolbox import ToolBox, UnknownTool
        from services.sandbox.world import World

        world = World(_db_url(db))
        if problem := world.problem():
            console.print(f"[red]error:[/red] {problem}")
            raise typer.Exit(2)
        box = ToolBox(world, dialect=dialect or get_settings().tool_dialect, cache_size=0)
        try:
            text = box.call(name, arguments).text
        except UnknownTool:
            console.print(f"[red]error:[/red] unknown tool {name!r}; known: {', '.join(box.names())}")
            raise typer.Exit(2) from None
    typer.echo(text)


def _parse_tool_args(args: list[str]) -> dict[str, str]:
    """`--key value` / `--key=value` pairs into a dict of strings."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--") or token == "--":
            raise typer.BadParameter(f"expected --name value, got {token!r}")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise typer.BadParameter(f"--{key} needs a value")
            value = args[i + 1]
            i += 1
        out[key.replace("-", "_")] = value
        i += 1
    return out
