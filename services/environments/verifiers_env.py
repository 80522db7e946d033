"""TravelPlanner as a verifiers environment (prime-rl's environment format), over the episode API.

    import verifiers as vf
    env = vf.load_environment("services.environments.verifiers_env", base_url="http://127.0.0.1:8007",
                              split="validation", query_ids=["1", "2"])
    results = env.evaluate_sync(client=AsyncOpenAI(base_url=...), model="my-model")

`load_environment()` returns a `vf.StatefulToolEnv`: each rollout starts an episode for its row's query, every
tool call the model makes runs inside that episode (the six tools, their schemas as the episode API gives them),
and the rollout's last assistant message is the episode's answer: a JSON plan (the benchmark's day list) or
plan text, which the episode API formats. The rubric's reward is the episode's finish reward, in the
episode's mode and reward kind; both modes' success are recorded as metrics beside it.

This module needs `verifiers` (the `verifiers` extra); nothing else in `services` imports it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from typing import Any

import verifiers as vf
from datasets import Dataset

from services.common.schemas import EpisodeResult, EpisodeStarted
from services.episodes.client import AsyncEpisodeClient, EpisodeClient, EpisodeError

DEFAULT_URL = "http://127.0.0.1:8007"
EPISODE_KEY = "episode_id"  # the argument the environment adds to every tool call (hidden from the model)


def finish_arguments(text: str | None) -> dict[str, Any]:
    """What a final message finishes an episode with: a JSON plan when it parses as one, plan text otherwise."""
    body = (text or "").strip()
    if body.startswith("```"):
        body = body.strip("`").removeprefix("json").strip()
    try:
        value = json.loads(body)
    except ValueError:
        return {"answer": text or ""}
    if isinstance(value, list) or (isinstance(value, dict) and isinstance(value.get("days"), list)):
        return {"plan": value}
    return {"answer": text or ""}


def tool_defs(started: EpisodeStarted) -> list[vf.Tool]:
    """The episode's OpenAI function tools in verifiers' provider-neutral form."""
    return [
        vf.Tool(
            name=t["function"]["name"],
            description=t["function"].get("description", ""),
            parameters=t["function"].get("parameters", {"type": "object", "properties": {}}),
        )
        for t in started.tools
    ]


def prompt_of(started: EpisodeStarted) -> list[dict[str, str]]:
    return [{"role": "system", "content": started.system_prompt}, {"role": "user", "content": started.task}]


def _last_assistant_text(messages: Sequence[Any]) -> str:
    for message in reversed(list(messages or [])):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        if role == "assistant":
            content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
            return content if isinstance(content, str) else ""
    return ""


class EpisodeUnavailable(vf.InfraError):
    """The episode API would not start the rollout's episode (the reason is the service's)."""


class EpisodeGone(vf.InfraError):
    """The rollout's episode expired or was closed: the rollout stops (a stop error of the environment)."""


