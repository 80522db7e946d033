"""An engine that replays given model outputs: the agent loop's semantics, tested exactly.

Each script entry is one model turn: a string (tokenized with the real tokenizer, then
`<|im_end|>` appended, as a model that stops would sample it), a list of token ids (sampled
as they are, e.g. a non-canonical tokenization no tokenizer would produce), or an exception
(raised, as a failing engine would). Log-probs are a deterministic function of position, so
tests can check each one landed on the token it belongs to. `delay_s(params, request_id)` gives
each turn a wall-clock duration (episodes of controlled lengths: a long tail, a turn that hangs);
a turn cancelled meanwhile (a deadline) is recorded in `cancelled`, as vLLM aborts its request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from services.rollout.engines.base import Engine, EngineError, Generation, TurnParams

ScriptEntry = str | list[int] | BaseException
Script = Sequence[ScriptEntry] | Callable[[list[int], int], ScriptEntry]
Delay = Callable[[TurnParams, str], float]


class ScriptedEngine(Engine):
    name = "scripted"

    def __init__(
        self,
        tokenizer: Any,
        script: Script,
        *,
        max_model_len: int | None = None,
        append_stop: bool = True,
        delay_s: Delay | None = None,
    ) -> None:
        super().__init__(tokenizer, max_model_len=max_model_len)
        self.script = script
        self.append_stop = append_stop
        self.calls: list[dict[str, Any]] = []  # what each call received (prompt length, params)
        self._turns: dict[str, int] = {}
        self.delay_s = delay_s
        self.cancelled: list[str] = []  # request ids of turns cancelled while they slept

    async def _wait(self, params: TurnParams, request_id: str) -> None:
        delay = self.delay_s(params, request_id) if self.delay_s is not None else 0.0
        try:
            await asyncio.sleep(delay)  # yield, as a real engine does while it samples
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise

    async def _generate(self, prompt_ids: list[int], params: TurnParams, request_id: str) -> Generation:
        await self._wait(params, request_id)
        turn = self._turns.get(request_id, 0)
        self._turns[request_id] = turn + 1
        self.calls.append(
            {"request_id": request_id, "prompt_len": len(prompt_ids), "params": params, "prompt_ids": prompt_ids}
        )
        entry = self.script(prompt_ids, turn) if callable(self.script) else self._entry(turn)
        if isinstance(entry, BaseException):
            raise entry
        if isinstance(entry, str):
            ids = self.tokenizer.encode(entry, add_special_tokens=False)
            if self.append_stop:
                ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        else:
            ids = list(entry)
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        elif not ids or ids[-1] not in self.stop_ids:
            finish = "length"
        start = len(prompt_ids)
        logprobs = [scripted_logprob(start + i) for i in range(len(ids))]
        top = None
        if params.top_logprobs:
            top = [{tid: lp} for tid, lp in zip(ids, logprobs)]
        return Generation(token_ids=ids, logprobs=logprobs, finish=finish, top_logprobs=top)

    def _entry(self, turn: int) -> ScriptEntry:
        if turn >= len(self.script):
            raise EngineError(f"script exhausted after {len(self.script)} turns")
        return self.script[turn]

    async def _load_weights(self, path: str) -> None:
        return None


def scripted_logprob(position: int) -> float:
    """The log-prob the scripted engine reports for the token at `position` of the sequence."""
    return -((position % 97) + 1) / 100.0
