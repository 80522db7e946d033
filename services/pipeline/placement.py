"""Placement: which GPUs each process of a run gets, from the recipe's `deployment:` section.

The learner's ranks take the first GPUs, one each. Rollout engines take the GPUs after them, in
groups of `engine_tensor_parallel`; where the machine has too few GPUs for that (or `share_gpus` says
so) the engines go beside the learner and each other, each limited to a share of its GPUs' memory,
GPUs without the learner filled first. A layout the machine cannot hold is refused with the numbers
before anything starts. Each process learns its devices through CUDA_VISIBLE_DEVICES (the
learner's ranks then pick theirs by LOCAL_RANK), and DeepSpeed its accelerator through
DS_ACCELERATOR, which defaults to CPU unless told. Validations during RL run on the first engine's GPUs.

A recipe that leaves `deployment.learner_ranks` unset under `placement.mode: auto` gets its layout from the
machine (`derive`): the GPUs seen, their memory and the model's size decide the learner's ranks and the engines.

The placement also decides how the RL stage's weights travel (`weight_sync`): over NCCL only where
every engine is a vLLM engine of the embedded fleet on GPUs of its own, apart from the learner's and
from each other's, since one NCCL group cannot hold two ranks on one GPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Literal

from services.pipeline.config import DeploymentSpec, PipelineConfig

DEDICATED_MEMORY_SHARE = 0.9  # an engine alone on its GPUs (vLLM's own default)
MIN_ENGINE_SHARE = 0.05  # below this an engine holds its weights and hardly any KV cache


class PlacementError(ValueError):
    """The machine cannot hold the layout the recipe asks for."""


@dataclass(frozen=True)
class Placement:
    accelerator: str  # "cuda" or "cpu"
    learner_ranks: int
    learner_devices: tuple[str, ...]  # GPU ids (empty on CPU)
    engine_devices: tuple[tuple[str, ...], ...]
    engine_memory_share: float | None  # None on CPU
    tensor_parallel: int = 1
    shared: bool = False
    validation_memory_share: float | None = None  # None: no validations beside the fleet, or on CPU
    colocated: bool = False  # engines share every learner GPU in time: asleep while the learner trains
    reason: str = ""  # why this layout (the memory model's numbers), printed with it
    validations_after: bool = False  # no room for a validation's engine beside the fleet: they run after RL
    derived: bool = False  # ranks and engines derived from the machine: one engine per GPU group, the budget pooled

    def learner_env(self) -> dict[str, str]:
        env = {"DS_ACCELERATOR": self.accelerator}
        if self.accelerator == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.learner_devices)
        return env

    def engine_devices_env(self, index: int) -> dict[str, str]:
        """Rollout worker `index`'s devices (the one setting CUDA itself reads from the environment)."""
        if self.accelerator != "cuda":
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.engine_devices[index])}

    def engine_settings(self, index: int) -> dict[str, object]:
        """Rollout worker `index`'s engine settings (RolloutConfig fields): its share of its GPUs' memory, its
        tensor parallelism, and, beside the learner or other engines, its KV cache sized from the share (vLLM's
        start-up measurement would count the others' allocations as its own)."""
        if self.accelerator != "cuda":
            return {}
        settings: dict[str, object] = {
            "gpu_memory_utilization": round(self.engine_memory_share, 2),
            "tensor_parallel_size": self.tensor_parallel,
        }
        if self.shared:
            settings["kv_cache_from_share"] = True
        return settings

    def validation_env(self) -> dict[str, str]:
        """A validation's devices (`rl.val_every`'s `star eval` beside the fleet): the first engine's
        GPUs, the least loaded (engines fill GPUs without the learner first), where the memory share
        its engine gets (`engine_memory_share`) was measured."""
        if self.accelerator != "cuda":
            return {}
        devices = self.engine_devices[0] if self.engine_devices else self.learner_devices
        return {"CUDA_VISIBLE_DEVICES": ",".join(devices)}

    def describe(self) -> str:
        if self.accelerator != "cuda":
            return f"placement: CPU; learner {self.learner_ranks} rank(s), {len(self.engine_devices)} engine(s)"
        engines = ", ".join("+".join(d) for d in self.engine_devices) or "none"
        validations = (
            "; validations after the RL steps, on the freed GPUs"
            if self.validations_after
            else ""
            if self.validation_memory_share is None
            else f"; validations beside engine 0 at {self.validation_memory_share:.2f}"
        )
        sharing = (
            " (colocated: asleep while the learner trains)"
            if self.colocated
            else (" (sharing GPUs)" if self.shared else "")
        )
        why = f"\n  why: {self.reason}" if self.reason else ""
        return (
            f"placement: learner on GPU {'+'.join(self.learner_devices)}; engines on GPU {engines} "
            f"at {self.engine_memory_share:.2f} of memory each{sharing}{validations}{why}"
        )


