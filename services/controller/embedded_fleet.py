"""The embedded fleet: the RL stage's own processes under one supervisor, started through the launcher.

Redis (restarted on its port, its AOF brings the streams back), the sandbox, rollout and reward workers
and the learner. A worker that dies is restarted (its unfinished message is reclaimed by the others or
by its successor), so is a dead learner (it resumes from its checkpoint and skips what it had trained),
and the stage stops them all at the end.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rich.markup import escape

from services.common.config_file import given_settings
from services.common.redis import free_port
from services.common.streams import StreamNames, ensure_group
from services.common.supervisor import Child, Supervisor, SupervisorError, stop_orphans
from services.controller import launcher
from services.controller.fleet import LearnerReport
from services.pipeline.config import PipelineConfig
from services.pipeline.placement import Placement
from services.pipeline.stage import Run, StageFailed, console, failure_cause, log_tail
from services.reward.config import RewardConfig, write_reward_config
from services.rollout.config import RolloutConfig, write_rollout_config
from services.sandbox.config import SandboxConfig, write_sandbox_config


@dataclass
class EmbeddedFleet:
    """The RL stage's processes under one supervisor: Redis (restarted on its port, its AOF brings
    the streams back), the sandbox, the workers and the learner. (`sup` None: a learner process
    alone, which nothing restarts.)"""

    sup: Supervisor | None
    redis_url: str
    sandbox_url: str = ""
    workers: list[Child] = field(default_factory=list)
    rollout_urls: list[str] = field(default_factory=list)  # the workers' HTTP faces (weights over NCCL)
    learner: Child | None = None
    status_path: Path | None = None  # the learner's status.json
    awaits_start_weights = False  # its workers start on the run's model: version 0

    @property
    def redis_proc(self) -> Child:
        return self.sup.children["redis"]

    @property
    def redis_log(self) -> Path | None:
        return self.redis_proc.log if self.sup and "redis" in self.sup.children else None

    def dependencies(self) -> dict[str, str]:
        return {"sandbox": self.sandbox_url} if self.sandbox_url else {}

    def weight_servers(self) -> list[str]:
        return list(self.rollout_urls)

    def outputs(self) -> dict[str, Any]:
        return {}

    def start_learner(self, run: Run, config: Path) -> None:
        # the Redis URL (it holds the password) travels in the environment, not in rl.json
        argv, learner_env = run.learner_launch("rl", config)
        self.status_path = run.folder / "rl" / "status.json"
        self.learner = self.sup.add(
            "learner",
            argv,
            {**run.env, **learner_env, "STAR_REDIS_URL": self.redis_url},
            run.log("learner"),
            stop_timeout=120,
        )

    def keep_alive(self) -> list[str]:
        """Restart what died (Redis, the sandbox, workers; not the learner, whose end `drive` reads
        first), each after its backoff; returns what was restarted. A process past its restart budget
        fails the stage."""
        if self.sup is None:
            return []
        try:
            return self.sup.poll([n for n in self.sup.children if n != "learner"])
        except SupervisorError as exc:
            raise StageFailed(str(exc)) from None

    def learner_report(self) -> LearnerReport:
        rc = self.learner.exited()
        status = _read_json(self.status_path)
        return LearnerReport(status.get("state", "starting"), running=rc is None, exit_code=rc)

    def learner_ended(self, report: LearnerReport) -> None:
        """Start the learner again once its backoff has passed (it resumes from its checkpoint and
        skips what it had trained); past its restart budget the stage fails."""
        if self.sup is None:
            raise StageFailed(f"the learner exited ({report.exit_code}) and nothing supervises it")
        try:
            if not self.sup.restart_due(self.learner):
                return
        except SupervisorError as exc:
            log = self.learner.log
            tail = log_tail(log, 8) if log else []
            raise StageFailed(
                f"the learner keeps failing: {exc}" + (f"; see {log}\n  " + "\n  ".join(tail) if tail else "")
            ) from None
        cause = failure_cause(self.learner.log) if self.learner.log else None
        console.print(
            f"[yellow]learner exited ({report.exit_code}, {report.state}); resuming from its checkpoint[/]"
            + (f"\n  [dim]{escape(cause)} (see {self.learner.log})[/]" if cause else "")
        )
        self.sup.restart(self.learner)

    def stop_learner(self) -> None:
        self.sup.stop("learner")

    def stop(self, exit_wait_s: float = 60.0) -> None:
        """Stop the fleet, the learner first. A learner that reports its run over is given
        `exit_wait_s` to exit on its own: its ranks tear down their process groups after the
        status is written, and a stop signal then (Python's handlers are gone while it exits) would
        kill them mid-teardown and make torchrun report a clean end as failed ranks."""
        order = (["learner"] if self.learner else []) + [w.name for w in self.workers] + ["sandbox", "redis"]
        if self.learner:
            self.learner.stop_timeout = 120
            if self.learner.running() and self.learner_report().state in ("finished", "stopped"):
                try:
                    self.learner.proc.wait(exit_wait_s)
                except subprocess.TimeoutExpired:
                    pass
        self.sup.stop_all(order)


def fleet_record(run: Run) -> Path:
    return run.folder / "fleet.json"


def start_fleet(run: Run, model: str, names: StreamNames) -> EmbeddedFleet:
    """Redis, the sandbox, rollout and reward workers (the learner is started by the caller), all
    in one supervisor whose record lets a later run stop what a killed controller left behind. The
    sandbox reads its settings from sandbox.json in the run folder (`--config`), as the workers read theirs."""
    logs = run.folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stop_orphans(fleet_record(run))
    f = EmbeddedFleet(Supervisor(fleet_record(run)), "")
    try:
        f.redis_url = launcher.start_redis(f.sup, run.folder / "redis", logs)
        client = redis.Redis.from_url(f.redis_url)
        for stream in (names.tasks, names.trajectories, names.scored):  # before any entry exists
            ensure_group(client, stream, StreamNames.consumer_group(stream))
        env = {
            **run.env,
            "STAR_REDIS_URL": f.redis_url,
            "STAR_STREAM_PREFIX": names.prefix,
            "STAR_WEIGHTS_ROOT": str(run.folder / "weights"),
        }
        sandbox = write_sandbox_config(run.folder / "sandbox.json", sandbox_config(run.config))
        _, port = launcher.start_service(
            f.sup, launcher.spec("sandbox"), env, logs, args=("--config", str(sandbox)), stop_timeout=10
        )
        f.sandbox_url = launcher.local_http(port)
        _start_workers(run, f, model, env, logs)
    except BaseException:
        f.stop()
        raise
    return f


def _start_workers(run: Run, f: EmbeddedFleet, model: str, env: dict[str, str], logs: Path) -> None:
    """Rollout and reward workers. Each reads its settings from a file of its own in the run folder
    (rollout/worker-<i>.json, reward/worker-<i>.json, `--config`); its environment carries only addresses and
    devices. With weights over
    NCCL each rollout worker also serves the rollout API on a port of its own (`f.rollout_urls`), where the
    learner forms its group and broadcasts, and its vLLM engine starts ready to receive (`weight_transfer: nccl`).
    Colocated (`placement.mode`), one worker per GPU group serves it too, its engine able to sleep while the
    learner trains."""
    env = {**env, "STAR_SANDBOX_URL": f.sandbox_url}
    # colocated, the IPC load runs through vLLM's collective_rpc
    engine_env = {**env, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if run.colocated else env
    for i in range(engine_workers(run.config, run.placement, colocated=run.colocated)):
        fields: dict[str, Any] = {"consumer": f"rollout-{i}"}
        if run.serves_http:  # the same port across the worker's restarts: the learner knows it by its address
            url = next(u for u in iter(lambda: f"http://127.0.0.1:{free_port()}", None) if u not in f.rollout_urls)
            fields["http_port"] = int(url.rsplit(":", 1)[1])
            f.rollout_urls.append(url)
        cfg = rollout_worker_config(
            run.config, run.placement, model, i, nccl=run.nccl, colocated=run.colocated, **fields
        )
        path = write_rollout_config(run.folder / "rollout" / f"worker-{i}.json", cfg)
        devices = run.placement.engine_devices_env(i) if run.placement else {}
        f.workers.append(
            launcher.start_service(
                f.sup,
                launcher.ROLLOUT_WORKER,
                {**engine_env, **devices},
                logs,
                name=f"rollout-{i}",
                args=("--config", str(path)),
            )[0]
        )
    for i in range(run.config.services.reward_workers):
        # the world's address travels in the environment (STAR_DB_URL, the run's), as for every process
        path = write_reward_config(run.folder / "reward" / f"worker-{i}.json", reward_worker_config(i))
        reward = launcher.start_service(
            f.sup, launcher.spec("reward-worker"), env, logs, name=f"reward-{i}", args=("--config", str(path))
        )
        f.workers.append(reward[0])


def sandbox_config(config: PipelineConfig) -> SandboxConfig:
    """The embedded sandbox's settings for the recipe: its fault injection (rl.fault_rate, drawn from the run's
    seed). Only these go into its file; the rest keeps the sandbox's defaults and STAR_* variables."""
    return given_settings(SandboxConfig, {"fault_rate": config.rl.fault_rate, "fault_seed": config.seed})


