"""`star score`, `star reward serve|worker`: the evaluator for people and for the fleet (a submission file's
leaderboard metrics: `star eval submission`, in services.evaluation.cli)."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from services.common.cli import fail as _fail, host_option, port_option, read_text as _read
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
    return Scorer(
        Evaluator(world), Formatter.from_settings(settings), default_backend=backend or settings.formatter_backend
    )


def _mode(mode: str) -> str:
    if mode not in ("official", "strict"):
        _fail(f"--mode must be official or strict, not {mode!r}")
    return mode


def _mark(passed: bool | None) -> str:
    return {True: "[green]pass[/green]", False: "[red]FAIL[/red]", None: "[dim]n/a[/dim]"}[passed]


# --- star score ---------------------------------------------------------------------------------


def score_command(
    query: Path = typer.Option(..., "--query", help="The query as JSON (a TravelPlanner record)."),
    plan: Path = typer.Option(..., "--plan", help='The plan: JSON (day list or {"days": [...]}) or plan text.'),
    mode: str = typer.Option("official", help="official (leaderboard parity) or strict."),
    reward: str = typer.Option("sum", help="sum | macro | success | curriculum"),
    epoch: int | None = typer.Option(None, min=1, help="1-based epoch (for curriculum)."),
    # bounds come from the request schema (PreferencePenalty), checked below like every other field
    preference_penalty: float = typer.Option(
        0.0, help="Points off the reward per broken stated preference, 0-5 (our own shaping; 0: the paper's rewards)."
    ),
    backend: str | None = typer.Option(None, help="Formatter backend for plan text: structured | llm | auto."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL of the world (default: settings)."),
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
    body: dict[str, Any] = {
        "query": q,
        "mode": _mode(mode),
        "reward": reward,
        "epoch": epoch,
        "backend": backend,
        "preference_penalty": preference_penalty,
    }
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
    out.print(
        f"cs_micro {s.cs_micro:.3f}  cs_macro {s.cs_macro:.0f}  hard_micro {s.hard_micro:.3f}  "
        f"hard_macro {s.hard_macro:.0f}  success {s.success:.0f}"
        + (f"  cost {result.cost:g}" if result.cost is not None else "")
    )
    out.print(
        "rewards: "
        + "  ".join(f"{k} {v:g}" for k, v in result.rewards.items())
        + f"   → {reward}: [bold]{result.reward:g}[/bold]"
    )


# --- star reward serve | worker -----------------------------------------------------------------


@reward_app.command("serve")
def reward_serve(
    host: str = host_option(),
    port: int = port_option(8003),
    workers: int = typer.Option(1, help="Worker processes (scoring is CPU-bound: one per core)."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL of the world."),
) -> None:
    """Serve POST /score, /score/batch and /evaluate (OpenAPI docs at /docs)."""
    import uvicorn

    if db is not None:
        os.environ["STAR_DB_URL"] = db
    get_settings.cache_clear()
    uvicorn.run(
        "services.reward.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="warning",
        access_log=False,
    )


@reward_app.command("worker")
def reward_worker(
    db: str | None = typer.Option(None, help="SQLAlchemy URL of the world (default: STAR_DB_URL)."),
    consumer: str | None = typer.Option(None, help="Consumer name (default: the config's, else host and pid)."),
    batch: int | None = typer.Option(None, min=1, help="Trajectories read per round (default: the config's, 8)."),
    threads: int | None = typer.Option(
        None,
        min=1,
        max=64,
        help="Consumers in this process (more when an LLM formats: each waits on the API; default: the config's, 1).",
    ),
    config: Path | None = typer.Option(
        None, "--config", help="JSON (or YAML) file of reward worker settings; STAR_REWARD_* set what it leaves out."
    ),
) -> None:
    """Score the trajectories stream into the scored stream until interrupted."""
    import signal

    from services.common.logging import configure_logging
    from services.common.redis import connect_redis
    from services.common.streams import StreamNames
    from services.reward.worker import ScoreWorker

    cfg = _worker_config(config, consumer=consumer, batch=batch, threads=threads)
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
    workers = [
        ScoreWorker(
            scorer,
            client,
            names,
            consumer=name,
            claim_idle_ms=cfg.claim_idle_ms,
            max_deliveries=cfg.max_deliveries,
        )
        for name in cfg.consumers(f"reward-{socket.gethostname()}-{os.getpid()}")
    ]
    console.print(f"scoring {names.trajectories} → {names.scored} as {', '.join(w.consumer.consumer for w in workers)}")
    pool = [
        threading.Thread(target=w.run, args=(stop,), kwargs={"batch": cfg.batch}, name=w.consumer.consumer)
        for w in workers
    ]
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


def _worker_config(path: Path | None, **flags: Any):
    """The worker's RewardConfig: `--config` (and STAR_REWARD_*), the flags given over it; or a clear error."""
    from services.common.config_file import ConfigFileError
    from services.reward.config import load_reward_config

    try:
        loaded = load_reward_config(path)
    except ConfigFileError as exc:
        _fail(str(exc))
    # the flags' bounds are the fields' own, checked by the command line
    return loaded.model_copy(update={name: value for name, value in flags.items() if value is not None})
