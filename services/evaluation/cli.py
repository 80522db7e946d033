"""`star eval ...`: evaluate a model or a predictions file on a split; compare two runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from services.common.cli import fail as _fail
from services.common.settings import get_settings

console = Console(stderr=True, soft_wrap=True)
eval_app = typer.Typer(
    help="TravelPlanner evaluation: Table-1 metrics, failure analysis, run folders, run comparison.\n\n"
         "star eval --split FILE (--model DIR|openai:NAME | --predictions FILE) [--mode official|strict] [-n N]",
    invoke_without_command=True, no_args_is_help=True)


def _default_out(split: Path, source: str, mode: str) -> Path:
    stem = Path(source.split(":")[-1]).name or "run"
    return get_settings().home / "runs" / f"eval-{split.stem}-{stem}-{mode}"


@eval_app.callback()
def eval_run(
    ctx: typer.Context,
    split: Optional[Path] = typer.Option(None, help="Split file: TravelPlanner query records (JSON list or JSONL)."),
    model: Optional[str] = typer.Option(None, help="HF model folder, or openai:NAME (with --base-url)."),
    predictions: Optional[Path] = typer.Option(None, help="Plans to score instead of running a model: submission "
                                                          "lines {idx, query, plan} or plan texts."),
    mode: str = typer.Option("official", help="Evaluator mode: official (leaderboard parity) or strict."),
    n: Optional[int] = typer.Option(None, "-n", min=1, help="Only the first N queries."),
    out: Optional[Path] = typer.Option(None, help="Run folder (default: STAR_HOME/runs/eval-<split>-<source>-<mode>)."),
    db: Optional[str] = typer.Option(None, help="World database URL (default: STAR_DB_URL / STAR_HOME)."),
    formatter: str = typer.Option("parser", help="parser (exact structured-plan parser) or module:factory."),
    official_split: str = typer.Option("auto", help="auto | none | train | validation | test: which official "
                                                    "denominators to use in official mode."),
    agent: Optional[str] = typer.Option(None, help="module:function TravelQuery → Trajectory, instead of --model."),
    engine: str = typer.Option("vllm", help="Engine for --model: vllm | transformers."),
    concurrency: Optional[int] = typer.Option(
        None, min=1, help="Episodes in flight at once; one engine batches their turns. Default: 16 with --model, "
                          "1 with --agent (a function of yours is then called from this many threads)."),
    decode: str = typer.Option("dynamic", help="The transformers engine's decode step: dynamic | static | graphs "
                                               "(CUDA graphs; static without a GPU)."),
    base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible base URL for openai:NAME."),
    sandbox_url: Optional[str] = typer.Option(None, help="Sandbox service URL (default: tools in-process)."),
    temperature: float = typer.Option(0.6), top_p: float = typer.Option(0.95),
    max_context: int = typer.Option(32_768), max_tool_calls: int = typer.Option(60),
    max_tokens: int = typer.Option(8192, "--max-tokens", min=1, help="Cap on one model turn's tokens."),
    seed: Optional[int] = typer.Option(None),
    summarize_at_limit: bool = typer.Option(
        False, help="At the context limit, ask for a summarizing plan in one more call and score its answer "
                    "(the public STAR agent's ending); off: such an episode has no answer."),
) -> None:
    """Run (or take) a plan per query, format, score, write the run folder, print the metrics."""
    if ctx.invoked_subcommand is not None:
        return
    from services.common.schemas import SamplingParams
    from services.evaluation.agents import AgentUnavailable, load_agent, rollout_agent
    from services.evaluation.formatting import FormatterUnavailable, load_formatter
    from services.evaluation.runfolder import RunMismatch
    from services.evaluation.runner import MODEL_CONCURRENCY, EvalError, EvalRun, run_eval
    from services.common.files import sha256_file as file_sha256
    from services.evaluation.submission import SubmissionError
    from services.reward.evaluator import Evaluator
    from services.sandbox.world import World

    if split is None:
        _fail("--split FILE is required")
    sources = [s for s in (model, predictions, agent) if s is not None]
    if len(sources) != 1:
        _fail("give exactly one of --model, --agent or --predictions")
    if mode not in ("official", "strict"):
        _fail(f"--mode must be official or strict, not {mode!r}")
    if official_split not in ("auto", "none", "train", "validation", "test"):
        _fail("--official-split must be auto, none, train, validation or test")
    from services.rollout.engines.hf import DECODE_MODES  # the engine's own list (the module loads no torch)

    if decode not in DECODE_MODES:
        _fail(f"--decode must be {', '.join(DECODE_MODES[:-1])} or {DECODE_MODES[-1]}, not {decode!r}")
    if concurrency is None:
        concurrency = MODEL_CONCURRENCY if model is not None else 1
    world_url = db or get_settings().world_url
    world = World(world_url)
    if problem := world.problem():
        _fail(f"the travel world is not usable: {problem}")
    close = None
    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, max_context_tokens=max_context,
                                  max_tool_calls=max_tool_calls, max_tokens_per_turn=max_tokens, seed=seed,
                                  summarize_at_limit=summarize_at_limit)
        if predictions is not None:
            source = {"kind": "predictions", "path": str(predictions), "sha256": file_sha256(predictions)} \
                if predictions.is_file() else _fail(f"{predictions}: no such file")
            run_agent = None
        elif agent is not None:
            source = {"kind": "agent", "agent": agent, "sampling": sampling.model_dump()}
            run_agent = load_agent(agent)
        else:
            source = {"kind": "model", "model": model, "engine": engine, "sampling": sampling.model_dump()}
            # the transformers engine decodes as many rows as there are episodes in flight
            options = {"max_batch": concurrency, "decode": decode} if engine == "transformers" else {}
            run_agent, close = rollout_agent(model, sampling, engine=engine, sandbox_url=sandbox_url,
                                             world_url=world_url, base_url=base_url, engine_options=options)
        label = str(predictions or agent or model)
        run = EvalRun(split_path=split, out=out or _default_out(split, label, mode),
                      evaluator=Evaluator(world, mode), formatter=load_formatter(formatter), source=source, limit=n,
                      official_split=None if official_split == "none" else official_split, sampling=sampling,
                      concurrency=concurrency)
        result = run_eval(run, agent=run_agent, predictions_path=predictions)
    except (SubmissionError, EvalError, RunMismatch, FormatterUnavailable, AgentUnavailable, ValueError) as exc:
        _fail(str(exc))
    finally:
        if close is not None:
            close()
    _print_result(result, run.out)


def _print_result(result: dict, out: Path) -> None:
    from services.reward.evaluator import SplitMetrics

    metrics = SplitMetrics(**result["metrics"])
    denominators = f"official {metrics.split} denominators" if metrics.split else "computed denominators"
    typer.echo(f"{metrics.counts.queries} queries, {metrics.mode} mode, {denominators}")
    typer.echo(metrics.table())
    console.print(f"run folder: {out} (report.md, metrics.json, predictions.jsonl, plots/)")


@eval_app.command("compare")
def eval_compare(
    run_a: Path = typer.Argument(..., help="Run folder A (the baseline)."),
    run_b: Path = typer.Argument(..., help="Run folder B."),
    resamples: int = typer.Option(2000, min=100, help="Bootstrap resamples."),
    confidence: float = typer.Option(0.95, min=0.5, max=0.999),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Metric deltas B − A with paired bootstrap confidence intervals over queries."""
    from services.evaluation.compare import CompareError, compare_records, compare_table
    from services.evaluation.runfolder import RunFolder

    folders = [RunFolder(p) for p in (run_a, run_b)]
    for f in folders:
        if f.manifest() is None:
            _fail(f"{f.path} is not a run folder (no manifest.json)")
    ma, mb = (f.manifest() for f in folders)
    try:
        deltas, info = compare_records(folders[0].records(), folders[1].records(), resamples=resamples,
                                       confidence=confidence, seed=seed)
    except (CompareError, ValueError) as exc:
        _fail(str(exc))
    ea, eb = ma["scoring"]["evaluator"], mb["scoring"]["evaluator"]
    if ea != eb:
        console.print(f"[yellow]warning:[/yellow] the runs were scored differently (A: {ea['mode']}, "
                      f"B: {eb['mode']}; code {ea['code_sha256'][:8]} vs {eb['code_sha256'][:8]})")
    if as_json:
        typer.echo(json.dumps({"info": info, "deltas": [vars(d) for d in deltas]}, indent=2))
        return
    typer.echo(f"{info['paired_queries']} paired queries (only in A: {info['only_a']}, only in B: {info['only_b']})")
    typer.echo(compare_table(deltas, confidence))


