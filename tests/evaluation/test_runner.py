"""The eval runner on the official train split: known verdicts reproduced, official submission
round trip, resumption, pinned scoring setup, plan texts through the parser, agent trajectories."""

from __future__ import annotations

import json

import pytest

from services.common.schemas import Plan, PlanDay, Trajectory
from services.evaluation.formatting import ServiceFormatter, StructuredParser
from services.evaluation.runfolder import RunFolder, RunMismatch
from services.evaluation.runner import EvalRun, run_eval
from services.formatter.structured import render_plan
from services.reward.evaluator import COMMONSENSE_CHECKS, HARD_CHECKS, OFFICIAL_DENOMINATORS, hard_denominator
from services.reward.submission import SubmissionError, load_split, read_predictions
from tests.evaluation.conftest import lowercase_index, mutated_plans


def make_run(gold, evaluator, out, **kw) -> EvalRun:
    return EvalRun(
        split_path=gold.split_path,
        out=out,
        evaluator=evaluator,
        formatter=StructuredParser(),
        source=kw.pop("source", {"kind": "test"}),
        **kw,
    )


def verdicts(score) -> dict:
    return {k: score.commonsense[k].passed for k in COMMONSENSE_CHECKS} | {k: score.hard[k].passed for k in HARD_CHECKS}


def test_known_verdicts_reproduced(gold, evaluator, mutated_submission, tmp_path):
    result = run_eval(make_run(gold, evaluator, tmp_path / "run"), predictions_path=mutated_submission, progress=False)
    records = RunFolder(tmp_path / "run").records()
    n = len(gold.plans)
    assert [r.query_id for r in records] == [str(i) for i in range(1, n + 1)]
    by_index = {r.index: r for r in records}
    # the faults we planted, as the official evaluator judges them (spec §6.8, §6.7)
    assert by_index[0].score.commonsense["is_valid_restaurants"].passed is False
    assert by_index[0].score.cs_macro == 0 and by_index[0].delivered
    assert not by_index[1].delivered and by_index[1].plan is None and by_index[1].score.success == 0
    assert by_index[2].score.commonsense["is_valid_information_in_sandbox"].passed is False
    assert by_index[2].score.hard["valid_cost"].reason.startswith("not checked")
    low = lowercase_index(gold)
    assert by_index[low].score.commonsense["is_valid_information_in_sandbox"].passed is False
    assert "malformed plan" in by_index[low].score.commonsense["is_valid_information_in_sandbox"].reason
    assert all(by_index[i].success for i in range(n) if i not in (0, 1, 2, low))
    # every verdict equals the evaluator's own, and the metrics equal evaluate_split's
    plans = mutated_plans(gold)
    for r, evaluation in zip(records, evaluator.evaluate_many(gold.queries, plans)):
        assert verdicts(r.score) == verdicts(evaluation.to_score())
    # the whole train split (full data) gets the official denominators, the fixture's subset computed ones
    split = "train" if n == OFFICIAL_DENOMINATORS["train"][0] else None
    expected = evaluator.evaluate_split(gold.queries, plans, split=split)
    assert result["metrics"] == expected.model_dump()
    assert result["metrics"]["split"] == split
    assert result["metrics"]["counts"]["hard_total"] == hard_denominator(gold.queries)  # 105 on the whole split
    assert result["metrics"]["final_pass_rate"] == pytest.approx(100 * (n - 4) / n)
    assert result["metrics"]["delivery_rate"] == pytest.approx(100 * (n - 1) / n)