def visible_gpu_ids() -> list[str]:
    """The GPUs this process may hand out, by the ids its children's CUDA_VISIBLE_DEVICES must name."""
    from services.learner.launch import visible_gpus

    count = visible_gpus()
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return listed[:count]
    return [str(i) for i in range(count)]


def plan(spec: DeploymentSpec, engines: int, gpus: list[str], *, validations: bool = False) -> Placement:
    """Devices for the learner and for each of `engines` rollout engines on a machine with `gpus`;
    `validations`: RL validations run beside the first engine, and their engine's memory is counted."""
    if not gpus:
        return Placement("cpu", spec.learner_ranks or 1, (), tuple(() for _ in range(engines)), None)
    n, ranks, tp = len(gpus), spec.learner_ranks or 1, spec.engine_tensor_parallel
    if ranks > n:
        raise PlacementError(
            f"deployment.learner_ranks {ranks} needs {ranks} GPUs, one per rank; this machine shows {n}"
        )
    if engines and tp > n:
        raise PlacementError(
            f"deployment.engine_tensor_parallel {tp} needs {tp} GPUs per engine; this machine shows {n}"
        )
    need = ranks + engines * tp
    shared = spec.share_gpus if spec.share_gpus is not None else need > n
    learner = tuple(gpus[:ranks])
    if not shared:
        if need > n:
            raise PlacementError(
                f"deployment needs {ranks} learner GPU(s) + {engines} engine(s) × {tp} GPU(s) = {need} GPUs; "
                f"this machine shows {n} (deployment.share_gpus: true puts engines beside the learner by "
                "memory share)"
            )
        devices = tuple(tuple(gpus[ranks + i * tp : ranks + (i + 1) * tp]) for i in range(engines))
    else:
        groups = [tuple(gpus[g * tp : (g + 1) * tp]) for g in range(n // tp)]
        # engines go first where the learner is not, then beside ranks other than rank 0 (which broadcasts
        # the weights: an engine on its GPU could not join that NCCL group), then round the groups again
        groups.sort(key=lambda group: (any(d in learner for d in group), learner[0] in group))
        devices = tuple(groups[i % len(groups)] for i in range(engines))
    share, val_share = _memory_shares(spec, gpus, learner, devices, validations and bool(devices), shared)
    return Placement("cuda", ranks, learner, devices, share, tp, shared=shared, validation_memory_share=val_share)


def _memory_shares(
    spec: DeploymentSpec,
    gpus: list[str],
    learner: tuple[str, ...],
    devices: tuple[tuple[str, ...], ...],
    validations: bool,
    shared: bool,
) -> tuple[float, float | None]:
    """The engines' memory share and a validation's, such that no GPU is asked for more than it has:
    on each GPU the learner keeps `learner_memory_share` (where engines share its GPU), a validation
    beside the first engine keeps its own share (or counts as one more engine), and the engines
    split the rest; alone on its GPUs an engine takes vLLM's default 0.9."""
    load = {d: sum(d in group for group in devices) for d in gpus}
    kept = {d: spec.learner_memory_share if shared and d in learner else 0.0 for d in gpus}
    held = {d: f"learner {kept[d]:.2f}" if kept[d] else "" for d in gpus}
    val_fixed = spec.validation_memory_share
    for d in devices[0] if validations else ():
        if val_fixed is None:
            load[d] += 1
        else:
            kept[d] += val_fixed
            held[d] = " + ".join(filter(None, (held[d], f"validation {val_fixed:.2f}")))
    used = [d for d in gpus if load[d]]
    cap = 1.0 if shared else DEDICATED_MEMORY_SHARE
    share = spec.engine_memory_share
    if share is None:
        fit = min(((cap - kept[d]) / load[d] for d in used), default=DEDICATED_MEMORY_SHARE)
        share = min(math.floor(fit * 100 + 1e-6) / 100, DEDICATED_MEMORY_SHARE)
        if share < MIN_ENGINE_SHARE:
            worst = min(used, key=lambda d: (cap - kept[d]) / load[d])
            raise PlacementError(
                f"deployment puts {load[worst]} engine(s) on GPU {worst}, leaving each {share:.2f} of its memory "
                f"({held[worst] or 'nothing else'} kept); an engine needs at least {MIN_ENGINE_SHARE:.2f}: "
                "fewer rollout workers, smaller shares, or more GPUs"
            )
    else:
        for d in used:
            total = load[d] * share + kept[d]
            if total > 1.0 + 1e-9:
                beside = f" + {held[d]}" if held[d] else ""
                raise PlacementError(
                    f"GPU {d} would hold {load[d]} engine(s) × {share:.2f}{beside} = {total:.2f} of its memory "
                    f"(at most 1.00): lower deployment.engine_memory_share to {(1.0 - kept[d]) / load[d]:.2f} "
                    "or run fewer engines"
                )
    val_share = (share if val_fixed is None else val_fixed) if validations else None
    return share, val_share


def placement_for(
    spec: DeploymentSpec, engines: int, gpus: list[str] | None = None, *, validations: bool = False
) -> Placement:
    """The run's placement on this machine (its visible GPUs unless `gpus` is given)."""
    return plan(spec, engines, visible_gpu_ids() if gpus is None else gpus, validations=validations)


@dataclass(frozen=True)
class WeightSyncChoice:
    """How the RL stage's weights reach its engines, and why (printed when the stage starts)."""

    method: Literal["files", "nccl", "ipc"]
    reason: str

    def describe(self) -> str:
        return f"weight sync: {self.method} ({self.reason})"


def nccl_obstacle(spec: DeploymentSpec, engine: str, placement: Placement) -> str | None:
    """Why the learner cannot broadcast weights into this layout's engines over NCCL, or None."""
    if spec.fleet != "embedded":
        return "the fleet is external: its rollout servers load versions from the weights store"
    if engine != "vllm":
        return f"services.engine is {engine}: only vLLM engines receive weights over NCCL"
    if placement.accelerator != "cuda":
        return "this machine has no CUDA GPUs"
    # the weights' group holds the learner's rank 0 and every engine rank: the other learner ranks are not in it
    rank0 = placement.learner_devices[0] if placement.learner_devices else None
    seen: dict[str, int] = {}
    for index, devices in enumerate(placement.engine_devices):
        for device in devices:
            if device == rank0:
                return (
                    f"engine {index} shares GPU {device} with the learner's rank 0, and one NCCL group cannot "
                    "hold two ranks on one GPU"
                )
            if device in seen:
                return (
                    f"engines {seen[device]} and {index} share GPU {device}, and one NCCL group cannot hold two "
                    "ranks on one GPU"
                )
            seen[device] = index
    return None


def weight_sync(spec: DeploymentSpec, engine: str, placement: Placement) -> WeightSyncChoice:
    """`deployment.weight_sync` resolved for this layout: `auto` takes nccl where it can work, files
    otherwise; an explicit nccl that cannot work is refused (PlacementError) with the reason."""
    if placement.colocated:
        if spec.fleet != "embedded" or engine != "vllm":
            raise PlacementError(
                "colocated placement needs vLLM engines (services.engine vllm) of an embedded fleet: "
                "they sleep while the learner trains and take its weights by CUDA IPC"
            )
        return WeightSyncChoice("ipc", "engines colocated on the learner's GPUs: CUDA IPC on waking")
    if spec.weight_sync == "files":
        return WeightSyncChoice("files", "deployment.weight_sync files")
    obstacle = nccl_obstacle(spec, engine, placement)
    if obstacle is None:
        return WeightSyncChoice("nccl", "vLLM engines on GPUs of their own")
    if spec.weight_sync == "nccl":
        raise PlacementError(
            f"deployment.weight_sync nccl cannot work here: {obstacle} "
            "(weight_sync auto or files sends versions through the weights store)"
        )
    return WeightSyncChoice("files", obstacle)


def fleet_obstacle(infos: dict[str, dict | None]) -> str | None:
    """Why an external fleet's rollout servers (`infos`: each one's GET /weights, None when it does not
    answer) cannot all join the learner's NCCL weight group, or None. Each server's engine is the one it
    reports running, not the recipe's services.engine (what an embedded fleet would start)."""
    if not infos:
        return "the fleet names no rollout server (STAR_ROLLOUT_URLS)"
    silent = [u for u, i in infos.items() if i is None]
    if silent:
        return f"rollout server(s) {', '.join(silent)} do not answer GET /weights"
    other = [f"{u} ({i['engine']})" for u, i in infos.items() if i.get("engine", "vllm") != "vllm"]
    if other:
        return f"rollout server(s) {', '.join(other)} run another engine: only vLLM engines receive weights over NCCL"
    off = [u for u, i in infos.items() if not (i or {}).get("weight_ranks")]
    if off:
        return (
            f"the engine of {', '.join(off)} does not take weights over NCCL (start it with the vLLM argument "
            "weight_transfer: nccl)"
        )
    return None


def external_weight_sync(spec: DeploymentSpec, infos: dict[str, dict | None]) -> WeightSyncChoice:
    """`deployment.weight_sync` for an external fleet, from what its rollout servers report: nccl (rank 0
    broadcasts to every engine's tensor-parallel ranks through the address the learner announces) when
    all of them can receive, files otherwise; an explicit nccl that cannot work is refused."""
    if spec.weight_sync == "files":
        return WeightSyncChoice("files", "deployment.weight_sync files")
    obstacle = fleet_obstacle(infos)
    if obstacle is None:
        ranks = sum(int(i["weight_ranks"]) for i in infos.values() if i)
        return WeightSyncChoice(
            "nccl",
            f"{len(infos)} rollout server(s), {ranks} engine rank(s), join the group at "
            "the address the learner announces; files for restarts and stragglers",
        )
    if spec.weight_sync == "nccl":
        raise PlacementError(
            f"deployment.weight_sync nccl cannot work here: {obstacle} "
            "(weight_sync auto or files sends versions through the weights store)"
        )
    return WeightSyncChoice("files", obstacle)


# ---- memory model: split or colocated ---------------------------------------------------------

GiB = 2**30
CARD_USABLE = 0.92  # of a card's memory: CUDA contexts, NCCL buffers and allocator fragments take the rest
# Measured at 7B on two H200s (docs/gpu.md, "Colocation's memory"): a learner rank held 6.2 GiB beyond its
# ZeRO-3 state before its first step; an engine 2.5 GiB beyond weights and KV cache that its sleep freed and
# 1.9 GiB it kept asleep.
LEARNER_RESERVE = 6 * GiB  # a rank's ZeRO-3 gather and reduce buckets, NCCL buffers, CUDA context, allocator cache
ENGINE_RESERVE = int(4.5 * GiB)  # an awake engine besides weights and KV (vllm_engine.ENGINE_RESERVE_BYTES)
SLEEP_RESIDUE = 2 * GiB  # an asleep engine: CUDA context, CUDA graphs' pools, the allocator's bookkeeping
ZERO3_BYTES_PER_PARAM = 2 + 2 + 12  # bf16 weights and gradients, fp32 Adam moments and master weights
FP32_GRADS_EXTRA = 2  # gradients accumulated in fp32 partitions (learner.fp32_grad_accum, the default)


@dataclass(frozen=True)
class ModelSize:
    """What placement needs of the model: its parameters and the shapes that size activations and KV."""

    params: int
    hidden: int
    intermediate: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelSize:
        """From a decoder's config.json (Qwen2/Llama-like: attention with q/k/v biases counted, SwiGLU MLP).
        PlacementError when it lacks a size the count needs."""
        needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in needed if not isinstance(config.get(k), int)]
        if missing:
            raise PlacementError(
                f"the model's config.json has no {', '.join(missing)}: placement cannot size "
                "the model (a decoder's config.json, as Qwen2 or Llama write it, has them)"
            )
        h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or heads
        hd = config.get("head_dim") or h // heads
        vocab = config["vocab_size"]
        attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + (heads + 2 * kv) * hd  # q, k, v, o + biases
        per_layer = attn + 3 * h * inter + 2 * h
        head = 0 if config.get("tie_word_embeddings", False) else vocab * h
        return cls(vocab * h + layers * per_layer + h + head, h, inter, layers, kv, hd, vocab)

    @property
    def weights_bytes(self) -> int:
        return 2 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # keys and values, bf16


def learner_state_bytes(
    size: ModelSize, ranks: int, reference: bool = False, persistent_bytes: int = 0, fp32_grads: bool = True
) -> int:
    """A ZeRO-3 rank's share of weights, gradients (fp32 with `fp32_grads`) and Adam state (allocated at the
    first step, so counted from the start: the engines wake beside it); the weights ZeRO-3 keeps whole on every
    rank (`learner.persistent_weights_gib`, at most the model's bf16 weights); with `reference` (a KL term),
    the frozen reference policy beside it, which every rank holds whole in bf16
    (`PolicyEngine.reference_policy`)."""
    per_param = ZERO3_BYTES_PER_PARAM + (FP32_GRADS_EXTRA if fp32_grads else 0)
    return (
        per_param * size.params // ranks
        + min(persistent_bytes, size.weights_bytes)
        + (2 * size.params if reference else 0)
    )


def activation_bytes(
    size: ModelSize,
    tokens: int,
    checkpointing: bool,
    *,
    recompute_mlp: bool = False,
    lean: bool = False,
    recompute_mlp_layers: int | None = None,
) -> int:
    """A rank's activations for a packed row of `tokens` (bf16): with checkpointing, each layer's input
    kept plus one layer recomputed at a time; without, every layer's. A layer holds about 10 hidden-wide
    and 4 MLP-wide tensors per token (norms, q/k/v/o, the residuals; gate, up, their product, its
    gradient); `lean` (learner.activation_memory) keeps neither the product nor the norms' outputs (8 and 2),
    `recompute_mlp` none of the MLP-wide ones but for the one layer being recomputed (in the first
    `recompute_mlp_layers` layers; the others keep theirs). The fused vocabulary head adds a few hidden-wide
    chunks."""
    hidden_wide, mlp_wide = (8, 2) if lean else (10, 4)
    layer = tokens * (hidden_wide * size.hidden + mlp_wide * size.intermediate) * 2
    if checkpointing:
        kept = size.layers * tokens * size.hidden * 2 + layer
    elif recompute_mlp:
        recomputed = size.layers if recompute_mlp_layers is None else min(recompute_mlp_layers, size.layers)
        mlp_layer = tokens * mlp_wide * size.intermediate * 2
        kept = size.layers * tokens * hidden_wide * size.hidden * 2 + (size.layers - recomputed + 1) * mlp_layer
    else:
        kept = size.layers * layer
    return kept + 4 * tokens * size.hidden * 4


@dataclass(frozen=True)
class Fit:
    """A layout's memory per GPU, the numbers the choice and its refusals name."""

    mode: Literal["split", "colocated"]
    fits: bool
    why: str
    engine_share: float | None = None  # colocated: each engine's memory share while awake
    validation_share: float | None = None  # colocated: a validation's engine beside engine 0


def split_fit(
    size: ModelSize,
    ranks: int,
    engines: int,
    tp: int,
    gpus: int,
    card: int,
    activations: int,
    min_kv_tokens: int,
    *,
    reference: bool = False,
    persistent_bytes: int = 0,
    fp32_grads: bool = True,
) -> Fit:
    """Learner ranks and engines on GPUs of their own."""
    usable = int(CARD_USABLE * card)
    need = ranks + engines * tp
    if need > gpus:
        return Fit(
            "split",
            False,
            f"split needs {ranks} learner GPU(s) + {engines} engine(s) × {tp} = {need} GPUs; this machine shows {gpus}",
        )
    state = learner_state_bytes(size, ranks, reference, persistent_bytes, fp32_grads)
    learner = state + activations + LEARNER_RESERVE
    if learner > usable:
        return Fit(
            "split",
            False,
            f"split: a learner rank needs {_gib(learner)} (ZeRO-3 state "
            f"{_gib(state)}{_persistent_note(size, persistent_bytes)}"
            f"{_reference_note(reference)} + "
            f"activations {_gib(activations)} + "
            f"{_gib(LEARNER_RESERVE)}) of {_gib(usable)} usable",
        )
    kv = int(DEDICATED_MEMORY_SHARE * card) - size.weights_bytes // tp - ENGINE_RESERVE
    if kv < min_kv_tokens * size.kv_bytes_per_token // tp:
        return Fit("split", False, f"split: an engine's KV cache of {_gib(kv)} holds fewer than {min_kv_tokens} tokens")
    return Fit(
        "split",
        True,
        f"split: learner rank {_gib(learner)} of {_gib(usable)}; each engine alone on "
        f"{tp} GPU(s), KV {_gib(kv)} ({kv * tp // size.kv_bytes_per_token:,} tokens)",
    )


VALIDATION_SEQUENCES = 2  # max-length sequences a validation's engine beside colocated training holds


def colocated_fit(
    size: ModelSize,
    gpus: int,
    tp: int,
    card: int,
    activations: int,
    min_kv_tokens: int,
    *,
    validations: bool = False,
    reference: bool = False,
    persistent_bytes: int = 0,
    fp32_grads: bool = True,
) -> Fit:
    """A learner rank on every GPU and one engine per tensor-parallel group of GPUs, asleep while the
    learner trains. Training: the rank's state, activations and reserve beside the asleep engine's
    residue. Rollout: the rank's state and reserve (activations freed) beside the awake engine's
    weights, reserve and KV. A validation during RL is a separate engine that does not sleep: on engine
    0's GPUs its weights, reserve and `VALIDATION_SEQUENCES` sequences of KV count in both phases."""
    usable = int(CARD_USABLE * card)
    state = learner_state_bytes(size, gpus, reference, persistent_bytes, fp32_grads)
    weights = size.weights_bytes // tp
    need_kv = min_kv_tokens * size.kv_bytes_per_token // tp
    validation = weights + ENGINE_RESERVE + VALIDATION_SEQUENCES * need_kv if validations else 0
    training = state + activations + LEARNER_RESERVE + SLEEP_RESIDUE + validation
    beside = f" + a validation's engine {_gib(validation)}" if validation else ""
    if training > usable:
        return Fit(
            "colocated",
            False,
            f"colocated: training needs {_gib(training)} a GPU (ZeRO-3 state over {gpus} "
            f"ranks {_gib(state)}{_persistent_note(size, persistent_bytes)}"
            f"{_reference_note(reference)} + activations {_gib(activations)} + "
            f"{_gib(LEARNER_RESERVE)} + an asleep engine {_gib(SLEEP_RESIDUE)}{beside}) "
            f"of {_gib(usable)} usable",
        )
    engine = usable - state - LEARNER_RESERVE - validation
    kv = engine - weights - ENGINE_RESERVE
    if kv < need_kv:
        return Fit(
            "colocated",
            False,
            f"colocated: an engine beside a learner rank's {_gib(state)}{beside} keeps "
            f"{_gib(max(kv, 0))} of KV cache, less than one {min_kv_tokens}-token "
            f"sequence ({_gib(need_kv)})",
        )
    share = math.floor(engine / card * 100) / 100
    val_share = math.ceil(validation / card * 100) / 100 if validation else None
    return Fit(
        "colocated",
        True,
        f"colocated: training {_gib(training)} of {_gib(usable)} a GPU with the engine "
        f"asleep{beside}; awake, the engine takes {share:.2f} of its GPUs, KV {_gib(kv)} "
        f"({kv * tp // size.kv_bytes_per_token:,} tokens)",
        engine_share=share,
        validation_share=val_share,
    )


def _persistent_note(size: ModelSize, persistent_bytes: int) -> str:
    kept = min(persistent_bytes, size.weights_bytes)
    return f", {_gib(kept)} of weights kept whole (learner.persistent_weights_gib)" if kept else ""


def _reference_note(reference: bool) -> str:
    return ", the KL reference's whole bf16 copy included" if reference else ""


def _gib(n: int | float) -> str:
    return f"{n / GiB:.1f} GiB"


def plan_colocated(
    spec: DeploymentSpec, gpus: list[str], share: float, *, validation_share: float | None = None
) -> Placement:
    """Every GPU holds a learner rank and one engine per tensor-parallel group of GPUs (the rollout
    workers' episode budget is pooled into them: `colocated_concurrency`), each taking `share` of its GPUs
    while awake; a validation during RL runs beside engine 0 at `validation_share`."""
    tp = spec.engine_tensor_parallel
    if tp > len(gpus):
        raise PlacementError(
            f"deployment.engine_tensor_parallel {tp} needs {tp} GPUs per engine; this machine shows {len(gpus)}"
        )
    devices = tuple(tuple(gpus[g * tp : (g + 1) * tp]) for g in range(len(gpus) // tp))
    return Placement(
        "cuda",
        len(gpus),
        tuple(gpus),
        devices,
        share,
        tp,
        shared=True,
        validation_memory_share=validation_share,
        colocated=True,
    )


def colocated_concurrency(workers: int, concurrency: int, engines: int) -> int:
    """Episodes each colocated engine's worker keeps in flight: the recipe's rollout workers × their
    budget, pooled into the colocated engines (one per GPU group)."""
    return max(1, math.ceil(workers * concurrency / max(engines, 1)))


def choose(
    spec: DeploymentSpec,
    mode: str,
    size: ModelSize | None,
    engines: int,
    gpus: list[str],
    card_bytes: int | None,
    *,
    micro_batch_tokens: int,
    checkpointing: bool,
    min_kv_tokens: int,
    recompute_mlp: bool = False,
    recompute_mlp_layers: int | None = None,
    lean: bool = False,
    activation_bytes_override: int | None = None,
    validations: bool = False,
    reference: bool = False,
    persistent_bytes: int = 0,
    fp32_grads: bool = True,
) -> Placement:
    """The run's layout: `mode` split (the deployment's own plan), colocated, or auto (split where the
    learner and engines fit GPUs of their own, else colocated where that fits); the placement's `reason`
    says why. A mode whose memory cannot fit is refused (PlacementError) with the numbers, before anything
    starts. Without GPUs, or split without a known model size, the deployment's plan as it was."""
    if not gpus or (mode == "split" and (size is None or card_bytes is None)):
        return plan(spec, engines, gpus, validations=validations)
    if size is None or card_bytes is None:
        raise PlacementError(
            f"placement.mode {mode} needs the model's size (its config.json) and the GPUs' memory "
            "(placement.gpu_gib where the GPUs cannot be asked)"
        )
    acts = activation_bytes_override or activation_bytes(
        size,
        micro_batch_tokens,
        checkpointing,
        recompute_mlp=recompute_mlp,
        lean=lean,
        recompute_mlp_layers=recompute_mlp_layers,
    )
    tp, n = spec.engine_tensor_parallel, len(gpus)
    if mode == "auto" and spec.learner_ranks is None:
        return derive(
            spec,
            size,
            gpus,
            card_bytes,
            acts,
            min_kv_tokens,
            validations=validations,
            reference=reference,
            persistent_bytes=persistent_bytes,
            fp32_grads=fp32_grads,
        )
    split = split_fit(
        size,
        spec.learner_ranks or 1,
        engines,
        tp,
        n,
        card_bytes,
        acts,
        min_kv_tokens,
        reference=reference,
        persistent_bytes=persistent_bytes,
        fp32_grads=fp32_grads,
    )
    if mode == "split":
        placed = plan(spec, engines, gpus, validations=validations)
        if split.fits or placed.shared:  # memory sharing by share: plan()'s own checks
            return _with_reason(placed, split.why if split.fits else "split by memory share (deployment.share_gpus)")
        raise PlacementError(f"placement.mode split does not fit: {split.why}")
    colo = colocated_fit(
        size,
        n,
        tp,
        card_bytes,
        acts,
        min_kv_tokens,
        validations=validations,
        reference=reference,
        persistent_bytes=persistent_bytes,
        fp32_grads=fp32_grads,
    )
    if mode == "auto" and split.fits:
        return _with_reason(
            plan(spec.model_copy(update={"share_gpus": False}), engines, gpus, validations=validations),
            f"auto → {split.why}",
        )
    later = False
    if not colo.fits and validations:
        # no room for a validation's engine beside the colocated ones: the validations wait for the fleet to end
        alone = colocated_fit(
            size,
            n,
            tp,
            card_bytes,
            acts,
            min_kv_tokens,
            reference=reference,
            persistent_bytes=persistent_bytes,
            fp32_grads=fp32_grads,
        )
        if alone.fits:
            colo, later = alone, True
    if colo.fits:
        prefix = f"auto → {colo.why} (not split: {split.why})" if mode == "auto" else colo.why
        if later:
            prefix += "; validations run after the RL steps (no room for their engine beside the fleet)"
        placed = plan_colocated(spec, gpus, colo.engine_share, validation_share=colo.validation_share)
        return _with_reason(replace(placed, validations_after=later), prefix)
    raise PlacementError(
        f"placement.mode {mode}: no layout fits {n} GPU(s) of {_gib(card_bytes)} for "
        f"{size.params / 1e9:.2f} B parameters: {colo.why}" + (f"; {split.why}" if mode == "auto" else "")
    )


def learner_rank_choices(gpus: int, tp: int) -> list[int]:
    """Learner ranks a split layout may take on `gpus` GPUs, fewest first: powers of two from a quarter of the
    machine up to what leaves one engine of `tp` GPUs."""
    ranks, choices = max(1, gpus // 4), []
    while ranks + tp <= gpus:
        choices.append(ranks)
        ranks *= 2
    return choices


def derive(
    spec: DeploymentSpec,
    size: ModelSize,
    gpus: list[str],
    card_bytes: int,
    acts: int,
    min_kv_tokens: int,
    *,
    validations: bool = False,
    reference: bool = False,
    persistent_bytes: int = 0,
    fp32_grads: bool = True,
) -> Placement:
    """Learner ranks and engines from the machine, for a recipe that leaves `deployment.learner_ranks` unset.
    Colocated where it fits (one GPU included): a learner rank on every GPU and one engine per
    `engine_tensor_parallel` GPUs, asleep while the learner trains, so no GPU waits through the other phase.
    Else split: the fewest learner ranks of `learner_rank_choices` whose ZeRO-3 state and activations fit, an
    engine on each group of GPUs after them. Else refused with both memory models' numbers. Either way the
    rollout workers' episode budget is pooled into the engines (`colocated_concurrency`)."""
    n, tp = len(gpus), spec.engine_tensor_parallel
    machine = f"{n} GPU(s) of {_gib(card_bytes)} for {size.params / 1e9:.2f} B parameters"
    colo = colocated_fit(
        size,
        n,
        tp,
        card_bytes,
        acts,
        min_kv_tokens,
        validations=validations,
        reference=reference,
        persistent_bytes=persistent_bytes,
        fp32_grads=fp32_grads,
    )
    later = False
    if not colo.fits and validations:
        alone = colocated_fit(
            size,
            n,
            tp,
            card_bytes,
            acts,
            min_kv_tokens,
            reference=reference,
            persistent_bytes=persistent_bytes,
            fp32_grads=fp32_grads,
        )
        colo, later = (alone, True) if alone.fits else (colo, False)
    if colo.fits:
        why = f"derived from {machine}: {colo.why}"
        if later:
            why += "; validations run after the RL steps (no room for their engine beside the fleet)"
        placed = plan_colocated(spec, gpus, colo.engine_share, validation_share=colo.validation_share)
        return replace(placed, reason=why, validations_after=later, derived=True)
    tried = []
    for ranks in learner_rank_choices(n, tp):
        engines = (n - ranks) // tp
        fit = split_fit(
            size,
            ranks,
            engines,
            tp,
            n,
            card_bytes,
            acts,
            min_kv_tokens,
            reference=reference,
            persistent_bytes=persistent_bytes,
            fp32_grads=fp32_grads,
        )
        if fit.fits:
            placed = plan(
                spec.model_copy(update={"learner_ranks": ranks, "share_gpus": False}),
                engines,
                gpus,
                validations=validations,
            )
            why = f"derived from {machine}: {ranks} learner rank(s) + {engines} engine(s); {fit.why} (not {colo.why})"
            return replace(placed, reason=why, derived=True)
        tried.append(fit.why)
    raise PlacementError(
        f"no layout fits {machine}: {colo.why}"
        + (f"; {'; '.join(tried)}" if tried else "; split needs at least 2 GPUs")
    )


def _with_reason(placement: Placement, reason: str) -> Placement:
    from dataclasses import replace

    return replace(placement, reason=reason)


def gpu_memory_bytes(gpus: list[str]) -> int | None:
    """The smallest memory among `gpus` (nvidia-smi: no CUDA context in the controller), or None."""
    import subprocess

    if not gpus:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = {i.strip(): int(float(m)) * 2**20 for i, m in (line.split(",") for line in out.strip().splitlines())}
    known = [sizes[g] for g in gpus if g in sizes]
    return min(known) if known else None


def placement_for_recipe(
    config: PipelineConfig, gpus: list[str] | None = None, card_bytes: int | None = None, size: ModelSize | None = None
) -> Placement:
    """The run's placement from its recipe (`placement.mode`, the deployment, the learner's row size, the
    episodes' context) on this machine: its visible GPUs and their memory unless given; the model's size
    from its config.json unless given (unknown for a model not built yet: split as the deployment says)."""
    gpus = visible_gpu_ids() if gpus is None else gpus
    mode = config.placement.mode
    if card_bytes is None:
        card_bytes = int(config.placement.gpu_gib * GiB) if config.placement.gpu_gib else gpu_memory_bytes(gpus)
    if size is None and config.model.path:
        from services.common.model_shape import model_config

        raw = model_config(config.model.path)
        size = ModelSize.from_hf_config(raw) if raw else None
    act = int(config.placement.activation_gib * GiB) if config.placement.activation_gib else None
    return choose(
        config.deployment,
        mode,
        size,
        config.services.rollout_workers,
        gpus,
        card_bytes,
        micro_batch_tokens=config.learner.micro_batch_tokens,
        checkpointing=config.learner.gradient_checkpointing,
        recompute_mlp=config.learner.recompute_mlp,
        recompute_mlp_layers=config.learner.recompute_mlp_layers,
        lean=config.learner.activation_memory == "lean",
        min_kv_tokens=config.rl.sampling.engine_max_len,
        activation_bytes_override=act,
        validations=config.validates_during_rl,
        reference=config.rl.kl_coef > 0,
        persistent_bytes=int(config.learner.persistent_weights_gib * GiB),
        fp32_grads=config.learner.fp32_grad_accum,
    )
