"""Validation during RL: which versions are due, which one is best, and that it runs beside the fleet."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.controller.validation import Validation
from services.pipeline import stage
from services.pipeline.stage import StageFailed
from tests.support.waiting import until


def test_due_every_n_versions_once_and_best_prefers_success_then_recency():
    v = Validation(run=None, split="val.jsonl", every=2)  # type: ignore[arg-type]
    assert [n for n in range(0, 7) if v.due(n)] == [2, 4, 6]
    v.history = [{"version": 2, "success": 0.25}, {"version": 4, "success": 0.5}, {"version": 6, "success": 0.5}]
    assert not v.due(4)
    assert v.best()["version"] == 6
    v.history.append({"version": 8, "success": 0.1})
    assert v.best()["version"] == 6
    assert Validation(run=None, split="x", every=0).due(3) is False  # type: ignore[arg-type]
    assert Validation(run=None, split="x", every=1).best() is None  # type: ignore[arg-type]


@dataclass
class _Run:
    """What Validation uses of a run: its folder, its processes' environment and logs."""

    folder: Path
    env: dict[str, str] = field(default_factory=dict)
    config: object = field(default_factory=lambda: SimpleNamespace(eval=SimpleNamespace(limit=None)))
    placement: object = None

    def log(self, name: str) -> Path:
        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        return self.folder / "logs" / f"{name}.log"


def _fake_eval(gate: Path):
    """A `star eval` stand-in: waits for `gate`, then writes the success it finds in the model folder, in
    metrics.json's shape (tests/evaluation/test_cli.py reads the real one with the same reader); a
    negative score fails, None writes nothing."""
    script = (
        "import json, pathlib, sys, time\n"
        "model, out, gate = map(pathlib.Path, sys.argv[1:4])\n"
        "while not gate.exists(): time.sleep(0.05)\n"
        "score = json.loads((model / 'score.json').read_text())\n"
        "if score is not None and score < 0: sys.exit('the model could not be evaluated')\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "if score is not None:\n"
        "    (out / 'metrics.json').write_text(json.dumps({'metrics': {'final_pass_rate': score}}))\n"
    )
    return lambda run, model, split, out, limit, memory_share=None: [
        sys.executable,
        "-c",
        script,
        model,
        str(out),
        str(gate),
    ]


def _version(tmp_path: Path, version: int, score: float | None) -> str:
    uri = tmp_path / "weights" / f"v{version}"
    uri.mkdir(parents=True)
    (uri / "score.json").write_text(json.dumps(score))
    return str(uri)


