"""Episode state in Redis: one hash per episode, a lock while it is scored, a sorted set of each client's
open episodes. Every change that must not race is one Lua script, so two requests at once (two tool calls
on the last unit of budget, two finishes) see one outcome; the service itself keeps nothing, and an
episode outlives a restart of the process that serves it.

Keys under `{prefix}:episodes:`: `<id>` (hash: spec, used, max, status, result, active, and the ledger of its
scoring: claims taken, results stored; expires when idle),
`<id>:lock` (the scoring request's token; short-lived and refreshed while it scores), `client:<name>`
(open episode ids scored by their expiry time, so expired ones drop out of the count).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

# Redis time in ms, the same clock for every service instance.
_NOW = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

# The client's set is named from the episode's own `client` field, so a tool call needs no read before it.
_TOUCH = """
local clients = ARGV[3] .. redis.call('HGET', KEYS[1], 'client')
redis.call('HSET', KEYS[1], 'active', now)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', clients, 'XX', now + tonumber(ARGV[1]), ARGV[2])
redis.call('PEXPIRE', clients, ARGV[1])
"""

# KEYS: episode, client set. ARGV: idle ms, id, spec JSON, max tool calls, max open, client.
START = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then return 0 end
redis.call('HSET', KEYS[1], 'spec', ARGV[3], 'used', 0, 'max', ARGV[4], 'status', 'open', 'active', now,
           'client', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""
)

# KEYS: episode, lock. ARGV: idle ms, id, client-set prefix. → {code, used, max}: 1 reserved, 0 unknown,
# -1 finished or being finished, -2 budget spent.
RESERVE = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, 0} end
local used = tonumber(redis.call('HGET', KEYS[1], 'used'))
local max = tonumber(redis.call('HGET', KEYS[1], 'max'))
if redis.call('HGET', KEYS[1], 'status') ~= 'open' or redis.call('EXISTS', KEYS[2]) == 1 then
  return {-1, used, max}
end
if used >= max then return {-2, used, max} end
used = redis.call('HINCRBY', KEYS[1], 'used', 1)
"""
    + _TOUCH
    + """
return {1, used, max}
"""
)

# KEYS: episode. Gives back a reserved call that never ran (the sandbox was away).
REFUND = """
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('HGET', KEYS[1], 'status') == 'open'
   and tonumber(redis.call('HGET', KEYS[1], 'used')) > 0 then
  return redis.call('HINCRBY', KEYS[1], 'used', -1)
end
return -1
"""

# KEYS: episode, lock. ARGV: token, lock ms, idle ms. → {'missing'} | {'done', result} | {'busy'} | {'claimed'}
CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local result = redis.call('HGET', KEYS[1], 'result')
if result then return {'done', result} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('HINCRBY', KEYS[1], 'claims', 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'claimed'}
end
return {'busy'}
"""

# KEYS: lock. ARGV: token, lock ms. Keeps a scoring request's claim while it works.
EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: lock. ARGV: token.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: episode, lock, client set. ARGV: token, result JSON, keep ms, id. The first result stored is the
# episode's for good. → {'missing'} | {'done', result}
STORE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local result = redis.call('HGET', KEYS[1], 'result')
if not result then
  result = ARGV[2]
  redis.call('HSET', KEYS[1], 'status', 'finished', 'result', result)
  redis.call('HINCRBY', KEYS[1], 'stores', 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  redis.call('ZREM', KEYS[3], ARGV[4])
end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return {'done', result}
"""


@dataclass
class StoredEpisode:
    episode_id: str
    spec: dict[str, Any]
    used: int
    max_tool_calls: int
    status: str
    result: dict[str, Any] | None
    ttl_ms: int


@dataclass
class Reservation:
    code: int  # 1 reserved, 0 unknown, -1 finished (or being finished), -2 budget spent
    used: int
    max_tool_calls: int


@dataclass
class Claim:
    outcome: str  # missing | done | busy | claimed
    result: dict[str, Any] | None = None


class EpisodeStore:
    """The Redis side of the episode API (asyncio)."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.redis = client
        self.prefix = f"{prefix}:episodes:"
        self._start = client.register_script(START)
        self._reserve = client.register_script(RESERVE)
        self._refund = client.register_script(REFUND)
        self._claim = client.register_script(CLAIM)
        self._extend = client.register_script(EXTEND)
        self._release = client.register_script(RELEASE)
        self._store = client.register_script(STORE)

    def key(self, episode_id: str) -> str:
        return self.prefix + episode_id

    def lock_key(self, episode_id: str) -> str:
        return self.prefix + episode_id + ":lock"

    def client_key(self, client: str) -> str:
        return self.prefix + "client:" + client

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def create(
        self, episode_id: str, spec: dict[str, Any], max_tool_calls: int, idle_ms: int, max_open: int
    ) -> bool:
        """False when the client already has `max_open` open episodes."""
        created = await self._start(
            keys=[self.key(episode_id), self.client_key(spec["client"])],
            args=[idle_ms, episode_id, json.dumps(spec), max_tool_calls, max_open, spec["client"]],
        )
        return bool(created)

    async def load(self, episode_id: str) -> StoredEpisode | None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.key(episode_id))
            pipe.pttl(self.key(episode_id))
            fields, ttl = await pipe.execute()
        if not fields or b"spec" not in fields:
            return None
        result = fields.get(b"result")
        return StoredEpisode(
            episode_id,
            json.loads(fields[b"spec"]),
            int(fields.get(b"used", 0)),
            int(fields.get(b"max", 0)),
            fields.get(b"status", b"open").decode(),
            json.loads(result) if result else None,
            int(ttl),
        )

    async def reserve(self, episode_id: str, idle_ms: int) -> Reservation:
        """One tool call of the episode's budget, taken atomically; refreshes its idle expiry."""
        code, used, max_calls = await self._reserve(
            keys=[self.key(episode_id), self.lock_key(episode_id)], args=[idle_ms, episode_id, self.client_key("")]
        )
        return Reservation(int(code), int(used), int(max_calls))

    async def refund(self, episode_id: str) -> None:
        await self._refund(keys=[self.key(episode_id)])

    async def claim(self, episode_id: str, token: str, lock_ms: int, idle_ms: int) -> Claim:
        reply = await self._claim(
            keys=[self.key(episode_id), self.lock_key(episode_id)], args=[token, lock_ms, idle_ms]
        )
        outcome = reply[0].decode()
        return Claim(outcome, json.loads(reply[1]) if outcome == "done" else None)

    async def extend(self, episode_id: str, token: str, lock_ms: int) -> bool:
        return bool(await self._extend(keys=[self.lock_key(episode_id)], args=[token, lock_ms]))

    async def release(self, episode_id: str, token: str) -> None:
        await self._release(keys=[self.lock_key(episode_id)], args=[token])

    async def store(
        self, episode_id: str, client: str, token: str, result: dict[str, Any], keep_ms: int
    ) -> dict[str, Any] | None:
        """The episode's result: `result`, or the one stored before it; None when the episode is gone."""
        reply = await self._store(
            keys=[self.key(episode_id), self.lock_key(episode_id), self.client_key(client)],
            args=[token, json.dumps(result), keep_ms, episode_id],
        )
        return json.loads(reply[1]) if reply[0] == b"done" else None

    async def delete(self, episode_id: str, client: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key(episode_id), self.lock_key(episode_id))
            pipe.zrem(self.client_key(client), episode_id)
            await pipe.execute()
