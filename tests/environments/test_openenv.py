"""The OpenEnv adapter against OpenEnv's own code: its server (`create_app`, WebSocket sessions) serving our
environment over real HTTP, driven by its client (`EnvClient`), with every step going to a live episode API.

Runs in `.venv-openenv` (scripts/test-adapters); skips elsewhere.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.environments.conftest import library_or_skip

library_or_skip("openenv", ".venv-openenv")

import uvicorn  # noqa: E402

from services.environments.openenv_env import (  # noqa: E402
    TravelAction,
    TravelPlannerClient,
    create_travelplanner_app,
)

MODES = ("official", "strict")


@pytest.fixture(scope="module")
def openenv_url(served) -> Iterator[str]:
    """OpenEnv's app for our environment, under uvicorn on a free port, over the live episode API."""
    app = create_travelplanner_app(served.url, served.token, split="train", query_ids=["1", "2"])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "OpenEnv's server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def gold_case(served) -> dict:
    """A gold plan that `star score` passes in strict mode (sum 5 of 5)."""
    for case in served.cases:
        if case["breaks"] is None and case["star_score"]["strict"] == 5.0:
            return case
    pytest.fail("no gold plan of the fixture passes `star score --mode strict`")


def test_client_runs_an_episode_end_to_end(served, openenv_url: str) -> None:
    case = gold_case(served)
    with TravelPlannerClient(base_url=openenv_url).sync() as env:
        started = env.reset(query_id=case["query_id"], split="train", reward="success")
        first = started.observation
        assert not started.done and first.episode_id
        assert first.content and first.system_prompt
        assert {t["function"]["name"] for t in first.tools} >= {"SearchFlight", "SearchAccommodation"}
        budget = first.tool_calls_left

        city = case["query"]["dest"]
        looked = env.step(TravelAction(tool="SearchAccommodation", arguments={"city": city}))
        assert not looked.done and looked.observation.error is None
        assert looked.observation.tool_calls_left == budget - 1
        # the sandbox's real answer: the gold plan's own hotel is among the city's accommodations
        hotel = next(d["accommodation"] for d in case["plan"] if d["accommodation"] not in ("-", ""))
        assert hotel.rsplit(",", 1)[0].strip() in looked.observation.content

        refused = env.step(TravelAction(tool="SearchAccommodation", arguments={"town": city}))
        assert not refused.done and refused.observation.error

        finished = env.step(TravelAction(tool="finish", plan=case["plan"]))
        assert finished.done and finished.reward == 1.0
        assert finished.observation.success == {"official": True, "strict": True}
        assert set(finished.observation.verdicts) == set(MODES)
        state = env.state()
        assert state.finished and state.reward == 1.0 and state.episode_id == first.episode_id

        after = env.step(TravelAction(tool="SearchAccommodation", arguments={"city": city}))
        assert after.done and after.observation.error


def test_reset_without_a_query_takes_the_servers_next(served, openenv_url: str) -> None:
    with TravelPlannerClient(base_url=openenv_url).sync() as env:
        first = env.reset()
        second = env.reset()
        assert first.observation.episode_id != second.observation.episode_id
        assert first.observation.content != second.observation.content  # train queries 1 and 2


def test_broken_plan_scores_below_the_gold(served, openenv_url: str) -> None:
    gold = gold_case(served)
    broken = next(
        c
        for c in served.cases
        if c["query_id"] == gold["query_id"] and c["breaks"] is not None and not c["query_changed"]
    )
    with TravelPlannerClient(base_url=openenv_url).sync() as env:
        env.reset(query_id=broken["query_id"], split="train", reward="success")
        result = env.step(TravelAction(tool="finish", plan=broken["plan"]))
    assert result.done and result.reward == 0.0
    assert result.observation.success["strict"] is False


def test_bad_requests_are_answered_not_errors(served, openenv_url: str) -> None:
    """A reset the episode API refuses is a done observation with the reason, over the client's session and over
    OpenEnv's plain HTTP routes (which make a fresh environment per request, so keep no episode); an action that
    does not fit the schema is OpenEnv's 422."""
    with TravelPlannerClient(base_url=openenv_url).sync() as env:
        refused = env.reset(query_id="9999", split="train")
        assert refused.done and "no query" in refused.observation.error
    with httpx.Client(base_url=openenv_url, timeout=30) as http:
        reply = http.post("/reset", json={"query_id": "9999", "split": "train"})
        assert reply.status_code == 200 and "no query" in reply.json()["observation"]["error"]
        reply = http.post("/step", json={"action": {"tool": "finish", "plan": []}})
        assert reply.status_code == 200 and "call reset first" in reply.json()["observation"]["error"]
        reply = http.post("/step", json={"action": {"name": "SearchFlight"}})
        assert reply.status_code == 422


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_reward_equals_star_score(served, openenv_url: str, mode: str) -> None:
    """Every gold plan and every plan broken one constraint at a time: the reward OpenEnv's client reads is
    `star score`'s, in both modes."""
    got, want = {}, {}
    with TravelPlannerClient(base_url=openenv_url).sync() as env:
        for case in served.cases:
            if case["query_changed"]:
                env.reset(query=case["query"], mode=mode)
            else:
                env.reset(query_id=case["query_id"], split="train", mode=mode)
            result = env.step(TravelAction(tool="finish", plan=case["plan"]))
            assert result.done
            got[case["name"]], want[case["name"]] = result.reward, case["star_score"][mode]
    assert got == want
    assert len({v for v in want.values()}) > 1  # the cases do differ in reward
