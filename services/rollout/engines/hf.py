"""transformers in-process with continuous batching: the CPU demo/test engine and a GPU fallback.

Rows join and leave the running batch between decode steps. A request that arrives while others
decode is prefilled on its own (with whatever else arrived with it), its KV cache is left-padded to
the running batch's length and stacked onto it, and from the next step it decodes with the rest; a
row that samples a stop token or reaches its `max_tokens` is answered at once and dropped from the
cache. So an agent's 60-token tool call never waits behind another agent's 500-token plan, which is
what a static batch (run until its longest row ends) made every turn do.

An agent's next turn repeats its last turn's context and adds the sampled tokens and the tool's
reply (token-in/token-out). A retired row's KV cache is kept (a few, least recently used first)
and a request that extends one prefills only its new tokens: without it every turn prefilled the
whole context again, and each such admission stalled every running row (bench/results/gpu_proof.md).
New weights drop the kept caches, which the old policy computed.

The sampling loop is ours rather than `model.generate` because each row needs its own seed, its
own `max_tokens`, and the raw log-prob (and top-k) of the token it sampled. Sampling runs on the
model's device; decoding runs in a worker thread, so the event loop keeps serving tool calls.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.rollout.engines.base import Engine, EngineError, Generation, TurnParams

STEPS_PER_TICK = 4  # decode steps between admissions: joiners wait at most this long
STATS_EVERY_S = 30.0  # how often the engine logs where its time went

log = logging.getLogger(__name__)


@dataclass
class _Window:
    """Where the decoding thread's time went since the last log line."""

    started: float = field(default_factory=time.perf_counter)
    decode_steps: int = 0
    row_steps: int = 0       # rows decoded, summed over steps: tokens sampled by decode steps
    decode_s: float = 0.0
    admit_s: float = 0.0     # prefill, stacking onto the batch, and retiring rows
    admitted: int = 0

    def line(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self.started, 1e-9)
        steps = max(self.decode_steps, 1)
        return {"window_s": round(wall, 1), "rows_mean": round(self.row_steps / steps, 1),
                "decode_ms_per_step": round(1000 * self.decode_s / steps, 1),
                "tokens_per_s": round(self.row_steps / wall, 1), "admitted": self.admitted,
                "decode_share": round(self.decode_s / wall, 3), "admit_share": round(self.admit_s / wall, 3)}


def attention_backends():
    """SDPA kernels for decoding: any but cuDNN's. cuDNN builds an execution plan per new shape,
    and a decode step's key length is new every step: on an H100 that plan cost 2 ms of host time
    per layer per step (65 of a 94 ms step for a 30-layer model; bench/results/decode_probe.md)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@dataclass
class _Request:
    prompt_ids: list[int]
    params: TurnParams
    future: asyncio.Future


@dataclass
class _Row:
    """One request being decoded: what it sampled so far and the generator that draws for it."""

    request: _Request
    generator: Any
    limit: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    done: bool = False


@dataclass
class _Prefix:
    """A retired row's KV cache: the tokens it covers and per layer (keys, values), [1, H, T, D]."""

    ids: tuple[int, ...]
    layers: list[tuple[Any, Any]]


