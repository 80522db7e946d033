"""`star eval ...`: evaluate a model or a predictions file on a split; compare two runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from services.common.cli import (
    fail as _fail,
    max_context_option,
    max_tool_calls_option,
    seed_option,
    temperature_option,
    top_p_option,
)
from services.common.settings import get_settings

console = Console(stderr=True, soft_wrap=True)
eval_app = typer.Typer(
    help="TravelPlanner evaluation: Table-1 metrics, failure analysis, run folders, run comparison.\n\n"
    "star eval --split FILE (--model DIR|openai:NAME | --predictions FILE) [--mode official|strict] [-n N]\n\n"
    "star eval submission FILE [--split FILE]: a submission's leaderboard metrics, without a run folder",
    invoke_without_command=True,
    no_args_is_help=True,
)


def _default_out(split: Path, source: str, mode: str) -> Path:
    stem = Path(source.split(":")[-1]).name or "run"
    return get_settings().home / "runs" / f"eval-{split.stem}-{stem}-{mode}"


@eval_app.callback()
def eval_run(
    ctx: typer.Context,
    split: Path | None = typer.Option(None, help="Split file: TravelPlanner query records (JSON list or JSONL)."),
    model: str | None = typer.Option(None, help="HF model folder, or openai:NAME (with --base-url)."),
    predictions: Path | None = typer.Option(
        None, help="Plans to score instead of running a model: submission lines {idx, query, plan} or plan texts."
    ),
    mode: str = typer.Option("official", help="Evaluator mode: official (leaderboard parity) or strict."),
    n: int | None = typer.Option(None, "-n", min=1, help="Only the first N queries."),
    out: Path | None = typer.Option(None, help="Run folder (default: STAR_HOME/runs/eval-<split>-<source>-<mode>)."),
    db: str | None = typer.Option(None, help="World database URL (default: STAR_DB_URL / STAR_HOME)."),
    formatter: str = typer.Option("parser", help="parser (exact structured-plan parser) or module:factory."),
    official_split: str = typer.Option(
        "auto", help="auto | none | train | validation | test: which official denominators to use in official mode."
    ),
    agent: str | None = typer.Option(None, help="module:function TravelQuery → Trajectory, instead of --model."),
    fleet: bool = typer.Option(
        False,
        "--fleet",
        help="Run the episodes on a deployed fleet's rollout servers "
        "(STAR_ROLLOUT_URLS), on the weights they hold, instead of --model.",
    ),
    engine: str = typer.Option("vllm", help="Engine for --model: vllm | transformers."),
    concurrency: int | None = typer.Option(
        None,
        min=1,
        help="Episodes in flight at once; one engine batches their turns. Default: 16 with --model, "
        "1 with --agent (a function of yours is then called from this many threads).",
    ),
    vllm_args: str | None = typer.Option(
        None,
        "--vllm-args",
        help="The vLLM engine's arguments as JSON (a "
        "recipe's services.vllm), e.g. '{\"gpu_memory_utilization\": 0.5}'.",
    ),
    base_url: str | None = typer.Option(None, help="OpenAI-compatible base URL for openai:NAME."),
    sandbox_url: str | None = typer.Option(None, help="Sandbox service URL (default: tools in-process)."),
    temperature: float = temperature_option(0.6),
    top_p: float = top_p_option(0.95),
    max_context: int = max_context_option(32_768),
    max_tool_calls: int = max_tool_calls_option(60),
    max_tokens: int = typer.Option(8192, "--max-tokens", min=1, help="Cap on one model turn's tokens."),
    seed: int | None = seed_option(None),
    summarize_at_limit: bool = typer.Option(
        False,
        help="At the context limit, ask for a summarizing plan in one more call and score its answer "
        "(the public STAR agent's ending); off: such an episode has no answer.",
    ),
) -> None:
    """Run (or take) a plan per query, format, score, write the run folder, print the metrics."""
    if ctx.invoked_subcommand is not None:
        return
    from services.common.files import sha256_file as file_sha256
    from services.common.schemas import SamplingParams
    from services.evaluation.agents import AgentUnavailable, fleet_agent, load_agent, rollout_agent
    from services.evaluation.formatting import FormatterUnavailable, load_formatter
    from services.evaluation.runfolder import RunMismatch
    from services.evaluation.runner import MODEL_CONCURRENCY, EvalError, EvalRun, run_eval
    from services.reward.evaluator import Evaluator
    from services.reward.submission import SubmissionError
    from services.sandbox.world import World

    if split is None:
        _fail("--split FILE is required")
    sources = [s for s in (model, predictions, agent, fleet or None) if s is not None]
    if len(sources) != 1:
        _fail("give exactly one of --model, --agent, --fleet or --predictions")
    if mode not in ("official", "strict"):
        _fail(f"--mode must be official or strict, not {mode!r}")
    if official_split not in ("auto", "none", "train", "validation", "test"):
        _fail("--official-split must be auto, none, train, validation or test")
    if concurrency is None:
        concurrency = MODEL_CONCURRENCY if model is not None or fleet else 1
    world_url = db or get_settings().world_url
    world = World(world_url)
    if problem := world.problem():
        _fail(f"the travel world is not usable: {problem}")
    close = None
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_context_tokens=max_context,
            max_tool_calls=max_tool_calls,
            max_tokens_per_turn=max_tokens,
            seed=seed,
            summarize_at_limit=summarize_at_limit,
        )
        if predictions is not None:
            source = (
                {"kind": "predictions", "path": str(predictions), "sha256": file_sha256(predictions)}
                if predictions.is_file()
                else _fail(f"{predictions}: no such file")
            )
            run_agent = None
        elif agent is not None:
            source = {"kind": "agent", "agent": agent, "sampling": sampling.model_dump()}
            run_agent = load_agent(agent)
        elif fleet:
            settings = get_settings()
            source = {"kind": "fleet", "rollout_urls": settings.rollout_url_list, "sampling": sampling.model_dump()}
            run_agent = fleet_agent(sampling, settings.rollout_url_list, settings.api_token)
        else:
            source = {"kind": "model", "model": model, "engine": engine, "sampling": sampling.model_dump()}
            # the transformers engine decodes as many rows as there are episodes in flight
            options = {"max_batch": concurrency} if engine == "transformers" else {}
            if engine == "vllm" and vllm_args:
                options["args"] = _vllm_args(vllm_args)
            run_agent, close = rollout_agent(
                model,
                sampling,
                engine=engine,
                sandbox_url=sandbox_url,
                world_url=world_url,
                base_url=base_url,
                engine_options=options,
            )
        label = str(predictions or agent or model or "fleet")
        run = EvalRun(
            split_path=split,
            out=out or _default_out(split, label, mode),
            evaluator=Evaluator(world, mode),
            formatter=load_formatter(formatter),
            source=source,
            limit=n,
            official_split=None if official_split == "none" else official_split,
            sampling=sampling,
            concurrency=concurrency,
        )
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
    confidence: float = typer.Option(0.95, min=0.5, max=0.999, help="Level of the confidence intervals."),
    seed: int = seed_option(0, "Seed of the bootstrap resampling."),
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
        deltas, info = compare_records(
            folders[0].records(), folders[1].records(), resamples=resamples, confidence=confidence, seed=seed
        )
    except (CompareError, ValueError) as exc:
        _fail(str(exc))
    ea, eb = ma["scoring"]["evaluator"], mb["scoring"]["evaluator"]
    if ea != eb:
        console.print(
            f"[yellow]warning:[/yellow] the runs were scored differently (A: {ea['mode']}, "
            f"B: {eb['mode']}; code {ea['code_sha256'][:8]} vs {eb['code_sha256'][:8]})"
        )
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
        typer.echo(
            f"reward variance per group: mean {g['mean_variance']:.4f} over {g['groups']} groups, "
            f"zero-variance groups {g['zero_variance_share']:.1f}%"
        )


def _vllm_args(raw: str) -> Any:
    from pydantic import ValidationError

    from services.common.schemas import VllmArgs

    try:
        return VllmArgs.model_validate_json(raw)
    except ValidationError as exc:
        _fail(
            "--vllm-args: " + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
        )


# --- star eval submission -------------------------------------------------------------------------


@eval_app.command("submission")
def eval_submission(
    submission: Path = typer.Argument(
        ...,
        help="Official submission JSONL: {idx, query, plan} per line, in dataset order (plan: day list, text or null).",
    ),
    split: Path | None = typer.Option(
        None,
        help="The split's query records (JSON list or JSONL with org, dest, "
        "days, date, ...). Default: the --official-split's queries in "
        "the dataset folder (STAR_TRAVELPLANNER_DIR), or train when the "
        "submission has 45 lines.",
    ),
    mode: str = typer.Option("official", help="Evaluator mode: official (leaderboard parity) or strict."),
    official_split: str = typer.Option(
        "auto",
        help="auto (by the number of queries) | none | train | validation | "
        "test: which official denominators to use in official mode.",
    ),
    backend: str | None = typer.Option(None, help="Formatter backend for plans given as text."),
    db: str | None = typer.Option(None, help="World database URL (default: STAR_DB_URL / STAR_HOME)."),
    allow_synthetic_flights: bool = typer.Option(
        False,
        help="Score validation/test on a world without the real flights (refused otherwise); the report is marked.",
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print the whole report as JSON (metrics, per-plan verdicts, tables by level and trip length, costs).",
    ),
    report: Path | None = typer.Option(None, help="Also write the whole report as JSON to this file."),
) -> None:
    """The leaderboard metrics of a submission file, paired line by line with the split's queries (as the
    official evaluator pairs them), with per-plan verdicts, tables and costs, printed without a run folder."""
    score_submission(
        submission,
        split,
        mode,
        official_split,
        backend,
        db,
        as_json,
        allow_synthetic_flights,
        report,
        flags=("--split", "--official-split"),
    )


def evaluate_alias(
    submission: Path = typer.Argument(..., help="Official submission JSONL."),
    queries: Path | None = typer.Option(None, help="Deprecated name of `star eval submission --split`."),
    mode: str = typer.Option("official", help="official or strict."),
    split: str = typer.Option("auto", help="Deprecated name of `star eval submission --official-split`."),
    backend: str | None = typer.Option(None, help="Formatter backend for plans given as text."),
    db: str | None = typer.Option(None, help="World database URL."),
    allow_synthetic_flights: bool = typer.Option(False, help="As `star eval submission --allow-synthetic-flights`."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole report as JSON."),
    report: Path | None = typer.Option(None, help="Also write the whole report as JSON to this file."),
) -> None:
    """Deprecated: `star eval submission FILE [--split QUERIES] [--official-split NAME]`."""
    score_submission(
        submission,
        queries,
        mode,
        split,
        backend,
        db,
        as_json,
        allow_synthetic_flights,
        report,
        flags=("--queries", "--split"),
    )


def score_submission(
    submission: Path,
    queries: Path | None,
    mode: str,
    official_split: str,
    backend: str | None,
    db: str | None,
    as_json: bool,
    allow_synthetic_flights: bool,
    report: Path | None,
    flags: tuple[str, str],
) -> None:
    """`flags`: the caller's names for the query file and the official split, for its error messages."""
    from rich.table import Table

    from services.common.cli import read_text
    from services.reward.cli import OFFICIAL_SIZES, _mode, _scoring, out
    from services.reward.submission import (
        SPLITS,
        SubmissionError,
        SubmissionLine,
        dataset_split,
        load_split,
        score_submission as score,
    )

    _mode(mode)
    if official_split not in (*SPLITS, "none", "auto"):
        _fail(f"{flags[1]} must be train, validation, test, none or auto, not {official_split!r}")
    raw = [ln for ln in read_text(submission).splitlines() if ln.strip()]
    lines = []
    for i, text in enumerate(raw, 1):
        try:
            lines.append(SubmissionLine(**json.loads(text)))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            _fail(f"{submission}:{i}: not a submission line ({str(exc).splitlines()[0]})")
    settings = get_settings()
    try:
        if queries is not None:
            split_queries = load_split(queries)
        elif official_split in SPLITS:
            split_queries = dataset_split(settings.travelplanner_dir, official_split)
        elif len(lines) == 45 and (settings.travelplanner_dir / "train" / "train.json").is_file():
            split_queries = dataset_split(settings.travelplanner_dir, "train")
        else:
            _fail(
                f"{submission} has {len(lines)} lines; give {flags[0]}, the split's records with their structured "
                f"fields (a submission carries only the query text), or {flags[1]} with the dataset folder"
            )
    except SubmissionError as exc:
        _fail(str(exc))
    mismatched = _text_mismatches(raw, split_queries)
    if mismatched:
        console.print(
            f"[yellow]warning:[/yellow] {len(mismatched)} line(s) carry a query text other than the "
            f"split's (first: line {mismatched[0]}); lines pair by order, as in the official evaluator"
        )
    chosen = (
        None
        if official_split == "none"
        else OFFICIAL_SIZES.get(len(split_queries))
        if official_split == "auto"
        else official_split
    )
    try:
        with _scoring(db, backend) as scorer:
            result = score(
                scorer,
                split_queries,
                lines,
                mode=mode,
                split=chosen,
                backend=backend,
                allow_synthetic_flights=allow_synthetic_flights,
            )
    except SubmissionError as exc:
        _fail(str(exc))
    if report is not None:
        report.write_text(result.model_dump_json(indent=2) + "\n", encoding="utf-8")
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    for warning in result.warnings[:5]:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    metrics, p = result.metrics, result.provenance
    c = metrics.counts
    table = Table(
        title=f"{submission.name}: {c.queries} queries, {mode} mode"
        + (f", official {chosen} denominators" if chosen and mode == "official" else ""),
        caption=f"world {p.world} {p.world_hash}, flights {p.flights}"
        + (" (scored on synthetic flights at the caller's insistence)" if p.synthetic_flights_insisted else ""),
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("count", justify="right")
    for label, value, num, den in (
        ("Delivery Rate", metrics.delivery_rate, c.delivered, c.queries),
        ("Commonsense Micro", metrics.cs_micro, c.cs_passed, c.cs_total),
        ("Commonsense Macro", metrics.cs_macro, c.cs_macro_passed, c.queries),
        ("Hard Micro", metrics.hard_micro, c.hard_passed, c.hard_total),
        ("Hard Macro", metrics.hard_macro, c.hard_macro_passed, c.queries),
        ("Final Pass Rate", metrics.final_pass_rate, c.final_passed, c.queries),
    ):
        table.add_row(label, f"{value:.2f}%", f"{num}/{den}")
    out.print(table)
    if c.formatter_outages:
        console.print(f"[yellow]{c.formatter_outages} plan(s) were not read: the formatter failed[/yellow]")
    for title, rows in (("by level", result.by_level), ("by trip length", result.by_trip_length)):
        cohort = Table(title=title)
        for col in ("", "n", "delivery", "cs micro", "cs macro", "hard micro", "hard macro", "final"):
            cohort.add_column(col, justify="right" if col else "left")
        for r in rows:
            cohort.add_row(
                r.value,
                str(r.n),
                *(
                    f"{v:.1f}%"
                    for v in (r.delivery_rate, r.cs_micro, r.cs_macro, r.hard_micro, r.hard_macro, r.final_pass_rate)
                ),
            )
        out.print(cohort)
    k = result.costs
    if k.costed:
        out.print(
            f"costs: {k.costed} plans costed, mean {k.mean:.0f}, median {k.median:.0f}, max {k.max:.0f}; "
            f"{k.over_budget} over budget"
        )
    failed = [v for v in result.plans if not v.success]
    for v in failed[:10]:
        first = v.failed[0] if v.failed else None
        out.print(f"line {v.idx} (query {v.query_id}): " + (f"{first.name}: {first.reason}" if first else "failed"))
    if len(failed) > 10:
        out.print(f"... and {len(failed) - 10} more failed plans (--json or --report for all verdicts)")


# --- star reward serve | worker -----------------------------------------------------------------


def _text_mismatches(lines: list[str], split_queries) -> list[int]:
    """Submission lines (1-based) whose query text differs from the split's query at the same position."""
    bad = []
    for i, (line, sq) in enumerate(zip(lines, split_queries), 1):
        try:
            text = json.loads(line).get("query")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(text, str) and sq.query.query and " ".join(text.split()) != " ".join(sq.query.query.split()):
            bad.append(i)
    return bad
