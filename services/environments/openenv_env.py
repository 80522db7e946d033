"""TravelPlanner behind OpenEnv's environment protocol (its HTTP/WebSocket server), over the episode API.

    python -m services.environments.openenv_env --episodes-url http://127.0.0.1:8007 --split validation --port 8010

    from services.environments.openenv_env import TravelAction, TravelPlannerClient
    with TravelPlannerClient(base_url="http://127.0.0.1:8010").sync() as env:
        result = env.reset(query_id="1")                       # an episode starts: the task, prompt and tools
        result = env.step(TravelAction(tool="SearchAccommodation", arguments={"city": "Rockford"}))
        result = env.step(TravelAction(tool="finish", plan=[...]))   # done; reward = the episode's reward

`reset()` starts an episode (a split's query by id, a query given inline, or the server's next query in turn);
`step(action)` is a tool call inside it, or `finish` with a JSON plan or plan text, which ends it with the
episode's reward and every check's verdict in both modes. OpenEnv gives each client session an instance of
`TravelPlannerEnvironment`; episodes are isolated by the episode API, so sessions run concurrently.

This module needs `openenv-core` (the `openenv` extra); nothing else in `services` imports it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from services.common.schemas import EpisodeStarted
from services.episodes.client import EpisodeClient, EpisodeError

DEFAULT_URL = "http://127.0.0.1:8007"
FINISH = "finish"


class TravelAction(Action):
    """A tool call (`tool` one of the six tools, `arguments` its arguments), or `tool="finish"` with a `plan`
    (the benchmark's day list) or an `answer` (plan text, read by our formatter)."""

    tool: str = Field(min_length=1, max_length=64)
    arguments: dict[str, Any] = Field(default_factory=dict)
    plan: list[dict[str, Any]] | dict[str, Any] | None = None
    answer: str | None = Field(None, max_length=200_000)


class TravelObservation(Observation):
    """After reset: the task, the system prompt and the tools. After a tool call: its text. After finish: the
    verdicts and scores (reward and done on the observation itself). `error`: why a step was refused."""

    content: str = ""
    episode_id: str | None = None
    system_prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_calls_left: int | None = None
    error: str | None = None
    success: dict[str, bool] | None = None
    verdicts: dict[str, Any] | None = None
    scores: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None


class TravelState(State):
    query: dict[str, Any] | None = None
    tool_calls_left: int | None = None
    finished: bool = False
    reward: float | None = None


class TravelPlannerEnvironment(Environment[TravelAction, TravelObservation, TravelState]):
    """One OpenEnv session: at most one open episode at a time, closed on the next reset and on close."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(
        self,
        episodes: EpisodeClient,
        *,
        split: str | None = None,
        next_query_id: Callable[[], str] | None = None,
        reward: str = "sum",
        mode: str = "strict",
        max_tool_calls: int | None = None,
    ) -> None:
        super().__init__()
        self.episodes = episodes
        self.split = split
        self.next_query_id = next_query_id
        self.reward = reward
        self.mode = mode
        self.max_tool_calls = max_tool_calls
        self._state = TravelState()

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        query_id: str | None = None,
        split: str | None = None,
        query: dict[str, Any] | None = None,
        reward: str | None = None,
        mode: str | None = None,
        max_tool_calls: int | None = None,
        **_: Any,
    ) -> TravelObservation:
        """Starts an episode; `episode_id` and `seed` are OpenEnv's own arguments and pick nothing here. An episode
        the API will not start is an observation with `error`, done (OpenEnv's HTTP routes would make an
        exception a 500)."""
        self._close_episode()
        if query is None and query_id is None:
            if self.next_query_id is None:
                return TravelObservation(
                    done=True, error="reset needs query_id (with split) or query: this server has no query list"
                )
            query_id = self.next_query_id()
        try:
            started = self._start(query_id, split, query, reward, mode, max_tool_calls)
        except EpisodeError as exc:
            return TravelObservation(done=True, error=str(exc))
        self._state = TravelState(
            episode_id=started.episode_id,
            query=started.query.model_dump(mode="json"),
            tool_calls_left=started.limits.max_tool_calls,
        )
        return TravelObservation(
            content=started.task,
            episode_id=started.episode_id,
            system_prompt=started.system_prompt,
            tools=started.tools,
            tool_calls_left=started.limits.max_tool_calls,
        )

    def _start(
        self,
        query_id: str | None,
        split: str | None,
        query: dict[str, Any] | None,
        reward: str | None,
        mode: str | None,
        max_tool_calls: int | None,
    ) -> EpisodeStarted:
        return self.episodes.start(
            query_id=None if query is not None else str(query_id),
            split=None if query is not None else (split or self.split),
            query=query,
            reward=reward or self.reward,
            mode=mode or self.mode,
            max_tool_calls=max_tool_calls or self.max_tool_calls,
            tool_format="native",
            client="openenv",
        )

    def step(self, action: TravelAction, timeout_s: float | None = None, **_: Any) -> TravelObservation:
        episode_id = self._state.episode_id
        if episode_id is None or self._state.finished:
            return TravelObservation(
                done=self._state.finished, error="no open episode: call reset first", episode_id=episode_id
            )
        self._state.step_count += 1
        if action.tool == FINISH:
            return self._finish(episode_id, action)
        try:
            reply = self.episodes.call_tool(episode_id, action.tool, action.arguments)
        except EpisodeError as exc:
            return self._refused(episode_id, exc)
        self._state.tool_calls_left = reply.tool_calls_left
        return TravelObservation(content=reply.content, episode_id=episode_id, tool_calls_left=reply.tool_calls_left)

    def _finish(self, episode_id: str, action: TravelAction) -> TravelObservation:
        try:
            result = self.episodes.finish(episode_id, plan=action.plan, answer=action.answer)
        except EpisodeError as exc:
            return self._refused(episode_id, exc)
        self._state.finished = True
        self._state.reward = result.reward
        return TravelObservation(
            done=True,
            reward=result.reward,
            episode_id=episode_id,
            success=result.success.model_dump(),
            scores=_dump(result.scores),
            verdicts=_dump(result.verdicts),
            plan=result.plan.model_dump(mode="json") if result.plan is not None else None,
        )

    def _refused(self, episode_id: str, exc: EpisodeError) -> TravelObservation:
        """A step the episode API refused, as an observation whose `error` says why: done when the episode is
        gone or finished (404, 409); otherwise it stays open (a bad call, a spent budget: finish; a 503: the same
        step again later)."""
        gone = exc.status in (404, 409)
        self._state.finished = self._state.finished or gone
        return TravelObservation(
            done=gone, error=str(exc), episode_id=episode_id, tool_calls_left=self._state.tool_calls_left
        )

    @property
    def state(self) -> TravelState:
        return self._state

    def close(self) -> None:
        self._close_episode()
        self.episodes.close_client()

    def _close_episode(self) -> None:
        if self._state.episode_id is None:
            return
        try:
            self.episodes.close(self._state.episode_id)
        except EpisodeError:
            pass  # gone already, or the service is away: the episode expires on its own
        self._state = TravelState()


def _dump(by_mode: dict[str, Any]) -> dict[str, Any]:
    return {mode: value.model_dump(mode="json") for mode, value in by_mode.items()}


class TravelPlannerClient(EnvClient[TravelAction, TravelObservation, TravelState]):
    """OpenEnv's client for this environment (WebSocket session to the server's /ws)."""

    def _step_payload(self, action: TravelAction) -> dict[str, Any]:
        return action.model_dump(exclude_none=True, exclude={"metadata"})

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[TravelObservation]:
        observation = TravelObservation(
            **payload.get("observation", {}), reward=payload.get("reward"), done=payload.get("done", False)
        )
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> TravelState:
        return TravelState(**payload)


def query_cycle(query_ids: Sequence[str]) -> Callable[[], str]:
    """The ids in turn, shared by every session of one server (thread-safe)."""
    ids, lock = itertools.cycle([str(i) for i in query_ids]), threading.Lock()

    def next_id() -> str:
        with lock:
            return next(ids)

    return next_id


def create_travelplanner_app(
    episodes_url: str | None = None,
    token: str | None = None,
    *,
    split: str | None = "validation",
    query_ids: Sequence[str] | None = None,
    reward: str = "sum",
    mode: str = "strict",
    max_tool_calls: int | None = None,
    max_concurrent_envs: int = 64,
) -> Any:
    """OpenEnv's FastAPI app (`create_app`) serving one `TravelPlannerEnvironment` per client session."""
    url = episodes_url or os.environ.get("STAR_EPISODES_URL") or DEFAULT_URL
    token = token or os.environ.get("STAR_API_TOKEN")
    next_id = query_cycle(query_ids) if query_ids else None

    def factory() -> TravelPlannerEnvironment:
        return TravelPlannerEnvironment(
            EpisodeClient(url, token),
            split=split,
            next_query_id=next_id,
            reward=reward,
            mode=mode,
            max_tool_calls=max_tool_calls,
        )

    return create_app(
        factory, TravelAction, TravelObservation, env_name="travelplanner", max_concurrent_envs=max_concurrent_envs
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve TravelPlanner episodes over OpenEnv's protocol.")
    parser.add_argument("--episodes-url", default=None, help="the episode API (default STAR_EPISODES_URL)")
    parser.add_argument("--split", default="validation", help="the split reset() draws from")
    parser.add_argument("--query-ids", default="", help="comma-separated ids reset() takes in turn when given none")
    parser.add_argument("--reward", default="sum", choices=["sum", "macro", "success", "curriculum"])
    parser.add_argument("--mode", default="strict", choices=["official", "strict"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    args = parser.parse_args(argv)
    import uvicorn

    ids = [i for i in args.query_ids.split(",") if i]
    app = create_travelplanner_app(
        args.episodes_url, split=args.split, query_ids=ids or None, reward=args.reward, mode=args.mode
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
