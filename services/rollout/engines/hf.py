"""transformers in-process with continuous batching: the CPU engine of demos and tests, and the
reference the GPU engine (vLLM) is checked against. GPU rollout is vLLM's job.

Rows join and leave the running batch between decode steps. A request that arrives while others
decode is prefilled on its own (with whatever else arrived with it) and from the next step decodes
with the rest; a row that samples a stop token or reaches its `max_tokens` is answered at once. So
an agent's 60-token tool call never waits behind another agent's 500-token plan, which is what a
static batch (run until its longest row ends) made every turn do.

The KV cache is a pool of slots, one per batch row, preallocated per layer as
[slots, kv_heads, capacity, head_dim]: a row's token at position p lives at column p of its slot.
A decode step writes one column per row and attends over the pool in place; rows joining or leaving
move no cache at all. (HF's DynamicCache grows by concatenation, i.e. copies the whole cache on every
step and on every join: an engine's cost grows with rows × context, to 85 ms a step at 128 rows and
65 GiB on an H100.) So the engine runs the model's layers
itself, reusing the model's own modules (norms, projections, rotary embedding, MLP); Llama- and
Qwen2-shaped models are supported, which covers SmolLM2 and Qwen2.5.

An agent's next turn repeats its last turn's context and adds the sampled tokens and the tool's
reply (token-in/token-out). A retired row's slot keeps its cache (least recently used evicted first)
and a request that extends it prefills only its new tokens, in the same slot. New weights load
between two ticks without draining the batch: rows in flight decode on under the new weights (over
the cache the old ones wrote), and the kept caches, which the old policy computed, are dropped.

The sampling loop is ours rather than `model.generate` because each row needs its own seed, its
own `max_tokens`, and the log-prob (and top-k) of the token it sampled under the distribution it
was drawn from (see `Generation.logprobs`). Sampling runs on the model's device; decoding runs in
a worker thread, so the event loop keeps serving tool calls.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.rollout.engines.base import Engine, EngineError, Generation, TurnParams, drawable

STEPS_PER_TICK = 4  # decode steps between admissions: joiners wait at most this long
STATS_EVERY_S = 30.0  # how often the engine logs where its time went
BROKEN_AFTER = 3  # ticks failed in a row after which the engine reports itself unhealthy
PREFILL_CHUNK = 512  # prompt tokens per row per prefill pass: bounds the attention mask's size
SUPPORTED = ("llama", "qwen2")  # decoder layers the engine can run itself (see _forward)

log = logging.getLogger(__name__)


@dataclass
class _Window:
    """Where the decoding thread's time went since the last log line."""

    started: float = field(default_factory=time.perf_counter)
    decode_steps: int = 0
    row_steps: int = 0  # rows decoded, summed over steps: tokens sampled by decode steps
    decode_s: float = 0.0
    admit_s: float = 0.0  # prefill, and retiring rows
    admitted: int = 0

    def line(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self.started, 1e-9)
        steps = max(self.decode_steps, 1)
        return {
            "window_s": round(wall, 1),
            "rows_mean": round(self.row_steps / steps, 1),
            "decode_ms_per_step": round(1000 * self.decode_s / steps, 1),
            "tokens_per_s": round(self.row_steps / wall, 1),
            "admitted": self.admitted,
            "decode_share": round(self.decode_s / wall, 3),
            "admit_share": round(self.admit_s / wall, 3),
        }


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
    """One request being decoded: its slot, what it sampled so far and the generator that draws
    for it. `length` is how many of its tokens the slot holds (= the pending token's position)."""

    request: _Request
    generator: Any
    limit: int
    slot: int = -1
    length: int = 0
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    done: bool = False


class _Batch:
    """The running batch: rows, and per row (device tensors) its slot, the pending token's position
    and the token it sampled last (fed at the next step)."""

    def __init__(self) -> None:
        self.rows: list[_Row] = []
        self.slots: Any = None
        self.positions: Any = None
        self.pending: Any = None


