"""The search agent: the rollout service's agent loop with `Search` as its only tool and the
search-agent prompt, as the function `star qa eval` calls per question."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from services.common.schemas import SamplingParams, ToolResult
from services.qa.datasets import QAItem
from services.qa.prompt import search_system_prompt
from services.qa.tools import SearchToolSet


class SearchToolClient:
    """`SearchToolSet` in this process, behind the rollout's async ToolClient interface."""

    def __init__(self, tools: SearchToolSet) -> None:
        self.tools = tools

    async def call(self, name: str, arguments: dict[str, Any], *, fault_key: str | None = None) -> ToolResult:
        return self.tools.call(name, arguments)

    async def reachable(self) -> bool:
        return True  # in this process

    async def close(self) -> None:
        return None


def qa_agent(
    engine: Any, tool_client: Any, sampling: SamplingParams, *, run_id: str = "qa"
) -> tuple[Callable[[QAItem, Any], str | None], Callable[[], None]]:
    """(answer function, close). The function runs one episode per question and returns the
    agent's answer text (None when it never answered)."""
    from services.rollout.agent import Agent

    agent = Agent(engine, tool_client, system=search_system_prompt(), tool_names_=["Search"])
    loop = asyncio.new_event_loop()

    def answer(item: QAItem, _tools: Any = None) -> str | None:
        trajectory = loop.run_until_complete(
            agent.run(f"Question: {item.question}", sampling, run_id=run_id, task_id=f"{item.dataset}/{item.id}")
        )
        return trajectory.answer if trajectory.finish_reason == "answer" else None

    def close() -> None:
        try:
            loop.run_until_complete(tool_client.close())
            closer = getattr(engine, "close", None)
            if closer is not None and asyncio.iscoroutine(result := closer()):
                loop.run_until_complete(result)
        finally:
            loop.close()

    return answer, close


def rollout_qa_agent(
    model: str,
    sampling: SamplingParams,
    *,
    engine: str = "vllm",
    search_url: str | None = None,
    tools: SearchToolSet | None = None,
    base_url: str | None = None,
) -> tuple[Callable[[QAItem, Any], str | None], Callable[[], None]]:
    from services.rollout.engines import build_engine
    from services.rollout.tools import HttpToolClient

    options: dict[str, Any] = {}
    if model.startswith("openai:"):
        engine, model = "openai", model.split(":", 1)[1]
        if base_url:
            options["base_url"] = base_url
    policy = build_engine(engine, model, **options)
    if search_url:
        client: Any = HttpToolClient(search_url)
    elif tools is not None:
        client = SearchToolClient(tools)
    else:
        raise ValueError("the search agent needs --search-url or a local --index")
    return qa_agent(policy, client, sampling)
