"""The STAR pipeline recipe: one typed YAML file per run (configs/*.yaml).

A recipe names the stages to run (synth → sft → rl → eval) and the settings of each; the
sections become the learner's SFTConfig/RLConfig, the rollout tasks' SamplingParams and the
reward schedule. Defaults are the paper's (spec/paper-recipe.md); `configs/tiny.yaml` shrinks
everything to finish on a laptop CPU in minutes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from services.common.schemas import ArpoParams, EvalMode, PreferencePenalty, RewardKind, SamplingParams, VllmArgs
from services.evaluation.runner import MODEL_CONCURRENCY
from services.learner.config import (
    EngineConfig,
    FilterConfig,
    RLKnobs,
    TruncationPolicy,
    late_masked_finishes,
    masked_finishes,
    zero_reward_finishes,
)
from services.reward.rewards import Curriculum, CurriculumUnit
from services.rollout.chat import ChatOptions

Stage = Literal["synth", "sft", "rl", "eval"]
STAGES: tuple[Stage, ...] = ("synth", "sft", "rl", "eval")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TinyModel(_Section):
    """A random Qwen2 policy with the Qwen2.5 vocabulary, built offline (services.models)."""

    hidden: int = Field(128, description="Hidden size; hidden / heads must be 64 (vLLM's CPU attention kernel).")
    layers: int = Field(2, description="Decoder layers.")
    heads: int = Field(2, description="Attention heads.")
    kv_heads: int = Field(1, description="Key/value heads (grouped-query attention); heads must be a multiple.")
    seed: int = Field(0, description="Seed of the random weights: same arguments, same weights.")
    tokenizer: Literal["travel", "qwen"] = Field(
        "travel", description="travel: our 4K BPE (fast on CPU); qwen: the Qwen2.5 vocabulary (152K rows)."
    )


class ModelSpec(_Section):
    path: str | None = Field(None, description="HF model folder (e.g. Qwen2.5-7B-Instruct); None: build `tiny`.")
    tiny: TinyModel | None = Field(None, description="Build a tiny random policy instead of loading `path`.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("model: give exactly one of `path` or `tiny`")
        return self


class WorldSpec(_Section):
    source: Literal["official", "synthetic"] = Field(
        "official",
        description="official: the real TravelPlanner tables (STAR_TRAVELPLANNER_DIR) with generated "
        "flights; synthetic: a generated world of synthetic_size.",
    )
    synthetic_size: Literal["tiny", "small", "medium", "full"] = Field(
        "small", description="Size of a synthetic world (full: the benchmark's scale)."
    )
    db_url: str | None = Field(None, description="World database; default STAR_DB_URL or STAR_HOME/world.sqlite.")


class SynthSpec(_Section):
    sft_queries: int = Field(1200, ge=0, description="Queries whose teacher trajectories train SFT.")
    rl_queries: int = Field(1000, ge=0, description="RL prompts; an RL epoch is rl_queries / rl.batch_prompts steps.")
    val_queries: int = Field(
        180,
        ge=0,
        description="Validation queries: RL's best-checkpoint selection (rl.val_every), "
        "and the eval stage's default where no held-out queries are made.",
    )
    heldout_queries: int = Field(
        0,
        ge=0,
        description="Queries for the eval stage alone, apart from the validation "
        "set that picks the RL checkpoint (the benchmark's test split plays this part).",
    )
    mix: tuple[int, int, int] = Field((4, 3, 3), description="easy:medium:hard")
    rl_mix: tuple[int, int, int] | None = Field(
        None,
        description="easy:medium:hard of the RL prompts alone (the "
        "paper's RL set is 4:3:3); default: mix. A level the SFT model never "
        "solves only makes flat groups under the success reward.",
    )
    days: list[Literal[3, 5, 7]] = Field(
        [3, 5, 7], min_length=1, description="Trip lengths drawn (the benchmark's 3, 5, 7)."
    )
    flight_share: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Share of flight trips; a hard query forbids self-driving "
        "on a flight trip and flights on a road trip.",
    )
    teacher: Literal["oracle", "openai"] = Field(
        "oracle", description="Who writes the SFT trajectories: the oracle planner, or an OpenAI-compatible model."
    )
    seed: int = Field(0, description="Seed of query synthesis and the teacher.")

    @model_validator(mode="after")
    def _mixes_are_ratios(self) -> SynthSpec:
        from services.synth.queries import parse_ratio  # the rule `star synth queries` applies to --mix

        for name in ("mix", "rl_mix"):
            ratio = getattr(self, name)
            if ratio is not None:
                parse_ratio(":".join(map(str, ratio)), 3, f"synth.{name}")
        return self


class SFTSpec(_Section):
    epochs: float = Field(4, gt=0, description="Passes over the teacher trajectories (fractions allowed).")
    lr: float = Field(5e-6, gt=0, description="Peak learning rate (linear warmup, then cosine decay).")
    batch_size: int = Field(32, ge=1, description="Trajectories per optimizer step.")
    warmup_ratio: float = Field(0.1, ge=0, lt=1, description="Share of the steps spent warming up.")
    max_seq_len: int = Field(20480, ge=64, description="Longest trajectory in tokens; longer ones are truncated.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (default: epochs).")


def sampling_cuts(sampling: SamplingParams) -> list[str]:
    """The top-p / top-k cuts a sampler applies, as a recipe spells them ([] when it samples the whole
    distribution, which the learner trains)."""
    cuts = []
    if sampling.top_p < 1.0:
        cuts.append(f"top_p {sampling.top_p:g}")
    if sampling.top_k > 0:
        cuts.append(f"top_k {sampling.top_k}")
    return cuts


class RLSpec(RLKnobs):
    """The RL stage: the knobs it shares with the learner (RLKnobs, passed on by `learner_fields`), and what
    the controller alone reads (epochs, rewards, sampling, validation, budgets)."""

    algorithm: Literal["grpo", "dapo", "arpo"] = "grpo"
    arpo: ArpoParams = Field(default_factory=ArpoParams, description="Branching settings when algorithm is arpo.")
    epochs: int = Field(5, ge=1)
    reward: RewardKind = "sum"
    # before `curriculum`, whose validator reads it
    curriculum_unit: CurriculumUnit = Field(
        "epoch",
        description=(
            "What the curriculum's stage numbers count: epochs (the paper's) or RL steps, for runs of an epoch or two."
        ),
    )
    curriculum: str = Field("sum:1-2,macro:3-4,success:5", description="Reward schedule when reward is curriculum.")
    preference_penalty: PreferencePenalty = 0.0
    truncated: TruncationPolicy = Field(
        "mask",
        description=(
            "Episodes that ran out of context or tool calls: mask leaves them out of the loss (the STAR code's "
            "overlong filter), fail trains them as reward-0 failures (the paper calls them failures)."
        ),
    )
    eval_mode: EvalMode = Field("strict", description="Evaluator mode of the training reward.")
    sampling: SamplingParams = Field(
        default_factory=SamplingParams,
        description=(
            "Rollout sampling. The learner's log-probs are taken at this temperature; top_p < 1 or a top_k makes the "
            "samples off-policy (the learner trains the whole distribution)."
        ),
    )
    fault_rate: float = Field(0.0, ge=0, le=1, description="Tool failure injection during RL (paper: 0, 1, 5, 10%).")
    max_staleness: int = Field(0, ge=0, description="0: synchronous on-policy; k: rollouts may lag k versions.")
    val_every: int = Field(0, ge=0, description="Validate every N steps and keep the best checkpoint (0: off).")
    keep_validated: Literal["best", "all"] = Field(
        "best",
        description="Which validated versions keep their weights in the run folder: the best so far (a "
        "version's copy is removed once a better one is validated: a 7B version is about 15 GB) or all of them.",
    )
    max_steps: int | None = Field(None, ge=1)
    max_minutes: float | None = Field(
        None,
        gt=0,
        description="Wall-clock budget of the RL stage: once spent, the stage ends with the latest "
        "published weights and the steps not yet trained are left out (default: no budget).",
    )
    oversample: float = Field(
        0.0,
        ge=0,
        le=4,
        description=(
            "Over-sampling: the controller publishes ceil(batch_prompts × (1 + oversample)) prompts a step and the "
            "step trains the first batch_prompts groups to complete, so it does not wait for its slowest groups; the "
            "surplus trains at a later step while within max_staleness, else it is dropped (groups_surplus_dropped). "
            "With max_staleness 0 every surplus group is dropped: sampled work traded for step time."
        ),
    )

    @field_validator("curriculum")
    @classmethod
    def _curriculum_reads(cls, text: str, info: ValidationInfo) -> str:
        # Read when the recipe loads: the RL stage parses it only after synthesis and SFT have run.
        Curriculum.parse(text, info.data.get("curriculum_unit", "epoch"))
        return text

    @model_validator(mode="after")
    def _samples_are_drawn(self) -> RLSpec:
        # the learner's log-probs are of logits / T: greedy decoding (T = 0) has no policy to train
        if self.sampling.temperature <= 0:
            raise ValueError("rl.sampling.temperature must be above 0: RL trains on sampled turns, not greedy ones")
        return self

    @model_validator(mode="after")
    def _forced_turns_fit(self) -> RLSpec:
        forced = self.sampling.forced_turns
        if forced is not None and forced.shape == "fixed" and forced.tool_calls > self.sampling.max_tool_calls:
            raise ValueError(
                f"rl.sampling.forced_turns.tool_calls {forced.tool_calls} exceeds "
                f"rl.sampling.max_tool_calls {self.sampling.max_tool_calls}"
            )
        return self

    @model_validator(mode="after")
    def _stale_cut_samples_are_corrected(self) -> RLSpec:
        # Under a cut the recorded log-probs are not of the policy trained, so the clip ratio's old policy is
        # the learner's own forward before the update; the gap from the policy that sampled, up to
        # max_staleness versions behind, is then weighed only by an importance correction.
        cuts = sampling_cuts(self.sampling)
        if self.max_staleness > 0 and cuts and self.importance_sampling == "off":
            raise ValueError(
                f"max_staleness {self.max_staleness} with rl.sampling's {' and '.join(cuts)} needs an importance "
                "correction: set rl.importance_sampling to tis or mis (or sample without the cut: top_p 1.0, "
                "top_k -1; or train on-policy: max_staleness 0)"
            )
        return self

    @model_validator(mode="after")
    def _penalty_can_bite(self) -> RLSpec:
        # A plan that breaks a stated preference fails, so its success reward is already 0, and
        # rewards are floored at 0: under success alone the penalty changes no reward at all.
        schedule = self.schedule()
        kinds = {k for _, k in schedule.stages} if schedule else {self.reward}
        if self.preference_penalty and kinds == {"success"}:
            raise ValueError(
                f"preference_penalty {self.preference_penalty:g} has no effect under the success reward "
                "(a plan that breaks a preference already scores 0); use sum, macro or a curriculum"
            )
        return self

    def schedule(self) -> Curriculum | None:
        """The reward curriculum this run follows, or None when `reward` is one kind throughout."""
        return Curriculum.parse(self.curriculum, self.curriculum_unit) if self.reward == "curriculum" else None

    def filters(self) -> FilterConfig:
        """Which samples reach the learner's loss, and with what reward."""
        return FilterConfig(
            max_staleness=self.max_staleness,
            mask_finish_reasons=masked_finishes(self.truncated) + late_masked_finishes(self.late_groups),
            zero_reward_finish_reasons=zero_reward_finishes(self.truncated),
        )

    def learner_fields(self) -> dict[str, Any]:
        """The learner's RLConfig fields this section sets: every shared knob as it is, and those derived
        from it (arpo trains as grpo; the sampling's temperature and cut; the filters; the surplus groups)."""
        return {
            **{name: getattr(self, name) for name in RLKnobs.model_fields},
            "algorithm": "dapo" if self.algorithm == "dapo" else "grpo",
            "temperature": self.sampling.temperature,
            "sampling_cut": bool(sampling_cuts(self.sampling)),
            "filters": self.filters(),
            "oversample_groups": self.oversample_groups,
        }

    @property
    def oversample_groups(self) -> int:
        """Groups published a step beyond batch_prompts."""
        return math.ceil(self.batch_prompts * self.oversample - 1e-9)


