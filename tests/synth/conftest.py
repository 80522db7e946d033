"""Fixtures of the synthesis tests: the index and oracle over the shared worlds, strict evaluators,
and the 45 official train queries with their gold plans."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from services.common.schemas import TravelQuery
from services.reward import Evaluator
from services.synth.index import SynthIndex
from services.synth.oracle import Oracle


@pytest.fixture(scope="session")
def synth_index(official_world) -> SynthIndex:
    return SynthIndex.build(official_world)


@pytest.fixture(scope="session")
def oracle(synth_index) -> Oracle:
    return Oracle(synth_index)


@pytest.fixture(scope="session")
def strict_eval(official_world) -> Evaluator:
    return Evaluator(official_world, "strict")


@pytest.fixture(scope="session")
def train_records(travelplanner_dir: Path) -> list[dict]:
    return json.loads((travelplanner_dir / "train" / "train.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def train_queries(train_records) -> list[TravelQuery]:
    return [TravelQuery(**r) for r in train_records]


@pytest.fixture(scope="session")
def gold_plans(train_records) -> list[list[dict]]:
    return [ast.literal_eval(r["annotated_plan"])[1] for r in train_records]


def failures(evaluation) -> dict[str, str]:
    """The checks a plan fails, with their reasons (empty: the plan succeeds)."""
    return {k: v.reason for k, v in {**evaluation.commonsense, **evaluation.hard}.items() if v.passed is False}
