"""Redis Streams with consumer groups: how tasks, trajectories and scores move between services.

The guarantees the RL loop relies on (docs/architecture.md, "One RL step"):
- at-least-once delivery inside a group: a message stays pending until acknowledged, and a
  consumer that died is relieved of it by `XAUTOCLAIM` after `claim_idle_ms`;
- exactly-once hand-off between stages: `forward` writes the result downstream and acknowledges
  the input in one MULTI/EXEC transaction, so a crash leaves either both or neither;
- poison messages end: after `max_deliveries` attempts a message moves to `<stream>:dead`
  with its error and is acknowledged, so it cannot block the group. A message whose handler
  kills the process (no failure is ever recorded) is buried when it comes round once more than
  `max_deliveries` times, so the workers that take it in turn do not crash-loop;
- a message being worked on is claimed again every `claim_idle_ms / 3` (`ClaimKeeper`), so a
  slow but live consumer is never robbed of it (which would process it twice);
- a reading consumer proves it is alive with a heartbeat (`services.common.heartbeat`), the same on
  every Redis version, and so does one working on a message;
- bounded state: once every group on a stream has acknowledged an entry it is trimmed
  (`trim_consumed`, XTRIM MINID), and dead-letter streams keep their last `DEAD_LETTERS_KEPT`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import redis
from pydantic import BaseModel

from services.common.heartbeat import BEAT_EVERY_S, Heartbeat
from services.common.settings import get_settings

log = logging.getLogger(__name__)

# Field under which every payload travels; one JSON document per stream entry.
PAYLOAD = b"payload"
DEAD_LETTERS_KEPT = 10_000  # approximate cap of each `<stream>:dead`
TRIM_EVERY_S = 1.0  # how often a worker trims its input stream


@dataclass(frozen=True)
class StreamNames:
    """The pipeline's streams; a prefix keeps runs (and tests) apart on one Redis."""

    prefix: str = "star"

    @property
    def tasks(self) -> str:
        return f"{self.prefix}:tasks"

    @property
    def trajectories(self) -> str:
        return f"{self.prefix}:trajectories"

    @property
    def scored(self) -> str:
        return f"{self.prefix}:scored"

    @property
    def weights_latest(self) -> str:
        """A plain key (not a stream) holding the latest published WeightsUpdate as JSON."""
        return f"{self.prefix}:weights:latest"

    @property
    def weights_version(self) -> str:
        """A plain key: the newest version the learner has published by any path. Over NCCL most
        versions reach the engines with no files written, so `weights_latest` (the newest version
        that has files) may be older; the learner writes this one after each publication."""
        return f"{self.prefix}:weights:version"

    @property
    def weights_highest(self) -> str:
        """A plain key: the highest version number published in this run by any process, never lowered
        (`weights_version` may be: a restarted learner records its own there). A learner gives every
        new version a number above it, so no number ever names two sets of weights."""
        return f"{self.prefix}:weights:highest"

    @property
    def weights_wanted(self) -> str:
        """A plain key: set (for a minute) by a rollout worker that lacks `weights_version` and has no
        files of it to load, asking the learner to send its current version again."""
        return f"{self.prefix}:weights:wanted"

    @property
    def learner_batches(self) -> str:
        """A plain key: step batches the learner has consumed, trained or skipped (the controller paces on it)."""
        return f"{self.prefix}:learner:batches"

    @staticmethod
    def dead(stream: str) -> str:
        return f"{stream}:dead"

    @staticmethod
    def consumer_group(stream: str) -> str | None:
        """The group of the pipeline's stage that consumes `stream` (None for other streams): its
        entries must wait for that group even before the stage's first worker has created it."""
        return PIPELINE_GROUPS.get(stream.rsplit(":", 1)[-1])


# Who consumes each pipeline stream (services/rollout/worker.py, reward/worker.py, the learner).
PIPELINE_GROUPS = {"tasks": "rollout", "trajectories": "reward", "scored": "learner"}


STREAMS = StreamNames()