# What an episode may spend, set in rl.sampling and followed by eval.sampling where it leaves them out.
EPISODE_BUDGETS = ("max_tokens_per_turn", "max_context_tokens", "max_tool_calls")


class EvalSpec(_Section):
    mode: EvalMode = Field("official", description="Evaluator mode: official (leaderboard parity) or strict.")
    split: str | None = Field(None, description="Query file; default: the synthesized validation set.")
    sampling: SamplingParams = Field(
        default_factory=lambda: SamplingParams(temperature=0.6, top_p=0.95, max_context_tokens=32768),
        description="Decoding of the evaluated model (the paper's: 0.6, 0.95, 32K). The episode budgets a recipe's "
        "eval.sampling leaves out (max_tokens_per_turn, max_context_tokens, max_tool_calls) are rl.sampling's; "
        "left out whole, it is the paper's decoding and context with rl.sampling's turn and tool budgets.",
    )
    limit: int | None = Field(None, ge=1, description="Only the first N queries of the split.")
    concurrency: int = Field(
        MODEL_CONCURRENCY,
        ge=1,
        description=(
            "Episodes in flight at once in an evaluation (the eval stage and rl.val_every's validations); one engine "
            "batches their turns."
        ),
    )

    @model_validator(mode="after")
    def _not_forced(self) -> EvalSpec:
        # forced episodes answer with whatever was sampled: a score of them measures nothing
        if self.sampling.forced_turns is not None:
            raise ValueError(
                "eval.sampling.forced_turns is for benchmarking rollouts (rl.sampling) only: an "
                "evaluation of forced episodes scores text the model was made to produce"
            )
        return self


