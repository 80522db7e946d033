"""`star score`, `star evaluate`, `star reward serve|worker`: the evaluator for people and for the fleet."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from services.common.cli import fail as _fail, read_text as _read
from services.common.settings import get_settings

console = Console(stderr=True)
out = Console()
reward_app = typer.Typer(help="Serve the scoring API or run the trajectory scoring worker.", no_args_is_help=True)

OFFICIAL_SIZES = {45: "train", 180: "validation", 1000: "test"}


@contextmanager
def _scoring(db: str | None, backend: str | None = None) -> Iterator[Any]:
    """A scorer over the world at `db`, closed afterwards; a ScoreError becomes a CLI error."""
    from services.reward.scoring import ScoreError

    scorer = _scorer(db, backend)
    try:
        yield scorer
    except ScoreError as exc:
        _fail(str(exc))
    finally:
        scorer.close()


def _scorer(db: str | None, backend: str | None = None):
    from services.formatter.core import Formatter
    from services.reward.evaluator import Evaluator
    from services.reward.scoring import Scorer
    from services.sandbox.world import World

    settings = get_settings()
    url = db or settings.world_url
    world = World(url)
    problem = world.problem()
    if problem is not None:
        _fail(f"the travel world at {url} cannot be used: {problem} (build it with `star world build`)")
    return Scorer(Evaluator(world), Formatter.from_settings(settings), default_backend=backend or settings.formatter_backend)


def _mode(mode: str) -> str:
    if mode not in ("official", "strict"):
        _fail(f"--mode must be official or strict, not {mode!r}")
    return mode


def _mark(passed: bool | None) -> str:
    return {True: "[green]pass[/green]", False: "[red]FAIL[/red]", None: "[dim]n/a[/dim]"}[passed]


# --- star score ---------------------------------------------------------------------------------

def score_command(
    query: Path = typer.Option(..., "--query", help="The query as JSON (a TravelPlanner record)."),
    plan: Path = typer.Option(..., "--plan", help="The plan: JSON (day list or {\"days\": [...]}) or plan text."),
    mode: str = typer.Option("official", help="official (leaderboard parity) or strict."),
    reward: str = typer.Option("sum", help="sum | macro | success | curriculum"),
    epoch: Optional[int] = typer.Option(None, min=1, help="1-based epoch (for curriculum)."),
    # bounds come from the request schema (PreferencePenalty), checked below like every other field
    preference_penalty: float = typer.Option(0.0, help="Points off the reward per broken stated preference, "
                                             "0-5 (our own shaping; 0: the paper's rewards)."),
    backend: Optional[str] = typer.Option(None, help="Formatter backend for plan text: structured | llm | auto."),
    db: Optional[str] = typer.Option(None, help="SQLAlchemy URL of the world (default: settings)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full response as JSON."),
) -> None:
    """Score one plan: every check's verdict with its reason, the five scores and the rewards."""
    from pydantic import ValidationError

    from services.reward.scoring import ScoreRequest

    try:
        q = json.loads(_read(query))
    except json.JSONDecodeError as exc:
        _fail(f"{query}: not JSON: {exc.msg} (line {exc.lineno})")
    raw = _read(plan)
    body: dict[str, Any] = {"query": q, "mode": _mode(mode), "reward": reward, "epoch": epoch, "backend": backend,
                            "preference_penalty": preference_penalty}
    try:
        value = json.loads(raw)
        body["plan_text" if isinstance(value, str) else "plan"] = value
    except json.JSONDecodeError:
        body["plan_text"] = raw
    try:
        request = ScoreRequest(**body)
    except ValidationError as exc:
        _fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]))
    with _scoring(db, backend) as scorer:
        result = scorer.score(request)
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    from services.reward.evaluator import COMMONSENSE_CHECKS, HARD_CHECKS

    table = Table(title=f"Verdicts ({mode} mode)")
    table.add_column("kind")
    table.add_column("check")
    table.add_column("verdict")
    table.add_column("reason", overflow="fold")
    s = result.score
    for kind, names, verdicts in (("commonsense", COMMONSENSE_CHECKS, s.commonsense), ("hard", HARD_CHECKS, s.hard)):
        for key, label in names.items():
            v = verdicts[key]
            table.add_row(kind, label, _mark(v.passed), v.reason)
    out.print(table)
    if result.formatter is not None:
        f = result.formatter
        out.print(f"formatter: {f.status} ({f.backend})" + (f" — {f.error}" if f.error else ""))
    out.print(f"cs_micro {s.cs_micro:.3f}  cs_macro {s.cs_macro:.0f}  hard_micro {s.hard_micro:.3f}  "
              f"hard_macro {s.hard_macro:.0f}  success {s.success:.0f}" +
              (f"  cost {result.cost:g}" if result.cost is not None else ""))
    out.print("rewards: " + "  ".join(f"{k} {v:g}" for k, v in result.rewards.items()) +
              f"   → {reward}: [bold]{result.reward:g}[/bold]")


