"""The episode API's bounds over real HTTP: open episodes per client, idle expiry, body size."""

from __future__ import annotations

import time

import httpx
import pytest

from services.episodes.client import EpisodeError
from tests.support.episode_plans import running_episode_server

pytestmark = pytest.mark.travelplanner_data

LIMITS = {
    "STAR_EPISODES_MAX_OPEN_PER_CLIENT": "2",
    "STAR_EPISODES_IDLE_EXPIRY_S": "1.5",
    "STAR_EPISODES_MAX_BODY_BYTES": "4096",
    "STAR_EPISODES_MAX_TOOL_CALLS": "3",
}


@pytest.fixture(scope="module")
def server(official_world_url, redis_server_url, travelplanner_dir, tmp_path_factory):
    with running_episode_server(
        official_world_url,
        redis_server_url,
        tmp_path_factory.mktemp("limits"),
        travelplanner_dir=travelplanner_dir,
        env=LIMITS,
    ) as s:
        yield s


def test_a_client_holds_at_most_its_open_episodes(server):
    with server.client() as client:
        first = client.start(query_id="1", split="train", client="trainer-a")
        client.start(query_id="1", split="train", client="trainer-a")
        with pytest.raises(EpisodeError) as full:
            client.start(query_id="1", split="train", client="trainer-a")
        assert full.value.status == 429 and "2 open episodes" in full.value.message
        client.start(query_id="1", split="train", client="trainer-b")  # another client is not counted
        client.close(first.episode_id)
        client.start(query_id="1", split="train", client="trainer-a")  # closing frees a place


def test_an_idle_episode_expires_and_activity_keeps_it(server):
    with server.client() as client:
        idle = client.start(query_id="1", split="train", client="expiry")
        busy = client.start(query_id="1", split="train", client="expiry")
        assert client.state(idle.episode_id).limits.max_tool_calls == 3
        for _ in range(3):
            time.sleep(0.6)
            client.call_tool(busy.episode_id, "SearchCity", {"state": "Texas"})
        with pytest.raises(EpisodeError) as gone:
            client.state(idle.episode_id)
        assert gone.value.status == 404
        assert client.state(busy.episode_id).tool_calls_used == 3
        with pytest.raises(EpisodeError) as spent:
            client.call_tool(busy.episode_id, "SearchCity", {"state": "Texas"})
        assert spent.value.status == 429
        # the expired one no longer counts against the client
        client.start(query_id="1", split="train", client="expiry")


def test_a_body_over_the_limit_is_a_413(server):
    with server.client() as client:
        ep = client.start(query_id="1", split="train", client="body")
        reply = httpx.post(
            f"{server.url}/v1/episodes/{ep.episode_id}/finish",
            json={"answer": "x" * 5000},
            headers={"Authorization": f"Bearer {server.token}"},
        )
        assert reply.status_code == 413 and "4096 bytes" in reply.json()["detail"]
        assert client.state(ep.episode_id).status == "open"