class LearnerSpec(_Section):
    """How the learner runs its forward/backward passes, for SFT and RL alike (the DeepSpeed ZeRO
    stage is `services.zero_stage`). On a GPU, several rows per pass padded to a multiple of 256
    are what reach the benchmark's MFU (bench/results/learner_gpu.md); the defaults suit a CPU."""

    # The learner's own fields (defaults, bounds, descriptions): one definition, in EngineConfig.
    micro_batch_tokens: int = EngineConfig.model_fields["micro_batch_tokens"]
    micro_batch_rows: int = EngineConfig.model_fields["micro_batch_rows"]
    pad_to_multiple: int = EngineConfig.model_fields["pad_to_multiple"]
    compile_layers: bool = EngineConfig.model_fields["compile_layers"]
    gradient_checkpointing: bool = EngineConfig.model_fields["gradient_checkpointing"]
    recompute_mlp: bool = EngineConfig.model_fields["recompute_mlp"]
    recompute_mlp_layers: int | None = EngineConfig.model_fields["recompute_mlp_layers"]
    activation_memory: Literal["keep", "lean"] = EngineConfig.model_fields["activation_memory"]
    keep_checkpoints: int = EngineConfig.model_fields["keep_checkpoints"]
    offload_optimizer: Literal["none", "cpu"] = EngineConfig.model_fields["offload_optimizer"]
    offload_params: Literal["none", "cpu"] = EngineConfig.model_fields["offload_params"]
    fp32_grad_accum: bool = EngineConfig.model_fields["fp32_grad_accum"]
    grad_reduce_dtype: Literal["fp32", "bf16"] = EngineConfig.model_fields["grad_reduce_dtype"]
    fuse_pointwise: bool | None = EngineConfig.model_fields["fuse_pointwise"]
    overlap_comm: bool | None = EngineConfig.model_fields["overlap_comm"]
    zero3_layer_units: bool = EngineConfig.model_fields["zero3_layer_units"]
    persistent_weights_gib: float = EngineConfig.model_fields["persistent_weights_gib"]
    nccl_protocol: Literal["Simple", "LL128", "LL"] | None = EngineConfig.model_fields["nccl_protocol"]
    packed_attention: Literal["auto", "varlen", "varlen-gqa", "per-sequence", "mask"] = EngineConfig.model_fields[
        "packed_attention"
    ]

    def engine(self, zero_stage: int, seed: int, ranks: int = 1) -> EngineConfig:
        """The learner's EngineConfig for this recipe (`ranks`: deployment.learner_ranks)."""
        return EngineConfig(zero_stage=zero_stage, seed=seed, ranks=ranks, **self.model_dump())


