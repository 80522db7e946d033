"""The learning-proof report (bench/gpu_proof.py) reads `star eval`'s metrics as percentages."""

from __future__ import annotations

import gzip
import json

import pytest

from bench import gpu_proof


def _eval(success: float, delivery: float) -> dict:
    metrics = {
        "delivery_rate": delivery,
        "cs_micro": 40.0,
        "cs_macro": 10.0,
        "hard_micro": 20.0,
        "hard_macro": 5.0,
        "final_pass_rate": success,
    }
    return {
        "model": "m",
        "queries": 48,
        "decode_s": 10.0,
        "finish_reasons": {"answer": 48},
        "tool_calls_mean": 9.0,
        "sampled_tokens_mean": 900.0,
        "generate_s_per_turn": 1.0,
        "official": metrics,
        "strict": metrics,
    }


def test_success_gain_is_in_points_and_tables_show_percentages(tmp_path):
    state = {
        "eval_sft": _eval(success=6.25, delivery=12.5),
        "eval_rl": {**_eval(success=18.75, delivery=75.0), "engine": "vllm"},
    }
    summary = gpu_proof.report(state, tmp_path, "proof", "python bench/gpu_proof.py")
    assert summary["success_gain_points"] == 12.5
    md = (tmp_path / "proof.md").read_text()
    assert "| SFT | 12.5 | 40.0 | 10.0 | 20.0 | 5.0 | 6.2 |" in md
    assert "| RL | 75.0 |" in md and "+12.5 points" in md
    # which engine the evaluation ran on, where the run recorded it (older runs did not)
    assert "- RL decode (on vllm): 48 queries" in md and "- SFT decode: 48 queries" in md
    assert json.loads((tmp_path / "proof.json").read_text())["success_gain_points"] == 12.5


def test_the_sft_loss_curve_is_read_and_reported(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(
            json.dumps({"step": i + 1, "time": 0.0, "loss": loss}) + "\n"
            for i, loss in enumerate((2.5, 1.25, 0.75, 0.8))
        )
    )
    losses = gpu_proof.sft_losses(metrics)
    assert losses == [2.5, 1.25, 0.75, 0.8]
    state = {
        "sft": {"sft": {"seconds": 72.0}, "loss": losses},
        "eval_sft": _eval(success=0.0, delivery=41.0),
        "eval_rl": _eval(success=1.0, delivery=37.0),
    }
    gpu_proof.report(state, tmp_path, "proof", "python bench/gpu_proof.py")
    md = (tmp_path / "proof.md").read_text()
    assert "SFT: 4 steps in 72 s; loss 2.500 at step 1, 0.750 at least, 0.800 at the last step" in md
    assert json.loads((tmp_path / "proof.json").read_text())["sft_stage"]["loss"] == losses


def test_recorded_runs_compare_per_step_wall_time_without_the_fleet_start():
    from bench import gpu_proof_runs

    steps = [{"time": t} for t in (100.0, 150.0, 160.0, 210.0)]  # the first step includes the fleet start
    assert gpu_proof_runs.step_walls(steps) == [50.0, 10.0, 50.0]
    assert gpu_proof_runs.seconds_per_step(steps) == 110.0 / 3
    assert gpu_proof_runs.seconds_per_step(steps[:1]) is None
    run8 = gpu_proof_runs.summarize("8")  # the recorded H100 run: sync 50.8 s, async 35.1 s a step
    assert round(run8["sync_s"], 1) == 50.8 and round(run8["speedup"], 2) == 1.45


def test_recorded_runs_without_a_baseline_compare_how_they_learned(tmp_path):
    from bench import gpu_proof_runs

    run17, run18 = gpu_proof_runs.summarize("17"), gpu_proof_runs.summarize("18")  # H100, no sync baseline
    assert run17["sync_s"] is None and run17["speedup"] is None
    assert "sync: none" in gpu_proof_runs.describe(run17) and "async 29.0 s/step" in gpu_proof_runs.describe(run17)
    # the uncapped KL term's spike (step 18) and the capped run's steady norms, read from the records
    assert max(s["grad_norm"] for s in run17["async"]) > 1000 > 1 > max(s["grad_norm"] for s in run18["async"])
    assert len(run18["restated"]) == 24 and min(run17["restated"]) == 0.0 < min(run18["restated"])
    out = tmp_path / "learning.png"
    gpu_proof_runs.plot_learning([run17, run18], out)
    assert out.stat().st_size > 10_000


