"""Placement: which GPUs each process of a run gets, from the recipe's `deployment:` section.

The learner's ranks take the first GPUs, one each. Rollout engines take the GPUs after them, in
groups of `engine_tensor_parallel`; where the machine has too few GPUs for that (or `share_gpus` says
so) the engines go beside the learner and each other, each limited to a share of its GPUs' memory,
GPUs without the learner filled first. A layout the machine cannot hold is refused with the numbers
before anything starts. Each process learns its devices through CUDA_VISIBLE_DEVICES (the
learner's ranks then pick theirs by LOCAL_RANK), and DeepSpeed its accelerator through
DS_ACCELERATOR, which defaults to CPU unless told. Validations during RL run on the first engine's GPUs.

The placement also decides how the RL stage's weights travel (`weight_sync`): over NCCL only where
every engine is a vLLM engine of the embedded fleet on GPUs of its own, apart from the learner's and
from each other's, since one NCCL group cannot hold two ranks on one GPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from services.pipeline.config import DeploymentSpec

DEDICATED_MEMORY_SHARE = 0.9   # an engine alone on its GPUs (vLLM's own default)
MIN_ENGINE_SHARE = 0.05        # below this an engine holds its weights and hardly any KV cache


class PlacementError(ValueError):
    """The machine cannot hold the layout the recipe asks for."""


@dataclass(frozen=True)
class Placement:
    accelerator: str                          # "cuda" or "cpu"
    learner_ranks: int
    learner_devices: tuple[str, ...]          # GPU ids (empty on CPU)
    engine_devices: tuple[tuple[str, ...], ...]
    engine_memory_share: float | None         # None on CPU
    tensor_parallel: int = 1
    shared: bool = False
    validation_memory_share: float | None = None  # None: no validations beside the fleet, or on CPU

    def learner_env(self) -> dict[str, str]:
        env = {"DS_ACCELERATOR": self.accelerator}
        if self.accelerator == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.learner_devices)
        return env

    def engine_env(self, index: int) -> dict[str, str]:
        """Rollout worker `index`'s devices, and the memory share and tensor parallelism of its engine."""
        if self.accelerator != "cuda":
            return {}
        env = {"CUDA_VISIBLE_DEVICES": ",".join(self.engine_devices[index]),
               "STAR_ROLLOUT_GPU_MEMORY_UTILIZATION": f"{self.engine_memory_share:.2f}",
               "STAR_ROLLOUT_TENSOR_PARALLEL_SIZE": str(self.tensor_parallel)}
        if self.shared:  # beside the learner or other engines: the KV cache from the share, not measured
            env["STAR_ROLLOUT_KV_CACHE_FROM_SHARE"] = "true"
        return env

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
        validations = ("" if self.validation_memory_share is None else
                       f"; validations beside engine 0 at {self.validation_memory_share:.2f}")
        return (f"placement: learner on GPU {'+'.join(self.learner_devices)}; engines on GPU {engines} "
                f"at {self.engine_memory_share:.2f} of memory each{' (sharing GPUs)' if self.shared else ''}"
                f"{validations}")


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
        return Placement("cpu", spec.learner_ranks, (), tuple(() for _ in range(engines)), None)
    n, ranks, tp = len(gpus), spec.learner_ranks, spec.engine_tensor_parallel
    if ranks > n:
        raise PlacementError(f"deployment.learner_ranks {ranks} needs {ranks} GPUs, one per rank; "
                             f"this machine shows {n}")
    if engines and tp > n:
        raise PlacementError(f"deployment.engine_tensor_parallel {tp} needs {tp} GPUs per engine; "
                             f"this machine shows {n}")
    need = ranks + engines * tp
    shared = spec.share_gpus if spec.share_gpus is not None else need > n
    learner = tuple(gpus[:ranks])
    if not shared:
        if need > n:
            raise PlacementError(
                f"deployment needs {ranks} learner GPU(s) + {engines} engine(s) × {tp} GPU(s) = {need} GPUs; "
                f"this machine shows {n} (deployment.share_gpus: true puts engines beside the learner by "
                "memory share)")
        devices = tuple(tuple(gpus[ranks + i * tp: ranks + (i + 1) * tp]) for i in range(engines))
    else:
        groups = [tuple(gpus[g * tp: (g + 1) * tp]) for g in range(n // tp)]
        # engines go first where the learner is not, then round the groups again
        groups.sort(key=lambda group: any(d in learner for d in group))
        devices = tuple(groups[i % len(groups)] for i in range(engines))
    share, val_share = _memory_shares(spec, gpus, learner, devices, validations and bool(devices), shared)
    return Placement("cuda", ranks, learner, devices, share, tp, shared=shared, validation_memory_share=val_share)


def _memory_shares(spec: DeploymentSpec, gpus: list[str], learner: tuple[str, ...],
                   devices: tuple[tuple[str, ...], ...], validations: bool, shared: bool
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
                "fewer rollout workers, smaller shares, or more GPUs")
    else:
        for d in used:
            total = load[d] * share + kept[d]
            if total > 1.0 + 1e-9:
                beside = f" + {held[d]}" if held[d] else ""
                raise PlacementError(
                    f"GPU {d} would hold {load[d]} engine(s) × {share:.2f}{beside} = {total:.2f} of its memory "
                    f"(at most 1.00): lower deployment.engine_memory_share to {(1.0 - kept[d]) / load[d]:.2f} "
                    "or run fewer engines")
    val_share = (share if val_fixed is None else val_fixed) if validations else None
    return share, val_share


def placement_for(spec: DeploymentSpec, engines: int, gpus: list[str] | None = None, *,
                  validations: bool = False) -> Placement:
    """The run's placement on this machine (its visible GPUs unless `gpus` is given)."""
    return plan(spec, engines, visible_gpu_ids() if gpus is None else gpus, validations=validations)


@dataclass(frozen=True)
class WeightSyncChoice:
    """How the RL stage's weights reach its engines, and why (printed when the stage starts)."""

    method: Literal["files", "nccl"]
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
    learner = set(placement.learner_devices)
    seen: dict[str, int] = {}
    for index, devices in enumerate(placement.engine_devices):
        for device in devices:
            if device in learner:
                return (f"engine {index} shares GPU {device} with the learner, and one NCCL group cannot hold two "
                        "ranks on one GPU")
            if device in seen:
                return (f"engines {seen[device]} and {index} share GPU {device}, and one NCCL group cannot hold two "
                        "ranks on one GPU")
            seen[device] = index
    return None


def weight_sync(spec: DeploymentSpec, engine: str, placement: Placement) -> WeightSyncChoice:
    """`deployment.weight_sync` resolved for this layout: `auto` takes nccl where it can work, files
    otherwise; an explicit nccl that cannot work is refused (PlacementError) with the reason."""
    if spec.weight_sync == "files":
        return WeightSyncChoice("files", "deployment.weight_sync files")
    obstacle = nccl_obstacle(spec, engine, placement)
    if obstacle is None:
        return WeightSyncChoice("nccl", "vLLM engines on GPUs of their own")
    if spec.weight_sync == "nccl":
        raise PlacementError(f"deployment.weight_sync nccl cannot work here: {obstacle} "
                             "(weight_sync auto or files sends versions through the weights store)")
    return WeightSyncChoice("files", obstacle)
