"""`star episodes serve`: the episode API (docs/environments.md)."""

from __future__ import annotations

import os

import typer

from services.common.cli import host_option, port_option
from services.common.settings import get_settings

episodes_app = typer.Typer(
    help="Serve TravelPlanner episodes to outside trainers (the episode API).", no_args_is_help=True
)


@episodes_app.command("serve")
def episodes_serve(
    host: str = host_option(),
    port: int = port_option(8007),
    db: str | None = typer.Option(None, help="SQLAlchemy URL of the world the scorer reads."),
    sandbox_url: str | None = typer.Option(
        None, "--sandbox-url", help="Sandbox service URL (default: STAR_SANDBOX_URL)."
    ),
    redis_url: str | None = typer.Option(None, "--redis-url", help="Redis URL (default: STAR_REDIS_URL)."),
    workers: int = typer.Option(1, min=1, help="Worker processes (episodes live in Redis: any worker serves any)."),
) -> None:
    """Serve /v1/episodes: start, tool calls, finish, state, close (OpenAPI docs at /docs)."""
    import uvicorn

    for name, value in (("STAR_DB_URL", db), ("STAR_SANDBOX_URL", sandbox_url), ("STAR_REDIS_URL", redis_url)):
        if value is not None:
            os.environ[name] = value
    get_settings.cache_clear()
    uvicorn.run(
        "services.episodes.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="warning",
        access_log=False,
    )