def test_transport_modes_count_plans_by_preference_and_report_them(tmp_path):
    def row(preference, *legs):
        plan = [{"day": i + 1, "transportation": leg} for i, leg in enumerate(legs)]
        return json.dumps({"query": {"local_constraint": {"transportation": preference}}, "plan": plan})

    scores = tmp_path / "scores.jsonl"
    scores.write_text(
        "\n".join(
            [
                row(None, "Self-driving, from A to B, cost: 56", "-", "Self-driving, from B to A, cost: 56"),
                row("no flight", "Flight Number: F1, from A to B", "-", "Taxi, from B to A, cost: 90"),
                row("no flight", "Flight Number: F2, from A to B", "-", "Flight Number: F3, from B to A"),
                json.dumps({"query": {"local_constraint": {"transportation": "no self-driving"}}, "plan": None}),
            ]
        )
        + "\n"
    )
    modes = gpu_proof.transport_modes(gpu_proof.held_out_answers(scores))
    assert modes == {
        "none": {"self-driving": 1},
        "no flight": {"flight+taxi": 1, "flight": 1},
        "no self-driving": {"-": 1},
    }
    state = {
        "eval_sft": {**_eval(50.0, 100.0), "transport_modes": modes},
        "eval_rl": {**_eval(50.0, 100.0), "transport_modes": {"none": {"flight": 1}}},
    }
    gpu_proof.report(state, tmp_path, "proof", "cmd")
    md = (tmp_path / "proof.md").read_text()
    assert "| no flight | flight 1, flight+taxi 1 | — |" in md
    assert "| none | self-driving 1 | flight 1 |" in md


def test_restated_preferences_count_what_the_first_thought_repeats_and_report_it(tmp_path):
    wants = {
        "q1": {
            "transportation": "no flight",
            "house_rule": None,
            "room_type": "private room",
            "cuisine": ["Thai", "Indian"],
        },
        "q2": {"transportation": "no self-driving", "house_rule": "pets", "room_type": None, "cuisine": None},
        "q3": {"transportation": None, "house_rule": None, "room_type": None, "cuisine": None},
    }
    thoughts = {
        "q1": "wants a private room, Thai food, no flight. No flights are allowed",
        "q2": "budget $900. First I check the way",  # dropped both of its preferences
        "q3": "budget $600. First I check the way",
    }
    scores, trajectories = tmp_path / "scores.jsonl", tmp_path / "trajectories.jsonl"
    scores.write_text(
        "".join(json.dumps({"query_id": q, "query": {"local_constraint": lc}}) + "\n" for q, lc in wants.items())
    )
    trajectories.write_text(
        "".join(
            json.dumps(
                {
                    "query_id": q,
                    "trajectory": {
                        "messages": [
                            {"role": "system", "content": "no flight allowed, Indian food"},  # not the policy's words
                            {"role": "user", "content": "the request"},
                            {"role": "assistant", "content": f"<think>{t}</think><tool_call>{{}}</tool_call>"},
                            {"role": "assistant", "content": "<think>Indian, pets</think>"},
                        ]
                    },
                }
            )
            + "\n"
            for q, t in thoughts.items()
        )
    )
    table = gpu_proof.restated_preferences(gpu_proof.held_out_answers(scores), trajectories)
    assert table == {"transportation": [1, 2], "house_rule": [0, 1], "room_type": [1, 1], "cuisine": [1, 2]}
    state = {
        "eval_sft": {**_eval(50.0, 100.0), "restated_preferences": table},
        "eval_rl": {**_eval(50.0, 100.0), "restated_preferences": {**table, "cuisine": [0, 2]}},
    }
    gpu_proof.report(state, tmp_path, "proof", "cmd")
    md = (tmp_path / "proof.md").read_text()
    assert "| transportation | 1 of 2 | 1 of 2 |" in md and "| cuisine | 1 of 2 | 0 of 2 |" in md