class _KVPool:
    """Keys and values per layer, [slots, kv_heads, capacity, head_dim]. The last column is scratch:
    padded prefill queries write there, and no row ever holds that many tokens."""

    GROW = 256  # capacity grows in these steps (at least doubling), so reallocation is rare

    def __init__(
        self, torch, layers: int, slots: int, kv_heads: int, head_dim: int, dtype, device: str, limit: int
    ) -> None:
        self.torch, self.layers, self.slots = torch, layers, slots
        self.shape, self.dtype, self.device, self.limit = (kv_heads, head_dim), dtype, device, limit
        self.capacity = 0
        self.keys: list[Any] = []
        self.values: list[Any] = []

    def ensure(self, tokens: int) -> None:
        """Room for `tokens` tokens in any slot (plus the scratch column)."""
        need = tokens + 1
        if need <= self.capacity:
            return
        grow = max(need, 2 * self.capacity)
        capacity = min(-(-grow // self.GROW) * self.GROW, max(need, self.limit + 1))
        torch, (h, d) = self.torch, self.shape

        def bigger(old: Any) -> Any:
            new = torch.zeros((self.slots, h, capacity, d), dtype=self.dtype, device=self.device)
            if old is not None:
                new[:, :, : old.shape[2]] = old
            return new

        self.keys = [bigger(self.keys[i] if self.keys else None) for i in range(self.layers)]
        self.values = [bigger(self.values[i] if self.values else None) for i in range(self.layers)]
        self.capacity = capacity
        if str(self.device).startswith("cuda"):
            # The old pool's blocks would stay reserved in this process's cache, unusable by the
            # learner and the other engines on the GPU: 4.5 of a 48-row engine's 10.6 GiB, enough
            # for a fleet of such engines to leave the learner out of memory.
            torch.cuda.empty_cache()

    @property
    def scratch(self) -> int:
        return self.capacity - 1


class TransformersEngine(Engine):
    name = "transformers"
    drains_on_update = False  # weights are swapped under the model lock, between ticks

    def __init__(
        self,
        model: str | Path,
        *,
        max_model_len: int = 32768,
        max_batch: int = 16,
        dtype: str | None = None,
        device: str | None = None,
        policy_version: int = 0,
        tokenizer: Any = None,
        continuous: bool = True,
        prefix_cache: int | None = None,
    ) -> None:
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
        # the decoder stack (embeddings, layers, rotary tables, final norm) and the head, as the model names them
        self._decoder = self.model.get_decoder()
        self._head = self.model.get_output_embeddings()
        config = self.model.config
        if config.model_type not in SUPPORTED:
            raise EngineError(
                f"the transformers engine runs {', '.join(SUPPORTED)} models, not {config.model_type!r}"
                " (serve it with vLLM: services.engine=vllm)"
            )
        self._fuse_projections()
        self.weights_path = str(model)
        self.max_batch = max_batch
        # False: admit only into an empty batch (static batching; kept as the benchmark's baseline)
        self.continuous = continuous
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._model_lock = threading.Lock()
        # One thread runs every tick and every weight load. asyncio.to_thread would spread them over
        # the default pool's threads, and each new thread that touches cuBLAS creates its own handle
        # and workspace: on a full GPU that creation fails (CUBLAS_STATUS_ALLOC_FAILED) and keeps
        # failing, which breaks the engine for good.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transformers-decode")
        self.batches: list[int] = []  # sizes of the groups admitted (prefilled) together, for tests and metrics
        attn = self._decoder.layers[0].self_attn
        self._pool = _KVPool(
            torch,
            config.num_hidden_layers,
            max_batch,
            config.num_key_value_heads,
            attn.head_dim,
            self.dtype,
            device,
            max_model_len or 32768,
        )
        self._free = list(range(max_batch))  # slots holding nothing
        # retired rows' caches kept for their agents' next turns: tokens → slot, least recent first
        self.prefix_cache = max_batch if prefix_cache is None else prefix_cache
        self._kept: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self.prefill_tokens = 0  # prompt tokens actually run through the model (for tests and metrics)
        self.reused_tokens = 0  # prompt tokens taken from a kept cache instead
        self._window = _Window()
        self.failed_ticks = 0  # in a row

    @property
    def healthy(self) -> bool:
        # A CUDA error (a failed allocation, a device-side assert) tends to repeat on every tick: the
        # run is better served by a fresh process than by failing each task until it is dead-lettered.
        return self.failed_ticks < BROKEN_AFTER

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
                finished = await asyncio.get_running_loop().run_in_executor(self._thread, self._tick, batch, joining)
            except Exception as exc:  # noqa: BLE001 - every waiting request learns why
                self.failed_ticks += 1
                log.error(
                    "transformers engine: a tick failed",
                    extra={"error": str(exc)[:500], "failed_in_a_row": self.failed_ticks},
                )
                error = EngineError(f"transformers: {type(exc).__name__}: {exc}")
                for r in [row.request for row in batch.rows] + joining:
                    if not r.future.done():
                        r.future.set_exception(error)
                batch = self._reset()
                continue
            self.failed_ticks = 0
            for row in finished:
                if not row.request.future.done():
                    row.request.future.set_result(_generation(row, self.stop_ids))

    def _reset(self) -> _Batch:
        """After a failed tick: every slot free, nothing kept (a half-written slot is not trusted)."""
        self._kept.clear()
        self._free = list(range(self.max_batch))
        return _Batch()

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
            fields = {
                **w.line(),
                "rows": len(batch.rows),
                "kept_caches": len(self._kept),
                "cache_capacity": self._pool.capacity,
            }
            if self.device.startswith("cuda"):  # what this process holds of a GPU other processes share
                fields["gpu_reserved_gib"] = round(torch.cuda.memory_reserved(self.device) / 2**30, 2)
            # in the message, not only in `extra`: the services' plain-text logs print no extras
            log.info("transformers engine: " + " ".join(f"{k}={v}" for k, v in fields.items()), extra=fields)
            self._window = _Window()
        return finished

    # -- slots -----------------------------------------------------------------------------------

    def _take_kept(self, prompt: list[int]) -> tuple[int, int] | None:
        """The slot whose kept tokens are the longest start of `prompt` that leaves at least one token
        to run, and how many tokens it holds; it leaves the kept set (its row now owns it)."""
        best = None
        for key in self._kept:
            if len(key) < len(prompt) and (best is None or len(key) > len(best)) and tuple(prompt[: len(key)]) == key:
                best = key
        return (self._kept.pop(best), len(best)) if best is not None else None

    def _take_slot(self) -> int:
        """A free slot (the lowest: decode attends over slots up to the highest in use), else the
        least recently kept one."""
        if not self._free:
            _, slot = self._kept.popitem(last=False)
            return slot
        self._free.sort()
        return self._free.pop(0)

    def _release(self, row: _Row) -> None:
        """A retired row's slot: kept for its agent's next turn (the prompt and every sampled token
        but the last, which was never fed back), or freed."""
        if not self.prefix_cache or not row.ids:
            self._free.append(row.slot)
            return
        ids = tuple(row.request.prompt_ids) + tuple(row.ids[:-1])
        if ids in self._kept:  # an identical row kept earlier: keep one of them
            self._free.append(self._kept.pop(ids))
        self._kept[ids] = row.slot
        while len(self._kept) > self.prefix_cache:
            self._free.append(self._kept.popitem(last=False)[1])

    # -- admission -------------------------------------------------------------------------------

    def _admit(self, batch: _Batch, joining: list[_Request]) -> list[_Row]:
        """Give each joiner a slot (one holding a start of its prompt, if kept), prefill the rest of
        its prompt, sample its first token, add it to the batch."""
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
        fresh = []
        for row in live:  # kept caches first, so a fresh row cannot evict one a joiner extends
            kept = self._take_kept(row.request.prompt_ids) if self.prefix_cache else None
            if kept is None:
                fresh.append(row)
            else:
                row.slot, row.length = kept
                self.reused_tokens += row.length
        for row in fresh:
            row.slot, row.length = self._take_slot(), 0
        self._pool.ensure(max(len(row.request.prompt_ids) + row.limit - 1 for row in live))
        tokens = self._sample(live, self._prefill(live))
        for row in live:
            row.length = len(row.request.prompt_ids)
        self._join(batch, live, tokens)
        return empty + self._retire(batch)

    def _prefill(self, rows: list[_Row]) -> Any:
        """Run each row's prompt from its slot's length on, in chunks; the last prompt token's logits."""
        torch = self.torch
        new = [row.request.prompt_ids[row.length :] for row in rows]
        width = max(len(ids) for ids in new)
        start = torch.tensor([row.length for row in rows], device=self.device)
        sizes = torch.tensor([len(ids) for ids in new], device=self.device)
        slots = torch.tensor([row.slot for row in rows], device=self.device)
        last: list[Any] = [None] * len(rows)
        for c0 in range(0, width, PREFILL_CHUNK):
            c1 = min(c0 + PREFILL_CHUNK, width)
            ids = torch.full((len(rows), c1 - c0), self.pad_id, dtype=torch.long)
            for i, seq in enumerate(new):
                part = seq[c0:c1]
                ids[i, : len(part)] = torch.tensor(part, dtype=torch.long)
            offsets = torch.arange(c0, c1, device=self.device)[None, :]
            valid = offsets < sizes[:, None]
            keys = max(row.length + min(len(seq), c1) for row, seq in zip(rows, new))  # host ints: no sync
            attend = self._prefill_attention(slots, start[:, None] + offsets, valid, keys)
            hidden = self._forward(ids.to(self.device), start[:, None] + offsets, slots, attend, valid)
            for i, seq in enumerate(new):
                if c0 <= len(seq) - 1 < c1:
                    last[i] = hidden[i, len(seq) - 1 - c0]
            self.prefill_tokens += sum(max(0, min(len(seq), c1) - c0) for seq in new)
        return self._logits(torch.stack(last))

    def _join(self, batch: _Batch, rows: list[_Row], tokens: Any) -> None:
        torch = self.torch
        slots = torch.tensor([row.slot for row in rows], device=self.device)
        positions = torch.tensor([row.length for row in rows], device=self.device)
        if not batch.rows:
            batch.rows, batch.slots, batch.positions, batch.pending = rows, slots, positions, tokens
            return
        batch.rows = batch.rows + rows
        batch.slots = torch.cat([batch.slots, slots])
        batch.positions = torch.cat([batch.positions, positions])
        batch.pending = torch.cat([batch.pending, tokens])

    # -- the model's layers over the slot pool ---------------------------------------------------

    def _fuse_projections(self) -> None:
        """Each layer's q/k/v and gate/up weights laid end to end in one tensor, the modules'
        parameters becoming views of it: one matmul where there were three (two), and a weight load
        (`load_state_dict` copies into parameters in place) updates the fused tensor too. A decode
        step is bound by the host's per-op cost (~20 µs a torch call), not by the GPU."""
        torch = self.torch
        if self.model.config.hidden_act != "silu" or self._decoder.layers[0].mlp.gate_proj.bias is not None:
            raise EngineError("the transformers engine runs SiLU MLPs without bias (serve this model with vLLM)")
        self._fused: list[tuple[Any, Any, Any]] = []
        for layer in self._decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _fuse(torch, [attn.q_proj, attn.k_proj, attn.v_proj], "weight")
            bias = (
                _fuse(torch, [attn.q_proj, attn.k_proj, attn.v_proj], "bias") if attn.q_proj.bias is not None else None
            )
            self._fused.append((qkv, bias, _fuse(torch, [mlp.gate_proj, mlp.up_proj], "weight")))

    def _forward(self, ids: Any, positions: Any, slots: Any, attend: Any, valid: Any | None = None) -> Any:
        """Hidden states (before the final norm) for `ids` [rows, S] at `positions` [rows, S] in
        `slots` [rows]; their keys and values are written into the slots first. `valid` [rows, S]
        marks the real tokens of right-padded prefill rows (padding writes to the scratch column).
        The model's own layers, computed with fewer torch calls: fused projections, one RMSNorm
        kernel, rotary embedding on queries and keys at once."""
        torch = self.torch
        linear, rms_norm, silu = torch.nn.functional.linear, torch.nn.functional.rms_norm, torch.nn.functional.silu
        inner = self._decoder
        n, s = ids.shape
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, positions)  # [n, S, D]: the model's own (scaled) rotary tables
        half = cos.shape[-1] // 2
        # rotate_half(x) · sin = roll(x, D/2) · (sin with its first half negated)
        cos, sin = cos[:, :, None, :], torch.cat([-sin[..., :half], sin[..., half:]], -1)[:, :, None, :]
        pool = self._pool
        columns = positions if valid is None else torch.where(valid, positions, pool.scratch)
        first = inner.layers[0].self_attn
        heads, d = self.model.config.num_attention_heads, first.head_dim
        kv_heads = self.model.config.num_key_value_heads
        for layer_index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            qkv_w, qkv_b, gate_up_w = self._fused[layer_index]
            norm = layer.input_layernorm
            x = rms_norm(h, (h.shape[-1],), norm.weight, norm.variance_epsilon)
            qkv = linear(x, qkv_w, qkv_b).view(n, s, heads + 2 * kv_heads, d)
            qk = qkv[:, :, : heads + kv_heads]
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)
            keys, values = pool.keys[layer_index], pool.values[layer_index]
            keys[slots[:, None], :, columns] = qk[:, :, heads:]
            values[slots[:, None], :, columns] = qkv[:, :, heads + kv_heads :]
            out = attend(qk[:, :, :heads].transpose(1, 2), keys, values, attn.scaling)  # [n, heads, S, d]
            h = h + attn.o_proj(out.transpose(1, 2).reshape(n, s, -1))
            norm = layer.post_attention_layernorm
            gate, up = linear(rms_norm(h, (h.shape[-1],), norm.weight, norm.variance_epsilon), gate_up_w).chunk(2, -1)
            h = h + layer.mlp.down_proj(silu(gate) * up)
        return h

    def _decode_attention(self, slots: Any, positions: Any, used: int, keys_len: int):
        """One query per row against the pool in place, over slots [0, used) and columns
        [0, keys_len). A row's query goes to its slot; idle slots get a zero query that sees column 0
        (dropped). Each kv head's query heads are stacked as that head's queries: no key is repeated."""
        torch = self.torch
        length = _round_up(keys_len, 64, self._pool.capacity)
        at = torch.zeros(used, dtype=torch.long, device=self.device)
        at[slots] = positions
        mask = (torch.arange(length, device=self.device)[None, :] <= at[:, None])[:, None, None, :]
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def attend(q: Any, keys: Any, values: Any, scale: float) -> Any:
            n, heads, _, d = q.shape
            kv_heads = keys.shape[1]
            stacked = q.new_zeros((used, kv_heads, heads // kv_heads, d))
            stacked[slots] = q.reshape(n, kv_heads, heads // kv_heads, d)
            out = sdpa(stacked, keys[:used, :, :length], values[:used, :, :length], attn_mask=mask, scale=scale)
            return out[slots].reshape(n, heads, 1, d)

        return attend

    def _prefill_attention(self, slots: Any, positions: Any, valid: Any, keys_len: int):
        """Each row's queries against its own slot (gathered), causal by position, over columns
        [0, keys_len); a padding query sees column 0 only (its output is dropped)."""
        torch = self.torch
        length = _round_up(keys_len, 64, self._pool.capacity)
        mask = torch.arange(length, device=self.device)[None, None, :] <= torch.where(valid, positions, 0)[:, :, None]
        mask = mask[:, None]  # [rows, 1, S, length]
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def attend(q: Any, keys: Any, values: Any, scale: float) -> Any:
            groups = q.shape[1] // keys.shape[1]
            k = keys[slots, :, :length].repeat_interleave(groups, dim=1)
            v = values[slots, :, :length].repeat_interleave(groups, dim=1)
            return sdpa(q, k, v, attn_mask=mask, scale=scale)

        return attend

    def _logits(self, hidden: Any) -> Any:
        return self._head(self._decoder.norm(hidden))

    # -- decoding --------------------------------------------------------------------------------

    def _decode_step(self, batch: _Batch) -> list[_Row]:
        logits = self._step_logits(batch)
        for row in batch.rows:
            row.length += 1
        batch.positions = batch.positions + 1
        batch.pending = self._sample(batch.rows, logits)
        return self._retire(batch)

    def _step_logits(self, batch: _Batch) -> Any:
        """The batch's next-token logits; writes the pending tokens' keys and values (running it
        again before the batch advances writes the same ones)."""
        used = max(row.slot for row in batch.rows) + 1
        keys_len = max(row.length for row in batch.rows) + 1
        attend = self._decode_attention(batch.slots, batch.positions, used, keys_len)
        hidden = self._forward(batch.pending[:, None], batch.positions[:, None], batch.slots, attend)
        return self._logits(hidden[:, -1])

    def _sample(self, rows: list[_Row], logits: Any) -> Any:
        """Draw one token per row (each with its own generator) and record its log-prob under the
        distribution it was drawn from (`_draw`), with that distribution's most probable alternatives."""
        torch = self.torch
        tokens, drawn = _draw(
            torch, logits.float(), [row.request.params for row in rows], [row.generator for row in rows]
        )
        chosen = drawn.gather(1, tokens[:, None])[:, 0].tolist()
        top_k = max(row.request.params.top_logprobs for row in rows)
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        if top_k:  # one host read for all rows' alternatives, not one per row
            values, indices = drawn.topk(top_k, dim=-1)
            top_ids, top_lps = indices.tolist(), values.tolist()
        stop = self.stop_ids
        for i, (row, tid) in enumerate(zip(rows, tokens.tolist())):
            row.ids.append(tid)
            row.logprobs.append(chosen[i])
            k = row.request.params.top_logprobs
            if k:
                row.top.append(drawable(zip(top_ids[i][:k], top_lps[i][:k])))
            row.done = (tid in stop and not row.request.params.ignore_stop) or len(row.ids) >= row.limit
        return tokens

    def _retire(self, batch: _Batch) -> list[_Row]:
        """Drop finished rows from the batch; their slots are kept or freed, nothing is copied."""
        done = [row for row in batch.rows if row.done]
        if not done:
            return []
        for row in done:
            self._release(row)
        keep = [i for i, row in enumerate(batch.rows) if not row.done]
        batch.rows = [batch.rows[i] for i in keep]
        if not keep:
            batch.slots = batch.positions = batch.pending = None
            return done
        idx = self.torch.tensor(keep, device=self.device)
        batch.slots, batch.positions, batch.pending = batch.slots[idx], batch.positions[idx], batch.pending[idx]
        return done

    async def parameter_digests(self) -> dict[str, Any]:
        """A sha256 of every parameter (`services.weights.digests`; the fused projections are
        views of the same storage, so these are the tensors decoding uses)."""
        from services.weights.digests import tensor_digest

        def digests() -> dict[str, str]:
            with self._model_lock:
                return {n: tensor_digest(p) for n, p in self.model.named_parameters()}

        return {
            "digests": await asyncio.to_thread(digests),
            "packed": {},
            "opaque": [],
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    async def _load_weights(self, path: str) -> None:
        from services.weights.files import load_state_dict

        def read() -> dict:
            state = load_state_dict(Path(path))
            if not state:
                raise EngineError(f"no safetensors files in {path}")
            return {k: v.to(self.dtype) for k, v in state.items()}

        def load(state: dict) -> None:
            with self._model_lock:
                self._free += list(self._kept.values())  # computed by the old weights
                self._kept.clear()
                missing, unexpected = self.model.load_state_dict(state, strict=False)
                # Tied embeddings make lm_head.weight legitimately absent from the file.
                missing = [k for k in missing if k != "lm_head.weight"]
                if missing or unexpected:
                    raise EngineError(
                        f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
                    )

        state = await asyncio.to_thread(read)  # the disk read overlaps decoding: host tensors only
        await asyncio.get_running_loop().run_in_executor(self._thread, load, state)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._thread.shutdown(wait=False)


def _fuse(torch, modules: list[Any], name: str) -> Any:
    """The modules' `name` tensors concatenated along dim 0; each module's becomes a view of it."""
    fused = torch.cat([getattr(m, name).data for m in modules], 0)
    start = 0
    for m in modules:
        size = getattr(m, name).shape[0]
        setattr(m, name, torch.nn.Parameter(fused[start : start + size], requires_grad=False))
        start += size
    return fused


def _round_up(n: int, step: int, limit: int) -> int:
    """n rounded up to a multiple of `step` (fewer distinct kernel shapes), at most `limit`."""
    return min(-(-n // step) * step, limit)


def _generation(row: _Row, stop: set[int]) -> Generation:
    finish = "stop" if row.ids and row.ids[-1] in stop and not row.request.params.ignore_stop else "length"
    return Generation(
        token_ids=row.ids,
        logprobs=row.logprobs,
        finish=finish,
        top_logprobs=row.top if row.request.params.top_logprobs else None,
    )


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
    """One token id per row of `logits` [rows, vocab], on their device, and the log-probs [rows, vocab]
    of the distribution each row was drawn from: at temperature 0 the argmax, with the model's own
    log-probs; else softmax(logits / temperature) cut to its top-k and then its top-p nucleus and
    renormalized (what vLLM records with `logprobs_mode: processed_logprobs`). Rows with the same
    settings are processed together; each row draws its noise from its own generator, so what a row
    samples does not depend on the batch."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    logprobs = torch.empty_like(logits)
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    for (temperature, top_k, top_p), rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        scores = logits[idx]
        if temperature <= 0:
            out[idx] = scores.argmax(-1)
            logprobs[idx] = torch.log_softmax(scores, dim=-1)
            continue
        scores = scores / temperature
        if top_k and top_k > 0:
            kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        drawn = torch.log_softmax(scores, dim=-1)
        if top_p < 1.0:
            keep = _nucleus(torch, probs, top_p)
            probs = probs.masked_fill(~keep, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
            drawn = drawn.masked_fill(~keep, float("-inf"))
            drawn = drawn - torch.logsumexp(drawn, dim=-1, keepdim=True)
        logprobs[idx] = drawn
        # argmax(p / E), E ~ Exp(1), draws from p (the exponential race); several times faster
        # than torch.multinomial over a 150K vocabulary.
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(1.0, generator=generators[i]) for i in rows])
        out[idx] = (probs / noise).argmax(-1)
    return out, logprobs
