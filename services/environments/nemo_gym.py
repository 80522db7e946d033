"""TravelPlanner as a NeMo Gym resources server, over our episode API (docs/environments.md#nemo-gym).

NeMo Gym's agents drive a resources server over HTTP: `POST /seed_session` with the dataset row, one
`POST /<tool name>` per function call the model makes (arguments as the JSON body, the session cookie
kept), then `POST /verify` with the model's final response, which returns the reward. Here a seeded
session starts one episode of the episode API (its id travels in the signed session cookie, so the
resources server keeps no state of its own), each tool route runs that tool inside the episode, and
verify finishes the episode with the final message (the benchmark's JSON plan, or the plan as text for
our formatter) and returns the episode's reward with every check's verdict.

NeMo Gym itself is imported only when a class of this module is first used (the `nemo-gym` extra), so
the rest of the package never needs it. `dataset_rows` writes the JSONL rows its agents read.
"""

# No `from __future__ import annotations`: FastAPI and pydantic read the annotations of the classes and routes
# built inside `_classes`, whose names live only in that function.
import json
from functools import cache
from typing import Any

from services.episodes.client import AsyncEpisodeClient, EpisodeClient, EpisodeError

# The six tools (the sandbox's names); each becomes a POST route of the resources server.
TOOL_NAMES = (
    "SearchFlight",
    "GoogleDistanceMatrix",
    "SearchAccommodation",
    "SearchRestaurant",
    "SearchAttraction",
    "SearchCity",
)
EPISODE_KEY = "star_episode_id"  # where the session cookie keeps the episode's id


