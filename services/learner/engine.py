"""The policy on DeepSpeed: distributed setup, forward to token logprobs, steps, checkpoints.

On CPU the process group is gloo and the precision fp32; on GPU, NCCL and bf16. The variables
torch.distributed needs (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE) are set here
when the launcher did not set them, so a plain `python` process is a world of one.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from services.common.redis import free_port
from services.learner.attention import (
    IMPLEMENTATIONS,
    PACKED_IMPLEMENTATIONS,
    packed_kwargs,
    runs_per_sequence,
    warm_sequence_plans,
)
from services.learner.batching import PackedRow, lr_lambda
from services.learner.build_locks import clear_stale_build_locks
from services.learner.config import EngineConfig, ScheduleConfig
from services.learner.fused_layers import lean_activations
from services.learner.nccl_env import set_learner_protocol
from services.learner.pointwise import fuse_pointwise
from services.learner.vocab_head import HeadKernels, fused_head_fits, model_logprobs, vocab_logprobs

if TYPE_CHECKING:  # annotations only
    from services.weights.buckets import FlatBucket

log = logging.getLogger(__name__)


def ensure_distributed_env(home: Path | None = None) -> dict[str, str]:
    """Fill in what torch.distributed needs for a single local process; keep a launcher's values.

    Without these DeepSpeed falls back to MPI discovery and fails for want of mpi4py. The JIT
    build of DeepSpeed's shm op (~40 s on CPU) is cached under STAR_HOME when nothing else is set."""
    defaults = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # A launcher (torchrun, or our own multi-rank spawn) owns the port. Alone, take a fresh one:
    # an inherited MASTER_PORT may belong to a parent that already listens on it (EADDRINUSE).
    launched = "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("WORLD_SIZE", "1") != "1"
    alone = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    if "MASTER_PORT" not in os.environ or (not launched and alone):
        os.environ["MASTER_PORT"] = str(free_port())
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if home is not None:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(home / "torch_extensions"))
    return {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}


def collective_timeout(data_wait_s: float) -> timedelta:
    """How long a collective may wait before the process group fails the rank: DeepSpeed's default
    (10 minutes, or DEEPSPEED_TIMEOUT minutes) plus the longest wait for data on rank 0, during which
    the other ranks already sit in the step's first broadcast."""
    from deepspeed.constants import default_pg_timeout

    return default_pg_timeout + timedelta(seconds=max(data_wait_s, 0.0))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class LogprobPolicy(nn.Module):
    """A causal LM whose forward returns the logprob (and entropy) of each target token.

    The vocabulary head is fused with the log-prob (`vocab_logprobs`): it runs in chunks of
    `chunk_tokens`, so a 30K-token row never materializes [T, 151936] logits (5+ GB in fp32)."""

    def __init__(self, lm: nn.Module, chunk_tokens: int = 2048, head_kernels: HeadKernels = "auto") -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.head_kernels = head_kernels
        self.temperature = 1.0  # log-probs of softmax(logits / T): the distribution a sampler at T draws from
        self.fused_head = fused_head_fits(lm.config)  # else the model's own logits (softcaps, scales)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        with_entropy: bool = True,
        bounds: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # No attention mask: position_ids restarting at 0 mark packed sequences (block-diagonal causal).
        # Under packed attention their boundaries go to every layer's attention as cu_seqlens; under
        # another implementation transformers builds a block mask from them. Where no row of the [B, T]
        # batch restarts (micro-batch padding continues the positions), SDPA runs its plain causal kernel.
        # `bounds`: those boundaries computed on the host already (PackedRow.bounds), else read here.
        if self.lm.config._attn_implementation not in PACKED_IMPLEMENTATIONS:
            bounds = {}
        elif bounds is None:
            bounds = packed_kwargs(position_ids)
        if not self.fused_head:
            logits = self.lm(input_ids=input_ids, position_ids=position_ids, use_cache=False, **bounds).logits
            return model_logprobs(
                logits.flatten(0, 1), targets.flatten(), temperature=self.temperature, with_entropy=with_entropy
            )
        hidden = self.lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **bounds
        ).last_hidden_state
        # The head's chunks run over all B·T tokens, whatever row they come from.
        return vocab_logprobs(
            hidden.flatten(0, 1),
            self.head_weight,
            targets.flatten(),
            chunk=self.chunk_tokens,
            temperature=self.temperature,
            with_entropy=with_entropy,
            head_kernels=self.head_kernels,
        )

    @property
    def head_weight(self) -> nn.Parameter:
        """The vocabulary head's weight [V, d] (under ZeRO-3 registered as this module's external
        parameter, so it is gathered for the forward and the backward)."""
        return self.lm.get_output_embeddings().weight


