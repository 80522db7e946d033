"""Typed recipes for the learner: SFT and RL (GRPO / DAPO), with the paper's defaults.

Defaults follow spec/paper-recipe.md (SFT: lr 5e-6, 4 epochs, batch 32, warmup 0.1, cosine;
RL: GRPO, G = 8, 32 prompts per step, lr 2e-6, clip-higher, token-level normalization, no KL).
The clip bounds are DAPO's 0.2 / 0.28: the paper says "clip-higher" without numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.common.schemas import FinishReason
from services.rollout.chat import ChatOptions

Schedule = Literal["cosine", "linear", "constant"]
# What happens to an episode that ran out of context or tool calls before it answered. "mask": out of
# the loss, as rLLM's overlong filter (the STAR code's setting); "fail": trained as a reward-0 failure,
# as the paper counts it. The paper does not say which it trained with (spec/agent-star.md §4.4).
TruncationPolicy = Literal["mask", "fail"]
# What happens to a group with episodes cut at their deadline (finish_reason "deadline"). "drop": the
# whole group leaves the batch; "partial": its finished episodes are trained, normalized among
# themselves, and the cut ones leave; "mask": every episode stays in the group's normalization and the
# cut ones are out of the loss (zero advantage on their tokens), as a truncation under "mask".
LateGroupPolicy = Literal["drop", "partial", "mask"]
TRUNCATED_FINISHES: tuple[FinishReason, ...] = ("context_limit", "tool_budget")


def masked_finishes(policy: TruncationPolicy) -> list[FinishReason]:
    """Finish reasons whose samples leave the loss: an engine error is never the policy's doing."""
    return [*TRUNCATED_FINISHES, "engine_error"] if policy == "mask" else ["engine_error"]


def late_masked_finishes(policy: LateGroupPolicy) -> list[FinishReason]:
    """Finish reasons the loss leaves out under a late-group policy: a cut episode under "mask"."""
    return ["deadline"] if policy == "mask" else []


