"""The TravelPlanner fixture is a cut, never a copy: part of the train split that still covers what the tests
read (each level and trip length, every kind of local constraint), and no file equal to one of the full data."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

from tests.conftest import FIXTURE_DIR

TRAIN_SIZE = 45


def _train(directory: Path) -> list[dict]:
    return json.loads((directory / "train" / "train.json").read_text(encoding="utf-8"))


def _digests(directory: Path) -> dict[str, Path]:
    return {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in directory.rglob("*") if p.is_file()}


def test_the_fixture_keeps_part_of_the_train_split_covering_the_tests():
    records = _train(FIXTURE_DIR)
    assert 0 < len(records) < TRAIN_SIZE
    assert {(r["level"], r["days"]) for r in records} == {
        (lv, d) for lv in ("easy", "medium", "hard") for d in (3, 5, 7)
    }
    asked = {k for r in records for k, v in ast.literal_eval(r["local_constraint"]).items() if v}
    assert asked == {"house rule", "cuisine", "room type", "transportation"}
    with open(FIXTURE_DIR / "train" / "train_ref_info.jsonl", encoding="utf-8") as fh:
        assert sum(1 for line in fh if line.strip()) == len(records)


def test_the_fixture_queries_are_train_queries_in_order(full_travelplanner_dir):
    full = [r["query"] for r in _train(full_travelplanner_dir)]
    positions = [full.index(r["query"]) for r in _train(FIXTURE_DIR)]
    assert positions == sorted(set(positions)) and len(full) == TRAIN_SIZE


def test_no_fixture_file_equals_a_file_of_the_full_data(full_travelplanner_dir):
    full = _digests(full_travelplanner_dir)
    same = {str(p.relative_to(FIXTURE_DIR)) for digest, p in _digests(FIXTURE_DIR).items() if digest in full}
    assert not same, f"whole files of the full data in the fixture: {sorted(same)}"