class ServicesSpec(_Section):
    engine: Literal["vllm", "transformers"] = "vllm"
    vllm: VllmArgs = Field(default_factory=VllmArgs, description="How each vLLM engine starts (services.engine vllm).")
    rollout_workers: int = Field(1, ge=1)
    max_inflight_episodes: int | None = Field(
        None,
        ge=1,
        description=(
            "Episodes each rollout worker keeps in flight on its engine, over all its groups (a group's finished "
            "episodes free their slots for other groups). None: derived per worker from its vLLM engine's KV cache "
            "(its memory share less the weights) over episode_tokens (docs/configuration.md); 16 without a GPU."
        ),
    )
    episode_tokens: int | None = Field(
        None,
        ge=64,
        description=(
            "The context an episode is expected to reach, for the derived max_inflight_episodes (None: "
            "rl.sampling.max_context_tokens, the safe bound; a fleet whose episodes end well short of it runs more "
            "at once by saying how long they get)."
        ),
    )
    rollout_concurrency: int | None = Field(
        None,
        ge=1,
        description=(
            "Deprecated (use max_inflight_episodes): groups each rollout worker samples at once; maps to "
            "rollout_concurrency × rl.group_size episodes."
        ),
    )
    reward_workers: int = Field(1, ge=1)
    zero_stage: Literal[0, 1, 2, 3] = 2
    chat: ChatOptions = Field(
        default_factory=ChatOptions,
        description=(
            "How the rollout agent talks to the model: its chat template or ChatML, the tool-call format, "
            "the thinking mode (docs/models.md)."
        ),
    )


