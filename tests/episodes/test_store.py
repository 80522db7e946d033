"""The episode store's scripts on the real Redis: budgets and claims hold under requests at once."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from services.episodes.store import EpisodeStore


def run(redis_url: str, body):
    async def main():
        client = aioredis.from_url(redis_url)
        store = EpisodeStore(client, f"test:{uuid.uuid4().hex[:8]}")
        try:
            return await body(store)
        finally:
            keys = [k async for k in client.scan_iter(match=store.prefix + "*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()

    return asyncio.run(main())


SPEC = {"client": "c1", "query": {}, "reward": "sum", "mode": "strict"}


def test_a_budget_of_three_gives_three_calls_to_twenty_at_once(redis_server_url):
    async def body(store):
        assert await store.create("e1", SPEC, 3, 60_000, 10)
        results = await asyncio.gather(*(store.reserve("e1", 60_000) for _ in range(20)))
        return sorted(r.code for r in results), (await store.load("e1")).used

    codes, used = run(redis_server_url, body)
    assert codes.count(1) == 3 and codes.count(-2) == 17
    assert used == 3


def test_a_refund_gives_a_call_back_and_an_unknown_episode_reserves_nothing(redis_server_url):
    async def body(store):
        await store.create("e1", SPEC, 1, 60_000, 10)
        first = await store.reserve("e1", 60_000)
        spent = await store.reserve("e1", 60_000)
        await store.refund("e1")
        again = await store.reserve("e1", 60_000)
        missing = await store.reserve("nope", 60_000)
        return first.code, spent.code, again.code, missing.code

    assert run(redis_server_url, body) == (1, -2, 1, 0)


def test_one_claim_wins_and_the_first_result_stays(redis_server_url):
    async def body(store):
        await store.create("e1", SPEC, 5, 60_000, 10)
        claims = await asyncio.gather(*(store.claim("e1", f"t{i}", 5000, 60_000) for i in range(10)))
        winner = [i for i, c in enumerate(claims) if c.outcome == "claimed"]
        stored = await store.store("e1", "c1", f"t{winner[0]}", {"reward": 1.0}, 60_000)
        late = await store.store("e1", "c1", "someone-else", {"reward": 2.0}, 60_000)
        after = await store.claim("e1", "t-late", 5000, 60_000)
        during_finish = await store.reserve("e1", 60_000)
        ledger = await store.redis.hmget(store.key("e1"), "claims", "stores")
        return [c.outcome for c in claims], winner, stored, late, after, during_finish.code, ledger

    outcomes, winner, stored, late, after, reserve, ledger = run(redis_server_url, body)
    assert ledger == [b"1", b"1"]  # one claim taken, one result stored
    assert len(winner) == 1 and outcomes.count("busy") == 9
    assert stored == late == {"reward": 1.0}
    assert after.outcome == "done" and after.result == {"reward": 1.0}
    assert reserve == -1  # a finished episode takes no tool calls


def test_a_lapsed_claim_can_be_taken_again(redis_server_url):
    """A scorer killed mid-way stops refreshing its claim: it lapses and another request claims."""

    async def body(store):
        await store.create("e1", SPEC, 5, 60_000, 10)
        first = await store.claim("e1", "dead", 100, 60_000)
        busy = await store.claim("e1", "next", 100, 60_000)
        await asyncio.sleep(0.25)
        taken = await store.claim("e1", "next", 100, 60_000)
        stale_extend = await store.extend("e1", "dead", 100)
        return first.outcome, busy.outcome, taken.outcome, stale_extend

    assert run(redis_server_url, body) == ("claimed", "busy", "claimed", False)


def test_open_episodes_per_client_are_bounded_and_freed_by_finishing_or_expiry(redis_server_url):
    async def body(store):
        made = [await store.create(f"e{i}", SPEC, 5, 60_000, 2) for i in range(3)]
        other_client = await store.create("x", {**SPEC, "client": "c2"}, 5, 60_000, 2)
        await store.claim("e0", "t", 5000, 60_000)
        await store.store("e0", "c1", "t", {"r": 0}, 60_000)
        after_finish = await store.create("e3", SPEC, 5, 60_000, 2)
        await store.delete("e1", "c1")
        after_close = await store.create("e4", SPEC, 5, 200, 2)
        full = await store.create("e5", SPEC, 5, 200, 2)
        await asyncio.sleep(0.3)  # e3 keeps 60 s, e4 expires
        after_expiry = await store.create("e6", SPEC, 5, 60_000, 2)
        gone = await store.load("e4")
        return made, other_client, after_finish, after_close, full, after_expiry, gone

    made, other, after_finish, after_close, full, after_expiry, gone = run(redis_server_url, body)
    assert made == [True, True, False] and other
    assert after_finish and after_close and not full and after_expiry
    assert gone is None


def test_a_tool_call_keeps_the_episode_and_its_place_in_the_clients_count(redis_server_url):
    async def body(store):
        await store.create("e1", SPEC, 5, 400, 1)
        await asyncio.sleep(0.25)
        await store.reserve("e1", 400)
        await asyncio.sleep(0.25)  # past the first expiry, within the refreshed one
        alive = await store.load("e1")
        second = await store.create("e2", SPEC, 5, 400, 1)
        return alive is not None, second

    assert run(redis_server_url, body) == (True, False)