def sdpa_kernels_now() -> list:
    """The SDPA kernels enabled now, in priority order (SDPBackend members)."""
    from torch.nn.attention import _cur_sdpa_kernel_backends

    enabled = _cur_sdpa_kernel_backends()
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    if order is None:
        return enabled
    rank = order()
    return sorted(enabled, key=lambda b: rank.index(int(b)) if int(b) in rank else len(rank))


def sdpa_as_in_forward() -> tuple[AbstractContextManager, AbstractContextManager]:
    """Activation checkpointing's `context_fn`: nothing around the forward; around the recompute in backward,
    the SDPA kernels and priority in force when the forward ran (read now, at the forward). The backward runs
    outside `sdpa_priority`, and a recompute on another kernel saves other tensors (cuDNN's logsumexp is
    [B, H, T, 1], flash's [B, H, T]): checkpoint refuses the mismatch (CheckpointError)."""
    try:
        from torch.nn.attention import sdpa_kernel
    except ImportError:  # pragma: no cover - torch without kernel selection
        return nullcontext(), nullcontext()
    return nullcontext(), sdpa_kernel(sdpa_kernels_now(), set_priority=True)


def recompute_layers(lm: nn.Module) -> None:
    """Whole-layer recomputation (HF's gradient checkpointing, non-reentrant), each layer recomputed under
    its forward's SDPA kernels."""
    lm.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": sdpa_as_in_forward}
    )


def recompute_mlps(lm: nn.Module, layers: int | None = None) -> int:
    """Selective recomputation: the MLP of each decoder layer (of the first `layers` of them; None: all) runs
    under activation checkpointing (its gate, up and activation outputs, 3 × intermediate width per token, are
    recomputed in backward); attention keeps its activations, so the costly attention forward is not run twice.
    The forward is replaced on the instance, so parameter names (and exports) stay HF's. Returns the count."""
    decoder_layers = list(getattr(lm.get_decoder(), "layers", []))
    if layers is not None and layers > len(decoder_layers):
        raise ValueError(f"recompute_mlp_layers {layers} is more than the model's {len(decoder_layers)} layers")
    count = 0
    for layer in decoder_layers[:layers]:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        plain = mlp.forward

        def forward(x: torch.Tensor, _plain=plain) -> torch.Tensor:
            if torch.is_grad_enabled() and x.requires_grad:
                return checkpoint(_plain, x, use_reentrant=False, context_fn=sdpa_as_in_forward)
            return _plain(x)

        mlp.forward = forward
        count += 1
    return count


def device_bounds(bounds: dict[str, Any] | None, device: torch.device) -> dict[str, Any] | None:
    """A micro-batch's host-side attention bounds with their tensors (cumulative lengths) copied to `device`,
    without a read back to the host."""
    if bounds is None:
        return None
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in bounds.items()}


def attention_choice(cfg: EngineConfig) -> dict[str, str]:
    """The attention implementation a policy is loaded with: packed attention, or the configured one
    (transformers' choice when none is set)."""
    if cfg.packed_attention != "mask":
        return {"attn_implementation": IMPLEMENTATIONS[cfg.packed_attention]}
    return {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}


@contextmanager
def sdpa_priority(backends: list[str] | None) -> Iterator[None]:
    """Prefer these SDPA kernels, in order, where a call is eligible for them (PyTorch falls back
    down the list, e.g. cuDNN → flash for shapes cuDNN does not take)."""
    if not backends:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    with sdpa_kernel([names[b] for b in backends], set_priority=True):
        yield


def zero3_layer_units(lm: nn.Module) -> int:
    """Make each decoder layer one ZeRO-3 unit (DeepSpeed's leaf modules): the layer's parameters are
    gathered in one go when it starts and its gradients reduced when its backward ends. Per-module hooks
    fire a dozen times a layer and the host time they take shows up in the step on fast GPUs. The layer
    classes are the model's own `_no_split_modules` (HF's name for its repeated block). Before
    deepspeed.initialize, which installs the hooks. Returns the number of layers marked."""
    from deepspeed.utils import set_z3_leaf_modules

    classes = list(getattr(lm, "_no_split_modules", None) or [])
    if not classes:
        return 0
    return len(set_z3_leaf_modules(lm, classes, raise_if_not_found=False))