@eval_app.command("report")
def eval_report(run: Path = typer.Argument(..., help="Run folder to re-analyse.")) -> None:
    """Recompute metrics.json, report.md and plots of a finished run from its scores."""
    from services.evaluation.runfolder import RunFolder
    from services.evaluation.runner import EvalError, finalize

    folder = RunFolder(run)
    manifest = folder.manifest()
    if manifest is None:
        _fail(f"{run} is not a run folder (no manifest.json)")
    old = folder.analysis() or {}
    split = old.get("metrics", {}).get("split")
    try:
        result = finalize(folder, manifest["scoring"]["evaluator"]["mode"], split)
    except (EvalError, ValueError) as exc:
        _fail(str(exc))
    _print_result(result, run)


@eval_app.command("scored")
def eval_scored(
    scored: Path = typer.Argument(..., help="ScoredTrajectory JSON lines (e.g. a dump of the scored stream)."),
    out: Path = typer.Option(..., help="Folder for the analysis (metrics.json, report.md, plots/)."),
) -> None:
    """Analyse scored RL trajectories: metrics over samples, failures, backtracking, and the reward
    variance within each sampling group."""
    from services.evaluation.runner import finalize
    from services.evaluation.scored import ScoredFileError, scored_to_folder

    try:
        folder = scored_to_folder(scored, out)
        result = finalize(folder, folder.manifest()["scoring"]["evaluator"]["mode"], None)
    except (ScoredFileError, ValueError) as exc:
        _fail(str(exc))
    _print_result(result, out)
    g = result["group_reward_variance"]
    if g.get("groups"):
        typer.echo(f"reward variance per group: mean {g['mean_variance']:.4f} over {g['groups']} groups, "
                   f"zero-variance groups {g['zero_variance_share']:.1f}%")
