"""The eval runner driving the rollout service's real agent loop against the sandbox over HTTP.

The policy is the rollout's scripted engine (real tokenizer, real token-in/token-out loop): per
query it searches once and then answers with the gold plan in the structured form, except one
query where it only rambles (format errors). What is under test is the wiring: trajectories
from the agent, the sandbox's real answers, the formatter, the scores and the run folder.
"""

from __future__ import annotations

import pytest

from services.common.schemas import Plan, PlanDay, SamplingParams
from services.controller.launcher import ServiceProcess
from services.evaluation import agents
from services.evaluation.agents import agent_function
from services.evaluation.formatting import StructuredParser
from services.evaluation.runfolder import RunFolder
from services.evaluation.runner import EvalRun, run_eval
from services.formatter.structured import render_plan

N = 4
RAMBLER = 2  # 0-based query index whose policy never calls a tool nor answers


@pytest.fixture(scope="module")
def sandbox(official_world_url, tmp_path_factory):
    env = {"STAR_DB_URL": official_world_url, "STAR_LOG_LEVEL": "WARNING"}
    proc = ServiceProcess("sandbox", "services.sandbox.app:create_app", env, tmp_path_factory.mktemp("logs")).start()
    yield proc
    proc.stop()


def scripted_policy(gold, tokenizer):
    from services.rollout.engines.scripted import ScriptedEngine
    from services.rollout.protocol import format_answer, format_tool_call

    def script(prompt_ids, turn):
        prompt = tokenizer.decode(prompt_ids)
        i = next(k for k in range(N) if gold.queries[k].query.strip() in prompt)
        if i == RAMBLER:
            return "I am not sure what to do."
        if turn == 0:
            return format_tool_call("SearchAccommodation", {"city": gold.queries[i].dest}, think="where to stay")
        days = [PlanDay(**d) for d in gold.plan(i) if d]
        return format_answer(render_plan(Plan(days=days)), think="done")

    return ScriptedEngine(tokenizer, script)


@pytest.mark.parametrize("concurrency", [1, N])  # N: every episode on the agent's one loop at once
def test_eval_through_the_agent_loop_and_sandbox_http(gold, evaluator, sandbox, tmp_path, concurrency):
    from services.models import qwen_tokenizer
    from services.rollout.agent import Agent
    from services.rollout.tools import HttpToolClient

    tokenizer = qwen_tokenizer()
    tools = HttpToolClient(sandbox.url)
    sampling = SamplingParams(temperature=0.6, top_p=0.95, max_context_tokens=32_768, max_tool_calls=60)
    run_fn, close = agent_function(Agent(scripted_policy(gold, tokenizer), tools), sampling, closers=[tools.close])
    try:
        run = EvalRun(
            split_path=gold.split_path,
            out=tmp_path / "run",
            evaluator=evaluator,
            formatter=StructuredParser(),
            source={"kind": "test-scripted"},
            limit=N,
            concurrency=concurrency,
        )
        result = run_eval(run, agent=run_fn, progress=False)
    finally:
        close()
    records = RunFolder(tmp_path / "run").records()
    assert [r.success for r in records] == [i != RAMBLER for i in range(N)]
    assert records[RAMBLER].trajectory.finish_reason == "format_error" and not records[RAMBLER].delivered
    assert all(r.trajectory.tool_calls == 1 for i, r in enumerate(records) if i != RAMBLER)
    assert result["metrics"]["final_pass_rate"] == pytest.approx(75.0)
    assert result["failures"] == [{"category": "format error (agent)", "queries": 1, "share_of_failures": 100.0}]
    trajectories = RunFolder(tmp_path / "run").trajectories()
    first = trajectories["1"]["messages"]
    # the sandbox's real reply came back over HTTP, wrapped as the protocol says
    assert first[3]["role"] == "user" and first[3]["content"].startswith("<tool_response>\nA SearchAccommodation for")
    assert result["tool_selection"]["calls"] == 3 and result["tool_selection"]["accuracy"] is not None
    assert result["trajectory"]["tokens_mean"] > 1000  # real template tokens, system prompt included


def test_closing_the_agent_cancels_the_episodes_still_under_way(gold):
    import asyncio
    import concurrent.futures
    import threading
    import time

    class SlowAgent:  # an episode that would outlive an interrupted eval
        async def run(self, query, sampling, **ids):
            await asyncio.sleep(60)

    run_fn, close = agent_function(SlowAgent(), SamplingParams())
    outcome: list[BaseException] = []

    def caller():
        try:
            run_fn(gold.queries[0])
        except BaseException as exc:  # noqa: BLE001 - what the caller saw is the point
            outcome.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    close()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - t0 < 10
    assert len(outcome) == 1 and isinstance(outcome[0], concurrent.futures.CancelledError)


class _Built(Exception):
    pass


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_the_engine_is_sized_from_the_episodes_context(monkeypatch, engine):
    seen = {}

    def build(kind, model, **options):
        seen.update(kind=kind, **options)
        raise _Built

    from services.rollout import engines

    monkeypatch.setattr(engines, "build_engine", build)
    with pytest.raises(_Built):
        agents.rollout_agent("/m", SamplingParams(max_context_tokens=6144), engine=engine)
    # a model whose max_position_embeddings is 8192 must not be asked for an engine default of 32K
    assert seen == {"kind": engine, "max_model_len": 6144 + 512}
    with pytest.raises(_Built):
        agents.rollout_agent(
            "/m", SamplingParams(max_context_tokens=6144), engine=engine, engine_options={"max_model_len": 4096}
        )
    assert seen["max_model_len"] == 4096