@dataclass
class StreamMessage:
    stream: str
    id: str
    data: dict[str, Any]
    deliveries: int = 1

    @property
    def raw_error(self) -> str | None:
        return self.data.get("_error") if isinstance(self.data, dict) else None


def encode(payload: BaseModel | Mapping[str, Any]) -> bytes:
    if isinstance(payload, BaseModel):
        return orjson.dumps(payload.model_dump(mode="json"))
    return orjson.dumps(payload)


def decode(fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    raw = fields.get(PAYLOAD)
    if raw is None:
        raise ValueError(f"stream entry has no {PAYLOAD.decode()!r} field")
    value = orjson.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("stream payload is not a JSON object")
    return value


def publish(client: redis.Redis, stream: str, payload: BaseModel | Mapping[str, Any], maxlen: int | None = None) -> str:
    """Append one payload; returns the entry id. `maxlen` trims approximately (old entries)."""
    kwargs = {"maxlen": maxlen, "approximate": True} if maxlen else {}
    entry_id = client.xadd(stream, {PAYLOAD: encode(payload)}, **kwargs)
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def ensure_group(client: redis.Redis, stream: str, group: str, start: str = "0") -> None:
    """Create the group (and the stream) if missing; `start="0"` reads what was published before."""
    try:
        client.xgroup_create(stream, group, id=start, mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def stream_depth(client: redis.Redis, stream: str, group: str) -> dict[str, int]:
    """Entries not yet delivered to the group (lag) and delivered but unacknowledged (pending)."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return {"length": 0, "pending": 0, "lag": 0}
    length = client.xlen(stream)
    for g in groups:
        name = g.get("name") or g.get(b"name")
        if (name.decode() if isinstance(name, bytes) else name) == group:
            lag = g.get("lag")
            return {
                "length": length,
                "pending": int(g.get("pending") or 0),
                "lag": int(lag) if lag is not None else length,
            }
    return {"length": length, "pending": 0, "lag": length}


class StreamConsumer:
    """One consumer of a group on one stream."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        *,
        claim_idle_ms: int = 60_000,
        max_deliveries: int = 3,
        start: str = "0",
    ) -> None:
        if max_deliveries < 1:
            raise ValueError("max_deliveries must be at least 1")
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self._backlog: list[StreamMessage] | None = None
        self.heartbeat = Heartbeat(client, stream, group, consumer)
        ensure_group(client, stream, group, start)

    # -- reading ---------------------------------------------------------------------------

    def read(self, count: int = 1, block_ms: int | None = 1000) -> list[StreamMessage]:
        """Messages to work on: first those a dead consumer left pending too long, then new ones.

        Our own pending messages (from before a restart under the same consumer name) are
        re-read first as well, so a restarted worker finishes what it had started."""
        self.heartbeat.beat()
        messages = self._own_pending(count)
        if len(messages) < count:
            messages += self._claim_stale(count - len(messages))
        if len(messages) < count:
            messages += self._read_new(count - len(messages), block_ms if not messages else None)
        return messages

    def _own_pending(self, count: int) -> list[StreamMessage]:
        # Once, at start: what this consumer name held when it last stopped. Later failures are
        # retried through _claim_stale after claim_idle_ms, which also counts the deliveries.
        if self._backlog is None:
            reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: "0"})
            self._backlog = self._messages(reply[0][1] if reply else [])
        taken, self._backlog = self._backlog[:count], self._backlog[count:]
        return taken

    def _claim_stale(self, count: int) -> list[StreamMessage]:
        reply = self.client.xautoclaim(
            self.stream, self.group, self.consumer, min_idle_time=self.claim_idle_ms, start_id="0-0", count=count
        )
        entries = reply[1] if len(reply) > 1 else []
        return self._messages(entries)

    def _read_new(self, count: int, block_ms: int | None) -> list[StreamMessage]:
        reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        entries = reply[0][1] if reply else []
        return self._messages(entries)

    def _messages(self, entries: list) -> list[StreamMessage]:
        out: list[StreamMessage] = []
        ids = []
        for entry_id, fields in entries:
            if fields is None:  # deleted while pending: nothing to do but acknowledge
                self.client.xack(self.stream, self.group, entry_id)
                continue
            entry = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            try:
                data = decode(fields)
            except (ValueError, orjson.JSONDecodeError) as exc:
                self._bury(
                    entry,
                    {"_raw": fields.get(PAYLOAD, b"")[:2000].decode(errors="replace")},
                    f"undecodable payload: {exc}",
                )
                continue
            out.append(StreamMessage(self.stream, entry, data))
            ids.append(entry)
        for msg, n in zip(out, self._delivery_counts(ids)):
            msg.deliveries = n
        return [m for m in out if not self._over_delivered(m)]

    def _over_delivered(self, msg: StreamMessage) -> bool:
        """Bury a message delivered more than `max_deliveries` times: its earlier attempts ended
        without a recorded failure, i.e. the consumer died holding it (a message that crashes its
        worker), and handing it out again would crash the next one too."""
        if msg.deliveries <= self.max_deliveries:
            return False
        self._bury(
            msg.id,
            msg.data,
            f"delivered {msg.deliveries} times without finishing: its consumers died while holding it",
            msg.deliveries,
        )
        return True

    def _delivery_counts(self, ids: list[str]) -> list[int]:
        counts = []
        for entry in ids:
            info = self.client.xpending_range(self.stream, self.group, min=entry, max=entry, count=1)
            counts.append(int(info[0]["times_delivered"]) if info else 1)
        return counts

    # -- finishing ---------------------------------------------------------------------------

    def ack(self, msg: StreamMessage) -> None:
        self.client.xack(self.stream, self.group, msg.id)

    def is_pending(self, msg: StreamMessage) -> bool:
        """Is `msg` still delivered-but-unacknowledged in this group?"""
        return bool(self.client.xpending_range(self.stream, self.group, min=msg.id, max=msg.id, count=1))

    def forward(
        self,
        msg: StreamMessage,
        out_stream: str,
        payloads: BaseModel | Mapping[str, Any] | list[BaseModel | Mapping[str, Any]],
    ) -> list[str]:
        """Write the result(s) downstream and acknowledge `msg`, atomically."""
        items = payloads if isinstance(payloads, list) else [payloads]
        pipe = self.client.pipeline(transaction=True)
        for item in items:
            pipe.xadd(out_stream, {PAYLOAD: encode(item)})
        pipe.xack(self.stream, self.group, msg.id)
        result = pipe.execute()
        return [r.decode() if isinstance(r, bytes) else r for r in result[:-1]]

    def fail(self, msg: StreamMessage, error: str) -> bool:
        """Record a failed attempt. Returns True when the message was dead-lettered; otherwise it
        stays pending and is retried after `claim_idle_ms` (by us or another consumer)."""
        if msg.deliveries >= self.max_deliveries:
            self._bury(msg.id, msg.data, error, msg.deliveries)
            return True
        log.warning(
            "message failed; will retry",
            extra={"stream": self.stream, "id": msg.id, "deliveries": msg.deliveries, "error": error[:500]},
        )
        return False

    def _bury(self, entry: str, data: dict[str, Any], error: str, deliveries: int = 1) -> None:
        dead = {
            "stream": self.stream,
            "id": entry,
            "group": self.group,
            "error": error[:4000],
            "deliveries": deliveries,
            "payload": data,
            "at": time.time(),
        }
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(
            StreamNames.dead(self.stream), {PAYLOAD: orjson.dumps(dead)}, maxlen=DEAD_LETTERS_KEPT, approximate=True
        )
        pipe.xack(self.stream, self.group, entry)
        pipe.execute()
        log.error("message dead-lettered", extra={"stream": self.stream, "id": entry, "error": error[:500]})


