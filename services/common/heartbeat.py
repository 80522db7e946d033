"""Stream workers' heartbeats: proof that a consumer is reading its stream, on any Redis version.

XINFO CONSUMERS cannot tell a live worker on every Redis: its `idle` resets on each XREADGROUP only
from Redis 7.2, and on 7.0 it grows while a worker polls an empty stream. So each consumer stamps its
name, with the Redis server's clock, into one sorted set per stream and group every few seconds while
it reads (`Heartbeat.beat`); a consumer whose stamp is older than `ALIVE_S` is not working: dead, or
held back because a dependency it needs is down (the rollout worker reads nothing while the sandbox
is down or its weights cannot load).

    python -m services.common.heartbeat STREAM GROUP   # exit 0 while a consumer of this host beats

is the container health check of the stream workers (STREAM without the STAR_STREAM_PREFIX).
"""

from __future__ import annotations

import socket
import sys
import time

import redis

ALIVE_S = 60.0  # a consumer whose last beat is older is not working
BEAT_EVERY_S = 5.0  # how often a reading consumer writes its beat
KEEP_S = 24 * 3600  # beats older than this are dropped from the set

# ZADD with the server's clock (every client agrees on it), dropping beats past KEEP_S.
_BEAT = """
local now = tonumber(redis.call('TIME')[1])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return now
"""


def beats_key(stream: str, group: str) -> str:
    """The sorted set of `group`'s consumers on `stream`, scored by their last beat (server seconds)."""
    return f"{stream}:alive:{group}"


class Heartbeat:
    """One consumer's beat, written at most every `every_s`; a Redis that does not answer skips it."""

    def __init__(
        self, client: redis.Redis, stream: str, group: str, consumer: str, every_s: float = BEAT_EVERY_S
    ) -> None:
        self.client = client
        self.key = beats_key(stream, group)
        self.consumer = consumer
        self.every_s = every_s
        self._last = float("-inf")

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        try:
            self.client.eval(_BEAT, 1, self.key, self.consumer, int(KEEP_S))
        except (redis.ConnectionError, redis.TimeoutError):
            return  # the worker's own loop waits for Redis; the beat comes with it
        self._last = now


def live_consumers(client: redis.Redis, stream: str, group: str, alive_s: float = ALIVE_S) -> list[str]:
    """The consumers of `group` on `stream` that beat within `alive_s`, by the server's clock."""
    now = client.time()[0]
    return [
        m.decode() if isinstance(m, bytes) else m
        for m in client.zrangebyscore(beats_key(stream, group), now - alive_s, "+inf")
    ]


def last_beat_age(client: redis.Redis, stream: str, group: str) -> float | None:
    """Seconds since any consumer of `group` beat (None: none ever did)."""
    newest = client.zrevrange(beats_key(stream, group), 0, 0, withscores=True)
    return float(client.time()[0] - newest[0][1]) if newest else None


def of_host(consumer: str, host: str) -> bool:
    """Is `consumer` named for `host`? The workers name theirs `[role-]HOST-PID[-N]`."""
    return consumer.startswith(f"{host}-") or f"-{host}-" in consumer


def main(argv: list[str] | None = None) -> int:
    """Health check: 0 while a consumer of this host beats on STREAM (prefixed) for GROUP, else 1."""
    from services.common.settings import get_settings

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m services.common.heartbeat STREAM GROUP  (e.g. tasks rollout)", file=sys.stderr)
        return 2
    settings = get_settings()
    stream, group = f"{settings.stream_prefix}:{args[0]}", args[1]
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=3, socket_connect_timeout=3)
        live = live_consumers(client, stream, group)
    except redis.RedisError as exc:
        print(f"redis: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    host = socket.gethostname()
    mine = [c for c in live if of_host(c, host)]
    if not mine:
        print(f"no consumer of {host} has read {stream} (group {group}) within {ALIVE_S:.0f} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
