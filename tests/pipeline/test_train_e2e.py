"""`star train configs/tiny.yaml` end to end, as the README runs it: synthesis → SFT → RL through
Redis Streams and separate service processes → eval, then a rerun that resumes (skips every stage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def train_env(home: Path, fleet: dict[str, str] | None = None) -> dict[str, str]:
    """`star train`'s environment: this one's without its STAR_* fleet settings, plus `fleet`'s."""
    env = {
        **os.environ,
        "STAR_HOME": str(home),
        "STAR_LOG_JSON": "false",
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(ROOT / "var" / "torch_extensions"),
    }
    for key in (
        "STAR_REDIS_URL",
        "STAR_DB_URL",
        "STAR_SANDBOX_URL",
        "STAR_MODEL",
        "STAR_LEARNER_URL",
        "STAR_ROLLOUT_URLS",
        "STAR_REWARD_URL",
        "STAR_STREAM_PREFIX",
        "STAR_API_TOKEN",
    ):
        env.pop(key, None)
    return {**env, **(fleet or {})}


def train_argv(run: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "services.cli",
        "train",
        str(ROOT / "configs" / "tiny.yaml"),
        "--run-dir",
        str(run),
        *extra,
    ]


def _train(home: Path, run: Path, *extra: str, fleet: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_argv(run, *extra), env=train_env(home, fleet), capture_output=True, text=True, timeout=1500
    )


def test_tiny_recipe_runs_every_stage_and_resumes(tmp_path):
    run = tmp_path / "run"
    small = [
        "--set",
        "sft.max_steps=1",
        "--set",
        "rl.max_steps=2",
        "--set",
        "eval.limit=2",
        "--set",
        "eval.sampling.max_tool_calls=2",
        "--set",
        "rl.val_every=1",
        "--set",
        "synth.heldout_queries=2",
    ]
    first = _train(tmp_path / "home", run, *small)
    assert first.returncode == 0, first.stderr[-3000:]
    stages = json.loads((run / "stages.json").read_text())
    assert [s for s in ("synth", "sft", "rl", "eval") if stages[s]["state"] == "done"] == ["synth", "sft", "rl", "eval"]

    # synthesis: disjoint query sets and oracle teacher chats for SFT
    data = run / "data"
    sets = {
        name: [json.loads(line)["query"] for line in (data / f"{name}.jsonl").read_text().splitlines()]
        for name in ("sft", "rl", "validation")
    }
    assert all(sets.values())
    assert not set(sets["sft"]) & set(sets["rl"]) and not set(sets["rl"]) & set(sets["validation"])
    assert (data / "teacher" / "sft.jsonl").read_text().count('"messages"') == len(sets["sft"])

    # SFT exported an HF model; RL trained from it and published a version per trained step
    assert (Path(stages["sft"]["outputs"]["model"]) / "config.json").is_file()
    rl = stages["rl"]["outputs"]
    metrics = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and rl["last_version"] == metrics[-1]["version"] >= 1
    # each step trained exactly batch_prompts × G fresh samples, sampled by the current policy version
    assert [m["samples_in"] for m in metrics] == [4.0, 4.0]
    assert all(m["samples_stale"] == 0 for m in metrics)

    # validation: the starting model (in place) and every version (kept in the run folder), beside the fleet;
    # the RL stage's model is the best version, and the eval stage scores it on queries of their own
    history = json.loads((run / "validation" / "history.json").read_text())
    assert sorted(h["version"] for h in history) == [0, 1, 2]
    assert next(h for h in history if h["version"] == 0)["model"] == stages["sft"]["outputs"]["model"]
    assert not (run / "validation" / "v0" / "model").exists()
    assert rl["model"] == str(run / "validation" / f"v{rl['version']}" / "model") and rl["version"] in (1, 2)
    assert (Path(rl["model"]) / "manifest.json").is_file()
    assert set(sets["validation"]).isdisjoint(
        json.loads(line)["query"] for line in (data / "heldout.jsonl").read_text().splitlines()
    )

    # eval scored the held-out queries with the RL model and wrote the report
    ev = json.loads((run / "eval" / "metrics.json").read_text())
    assert (run / "eval" / "scores.jsonl").read_text().count("\n") == 2
    assert ev  # the leaderboard metrics exist, whatever a random 1M-parameter model scores
    report = (run / "report.md").read_text()
    assert "## RL" in report and "## Evaluation" in report and list((run / "plots").glob("rl-*.png"))

    # a rerun resumes: nothing is redone
    again = _train(tmp_path / "home", run, *small)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("done earlier, skipped") == 4


def test_a_different_recipe_in_the_same_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((ROOT / "configs" / "tiny.yaml").read_text().replace("seed: 0\n", "seed: 9\n", 1))
    out = _train(tmp_path / "home", run, "--stage", "synth")
    assert out.returncode == 1 and "different recipe" in out.stderr


def test_a_bad_recipe_is_a_cli_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {path: /nowhere}\nrl: {group_size: 0}\n")
    env = {**os.environ, "STAR_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", str(bad)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "rl.group_size" in out.stderr and "Traceback" not in out.stderr
