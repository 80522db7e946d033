"""Fixtures of the evaluation tests: the train queries with their gold plans (all 45 with the full data,
the fixture's subset without),
submission files built from them (with known mutations), and an evaluator over the shared
official world."""

from __future__ import annotations

import ast
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.common.schemas import TravelQuery


@dataclass
class Gold:
    split_path: Path
    records: list[dict[str, Any]]
    queries: list[TravelQuery]
    plans: list[list[dict[str, Any]]]

    def plan(self, i: int) -> list[dict[str, Any]]:
        return copy.deepcopy(self.plans[i])


@pytest.fixture(scope="session")
def gold(travelplanner_dir: Path) -> Gold:
    path = travelplanner_dir / "train" / "train.json"
    records = json.loads(path.read_text(encoding="utf-8"))
    plans = [ast.literal_eval(r["annotated_plan"])[1] for r in records]
    return Gold(path, records, [TravelQuery(**r) for r in records], plans)


def mutated_plans(gold: Gold) -> list[list[dict[str, Any]] | None]:
    """Gold plans with known faults in four of them (the official evaluator's verdicts on these
    mutations are in spec travelplanner.md §6.8)."""
    plans: list[list[dict[str, Any]] | None] = [gold.plan(i) for i in range(len(gold.plans))]
    p0 = plans[0]
    p0[1]["lunch"] = p0[1]["breakfast"]  # same restaurant twice: Diverse Restaurants False
    plans[1] = None  # not delivered
    p2 = plans[2]
    p2[0]["transportation"] = p2[0]["transportation"].replace("Flight Number: F", "Flight Number: F9")  # unknown flight
    p3 = plans[lowercase_index(gold)]
    p3[0]["transportation"] = p3[0]["transportation"].replace("Flight Number:", "flight number:")  # crashes official
    return plans


def lowercase_index(gold: Gold) -> int:
    """The first plan from index 3 on whose day 1 is a flight (the lower-case label mutation)."""
    return next(i for i in range(3, len(gold.plans)) if "Flight Number:" in gold.plans[i][0]["transportation"])


def write_submission(path: Path, gold: Gold, plans: list[Any]) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for i, (record, plan) in enumerate(zip(gold.records, plans)):
            fh.write(json.dumps({"idx": i + 1, "query": record["query"], "plan": plan}) + "\n")
    return path


@pytest.fixture
def mutated_submission(gold: Gold, tmp_path: Path) -> Path:
    return write_submission(tmp_path / "submission.jsonl", gold, mutated_plans(gold))


@pytest.fixture(scope="session")
def evaluator(official_world):
    from services.reward.evaluator import Evaluator

    return Evaluator(official_world, "official")
