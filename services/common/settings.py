"""Settings read from `STAR_*` environment variables (and an optional `.env`).

One object for every service keeps names consistent across Compose, Helm and the embedded
mode: `STAR_DB_URL` means the same thing to the sandbox and to the reward scorer.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Real TravelPlanner tables live beside the checkout, never inside it.
DEFAULT_TRAVELPLANNER_DIR = PROJECT_ROOT.parent / "shared" / "travelplanner"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STAR_", env_file=".env", extra="ignore")

    home: Path = Field(default=PROJECT_ROOT / "var", description="Where worlds, weights and runs are written.")
    db_url: str | None = Field(
        default=None, description="SQLAlchemy URL of the travel world; default: SQLite under home."
    )
    redis_url: str | None = Field(default=None, description="Redis URL; unset starts an embedded Redis server.")
    redis_password: str | None = Field(
        default=None,
        description="Redis password, when redis_url carries none "
        "(Compose and Helm pass it from a secret); added to redis_url.",
    )
    travelplanner_dir: Path = Field(default=DEFAULT_TRAVELPLANNER_DIR, description="Official TravelPlanner data.")

    api_token: str | None = Field(default=None, description="Bearer token required by mutating endpoints.")
    max_body_bytes: int | None = Field(
        default=None,
        ge=1024,
        description="Largest request body any service "
        "accepts; default: the shared limit of services/common/http.py (16 MiB).",
    )
    log_level: str = "INFO"
    log_json: bool = True

    # sandbox
    tool_dialect: str = Field(default="star", description="Tool output dialect: star | official.")
    fault_rate: float = Field(default=0.0, ge=0.0, le=1.0, description="Per-call tool failure probability.")
    fault_seed: int = 0
    tool_cache_size: int = Field(default=4096, ge=0, description="Rendered tool results kept in memory (0: off).")

    # how the services find each other (embedded mode fills these in; Compose/Helm set them)
    sandbox_url: str | None = Field(default=None, description="Base URL of the sandbox service.")
    formatter_url: str | None = Field(default=None, description="Base URL of the formatter service.")
    reward_url: str | None = Field(default=None, description="Base URL of the reward scoring API.")
    rollout_urls: str | None = Field(default=None, description="Comma-separated base URLs of the rollout servers.")
    learner_url: str | None = Field(default=None, description="Base URL of the learner service.")
    # a multi-node learner (services.learner.launch.Nodes): one learner service per node, node 0 taking runs
    learner_nodes: int = Field(
        default=1,
        ge=1,
        description="Nodes of the learner, one learner service each; more than "
        "1: node 0 starts each run on every node, as one torchrun per node.",
    )
    learner_node_rank: int = Field(default=0, ge=0, description="This learner node's rank (0: it takes the runs).")
    learner_rendezvous: str | None = Field(
        default=None, description="host:port of the learner's c10d rendezvous, on node 0 (multi-node learner)."
    )
    learner_peer_urls: str | None = Field(
        default=None,
        description="Comma-separated base URLs of learner nodes 1.., "
        "in node order, which node 0 asks to join each run (multi-node learner).",
    )
    stream_prefix: str = Field(
        default="star", description="Prefix of the Redis stream names (tasks, trajectories, scored)."
    )
    stream_trim: bool = Field(
        default=True,
        description="Trim each stream to what some consumer group still needs; false keeps every entry "
        "(bench/chaos.py's baseline).",
    )

    # experiment tracking beside TensorBoard (services/common/tracking.py)
    tracking: str = Field(default="off", description="Trackers switched on, comma-separated: wandb, mlflow; off: none.")
    wandb_project: str = Field(default="star", description="W&B project of the runs tracked.")
    mlflow_tracking_uri: str | None = Field(
        default=None, description="MLflow tracking server; default: a SQLite store in the run folder."
    )
    mlflow_experiment: str = Field(default="star", description="MLflow experiment of the runs tracked.")

    # fault injection for the learner's resume tests: the learner process kills itself (SIGKILL) there
    learner_crash_after_step: int | None = Field(
        default=None, description="Tests only: die after training this version, before its checkpoint."
    )
    learner_crash_after_checkpoint: int | None = Field(
        default=None, description="Tests only: die after this version's checkpoint, before acknowledging its batches."
    )

    # models and weights
    model: str | None = Field(default=None, description="Path of the policy model (an HF folder).")
    weights_root: Path | None = Field(
        default=None, description="Where published weight versions live; default home/weights."
    )
    nccl_master_addr: str | None = Field(
        default=None,
        description=(
            "The address the learner announces to an external fleet's rollout servers for the NCCL weight group (its "
            "pod IP, say); default: this host's address on the route to the first rollout server."
        ),
    )
    nccl_port: int = Field(
        default=29731,
        ge=1,
        le=65535,
        description=("The port the learner's rank 0 listens on for the NCCL weight group's rendezvous (TCP)."),
    )

    @model_validator(mode="after")
    def _password_into_redis_url(self) -> Settings:
        if self.redis_url and self.redis_password and urlsplit(self.redis_url).password is None:
            parts = urlsplit(self.redis_url)
            user = parts.username or ""
            netloc = f"{user}:{quote(self.redis_password, safe='')}@{parts.netloc.rsplit('@', 1)[-1]}"
            self.redis_url = urlunsplit(parts._replace(netloc=netloc))
        return self

    @property
    def weights_dir(self) -> Path:
        return self.weights_root or self.home / "weights"

    @property
    def rollout_url_list(self) -> list[str]:
        return [u.strip().rstrip("/") for u in (self.rollout_urls or "").split(",") if u.strip()]

    # OOD QA search service
    qa_index: Path | None = Field(default=None, description="Passage index folder; default: home/qa/index.")
    qa_top_k: int = Field(default=5, ge=1, le=100, description="Passages a Search call returns (the paper: top-5).")

    # formatter (LLM backend: any OpenAI-compatible chat API) and reward scorer
    formatter_llm_url: str | None = Field(
        default=None, description="Base URL of an OpenAI-compatible API, e.g. http://vllm:8000/v1."
    )
    formatter_llm_model: str = Field(default="deepseek-chat", description="Model name sent to the formatter API.")
    formatter_llm_api_key: str | None = Field(default=None, description="Bearer key of the formatter API.")
    formatter_max_attempts: int = Field(default=3, ge=1, le=20, description="LLM calls per answer, repairs included.")
    formatter_timeout_s: float = Field(default=60.0, gt=0, description="Per-request timeout of the formatter API.")
    formatter_deadline_s: float = Field(default=180.0, gt=0, description="Wall-clock bound of one formatting.")
    formatter_concurrency: int = Field(default=8, ge=1, description="Formatter API requests in flight per process.")
    formatter_cache_size: int = Field(default=4096, ge=0, description="Formatted answers kept in memory (0: off).")
    formatter_backend: str = Field(default="auto", description="Default formatter backend: structured | llm | auto.")

    # episode API (services/episodes)
    episodes_url: str | None = Field(default=None, description="Base URL of the episode API.")
    episodes_max_tool_calls: int = Field(
        default=60,
        ge=1,
        le=10_000,
        description="Tool calls an episode may make (the default and the most a start may ask for).",
    )
    episodes_idle_expiry_s: float = Field(
        default=900.0,
        gt=0,
        le=7 * 24 * 3600,
        description="An episode untouched this long expires; a finished one is kept this long for its result.",
    )
    episodes_max_open_per_client: int = Field(default=256, ge=1, description="Open episodes one client may hold.")
    episodes_max_body_bytes: int = Field(
        default=1024 * 1024, ge=1024, description="Largest request body of the episode API (a plan is a few KB)."
    )
    episodes_splits_dir: Path | None = Field(
        default=None,
        description="Folder of extra query files an episode may "
        "name as its split (<name>.json or .jsonl: synthetic queries).",
    )

    @property
    def world_url(self) -> str:
        return self.db_url or f"sqlite:///{self.home / 'world.sqlite'}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