def reward_worker_config(index: int) -> RewardConfig:
    """Reward worker `index`'s settings: its consumer name (the same across its restarts). How each trajectory is
    scored (mode, reward, epoch, penalty) travels in the trajectory itself."""
    return given_settings(RewardConfig, {"consumer": f"reward-{index}"})


def engine_per_gpu_group(placement: Placement | None, colocated: bool) -> bool:
    """One engine per GPU group, holding the recipe's episode budget pooled: colocated, or where placement derived
    the engines from the machine."""
    return colocated or (placement is not None and placement.derived)


def engine_workers(config: PipelineConfig, placement: Placement | None, *, colocated: bool = False) -> int:
    """Rollout workers the fleet starts: the recipe's, or one per GPU group (`engine_per_gpu_group`)."""
    if placement is not None and engine_per_gpu_group(placement, colocated):
        return len(placement.engine_devices)
    return config.services.rollout_workers


def rollout_worker_config(
    config: PipelineConfig,
    placement: Placement | None,
    model: str,
    index: int,
    *,
    nccl: bool = False,
    colocated: bool = False,
    **fields: Any,
) -> RolloutConfig:
    """Rollout worker `index`'s settings for the recipe: its engine and its arguments, the chat options, the
    context, its episode budget and its engine's share of its GPUs; `fields` adds the worker's own (its consumer
    name, its HTTP port). `nccl`: its engine receives weights over NCCL; `colocated`: it sleeps while the learner
    trains. Only what is set here goes into its file; the rest keeps the worker's defaults."""
    s = config.services
    vllm = s.vllm.model_copy(update={"weight_transfer": "nccl"}) if nccl else s.vllm
    if colocated:
        vllm = vllm.model_copy(update={"enable_sleep_mode": True})
    settings = {
        "model": model,
        "engine": s.engine,
        "vllm": vllm,
        "chat": s.chat,
        "max_model_len": config.rl.sampling.engine_max_len,
        "claim_idle_ms": 30000,
        **inflight_fields(config),
    }
    if placement is not None and engine_per_gpu_group(placement, colocated):
        from services.pipeline.placement import colocated_concurrency

        budget = config.inflight_episodes()
        if budget is not None:  # else each engine derives its budget from its own (shared) KV cache
            pooled = colocated_concurrency(s.rollout_workers, budget, len(placement.engine_devices))
            settings.update(max_inflight_episodes=pooled, max_batch=pooled)
    if placement is not None:
        settings.update(placement.engine_settings(index))
    return given_settings(RolloutConfig, {**settings, **fields})  # validated, and no environment read here


def inflight_fields(config: PipelineConfig) -> dict[str, int]:
    """A rollout worker's episode budget: the recipe's, else derived by the worker from its engine's KV cache
    over the episodes' context. The transformers engine decodes every episode in flight in one batch."""
    s, budget = config.services, config.inflight_episodes()
    fields = {"episode_tokens": s.episode_tokens or config.rl.sampling.max_context_tokens}
    if budget is not None:
        fields["max_inflight_episodes"] = budget
    fields["max_batch"] = budget or 2 * config.rl.group_size
    return fields


def _read_json(path: Path | None) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}