def test_official_submission_round_trips(gold, evaluator, mutated_submission, tmp_path):
    run_eval(make_run(gold, evaluator, tmp_path / "run"), predictions_path=mutated_submission, progress=False)
    written = (tmp_path / "run" / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    original = mutated_submission.read_text(encoding="utf-8").splitlines()
    assert [json.loads(a) for a in written] == [json.loads(b) for b in original]
    # and the written file scores the same when fed back
    again = run_eval(
        make_run(gold, evaluator, tmp_path / "again"),
        predictions_path=tmp_path / "run" / "predictions.jsonl",
        progress=False,
    )
    first = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert again["metrics"] == first["metrics"]


def test_interrupted_then_resumed_equals_one_go(gold, evaluator, mutated_submission, tmp_path):
    whole = run_eval(make_run(gold, evaluator, tmp_path / "whole"), predictions_path=mutated_submission, progress=False)
    run = make_run(gold, evaluator, tmp_path / "resumed")
    assert run_eval(run, predictions_path=mutated_submission, progress=False, stop_after=10) == {}
    folder = RunFolder(tmp_path / "resumed")
    assert len(folder.records()) == 10 and not folder.metrics_path.exists()
    # a kill in the middle of a write leaves half a line: it is dropped and that query re-run
    with open(folder.scores_path, "a", encoding="utf-8") as fh:
        fh.write('{"index": 10, "query_id": "11", "que')
    assert run_eval(run, predictions_path=mutated_submission, progress=False, stop_after=5) == {}
    assert [r.index for r in folder.records()] == list(range(15))
    resumed = run_eval(run, predictions_path=mutated_submission, progress=False)
    assert resumed["metrics"] == whole["metrics"]
    assert resumed["constraints"] == whole["constraints"] and resumed["failures"] == whole["failures"]
    assert len(folder.records()) == len(gold.plans)


def test_resume_skips_finished_queries(gold, evaluator, tmp_path):
    calls = []

    def agent(query):
        calls.append(query.id)
        return Trajectory(
            run_id="r",
            task_id=query.id,
            prompt_id=query.id,
            group_id=query.id,
            sample_index=0,
            finish_reason="format_error",
            messages=[],
        )

    run = make_run(gold, evaluator, tmp_path / "run", limit=6)
    run_eval(run, agent=agent, progress=False, stop_after=4)
    run_eval(run, agent=agent, progress=False)
    assert calls == ["1", "2", "3", "4", "5", "6"]


def test_scoring_setup_is_pinned(gold, evaluator, mutated_submission, tmp_path):
    out = tmp_path / "run"
    run_eval(make_run(gold, evaluator, out, limit=3), predictions_path=mutated_submission, progress=False)
    manifest = RunFolder(out).manifest()
    assert len(manifest["config_hash"]) == 64
    assert manifest["scoring"]["evaluator"]["mode"] == "official"
    assert manifest["scoring"]["formatter"]["kind"] == "structured-parser"
    with pytest.raises(RunMismatch, match="evaluator"):
        run_eval(
            make_run(gold, evaluator.with_mode("strict"), out, limit=3),
            predictions_path=mutated_submission,
            progress=False,
        )
    with pytest.raises(RunMismatch, match="source"):
        run_eval(
            make_run(gold, evaluator, out, limit=3, source={"kind": "other"}),
            predictions_path=mutated_submission,
            progress=False,
        )


def test_plan_texts_through_the_parser(gold, evaluator, tmp_path):
    n = 6
    lines = []
    for i in range(n):
        days = [PlanDay(**d) for d in gold.plan(i) if d]
        lines.append({"idx": i + 1, "plan_text": "Here is the plan.\n\n" + render_plan(Plan(days=days))})
    lines[5]["plan_text"] = "I could not finish the plan."
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    result = run_eval(make_run(gold, evaluator, tmp_path / "run", limit=n), predictions_path=path, progress=False)
    records = RunFolder(tmp_path / "run").records()
    assert all(r.success for r in records[:5])
    assert not records[5].delivered and records[5].score.formatter_status.startswith(
        "invalid_output: not a structured plan"
    )
    assert result["metrics"]["split"] is None  # a part of the split: computed denominators
    assert result["metrics"]["final_pass_rate"] == pytest.approx(100 * 5 / 6)
    assert any(f["category"] == "format error (formatter)" for f in result["failures"])


def gold_agent(gold, before=None):
    """A scripted agent: one tool call, then the gold plan as its answer (query 3: the tool budget
    runs out instead). `before(query)` runs first, in the calling thread."""

    def agent(query):
        if before is not None:
            before(query)
        i = int(query.id) - 1
        days = [PlanDay(**d) for d in gold.plan(i) if d]
        messages = [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": query.query},
            {
                "role": "assistant",
                "content": '<think>a</think><tool_call>{"name": "SearchAccommodation", '
                f'"arguments": {{"city": "{query.dest}"}}}}</tool_call>',
            },
            {"role": "user", "content": "<tool_response>\nA SearchAccommodation ...</tool_response>"},
            {"role": "assistant", "content": "<think>b</think><answer>" + render_plan(Plan(days=days)) + "</answer>"},
        ]
        finish = "answer" if i != 2 else "tool_budget"
        return Trajectory(
            run_id="r",
            task_id=query.id,
            prompt_id=query.id,
            group_id=f"g{i // 2}",
            sample_index=i % 2,
            finish_reason=finish,
            messages=messages,
            tool_calls=1,
            token_ids=list(range(100 + i)),
            answer=render_plan(Plan(days=days)) if finish == "answer" else None,
        )

    return agent


def test_agent_trajectories_feed_the_analyses(gold, evaluator, tmp_path):
    agent = gold_agent(gold)
    result = run_eval(make_run(gold, evaluator, tmp_path / "run", limit=4), agent=agent, progress=False)
    t = result["trajectory"]
    assert t["trajectories"] == 4 and t["finish_reasons"] == {"answer": 3, "tool_budget": 1}
    assert t["task_completion"] == pytest.approx(75.0)
    assert t["steps_p50"] == 2 and t["tokens_p50"] == pytest.approx(101.5) and t["steps_histogram"] == {2: 4}
    assert all(c["steps_p50"] == 2 for c in result["cohorts"])
    assert result["failures"] == [{"category": "tool budget exhausted", "queries": 1, "share_of_failures": 100.0}]
    assert result["tool_selection"]["calls"] == 4 and result["tool_selection"]["well_formed_rate"] == 100.0
    g = result["group_reward_variance"]  # group g1 = queries 3 (failed) and 4 (passed): variance 0.25
    assert g["groups"] == 2 and g["per_group"] == {"g0": 0.0, "g1": 0.25}
    assert len(RunFolder(tmp_path / "run").trajectories()) == 4
    report = (tmp_path / "run" / "report.md").read_text()
    assert "steps per task p50 / p99: 2.0 / 2.0" in report and "tool budget exhausted" in report
    for name in ("metrics.png", "constraints.png", "failures.png", "cohorts.png", "steps.png"):
        assert (tmp_path / "run" / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_agent_runs_that_many_episodes_at_once(gold, evaluator, tmp_path):
    import threading

    # four callers must be inside the agent together to pass; one at a time, the barrier times out
    together = threading.Barrier(4, timeout=20)
    agent = gold_agent(gold, before=lambda query: together.wait())
    result = run_eval(make_run(gold, evaluator, tmp_path / "run", limit=8, concurrency=4), agent=agent, progress=False)
    one_by_one = run_eval(make_run(gold, evaluator, tmp_path / "one", limit=8), agent=gold_agent(gold), progress=False)
    records = RunFolder(tmp_path / "run").records()
    assert [r.query_id for r in records] == [str(i) for i in range(1, 9)]  # finished in any order, kept by index
    assert [r.success for r in records] == [r.success for r in RunFolder(tmp_path / "one").records()]
    assert result["metrics"] == one_by_one["metrics"] and result["trajectory"]["trajectories"] == 8
    assert len(RunFolder(tmp_path / "run").trajectories()) == 8


def test_an_interrupted_concurrent_run_resumes_to_the_same_result(gold, evaluator, tmp_path):
    import threading

    started: list[str] = []
    lock = threading.Lock()

    def count(query):
        with lock:
            started.append(query.id)

    run = make_run(gold, evaluator, tmp_path / "run", limit=8, concurrency=3)
    assert run_eval(run, agent=gold_agent(gold, before=count), progress=False, stop_after=2) == {}
    kept = RunFolder(tmp_path / "run").records()
    assert len(kept) == 2
    # no episode goes on in the background once the run has returned
    assert not [t for t in threading.enumerate() if t.name.startswith("eval-episode")]
    result = run_eval(run, agent=gold_agent(gold, before=count), progress=False)
    one_go = run_eval(make_run(gold, evaluator, tmp_path / "one", limit=8), agent=gold_agent(gold), progress=False)
    assert result["metrics"] == one_go["metrics"]
    assert sorted(set(started)) == sorted(str(i) for i in range(1, 9))  # the resumed run skipped the 2 kept


def test_a_failed_episode_ends_a_concurrent_run_at_once_with_its_error(gold, evaluator, tmp_path):
    import threading
    import time

    release = threading.Event()

    def fail_first_hold_the_rest(query):
        if query.id == "1":
            raise RuntimeError("engine lost")
        release.wait(timeout=60)  # episodes still under way when the first one fails

    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="engine lost"):
            run_eval(
                make_run(gold, evaluator, tmp_path / "run", limit=8, concurrency=4),
                agent=gold_agent(gold, before=fail_first_hold_the_rest),
                progress=False,
            )
        assert time.monotonic() - t0 < 20  # reported now, not after the held episodes
    finally:
        release.set()
    assert all(r.query_id != "1" for r in RunFolder(tmp_path / "run").records())


def test_predictions_pair_by_id_or_order(gold, tmp_path):
    queries = load_split(gold.split_path, limit=3)
    path = tmp_path / "p.jsonl"
    path.write_text('{"plan": null}\n{"query_id": "3", "plan": []}\n', encoding="utf-8")
    preds = read_predictions(path, queries)
    assert preds["1"].plan is None and preds["3"].plan == [] and "2" not in preds
    path.write_text('{"plan": null}\n{"query_id": "3", "plan": []}\n{"plan": "Day 1:"}\n', encoding="utf-8")
    with pytest.raises(SubmissionError, match="line 3 gives a second plan for query '3'"):
        read_predictions(path, queries)


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"plan": 5}\n', "'plan' must be a list"),
        ("[1, 2]", "line 1 is not a JSON object"),
        ('{"plan": null}\n{oops\n', "p.jsonl:2: not a JSON line"),
    ],
)
def test_bad_predictions_say_where(gold, tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SubmissionError, match=message):
        read_predictions(path, load_split(gold.split_path, limit=3))


