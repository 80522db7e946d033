"""Agents for `star eval --model`: the rollout service's ReAct loop behind a plain function
`TravelQuery → Trajectory`, so the eval runner does not depend on how rollouts are made."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import threading
from collections.abc import Callable
from typing import Any

from services.common.schemas import SamplingParams, Trajectory, TravelQuery


class AgentUnavailable(RuntimeError):
    pass


def rollout_agent(
    model: str,
    sampling: SamplingParams,
    *,
    engine: str = "vllm",
    sandbox_url: str | None = None,
    world_url: str | None = None,
    base_url: str | None = None,
    run_id: str = "eval",
    engine_options: dict[str, Any] | None = None,
) -> tuple[Callable[[TravelQuery], Trajectory], Callable[[], None]]:
    """(agent, close). `model` is an HF folder, or `openai:NAME` for an OpenAI-compatible server
    at `base_url`. Tools come from the sandbox at `sandbox_url`, else in-process from the world."""
    try:
        from services.rollout.agent import Agent
        from services.rollout.engines import build_engine
        from services.rollout.tools import HttpToolClient, LocalToolClient
    except ImportError as exc:
        raise AgentUnavailable(
            f"the rollout service's agent is not available ({exc}); score existing plans with --predictions FILE"
        ) from None
    options = dict(engine_options or {})
    if model.startswith("openai:"):
        engine, model = "openai", model.split(":", 1)[1]
        if base_url:
            options["base_url"] = base_url
    else:
        options.setdefault("max_model_len", sampling.engine_max_len)
    try:
        policy = build_engine(engine, model, **options)
    except (ValueError, OSError, ImportError) as exc:
        raise AgentUnavailable(f"cannot start the {engine} engine: {exc}") from None
    if sandbox_url:
        tools = HttpToolClient(sandbox_url)
    else:
        from services.common.settings import get_settings
        from services.sandbox.tools.toolbox import ToolBox
        from services.sandbox.world import World

        tools = LocalToolClient(ToolBox(World(world_url or get_settings().world_url)))
    return agent_function(
        Agent(policy, tools), sampling, run_id=run_id, closers=[tools.close, getattr(policy, "close", None)]
    )


def agent_function(
    agent: Any, sampling: SamplingParams, *, run_id: str = "eval", closers: list[Any] | None = None
) -> tuple[Callable[[TravelQuery], Trajectory], Callable[[], None]]:
    """A rollout `Agent` (async) as the runner's plain function, and its `close`. Every call runs
    on one event loop in a thread of its own, so the function may be called from several threads
    at once: N callers keep N episodes in flight on one engine, which batches their turns."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"{run_id}-agents", daemon=True)
    thread.start()

    in_flight: set[concurrent.futures.Future] = set()

    def on_loop(coroutine: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        in_flight.add(future)
        try:
            return future.result()
        finally:
            in_flight.discard(future)

    def run(query: TravelQuery) -> Trajectory:
        qid = query.id or "query"
        return on_loop(agent.run(query, sampling, run_id=run_id, task_id=qid, prompt_id=qid, eval_mode="official"))

    def close() -> None:
        # episodes still under way (an interrupted or failed eval) are cancelled, so their callers return
        for future in list(in_flight):
            future.cancel()
        try:
            for closer in closers or []:
                if closer is None:
                    continue
                result = closer()
                if asyncio.iscoroutine(result):
                    on_loop(result)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    return run, close


def fleet_agent(
    sampling: SamplingParams,
    rollout_urls: list[str],
    api_token: str | None = None,
    run_id: str = "eval",
    timeout_s: float = 3600.0,
) -> Callable[[TravelQuery], Trajectory]:
    """Each episode on a deployed fleet's rollout servers (POST /rollouts, in turn): on their engines and the
    weights they hold, where the fleet's accelerators are, not on this machine."""
    import itertools

    import httpx

    if not rollout_urls:
        raise AgentUnavailable("no rollout server to run the episodes on (STAR_ROLLOUT_URLS)")
    turn = itertools.cycle([u.rstrip("/") for u in rollout_urls])
    lock = threading.Lock()
    headers = {"authorization": f"Bearer {api_token}"} if api_token else {}

    def agent(query: TravelQuery) -> Trajectory:
        with lock:
            url = next(turn)
        body = {
            "query": query.model_dump(mode="json"),
            "group_size": 1,
            "sampling": sampling.model_dump(mode="json"),
            "run_id": run_id,
        }
        r = httpx.post(f"{url}/rollouts", json=body, headers=headers, timeout=timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"the rollout server at {url} answered {r.status_code}: {r.text[:500]}")
        return Trajectory.model_validate(r.json()["trajectories"][0])

    return agent


def load_agent(spec: str) -> Callable[[TravelQuery], Trajectory]:
    """`package.module:function`: a function TravelQuery → Trajectory (or a factory of one when
    it is named `make_*`)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise AgentUnavailable(f"agent {spec!r} must look like package.module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise AgentUnavailable(f"cannot load agent {spec!r}: {exc}") from None
    return fn() if name.startswith("make_") else fn