# --- star evaluate ------------------------------------------------------------------------------

def evaluate_command(
    submission: Path = typer.Argument(..., help="Official submission JSONL: {idx, query, plan} per line, "
                                                "in dataset order (plan: day list, text or null)."),
    queries: Optional[Path] = typer.Option(None, help="The split's query records (JSON list or JSONL with "
                                                      "org, dest, days, date, ...). Default: the named split's "
                                                      "queries in the dataset folder (STAR_TRAVELPLANNER_DIR), "
                                                      "or train when the submission has 45 lines."),
    mode: str = typer.Option("official", help="official (leaderboard parity) or strict."),
    split: str = typer.Option("auto", help="train | validation | test | none | auto (by the number of queries). "
                                           "Official mode then uses that split's fixed denominators."),
    backend: Optional[str] = typer.Option(None, help="Formatter backend for plans given as text."),
    db: Optional[str] = typer.Option(None, help="SQLAlchemy URL of the world (default: settings)."),
    allow_synthetic_flights: bool = typer.Option(False, help="Score validation/test on a world without the real "
                                                             "flights (refused otherwise); the report is marked."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole report as JSON (metrics, per-plan "
                                                       "verdicts, tables by level and trip length, costs)."),
    report: Optional[Path] = typer.Option(None, help="Also write the whole report as JSON to this file."),
) -> None:
    """The leaderboard metrics of a submission file, paired line by line with the split's queries
    (as the official evaluator pairs them), with per-plan verdicts, tables and costs."""
    from services.evaluation.submission import SPLITS, SubmissionError, SubmissionLine, dataset_split, load_split
    from services.evaluation.submission import score_submission

    _mode(mode)
    if split not in (*SPLITS, "none", "auto"):
        _fail(f"--split must be train, validation, test, none or auto, not {split!r}")
    raw = [ln for ln in _read(submission).splitlines() if ln.strip()]
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
        elif split in SPLITS:
            split_queries = dataset_split(settings.travelplanner_dir, split)
        elif len(lines) == 45 and (settings.travelplanner_dir / "train" / "train.json").is_file():
            split_queries = dataset_split(settings.travelplanner_dir, "train")
        else:
            _fail(f"{submission} has {len(lines)} lines; give --queries, the split's records with their structured "
                  "fields (a submission carries only the query text), or --split with the dataset folder")
    except SubmissionError as exc:
        _fail(str(exc))
    chosen = None if split == "none" else OFFICIAL_SIZES.get(len(split_queries)) if split == "auto" else split
    with _scoring(db, backend) as scorer:
        result = score_submission(scorer, split_queries, lines, mode=mode, split=chosen, backend=backend,
                                  allow_synthetic_flights=allow_synthetic_flights)
    if report is not None:
        report.write_text(result.model_dump_json(indent=2) + "\n", encoding="utf-8")
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    for warning in result.warnings[:5]:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    metrics, p = result.metrics, result.provenance
    c = metrics.counts
    table = Table(title=f"{submission.name}: {c.queries} queries, {mode} mode"
                        + (f", official {chosen} denominators" if chosen and mode == "official" else ""),
                  caption=f"world {p.world} {p.world_hash}, flights {p.flights}"
                          + (" (scored on synthetic flights at the caller's insistence)"
                             if p.synthetic_flights_insisted else ""))
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
            cohort.add_row(r.value, str(r.n), *(f"{v:.1f}%" for v in (r.delivery_rate, r.cs_micro, r.cs_macro,
                                                                      r.hard_micro, r.hard_macro, r.final_pass_rate)))
        out.print(cohort)
    k = result.costs
    if k.costed:
        out.print(f"costs: {k.costed} plans costed, mean {k.mean:.0f}, median {k.median:.0f}, max {k.max:.0f}; "
                  f"{k.over_budget} over budget")
    failed = [v for v in result.plans if not v.success]
    for v in failed[:10]:
        first = v.failed[0] if v.failed else None
        out.print(f"line {v.idx} (query {v.query_id}): " + (f"{first.name}: {first.reason}" if first else "failed"))
    if len(failed) > 10:
        out.print(f"... and {len(failed) - 10} more failed plans (--json or --report for all verdicts)")


# --- star reward serve | worker -----------------------------------------------------------------

@reward_app.command("serve")
def reward_serve(
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8003),
    workers: int = typer.Option(1, help="Worker processes (scoring is CPU-bound: one per core)."),
    db: Optional[str] = typer.Option(None, help="SQLAlchemy URL of the world."),
) -> None:
    """Serve POST /score, /score/batch and /evaluate (OpenAPI docs at /docs)."""
    import uvicorn

    if db is not None:
        os.environ["STAR_DB_URL"] = db
    get_settings.cache_clear()
    uvicorn.run("services.reward.app:create_app", factory=True, host=host, port=port, workers=workers,
                log_level="warning", access_log=False)


