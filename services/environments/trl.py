"""TravelPlanner for TRL's GRPOTrainer, over our episode API (docs/environments.md#trl).

TRL's multi-turn tool form is `GRPOTrainer(environment_factory=...)`: the trainer makes one environment
per rollout, calls its `reset(**row)` before generating, exposes its public methods as tools (their names,
type hints and Google-style docstrings become the schemas the chat template lists), runs the tool calls
the model writes, and hands the environments to the reward functions (`environments=`). Here:

- `TravelPlannerEnv`: `reset` starts an episode for the row's query (closing the one before), and the six
  methods named like our tools run inside it (their budget, their errors as text the model reads); TRL makes
  every public method a tool, so its other methods are private;
- `travelplanner_reward`: finishes each rollout's episode with the final assistant message (the benchmark's
  JSON plan, or the plan as text for our formatter) and returns the episode API's rewards;
- `travelplanner_dataset`: the prompt rows (system prompt and task as the episode API gives them).

This module never imports TRL (the trainer only calls it); `travelplanner_dataset` needs `datasets`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from services.common.schemas import EpisodeResult
from services.environments.nemo_gym import not_the_policys_fault, plan_or_answer
from services.episodes.client import EpisodeClient, EpisodeError

DEFAULT_URL = "http://127.0.0.1:8007"


class TravelPlannerEnv:
    """One TravelPlanner episode at a time, for `GRPOTrainer(environment_factory=...)`.

    The episode API is at `base_url` (default: STAR_EPISODES_URL, else the local `star episodes serve`),
    with `token` (default: STAR_API_TOKEN). `mode` and `reward` choose the reward `travelplanner_reward`
    returns; a row's own `mode` / `reward` columns override them.
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        split: str = "train",
        mode: str = "strict",
        reward: str = "sum",
        max_tool_calls: int | None = None,
    ) -> None:
        self._client = EpisodeClient(
            base_url or os.environ.get("STAR_EPISODES_URL", DEFAULT_URL),
            token if token is not None else os.environ.get("STAR_API_TOKEN") or None,
        )
        self._defaults = {"split": split, "mode": mode, "reward": reward}
        self._max_tool_calls = max_tool_calls
        self.episode_id: str | None = None
        self.result: EpisodeResult | None = None

    def reset(self, **row: Any) -> None:
        """Start the episode of a dataset row: `query_id` (with `split`) or an inline `query` (its fields, or
        them as JSON text: a dataset column holds nested queries of mixed shapes best as text). The row's prompt
        already holds the task, so nothing is appended to it."""
        self._end_episode()
        query = row.get("query")
        if isinstance(query, str):
            query = json.loads(query)
        if not query and row.get("query_id") is None:
            raise ValueError("a TravelPlanner row needs a query_id (with split) or a query")
        options = {k: row.get(k) or v for k, v in self._defaults.items()}
        started = self._client.start(
            query_id=None if query else str(row["query_id"]),
            split=None if query else options["split"],
            query=query or None,
            mode=options["mode"],
            reward=options["reward"],
            epoch=row.get("epoch"),
            max_tool_calls=self._max_tool_calls,
            tool_format="native",
        )
        self.episode_id = started.episode_id
        return None

    def _finish(self, final_message: str) -> EpisodeResult:
        """Score the episode with the model's final message (a second call returns the stored result)."""
        if self.episode_id is None:
            raise RuntimeError("no episode: reset() starts one")
        if self.result is None:
            arguments = plan_or_answer(final_message)
            try:
                self.result = self._client.finish(self.episode_id, **arguments)
            except EpisodeError as exc:
                if exc.status != 422 or "plan" not in arguments:
                    raise
                # JSON the API takes for no plan: read it as text instead (an unreadable answer scores 0)
                self.result = self._client.finish(self.episode_id, answer=final_message)
        return self.result

    def _close(self) -> None:
        """End the open episode and the HTTP client (`close_environments`)."""
        self._end_episode()
        self._client.close_client()

    def _end_episode(self) -> None:
        if self.episode_id is not None:
            try:
                self._client.close(self.episode_id)
            except EpisodeError:
                pass  # already expired or closed
        self.episode_id, self.result = None, None

    def _tool(self, name: str, arguments: dict[str, Any]) -> str:
        if self.episode_id is None:
            return "Error: no episode is running"
        try:
            return self._client.call_tool(self.episode_id, name, arguments).content
        except EpisodeError as exc:
            return f"Error: {exc.message}"

    # The six tools. Names and parameters are the sandbox's (services/sandbox/tools/registry.py).

    def SearchFlight(self, departure: str, destination: str, date: str) -> str:  # noqa: N802 - the tool's name
        """List every flight from one city to another on a given day, with flight number, ticket price per
        person, departure and arrival times, duration and distance.

        Args:
            departure: City the flight leaves from, exactly as the database spells it (case-sensitive).
            destination: City the flight arrives in, exactly as the database spells it.
            date: Day of departure, formatted YYYY-MM-DD.
        """
        return self._tool("SearchFlight", {"departure": departure, "destination": destination, "date": date})

    def GoogleDistanceMatrix(self, departure: str, destination: str, mode: str = "driving") -> str:  # noqa: N802
        """Road trip between two cities: driving time, distance and the cost of going by self-driving or by taxi.

        Args:
            departure: City the trip starts in, exactly as the database spells it (case-sensitive).
            destination: City the trip ends in, exactly as the database spells it.
            mode: How to travel: 'driving' (your own car) or 'taxi'.
        """
        return self._tool("GoogleDistanceMatrix", {"departure": departure, "destination": destination, "mode": mode})

    def SearchAccommodation(self, city: str) -> str:  # noqa: N802
        """List the places to stay in a city: nightly price, room type, house rules, minimum stay, maximum
        occupancy and review score.

        Args:
            city: City to stay in, exactly as the database spells it (case-sensitive).
        """
        return self._tool("SearchAccommodation", {"city": city})

    def SearchRestaurant(self, city: str) -> str:  # noqa: N802
        """List the restaurants of a city with their average cost per person, cuisines and rating.

        Args:
            city: City to eat in, exactly as the database spells it (case-sensitive).
        """
        return self._tool("SearchRestaurant", {"city": city})

    def SearchAttraction(self, city: str) -> str:  # noqa: N802
        """List the sights of a city with address, phone number and website.

        Args:
            city: City to visit, exactly as the database spells it (case-sensitive).
        """
        return self._tool("SearchAttraction", {"city": city})

    def SearchCity(self, state: str) -> str:  # noqa: N802
        """List the cities of a state (or territory) that the travel database covers.

        Args:
            state: State name, e.g. 'Texas' or 'New York'.
        """
        return self._tool("SearchCity", {"state": state})


