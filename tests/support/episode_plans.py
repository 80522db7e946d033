"""Plans and a live server for episode-API tests and the adapters' parity tests.

- `plan_cases(travelplanner_dir)`: the train queries of the data the tests read (the fixture's 15, or all 45)
  with their gold plans, and each gold plan broken one constraint at a time (`PlanCase.breaks` names the
  check the break targets; `None` for the gold plan itself). Every case is a (query, plan) pair to score the
  same way through `star score`, the episode API and each adapter.
- `running_episode_server(...)`: the sandbox and the episode service as real processes on free ports (the
  scorer runs inside the episode service, over the same world), with Redis keys under a prefix of their
  own; yields an `EpisodeServer` (base URL, token).
- `episode_server`: that as a module-scoped pytest fixture; import it into a test module or conftest
  (`from tests.support.episode_plans import episode_server  # noqa: F401`).
"""

from __future__ import annotations

import ast
import copy
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

TOKEN = "episode-test-token"
SPLIT = "train"


@dataclass(frozen=True)
class PlanCase:
    """One (query, plan) pair: `query_id` is the query's id in the train split; `query` its record (with any
    change the break makes to it, e.g. a budget too small); `plan` the benchmark's day list."""

    name: str
    query_id: str
    query: dict[str, Any]
    plan: list[dict[str, Any]]
    breaks: str | None = None  # the check that fails (commonsense or hard name); None: the gold plan
    query_changed: bool = False  # the break is in the query (start the episode with `query`, not the id)

    @property
    def gold(self) -> bool:
        return self.breaks is None


def train_records(travelplanner_dir: Path) -> list[dict[str, Any]]:
    return json.loads((Path(travelplanner_dir) / "train" / "train.json").read_text(encoding="utf-8"))


