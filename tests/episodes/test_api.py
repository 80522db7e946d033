"""The episode API over real HTTP (sandbox and episode service as processes, real Redis): a whole episode,
isolation, the tool budget, bad input as 4xx, finishing once, auth, metrics and the OpenAPI document."""

from __future__ import annotations

import threading

import httpx
import pytest

from services.common.schemas import Plan, PlanDay
from services.episodes.client import EpisodeClient, EpisodeError
from services.formatter.structured import render_plan
from tests.support.episode_plans import plan_cases

pytestmark = pytest.mark.travelplanner_data


@pytest.fixture(scope="module")
def client(episode_server):
    with episode_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def cases(travelplanner_dir):
    return plan_cases(travelplanner_dir, limit=2)


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_start_by_split_id_gives_the_task_prompt_tools_and_limits(client, cases):
    ep = client.start(query_id="1", split="train")
    assert ep.query.org == cases[0].query["org"] and ep.query.id == "1"
    assert ep.task == cases[0].query["query"]
    assert "<tool_call>" in ep.system_prompt and "SearchFlight" in ep.system_prompt
    assert {t["function"]["name"] for t in ep.tools} == {
        "SearchFlight",
        "GoogleDistanceMatrix",
        "SearchAccommodation",
        "SearchRestaurant",
        "SearchAttraction",
        "SearchCity",
    }
    assert ep.limits.max_tool_calls == 60 and ep.limits.idle_expiry_s == 900
    native = client.start(query=cases[0].query, tool_format="native", max_tool_calls=5)
    assert "<tools>" not in native.system_prompt and native.limits.max_tool_calls == 5
    assert native.episode_id != ep.episode_id


def test_a_tool_call_returns_the_sandboxs_text_and_counts(client, episode_server):
    ep = client.start(query_id="1", split="train", max_tool_calls=3)
    direct = httpx.post(
        f"{episode_server.sandbox_url}/tools/call",
        json={"name": "SearchAccommodation", "arguments": {"city": "Rockford"}},
    ).json()
    reply = client.call_tool(ep.episode_id, "SearchAccommodation", {"city": "Rockford"})
    assert reply.content == direct["text"] and reply.ok
    assert (reply.tool_calls_used, reply.tool_calls_left) == (1, 2)
    official = client.call_tool(ep.episode_id, "AccommodationSearch", {"city": "Nowhere City"})
    assert not official.ok and official.tool_calls_used == 2  # the official name resolves; no result is ok=False


def test_episodes_are_isolated_and_the_budget_is_enforced(client):
    a = client.start(query_id="1", split="train", max_tool_calls=2)
    b = client.start(query_id="1", split="train", max_tool_calls=2)
    for _ in range(2):
        client.call_tool(a.episode_id, "SearchCity", {"state": "Illinois"})
    with pytest.raises(EpisodeError) as spent:
        client.call_tool(a.episode_id, "SearchCity", {"state": "Illinois"})
    assert spent.value.status == 429 and "all its 2 tool calls" in spent.value.message
    assert client.call_tool(b.episode_id, "SearchCity", {"state": "Illinois"}).tool_calls_used == 1
    assert client.state(a.episode_id).tool_calls_left == 0 and client.state(b.episode_id).tool_calls_used == 1


@pytest.mark.parametrize(
    "name, arguments, words",
    [
        ("BookFlight", {"city": "Rockford"}, "unknown tool"),
        ("SearchAccommodation", {"town": "Rockford"}, "not town"),
        ("SearchFlight", {"departure": "Rockford", "destination": "Chicago"}, "needs date"),
        ("SearchRestaurant", {"city": 7}, "must be a string"),
    ],
)
def test_a_bad_tool_call_is_a_422_and_costs_nothing(client, name, arguments, words):
    ep = client.start(query_id="1", split="train", max_tool_calls=2)
    with pytest.raises(EpisodeError) as bad:
        client.call_tool(ep.episode_id, name, arguments)
    assert bad.value.status == 422 and words in bad.value.message
    assert client.state(ep.episode_id).tool_calls_used == 0


def test_finish_scores_both_modes_and_a_second_finish_returns_the_stored_result(client, episode_server, cases):
    gold = cases[0]
    ep = client.start(query_id=gold.query_id, split="train", reward="sum")
    client.call_tool(ep.episode_id, "SearchRestaurant", {"city": "Rockford"})
    scored_before = metric(episode_server, "star_episodes_finished_total")
    result = client.finish(ep.episode_id, plan=gold.plan)
    assert result.reward == 5.0 and result.reward_kind == "sum" and result.mode == "strict"
    assert result.success.official and result.success.strict and result.tool_calls_used == 1
    assert set(result.verdicts) == {"official", "strict"}
    assert all(v.passed is not False for v in result.verdicts["strict"].commonsense.values())
    assert result.scores["official"].rewards == {"sum": 5.0, "macro": 3.0, "success": 1.0}
    again = client.finish(ep.episode_id, plan=cases[1].plan, reward="success")  # never re-scored
    assert again == result
    assert metric(episode_server, "star_episodes_finished_total") == scored_before + 1
    with pytest.raises(EpisodeError) as late:
        client.call_tool(ep.episode_id, "SearchCity", {"state": "Illinois"})
    assert late.value.status == 409
    state = client.state(ep.episode_id)
    assert state.status == "finished" and state.result == result