Handler = Callable[[StreamMessage], "BaseModel | Mapping[str, Any] | list | None"]


def run_worker(
    consumer: StreamConsumer,
    handler: Handler,
    out_stream: str | None,
    stop: threading.Event | None = None,
    *,
    batch: int = 1,
    block_ms: int = 1000,
    on_idle: Callable[[], None] | None = None,
    keep_claims: bool = True,
    until_ready: Callable[[], bool] | None = None,
) -> int:
    """Consume until `stop` is set. `handler` returns the payload(s) to forward (acknowledged in the
    same transaction), or None to just acknowledge; an exception counts as a failed attempt.
    From its read until it is settled a message's claim is kept fresh (`ClaimKeeper`), so the last
    message of a batch is not re-claimed by another consumer while the first are handled; consumed
    entries of the input stream are trimmed now and then. `until_ready`, where given, runs before every read
    and blocks while the worker could not handle a message (a dependency is down), so that nothing
    is claimed meanwhile; it returns False when `stop` ends the wait. Returns the number of
    messages handled."""
    stop = stop or threading.Event()
    handled = 0
    keeper = ClaimKeeper(consumer.client, consumer.claim_idle_ms, stop) if keep_claims else None
    trimmed_at = 0.0
    try:
        while not stop.is_set():
            if until_ready is not None and not until_ready():
                continue
            try:
                messages = consumer.read(batch, block_ms)
                if time.monotonic() - trimmed_at >= TRIM_EVERY_S:
                    trimmed_at = time.monotonic()
                    trim_consumed(consumer.client, consumer.stream)
            except REDIS_DOWN as exc:
                log.warning("redis unavailable; retrying", extra={"error": str(exc)})
                stop.wait(1.0)
                continue
            if not messages:
                if on_idle:
                    on_idle()
                continue
            if keeper:  # the whole read from now on: the last of a batch waits while the first are handled
                for msg in messages:
                    keeper.hold(consumer, msg)
            for msg in messages:
                try:
                    result = handler(msg)
                except Exception as exc:  # noqa: BLE001 - any failure is recorded on the message
                    log.exception("handler failed", extra={"stream": consumer.stream, "id": msg.id})
                    _settle(consumer, msg, lambda m=msg, e=exc: consumer.fail(m, f"{type(e).__name__}: {e}"), stop)
                    continue
                finally:
                    if keeper:
                        keeper.release(msg)
                if result is None or out_stream is None:
                    _settle(consumer, msg, lambda m=msg: consumer.ack(m), stop)
                else:
                    _settle(consumer, msg, lambda m=msg, r=result: consumer.forward(m, out_stream, r), stop)
                handled += 1
    finally:
        if keeper:
            keeper.close()
    return handled


