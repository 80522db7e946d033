"""`star synth ...`: feasible queries, oracle plans and teacher trajectories from the command line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from services.common.settings import get_settings

console = Console(stderr=True)
synth_app = typer.Typer(
    help="Synthesis: feasible queries, the oracle planner, teacher trajectories.", no_args_is_help=True
)


def fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def _open_world(db: str | None):
    from services.sandbox.world import World

    url = db or get_settings().world_url
    world = World(url)
    if problem := world.problem():
        fail(problem)
    return world


def _build_oracle(db: str | None, even_nights: bool = False):
    from services.synth.index import SynthIndex
    from services.synth.oracle import Oracle

    world = _open_world(db)
    with console.status("indexing the world (once)"):
        index = SynthIndex.build(world)
    console.print(f"index: {index.stats()}")
    return world, Oracle(index, even_nights=even_nights)


def _bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


@synth_app.command("queries")
def queries_command(
    n: int = typer.Option(1000, "--n", min=1, help="How many queries in all."),
    mix: str = typer.Option("4:3:3", help="easy:medium:hard ratio."),
    rl_mix: str | None = typer.Option(
        None,
        help="easy:medium:hard ratio of the RL split alone (default: --mix), "
        "e.g. 1:1:0 for RL prompts a small SFT model can sometimes solve.",
    ),
    splits: str = typer.Option(
        "4:5:1",
        help="sft:rl:validation[:heldout] ratio of the disjoint sets (heldout: "
        "for the final evaluation alone; none when left out).",
    ),
    out: Path = typer.Option(..., help="Output directory."),
    seed: int = typer.Option(0, help="Seed of the sampling: same seed, same queries."),
    budget_factors: str = typer.Option(
        "1.5:1.3:1.15", help="Budget = oracle cheapest cost × factor (easy:medium:hard)."
    ),
    workers: int = typer.Option(min(2, os.cpu_count() or 1), help="Oracle worker processes."),
    language: str = typer.Option("template", help="template | openai (back-translation by an LLM)."),
    llm_url: str | None = typer.Option(None, help="OpenAI-compatible base URL (…/v1) for --language openai."),
    llm_model: str = typer.Option("gpt-4o-mini", help="Model name for --language openai."),
    llm_key_env: str = typer.Option("OPENAI_API_KEY", help="Environment variable holding the API key."),
    flight_share: float = typer.Option(0.9, min=0.0, max=1.0, help="Share of flight-based trips (the rest by road)."),
    days: str = typer.Option("3,5,7", help="Trip lengths to draw from, a subset of 3,5,7 (e.g. 3 for one-city trips)."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL of the world."),
) -> None:
    """Synthesize feasible queries: sample, check with the oracle, set budgets, phrase, split."""
    from services.synth.queries import (
        LEVELS,
        SPLITS,
        QuerySynthesizer,
        allocate,
        check_trip_days,
        mixed_split_table,
        parse_ratio,
        split_queries,
        write_jsonl,
    )

    try:
        mix_w = parse_ratio(mix, 3, "--mix")
        rl_mix_w = parse_ratio(rl_mix, 3, "--rl-mix") if rl_mix else None
        split_w = parse_ratio(splits, len(SPLITS), "--splits", optional=1)
        factors = dict(zip(LEVELS, parse_ratio(budget_factors, 3, "--budget-factors")))
        trip_days = check_trip_days(_int_list(days, "--days"))
    except ValueError as exc:
        fail(str(exc))
    if any(f < 1.0 for f in factors.values()):
        fail("--budget-factors must be at least 1 (a budget under the cheapest plan makes the query infeasible)")
    describe = None
    if language == "openai":
        if not llm_url:
            fail("--language openai needs --llm-url (an OpenAI-compatible base URL ending in /v1)")
        describe = _llm_describer(llm_url, llm_model, os.environ.get(llm_key_env))
    elif language != "template":
        fail(f"--language must be 'template' or 'openai', not {language!r}")
    # with --rl-mix each split is sized per level first, and the levels' totals are what gets synthesized
    table = (
        mixed_split_table(n, split_w, [rl_mix_w if split == "rl" else mix_w for split in SPLITS]) if rl_mix_w else None
    )
    counts = {lv: sum(table[lv]) for lv in LEVELS} if table else dict(zip(LEVELS, allocate(n, mix_w)))
    _, oracle = _build_oracle(db)
    kwargs = {"describe": describe} if describe else {}
    synth = QuerySynthesizer(
        oracle,
        seed=seed,
        budget_factors=factors,
        workers=workers,
        flight_share=flight_share,
        trip_days=trip_days,
        **kwargs,
    )
    t0 = time.perf_counter()
    with _bar() as bar:
        task = bar.add_task("queries", total=n)
        try:
            queries, report = synth.generate(counts, progress=lambda k: bar.advance(task, k))
        except RuntimeError as exc:
            fail(str(exc))
    elapsed = time.perf_counter() - t0
    parts = split_queries(queries, split_w, seed, table)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "queries.jsonl", queries)
    for split, weight in zip(SPLITS, split_w):
        if weight or split != "heldout":  # no empty held-out file where none was asked for
            write_jsonl(out / f"{split}.jsonl", parts[split])
        report.splits[split] = {lv: sum(q.level == lv for q in parts[split]) for lv in LEVELS}
    summary = report.to_dict() | {
        "seconds": round(elapsed, 2),
        "seed": seed,
        "mix": mix,
        "rl_mix": rl_mix or mix,
        "splits_ratio": splits,
        "trip_days": trip_days,
        "budget_factors": factors,
        "language": language,
        "files": sorted(p.name for p in out.glob("*.jsonl")),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    _print_summary(report, elapsed)
    console.print(f"wrote {len(queries)} queries to {out} (queries.jsonl, one file per split, summary.json)")


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated whole numbers, not {text!r}") from None


def _llm_describer(url: str, model: str, key: str | None):
    from services.synth.language import BackTranslationError, BackTranslator, template_text

    translator = BackTranslator(url, model, api_key=key)

    def describe(q, rng):
        try:
            return translator(q)
        except BackTranslationError as exc:
            console.print(f"[yellow]warning:[/yellow] {exc}; using the template text for {q.id}")
            return template_text(q, rng)

    return describe


def _print_summary(report, elapsed: float) -> None:
    from services.synth.queries import LEVELS, SPLITS

    table = Table(title=f"synthesized queries ({elapsed:.1f} s)")
    for col in ("level", "kept", "tried", "feasible", "sft", "rl", "val", "held out", "$ min", "$ median", "$ max"):
        table.add_column(col, justify="right")
    for lv in LEVELS:
        b = report.budget_stats(lv)
        table.add_row(
            lv,
            str(report.accepted[lv]),
            str(report.attempts[lv]),
            f"{report.feasibility(lv):.0%}",
            *(str(report.splits.get(s, {}).get(lv, 0)) for s in SPLITS),
            *(f"{b[k]:,.0f}" if b else "-" for k in ("min", "median", "max")),
        )
    table.add_row(
        "all",
        str(sum(report.accepted.values())),
        str(sum(report.attempts.values())),
        f"{report.feasibility():.0%}",
        *(str(sum(report.splits.get(s, {}).values())) for s in SPLITS),
        "",
        "",
        "",
    )
    console.print(table)
    if report.rejections:
        console.print(
            "rejected (constraint without a plan): " + ", ".join(f"{k} {v}" for k, v in report.rejections.most_common())
        )


@synth_app.command("plan")
def plan_command(
    queries: Path = typer.Option(..., help="Query file (JSONL, JSON array or CSV in the benchmark layout)."),
    out: Path | None = typer.Option(None, help="Write one JSON line per query (plan or reason) here."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL of the world."),
    even_nights: bool = typer.Option(False, help="Only the two-nights-per-city split of the gold plans."),
) -> None:
    """Run the oracle on a query file: cheapest strict-valid plan per query, or why none exists."""
    from services.synth.queries import QueryFileError, load_queries

    try:
        items = load_queries(queries)
    except QueryFileError as exc:
        fail(str(exc))
    _, oracle = _build_oracle(db, even_nights)
    rows, solved = [], 0
    with _bar() as bar:
        task = bar.add_task("oracle", total=len(items))
        for i, q in enumerate(items):
            r = oracle.solve(q)
            solved += r.feasible
            rows.append({"index": i, "id": q.id, **r.summary(), "plan": r.solution.day_dicts() if r.solution else None})
            bar.advance(task)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    table = Table(title=f"oracle: {solved} of {len(items)} queries have a plan within budget")
    for col in ("#", "level", "days", "route", "cost", "budget", "constraint / reason"):
        table.add_column(col)
    for r, q in zip(rows, items):
        table.add_row(
            str(r["index"] + 1),
            q.level or "-",
            str(q.days),
            " → ".join(r["route"] or []) or "-",
            f"{r['cost']:g}" if r["cost"] is not None else "-",
            str(q.budget),
            "ok" if r["feasible"] else f"{r['constraint']}: {r['reason']}",
        )
    console.print(table)


@synth_app.command("teacher")
def teacher_command(
    queries: Path = typer.Option(..., help="Query file (JSONL, JSON array or CSV in the benchmark layout)."),
    teacher: str = typer.Option("oracle", help="oracle | openai."),
    out: Path = typer.Option(..., help="Output directory (sft.jsonl, dataset_info.json, teacher_summary.json)."),
    sandbox_url: str | None = typer.Option(
        None, help="Call a running sandbox service instead of the tools in-process."
    ),
    llm_url: str | None = typer.Option(None, help="OpenAI-compatible base URL (…/v1) for --teacher openai."),
    llm_model: str = typer.Option("deepseek-chat", help="Model name for --teacher openai."),
    llm_key_env: str = typer.Option("OPENAI_API_KEY", help="Environment variable holding the API key."),
    samples: int = typer.Option(1, min=1, help="Episodes per query (--teacher openai)."),
    concurrency: int = typer.Option(4, min=1, help="Episodes in flight (--teacher openai)."),
    seed: int = typer.Option(0, help="Seed of the teacher's choices and the LLM's sampling."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL of the world."),
) -> None:
    """Teacher trajectories for SFT; only those scoring success under the strict evaluator are kept."""
    from services.reward import Evaluator
    from services.synth.queries import QueryFileError, load_queries
    from services.synth.teacher import HttpTools, InProcessTools, LLMTeacher, OracleTeacher, TeacherError, write_sft

    if teacher not in ("oracle", "openai"):
        fail(f"--teacher must be 'oracle' or 'openai', not {teacher!r}")
    if teacher == "openai" and not llm_url:
        fail("--teacher openai needs --llm-url (an OpenAI-compatible base URL ending in /v1)")
    try:
        items = load_queries(queries)
    except QueryFileError as exc:
        fail(str(exc))
    world = _open_world(db)
    if sandbox_url:
        tools = HttpTools(sandbox_url)
    else:
        from services.sandbox.tools import ToolBox

        tools = InProcessTools(ToolBox(world, dialect=get_settings().tool_dialect))
    evaluator = Evaluator(world, "strict")
    t0 = time.perf_counter()
    rejected: dict[str, int] = {}
    with _bar() as bar:
        task = bar.add_task(teacher, total=len(items) * (samples if teacher == "openai" else 1))
        if teacher == "oracle":
            _, oracle = _build_oracle(db)
            kept = []
            coach = OracleTeacher(oracle, tools, evaluator, seed=seed)
            for i, q in enumerate(items):
                try:
                    kept.append(coach.trajectory(q, sample_id=f"{q.id or i}-oracle"))
                except TeacherError as exc:
                    text = str(exc)  # "no plan: <constraint>: <reason>" or a check that failed
                    key = "no plan: " + text.split(":")[1].strip() if text.startswith("no plan:") else text[:80]
                    rejected[key] = rejected.get(key, 0) + 1
                bar.advance(task)
        else:
            llm = LLMTeacher(
                llm_url,
                llm_model,
                tools,
                evaluator,
                api_key=os.environ.get(llm_key_env),
                samples=samples,
                concurrency=concurrency,
            )
            kept = llm.run(items, on_done=lambda _ok: bar.advance(task))
            rejected = dict(llm.report.rejected)
    n = write_sft(out, kept)
    calls = [len(s.calls) for s in kept]
    summary = {
        "teacher": teacher,
        "queries": len(items),
        "kept": n,
        "rejected": rejected,
        "mean_tool_calls": round(sum(calls) / len(calls), 2) if calls else None,
        "mean_chars": round(sum(sum(len(m["content"]) for m in s.messages) for s in kept) / n, 1) if n else None,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (out / "teacher_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    table = Table(title=f"{teacher} teacher: {n} successful trajectories")
    for key in ("queries", "kept", "mean_tool_calls", "mean_chars", "seconds"):
        table.add_row(key, str(summary[key]))
    for reason, count in rejected.items():
        table.add_row(f"rejected: {reason}", str(count))
    console.print(table)
    console.print(f"wrote {out / 'sft.jsonl'} and {out / 'dataset_info.json'}")
