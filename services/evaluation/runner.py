"""`star eval`: run (or take) a plan for every query of a split, format, score, write the run.

Plans come from an agent (query → `Trajectory`; the rollout service provides it) or from a
predictions file (official submission lines with day dicts, or plan texts). Either way each
query is formatted, scored by the reward evaluator, and appended to the run folder as soon as
it is done, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.files import sha256_file as file_sha256
from services.common.schemas import SamplingParams, Trajectory, TravelQuery
from services.evaluation import analysis, trajectories as traj_diag
from services.evaluation.formatting import PlanFormatter
from services.evaluation.records import QueryRecord, TrajectorySummary, append_jsonl, split_metrics
from services.evaluation.runfolder import RunFolder, evaluator_code_sha256
from services.reward.evaluator import Evaluator, PlanError, hard as hard_checks
from services.reward.evaluator.aggregate import OFFICIAL_DENOMINATORS, Mode, Split, hard_denominator, not_delivered
from services.reward.submission import (
    Prediction,
    SplitQuery,
    load_split,
    read_predictions,
    write_submission,
)

Agent = Callable[[TravelQuery], Trajectory]

# The paper's inference sampling for evaluation (agent-star.md; issue 7): T 0.6, top-p 0.95,
# 32K context, 60 tool calls.
EVAL_SAMPLING = SamplingParams(temperature=0.6, top_p=0.95, max_context_tokens=32_768, max_tool_calls=60)
# Episodes in flight when a model is evaluated: vLLM and the transformers engine batch their turns, so one
# at a time left the engine decoding a single row (bench/gpu_proof.py decodes 48-128 at once).
MODEL_CONCURRENCY = 16


class EvalError(ValueError):
    pass


def official_split_of(path: Path, queries: list[TravelQuery], mode: Mode, limited: bool) -> Split | None:
    """The official split a file is, for its hard-coded denominators: official mode, the whole
    file, its name in the path (eval.py's own test), the split's size, and the split's hard
    constraint count. The last guards synthetic sets saved as `validation.jsonl`: the official
    denominators are wrong for them (agent-star.md §6.1)."""
    if mode != "official" or limited:
        return None
    for name, (size, _, hard_total) in OFFICIAL_DENOMINATORS.items():
        if name in str(path).lower() and len(queries) == size and hard_denominator(queries) == hard_total:
            return name  # type: ignore[return-value]
    return None


def world_identity(world) -> dict[str, Any] | None:
    """What the world is made of, not when it was built: a rebuild from the same sources and seed
    keeps the hash; other sources, seed, scale or row counts change it."""
    if world is None:
        return None
    meta = {k: v for k, v in world.meta().items() if k not in ("built_at", "seconds")}
    return {**meta, "counts": world.counts()}


@dataclass
class EvalRun:
    split_path: Path
    out: Path
    evaluator: Evaluator
    formatter: PlanFormatter
    source: dict[str, Any]  # what produced the plans (model or predictions file)
    limit: int | None = None
    official_split: Split | None | str = "auto"
    sampling: SamplingParams = field(default_factory=lambda: EVAL_SAMPLING)
    concurrency: int = 1  # episodes in flight at once (an agent's calls from that many threads)

    def scoring(self, queries: list[SplitQuery]) -> dict[str, Any]:
        world = self.evaluator.index.world
        return {
            "evaluator": {
                "mode": self.evaluator.mode,
                "parties_typo": self.evaluator.parties_typo,
                "code_sha256": evaluator_code_sha256(),
            },
            "formatter": self.formatter.config,
            "split": {"sha256": file_sha256(self.split_path), "queries": len(queries), "limit": self.limit},
            "world": world_identity(world),
            "source": self.source,
        }

    def split_name(self, queries: list[SplitQuery]) -> Split | None:
        if self.official_split != "auto":
            return self.official_split  # type: ignore[return-value]
        return official_split_of(
            self.split_path, [q.query for q in queries], self.evaluator.mode, self.limit is not None
        )


def score_query(
    evaluator: Evaluator,
    sq: SplitQuery,
    plan: list[dict[str, Any]] | None,
    status: str,
    plan_text: str | None,
    trajectory: Trajectory | None,
) -> QueryRecord:
    try:
        evaluation = evaluator.evaluate(sq.query, plan, formatter_status=status)
    except PlanError as exc:  # not a plan at all: delivered, fails everywhere (evaluate_many does the same)
        applicable = hard_checks.applicable(_QueryOnly(sq.query))
        evaluation = not_delivered(
            evaluator.mode, applicable, f"invalid plan: {exc}", delivered=True, formatter_status=status
        )
    reward = getattr(trajectory, "reward", None)
    return QueryRecord(
        index=sq.index,
        query_id=sq.query_id,
        query=sq.query,
        plan=plan,
        plan_text=plan_text,
        delivered=evaluation.delivered,
        score=evaluation.to_score(),
        cost=evaluation.cost,
        trajectory=TrajectorySummary.of(trajectory, reward) if trajectory is not None else None,
    )


class _QueryOnly:
    def __init__(self, query: TravelQuery) -> None:
        self.query = query


def plan_of(
    formatter: PlanFormatter, query: TravelQuery, prediction: Prediction | None
) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    """(day dicts, formatter status, plan text) of one prediction."""
    if prediction is None:
        return None, "no_answer", None
    if prediction.plan is not None or prediction.plan_text is None:
        return prediction.plan, "ok", None
    plan, status = formatter.format(query, prediction.plan_text)
    return plan, status, prediction.plan_text


def run_eval(
    run: EvalRun,
    *,
    agent: Agent | None = None,
    predictions_path: Path | None = None,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Evaluate every unfinished query, then write the whole run folder. `stop_after` ends the
    loop after that many new queries (for tests of resumption) without finalising."""
    from tqdm import tqdm

    if (agent is None) == (predictions_path is None):
        raise EvalError("give either an agent or a predictions file")
    queries = load_split(run.split_path, run.limit)
    folder = RunFolder(run.out)
    finished = folder.open(
        run.scoring(queries), extra={"split_path": str(run.split_path), "sampling": run.sampling.model_dump()}
    )
    done = {r.query_id for r in finished}
    predictions = read_predictions(predictions_path, queries) if predictions_path is not None else {}
    todo = [q for q in queries if q.query_id not in done]
    pairs = episodes(agent, todo, run.concurrency) if agent is not None else ((sq, None) for sq in todo)
    bar = tqdm(pairs, total=len(todo), desc="eval", unit="query", disable=not progress)
    try:
        for count, (sq, trajectory) in enumerate(bar, 1):
            if agent is not None:
                text = trajectory.answer if trajectory.finish_reason == "answer" else None
                plan, status = run.formatter.format(sq.query, text) if text else (None, "no_answer")
                plan_text = text
                append_jsonl(
                    folder.trajectories_path,
                    [{"query_id": sq.query_id, "trajectory": trajectory.model_dump(mode="json")}],
                )
            else:
                plan, status, plan_text = plan_of(run.formatter, sq.query, predictions.get(sq.query_id))
            append_jsonl(folder.scores_path, [score_query(run.evaluator, sq, plan, status, plan_text, trajectory)])
            if stop_after is not None and count >= stop_after:
                return {}
    finally:
        bar.close()
        pairs.close()  # a stopped or failed run leaves no episode threads behind
    return finalize(
        folder,
        run.evaluator.mode,
        run.split_name(queries),
        expected=len(queries),
        city_state=run.evaluator.index.city_state,
    )


def episodes(agent: Agent, queries: list[SplitQuery], concurrency: int = 1) -> Iterator[tuple[SplitQuery, Trajectory]]:
    """Each query with its trajectory, as episodes finish (in order when `concurrency` is 1). The
    run folder sorts records by index, and each one is written as it comes, so an interrupted run
    resumes with whatever finished. A failed episode ends the run at once, as it does one at a time."""
    if concurrency <= 1:
        for sq in queries:
            yield sq, agent(sq.query)
        return
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eval-episode")
    failed = False
    try:
        futures = {pool.submit(agent, sq.query): sq for sq in queries}
        for future in as_completed(futures):
            yield futures[future], future.result()
    except GeneratorExit:
        raise  # the caller stopped early: let the episodes under way finish below
    except BaseException:
        failed = True  # an episode's error or Ctrl-C: report it now, not after the episodes under way
        raise
    finally:
        # episodes not yet started are dropped; the agent's `close` cancels those under way when it can
        pool.shutdown(wait=not failed, cancel_futures=True)


def analyse(
    folder: RunFolder, mode: Mode, split: Split | None, city_state: dict[str, str] | None = None
) -> dict[str, Any]:
    records = folder.records()
    metrics = split_metrics(records, mode, split)
    trajectories = folder.trajectories()
    selection, ends = [], []
    for r in records:
        t = trajectories.get(r.query_id)
        if t is None:
            continue
        calls = traj_diag.tool_calls(t.get("messages", []))
        selection.append(traj_diag.tool_selection(r.query, calls, city_state))
        ends.append((r.success, r.query_id, traj_diag.dead_ends(r.query, calls, r.plan)))
    total_calls = sum(s["calls"] for s in selection)
    return {
        "metrics": metrics.model_dump(),
        "constraints": analysis.constraint_table(records),
        "failures": analysis.failure_table(records),
        "failure_examples": analysis.failure_examples(records),
        "cohorts": analysis.cohort_table(records, mode),
        "trajectory": analysis.trajectory_stats(records),
        "tool_selection": {
            "calls": total_calls,
            "well_formed_rate": 100.0 * sum(s["well_formed"] for s in selection) / total_calls if total_calls else None,
            "accuracy": 100.0 * sum(s["needed"] for s in selection) / total_calls if total_calls else None,
        },
        "backtracking": traj_diag.backtracking_summary([(ok, d) for ok, _, d in ends]),
        "dead_ends": {qid: traj_diag.dead_end_dicts(d) for _, qid, d in ends if d},
        "group_reward_variance": analysis.group_reward_variance(records),
        "per_query_failures": {r.query_id: analysis.failure_categories(r) for r in records if not r.success},
    }


def finalize(
    folder: RunFolder,
    mode: Mode,
    split: Split | None,
    expected: int | None = None,
    city_state: dict[str, str] | None = None,
) -> dict[str, Any]:
    from services.evaluation.report import write_plots, write_report

    records = folder.records()
    if expected is not None and len(records) != expected:
        raise EvalError(f"{folder.path}: {len(records)} of {expected} queries are scored; run again to finish")
    result = analyse(folder, mode, split, city_state)
    write_submission(folder.predictions_path, records)
    folder.metrics_path.write_text(json.dumps(result, indent=2), encoding="utf-8")
    plots = write_plots(folder.plots_dir, result)
    write_report(folder.report_path, result, folder.manifest() or {}, plots)
    return result
