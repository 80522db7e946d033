"""A colocated rollout server's side of time-slicing a GPU with the learner (placement `colocated`).

The learner's rank 0 drives it over HTTP (services/learner/colocate.py), each step:

1. `POST /sleep` before its forward/backward: the engine holds new turns (agents wait in `generate`,
   their tasks stay claimed by this worker), lets the turns in flight finish within the request's
   `timeout_s`, then sleeps (vLLM sleep mode: level 1 moves the weights to host memory and drops the
   KV cache, level 2 drops both). A server that cannot drain in time wakes its gate again and answers
   503: the learner then refuses to train rather than run out of memory.
2. after its optimizer step: `POST /wake {"tags": ["weights"]}`, the new version's tensors by CUDA IPC
   (`POST /weights/ipc`, chunk by chunk, from the learner rank on this GPU), then `POST /wake` for the
   rest (the KV cache): the held turns run on the new version.

While asleep the server refuses other weight loads (files, NCCL): they would load into freed memory.
A learner that restarts finds its servers asleep and wakes them: after level 1 they hold the version
they had; after level 2 their weights are gone, so such a server ends its process (its supervisor
starts a fresh one, which loads the newest files) rather than sample on garbage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.common.schemas import IpcWeights, SleepRequest, WakeRequest
from services.rollout.engines.base import Engine


class SleepError(Exception):
    """A sleep, wake or IPC load the server cannot do, with the HTTP status to answer."""

    def __init__(self, status: int, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.fatal = fatal  # the engine cannot serve again in this process


@dataclass
class SleepState:
    """What a colocated server is doing with its GPU memory, and how long its last changes took."""

    level: int = 0  # 0: awake
    awake: set[str] = field(default_factory=set)  # tags woken since the last sleep
    loading: int | None = None  # the version whose IPC chunks are arriving
    loaded: bool = False  # a whole version arrived since the last sleep
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def asleep(self) -> bool:
        return self.level > 0

    def info(self) -> dict[str, Any]:
        return {
            "asleep": self.asleep,
            "level": self.level,
            "awake_tags": sorted(self.awake),
            "loading": self.loading,
            **self.timings,
        }


async def sleep(engine: Engine, state: SleepState, request: SleepRequest) -> dict[str, Any]:
    """Hold new turns, drain those in flight, free the engine's GPU memory."""
    if not engine.supports_sleep:
        raise SleepError(
            409,
            f"the {engine.name} engine cannot sleep (vLLM on a GPU started with "
            "enable_sleep_mode: colocated placement sets it)",
        )
    if state.asleep:
        return {**state.info(), "slept": False}
    t0 = time.perf_counter()
    try:
        drain_s = await engine.hold(request.timeout_s)
    except TimeoutError as exc:
        raise SleepError(503, f"could not sleep: {exc}; the engine keeps its memory") from None
    try:
        await engine.sleep(request.level)
    except Exception as exc:  # noqa: BLE001 - the engine stays awake and serves again
        engine.release()
        raise SleepError(500, f"vLLM sleep failed: {type(exc).__name__}: {exc}") from exc
    state.level, state.awake, state.loaded = request.level, set(), False
    state.timings = {"drain_s": drain_s, "sleep_s": time.perf_counter() - t0 - drain_s}
    return {**state.info(), "slept": True}


async def wake(engine: Engine, state: SleepState, request: WakeRequest) -> dict[str, Any]:
    """Bring back `request.tags` of the engine's memory; all of it reopens the gate to held turns."""
    if not state.asleep:
        return {**state.info(), "woke": False}
    if request.tags is None and state.loading is not None:
        raise SleepError(409, f"version {state.loading} is still loading: its last chunk has not arrived")
    t0 = time.perf_counter()
    tags = [t for t in (request.tags or ["weights", "kv_cache"]) if t not in state.awake]
    if tags:
        await engine.wake(tags)
    state.awake.update(tags)
    state.timings[f"wake_{'_'.join(tags) or 'none'}_s"] = time.perf_counter() - t0
    if {"weights", "kv_cache"} <= state.awake:
        if state.level == 2 and not state.loaded:
            # level 2 discarded the weights: woken without a version, the engine holds garbage
            raise SleepError(
                503, "woken from a level-2 sleep without new weights: the engine's weights are gone", fatal=True
            )
        state.level = 0
        engine.release()
    return {**state.info(), "woke": True}


async def receive_ipc(engine: Engine, state: SleepState, chunk: IpcWeights) -> dict[str, Any]:
    """One chunk of a version over CUDA IPC, into an engine whose weights are awake (its KV is not yet)."""
    receive = getattr(engine, "receive_ipc", None)
    if receive is None or not engine.supports_sleep:
        raise SleepError(409, f"the {engine.name} engine cannot take weights by CUDA IPC")
    if state.asleep and "weights" not in state.awake:
        raise SleepError(409, 'the engine\'s weights are asleep: POST /wake {"tags": ["weights"]} first')
    if chunk.first:
        state.loading = chunk.version
    elif state.loading != chunk.version:
        raise SleepError(409, f"a chunk of version {chunk.version} without its first chunk (loading: {state.loading})")
    t0 = time.perf_counter()
    body = chunk.model_dump(include={"names", "dtype_names", "shapes", "tensor_sizes", "handles"})
    out = await receive(body, first=chunk.first, last=chunk.last, version=chunk.version)
    if chunk.last:
        state.loading, state.loaded = None, True
    return {"version": chunk.version, "chunk_s": time.perf_counter() - t0, **out}