def test_a_broken_plan_fails_its_check_and_text_goes_through_the_formatter(client, cases):
    broken = next(c for c in cases if c.breaks == "is_valid_restaurants")
    ep = client.start(query_id=broken.query_id, split="train", reward="macro", mode="official")
    result = client.finish(ep.episode_id, plan=broken.plan)
    assert result.verdicts["official"].commonsense["is_valid_restaurants"].passed is False
    assert not result.success.official and result.reward == result.scores["official"].rewards["macro"]
    text = render_plan(Plan(days=[PlanDay.model_validate(d) for d in cases[0].plan]))
    ep2 = client.start(query_id="1", split="train", reward="success")
    as_text = client.finish(ep2.episode_id, answer=text)
    assert as_text.reward == 1.0 and as_text.scores["strict"].formatter_status == "ok"
    assert as_text.plan is not None and len(as_text.plan.days) == len(cases[0].plan)


def test_finishes_at_once_score_once_and_agree(client, episode_server, cases):
    ep = client.start(query_id="1", split="train")
    before = metric(episode_server, "star_episodes_finished_total")
    results, errors = [], []

    def finish():
        try:
            with episode_server.client() as own:
                results.append(own.finish(ep.episode_id, plan=cases[0].plan))
        except Exception as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=finish) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 8
    assert all(r == results[0] for r in results)
    assert metric(episode_server, "star_episodes_finished_total") == before + 1


def test_unknown_closed_and_invalid_episodes(client, cases):
    with pytest.raises(EpisodeError) as unknown:
        client.call_tool("no-such-episode", "SearchCity", {"state": "Texas"})
    assert unknown.value.status == 404 and "never started" in unknown.value.message
    ep = client.start(query_id="1", split="train")
    client.close(ep.episode_id)
    for call in (
        lambda: client.state(ep.episode_id),
        lambda: client.finish(ep.episode_id, plan=cases[0].plan),
        lambda: client.close(ep.episode_id),
    ):
        with pytest.raises(EpisodeError) as gone:
            call()
        assert gone.value.status == 404
    ep = client.start(query_id="1", split="train")
    with pytest.raises(EpisodeError) as not_a_plan:
        client.finish(ep.episode_id, plan="Day 1: somewhere")
    assert not_a_plan.value.status == 422
    assert client.state(ep.episode_id).status == "open"  # a refused finish leaves the episode open


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"query_id": "99999", "split": "train"}, 404, "has no query"),
        ({"query_id": "1", "split": "nonsense"}, 404, "unknown split"),
        ({"query_id": "1"}, 422, "query_id together with split"),
        ({"query_id": "1", "split": "train", "reward": "curriculum"}, 422, "needs the epoch"),
        ({"query_id": "1", "split": "train", "max_tool_calls": 1000}, 422, "at most 60"),
        ({"query_id": "1", "split": "../etc"}, 422, "String should match pattern"),
    ],
)
def test_a_bad_start_is_a_4xx_with_a_message(episode_server, body, status, words):
    reply = httpx.post(
        f"{episode_server.url}/v1/episodes", json=body, headers={"Authorization": f"Bearer {episode_server.token}"}
    )
    assert reply.status_code == status, reply.text
    assert words in str(reply.json()["detail"])


def test_every_episode_route_needs_the_token(episode_server):
    ep = EpisodeClient(episode_server.url, episode_server.token).start(query_id="1", split="train")
    for method, path in (
        ("POST", "/v1/episodes"),
        ("POST", f"/v1/episodes/{ep.episode_id}/tool_calls"),
        ("POST", f"/v1/episodes/{ep.episode_id}/finish"),
        ("GET", f"/v1/episodes/{ep.episode_id}"),
        ("DELETE", f"/v1/episodes/{ep.episode_id}"),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = httpx.request(method, episode_server.url + path, json={}, headers=headers)
            assert reply.status_code == 401, (method, path, reply.text)
    assert httpx.get(f"{episode_server.url}/healthz").status_code == 200


def test_metrics_and_openapi_describe_the_api(episode_server, client):
    client.start(query_id="1", split="train")
    text = httpx.get(f"{episode_server.url}/metrics").text
    for name in (
        "star_episodes_started_total",
        "star_episodes_tool_calls_total",
        "star_episodes_refused_total",
        "star_episodes_score_seconds",
    ):
        assert name in text
    doc = httpx.get(f"{episode_server.url}/openapi.json").json()
    paths = doc["paths"]
    assert set(paths) >= {
        "/v1/episodes",
        "/v1/episodes/{episode_id}/tool_calls",
        "/v1/episodes/{episode_id}/finish",
        "/v1/episodes/{episode_id}",
    }
    tool_calls = paths["/v1/episodes/{episode_id}/tool_calls"]["post"]["responses"]
    assert {"200", "401", "404", "409", "422", "429", "503"} <= set(tool_calls)
    assert tool_calls["429"]["content"]["application/problem+json"]["example"]["status"] == 429
    start = paths["/v1/episodes"]["post"]
    assert "201" in start["responses"] and start["security"]
    examples = doc["components"]["schemas"]["EpisodeStart"]["examples"]
    assert {"query_id", "split"} <= set(examples[0])


def test_a_finish_without_a_plan_scores_an_undelivered_plan(client):
    ep = client.start(query_id="2", split="train", reward="sum")
    result = client.finish(ep.episode_id)
    assert result.reward == 0.0 and not result.success.official and not result.success.strict
    assert result.plan is None
    assert result.verdicts["official"].commonsense["is_not_absent"].passed is False