def test_split_without_structured_fields_is_refused(travelplanner_dir):
    with pytest.raises(SubmissionError, match="not a TravelPlanner query"):
        load_split(travelplanner_dir / "validation_queries_example_submission.jsonl")


class PinnedParser(ServiceFormatter):
    """A formatter plug-in (module:factory) whose config names a model, as an LLM formatter's would."""

    def __init__(self, model: str = "formatter-a") -> None:
        super().__init__("structured")
        self.config = {"kind": "llm", "model": model, "prompt_sha256": "0" * 64}


def make_formatter_b() -> PinnedParser:
    return PinnedParser("formatter-b")


def test_formatter_plugin_is_pinned(gold, evaluator, mutated_submission, tmp_path):
    from services.evaluation.formatting import FormatterUnavailable, load_formatter

    assert load_formatter("parser").config["kind"] == "structured-parser"
    plugin = load_formatter("tests.evaluation.test_runner:make_formatter_b")
    assert plugin.config["model"] == "formatter-b"
    with pytest.raises(FormatterUnavailable, match="did not return a formatter"):
        load_formatter("json:JSONDecoder")
    with pytest.raises(FormatterUnavailable, match="failed to start"):
        load_formatter("json:dumps")
    out = tmp_path / "run"
    run = make_run(gold, evaluator, out, limit=2)
    run.formatter = PinnedParser("formatter-a")
    run_eval(run, predictions_path=mutated_submission, progress=False)
    assert RunFolder(out).manifest()["scoring"]["formatter"]["model"] == "formatter-a"
    run.formatter = plugin
    with pytest.raises(RunMismatch, match="formatter"):
        run_eval(run, predictions_path=mutated_submission, progress=False)