def zero_reward_finishes(policy: TruncationPolicy) -> list[FinishReason]:
    """Finish reasons whose reward is forced to 0: a missing answer, and under "fail" a truncation."""
    return ["format_error"] if policy == "mask" else ["format_error", *TRUNCATED_FINISHES]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineConfig(_Strict):
    """How DeepSpeed runs the policy."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto: bf16 on GPU, fp32 on CPU (CPU bf16 matmuls are slow and lossy here)."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward (a 30K-token row's activations "
        "do not fit beside a 1.5B+ model otherwise).",
    )
    recompute_mlp: bool = Field(
        False,
        description="Selective recomputation: recompute only each layer's MLP in backward (its "
        "intermediate-width activations are most of a layer's memory), keep attention's. "
        "Ignored under gradient_checkpointing, which recomputes whole layers.",
    )
    recompute_mlp_layers: int | None = Field(
        None,
        ge=1,
        description="With recompute_mlp: how many decoder layers, the first ones, recompute their MLP (None: "
        "every layer). Each layer left out keeps its MLP-wide activations (2 x intermediate bytes per token in "
        "bf16 under activation_memory lean, 4 x otherwise) and skips a second gate and up projection in "
        "backward: the fewest layers whose activations fit the card is the fastest setting.",
    )
    activation_memory: Literal["keep", "lean"] = Field(
        "keep",
        description="keep: every activation eager PyTorch saves; lean: the SwiGLU MLP saves only its gate "
        "and up (the product recomputed in backward) and each RMSNorm's output is rebuilt in "
        "backward from its input rather than saved (services/learner/fused_layers.py): about "
        "2 x intermediate + 4 x hidden bytes less per token and layer in bf16. Combines with "
        "recompute_mlp; under gradient_checkpointing only the SwiGLU part applies.",
    )
    ranks: int | None = Field(
        None,
        ge=1,
        description="Learner processes, launched under torchrun, one GPU each on a GPU machine (None: "
        "every visible GPU, 1 on CPU). More ranks than visible GPUs is refused.",
    )
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-1/2/3: keep Adam's state (and step it) in host memory."
    )
    offload_params: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-3: keep the parameter shards in host memory."
    )
    zero_init: bool = Field(
        True,
        description="ZeRO-3: build the model under deepspeed.zero.Init, so that each rank materializes only its "
        "shard (a 7B model never sits whole in one process).",
    )
    zero3_layer_units: bool = Field(
        True,
        description="ZeRO-3: each decoder layer is one unit (a DeepSpeed leaf module): its parameters are "
        "gathered together on entry and its gradients reduced together after its backward, instead "
        "of hooks and collectives for every linear and norm inside it.",
    )
    fp32_grad_accum: bool = Field(
        True,
        description="Under bf16 with ZeRO, accumulate gradients in fp32 partitions (DeepSpeed data_types."
        "grad_accum_dtype): bf16 accumulation over 128-256 micro-batches lost 1.3-1.8 % of the "
        "gradient.",
    )
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Under bf16 with ZeRO, the dtype gradients are reduce-scattered in (DeepSpeed "
        "communication_data_type). bf16 moves half the bytes and rounds each micro-batch's "
        "summed gradient once before the fp32 accumulation: 0.17 % of the gradient over 2 ranks, "
        "not growing with the micro-batches (bench/results/grad_precision.md).",
    )
    overlap_comm: bool | None = Field(
        None, description="ZeRO-2/3: overlap gradient reduction with the backward pass (None: on GPU only)."
    )
    micro_batch_tokens: int = Field(4096, ge=16, description="Token capacity of one packed micro-batch row.")
    micro_batch_rows: int = Field(
        1,
        ge=1,
        description="Packed rows stacked along the batch dimension in one forward/backward (right-padded to "
        "the longest); fewer, larger micro-batches cut per-pass launch and gradient-hook overhead.",
    )
    pad_to_multiple: int = Field(
        1,
        ge=1,
        description="Right-pad each micro-batch's length up to a multiple of this (e.g. 256 on GPU): few "
        "distinct shapes let cuDNN attention reuse its plans and compiled layers their graphs.",
    )
    logprob_chunk_tokens: int = Field(
        2048,
        ge=16,
        description="Tokens per chunk of the fused vocabulary head and log-prob (the logits of one chunk "
        "exist at a time, forward and backward).",
    )
    head_kernels: Literal["auto", "compiled", "eager"] = Field(
        "auto",
        description="The fused head's element-wise work: torch.compile'd (one pass over each chunk's logits) "
        "or eager PyTorch ops; auto: compiled on GPU.",
    )
    fuse_pointwise: bool | None = Field(
        None,
        description="RMSNorm, rotary embedding and the SwiGLU product as torch.compile'd functions, each fused "
        "into a kernel or two (services/learner/pointwise.py); None: on GPU.",
    )
    compile_layers: bool = Field(
        False, description="torch.compile each decoder layer (fuses norms, rotary, SiLU on GPU)."
    )
    attn_implementation: str | None = Field(
        None,
        description="e.g. sdpa, eager, flash_attention_2; None: transformers' choice. Used where packed_attention "
        "is mask; otherwise only sdpa (the kernel of unpacked rows) is accepted.",
    )
    packed_attention: Literal["auto", "varlen", "varlen-gqa", "per-sequence", "mask"] = Field(
        "auto",
        description="How the sequences of a packed row are kept apart. By their boundaries, with no [T, T] "
        "mask (services/learner/attention.py): auto: per-sequence for rows whose sequences average at least 4,096 "
        "tokens and on CPU (exact against unpacked rows), varlen for shorter ones on a GPU; "
        "varlen: the varlen kernel; varlen-gqa: varlen with K and V at their own head count, never repeated "
        "to the query's (FlashAttention's GQA); per-sequence: causal SDPA over each sequence in the layout "
        "the plain path hands SDPA (on a GPU its cuDNN plans for every padded length built before the first "
        "step). mask: transformers builds a [B, 1, T, T] block mask "
        "for attn_implementation (2.6x the cost of the sequences alone at 7B width, "
        "bench/results/packed_attention.md).",
    )
    sdpa_backends: list[Literal["cudnn", "flash", "efficient", "math"]] | None = Field(
        None, description="SDPA kernels in priority order on GPU (e.g. [cudnn, flash]); None: PyTorch's order."
    )
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0.0)
    grad_clip: float = Field(1.0, ge=0.0, description="Global grad-norm clip (0: off).")
    reduce_bucket_size: int = Field(
        50_000_000, ge=1, description="ZeRO-2/3 gradient reduce bucket in elements (DeepSpeed counts elements)."
    )
    allgather_bucket_size: int = Field(
        50_000_000, ge=1, description="ZeRO-2 all-gather bucket for the updated parameters, in elements."
    )
    param_persistence_threshold: int = Field(
        10_000,
        ge=0,
        description="ZeRO-3: parameters with at most this many elements stay whole on every rank "
        "(norms, biases), never gathered (DeepSpeed stage3_param_persistence_threshold).",
    )
    persistent_weights_gib: float = Field(
        4.0,
        ge=0.0,
        description="ZeRO-3: GiB per rank that whole weights may take. Parameters stay whole on every rank, "
        "in model order, while they fit (DeepSpeed stage3_model_persistence_threshold), and are "
        "never gathered again; the rest are sharded and gathered layer by layer. A 1.5B model's "
        "bf16 weights (3.1 GB) fit whole; gradients and Adam state stay sharded either way. "
        "0: shard every parameter above param_persistence_threshold.",
    )
    nccl_protocol: Literal["Simple", "LL128", "LL"] | None = Field(
        "Simple",
        description="NCCL_PROTO for the learner's collectives where the environment does not set it. "
        "Simple moves a layer's bf16 weights at 433 GB/s where NCCL's own choice gave 291 "
        "(bench/nccl_protocols.py), and ZeRO-3 steps ran 5-8 % faster with it on 2× H100 "
        "(docs/gpu.md). The learner's own collectives only: the weight group it forms with vLLM engines keeps "
        "NCCL's choice, as the engines do; None: NCCL's choice everywhere.",
    )
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="Training checkpoints kept on disk, newest first; older tags are deleted after each "
        "save. A tag holds the optimizer state too (about 14 bytes per parameter): unpruned, "
        "a 135 M model's tags (about 1.9 GB each) fill a 64 GiB disk in a few dozen steps.",
    )
    seed: int = 0

    @model_validator(mode="after")
    def _one_attention(self) -> EngineConfig:
        if self.packed_attention != "mask" and self.attn_implementation not in (None, "sdpa"):
            raise ValueError(
                f"attn_implementation {self.attn_implementation!r} is not used under packed_attention "
                f"{self.packed_attention}; set packed_attention: mask to use it"
            )
        return self

    @model_validator(mode="after")
    def _mlp_layers_need_recompute(self) -> EngineConfig:
        if self.recompute_mlp_layers is not None and not self.recompute_mlp:
            raise ValueError(
                f"recompute_mlp_layers {self.recompute_mlp_layers} needs recompute_mlp: true (it says how many "
                "layers recompute their MLP)"
            )
        return self

    @model_validator(mode="after")
    def _lean_not_compiled(self) -> EngineConfig:
        if self.activation_memory == "lean" and self.compile_layers:
            raise ValueError(
                "activation_memory lean replaces the layers' MLP and norm code with autograd functions "
                "and saved-tensor hooks, which compile_layers would trace; use one of the two"
            )
        return self

    @model_validator(mode="after")
    def _offload_fits_stage(self) -> EngineConfig:
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ValueError(f"offload_params needs zero_stage 3 (got {self.zero_stage})")
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs ZeRO (zero_stage 1, 2 or 3)")
        return self


class ScheduleConfig(_Strict):
    lr: float = Field(gt=0.0)
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    schedule: Schedule = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Floor of the decay, as a fraction of lr.")


class SFTConfig(_Strict):
    """Supervised fine-tuning on chat trajectories (loss on assistant turns only)."""

    model: str = Field(description="HF model folder of the starting policy.")
    data: str = Field(description="JSONL file: one {'messages': [...]} chat per line.")
    output_dir: str = Field(description="Run folder: checkpoints, metrics.jsonl, TensorBoard, exports.")
    lr: float = Field(5e-6, gt=0.0)
    epochs: float = Field(4, gt=0.0)
    batch_size: int = Field(32, ge=1, description="Sequences per optimizer step (across all ranks).")
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    schedule: Schedule = "cosine"
    max_seq_len: int = Field(20480, ge=16, description="Longer chats are truncated (LLaMA-Factory cutoff_len).")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    chat: ChatOptions = Field(
        default_factory=ChatOptions,
        description=(
            "The chat format the chats are rendered in, as the rollout's (a recipe's services.chat): the model's "
            "template with the agent's tools and system prompt, or ChatML (docs/models.md)."
        ),
    )

    def schedule_config(self) -> ScheduleConfig:
        return ScheduleConfig(lr=self.lr, warmup_ratio=self.warmup_ratio, schedule=self.schedule)


class FilterConfig(_Strict):
    """Which groups and samples reach the loss."""

    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards all match.")
    refill: bool = Field(False, description="DAPO: read more groups until the batch is full again.")
    max_refill_rounds: int = Field(3, ge=0, description="Extra reads per step when refilling (0: unlimited).")
    variance_keep_fraction: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="StarPO-S: keep this fraction of groups with the largest reward spread (1: off).",
    )
    zero_variance_eps: float = Field(
        1e-6, ge=0.0, description="Groups with max - min reward at most this count as flat."
    )
    mask_finish_reasons: list[FinishReason] = Field(
        default_factory=lambda: masked_finishes("mask"),
        description="Overlength / truncated samples: out of the loss, kept in their group's normalization.",
    )
    zero_reward_finish_reasons: list[FinishReason] = Field(
        default_factory=lambda: zero_reward_finishes("mask"), description="Samples whose reward is forced to 0."
    )
    max_staleness: int = Field(0, ge=0, description="Drop samples more than this many versions behind the learner.")


class RLKnobs(_Strict):
    """The RL settings a recipe's `rl:` section and the learner's RLConfig share, declared once: a recipe's
    values reach the learner as they are (services.pipeline.config.RLSpec.learner_fields)."""

    group_size: int = Field(8, ge=1, description="Episodes sampled per prompt (G), normalized together.")
    batch_prompts: int = Field(32, ge=1, description="Groups (prompts) per optimizer step.")
    lr: float = Field(2e-6, gt=0.0, description="Learning rate.")
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per full batch of batch_prompts × group_size, each on whole groups (verl's "
        "ppo_mini_batch_size as a count; 1: one update per batch); a batch that DAPO, the filters or staleness "
        "shrank makes fewer steps of the same number of groups.",
    )
    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower clip bound of the importance ratio (1 - eps_low).")
    eps_high: float = Field(
        0.28, ge=0.0, description="Upper clip bound of the importance ratio (1 + eps_high; clip-higher: ≥ eps_low)."
    )
    # The policy loss's bounds and corrections (docs/rl-numerics.md).
    dual_clip_c: float | None = Field(
        3.0,
        gt=1.0,
        description=(
            "Dual-clip bound for negative advantages: a token costs at most c·|A| (verl's default 3; None: off)."
        ),
    )
    log_ratio_clamp: float | None = Field(
        20.0,
        gt=0.0,
        description=(
            "Clamp of log(π/π_old) per token before exp (verl's ±20): one token far off the sampler gives a finite "
            "loss and no gradient (None: off)."
        ),
    )
    importance_sampling: Literal["off", "tis", "mis"] = Field(
        "off",
        description=(
            "Token-level correction from the sampler to the learner's policy before the update (docs/rl-numerics.md): "
            "tis truncates the weight at is_high, mis zeroes tokens whose weight leaves [is_low, is_high]; "
            "on, the clip ratio is against the learner's own log-probs."
        ),
    )
    is_low: float = Field(0.5, ge=0.0, le=1.0, description="mis: lower bound of the token importance weight.")
    is_high: float = Field(2.0, ge=1.0, description="tis: cap of the token importance weight; mis: upper bound.")
    loss_agg: Literal["token-mean", "group-token-mean", "seq-mean-token-mean"] = Field(
        "token-mean",
        description=(
            "token-mean: every loss token of the step weighs the same; group-token-mean: the paper's, tokens "
            "normalized within their group, groups averaged; seq-mean-token-mean: each sequence weighs the same."
        ),
    )
    # Not the paper's (it trains KL-free): a brake on RL unlearning what SFT taught. The reference is
    # the stage's starting model, usually the SFT export.
    kl_coef: float = Field(0.0, ge=0.0, description="KL to the reference policy (0: KL-free, no reference model).")
    negative_scale: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description=(
            "Weight of negative advantages (1: GRPO as the paper; 0: only samples above their group's mean train, "
            "as in RAFT++)."
        ),
    )
    late_groups: LateGroupPolicy = Field(
        "partial",
        description=(
            "A group with episodes cut at their deadline (rl.sampling's turn_timeout_s, episode_timeout_s, "
            "group_timeout_s; finish_reason deadline): drop leaves the whole group out; partial trains its finished "
            "episodes, normalized among themselves; mask keeps every episode in the group's normalization with the "
            "cut ones out of the loss. Counted as groups_late, groups_dropped_late, groups_partial, episodes_cut."
        ),
    )
    save_every: int = Field(
        4,
        ge=1,
        le=16,
        description="Checkpoint every N steps (and at the end). Resume stays exact: the batches "
        "since the last checkpoint are replayed from the stream, whose messages are acknowledged only at "
        "checkpoints; so at most N steps are trained again after a crash.",
    )
    samples_per_step: int = Field(
        4,
        ge=0,
        description=(
            "Trajectories of each trained step written whole to samples.jsonl, one per group (the group's first "
            "sample, so not picked by reward); 0: none. What the policy says, step by step."
        ),
    )

    @field_validator("importance_sampling", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        # YAML reads a bare `off` as false
        return "off" if value is False else value


class RLConfig(RLKnobs):
    """GRPO-family RL on scored trajectories from the stream (the fields a recipe shares: RLKnobs)."""

    model: str = Field(description="HF model folder of the starting policy (usually the SFT export).")
    output_dir: str
    algorithm: Literal["grpo", "dapo"] = "grpo"
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    schedule: Schedule = "constant"
    total_steps: int = Field(155, ge=1, description="For the schedule; the paper's 5 epochs over 1K prompts.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many batches (steps).")
    temperature: float = Field(
        1.0,
        gt=0.0,
        description=(
            "The rollout's sampling temperature: the learner's log-probs are of logits / temperature, so samples "
            "drawn at T != 1 stay on-policy; the rollouts record their log-probs at the same temperature."
        ),
    )
    sampling_cut: bool = Field(
        False,
        description=(
            "The rollouts sample under a top-p or top-k cut: their recorded log-probs are of the cut distribution, "
            "which the learner does not compute. They then serve only as the behaviour policy of the importance "
            "correction (tis/mis); the ratio's old policy is the learner's own forward from before the update."
        ),
    )
    std_normalize: bool = Field(True, description="Divide by the group's std (GRPO); False: Dr.GRPO-style mean only.")
    use_rollout_logprobs: bool = Field(
        True, description="Importance ratio against the rollout's logprobs; False: the learner's own recomputation."
    )
    filters: FilterConfig = Field(default_factory=FilterConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    # the data stream and where weights go
    redis_url: str | None = None
    stream_prefix: str = "star"
    consumer_group: str = "learner"
    consumer_name: str = "learner-0"
    read_block_ms: int = Field(1000, ge=1)
    wait_timeout_s: float = Field(3600.0, gt=0.0, description="Give up a step when no data comes for this long.")
    straggler_wait_s: float = Field(
        600.0, gt=0.0, description="How long a batch waits for its own step's groups before taking later steps' ones."
    )
    oversample_groups: int = Field(
        0,
        ge=0,
        description=(
            "Groups the controller publishes per step beyond batch_prompts: a step takes its first batch_prompts "
            "complete groups, the surplus goes to later steps while fresh enough (filters.max_staleness), else it is "
            "dropped and counted (groups_surplus_dropped)."
        ),
    )
    publish_weights: bool = True
    weights_dir: str | None = Field(
        None, description="Weights store (default: STAR_WEIGHTS_ROOT, else STAR_HOME/weights)."
    )
    keep_versions: int = Field(3, ge=1)
    publish_start: bool = Field(
        False,
        description=(
            "Publish the starting weights as version 0 before the first step, when nothing is published yet: "
            "rollout workers started on a model of their own (an external fleet) load it before they sample, so the "
            "first step is sampled by the policy it trains."
        ),
    )
    rollout_servers: list[str] = Field(default_factory=list, description="Base URLs that get POST /weights.")
    weight_sync: Literal["files", "nccl", "ipc"] = Field(
        "files",
        description=(
            "files: each version written to the weights store and loaded by the servers from it (any host). nccl: "
            "broadcast from rank 0 into every rollout server's vLLM engine (engines started with weight_transfer: "
            "nccl); the store still gets every `files_every`-th version and any version a server missed. ipc: the "
            "servers are colocated on the learner's GPUs (services/learner/colocate.py): asleep while it trains, "
            "woken with each version by CUDA IPC; the store gets every `files_every`-th version."
        ),
    )
    sleep_level: Literal[1, 2] = Field(1, description="With weight_sync ipc: the servers' vLLM sleep level.")
    sleep_timeout_s: float = Field(
        300.0,
        gt=0,
        description=(
            "With weight_sync ipc: how long every server may take to finish its turns and sleep before the learner "
            "refuses the step."
        ),
    )
    nccl_master: str = Field(
        "127.0.0.1:29731",
        description=(
            "host:port rank 0 listens on for the weight group; auto (an external fleet): the address and port the "
            "learner announces (STAR_NCCL_MASTER_ADDR or its address on the route to the first server, STAR_NCCL_PORT)."
        ),
    )
    files_every: int = Field(10, ge=1, description="With weight_sync nccl: also write every N-th version to the store.")
    nccl_timeout_s: float = Field(
        120.0,
        gt=0,
        description=(
            "With weight_sync nccl: the longest forming the group or one broadcast may take before rank 0 ends for a "
            "restart (services.weights.nccl.NcclPublisher)."
        ),
    )

    @model_validator(mode="after")
    def _dapo_filters(self) -> RLConfig:
        if self.eps_high < self.eps_low:
            raise ValueError(f"clip-higher needs eps_high >= eps_low (got {self.eps_high} < {self.eps_low})")
        if self.algorithm == "dapo" and not self.filters.dynamic_sampling:
            self.filters.dynamic_sampling = True
        return self

    def schedule_config(self) -> ScheduleConfig:
        return ScheduleConfig(lr=self.lr, warmup_ratio=self.warmup_ratio, schedule=self.schedule)


def load_config(path: str | Path, kind: type[BaseModel]) -> BaseModel:
    """Read a JSON or YAML recipe file into `kind`, with a clear error for a bad file."""
    import json

    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    return kind.model_validate(data)