class ClaimKeeper:
    """Re-claims the messages its consumers are working on every `claim_idle_ms / 3` (XCLAIM
    JUSTID, which leaves the delivery count alone), so no other consumer's XAUTOCLAIM takes a
    message from a live consumer that is merely slow (a long formatter call, a weight load).
    Meanwhile it keeps those consumers' heartbeats going."""

    def __init__(self, client: redis.Redis, claim_idle_ms: int, stop: threading.Event | None = None) -> None:
        self.client = client
        self.interval_s = max(0.05, claim_idle_ms / 3000.0)
        self._held: dict[str, tuple[StreamConsumer, StreamMessage]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._stop = stop
        self._thread = threading.Thread(target=self._run, name="claim-keeper", daemon=True)
        self._thread.start()

    def hold(self, consumer: StreamConsumer, msg: StreamMessage) -> None:
        with self._lock:
            self._held[msg.id] = (consumer, msg)

    def release(self, msg: StreamMessage) -> None:
        with self._lock:
            self._held.pop(msg.id, None)

    def close(self) -> None:
        self._closed.set()

    def extend(self) -> int:
        """Claim every held message again now; returns how many were extended."""
        with self._lock:
            held = list(self._held.values())
        for consumer, msg in held:
            try:
                self.client.xclaim(
                    consumer.stream,
                    consumer.group,
                    consumer.consumer,
                    min_idle_time=0,
                    message_ids=[msg.id],
                    justid=True,
                )
            except redis.RedisError as exc:
                log.warning("claim not extended", extra={"id": msg.id, "error": str(exc)})
        return len(held)

    def beat(self) -> None:
        """The heartbeat of each consumer holding a message (it reads nothing while it works)."""
        with self._lock:
            consumers = {id(c): c for c, _ in self._held.values()}
        for consumer in consumers.values():
            consumer.heartbeat.beat()

    def _run(self) -> None:
        extended = time.monotonic()
        while not self._closed.wait(min(self.interval_s, BEAT_EVERY_S)):
            if self._stop is not None and self._stop.is_set():
                return
            self.beat()
            if time.monotonic() - extended >= self.interval_s:
                extended = time.monotonic()
                self.extend()


def _next_id(entry: str) -> str:
    ms, _, seq = entry.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def as_text(value: Any) -> str:
    """A Redis reply's bytes (or anything) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def consumed_below(client: redis.Redis, stream: str) -> str | None:
    """The smallest entry id some group on `stream` still needs (its oldest pending entry, else
    the first one after its last delivered); everything below it has been acknowledged by every
    group. None when the stream has no group (nobody has said what they consumed), or when it is
    a pipeline stream whose stage's group does not exist yet (an audit group alone must not let
    the tasks go before a rollout worker has joined)."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return None
    if not groups:
        return None
    required = StreamNames.consumer_group(stream)
    if required and required not in {as_text(g.get("name") or g.get(b"name")) for g in groups}:
        return None  # its consumers have not joined yet: nothing is consumed
    floor: tuple[int, int] | None = None
    for g in groups:
        name = as_text(g.get("name") or g.get(b"name"))
        oldest = client.xpending(stream, name)["min"] if int(g.get("pending") or 0) else None
        if oldest is not None:
            needed = as_text(oldest)
        else:  # nothing pending (or acknowledged since XINFO said otherwise): all it read is done
            needed = _next_id(as_text(g.get("last-delivered-id") or g.get(b"last-delivered-id") or "0-0"))
        key = tuple(int(x) for x in needed.split("-"))
        floor = key if floor is None or key < floor else floor
    return f"{floor[0]}-{floor[1]}"