def final_message(completion: Any) -> str:
    """The text of a completion's last assistant message (conversational), or the completion (plain text)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(list(completion)):
        if message.get("role") == "assistant":
            content = message.get("content") or ""
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content
    return ""


def travelplanner_reward(
    completions: Sequence[Any], environments: Sequence[TravelPlannerEnv], **kwargs: Any
) -> list[float | None]:
    """A GRPOTrainer reward function: each rollout's episode finished with its final message, scored by the
    episode API (the reward kind and mode its environment chose). A rollout the API could not score for no fault
    of the plan (unreachable, the episode expired) gets None, which TRL leaves out."""
    rewards: list[float | None] = []
    for completion, env in zip(completions, environments, strict=True):
        try:
            rewards.append(env._finish(final_message(completion)).reward)
        except EpisodeError as exc:
            if not not_the_policys_fault(exc):
                raise
            warnings.warn(f"TravelPlanner episode {env.episode_id} not scored: {exc}", RuntimeWarning, stacklevel=2)
            rewards.append(None)  # TRL leaves a reward of None out of the sample's reward
    log_metric = kwargs.get("log_metric")
    if callable(log_metric) and environments:
        for mode in ("official", "strict"):
            passed = [float(getattr(env.result.success, mode)) for env in environments if env.result is not None]
            log_metric(f"travelplanner/success_{mode}", sum(passed) / max(1, len(passed)))
    return rewards


def close_environments(environments: Sequence[TravelPlannerEnv]) -> None:
    """Close the environments' open episodes (after training: `trainer._environment_pool`, or your own)."""
    for env in environments:
        env._close()


def environment_factory(
    base_url: str | None = None, token: str | None = None, **options: Any
) -> Callable[[], TravelPlannerEnv]:
    """A zero-argument factory for `environment_factory=` with these settings (see `TravelPlannerEnv`)."""

    def make() -> TravelPlannerEnv:
        return TravelPlannerEnv(base_url, token, **options)

    return make


def travelplanner_dataset(client: EpisodeClient, split: str, query_ids: Sequence[str], **columns: Any):
    """A `datasets.Dataset` of conversational prompts, one per query: the episode API's system prompt for
    native tool calling and the task, with `query_id` and `split` for `reset` (and any extra `columns`, the
    same for every row). Each prompt is read from an episode started and closed at once."""
    from datasets import Dataset

    rows = []
    for query_id in query_ids:
        started = client.start(query_id=str(query_id), split=split, tool_format="native")
        client.close(started.episode_id)
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": started.system_prompt},
                    {"role": "user", "content": started.task},
                ],
                "query_id": str(query_id),
                "split": split,
                **columns,
            }
        )
    return Dataset.from_list(rows)
