"""`star rollout`: run G trajectories of one query and print them; `serve` and `worker` subcommands.

star rollout --model DIR --query q.json -G 8 [--engine vllm|transformers|openai]
star rollout serve --port 8004 [--config rollout.json]
star rollout worker [--config rollout.json]
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from services.common.cli import (
    fail as _fail,
    host_option,
    max_context_option,
    max_tool_calls_option,
    port_option,
    seed_option,
    temperature_option,
    top_p_option,
)

console = Console()
rollout_app = typer.Typer(
    help="ReAct agents on an inference engine (token-in/token-out).", invoke_without_command=True, no_args_is_help=False
)


def load_query(path: Path):
    """A TravelQuery from a JSON object, or the first line of a JSON-lines file."""
    from pydantic import ValidationError

    from services.common.schemas import TravelQuery

    if not path.is_file():
        _fail(f"no query file at {path}")
    text = path.read_text(encoding="utf-8").strip()
    if not text:
        _fail(f"{path} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = json.loads(text.splitlines()[0])
        except json.JSONDecodeError as exc:
            _fail(f"{path} is not JSON (nor JSON lines): {exc}")
    if isinstance(data, list):
        if not data:
            _fail(f"{path} holds an empty list")
        data = data[0]
    try:
        return TravelQuery.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        _fail(f"{path} is not a TravelQuery: {problems}")


@rollout_app.callback()
def rollout(
    ctx: typer.Context,
    model: str | None = typer.Option(
        None, "--model", help="HF model folder (vllm, transformers) or served model name (openai)."
    ),
    query: Path | None = typer.Option(None, "--query", help="JSON file with one TravelQuery."),
    group: int = typer.Option(1, "-G", "--group", min=1, max=256, help="Samples of the query."),
    engine: str = typer.Option("vllm", "--engine", help="vllm | transformers | openai"),
    base_url: str | None = typer.Option(None, "--base-url", help="openai: the API's base URL (…/v1)."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="openai: bearer key."),
    sandbox_url: str | None = typer.Option(
        None, "--sandbox-url", help="Sandbox service URL; default STAR_SANDBOX_URL, else the local world in-process."
    ),
    temperature: float = temperature_option(0.6),
    top_p: float = top_p_option(0.95),
    seed: int | None = seed_option(0),
    max_tokens: int = typer.Option(8192, "--max-tokens", help="Cap on one model turn's tokens."),
    max_context: int = max_context_option(30000),
    max_tool_calls: int = max_tool_calls_option(60),
    max_model_len: int = typer.Option(
        32768, "--max-model-len", help="The engine's context window (vllm, transformers)."
    ),
    sandbox: str | None = typer.Option(None, "--sandbox", hidden=True, help="Deprecated name of --sandbox-url."),
    context: int | None = typer.Option(None, "--context", hidden=True, help="Deprecated name of --max-context."),
    tool_budget: int | None = typer.Option(
        None, "--tool-budget", hidden=True, help="Deprecated name of --max-tool-calls."
    ),
    arpo: bool = typer.Option(False, help="ARPO branching (initial G/2, beam 2)."),
    out: Path | None = typer.Option(None, "--out", help="Also write the trajectories as JSON lines."),
    full: bool = typer.Option(False, help="Print every message in full."),
) -> None:
    """Run G trajectories of one query and print them."""
    if ctx.invoked_subcommand is not None:
        return
    if query is None:
        console.print(ctx.get_help())
        raise typer.Exit(0 if model is None else 2)
    from services.rollout.engines import ENGINES

    if engine not in ENGINES:
        _fail(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    q = load_query(query)
    from services.common.schemas import SamplingParams

    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            max_tokens_per_turn=max_tokens,
            max_context_tokens=max_context if context is None else context,
            max_tool_calls=max_tool_calls if tool_budget is None else tool_budget,
        )
    except ValueError as exc:
        _fail(str(exc))
    trajectories = asyncio.run(
        _run(model, engine, base_url, api_key, sandbox or sandbox_url, q, group, sampling, max_model_len, arpo)
    )
    for t in trajectories:
        show(t, full)
    summary(trajectories)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            for t in trajectories:
                fh.write(t.model_dump_json() + "\n")
        console.print(f"wrote {len(trajectories)} trajectories → {out}")


async def _run(model, engine_kind, base_url, api_key, sandbox, query, group, sampling, max_model_len, arpo):
    from services.common.settings import get_settings
    from services.rollout.agent import Agent
    from services.rollout.engines import build_engine
    from services.rollout.group import ArpoConfig, sample_group
    from services.rollout.tools import HttpToolClient

    options = (
        {"base_url": base_url, "api_key": api_key} if engine_kind == "openai" else {"max_model_len": max_model_len}
    )
    try:
        with console.status(f"starting the {engine_kind} engine…"):
            engine = build_engine(engine_kind, model, **options)
    except ValueError as exc:
        _fail(str(exc))
    settings = get_settings()
    url = sandbox or settings.sandbox_url
    if url:
        tools = HttpToolClient(url)
    else:
        tools = _local_tools(settings)
    agent = Agent(engine, tools)
    try:
        with console.status(f"rolling out {group} trajectories…"):
            return await sample_group(agent, query, group, sampling, arpo=ArpoConfig() if arpo else None)
    finally:
        await tools.close()
        await engine.close()


def _local_tools(settings):
    from services.rollout.tools import LocalToolClient
    from services.sandbox.tools.toolbox import ToolBox
    from services.sandbox.world import World

    world = World(settings.world_url)
    problem = world.problem()
    if problem:
        _fail(f"{problem} (or pass --sandbox-url URL)")
    return LocalToolClient(ToolBox.from_settings(world, settings))


COLORS = {
    "answer": "green",
    "format_error": "red",
    "context_limit": "yellow",
    "tool_budget": "yellow",
    "engine_error": "magenta",
}


def show(t, full: bool = False) -> None:
    colour = COLORS.get(t.finish_reason, "white")
    lines = []
    for m in t.messages[2:]:
        text = m["content"] if full else _clip(m["content"])
        who = "model" if m["role"] == "assistant" else "tool "
        lines.append(f"[bold]{who}[/bold] {text}")
    if t.answer is not None:
        lines.append(f"[green bold]answer[/green bold] {t.answer if full else _clip(t.answer, 600)}")
    if t.error:
        lines.append(f"[magenta]error[/magenta] {t.error}")
    title = (
        f"sample {t.sample_index} · [{colour}]{t.finish_reason}[/{colour}] · {t.tool_calls} tool calls · "
        f"{len(t.token_ids)} tokens ({int(sum(t.loss_mask))} sampled) · v{t.policy_version} · "
        f"{t.timings.get('total_s', 0):.1f}s"
    )
    console.print(Panel("\n".join(lines) or "(no turns)", title=title, title_align="left"))


def summary(trajectories) -> None:
    table = Table(title="group")
    for col in ("sample", "finish", "tool calls", "tokens", "sampled", "turns", "generate s", "tool s"):
        table.add_column(col)
    for t in trajectories:
        table.add_row(
            str(t.sample_index),
            t.finish_reason,
            str(t.tool_calls),
            str(len(t.token_ids)),
            str(sum(t.loss_mask)),
            f"{t.timings.get('turns', 0):.0f}",
            f"{t.timings.get('generate_s', 0):.2f}",
            f"{t.timings.get('tool_s', 0):.3f}",
        )
    console.print(table)


def _clip(text: str, limit: int = 240) -> str:
    text = text.replace("\n", " ⏎ ")
    return text if len(text) <= limit else text[:limit] + f"… (+{len(text) - limit} chars)"


def config_option():
    return typer.Option(
        None, "--config", help="JSON (or YAML) file of rollout settings; STAR_ROLLOUT_* set what it leaves out."
    )


def rollout_config(path: Path | None):
    """The process's RolloutConfig from `--config` (and the environment), or a clear error."""
    from services.rollout.config import RolloutConfigError, load_rollout_config

    try:
        return load_rollout_config(path)
    except RolloutConfigError as exc:
        _fail(str(exc))


@rollout_app.command("serve")
def serve(host: str = host_option(), port: int = port_option(8004), config: Path | None = config_option()) -> None:
    """Run the rollout HTTP service (engine from --config or STAR_ROLLOUT_*, sandbox from STAR_SANDBOX_URL)."""
    import uvicorn

    from services.rollout.app import create_app

    uvicorn.run(create_app(config=rollout_config(config)), host=host, port=port, log_level="warning")


@rollout_app.command("worker")
def worker(config: Path | None = config_option()) -> None:
    """Consume RolloutTasks from the tasks stream (STAR_REDIS_URL) until stopped."""
    settings = rollout_config(config)
    from services.rollout.worker import main

    main(config=settings)