class _Batch:
    """The running batch: rows, their shared left-padded KV cache and 2-D attention mask, each
    row's next position, and the token each row sampled last (fed at the next step)."""

    def __init__(self) -> None:
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.attention: Any = None   # [rows, cache length], 1 on real tokens, 0 on left padding
        self.positions: Any = None   # [rows] position of the pending token
        self.pending: Any = None     # [rows] last sampled token, not yet in the cache


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model: str | Path, *, max_model_len: int = 32768, max_batch: int = 16,
                 dtype: str | None = None, device: str | None = None, policy_version: int = 0, tokenizer: Any = None,
                 continuous: bool = True, prefix_cache: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
        super().__init__(tokenizer, policy_version=policy_version, max_model_len=max_model_len)
        self.torch = torch
        # On a GPU machine decode there: the CPU is the fallback, not the default.
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = device
        # bf16 where it is fast (as vLLM serves and the learner trains); CPU bf16 matmuls are slow
        self.dtype = getattr(torch, dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(str(model), dtype=self.dtype).to(device).eval()
        self.weights_path = str(model)
        self.max_batch = max_batch
        # False: admit only into an empty batch (static batching; kept as the benchmark's baseline)
        self.continuous = continuous
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._model_lock = threading.Lock()
        self.batches: list[int] = []  # sizes of the groups admitted (prefilled) together, for tests and metrics
        # retired rows' KV caches kept for their agents' next turns (0: off); default one per batch row
        self.prefix_cache = max_batch if prefix_cache is None else prefix_cache
        self._prefixes: OrderedDict[tuple[int, ...], _Prefix] = OrderedDict()
        self.prefill_tokens = 0  # prompt tokens actually run through the model (for tests and metrics)
        self.reused_tokens = 0   # prompt tokens taken from a kept cache instead
        self._window = _Window()

    async def _generate(self, prompt_ids: list[int], params: TurnParams, request_id: str) -> Generation:
        if self.max_model_len and len(prompt_ids) + 1 > self.max_model_len:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens leaves no room in {self.max_model_len}")
        loop = asyncio.get_running_loop()
        if self._queue is None or self._loop is not loop:
            # One scheduler per event loop (a CLI or test may run several loops one after another).
            self._loop, self._queue = loop, asyncio.Queue()
            self._worker = loop.create_task(self._scheduler())
        future = loop.create_future()
        await self._queue.put(_Request(prompt_ids, params, future))
        return await future

    async def _scheduler(self) -> None:
        queue = self._queue
        assert queue is not None
        batch = _Batch()
        while True:
            joining: list[_Request] = []
            if not batch.rows:
                joining.append(await queue.get())
                await asyncio.sleep(0)  # let requests issued in the same tick join together
            if joining or self.continuous:
                while not queue.empty() and len(batch.rows) + len(joining) < self.max_batch:
                    joining.append(queue.get_nowait())
            if joining:
                self.batches.append(len(joining))
            try:
                finished = await asyncio.to_thread(self._tick, batch, joining)
            except Exception as exc:  # noqa: BLE001 - every waiting request learns why
                error = EngineError(f"transformers: {type(exc).__name__}: {exc}")
                for r in [row.request for row in batch.rows] + joining:
                    if not r.future.done():
                        r.future.set_exception(error)
                batch = _Batch()
                continue
            for row in finished:
                if not row.request.future.done():
                    row.request.future.set_result(_generation(row, self.stop_ids))

    def _tick(self, batch: _Batch, joining: list[_Request]) -> list[_Row]:
        """Admit `joining`, then decode a few steps; returns the rows that finished."""
        torch = self.torch
        w = self._window
        with self._model_lock, torch.inference_mode(), attention_backends():
            finished: list[_Row] = []
            if joining:
                t0 = time.perf_counter()
                finished += self._admit(batch, joining)
                w.admit_s += time.perf_counter() - t0
                w.admitted += len(joining)
            for _ in range(STEPS_PER_TICK):
                if not batch.rows:
                    break
                t0, rows = time.perf_counter(), len(batch.rows)
                finished += self._decode_step(batch)  # ends in a host read: the time is the GPU's too
                w.decode_s += time.perf_counter() - t0
                w.decode_steps += 1
                w.row_steps += rows
                if finished:
                    break  # answer them now rather than after the remaining steps
        if time.perf_counter() - w.started >= STATS_EVERY_S:
            fields = {**w.line(), "rows": len(batch.rows), "kept_caches": len(self._prefixes)}
            # in the message, not only in `extra`: the services' plain-text logs print no extras
            log.info("transformers engine: " + " ".join(f"{k}={v}" for k, v in fields.items()), extra=fields)
            self._window = _Window()
        return finished

    # -- admission -------------------------------------------------------------------------------

    def _admit(self, batch: _Batch, joining: list[_Request]) -> list[_Row]:
        """Prefill the joiners (those extending a kept cache on it, the rest from scratch), sample
        their first token, stack them onto the batch."""
        torch = self.torch
        rows = []
        for r in joining:
            g = torch.Generator(device=self.device)
            g.manual_seed(r.params.seed if r.params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
            rows.append(_Row(r, g, min(r.params.max_tokens, (self.max_model_len or 10**9) - len(r.prompt_ids))))
        live = [row for row in rows if row.limit > 0]
        empty = [row for row in rows if row.limit <= 0]
        for row in empty:
            row.done = True
        if not live:
            return empty
        reuse = [(row, self._take_prefix(row.request.prompt_ids)) for row in live]
        extending = [(row, p) for row, p in reuse if p is not None]
        fresh = [row for row, p in reuse if p is None]
        if extending:
            self._prefill_on_prefixes(batch, extending)
        if fresh:
            self._prefill(batch, fresh)
        return empty + self._retire(batch)

    def _prefill(self, batch: _Batch, live: list[_Row]) -> None:
        """Prefill whole prompts, left-padded to the longest."""
        torch = self.torch
        width = max(len(row.request.prompt_ids) for row in live)
        input_ids = torch.full((len(live), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(live), width), dtype=torch.long)
        for i, row in enumerate(live):
            p = row.request.prompt_ids
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        position = (attention.cumsum(-1) - 1).clamp(min=0)
        attention, position = attention.to(self.device), position.to(self.device)
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention, position_ids=position,
                         use_cache=True, logits_to_keep=1)  # the prompt's own logits are never needed
        self.prefill_tokens += int(attention.sum())
        tokens = self._sample(live, out.logits[:, -1, :])
        _stack(batch, live, out.past_key_values, attention, position[:, -1] + 1, tokens, torch)

    def _prefill_on_prefixes(self, batch: _Batch, extending: list[tuple[_Row, _Prefix]]) -> None:
        """Prefill only what each prompt adds to its kept cache. The kept caches are left-padded
        to one length P and the new tokens to one length S; the mask has a hole between a row's
        cache and its new tokens, which attention skips like any padding."""
        from transformers import DynamicCache

        torch = self.torch
        P = max(len(p.ids) for _, p in extending)
        S = max(len(row.request.prompt_ids) - len(p.ids) for row, p in extending)
        n = len(extending)
        input_ids = torch.full((n, S), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, P + S), dtype=torch.long)
        position = torch.zeros((n, S), dtype=torch.long)
        for i, (row, p) in enumerate(extending):
            k, new = len(p.ids), row.request.prompt_ids[len(p.ids):]
            attention[i, P - k:P] = 1
            attention[i, P + S - len(new):] = 1
            input_ids[i, S - len(new):] = torch.tensor(new)
            position[i, S - len(new):] = torch.arange(k, k + len(new))
            position[i, :S - len(new)] = k  # padding: any valid position, it is masked
        cache = DynamicCache()
        for layer in range(len(extending[0][1].layers)):
            keys = torch.cat([_left_pad(p.layers[layer][0], P, torch) for _, p in extending], 0)
            values = torch.cat([_left_pad(p.layers[layer][1], P, torch) for _, p in extending], 0)
            cache.update(keys, values, layer)
        attention, position = attention.to(self.device), position.to(self.device)
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention, position_ids=position,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.prefill_tokens += int(attention[:, P:].sum())
        self.reused_tokens += sum(len(p.ids) for _, p in extending)
        rows = [row for row, _ in extending]
        tokens = self._sample(rows, out.logits[:, -1, :])
        _stack(batch, rows, out.past_key_values, attention, position[:, -1] + 1, tokens, torch)

    # -- kept caches -----------------------------------------------------------------------------

    def _take_prefix(self, prompt: list[int]) -> _Prefix | None:
        """The longest kept cache whose tokens start `prompt` and leave at least one token to run;
        it leaves the store (the row that extends it will be kept in its place)."""
        best = None
        for key in self._prefixes:
            if len(key) < len(prompt) and (best is None or len(key) > len(best)) and tuple(prompt[:len(key)]) == key:
                best = key
        return self._prefixes.pop(best) if best is not None else None

    def _keep_prefix(self, batch: _Batch, i: int, row: _Row) -> None:
        """Keep row i's cache: its prompt and every sampled token but the last (never fed back)."""
        ids = tuple(row.request.prompt_ids) + tuple(row.ids[:-1])
        real = batch.attention[i].bool()
        if int(real.sum()) != len(ids):
            return  # should not happen; never keep a cache that does not match its tokens
        layers = [(layer.keys[i][:, real].unsqueeze(0), layer.values[i][:, real].unsqueeze(0))
                  for layer in batch.cache.layers]
        self._prefixes[ids] = _Prefix(ids, layers)
        while len(self._prefixes) > self.prefix_cache:
            self._prefixes.popitem(last=False)

    # -- decoding --------------------------------------------------------------------------------

    def _decode_step(self, batch: _Batch) -> list[_Row]:
        torch = self.torch
        n = len(batch.rows)
        batch.attention = torch.cat([batch.attention, torch.ones((n, 1), dtype=torch.long, device=self.device)], 1)
        out = self.model(input_ids=batch.pending[:, None], attention_mask=batch.attention,
                         position_ids=batch.positions[:, None], past_key_values=batch.cache, use_cache=True,
                         logits_to_keep=1)
        batch.cache = out.past_key_values
        batch.positions = batch.positions + 1
        batch.pending = self._sample(batch.rows, out.logits[:, -1, :])
        return self._retire(batch)

    def _sample(self, rows: list[_Row], logits: Any) -> Any:
        """Draw one token per row (each with its own generator) and record its raw log-prob."""
        torch = self.torch
        logits = logits.float()
        raw = torch.log_softmax(logits, dim=-1)
        tokens = _draw(torch, logits, [row.request.params for row in rows], [row.generator for row in rows])
        chosen = raw.gather(1, tokens[:, None])[:, 0].tolist()
        top_k = max(row.request.params.top_logprobs for row in rows)
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        if top_k:  # one host read for all rows' alternatives, not one per row
            values, indices = raw.topk(top_k, dim=-1)
            top_ids, top_lps = indices.tolist(), values.tolist()
        stop = self.stop_ids
        for i, (row, tid) in enumerate(zip(rows, tokens.tolist())):
            row.ids.append(tid)
            row.logprobs.append(chosen[i])
            k = row.request.params.top_logprobs
            if k:
                row.top.append(dict(zip(top_ids[i][:k], top_lps[i][:k])))
            row.done = tid in stop or len(row.ids) >= row.limit
        return tokens

    def _retire(self, batch: _Batch) -> list[_Row]:
        """Drop finished rows from the batch and the columns no remaining row attends to."""
        done = [row for row in batch.rows if row.done]
        if not done:
            return []
        if self.prefix_cache:
            for i, row in enumerate(batch.rows):
                if row.done and row.ids:
                    self._keep_prefix(batch, i, row)
        keep = [i for i, row in enumerate(batch.rows) if not row.done]
        batch.rows = [batch.rows[i] for i in keep]
        if not keep:
            batch.cache = batch.attention = batch.positions = batch.pending = None
            return done
        idx = self.torch.tensor(keep, device=self.device)
        batch.attention, batch.positions, batch.pending = batch.attention[idx], batch.positions[idx], batch.pending[idx]
        # Left padding every remaining row has: cut it so attention stays as short as the longest row.
        start = int((batch.attention.sum(0) > 0).long().argmax())
        batch.attention = batch.attention[:, start:]
        for layer in batch.cache.layers:
            layer.keys, layer.values = layer.keys[idx, :, start:], layer.values[idx, :, start:]
        return done

    async def _load_weights(self, path: str) -> None:
        from safetensors.torch import load_file

        def load() -> None:
            state: dict = {}
            for f in sorted(Path(path).glob("*.safetensors")):
                state.update(load_file(str(f)))
            if not state:
                raise EngineError(f"no safetensors files in {path}")
            with self._model_lock:
                self._prefixes.clear()  # computed by the old weights
                missing, unexpected = self.model.load_state_dict(
                    {k: v.to(self.dtype) for k, v in state.items()}, strict=False)
                # Tied embeddings make lm_head.weight legitimately absent from the file.
                missing = [k for k in missing if k != "lm_head.weight"]
                if missing or unexpected:
                    raise EngineError(f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")

        await asyncio.to_thread(load)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()


def _stack(batch: _Batch, rows: list[_Row], cache: Any, attention: Any, positions: Any, pending: Any, torch) -> None:
    """Put newly prefilled rows under the running ones: both caches left-padded to one length."""
    if not batch.rows:
        batch.rows, batch.cache, batch.attention, batch.positions, batch.pending = rows, cache, attention, positions, pending
        return
    old_len, new_len = batch.attention.shape[1], attention.shape[1]
    length = max(old_len, new_len)
    batch.attention = torch.cat([_left_pad(batch.attention, length, torch), _left_pad(attention, length, torch)], 0)
    for mine, theirs in zip(batch.cache.layers, cache.layers):
        mine.keys = torch.cat([_left_pad(mine.keys, length, torch), _left_pad(theirs.keys, length, torch)], 0)
        mine.values = torch.cat([_left_pad(mine.values, length, torch), _left_pad(theirs.values, length, torch)], 0)
    batch.rows = batch.rows + rows
    batch.positions = torch.cat([batch.positions, positions])
    batch.pending = torch.cat([batch.pending, pending])


def _left_pad(t: Any, length: int, torch) -> Any:
    """Zeros on the left of the sequence axis (-1 for a mask [rows, T], -2 for KV [rows, H, T, D])."""
    axis = 1 if t.dim() == 2 else 2
    missing = length - t.shape[axis]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], axis)