def _scored(query_id: str, level: str, success: bool, broken: tuple[str, ...] = (), transport=None) -> dict:
    checks = {name: {"passed": name not in broken, "reason": ""} for name in ("valid_cost", "valid_cuisine")}
    return {
        "query_id": query_id,
        "cost": 500.0,
        "query": {
            "level": level,
            "budget": 900,
            "people_number": 2,
            "local_constraint": {"transportation": transport, "cuisine": None},
        },
        "plan": [{"day": 1, "transportation": "Self-driving, from A to B, cost: 56"}],
        "score": {
            "commonsense": {"is_not_absent": {"passed": True, "reason": ""}},
            "hard": checks,
            "success": 1.0 if success else 0.0,
        },
    }


def test_held_out_answers_set_sft_against_rl_query_by_query(tmp_path):
    runs = {
        "sft": [
            _scored("q1", "easy", True),
            _scored("q2", "easy", True),
            _scored("q3", "hard", False, ("valid_cost",), transport="no flight"),
        ],
        "rl": [
            _scored("q1", "easy", True),
            _scored("q2", "easy", False, ("valid_cost", "valid_cuisine")),
            _scored("q3", "hard", True, transport="no flight"),
        ],
    }
    answers = {}
    for label, rows in runs.items():
        path = tmp_path / f"{label}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        answers[label] = gpu_proof.held_out_answers(path)
    assert answers["sft"]["q3"] == {
        "level": "hard",
        "people": 2,
        "budget": 900,
        "constraints": {"transportation": "no flight"},
        "transport": "no flight",
        "modes": "self-driving",
        "broken": ["valid_cost"],
        "success": 0.0,
        "cost": 500.0,
    }
    change = gpu_proof.held_out_change(answers["sft"], answers["rl"])
    assert (change["queries"], change["both"], change["gained"], change["lost"]) == (3, 1, 1, 1)
    assert change["levels"] == {"easy": {"queries": 2, "sft": 2, "rl": 1}, "hard": {"queries": 1, "sft": 0, "rl": 1}}
    assert change["broken"] == {"valid_cost": {"sft": 1, "rl": 1}, "valid_cuisine": {"sft": 0, "rl": 1}}
    assert change["answers"][1]["rl"] == {
        "modes": "self-driving",
        "broken": ["valid_cost", "valid_cuisine"],
        "success": 0.0,
        "cost": 500.0,
    }
    state = {
        "eval_sft": {**_eval(66.7, 100.0), "answers": answers["sft"]},
        "eval_rl": {**_eval(66.7, 100.0), "answers": answers["rl"]},
    }
    summary = gpu_proof.report(state, tmp_path, "proof", "cmd")
    md = (tmp_path / "proof.md").read_text()
    assert "both succeed on 1, RL gained 1, RL lost 1" in md
    assert "| easy | 2 | 2 | 1 |" in md and "| valid_cuisine | 0 | 1 |" in md
    assert json.loads((tmp_path / "proof.json").read_text())["held_out"]["lost"] == summary["held_out"]["lost"] == 1
    assert "answers" not in summary["eval"]["sft"]  # the brief stays brief; per query lives in held_out