def response_tools(openai_tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The episode API's chat-completions tool schemas in the Responses API form NeMo Gym's models take."""
    out = []
    for tool in openai_tools:
        fn = tool.get("function", tool)
        out.append(
            {
                "type": "function",
                "name": fn["name"],
                "description": fn.get("description", ""),
                "parameters": fn.get("parameters", {"type": "object", "properties": {}}),
                "strict": False,
            }
        )
    return out


def dataset_rows(
    client: EpisodeClient, split: str, query_ids: list[str], *, mode: str = "strict", reward: str = "sum"
) -> list[dict[str, Any]]:
    """One NeMo Gym dataset row per query: the prompt (system prompt, task) and the tools as the episode API
    gives them, and the fields `/seed_session` starts the episode from. Each row's prompt is read from an
    episode started and closed at once."""
    rows = []
    for query_id in query_ids:
        started = client.start(query_id=query_id, split=split, mode=mode, reward=reward, tool_format="native")
        client.close(started.episode_id)
        rows.append(
            {
                "responses_create_params": {
                    "input": [
                        {"role": "system", "content": started.system_prompt},
                        {"role": "user", "content": started.task},
                    ],
                    "tools": response_tools(started.tools),
                },
                "query_id": query_id,
                "split": split,
                "mode": mode,
                "reward": reward,
            }
        )
    return rows


def final_text(response: Any) -> str:
    """The text of the last assistant message of a Responses API response (NeMoGymResponse or its JSON)."""
    output = response.get("output", []) if isinstance(response, dict) else getattr(response, "output", [])
    for item in reversed(list(output)):
        item = item if isinstance(item, dict) else item.model_dump()
        if item.get("type") == "message" and item.get("role", "assistant") == "assistant":
            parts = item.get("content") or []
            if isinstance(parts, str):
                return parts
            return "".join(p.get("text", "") for p in parts if p.get("type") in ("output_text", "text"))
    return ""


def plan_or_answer(text: str) -> dict[str, Any]:
    """`finish`'s arguments for a final message: the benchmark's JSON plan when it is one, else the text."""
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, list) or (isinstance(value, dict) and "days" in value):
            return {"plan": value}
    return {"answer": text}


def not_the_policys_fault(error: EpisodeError) -> bool:
    """Whether a failed finish says nothing of the plan: no reply, an episode gone (expired), a server error."""
    return error.status in (0, 404) or error.status >= 500


@cache
def _classes() -> dict[str, type]:
    """NeMo Gym's base classes extended with ours; built on first use so the import stays optional."""
    try:
        from fastapi import Request
        from fastapi.responses import PlainTextResponse
        from nemo_gym.base_resources_server import (
            BaseResourcesServerConfig,
            BaseSeedSessionRequest,
            BaseSeedSessionResponse,
            BaseVerifyRequest,
            BaseVerifyResponse,
            SimpleResourcesServer,
        )
        from pydantic import ConfigDict, Field, PrivateAttr
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise ImportError(f"the NeMo Gym adapter needs NeMo Gym: pip install 'star-train[nemo-gym]' ({exc})") from exc

    class TravelPlannerResourcesServerConfig(BaseResourcesServerConfig):
        """Where the episode API is, and the episode defaults a dataset row may override."""

        episodes_url: str = Field(description="Base URL of the episode API (`star episodes serve`).")
        episodes_token: str | None = Field(None, description="Its bearer token (STAR_API_TOKEN), if any.")
        split: str = "train"
        mode: str = Field("strict", description="Evaluator mode of the reward: official | strict.")
        reward: str = Field("sum", description="Reward kind: sum | macro | success | curriculum.")
        max_tool_calls: int | None = None

    class TravelPlannerSeedSessionRequest(BaseSeedSessionRequest):
        """A dataset row's episode fields (the rest of the row is ignored): a query by id, or inline."""

        model_config = ConfigDict(extra="ignore")
        query_id: str | None = None
        split: str | None = None
        query: dict[str, Any] | None = None
        mode: str | None = None
        reward: str | None = None
        epoch: int | None = None

    class TravelPlannerSeedSessionResponse(BaseSeedSessionResponse):
        episode_id: str
        task: str
        max_tool_calls: int

    class TravelPlannerVerifyResponse(BaseVerifyResponse):
        """NeMo Gym's verify response with the episode's result; top-level numbers feed aggregate metrics."""

        episode_id: str | None = None
        reward_kind: str | None = None
        mode: str | None = None
        success_official: float = 0.0
        success_strict: float = 0.0
        tool_calls_used: int = 0
        verdicts: dict[str, Any] = Field(default_factory=dict)

    class TravelPlannerResourcesServer(SimpleResourcesServer):
        """Our six tools and the benchmark's evaluator behind NeMo Gym's resources-server protocol."""

        config: TravelPlannerResourcesServerConfig
        _episodes: Any = PrivateAttr(None)

        def episodes(self) -> AsyncEpisodeClient:
            if self._episodes is None:
                self._episodes = AsyncEpisodeClient(self.config.episodes_url, self.config.episodes_token)
            return self._episodes

        def setup_webserver(self):
            app = super().setup_webserver()
            for name in TOOL_NAMES:
                app.post(
                    f"/{name}", response_class=PlainTextResponse, summary=f"Run {name} inside this session's episode"
                )(self._tool_route(name))
            return app

        def _tool_route(self, name: str):
            async def run_tool(request: Request, body: dict[str, Any]) -> PlainTextResponse:
                episode_id = request.session.get(EPISODE_KEY)
                if not episode_id:
                    return PlainTextResponse("no episode in this session: POST /seed_session first", 400)
                try:
                    result = await self.episodes().call_tool(episode_id, name, body)
                except EpisodeError as exc:
                    return PlainTextResponse(f"Error: {exc.message}", exc.status or 502)
                return PlainTextResponse(result.content)

            run_tool.__name__ = name
            return run_tool

        async def seed_session(
            self, request: Request, body: TravelPlannerSeedSessionRequest
        ) -> TravelPlannerSeedSessionResponse:
            c = self.config
            try:
                started = await self.episodes().start(
                    query_id=None if body.query is not None else body.query_id,
                    split=None if body.query is not None else (body.split or c.split),
                    query=body.query,
                    mode=body.mode or c.mode,
                    reward=body.reward or c.reward,
                    epoch=body.epoch,
                    max_tool_calls=c.max_tool_calls,
                    tool_format="native",
                )
            except EpisodeError as exc:
                from fastapi import HTTPException

                raise HTTPException(exc.status if 400 <= exc.status < 600 else 502, exc.message) from None
            request.session[EPISODE_KEY] = started.episode_id
            return TravelPlannerSeedSessionResponse(
                episode_id=started.episode_id, task=started.task, max_tool_calls=started.limits.max_tool_calls
            )

        async def finish_episode(self, episode_id: str, text: str):
            """Finish with the final message; JSON the API takes for no plan (422) is read as text instead."""
            arguments = plan_or_answer(text)
            try:
                return await self.episodes().finish(episode_id, **arguments)
            except EpisodeError as exc:
                if exc.status != 422 or "plan" not in arguments:
                    raise
            return await self.episodes().finish(episode_id, answer=text)

        async def verify(self, request: Request, body: BaseVerifyRequest) -> TravelPlannerVerifyResponse:
            episode_id = request.session.get(EPISODE_KEY)
            base = body.model_dump()
            if not episode_id:
                return TravelPlannerVerifyResponse(**base, reward=0.0, failure_reason="no episode in this session")
            try:
                result = await self.finish_episode(episode_id, final_text(body.response))
            except EpisodeError as exc:
                return TravelPlannerVerifyResponse(
                    **base,
                    reward=0.0,
                    episode_id=episode_id,
                    mask_sample=not_the_policys_fault(exc),
                    failure_reason=f"episode API: HTTP {exc.status}: {exc.message}",
                )
            try:
                await self.episodes().close(episode_id)
            except EpisodeError:
                pass  # scored already; an episode left open expires on its own
            request.session.pop(EPISODE_KEY, None)
            return TravelPlannerVerifyResponse(
                **base,
                reward=result.reward,
                episode_id=episode_id,
                reward_kind=result.reward_kind,
                mode=result.mode,
                success_official=float(result.success.official),
                success_strict=float(result.success.strict),
                tool_calls_used=result.tool_calls_used,
                verdicts={mode: v.model_dump(mode="json") for mode, v in result.verdicts.items()},
            )

    return {
        cls.__name__: cls
        for cls in (
            TravelPlannerResourcesServerConfig,
            TravelPlannerSeedSessionRequest,
            TravelPlannerSeedSessionResponse,
            TravelPlannerVerifyResponse,
            TravelPlannerResourcesServer,
        )
    }


LAZY_NAMES = (
    "TravelPlannerResourcesServerConfig",
    "TravelPlannerSeedSessionRequest",
    "TravelPlannerSeedSessionResponse",
    "TravelPlannerVerifyResponse",
    "TravelPlannerResourcesServer",
)


def __getattr__(name: str) -> Any:
    if name in LAZY_NAMES:
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