def gold_plan(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The annotated plan's day objects (the benchmark stores a Python repr of [meta, days])."""
    _meta, days = ast.literal_eval(record["annotated_plan"])
    return [d for d in days if d]


def query_of(record: dict[str, Any], position: int) -> dict[str, Any]:
    """The query fields of a train record, in the structured form (no gold plan or reference text), with the id
    the episode service gives it: its 1-based position."""
    from services.common.schemas import TravelQuery

    fields = {k: v for k, v in record.items() if k not in ("annotated_plan", "reference_information")}
    return TravelQuery(**fields).model_copy(update={"id": str(position)}).model_dump(mode="json")


# -- breaking a plan one constraint at a time --------------------------------------------------------

MEALS = ("breakfast", "lunch", "dinner")


def _places(plan: list[dict[str, Any]], slot: str) -> list[tuple[int, str]]:
    return [(i, d[slot]) for i, d in enumerate(plan) if d.get(slot, "-") not in ("-", "", None)]


def repeat_restaurant(query: dict, plan: list[dict]) -> list[dict] | None:
    """The same restaurant for two meals."""
    meals = [(i, slot, d[slot]) for i, d in enumerate(plan) for slot in MEALS if d.get(slot, "-") not in ("-", "")]
    if len(meals) < 2:
        return None
    out = copy.deepcopy(plan)
    (_, _, first), (j, slot, _) = meals[0], meals[1]
    out[j][slot] = first
    return out


def invented_restaurant(query: dict, plan: list[dict]) -> list[dict] | None:
    """A restaurant the world does not have."""
    meals = [(i, slot, d[slot]) for i, d in enumerate(plan) for slot in MEALS if d.get(slot, "-") not in ("-", "")]
    if not meals:
        return None
    i, slot, name = meals[-1]
    out = copy.deepcopy(plan)
    out[i][slot] = f"The Imaginary Spoon, {name.rsplit(',', 1)[-1].strip()}"
    return out


def repeat_attraction(query: dict, plan: list[dict]) -> list[dict] | None:
    """One attraction visited on two days."""
    days = _places(plan, "attraction")
    if len(days) < 2:
        return None
    out = copy.deepcopy(plan)
    first = days[0][1].split(";")[0]
    j, text = days[1]
    out[j]["attraction"] = f"{first};{text}" if text.endswith(";") or not text else f"{first};{text};"
    return out


def no_return_trip(query: dict, plan: list[dict]) -> list[dict] | None:
    """The last day's way home left out."""
    if plan[-1].get("transportation", "-") in ("-", ""):
        return None
    out = copy.deepcopy(plan)
    out[-1]["transportation"] = "-"
    return out


def over_budget(query: dict, plan: list[dict]) -> tuple[dict, list[dict]]:
    """The same plan for a budget of $1: the query changes, not the plan."""
    return {**query, "budget": 1}, copy.deepcopy(plan)


PLAN_BREAKS: dict[str, Callable[[dict, list[dict]], list[dict] | None]] = {
    "is_valid_restaurants": repeat_restaurant,
    "is_valid_information_in_sandbox": invented_restaurant,
    "is_valid_attractions": repeat_attraction,
    "is_not_absent": no_return_trip,
}


def plan_cases(travelplanner_dir: Path, limit: int | None = None) -> list[PlanCase]:
    """Gold and broken cases of the first `limit` train queries (all when None)."""
    out: list[PlanCase] = []
    records = train_records(travelplanner_dir)[:limit]
    for position, record in enumerate(records, 1):
        qid = str(position)
        query, plan = query_of(record, position), gold_plan(record)
        out.append(PlanCase(f"train-{qid}-gold", qid, query, plan))
        for check, breaker in PLAN_BREAKS.items():
            broken = breaker(query, plan)
            if broken is not None:
                out.append(PlanCase(f"train-{qid}-{breaker.__name__}", qid, query, broken, breaks=check))
        budget_query, same_plan = over_budget(query, plan)
        out.append(
            PlanCase(f"train-{qid}-over_budget", qid, budget_query, same_plan, breaks="valid_cost", query_changed=True)
        )
    return out


# -- a live episode server ---------------------------------------------------------------------------


@dataclass
class EpisodeServer:
    url: str
    token: str
    prefix: str
    sandbox_url: str
    processes: dict[str, Any] = field(default_factory=dict)

    def client(self, **options: Any):
        from services.episodes.client import EpisodeClient

        return EpisodeClient(self.url, self.token, **options)

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Stop and start one of the processes (`sandbox` or `episodes`); it comes back on the same port."""
        proc = self.processes[name]
        proc.stop()
        proc.start(timeout=timeout)


@contextmanager
def running_episode_server(
    world_url: str,
    redis_url: str,
    logs: Path,
    *,
    travelplanner_dir: Path | None = None,
    token: str | None = TOKEN,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Iterator[EpisodeServer]:
    """The sandbox and the episode service over `world_url`, episodes in Redis at `redis_url` under a fresh
    prefix (deleted afterwards). `env`: more STAR_* settings for the episode service."""
    import redis

    from services.controller.launcher import ServiceProcess

    logs = Path(logs)
    logs.mkdir(parents=True, exist_ok=True)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    common = {
        "STAR_DB_URL": world_url,
        "STAR_LOG_LEVEL": "WARNING",
        "STAR_LOG_JSON": "false",
        "STAR_API_TOKEN": token or "",
        "STAR_HOME": str(logs / "home"),
    }
    if not token:
        common.pop("STAR_API_TOKEN")
    sandbox = ServiceProcess("sandbox", "services.sandbox.app:create_app", common, logs).start(timeout=timeout)
    episodes = None
    try:
        episode_env = {
            **common,
            "STAR_REDIS_URL": redis_url,
            "STAR_SANDBOX_URL": sandbox.url,
            "STAR_STREAM_PREFIX": prefix,
            "STAR_FORMATTER_LLM_URL": "",
            **(env or {}),
        }
        if travelplanner_dir is not None:
            episode_env["STAR_TRAVELPLANNER_DIR"] = str(travelplanner_dir)
        episodes = ServiceProcess("episodes", "services.episodes.app:create_app", episode_env, logs)
        episodes.start(timeout=timeout)
        yield EpisodeServer(episodes.url, token or "", prefix, sandbox.url, {"sandbox": sandbox, "episodes": episodes})
    finally:
        if episodes is not None:
            episodes.stop()
        sandbox.stop()
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        client.close()


@pytest.fixture(scope="module")
def episode_server(
    official_world_url: str, redis_server_url: str, travelplanner_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EpisodeServer]:
    """A live episode API (+ sandbox) over the tests' official world and data, with a bearer token."""
    with running_episode_server(
        official_world_url, redis_server_url, tmp_path_factory.mktemp("episodes"), travelplanner_dir=travelplanner_dir
    ) as server:
        yield server