def test_a_bad_recipe_override_is_a_command_line_error(tmp_path):
    import subprocess
    import sys

    base = [sys.executable, "bench/gpu_proof.py", "--work", str(tmp_path / "w"), "--phases", "report"]
    for bad, says in (("rl.reward=nope", "rl.reward"), ("no-equals-sign", "section.key=value")):
        proc = subprocess.run([*base, "--set", bad], capture_output=True, text=True, cwd=gpu_proof.ROOT)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()  # nothing was started
    ok = subprocess.run(
        [*base, "--set", "rl.reward=success", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=gpu_proof.ROOT,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_restated_share_per_rl_step_is_read_from_the_samples_and_reported(tmp_path):
    def sample(step, lc, thought):
        return json.dumps(
            {
                "step": step,
                "query": {"local_constraint": lc},
                "messages": [
                    {"role": "user", "content": "no flight"},
                    {"role": "assistant", "content": f"<think>{thought}</think>"},
                ],
            }
        )

    hard = {"transportation": "no flight", "cuisine": ["Thai"]}
    samples = tmp_path / "samples.jsonl"
    samples.write_text(
        "\n".join(
            [
                sample(1, hard, "wants Thai food, no flight."),
                sample(1, {}, "budget $900."),
                sample(2, hard, "wants Thai food."),  # the transport preference is gone
                sample(3, {}, "budget $900."),  # states nothing: no share
                sample(4, hard, "budget $900."),
            ]
        )
        + "\n"
    )
    assert gpu_proof.restated_by_step(samples) == [1.0, 0.5, None, 0.0]
    assert gpu_proof.restated_by_step(tmp_path / "absent.jsonl") == []
    gzipped = tmp_path / "samples.jsonl.gz"  # the copy `poll` brings back
    gzipped.write_bytes(gzip.compress(samples.read_bytes()))
    assert gpu_proof.restated_by_step(gzipped) == [1.0, 0.5, None, 0.0]
    # a skipped batch repeats the step of the last trained one; its own batch keeps it apart
    batched = tmp_path / "batched.jsonl"
    batched.write_text(
        "\n".join(
            json.dumps({**json.loads(line), "batch": b})
            for line, b in zip(
                [sample(1, hard, "wants Thai food, no flight."), sample(1, hard, "budget $900.")], (1, 2)
            )
        )
        + "\n"
    )
    assert gpu_proof.restated_by_step(batched) == [1.0, 0.0]
    steps = [
        {
            "time": 100.0 + 10 * i,
            "reward_mean": 1.0,
            "success_rate": 0.5,
            "time_wait_s": 1.0,
            "time_compute_s": 2.0,
            "time_sync_s": 0.5,
        }
        for i in range(4)
    ]
    for step, truncated in zip(steps, (3.0, 0.0, 5.0)):  # the last step predates the figure
        step["samples_truncated"] = truncated
    state = {
        "rl_async": {
            "max_staleness": 3,
            "steps": steps,
            "stage_s": 40.0,
            "restated": gpu_proof.restated_by_step(samples),
        },
        "rl_sync": {"max_staleness": 0, "steps": steps[:2], "stage_s": 20.0},
    }
    gpu_proof.report(state, tmp_path, "proof", "cmd")
    md = (tmp_path / "proof.md").read_text()
    assert "- async share of stated preferences the samples' first thoughts repeat, per step: 1.00, 0.50, —, 0.00" in md
    assert "sync share" not in md.replace("async share", "")
    assert "- async samples out of context or tool calls, per step: 3, 0, 5, —" in md
    assert (tmp_path / "proof.png").stat().st_size > 10_000


def test_validated_checkpoints_are_reported_and_their_final_validation_has_time_kept(tmp_path):
    import time

    steps = [{"time": 100.0 + 20 * i, "reward_mean": 0.3, "success_rate": 0.3} for i in range(4)]
    run = {
        "max_staleness": 3,
        "steps": steps,
        "stage_s": 80.0,
        "version": 2,
        "validation": [
            {"version": 2, "success": 47.0},
            {"version": 0, "success": 41.0},
            {"version": 4, "success": 44.0},
        ],
    }  # in the order they finished
    gpu_proof.report({"rl_async": run}, tmp_path, "proof", "python bench/gpu_proof.py")
    md = (tmp_path / "proof.md").read_text()
    assert (
        "- async validation success (%, on the validation queries; RL evaluation scores v2; v0 is the starting "
        "model): v0 41.0, v2 47.0, v4 44.0"
    ) in md
    # a recipe that validates keeps VALIDATION_RESERVE_S more of the deadline for its last validation
    plain = gpu_proof.load_config(gpu_proof.ROOT / "configs" / "smollm2-proof.yaml", ["rl.val_every=0"])
    validated = gpu_proof.load_config(
        gpu_proof.ROOT / "configs" / "smollm2-proof.yaml", ["rl.val_every=8", "synth.heldout_queries=100"]
    )
    finish_by = time.monotonic() + 20 * 60
    left = {c.rl.val_every: gpu_proof.with_time_budget(c, finish_by).rl.max_minutes for c in (plain, validated)}
    assert round((left[0] - left[8]) * 60) == gpu_proof.VALIDATION_RESERVE_S


def test_a_deadline_that_leaves_rl_no_time_is_refused_before_any_phase_runs(tmp_path):
    import subprocess
    import sys
    import time

    config = gpu_proof.load_config(gpu_proof.ROOT / "configs" / "smollm2-proof.yaml", ["rl.val_every=0"])
    phases = ["convert", "sft", "eval_sft", "rl_async", "eval_rl", "report"]
    # 2026-11-25: --finish-within-min 6 left RL one minute, and it trained 0 of 32 steps
    with pytest.raises(gpu_proof.ProofBudgetError, match="leaves RL under 5 minutes"):
        gpu_proof.check_deadline(config, phases, set(), 6)
    gpu_proof.check_deadline(config, phases, set(), 25)
    gpu_proof.check_deadline(config, phases, {"convert", "sft", "eval_sft"}, 9)  # finished phases cost nothing
    gpu_proof.check_deadline(config, ["convert", "sft", "eval_sft"], set(), 1)  # no RL run: no RL budget
    validated = gpu_proof.load_config(gpu_proof.ROOT / "configs" / "smollm2-proof.yaml")  # the recipe validates
    with pytest.raises(gpu_proof.ProofBudgetError):  # its final validation needs time of its own
        gpu_proof.check_deadline(validated, phases, {"convert", "sft", "eval_sft"}, 9)
    # at the RL phase itself: what is left after the reserve must hold MIN_RL_MINUTES
    with pytest.raises(gpu_proof.ProofBudgetError, match="minutes are left for RL"):
        gpu_proof.with_time_budget(config, time.monotonic() + gpu_proof.EVAL_RL_RESERVE_S + 60)
    cut = gpu_proof.with_time_budget(config, time.monotonic() + gpu_proof.EVAL_RL_RESERVE_S + 6 * 60)
    assert 5.9 < cut.rl.max_minutes <= 6.0
    proc = subprocess.run(
        [sys.executable, "bench/gpu_proof.py", "--work", str(tmp_path / "w"), "--finish-within-min", "6"],
        capture_output=True,
        text=True,
        cwd=gpu_proof.ROOT,
    )
    assert proc.returncode == 2 and "--finish-within-min 6" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "w" / "state.json").exists()  # no phase ran


def test_an_rl_run_that_trained_no_step_is_reported_not_a_crash(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    (folder / "rl").mkdir(parents=True)
    monkeypatch.setattr(gpu_proof, "train_stages", lambda config, folder, stages: None)
    monkeypatch.setattr(
        gpu_proof,
        "stage_outputs",
        lambda folder, stage: {
            "model": "/m",
            "version": 0,
            "ended": "budget",
            "steps_trained": 0,
            "metrics": str(folder / "rl" / "metrics.jsonl"),
        },
    )
    config = gpu_proof.load_config(gpu_proof.ROOT / "configs" / "smollm2-proof.yaml")
    run = gpu_proof.rl_run(config, folder)
    assert run["steps"] == [] and run["ended"] == "budget" and run["steps_trained"] == 0
    gpu_proof.report({"rl_async": run}, tmp_path, "proof", "cmd")  # the report copes too
    assert "| async | 3 | 0 |" in (tmp_path / "proof.md").read_text()