def _generation(row: _Row, stop: set[int]) -> Generation:
    finish = "stop" if row.ids and row.ids[-1] in stop else "length"
    return Generation(token_ids=row.ids, logprobs=row.logprobs, finish=finish,
                      top_logprobs=row.top if row.request.params.top_logprobs else None)


NUCLEUS_CANDIDATES = 1024


def _nucleus(torch, probs, top_p: float):
    """The top-p mask per row: the most probable tokens whose mass before them is < top_p.

    Exact without sorting the whole vocabulary when the `NUCLEUS_CANDIDATES` most probable tokens
    already hold top_p of the mass (a trained policy nearly always): a full sort of 150K entries
    per row per step is what dominated CPU decoding. Flat rows fall back to the full sort."""
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    sorted_p, order = probs.topk(k, dim=-1)
    if not bool((sorted_p.sum(-1) >= top_p).all()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep)


def _draw(torch, logits, params: list[TurnParams], generators: list[Any]):
    """One token id per row of `logits` [rows, vocab], on their device: greedy at temperature 0,
    else temperature, top-k, top-p. Rows with the same settings are processed together; each row
    draws its noise from its own generator, so what a row samples does not depend on the batch."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    for (temperature, top_k, top_p), rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        scores = logits[idx]
        if temperature <= 0:
            out[idx] = scores.argmax(-1)
            continue
        scores = scores / temperature
        if top_k and top_k > 0:
            kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if top_p < 1.0:
            probs = probs.masked_fill(~_nucleus(torch, probs, top_p), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        # argmax(p / E), E ~ Exp(1), draws from p (the exponential race); several times faster
        # than torch.multinomial over a 150K vocabulary.
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(1.0, generator=generators[i]) for i in rows])
        out[idx] = (probs / noise).argmax(-1)
    return out
