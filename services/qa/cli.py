"""`star qa ...`: build the passage index, search it, serve it, score QA runs."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from services.common.cli import (
    fail as _fail,
    host_option,
    max_context_option,
    max_tool_calls_option,
    port_option,
    temperature_option,
    top_p_option,
)
from services.common.settings import get_settings

console = Console(stderr=True, soft_wrap=True)
qa_app = typer.Typer(help="OOD QA: dense passage search and the seven QA sets (paper Table 2).", no_args_is_help=True)


def _index_dir(index: Path | None) -> Path:
    from services.qa.app import index_dir

    return index or index_dir(get_settings())


@qa_app.command("index")
def qa_index(
    corpus: Path = typer.Argument(..., help="JSONL corpus: {id, contents} (wiki-18 form) or {id, title, text}."),
    out: Path | None = typer.Option(None, help="Index folder (default: STAR_QA_INDEX or STAR_HOME/qa/index)."),
    encoder: str = typer.Option("minilm", help="minilm (offline) or e5 (production; query:/passage: prefixes)."),
    model: str | None = typer.Option(None, help="Encoder path or hub name overriding the preset's."),
    batch_size: int = typer.Option(64, min=1, help="Passages encoded per batch."),
) -> None:
    """Encode a passage corpus into an index folder (progress bar)."""
    from dataclasses import replace

    from services.qa.retriever import RetrieverError, build_index, encoder_preset

    try:
        config = replace(encoder_preset(encoder, model), batch_size=batch_size)
        path = build_index(corpus, _index_dir(out), config)
    except RetrieverError as exc:
        _fail(str(exc))
    console.print(f"index written to {path}")


@qa_app.command("search")
def qa_search(
    query: str = typer.Argument(..., help="The search query."),
    index: Path | None = typer.Option(None, help="Index folder (default: STAR_QA_INDEX or STAR_HOME/qa/index)."),
    k: int = typer.Option(5, min=1, help="Passages to return."),
) -> None:
    """Run one Search call against an index and print the tool text."""
    from services.qa.retriever import PassageIndex, RetrieverError, render_hits

    try:
        hits = PassageIndex.load(_index_dir(index)).search(query, k)
    except RetrieverError as exc:
        _fail(str(exc))
    typer.echo(render_hits(hits))


@qa_app.command("serve")
def qa_serve(
    host: str = host_option(),
    port: int = port_option(8006),
    index: Path | None = typer.Option(None, help="Index folder (default: STAR_QA_INDEX or STAR_HOME/qa/index)."),
) -> None:
    """Serve Search over HTTP (POST /search, POST /tools/call)."""
    import os

    import uvicorn

    if index is not None:
        os.environ["STAR_QA_INDEX"] = str(index)
        get_settings.cache_clear()
    uvicorn.run("services.qa.app:create_app", factory=True, host=host, port=port)


@qa_app.command("eval")
def qa_eval(
    data: list[Path] = typer.Option(..., "--data", help="QA files (repeat); dataset from the file name or NAME=FILE."),
    predictions: Path | None = typer.Option(None, help="JSONL of {id, [dataset], prediction} replies to score."),
    agent: str | None = typer.Option(None, help="package.module:function answering (item, tools) → reply."),
    model: str | None = typer.Option(None, help="Run the search agent: HF model folder or openai:NAME."),
    engine: str = typer.Option("vllm", help="Engine for --model: vllm | transformers."),
    base_url: str | None = typer.Option(None, help="OpenAI-compatible base URL for openai:NAME."),
    search_url: str | None = typer.Option(None, help="Search service URL (default: the index in-process)."),
    temperature: float = temperature_option(0.6),
    top_p: float = top_p_option(0.95),
    max_tool_calls: int = max_tool_calls_option(10),
    max_context: int = max_context_option(8192),
    index: Path | None = typer.Option(None, help="Passage index for the agent's Search tool."),
    out: Path | None = typer.Option(None, help="Run folder for predictions.jsonl, metrics.json, report.md."),
    n: int | None = typer.Option(None, "-n", help="At most this many questions per dataset."),
) -> None:
    """Score answers on the QA sets: EM / F1 per dataset and the average."""
    from services.qa.datasets import QADataError, load_qa
    from services.qa.evaluate import QAPredictionError, evaluate_qa, load_agent, read_predictions, write_qa_run

    if sum(x is not None for x in (predictions, agent, model)) != 1:
        _fail("give exactly one of --predictions FILE, --agent module:function or --model")
    close = None
    try:
        items = []
        for spec in data:
            name, sep, file = str(spec).partition("=")
            items += load_qa(file, name, limit=n) if sep else load_qa(spec, limit=n)
        tools = None
        if agent is not None or (model is not None and search_url is None):
            from services.qa.retriever import PassageIndex
            from services.qa.tools import SearchToolSet

            tools = SearchToolSet(PassageIndex.load(_index_dir(index)), top_k=get_settings().qa_top_k)
        run_agent = load_agent(agent) if agent else None
        if model is not None:
            from services.common.schemas import SamplingParams
            from services.qa.agent import rollout_qa_agent

            sampling = SamplingParams(
                temperature=temperature, top_p=top_p, max_tool_calls=max_tool_calls, max_context_tokens=max_context
            )
            run_agent, close = rollout_qa_agent(
                model, sampling, engine=engine, search_url=search_url, tools=tools, base_url=base_url
            )
        table, rows = evaluate_qa(
            items, predictions=read_predictions(predictions) if predictions else None, agent=run_agent, tools=tools
        )
    except (QADataError, QAPredictionError, ValueError, ImportError, OSError) as exc:
        _fail(str(exc))
    finally:
        if close is not None:
            close()
    if out is not None:
        write_qa_run(
            out,
            table,
            rows,
            {
                "data": [str(d) for d in data],
                "predictions": str(predictions or ""),
                "agent": agent or "",
                "model": model or "",
            },
        )
        console.print(f"run written to {out}")
    typer.echo(table.markdown())