class TravelPlannerEnv(vf.StatefulToolEnv):
    """One episode of the episode API per rollout: started in `setup_state`, finished and closed in cleanup."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        dataset: Dataset,
        tools: list[vf.Tool],
        *,
        reward: str = "sum",
        mode: str = "strict",
        max_tool_calls: int | None = None,
        max_turns: int = 40,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            tools=[],
            eval_dataset=dataset,
            max_turns=max_turns,
            rubric=episode_rubric(),
            stop_errors=[EpisodeGone],
            **kwargs,
        )
        self.base_url = base_url
        self.token = token
        self._clients: dict[asyncio.AbstractEventLoop, AsyncEpisodeClient] = {}
        self.reward = reward
        self.mode = mode
        self.max_tool_calls = max_tool_calls
        self.tool_defs = tools
        self.tool_map = {t.name: t for t in tools}

    def episodes(self) -> AsyncEpisodeClient:
        """The episode client of the running event loop (an httpx pool serves one loop, and each of verifiers'
        `evaluate_sync` / `generate_sync` calls runs a loop of its own)."""
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            self._clients = {k: v for k, v in self._clients.items() if not k.is_closed()}
            self._clients[loop] = AsyncEpisodeClient(self.base_url, self.token)
        return self._clients[loop]

    async def setup_state(self, state: vf.State) -> vf.State:
        """Starts the row's episode; a refusal ends the rollout with verifiers' error (reward 0), not the run."""
        info = state["info"]
        try:
            started = await self._start(info)
        except EpisodeError as exc:
            raise EpisodeUnavailable(f"the episode API refused the episode: {exc}") from exc
        state[EPISODE_KEY] = started.episode_id
        state["tool_defs"] = tool_defs(started)
        return state

    async def _start(self, info: dict[str, Any]) -> EpisodeStarted:
        return await self.episodes().start(
            query_id=info.get("query_id"),
            split=info.get("split"),
            query=info.get("query"),
            reward=self.reward,
            mode=self.mode,
            max_tool_calls=self.max_tool_calls,
            tool_format="native",
            client="verifiers",
        )

    def update_tool_args(
        self, tool_name: str, tool_args: dict, messages: vf.Messages, state: vf.State, **kwargs: Any
    ) -> dict:
        return {**tool_args, EPISODE_KEY: state[EPISODE_KEY]}

    async def call_tool(self, tool_name: str, tool_args: dict, tool_call_id: str, **kwargs: Any) -> vf.ToolMessage:
        """Runs the call inside the episode; a refused call (unknown tool, bad arguments, budget spent) comes
        back to the model as the tool's message, with the service's reason."""
        episode_id = tool_args.pop(EPISODE_KEY)
        try:
            reply = await self.episodes().call_tool(episode_id, tool_name, tool_args)
            content = reply.content
        except EpisodeError as exc:
            if exc.status == 404:
                raise EpisodeGone(f"the rollout's episode is gone: {exc}") from exc
            content = f"Error: {exc.message}"
        return vf.ToolMessage(role="tool", content=content, tool_call_id=tool_call_id)

    @vf.cleanup
    async def finish_episode(self, state: vf.State) -> None:
        """Finishes the episode with the last assistant message (once; the service never scores twice), keeps
        its result in the state for the rubric, and closes it."""
        episode_id = state.get(EPISODE_KEY)
        if episode_id is None or "episode_result" in state:
            return
        answer = _last_assistant_text(state.get("completion") or [])
        try:
            result = await self.episodes().finish(episode_id, **finish_arguments(answer))
            state["episode_result"] = result.model_dump(mode="json")
            await self.episodes().close(episode_id)
        except EpisodeError as exc:  # the rollout keeps reward 0 and says why; the others go on
            state["episode_error"] = str(exc)


def _result(state: vf.State) -> EpisodeResult | None:
    raw = state.get("episode_result")
    return EpisodeResult.model_validate(raw) if raw is not None else None


async def episode_reward(state: vf.State) -> float:
    """The episode's finish reward (its reward kind, in its mode); 0 for a rollout that never finished one."""
    result = _result(state)
    return result.reward if result is not None else 0.0


async def success_official(state: vf.State) -> float:
    result = _result(state)
    return float(result.success.official) if result is not None else 0.0


async def success_strict(state: vf.State) -> float:
    result = _result(state)
    return float(result.success.strict) if result is not None else 0.0


def episode_rubric() -> vf.Rubric:
    """The reward (weight 1) and both modes' success (metrics, weight 0)."""
    return vf.Rubric(funcs=[episode_reward, success_official, success_strict], weights=[1.0, 0.0, 0.0])


def episode_rows(
    base_url: str, token: str | None, split: str | None, query_ids: Sequence[str] | None, queries: Sequence[dict] | None
) -> tuple[list[dict[str, Any]], list[vf.Tool]]:
    """The dataset's rows (each query's prompt as the episode API words it) and the tools, read by starting
    and closing one episode per query."""
    if queries is None and (split is None or not query_ids):
        raise ValueError("give split and query_ids, or queries (TravelPlanner query objects)")
    picks = (
        [{"query": q} for q in queries]
        if queries is not None
        else [{"split": split, "query_id": str(i)} for i in query_ids or ()]
    )
    rows, tools = [], []
    with EpisodeClient(base_url, token) as client:
        for pick in picks:
            started = client.start(**pick, tool_format="native", client="verifiers")
            client.close(started.episode_id)
            tools = tool_defs(started)
            # info as JSON text (verifiers reads it back): its rows need not share one Arrow schema
            rows.append({"prompt": prompt_of(started), "info": json.dumps(pick)})
    return rows, tools


def load_environment(
    base_url: str | None = None,
    token: str | None = None,
    split: str | None = "validation",
    query_ids: Sequence[str | int] | None = None,
    queries: Sequence[dict] | None = None,
    reward: str = "sum",
    mode: str = "strict",
    max_tool_calls: int | None = None,
    max_turns: int = 40,
    **kwargs: Any,
) -> TravelPlannerEnv:
    """The environment for the queries named (a split's ids, or query objects), served by the episode API at
    `base_url` (default STAR_EPISODES_URL, else 127.0.0.1:8007) with bearer `token` (default STAR_API_TOKEN).
    `reward` (sum | macro | success | curriculum) and `mode` (official | strict) pick the rubric's reward."""
    base_url = base_url or os.environ.get("STAR_EPISODES_URL") or DEFAULT_URL
    token = token or os.environ.get("STAR_API_TOKEN")
    ids = [str(i) for i in query_ids] if query_ids is not None else None
    rows, tools = episode_rows(base_url, token, split, ids, queries)
    return TravelPlannerEnv(
        base_url,
        token,
        Dataset.from_list(rows),
        tools,
        reward=reward,
        mode=mode,
        max_tool_calls=max_tool_calls,
        max_turns=max_turns,
        **kwargs,
    )
