"""`star formatter ...`: serve the formatter, or format one plan text from the command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from services.common.cli import fail as _fail, host_option, port_option, read_text as _read
from services.common.settings import get_settings

formatter_app = typer.Typer(help="Plan text → TravelPlanner plan (structured parser, or an LLM).", no_args_is_help=True)


@formatter_app.command("serve")
def formatter_serve(
    host: str = host_option(),
    port: int = port_option(8002),
    workers: int = typer.Option(1, help="Worker processes."),
    llm_url: str | None = typer.Option(None, help="OpenAI-compatible base URL (STAR_FORMATTER_LLM_URL)."),
    llm_model: str | None = typer.Option(None, help="Model name (STAR_FORMATTER_LLM_MODEL)."),
) -> None:
    """Serve POST /format over HTTP (OpenAPI docs at /docs)."""
    import uvicorn

    for key, value in (("STAR_FORMATTER_LLM_URL", llm_url), ("STAR_FORMATTER_LLM_MODEL", llm_model)):
        if value is not None:
            os.environ[key] = value
    get_settings.cache_clear()
    uvicorn.run(
        "services.formatter.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="warning",
        access_log=False,
    )


@formatter_app.command("format")
def formatter_format(
    text_file: Path = typer.Argument(..., help="The plan text ('-' reads standard input)."),
    query: Path | None = typer.Option(None, help="The query as JSON (a TravelPlanner record)."),
    backend: str = typer.Option("auto", help="structured | llm | auto"),
) -> None:
    """Print the plan read from a text as JSON (exit 1 when no plan could be read)."""
    from pydantic import ValidationError

    from services.common.schemas import TravelQuery
    from services.formatter.core import Formatter, LLMUnavailable

    text = sys.stdin.read() if str(text_file) == "-" else _read(text_file)
    q = None
    if query is not None:
        try:
            q = TravelQuery(**json.loads(_read(query)))
        except (ValueError, TypeError, ValidationError) as exc:
            _fail(f"{query}: not a TravelPlanner query: {str(exc).splitlines()[0]}")
    fmt = Formatter.from_settings(get_settings())
    try:
        result = fmt.format(text, q, backend)  # type: ignore[arg-type]
    except (LLMUnavailable, ValueError) as exc:
        _fail(str(exc))
    finally:
        fmt.close()
    print(
        json.dumps(
            {
                "status": result.status,
                "backend": result.backend,
                "error": result.error,
                "plan": [d.model_dump() for d in result.plan.days] if result.plan else None,
            },
            indent=2,
            ensure_ascii=False,
        )
    )
    raise typer.Exit(0 if result.ok else 1)
