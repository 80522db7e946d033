"""transformers in-process, batched: the CPU demo/test engine and a GPU fallback.

Requests that arrive together are decoded together: a batcher collects whatever is waiting
(up to `max_batch`), left-pads the prompts and runs one sampling loop over a shared KV cache.
The loop is ours rather than `model.generate` because each row needs its own seed, its own
`max_tokens`, and the raw log-prob (and top-k) of the token it sampled; rows that finish stop
counting while the others go on. Sampling runs in a worker thread, so the event loop keeps
serving tool calls meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.rollout.engines.base import Engine, EngineError, Generation, TurnParams


@dataclass
class _Request:
    prompt_ids: list[int]
    params: TurnParams
    future: asyncio.Future


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model: str | Path, *, max_model_len: int = 32768, max_batch: int = 16,
                 dtype: str = "float32", device: str | None = None, policy_version: int = 0, tokenizer: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
        super().__init__(tokenizer, policy_version=policy_version, max_model_len=max_model_len)
        self.torch = torch
        # On a GPU machine decode there: the CPU is the fallback, not the default.
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = device
        self.dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(str(model), dtype=self.dtype).to(device).eval()
        self.weights_path = str(model)
        self.max_batch = max_batch
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._model_lock = threading.Lock()
        self.batches: list[int] = []  # batch sizes run, for tests and metrics

    async def _generate(self, prompt_ids: list[int], params: TurnParams, request_id: str) -> Generation:
        if self.max_model_len and len(prompt_ids) + 1 > self.max_model_len:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens leaves no room in {self.max_model_len}")
        loop = asyncio.get_running_loop()
        if self._queue is None or self._loop is not loop:
            # One batcher per event loop (a CLI or test may run several loops one after another).
            self._loop, self._queue = loop, asyncio.Queue()
            self._worker = loop.create_task(self._batcher())
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(prompt_ids, params, future))
        return await future

    async def _batcher(self) -> None:
        queue = self._queue
        assert queue is not None
        while True:
            first = await queue.get()
            await asyncio.sleep(0)  # let requests issued in the same tick join the batch
            batch = [first]
            while not queue.empty() and len(batch) < self.max_batch:
                batch.append(queue.get_nowait())
            self.batches.append(len(batch))
            try:
                results = await asyncio.to_thread(self._run_batch, batch)
            except Exception as exc:  # noqa: BLE001 - every waiting request learns why
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(EngineError(f"transformers: {type(exc).__name__}: {exc}"))
                continue
            for r, gen in zip(batch, results):
                if not r.future.done():
                    r.future.set_result(gen)

    def _run_batch(self, batch: list[_Request]) -> list[Generation]:
        torch = self.torch
        with self._model_lock, torch.inference_mode():
            return self._sample(batch)

    def _sample(self, batch: list[_Request]) -> list[Generation]:
        torch = self.torch
        n = len(batch)
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids):] = 1
        generators = []
        for r in batch:
            g = torch.Generator(device="cpu")
            g.manual_seed(r.params.seed if r.params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
            generators.append(g)
        limits = [min(r.params.max_tokens, (self.max_model_len or 10**9) - len(r.prompt_ids)) for r in batch]
        stop = self.stop_ids
        out_ids: list[list[int]] = [[] for _ in batch]
        out_lp: list[list[float]] = [[] for _ in batch]
        out_top: list[list[dict[int, float]]] = [[] for _ in batch]
        active = [lim > 0 for lim in limits]
        position = attention.cumsum(-1) - 1
        position.clamp_(min=0)
        past = None
        step_ids, step_pos = input_ids, position
        while any(active):
            out = self.model(input_ids=step_ids.to(self.device), attention_mask=attention.to(self.device),
                             position_ids=step_pos.to(self.device), past_key_values=past, use_cache=True,
                             logits_to_keep=1)  # only the last position: the prompt's logits are never needed
            past = out.past_key_values
            logits = out.logits[:, -1, :].float().cpu()
            raw = torch.log_softmax(logits, dim=-1)
            next_ids = torch.full((n,), self.pad_id, dtype=torch.long)
            for i, r in enumerate(batch):
                if not active[i]:
                    continue
                tid = _draw(torch, logits[i], r.params, generators[i])
                next_ids[i] = tid
                out_ids[i].append(tid)
                out_lp[i].append(float(raw[i, tid]))
                if r.params.top_logprobs:
                    values, idx = raw[i].topk(r.params.top_logprobs)
                    out_top[i].append({int(t): float(v) for t, v in zip(idx, values)})
                if tid in stop or len(out_ids[i]) >= limits[i]:
                    active[i] = False
            step_ids = next_ids.unsqueeze(1)
            attention = torch.cat([attention, torch.ones((n, 1), dtype=torch.long)], dim=1)
            step_pos = (position[:, -1:] + 1)
            position = torch.cat([position, step_pos], dim=1)
        results = []
        for i, r in enumerate(batch):
            ids = out_ids[i]
            finish = "stop" if ids and ids[-1] in stop else "length"
            results.append(Generation(token_ids=ids, logprobs=out_lp[i], finish=finish,
                                      top_logprobs=out_top[i] if r.params.top_logprobs else None))
        return results

    async def _load_weights(self, path: str) -> None:
        from safetensors.torch import load_file

        def load() -> None:
            state: dict = {}
            for f in sorted(Path(path).glob("*.safetensors")):
                state.update(load_file(str(f)))
            if not state:
                raise EngineError(f"no safetensors files in {path}")
            with self._model_lock:
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


def _draw(torch, logits, params: TurnParams, generator) -> int:
    """Sample one token id: greedy at temperature 0, else temperature, top-k, top-p."""
    if params.temperature <= 0:
        return int(logits.argmax())
    scores = logits / params.temperature
    if params.top_k and params.top_k > 0:
        kth = scores.topk(min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = probs.masked_fill(~mask, 0.0)
        probs = probs / probs.sum()
    # argmax(p / E), E ~ Exp(1), draws from p (the exponential race); several times faster
    # than torch.multinomial over a 150K vocabulary.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int((probs / noise).argmax())
