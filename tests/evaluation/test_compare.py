"""Paired bootstrap comparison of two runs, as a function and as `star eval compare`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.evaluation.compare import CompareError, compare_records
from services.evaluation.formatting import StructuredParser
from services.evaluation.runfolder import RunFolder
from services.evaluation.runner import EvalRun, run_eval
from tests.evaluation.conftest import mutated_plans, write_submission

runner = CliRunner()


@pytest.fixture
def runs(gold, evaluator, tmp_path):
    """Run A: the gold plans with 4 faults; run B: the gold plans; run C: a copy of A."""
    gold_sub = write_submission(tmp_path / "gold.jsonl", gold, [gold.plan(i) for i in range(len(gold.plans))])
    bad_sub = write_submission(tmp_path / "bad.jsonl", gold, mutated_plans(gold))
    out = {}
    for name, sub in (("a", bad_sub), ("b", gold_sub), ("c", bad_sub)):
        run = EvalRun(
            split_path=gold.split_path,
            out=tmp_path / name,
            evaluator=evaluator,
            formatter=StructuredParser(),
            source={"kind": "predictions", "name": name},
        )
        run_eval(run, predictions_path=sub, progress=False)
        out[name] = tmp_path / name
    return out


def test_identical_runs_have_zero_delta(runs, gold):
    deltas, info = compare_records(RunFolder(runs["a"]).records(), RunFolder(runs["c"]).records(), resamples=500)
    assert info == {"paired_queries": len(gold.plans), "only_a": 0, "only_b": 0}
    for d in deltas:
        assert d.delta == 0 and d.low == 0 and d.high == 0 and d.p_b_better == 0


def test_better_run_has_positive_delta_and_ci(runs, gold):
    n = len(gold.plans)
    deltas, _ = compare_records(RunFolder(runs["a"]).records(), RunFolder(runs["b"]).records(), resamples=2000)
    by = {d.metric: d for d in deltas}
    final = by["final_pass_rate"]
    assert final.a == pytest.approx(100 * (n - 4) / n) and final.b == pytest.approx(100.0)
    assert final.delta == pytest.approx(100 * 4 / n)
    # B is never worse on any query, so no resample can favour A; the CI holds the point estimate
    assert 0 <= final.low <= final.delta <= final.high
    assert by["delivery_rate"].delta == pytest.approx(100 / n)
    assert final.p_b_better > 0.9


def test_same_seed_same_interval(runs):
    a, b = RunFolder(runs["a"]).records(), RunFolder(runs["b"]).records()
    first, _ = compare_records(a, b, resamples=300, seed=7)
    again, _ = compare_records(a, b, resamples=300, seed=7)
    assert [(d.low, d.high) for d in first] == [(d.low, d.high) for d in again]


def test_unrelated_runs_refused(runs):
    a = RunFolder(runs["a"]).records()
    other = [r.model_copy(update={"query_id": "x" + r.query_id}) for r in a]
    with pytest.raises(CompareError, match="share no query ids"):
        compare_records(a, other)


def test_cli_compare(runs, gold, tmp_path):
    n = len(gold.plans)  # 45 on the full data: 91.11, +8.89
    r = runner.invoke(app, ["eval", "compare", str(runs["a"]), str(runs["b"]), "--resamples", "500"])
    assert r.exit_code == 0, r.output
    assert f"{n} paired queries" in r.stdout
    assert f"| Final Pass Rate | {100 * (n - 4) / n:.2f} | 100.00 | +{400 / n:.2f} |" in r.stdout
    r = runner.invoke(app, ["eval", "compare", str(runs["a"]), str(runs["c"]), "--json", "--resamples", "200"])
    assert r.exit_code == 0, r.output
    assert all(d["delta"] == 0 and d["low"] == 0 and d["high"] == 0 for d in json.loads(r.stdout)["deltas"])
    r = runner.invoke(app, ["eval", "compare", str(runs["a"]), str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "not a run folder" in r.output


def test_the_learning_proof_reports_its_success_gain_with_this_interval(runs, gold, tmp_path):
    import shutil

    n = len(gold.plans)
    from bench import gpu_proof

    evals = {}
    for label, run in (("sft", "a"), ("rl", "b")):  # the proof scores each model into <folder>/official
        shutil.copytree(runs[run], tmp_path / label / "official")
        evals[label] = {"folder": str(tmp_path / label)}
    ci = gpu_proof.success_gain_interval(evals["sft"], evals["rl"])
    expected = next(
        d
        for d in compare_records(RunFolder(runs["a"]).records(), RunFolder(runs["b"]).records())[0]
        if d.metric == "final_pass_rate"
    )
    assert ci == {
        "points": expected.delta,
        "low": expected.low,
        "high": expected.high,
        "p_rl_better": expected.p_b_better,
        "confidence": 0.95,
        "queries": n,
    }
    assert ci["points"] == pytest.approx(100 * 4 / n)
    # an older state, or folders left on the device: no interval, no error
    assert gpu_proof.success_gain_interval({"model": "m"}, evals["rl"]) is None
    assert gpu_proof.success_gain_interval({"folder": str(tmp_path / "gone")}, evals["rl"]) is None
    decoded = {"queries": n, "decode_s": 1.0, "finish_reasons": {"answer": n}, "tool_calls_mean": 5.0}
    sft = round(100 * (n - 4) / n, 2)
    state = {
        label: {**e, **decoded, "official": {"final_pass_rate": p}, "strict": {}}
        for label, e, p in (("eval_sft", evals["sft"], sft), ("eval_rl", evals["rl"], 100.0))
    }
    gpu_proof.report(state, tmp_path / "out", "proof", "cmd")
    md = (tmp_path / "out" / "proof.md").read_text()
    assert (
        f"Success gain of RL over SFT (official): {100 - sft:+.1f} points, 95% CI [{ci['low']:+.1f}, "
        f"{ci['high']:+.1f}], P(RL > SFT) {ci['p_rl_better']:.2f} (paired bootstrap over the {n} held-out "
        "queries"
    ) in md
