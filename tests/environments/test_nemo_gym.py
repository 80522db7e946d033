"""The NeMo Gym adapter against NeMo Gym's own resources-server classes, over real HTTP to our real episode API.

Runs in `.venv-nemogym` (scripts/test-adapters); skipped where NeMo Gym is not installed. `served` (conftest.py)
is the live episode API with the fixture's plan cases and their `star score` rewards. The resources
server is NeMo Gym's `SimpleResourcesServer` (its app, session middleware, verify wrappers) served by
uvicorn; the client speaks the protocol NeMo Gym's simple agent speaks (seed_session, one POST per tool
call with the session cookie, verify with a Responses API response).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.environments.adapter_server import fixture_query_ids
from tests.environments.conftest import library_or_skip

library_or_skip("nemo_gym", ".venv-nemogym")


# starts the episode API (conftest's `served`) and a resources server
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gym_url(served):
    """Our resources server, built by NeMo Gym's classes and served over HTTP."""
    import uvicorn
    from nemo_gym.server_utils import BaseServerConfig, ServerClient
    from omegaconf import OmegaConf

    from services.environments.nemo_gym import TravelPlannerResourcesServer, TravelPlannerResourcesServerConfig

    port = _free_port()
    config = TravelPlannerResourcesServerConfig(
        host="127.0.0.1",
        port=port,
        entrypoint="app.py",
        name="travelplanner",
        episodes_url=served.url,
        episodes_token=served.token,
    )
    client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=_free_port()),
        global_config_dict=OmegaConf.create({}),
    )
    server = TravelPlannerResourcesServer(config=config, server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    yield url
    uv.should_exit = True
    thread.join(timeout=10)


def _response(text: str) -> dict:
    """A Responses API response whose last output is an assistant message (what a policy model returns)."""
    return {
        "id": "resp_1",
        "created_at": 0.0,
        "model": "scripted",
        "object": "response",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": [
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
    }


def _seed_body(case: dict, **fields) -> dict:
    where = {"query": case["query"]} if case["query_changed"] else {"query_id": case["query_id"], "split": "train"}
    return {"responses_create_params": {"input": [{"role": "user", "content": "plan my trip"}]}, **where, **fields}


def _episode(gym_url: str, case: dict, *, tools: list[tuple[str, dict]] = (), answer: str, **fields) -> dict:
    """One rollout as NeMo Gym's simple agent drives it: seed, tool calls (cookie kept), verify."""
    with httpx.Client(base_url=gym_url, timeout=60) as http:
        seeded = http.post("/seed_session", json=_seed_body(case, **fields))
        assert seeded.status_code == 200, seeded.text
        for name, arguments in tools:
            reply = http.post(f"/{name}", json=arguments)
            assert reply.status_code == 200, reply.text
        verified = http.post("/verify", json={**_seed_body(case, **fields), "response": _response(answer)})
        assert verified.status_code == 200, verified.text
        return verified.json()


def _oracle_tools(case: dict) -> list[tuple[str, dict]]:
    q = case["query"]
    return [
        ("SearchFlight", {"departure": q["org"], "destination": q["dest"], "date": q["date"][0]}),
        ("SearchAccommodation", {"city": q["dest"]}),
        ("SearchRestaurant", {"city": q["dest"]}),
    ]


def test_oracle_plan_scores_one_and_a_broken_plan_less(gym_url, served):
    gold = next(c for c in served.cases if c["breaks"] is None)
    broken = next(
        c for c in served.cases if c["query_id"] == gold["query_id"] and c["breaks"] == "is_valid_restaurants"
    )
    good = _episode(gym_url, gold, tools=_oracle_tools(gold), answer=json.dumps(gold["plan"]), reward="success")
    assert good["reward"] == 1.0
    assert good["success_strict"] == 1.0 and good["tool_calls_used"] == 3
    assert good["verdicts"]["strict"]["commonsense"]["is_valid_restaurants"]["passed"] is True
    bad = _episode(gym_url, broken, tools=_oracle_tools(broken), answer=json.dumps(broken["plan"]), reward="success")
    assert bad["reward"] == 0.0
    assert bad["verdicts"]["official"]["commonsense"]["is_valid_restaurants"]["passed"] is False


def test_tool_routes_return_the_sandbox_text_inside_the_episode(gym_url, served):
    case = served.cases[0]
    with httpx.Client(base_url=gym_url, timeout=60) as http:
        assert http.post("/SearchCity", json={"state": "Texas"}).status_code == 400  # no session seeded yet
        assert http.post("/seed_session", json=_seed_body(case)).status_code == 200
        reply = http.post("/SearchAccommodation", json={"city": case["query"]["dest"]})
        assert reply.status_code == 200 and case["query"]["dest"] in reply.text
        bad = http.post("/SearchFlight", json={"departure": case["query"]["org"]})  # destination and date missing
        assert 400 <= bad.status_code < 500 and bad.text.startswith("Error:")


def test_a_text_answer_goes_through_the_formatter(gym_url, served):
    gold = next(c for c in served.cases if c["breaks"] is None)
    text = "\n\n".join(
        f"Day {d['days']}:\n"
        + "\n".join(
            f"{label}: {d[key]}"
            for label, key in (
                ("Current City", "current_city"),
                ("Transportation", "transportation"),
                ("Breakfast", "breakfast"),
                ("Attraction", "attraction"),
                ("Lunch", "lunch"),
                ("Dinner", "dinner"),
                ("Accommodation", "accommodation"),
            )
        )
        for d in gold["plan"]
    )
    result = _episode(gym_url, gold, answer=text, mode="official")
    assert result["reward"] == gold["star_score"]["official"]


@pytest.mark.parametrize("mode", ["official", "strict"])
def test_reward_equals_star_score_on_gold_and_broken_plans(gym_url, served, mode):
    assert {c["query_id"] for c in served.cases} == fixture_query_ids()
    assert any(c["breaks"] for c in served.cases) and any(c["breaks"] is None for c in served.cases)
    mismatches = []
    for case in served.cases:
        got = _episode(gym_url, case, answer=json.dumps(case["plan"]), mode=mode, reward="sum")
        assert got["mode"] == mode and got["reward_kind"] == "sum"
        if got["reward"] != case["star_score"][mode]:
            mismatches.append((case["name"], got["reward"], case["star_score"][mode]))
    assert not mismatches


def test_verify_failures_say_whose_they_are(gym_url, served):
    """JSON that is no plan scores as text (0, the policy's); an episode gone meanwhile masks the sample."""
    case = served.cases[0]
    junk = _episode(gym_url, case, answer="[1, 2]", reward="sum")
    assert junk["reward"] == 0.0 and junk["mask_sample"] is False
    with httpx.Client(base_url=gym_url, timeout=60) as http:
        seeded = http.post("/seed_session", json=_seed_body(case)).json()
        with served.client() as client:
            client.close(seeded["episode_id"])
        gone = http.post("/verify", json={**_seed_body(case), "response": _response(json.dumps(case["plan"]))})
        assert gone.status_code == 200
        assert gone.json()["mask_sample"] is True and "404" in gone.json()["failure_reason"]
    with httpx.Client(base_url=gym_url, timeout=60) as http:  # no seed_session
        unseeded = http.post("/verify", json={**_seed_body(case), "response": _response("Day 1: ...")}).json()
        assert unseeded["reward"] == 0.0 and unseeded["failure_reason"] == "no episode in this session"


def test_dataset_rows_are_what_the_agent_sends(gym_url, served):
    """`dataset_rows`: the episode API's prompt and tools in the Responses API form, one route per tool, and a row
    that seeds its own episode."""
    from services.environments.nemo_gym import TOOL_NAMES, dataset_rows

    with served.client() as client:
        [row] = dataset_rows(client, "train", ["1"], mode="official", reward="success")
    params = row["responses_create_params"]
    assert [m["role"] for m in params["input"]] == ["system", "user"] and params["input"][1]["content"]
    assert [t["name"] for t in params["tools"]] == list(TOOL_NAMES)
    assert all(t["type"] == "function" and t["parameters"]["properties"] for t in params["tools"])
    with httpx.Client(base_url=gym_url, timeout=60) as http:
        seeded = http.post("/seed_session", json=row).json()
        assert seeded["task"] == params["input"][1]["content"]
        with served.client() as client:
            state = client.state(seeded["episode_id"])
        assert (state.mode, state.reward, state.tool_calls_used) == ("official", "success", 0)