class ControllerSpec(_Section):
    """How long the controller waits on the processes it drives before it gives up, naming what it waited on. Not
    part of what a run trains: a run folder resumes under other values."""

    redis_down_limit_s: float = Field(
        300.0,
        gt=0,
        description=(
            "How long the RL stage waits for its Redis to come back (keeping the processes alive meanwhile) "
            "before it fails, naming it."
        ),
    )
    sandbox_down_limit_s: float = Field(
        300.0,
        gt=0,
        description=(
            "How long a service the RL stage cannot train without (the sandbox; an external fleet's learner "
            "service) may stay unready, no step published meanwhile, before the stage fails, naming it."
        ),
    )
    fleet_wait_s: float = Field(
        30.0,
        ge=0,
        description=(
            "How long `star train` waits for an external fleet still starting (its parts, its world, its engines) "
            "before it refuses, naming what does not answer."
        ),
    )


FleetMode = Literal["embedded", "external"]
WeightSync = Literal["auto", "files", "nccl"]


class DeploymentSpec(_Section):
    """Who runs the RL stage's fleet, and where a run's processes go on this machine's GPUs
    (services.pipeline.placement): the learner's ranks, and the rollout engines (one per rollout worker,
    `services.rollout_workers`), each over `engine_tensor_parallel` GPUs. On a machine without GPUs
    everything runs on CPU and `learner_ranks` counts gloo processes."""

    fleet: FleetMode = Field(
        "embedded",
        description=(
            "embedded: `star train` starts the RL stage's own Redis, sandbox, workers and learner; external: it "
            "drives a running fleet (Compose, Helm) found through STAR_REDIS_URL and the STAR_*_URL settings, "
            "starting only the learner run, on the learner service (`star train --fleet` overrides it)."
        ),
    )
    learner_ranks: int | None = Field(
        None,
        ge=1,
        description="Learner processes, under torchrun for more than 1; "
        "on a GPU machine one GPU each (the first ones). None: with `placement.mode` "
        "auto, derived with the engines from the GPUs seen and the model's size "
        "(services.pipeline.placement.derive); otherwise 1.",
    )
    engine_tensor_parallel: int = Field(
        1, ge=1, description="GPUs each rollout engine spans (vLLM tensor parallelism)."
    )
    engine_memory_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of each of its GPUs' memory an engine may take (vLLM "
        "gpu_memory_utilization). None: 0.9 on GPUs of their own; beside the learner or other engines, what "
        "is left divided among the engines of the fullest GPU.",
    )
    learner_memory_share: float = Field(
        0.4, gt=0, lt=1, description="Share of a GPU's memory kept for the learner where engines share its GPU."
    )
    validation_memory_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of its GPUs' memory the engine of a validation during RL "
        "(`rl.val_every`) takes, beside the first rollout engine. None: the engines' share, the validation "
        "counted as one more engine on those GPUs.",
    )
    share_gpus: bool | None = Field(
        None,
        description="Engines beside the learner (and each other) on the same GPUs, "
        "by memory share. None: only when the machine has too few GPUs to give each "
        "process its own.",
    )
    weight_sync: WeightSync = Field(
        "auto",
        description=(
            "How the RL stage's rollout engines get each new policy version. files: the learner writes every version to "
            "the weights store and the engines load it from there. nccl: the learner's rank 0 broadcasts it into every "
            "vLLM engine's GPUs, and the store gets only every rl.val_every-th version (else every 10th), the last, and "
            "any a broadcast missed; it needs vLLM engines on GPUs of their own (NCCL cannot put two ranks on one "
            "GPU): an embedded fleet's placement, or an external fleet whose every rollout server reports weight_ranks "
            "(vLLM started with weight_transfer: nccl), joining at the address its learner announces. auto: nccl "
            "where that holds, else files."
        ),
    )
    nccl_timeout_s: float = Field(
        120.0,
        gt=0,
        description=(
            "With weights over NCCL: how long forming the weight group or one broadcast may take before the learner "
            "counts a member lost and ends for a restart (a broadcast into a dead rank never returns). Raise it "
            "where a version crosses slow links between hosts."
        ),
    )