def trim_consumed(client: redis.Redis, stream: str) -> int:
    """Delete the entries every group on `stream` has acknowledged; returns how many went."""
    floor = consumed_below(client, stream) if get_settings().stream_trim else None
    if floor is None or floor == "0-1":
        return 0
    return int(client.xtrim(stream, minid=floor, approximate=False))


REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)  # BusyLoadingError (AOF replay) is a ConnectionError


def _settle(consumer: StreamConsumer, msg: StreamMessage, finish: Callable[[], Any], stop: threading.Event) -> None:
    """Acknowledge/forward/fail `msg`, riding out a Redis outage instead of losing the result.

    When the connection drops during the transaction, its reply is lost but it may have been
    applied: before trying again, the pending list says whether it was (acknowledged = done), so
    a retry never writes the result twice. If the worker is stopped first, the message stays
    pending and is reclaimed later: nothing is lost either way."""
    attempt = 0
    while True:
        try:
            if attempt and not consumer.is_pending(msg):
                return
            finish()
            return
        except REDIS_DOWN as exc:
            attempt += 1
            log.warning(
                "redis unavailable while settling a message; retrying",
                extra={"stream": consumer.stream, "id": msg.id, "attempt": attempt, "error": str(exc)},
            )
            if stop.wait(min(0.5 * attempt, 5.0)):
                return


def until_redis(
    action: Callable[[], Any], stop: threading.Event | None = None, what: str = "redis call", max_wait_s: float = 5.0
) -> Any:
    """Run `action` until it does not fail for want of Redis (or `stop` is set: returns None).
    For writes that are idempotent (SET, XACK) in processes that must outlive a Redis restart."""
    attempt = 0
    while True:
        try:
            return action()
        except REDIS_DOWN as exc:
            attempt += 1
            log.warning(f"redis unavailable ({what}); retrying", extra={"attempt": attempt, "error": str(exc)})
            if stop is not None and stop.is_set():
                return None
            time.sleep(min(0.5 * attempt, max_wait_s))


def read_all(client: redis.Redis, stream: str) -> list[tuple[str, dict[str, Any]]]:
    """Every entry of a stream, oldest first (inspection and tests)."""
    out = []
    for entry_id, fields in client.xrange(stream):
        out.append((entry_id.decode() if isinstance(entry_id, bytes) else entry_id, decode(fields)))
    return out
