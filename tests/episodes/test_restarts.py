"""A sandbox or episode service killed mid-episode: the episode goes on after the restart, a tool call
meanwhile is a retryable 503 that costs nothing, and the episode is scored once."""

from __future__ import annotations

import os
import signal

import pytest

from services.episodes.client import EpisodeError
from tests.support.episode_plans import plan_cases, running_episode_server

pytestmark = [pytest.mark.travelplanner_data, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(official_world_url, redis_server_url, travelplanner_dir, tmp_path_factory):
    with running_episode_server(
        official_world_url, redis_server_url, tmp_path_factory.mktemp("restarts"), travelplanner_dir=travelplanner_dir
    ) as s:
        yield s


def kill(server, name: str) -> None:
    proc = server.processes[name].proc
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_a_killed_sandbox_gives_a_retryable_503_then_the_episode_goes_on(server):
    with server.client(retries=0) as client:
        ep = client.start(query_id="1", split="train")
        client.call_tool(ep.episode_id, "SearchCity", {"state": "Texas"})
        kill(server, "sandbox")
        with pytest.raises(EpisodeError) as away:
            client.call_tool(ep.episode_id, "SearchCity", {"state": "Texas"})
        assert away.value.status == 503 and away.value.retry_after == 1 and away.value.retryable
        assert client.state(ep.episode_id).tool_calls_used == 1  # the failed call cost nothing
        server.processes["sandbox"].start()
        assert client.call_tool(ep.episode_id, "SearchCity", {"state": "Texas"}).tool_calls_used == 2


def test_an_episode_outlives_a_killed_episode_service_and_is_scored_once(server, travelplanner_dir):
    gold = plan_cases(travelplanner_dir, limit=1)[0]
    with server.client() as client:
        ep = client.start(query_id="1", split="train", max_tool_calls=4)
        client.call_tool(ep.episode_id, "SearchAccommodation", {"city": "Rockford"})
        kill(server, "episodes")
        server.processes["episodes"].start()
        state = client.state(ep.episode_id)
        assert state.status == "open" and state.tool_calls_used == 1 and state.tool_calls_left == 3
        result = client.finish(ep.episode_id, plan=gold.plan)
        kill(server, "episodes")
        server.processes["episodes"].start()
        assert client.finish(ep.episode_id, plan=gold.plan) == result  # the stored result, not a new score
        assert client.state(ep.episode_id).result == result


def test_redis_away_is_a_retryable_503_and_the_service_recovers(official_world_url, travelplanner_dir, tmp_path):
    from services.common.redis import EmbeddedRedis

    redis = EmbeddedRedis(data_dir=tmp_path / "redis", appendonly=True).start()
    try:
        with (
            running_episode_server(
                official_world_url, redis.url, tmp_path / "servers", travelplanner_dir=travelplanner_dir
            ) as server,
            server.client(retries=0) as client,
        ):
            ep = client.start(query_id="1", split="train")
            redis.stop()
            with pytest.raises(EpisodeError) as away:
                client.call_tool(ep.episode_id, "SearchCity", {"state": "Texas"})
            assert away.value.status == 503 and "Redis" in away.value.message and away.value.retry_after == 1
            redis = EmbeddedRedis(data_dir=tmp_path / "redis", port=redis.port, appendonly=True).start()
            assert client.call_tool(ep.episode_id, "SearchCity", {"state": "Texas"}).tool_calls_used == 1
    finally:
        redis.stop()