PlacementMode = Literal["auto", "split", "colocated"]


class PlacementSpec(_Section):
    """Whether the RL stage's engines get GPUs of their own or share the learner's in time
    (services.pipeline.placement): colocated, every GPU holds a learner rank and engines, and the engines
    sleep (vLLM sleep mode) while the learner trains, then wake with the new weights (CUDA IPC)."""

    mode: PlacementMode = Field(
        "split",
        description=(
            "split: engines on GPUs of their own (or beside the learner by memory share, `deployment.share_gpus`); "
            "colocated: a learner rank on every GPU and the engines beside it, asleep while it trains; auto: split "
            "where the learner and the engines fit GPUs of their own, else colocated where that fits, else refused "
            "with the numbers. auto and colocated read the model's size from its config.json."
        ),
    )
    sleep_level: Literal[1, 2] = Field(
        1,
        description=(
            "Colocated engines' vLLM sleep level: 1 offloads weights to host memory and drops the KV cache; 2 "
            "discards both (faster to sleep; the buffers that are not weights, the rotary caches, are restored "
            "after each load and checked)."
        ),
    )
    sleep_timeout_s: float = Field(
        300.0,
        gt=0,
        description=(
            "How long the learner waits for every colocated engine to finish its turns in flight and sleep before "
            "it refuses to train the step (rather than run out of memory)."
        ),
    )
    activation_gib: float | None = Field(
        None,
        gt=0,
        description=(
            "A learner rank's activation memory at `learner.micro_batch_tokens`, GiB. None: estimated from the "
            "model's shape (docs/gpu.md)."
        ),
    )
    gpu_gib: float | None = Field(
        None, gt=0, description=("Memory of each GPU, GiB. None: what the first visible GPU reports.")
    )