def test_llm_formatter_over_an_openai_compatible_server(gold, evaluator, tmp_path):
    """Prose answers formatted by the formatter service's LLM backend, against a real HTTP server
    speaking the OpenAI chat API (the hosted model is the only stand-in)."""
    from services.common.settings import Settings
    from tests.support.fake_openai import FakeOpenAI

    n = 3
    path = tmp_path / "prose.jsonl"
    path.write_text(
        "".join(
            json.dumps({"idx": i + 1, "plan_text": f"On day one we fly out ... (trip {i + 1})"}) + "\n"
            for i in range(n)
        ),
        encoding="utf-8",
    )
    with FakeOpenAI(api_key="sk-test") as server:
        for i in range(n):
            server.push(json.dumps([d for d in gold.plan(i) if d]))
        settings = Settings(
            formatter_llm_url=server.base_url,
            formatter_llm_model="fake-model",
            formatter_llm_api_key="sk-test",
            formatter_max_attempts=1,
        )
        formatter = ServiceFormatter("llm", settings=settings)
        run = make_run(gold, evaluator, tmp_path / "run", limit=n)
        run.formatter = formatter
        result = run_eval(run, predictions_path=path, progress=False)
        formatter.close()
        assert len(server.requests) == n
    assert result["metrics"]["final_pass_rate"] == 100.0
    config = RunFolder(tmp_path / "run").manifest()["scoring"]["formatter"]
    assert config["kind"] == "formatter-llm" and config["llm_model"] == "fake-model"
    assert len(config["prompt_sha256"]) == 64 and config["prompt_version"]


def test_part_of_the_train_split_is_not_official(gold):
    """A train.json missing a query (as the fixture's subset is) gets computed denominators."""
    from services.evaluation.runner import official_split_of

    assert official_split_of(gold.split_path, list(gold.queries)[:-1], "official", limited=False) is None


def test_official_denominators_only_for_the_official_split(gold, tmp_path, full_travelplanner_dir):
    """The whole train split, by name, size and constraints (full data only)."""
    from services.evaluation.runner import official_split_of

    queries = list(gold.queries)
    assert official_split_of(gold.split_path, queries, "official", limited=False) == "train"
    assert official_split_of(gold.split_path, queries, "strict", limited=False) is None
    assert official_split_of(gold.split_path, queries, "official", limited=True) is None
    assert official_split_of(tmp_path / "mine.json", queries, "official", limited=False) is None
    # a synthetic set of the same size and name but other constraints: the official 105 would be wrong
    easy = queries[0]
    changed = [
        easy.model_copy(
            update={"local_constraint": easy.local_constraint.model_copy(update={"room_type": "private room"})}
        ),
        *queries[1:],
    ]
    assert official_split_of(gold.split_path, changed, "official", limited=False) is None