@reward_app.command("worker")
def reward_worker(
    db: Optional[str] = typer.Option(None, help="SQLAlchemy URL of the world."),
    consumer: Optional[str] = typer.Option(None, help="Consumer name (default: host and pid)."),
    batch: int = typer.Option(8, min=1, help="Trajectories read per round."),
    threads: int = typer.Option(1, min=1, max=64, help="Consumers in this process (more when an LLM formats: "
                                                        "each waits on the API)."),
) -> None:
    """Score the trajectories stream into the scored stream until interrupted."""
    import signal

    from services.common.logging import configure_logging
    from services.common.redis import connect_redis
    from services.common.streams import StreamNames
    from services.reward.worker import ScoreWorker

    settings = get_settings()
    if not settings.redis_url:
        _fail("set STAR_REDIS_URL: the worker reads the trajectories stream of a shared Redis")
    configure_logging("reward-worker", settings.log_level, settings.log_json)
    try:
        client, embedded = connect_redis(settings.redis_url)
    except Exception as exc:  # noqa: BLE001 - any connection failure is reported the same way
        _fail(f"cannot reach Redis at {settings.redis_url}: {exc}")
    scorer = _scorer(db)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    names = StreamNames(settings.stream_prefix)
    base = consumer or f"reward-{socket.gethostname()}-{os.getpid()}"
    workers = [ScoreWorker(scorer, client, names, consumer=base if threads == 1 else f"{base}-{i}")
               for i in range(threads)]
    console.print(f"scoring {names.trajectories} → {names.scored} as {', '.join(w.consumer.consumer for w in workers)}")
    pool = [threading.Thread(target=w.run, args=(stop,), kwargs={"batch": batch}, name=w.consumer.consumer)
            for w in workers]
    try:
        for t in pool:
            t.start()
        while any(t.is_alive() for t in pool):
            for t in pool:
                t.join(0.5)
    finally:
        stop.set()
        scorer.close()
        if embedded is not None:
            embedded.stop()
    console.print(f"stopped: {sum(w.scored for w in workers)} scored, {sum(w.dead for w in workers)} dead-lettered")