class PipelineConfig(_Section):
    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="The run's name: its folder is STAR_HOME/runs/NAME unless --run-dir says otherwise.",
    )
    seed: int = Field(
        0, description="Seed of the run: learner, RL prompt order and sampling, tool faults, a synthetic world."
    )
    stages: list[Stage] = Field(
        default_factory=lambda: list(STAGES),
        description=("Stages to run, in order; a stage left out starts from what earlier runs of the folder made."),
    )
    model: ModelSpec
    world: WorldSpec = Field(default_factory=WorldSpec)
    synth: SynthSpec = Field(default_factory=SynthSpec)
    sft: SFTSpec = Field(default_factory=SFTSpec)
    rl: RLSpec = Field(default_factory=RLSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    services: ServicesSpec = Field(default_factory=ServicesSpec)
    learner: LearnerSpec = Field(default_factory=LearnerSpec)
    deployment: DeploymentSpec = Field(default_factory=DeploymentSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    controller: ControllerSpec = Field(default_factory=ControllerSpec)

    @model_validator(mode="after")
    def _stages_in_order(self) -> PipelineConfig:
        order = [STAGES.index(s) for s in self.stages]
        if order != sorted(set(order)):
            raise ValueError(f"stages must be distinct and in the order {', '.join(STAGES)}; got {self.stages}")
        if self.rl.eps_high < self.rl.eps_low:
            raise ValueError("rl: clip-higher needs eps_high >= eps_low")
        if self._selects_on_its_eval_set():
            raise ValueError(
                "rl.val_every picks the best checkpoint on the synthesized validation queries, and the "
                "eval stage would report its success on those same queries: set synth.heldout_queries "
                "(queries for the eval stage alone) or eval.split"
            )
        return self

    @model_validator(mode="after")
    def _eval_episodes_as_rl_ones(self) -> PipelineConfig:
        # An episode's budgets are set once, in rl.sampling: eval.sampling keeps its own where the recipe (or
        # its default, the paper's 32K context) gives them, and takes rl.sampling's for the rest.
        given = self.eval.sampling.model_fields_set
        shared = {name: getattr(self.rl.sampling, name) for name in EPISODE_BUDGETS if name not in given}
        if shared:
            self.eval.sampling = self.eval.sampling.model_copy(update=shared)
        return self

    @model_validator(mode="after")
    def _one_concurrency(self) -> PipelineConfig:
        s = self.services
        if s.max_inflight_episodes is not None and s.rollout_concurrency is not None:
            raise ValueError(
                "services: set max_inflight_episodes (episodes per worker) or the deprecated "
                "rollout_concurrency (groups per worker), not both"
            )
        return self

    def inflight_episodes(self) -> int | None:
        """Each rollout worker's episode budget as the recipe sets it (the deprecated rollout_concurrency in
        groups of rl.group_size), or None: each worker derives its own from its engine's KV cache."""
        s = self.services
        if s.rollout_concurrency is not None:
            return s.rollout_concurrency * self.rl.group_size
        return s.max_inflight_episodes

    @property
    def validates_during_rl(self) -> bool:
        """RL validates versions as it goes (`rl.val_every`), each with an engine beside the fleet's."""
        return "rl" in self.stages and self.rl.val_every > 0

    def _selects_on_its_eval_set(self) -> bool:
        """RL would choose its checkpoint by validation success, and eval would score that checkpoint on
        the validation file itself: a success figure chosen on its own test set."""
        selects = self.validates_during_rl
        scores_validation = "eval" in self.stages and self.eval.split is None and self.synth.heldout_queries == 0
        return selects and scores_validation


class ConfigError(ValueError):
    """A recipe file that cannot be used, with a message fit for the command line."""


def load_pipeline_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a recipe; `overrides` are `section.key=value` strings (YAML values), applied in order."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no recipe file at {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections")
    for item in overrides or []:
        _apply_override(data, item)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"{path} is not a valid recipe:\n" + "\n".join(lines)) from None


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value")
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: bad value: {exc}") from None


def dump_config(config: PipelineConfig) -> str:
    """The resolved recipe, as written into the run folder."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