def test_validations_run_beside_the_controller_one_at_a_time_and_keep_their_weights(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    monkeypatch.setattr(stage, "eval_argv", _fake_eval(gate))
    v = Validation(run=_Run(tmp_path / "run"), split="val.jsonl", every=2)  # type: ignore[arg-type]
    started = time.monotonic()
    v.submit(2, _version(tmp_path, 2, 40.0))
    v.submit(4, _version(tmp_path, 4, 47.0))
    assert time.monotonic() - started < 5  # submitting does not wait for the evaluation
    assert v.running[0] == 2 and [version for version, _ in v.waiting] == [4]  # one at a time, the next queued
    assert not v.due(2) and not v.due(4) and v.due(6)  # under way and queued count as seen
    assert v.poll() == []  # nothing finished while the gate is shut
    # the learner prunes old versions: the validation's copy stays (hard links)
    for n in (2, 4):
        (tmp_path / "weights" / f"v{n}" / "score.json").unlink()
    assert (tmp_path / "run" / "validation" / "v4" / "model" / "score.json").is_file()
    gate.touch()
    first = until(v.poll)
    assert [e["version"] for e in first] == [2] and v.running[0] == 4  # the queued one starts as one ends
    assert [e["version"] for e in v.wait()] == [4]
    assert v.best()["version"] == 4 and v.best()["success"] == 47.0
    history = json.loads((tmp_path / "run" / "validation" / "history.json").read_text())
    assert [h["version"] for h in history] == [2, 4]


def test_a_failed_validation_fails_the_stage_and_stop_ends_the_one_under_way(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    monkeypatch.setattr(stage, "eval_argv", _fake_eval(gate))
    v = Validation(run=_Run(tmp_path / "run"), split="val.jsonl", every=1)  # type: ignore[arg-type]
    v.submit(1, _version(tmp_path, 1, -1.0))
    gate.touch()
    with pytest.raises(StageFailed, match="(?s)validate-v1 exited with 1.*could not be evaluated"):
        v.wait()
    # an evaluation that exits cleanly without a figure is an error, not 0 % (run 33 read every version as 0)
    v.submit(9, _version(tmp_path, 9, None))
    with pytest.raises(StageFailed, match="validate-v9 exited cleanly but left no success"):
        v.wait()
    gate.unlink()
    v.submit(2, _version(tmp_path, 2, 50.0))
    v.submit(3, _version(tmp_path, 3, 50.0))
    proc = v.running[2].proc
    v.stop()
    assert proc.returncode is not None and v.running is None and v.waiting == []
    assert v.history == []


def test_the_starting_model_is_the_baseline_evaluated_in_place_never_the_pick(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setattr(stage, "eval_argv", _fake_eval(gate))
    v = Validation(run=_Run(tmp_path / "run"), split="val.jsonl", every=4)  # type: ignore[arg-type]
    start = _version(tmp_path, 0, 52.0)
    v.submit(0, start, keep=False)
    v.submit(4, _version(tmp_path, 4, 45.0))
    v.wait()
    assert [h["version"] for h in v.history] == [0, 4] and v.history[0]["model"] == start
    assert not (tmp_path / "run" / "validation" / "v0" / "model").exists()  # no copy of the starting model
    assert v.best()["version"] == 4  # RL's pick, though the starting model scored higher
    assert Validation(run=None, split="x", every=1, history=[v.history[0]]).best() is None  # type: ignore[arg-type]


def test_validations_after_the_fleet_queue_until_it_has_ended(tmp_path, monkeypatch):
    # a colocated placement with no room for a validation's engine: nothing starts beside the fleet
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setattr(stage, "eval_argv", _fake_eval(gate))
    v = Validation(run=_Run(tmp_path / "run"), split="val.jsonl", every=2, after_fleet=True)  # type: ignore[arg-type]
    v.submit(2, _version(tmp_path, 2, 30.0))
    v.submit(4, _version(tmp_path, 4, 35.0))
    time.sleep(0.2)
    assert v.running is None and [version for version, _ in v.waiting] == [2, 4] and v.poll() == []
    assert not v.due(2) and not v.due(4)  # queued counts as seen: not submitted twice
    assert [e["version"] for e in v.wait()] == [2, 4]  # the fleet has ended: both run, in order
    assert v.best()["version"] == 4


@pytest.mark.parametrize("keep", ["best", "all"])
def test_validated_versions_beaten_by_another_give_their_disk_back(tmp_path, monkeypatch, keep):
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setattr(stage, "eval_argv", _fake_eval(gate))
    v = Validation(run=_Run(tmp_path / "run"), split="val.jsonl", every=2, keep=keep)  # type: ignore[arg-type]
    start = _version(tmp_path, 0, 60.0)
    v.submit(0, start, keep=False)
    for version, score in ((2, 40.0), (4, 47.0), (6, 45.0)):
        v.submit(version, _version(tmp_path, version, score))
    v.wait()
    kept = {n: (tmp_path / "run" / "validation" / f"v{n}" / "model").is_dir() for n in (2, 4, 6)}
    if keep == "best":
        assert kept == {2: False, 4: True, 6: False}
        assert [h.get("pruned", False) for h in v.history] == [False, True, False, True]
    else:
        assert kept == {2: True, 4: True, 6: True}
    assert Path(start).is_dir()  # the starting model lies where the user put it
    assert v.best()["version"] == 4
    # a restarted controller keeps the whole curve and the same pick
    again = Validation(run=_Run(tmp_path / "run"), split="val.jsonl", every=2, keep=keep)  # type: ignore[arg-type]
    assert [h["version"] for h in again.history] == [0, 2, 4, 6]
    assert again.best()["version"] == 4 and not again.due(6)
