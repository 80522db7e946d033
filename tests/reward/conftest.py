"""Fixtures of the evaluator tests: the train queries with their gold plans (all 45 with the full data,
the fixture's subset without), and evaluators in both modes over the shared official world."""

from __future__ import annotations

import ast
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.common.schemas import TravelQuery
from services.reward import COMMONSENSE_CHECKS, HARD_CHECKS, Evaluator
from tests.conftest import train_position


@dataclass
class Gold:
    records: list[dict[str, Any]]
    queries: list[TravelQuery]
    plans: list[list[dict[str, Any]]]  # the annotated day lists, `{}` padding included

    def plan(self, i: int) -> list[dict[str, Any]]:
        """A fresh deep copy of gold plan i, ready to mutate."""
        return copy.deepcopy(self.plans[i])

    def at(self, org: str, dest: str) -> int:
        """The position of the query from org to dest (positions differ between fixture and full data)."""
        return train_position(self.records, org, dest)

    def query(self, i: int, **changes: Any) -> TravelQuery:
        """Query i, optionally with fields (or local constraints via lc_<name>) replaced."""
        data = self.queries[i].model_dump()
        for key, value in changes.items():
            if key.startswith("lc_"):
                data["local_constraint"][key[3:]] = value
            else:
                data[key] = value
        return TravelQuery(**data)


@pytest.fixture(scope="session")
def gold(travelplanner_dir: Path) -> Gold:
    records = json.loads((travelplanner_dir / "train" / "train.json").read_text(encoding="utf-8"))
    queries = [TravelQuery(**r) for r in records]
    plans = []
    for r in records:
        meta, days = ast.literal_eval(r["annotated_plan"])
        assert meta["org"] == r["org"] and meta["days"] == r["days"]
        plans.append(days)
    return Gold(records, queries, plans)


@pytest.fixture(scope="session")
def official(official_world) -> Evaluator:
    return Evaluator(official_world, "official")


@pytest.fixture(scope="session")
def strict(official) -> Evaluator:
    return official.with_mode("strict")


@pytest.fixture(scope="session")
def evaluators(official, strict) -> dict[str, Evaluator]:
    return {"official": official, "strict": strict}


def verdicts(evaluation) -> dict[str, bool | None]:
    """Every check's verdict, commonsense then hard."""
    return {k: evaluation.commonsense[k].passed for k in COMMONSENSE_CHECKS} | {
        k: evaluation.hard[k].passed for k in HARD_CHECKS
    }


@pytest.fixture(scope="session")
def all_verdicts():
    return verdicts