def zero3_persistence(cfg: EngineConfig, bytes_per_weight: int) -> dict[str, int]:
    """Which parameters ZeRO-3 keeps whole on every rank: the small ones always, and any parameter, in model
    order, while the whole weights kept fit `persistent_weights_gib`."""
    budget = int(cfg.persistent_weights_gib * 2**30) // bytes_per_weight
    if budget <= 0:
        return {"stage3_param_persistence_threshold": cfg.param_persistence_threshold}
    return {
        "stage3_param_persistence_threshold": max(budget, cfg.param_persistence_threshold),
        "stage3_model_persistence_threshold": budget,
    }


def deepspeed_config(cfg: EngineConfig, *, bf16: bool, world_size: int, on_gpu: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.zero_stage >= 2:
        overlap = cfg.overlap_comm if cfg.overlap_comm is not None else on_gpu
        zero.update(
            {
                "overlap_comm": overlap,
                "contiguous_gradients": True,
                "reduce_bucket_size": cfg.reduce_bucket_size,
                "allgather_bucket_size": cfg.allgather_bucket_size,
            }
        )
    if cfg.zero_stage == 3:
        zero.update(
            {
                "stage3_gather_16bit_weights_on_model_save": False,
                **zero3_persistence(cfg, bytes_per_weight=2 if bf16 else 4),
            }
        )
    if cfg.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if cfg.offload_params == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    config: dict[str, Any] = {
        # We own accumulation: each micro-batch's loss is already weighted for the whole step, and
        # step() is the boundary, so the number of micro-batches may change from step to step.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16 and cfg.zero_stage >= 1:
        # ZeRO keeps fp32 gradient partitions (DeepSpeed has no bf16-weights / fp32-accumulation mode
        # without ZeRO); the reduction's dtype is a choice of its own
        if cfg.fp32_grad_accum:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = cfg.grad_reduce_dtype
    return config


@contextmanager
def zero3_init(ds_config: dict[str, Any], enabled: bool) -> Iterator[None]:
    """Under ZeRO-3, have transformers build the model inside deepspeed.zero.Init: each rank allocates
    only its shard of every parameter as it is created, and the checkpoint is loaded shard by shard.
    transformers sees the DeepSpeed config through a weak reference that lives as long as the
    HfDeepSpeedConfig object; dropped at exit, so that later loads (the KL reference) are plain."""
    if not enabled:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    holder = HfDeepSpeedConfig(ds_config)
    try:
        yield
    finally:
        del holder


@dataclass
class StepResult:
    grad_norm: float
    lr: float


class PolicyEngine:
    """One DeepSpeed engine around a HF causal LM, for SFT and RL alike."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig,
        schedule: ScheduleConfig,
        total_steps: int,
        home: Path | None = None,
        data_wait_s: float = 0.0,
    ) -> None:
        """`data_wait_s`: the longest rank 0 may wait for data while the other ranks wait in a collective."""
        ensure_distributed_env(home)
        import deepspeed
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.on_gpu = torch.cuda.is_available()
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.on_gpu)
        if self.on_gpu:
            set_learner_protocol(cfg.nccl_protocol)
        timeout = collective_timeout(data_wait_s)
        if not torch.distributed.is_initialized():
            clear_stale_build_locks()  # else a killed build of DeepSpeed's ops holds every start forever
            deepspeed.init_distributed(dist_backend="nccl" if self.on_gpu else "gloo", timeout=timeout)
        else:
            torch.distributed.group.WORLD.set_timeout(timeout)
        self.rank = torch.distributed.get_rank()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # this node's GPU and disk
        self.world_size = torch.distributed.get_world_size()
        if self.on_gpu:
            torch.cuda.set_device(self.local_rank)
        seed_everything(cfg.seed)
        kwargs: dict[str, Any] = {"dtype": torch.float32, **attention_choice(cfg)}
        ds_config = deepspeed_config(cfg, bf16=self.bf16, world_size=self.world_size, on_gpu=self.on_gpu)
        with zero3_init(ds_config, cfg.zero_stage == 3 and cfg.zero_init):
            lm = AutoModelForCausalLM.from_pretrained(self.model_dir, **kwargs)
        lm.config.use_cache = False
        fuse = cfg.fuse_pointwise if cfg.fuse_pointwise is not None else self.on_gpu
        if fuse:
            fuse_pointwise(lm)  # before recompute_mlps, which wraps the MLP forward it finds
        if cfg.activation_memory == "lean":
            # after fuse_pointwise, whose MLP and norm forwards these replace; under ZeRO-3 down_proj's weight
            # is read directly only where each layer is gathered whole
            lean_activations(
                lm,
                recompute_norms=not cfg.gradient_checkpointing,
                compiled=fuse,
                fold_down=cfg.zero_stage < 3 or cfg.zero3_layer_units,
            )
        if cfg.gradient_checkpointing:
            recompute_layers(lm)
        elif cfg.recompute_mlp:
            recompute_mlps(lm, cfg.recompute_mlp_layers)
        if self.on_gpu and runs_per_sequence(cfg.packed_attention):
            self._warm_sequence_plans(lm.config)
        self.policy = LogprobPolicy(lm, cfg.logprob_chunk_tokens, cfg.head_kernels)
        if cfg.zero_stage == 3:
            if cfg.zero3_layer_units:
                zero3_layer_units(lm)
            # the fused head reads the weight directly, not through lm_head's forward (whose hooks
            # would gather it)
            deepspeed.zero.register_external_parameter(self.policy, self.policy.head_weight)
        if cfg.compile_layers:
            # Regional compilation: one graph serves every layer (same code, parameters as inputs)
            for layer in lm.get_decoder().layers:
                layer.compile()
        self.lm_config = lm.config
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if cfg.offload_optimizer == "cpu":
            # ZeRO-Offload steps Adam on the host with DeepSpeed's vectorized CPU Adam
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(
                params,
                lr=schedule.lr,
                betas=cfg.betas,
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
                adamw_mode=True,
            )
        else:
            optimizer = torch.optim.AdamW(
                params,
                lr=schedule.lr,
                betas=cfg.betas,
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
                foreach=self.on_gpu,
            )
        factor = lr_lambda(schedule, total_steps)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.policy,
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
            config=ds_config,
        )
        # from_pretrained leaves the model in eval mode, and HF recomputes a layer (gradient
        # checkpointing) only in training mode: without this, recomputation is silently off
        self.engine.train()
        self.device = self.engine.device
        self.step_count = 0

    def _warm_sequence_plans(self, config: Any) -> None:
        """cuDNN's plans for every padded sequence length a micro-batch can bring, built before the first step
        through the training path's own layout, under the steps' kernel priority."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        with sdpa_priority(self.cfg.sdpa_backends):
            lengths = warm_sequence_plans(
                heads,
                getattr(config, "num_key_value_heads", heads),
                head_dim,
                self.cfg.micro_batch_tokens,
                torch.device("cuda", self.local_rank),
                dtype,
            )
        log.info("per-sequence attention: plans built for %d padded lengths up to %d", len(lengths), lengths[-1])

    # -- compute ---------------------------------------------------------------------------------

    @property
    def module(self) -> LogprobPolicy:
        return self.engine.module

    @property
    def hf_model(self) -> nn.Module:
        return self.engine.module.lm

    def num_parameters(self) -> int:
        params = {id(p): p for p in self.hf_model.parameters()}
        return sum(getattr(p, "ds_numel", p.numel()) for p in params.values())

    def logprobs(self, row: PackedRow, *, grad: bool, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprob and entropy of every target of a row ([T]) or micro-batch ([B, T]), flattened to [B·T]."""
        ctx = nullcontext() if grad else torch.no_grad()
        inputs = [t if t.dim() == 2 else t[None] for t in (row.input_ids, row.position_ids, row.targets)]
        # The attention kernel is chosen in the forward; its backward follows that choice, and recomputation in
        # backward runs under the same priority (sdpa_as_in_forward).
        with ctx, sdpa_priority(self.cfg.sdpa_backends if self.on_gpu else None):
            return self.engine(
                *(t.to(self.device) for t in inputs),
                with_entropy,
                bounds=device_bounds(getattr(row, "bounds", None), self.device),
            )

    def reference_policy(self) -> LogprobPolicy:
        """A frozen copy of the starting weights (read again from `model_dir`), for the KL term."""
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.bfloat16 if self.bf16 else torch.float32, **attention_choice(self.cfg)
        )
        ref = LogprobPolicy(lm, self.cfg.logprob_chunk_tokens, self.cfg.head_kernels).to(self.device).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def backward(self, loss: torch.Tensor) -> None:
        # Losses are pre-weighted for the whole step and DeepSpeed averages gradients over ranks;
        # callers multiply by world_size so the sum over ranks comes out right.
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> StepResult:
        self.engine.step()
        self.step_count += 1
        norm = self.engine.get_global_grad_norm()
        norm = float(norm.item() if torch.is_tensor(norm) else (norm if norm is not None else float("nan")))
        return StepResult(grad_norm=norm, lr=float(self.scheduler.get_last_lr()[0]))

    def close(self) -> None:
        """Remove DeepSpeed's gradient hooks and buffers, so that dropping this engine frees its
        memory (a later engine in the same process, e.g. the next benchmark variant)."""
        self.engine.destroy()

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, folder: Path, client_state: dict[str, Any], tag: str | None = None) -> Path:
        """Model, optimizer, scheduler (DeepSpeed's files) plus step, RNG and our client state.
        DeepSpeed writes `latest` last, so a kill mid-save leaves the previous checkpoint in force.
        Tags start with `step` and the zero-padded step count, so that their names sort by age."""
        tag = tag or f"step{self.step_count:07d}"
        state = {"step": self.step_count, "rng": rng_state(), **client_state}
        self.engine.save_checkpoint(str(folder), tag=tag, client_state=state)
        if self.local_rank == 0:  # one pruner per node's disk
            prune_checkpoints(folder, self.cfg.keep_checkpoints)
        return folder / tag

    def load_checkpoint(self, folder: Path) -> dict[str, Any] | None:
        if not (folder / "latest").is_file():
            return None
        path, state = self.engine.load_checkpoint(
            str(folder), load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            return None
        self.step_count = int(state["step"])
        set_rng_state(state["rng"])
        return state

    # -- full weights, bucket by bucket ----------------------------------------------------------

    def iter_weight_buckets(
        self, bucket_bytes: int = 256 * 2**20, dtype: torch.dtype | None = None, device: str = "cpu"
    ) -> Iterator[FlatBucket]:
        """Full (unsharded) HF-named weights, one flat byte buffer per bucket of about `bucket_bytes`.

        Under ZeRO-3 each bucket is gathered with GatheredParameters and released before the
        next, so peak memory is one bucket, not the model. Tied weights appear once. GPU → host
        copies land in pinned buffers kept for the next publication (one copy per bucket)."""
        if not hasattr(self, "_pinned"):
            self._pinned: list[torch.Tensor] = []
        pinned = self._pinned if (self.on_gpu and device == "cpu") else None
        yield from iter_weight_buckets(
            self.hf_model,
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            zero3=self.cfg.zero_stage == 3,
            device=device,
            pinned=pinned,
        )


def prune_checkpoints(folder: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` checkpoint tags (never the one `latest` names); returns
    the deleted tags. Tags are `step` plus a zero-padded count, so their names sort by age."""
    latest = folder / "latest"
    current = latest.read_text().strip() if latest.is_file() else None
    tags = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name.startswith("step"))
    doomed = [t for t in tags[: max(len(tags) - keep, 0)] if t != current]
    for tag in doomed:
        shutil.rmtree(folder / tag, ignore_errors=True)
    return doomed


def _gathered(params: list[nn.Parameter], zero3: bool):
    if not zero3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def iter_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int = 256 * 2**20,
    dtype: torch.dtype | None = None,
    zero3: bool = False,
    device: str | torch.device = "cpu",
    pinned: list[torch.Tensor] | None = None,
) -> Iterator[FlatBucket]:
    from services.weights.buckets import flatten, parameter_groups

    named = list(model.named_parameters(remove_duplicate=True))
    for k, group in enumerate(parameter_groups(named, bucket_bytes, dtype)):
        with _gathered([p for _, p in group], zero3):
            tensors = [(n, p.detach()) for n, p in group]
            on_device = tensors[0][1].device
            if torch.device(device) == on_device:
                # Same device: flatten() allocates a fresh buffer, so the copy outlives a ZeRO-3 gather.
                yield flatten(tensors, dtype=dtype)
                continue
            need = sum(t.numel() * (dtype or t.dtype).itemsize + 64 for _, t in tensors)
            if pinned is not None:
                while len(pinned) <= k:
                    pinned.append(torch.empty(0, dtype=torch.uint8))
                if pinned[k].numel() < need:
                    pinned[k] = torch.empty(need, dtype=torch.uint8, pin_memory=True)
                out = pinned[k]
            else:
                out = torch.empty(need, dtype=torch.uint8, device=device)
            yield flatten(tensors, dtype=dtype, out=out)
