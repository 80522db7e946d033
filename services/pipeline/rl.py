"""The RL stage: the real services as separate processes, joined by Redis Streams.

    controller ──tasks──▶ rollout workers ──trajectories──▶ reward workers ──scored──▶ learner
        ▲                     │ (sandbox over HTTP)                                    │
        └─────────── weights version (Redis key), batches consumed ◀───────────────────┘

The controller publishes each step's tasks when the learner is close enough (`max_staleness`),
watches the fleet, and ends the stage when every step has been trained. Who runs the fleet is the
recipe's `deployment.fleet`: embedded, the stage starts it (`Fleet`: Redis, sandbox, workers, the
learner under one supervisor), restarts a worker that died (its unfinished message is reclaimed by
the others or by its successor) or a dead learner (it resumes from its checkpoint and skips what it
had trained), and stops it at the end; external, it drives a running fleet (`external.ExternalFleet`)
and owns only the learner run it starts there. Both go through one loop, `drive`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from services.common.redis import free_port, local_url, redact, redis_argv, redis_password, wait_for_redis
from services.common.schemas import SamplingParams
from services.common.settings import get_settings
from services.common.streams import StreamNames, ensure_group, trim_consumed
from services.common.supervisor import Child, Supervisor, SupervisorError, spawn, stop_orphans, stop_process, wait_ready
from services.pipeline import fleet, stage
from services.pipeline.config import PipelineConfig, sampling_cuts
from services.pipeline.external import ExternalFleet, FleetAddress, LearnerReport, connect, ready
from services.pipeline.scheduler import Schedule, TaskPublisher
from services.pipeline.stage import Run, StageFailed, check_exit, console, failure_cause, log_tail
from services.reward.rewards import Curriculum
from services.synth.queries import load_queries

REDIS_DOWN_LIMIT_S = float(os.environ.get("STAR_REDIS_DOWN_LIMIT_S", "300"))  # then the stage fails
SANDBOX_DOWN_LIMIT_S = float(os.environ.get("STAR_SANDBOX_DOWN_LIMIT_S", "300"))
HEALTH_EVERY_S = 2.0


class Managed(Child):
    """A process of the stage outside the fleet's supervisor (a validation's `star eval`), started
    and stopped the same way: output to its log, dies with the controller."""

    def start(self) -> Managed:
        self.proc = spawn(self.argv, env={**os.environ, **self.env}, log_path=self.log)
        self.started_at = time.monotonic()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        stop_process(self.proc, timeout)


@dataclass
class Fleet:
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

    @property
    def redis_proc(self) -> Child:
        return self.sup.children["redis"]

    @property
    def redis_log(self) -> Path | None:
        return self.redis_proc.log if self.sup and "redis" in self.sup.children else None

    def dependencies(self) -> dict[str, str]:
        return {"sandbox": self.sandbox_url} if self.sandbox_url else {}

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


def rl_config(
    run: Run, model: str, names: StreamNames, redis_url: str | None, total_steps: int, servers: list[str] | None = None
) -> Path:
    """The learner's RLConfig for this run, written to rl.json. An embedded fleet keeps its weights in
    the run folder; an external one in its own store (the learner service's STAR_WEIGHTS_ROOT, which
    its rollout workers read), and its rollout servers (STAR_ROLLOUT_URLS) are told of each version.
    With weights over NCCL (`run.weight_sync`), `servers` are the embedded workers' HTTP faces; an
    external fleet's servers join at the address its learner announces (`nccl_master` auto)."""
    from services.learner.config import RLConfig

    r = run.config.rl
    external = run.config.deployment.fleet == "external"
    sync = nccl_sync(run, servers or []) if run.nccl and not external else {}
    if run.nccl and external:  # rank 0 announces its address to the fleet's servers (services.learner.nccl_master)
        sync = {
            "weight_sync": "nccl",
            "nccl_master": "auto",
            "files_every": r.val_every or 10,
            "nccl_timeout_s": run.config.deployment.nccl_timeout_s,
        }
    if run.colocated:
        sync = colocated_sync(run, servers or [])
    cfg = RLConfig(
        model=model,
        output_dir=str(run.folder / "rl"),
        algorithm="dapo" if r.algorithm == "dapo" else "grpo",
        group_size=r.group_size,
        batch_prompts=r.batch_prompts,
        lr=r.lr,
        total_steps=total_steps,
        mini_batches=r.mini_batches,
        kl_coef=r.kl_coef,
        negative_scale=r.negative_scale,
        samples_per_step=r.samples_per_step,
        save_every=r.save_every,
        loss_agg=r.loss_agg,
        dual_clip_c=r.dual_clip_c,
        log_ratio_clamp=r.log_ratio_clamp,
        importance_sampling=r.importance_sampling,
        is_low=r.is_low,
        is_high=r.is_high,
        temperature=r.sampling.temperature,
        sampling_cut=bool(sampling_cuts(r.sampling)),
        eps_low=r.eps_low,
        eps_high=r.eps_high,
        filters=r.filters(),
        oversample_groups=r.oversample_groups,
        late_groups=r.late_groups,
        engine=run.config.learner.engine(run.config.services.zero_stage, run.config.seed, ranks=run.learner_ranks),
        redis_url=redis_url,
        stream_prefix=names.prefix,
        weights_dir=None if external else str(run.folder / "weights"),
        rollout_servers=get_settings().rollout_url_list if external else [],
        wait_timeout_s=24 * 3600,
    )
    cfg = cfg.model_copy(update=sync)
    path = run.folder / "rl.json"
    path.write_text(cfg.model_dump_json(indent=2))
    return path


def nccl_sync(run: Run, servers: list[str]) -> dict[str, Any]:
    """The learner's settings for weights over NCCL into the embedded workers at `servers`: its rank 0
    listens for the group on a free local port, and the store gets every validated version (a
    validation evaluates it from files) or else every 10th, besides the last and any a server missed."""
    if not servers:
        raise StageFailed("weights over NCCL need the rollout workers' HTTP addresses; none were started")
    files_every = run.config.rl.val_every or 10
    return {
        "weight_sync": "nccl",
        "rollout_servers": list(servers),
        "nccl_master": f"127.0.0.1:{free_port()}",
        "files_every": files_every,
        "nccl_timeout_s": run.config.deployment.nccl_timeout_s,
    }


def colocated_sync(run: Run, servers: list[str]) -> dict[str, Any]:
    """The learner's settings for engines colocated on its GPUs (`placement.mode` colocated): the
    servers it puts to sleep before each step and wakes with the new weights by CUDA IPC."""
    if not servers:
        raise StageFailed("colocation needs the rollout workers' HTTP addresses; none were started")
    p = run.config.placement
    return {
        "weight_sync": "ipc",
        "rollout_servers": list(servers),
        "files_every": run.config.rl.val_every or 10,
        "sleep_level": p.sleep_level,
        "sleep_timeout_s": p.sleep_timeout_s,
    }


def fleet_record(run: Run) -> Path:
    return run.folder / "fleet.json"


def start_fleet(run: Run, model: str, names: StreamNames) -> Fleet:
    """Redis, the sandbox, rollout and reward workers (the learner is started by the caller), all
    in one supervisor whose record lets a later run stop what a killed controller left behind."""
    logs = run.folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stop_orphans(fleet_record(run))
    sup = Supervisor(fleet_record(run))
    data = run.folder / "redis"
    data.mkdir(parents=True, exist_ok=True)
    password = redis_password(data)
    port = free_port()
    redis_url = local_url(port, password)
    sup.info = {"redis_port": port}
    redis_child = sup.add(
        "redis", redis_argv(data, port, password, appendonly=True), log=logs / "redis.log", stop_timeout=10
    )
    f = Fleet(sup, redis_url)
    try:
        wait_for_redis(redis_url, redis_child.proc, 10, f"; see {redis_child.log}")
        client = redis.Redis.from_url(redis_url)
        for stream in (names.tasks, names.trajectories, names.scored):  # before any entry exists
            ensure_group(client, stream, StreamNames.consumer_group(stream))
        env = {
            **run.env,
            "STAR_REDIS_URL": redis_url,
            "STAR_STREAM_PREFIX": names.prefix,
            "STAR_WEIGHTS_ROOT": str(run.folder / "weights"),
        }
        sandbox_spec = next(s for s in fleet.SERVICES if s.name == "sandbox")
        fault = {"STAR_FAULT_RATE": str(run.config.rl.fault_rate), "STAR_FAULT_SEED": str(run.config.seed)}
        port = free_port()
        sandbox = sup.add(
            "sandbox", fleet.service_argv(sandbox_spec, port), {**env, **fault}, logs / "sandbox.log", stop_timeout=10
        )
        f.sandbox_url = f"http://127.0.0.1:{port}"
        wait_ready("sandbox", sandbox.proc, f.sandbox_url, sandbox.log, 120)
        _start_workers(run, f, model, env, logs)
    except BaseException:
        f.stop()
        raise
    return f


def _start_workers(run: Run, f: Fleet, model: str, env: dict[str, str], logs: Path) -> None:
    """Rollout and reward workers. With weights over NCCL each rollout worker also serves the rollout
    API on a port of its own (`f.rollout_urls`), where the learner forms its group and broadcasts, and
    its vLLM engine starts ready to receive (`weight_transfer: nccl`). Colocated (`placement.mode`), one
    worker per GPU group serves it too, its engine able to sleep while the learner trains."""
    env = {**env, "STAR_SANDBOX_URL": f.sandbox_url}
    s = run.config.services
    sampling = run.config.rl.sampling
    vllm = s.vllm.model_copy(update={"weight_transfer": "nccl"}) if run.nccl else s.vllm
    workers, inflight = s.rollout_workers, inflight_env(run.config)
    if run.colocated:
        vllm = vllm.model_copy(update={"enable_sleep_mode": True})
    if run.colocated or (run.placement and run.placement.derived):
        # one engine per GPU group (able to sleep where colocated), holding the recipe's episode budget pooled
        from services.pipeline.placement import colocated_concurrency

        workers = len(run.placement.engine_devices)
        budget = run.config.inflight_episodes()
        if budget is not None:  # else each engine derives its budget from its own (shared) KV cache
            pooled = str(colocated_concurrency(s.rollout_workers, budget, workers))
            inflight.update(STAR_ROLLOUT_MAX_INFLIGHT_EPISODES=pooled, STAR_ROLLOUT_MAX_BATCH=pooled)
    rollout_env = {
        **env,
        "STAR_MODEL": model,
        "STAR_ROLLOUT_ENGINE": s.engine,
        "STAR_ROLLOUT_VLLM": vllm.model_dump_json(),
        "STAR_ROLLOUT_CHAT": s.chat.model_dump_json(),
        "STAR_ROLLOUT_MAX_MODEL_LEN": str(sampling.engine_max_len),
        "STAR_ROLLOUT_CLAIM_IDLE_MS": "30000",
        **inflight,
    }
    if run.colocated:
        rollout_env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the IPC load runs through collective_rpc
    for i in range(workers):
        devices = run.placement.engine_env(i) if run.placement else {}
        http = {}
        if run.serves_http:  # the same port across the worker's restarts: the learner knows it by its address
            url = next(u for u in iter(lambda: f"http://127.0.0.1:{free_port()}", None) if u not in f.rollout_urls)
            http = {"STAR_ROLLOUT_HTTP_PORT": url.rsplit(":", 1)[1]}
            f.rollout_urls.append(url)
        f.workers.append(
            f.sup.add(
                f"rollout-{i}",
                [sys.executable, "-m", "services.rollout.worker"],
                {**rollout_env, **devices, **http, "STAR_ROLLOUT_CONSUMER": f"rollout-{i}"},
                logs / f"rollout-{i}.log",
            )
        )
    for i in range(s.reward_workers):
        f.workers.append(
            f.sup.add(
                f"reward-{i}",
                [
                    sys.executable,
                    "-m",
                    "services.cli",
                    "reward",
                    "worker",
                    "--consumer",
                    f"reward-{i}",
                    "--db",
                    run.world_url,
                ],
                env,
                logs / f"reward-{i}.log",
            )
        )


def inflight_env(config: PipelineConfig) -> dict[str, str]:
    """A rollout worker's episode budget: the recipe's, else derived by the worker from its engine's KV cache
    over the episodes' context. The transformers engine decodes every episode in flight in one batch."""
    s, budget = config.services, config.inflight_episodes()
    env = {"STAR_ROLLOUT_EPISODE_TOKENS": str(s.episode_tokens or config.rl.sampling.max_context_tokens)}
    if budget is not None:
        env["STAR_ROLLOUT_MAX_INFLIGHT_EPISODES"] = str(budget)
    env["STAR_ROLLOUT_MAX_BATCH"] = str(budget or 2 * config.rl.group_size)
    return env


def weights_version(client: redis.Redis, names: StreamNames) -> int:
    """The newest policy version published: the newest with files (`weights:latest`) or, over NCCL, a
    newer one the learner broadcast without writing files (`weights:version`). Tasks ask for it."""
    raw, broadcast = client.mget(names.weights_latest, names.weights_version)
    return max(int(json.loads(raw)["version"]) if raw else 0, int(broadcast) if broadcast else 0)


def learner_progress(client: redis.Redis, names: StreamNames) -> int:
    """Batches consumed; falls back to the weights version for a learner that does not count."""
    raw = client.get(names.learner_batches)
    return max(int(raw) if raw else 0, weights_version(client, names))


def off_policy_note(sampling: SamplingParams) -> str | None:
    """What rollout sampling the learner cannot follow means for training, or None when it can. The
    learner's log-probs are of softmax(logits / T) at the rollouts' temperature (rl.sampling passes
    it), but of the whole vocabulary: a top-p or top-k cut draws from another distribution, so its
    samples are off-policy for the policy trained."""
    cuts = sampling_cuts(sampling)
    if not cuts:
        return None
    return (
        f"rl.sampling samples with {' and '.join(cuts)}: the learner trains the whole distribution, so these "
        "samples are off-policy for it (top_p 1.0 and no top_k keep them on-policy)"
    )


def forced_turns_note(sampling: SamplingParams) -> str | None:
    """A warning that the episodes are forced to a fixed shape (a benchmarking option), or None."""
    f = sampling.forced_turns
    if f is None:
        return None
    if f.shape == "teacher":
        return (
            "rl.sampling.forced_turns (benchmarking): each episode's tool calls, turn and answer lengths are drawn "
            "from the teacher's trajectories, whatever the model samples: the run measures time, not learning"
        )
    return (
        f"rl.sampling.forced_turns (benchmarking): every episode is {f.tool_calls} tool turns of {f.turn_tokens} "
        f"tokens and an answer of {f.answer_tokens}, whatever the model samples: the run measures time, not learning"
    )


def unreached_stages_note(curriculum: Curriculum | None, epochs: int, steps: int) -> str | None:
    """Which curriculum stages start after the run's last epoch (or step, when the curriculum counts
    steps), or None when it reaches them all. A curriculum by epoch trains a run of an epoch or two on
    its first stages only."""
    if curriculum is None:
        return None
    if curriculum.unit == "epoch":
        last, length, hint = epochs, f"rl.epochs {epochs}", "rl.curriculum_unit step counts RL steps instead"
    else:
        last, length, hint = steps, f"the run's {steps} steps", "more rl.max_steps or rl.epochs reach them"
    late = [f"{kind}@{start}" for start, kind in curriculum.stages if start > last]
    if not late:
        return None
    reached = [kind for start, kind in curriculum.stages if start <= last]
    return (
        f"rl.curriculum stages {', '.join(late)} start after {length}: this run's reward is "
        f"{' then '.join(reached)} ({hint})"
    )


def external_fleet_note(config: PipelineConfig) -> str | None:
    """What of the recipe an external fleet does not take from it, or None: its sandbox injects the
    faults its own settings say."""
    if config.deployment.fleet != "external" or not config.rl.fault_rate:
        return None
    return (
        f"rl.fault_rate {config.rl.fault_rate:g} is not applied to an external fleet: its sandbox's "
        "STAR_FAULT_RATE decides"
    )


def fleet_streams(run: Run) -> StreamNames:
    """The streams of the run's fleet: an embedded fleet's are the run's own; an external fleet's are
    the ones its workers read (STAR_STREAM_PREFIX)."""
    if run.config.deployment.fleet == "external":
        return StreamNames(get_settings().stream_prefix)
    return StreamNames(f"star:{run.config.name}")


def learner_record(run: Run) -> Path:
    """The learner run an external fleet's learner service runs for this folder."""
    return run.folder / "learner-run.json"


def open_fleet(run: Run, model: str, names: StreamNames) -> Fleet | ExternalFleet:
    """The RL stage's fleet: started here (embedded) or found running (external)."""
    if run.config.deployment.fleet == "external":
        return connect(FleetAddress.from_settings(get_settings()), names, learner_record(run))
    return start_fleet(run, model, names)


def stage_rl(run: Run, model: str, synth: dict[str, Any]) -> dict[str, Any]:
    r = run.config.rl
    curriculum = r.schedule()
    prompts_file = synth.get("rl_queries")
    if not prompts_file or not Path(prompts_file).is_file():
        raise StageFailed("rl needs the RL prompt set of the synth stage (data/rl.jsonl)")
    prompts = tuple(load_queries(prompts_file))
    schedule = Schedule(prompts, r.batch_prompts, r.group_size, r.epochs, seed=run.config.seed, max_steps=r.max_steps)
    if curriculum is not None:
        console.print(f"reward: curriculum {curriculum.describe()} (by {curriculum.unit})")
    if run.weight_sync is not None:
        console.print(run.weight_sync.describe())
    for note in (
        forced_turns_note(r.sampling),
        off_policy_note(r.sampling),
        unreached_stages_note(curriculum, r.epochs, schedule.total_steps),
        external_fleet_note(run.config),
    ):
        if note:
            console.print(f"[yellow]{note}[/]")
    deadline = time.monotonic() + r.max_minutes * 60 if r.max_minutes else None  # the fleet's start counts
    names = fleet_streams(run)
    sampling = r.sampling if r.sampling.seed is not None else r.sampling.model_copy(update={"seed": run.config.seed})
    later = bool(run.placement and run.placement.validations_after)
    validation = (
        Validation(run, synth["val_queries"], r.val_every, after_fleet=later, keep=r.keep_validated)
        if r.val_every and synth.get("val_queries")
        else None
    )
    try:
        f = open_fleet(run, model, names)
        try:
            if validation and not validation.seen(0):
                validation.submit(0, model, keep=False)  # the starting model: the curve's baseline, same queries
            servers = f.rollout_urls if isinstance(f, Fleet) else []
            f.start_learner(run, rl_config(run, model, names, None, schedule.total_steps, servers))
            client = redis.Redis.from_url(f.redis_url)
            publisher = TaskPublisher(
                client,
                names,
                run.config.name,
                schedule,
                sampling,
                reward_kind=r.reward,
                preference_penalty=r.preference_penalty,
                curriculum=curriculum,
                eval_mode=r.eval_mode,
                max_staleness=r.max_staleness,
                arpo=r.arpo if r.algorithm == "arpo" else None,
                oversample_groups=r.oversample_groups,
                await_start_weights=isinstance(f, ExternalFleet),
            )
            ended = drive(run, f, client, names, publisher, schedule, validation=validation, deadline=deadline)
            if ended.reason == "budget":
                # the learner may publish once more while it stops: read the weights after it has
                f.stop_learner()
                ended = Ending("budget", learner_progress(client, names))
            latest = client.get(names.weights_latest)
        finally:
            f.stop()
        update = json.loads(latest) if latest else None
        if validation:  # after the fleet, whose engines have given the GPU back
            if update and not validation.seen(update["version"]):
                validation.submit(update["version"], update["uri"])  # the final policy is a candidate too
            print_validations(validation.wait())
    except BaseException:  # a failing or interrupted stage leaves no validation running
        if validation:
            validation.stop()
        raise
    best = validation.best() if validation else None
    ending = {"ended": ended.reason, "steps_trained": ended.steps}
    if isinstance(f, ExternalFleet):
        ending["learner_run"] = f.run_id
    if best:
        return {
            "model": best["model"],
            "version": best["version"],
            "best_success": best["success"],
            "last_version": update["version"] if update else 0,
            "steps": schedule.total_steps,
            **ending,
            "metrics": str(run.folder / "rl" / "metrics.jsonl"),
            "validation": str(run.folder / "validation"),
        }
    return {
        "model": update["uri"] if update else model,
        "version": update["version"] if update else 0,
        "steps": schedule.total_steps,
        **ending,
        "metrics": str(run.folder / "rl" / "metrics.jsonl"),
        "learner_restarts": f.learner.restarts if f.learner else 0,
        "worker_restarts": {w.name: w.restarts for w in f.workers if w.restarts},
    }


@dataclass
class Validation:
    """Every `every` versions: evaluate that version on the validation queries, keep the best. The
    starting model is validated too (version 0), as the baseline of the curve.

    A due version is hard-linked into the run folder at once, so the learner pruning old versions
    cannot pull it away, and the best one survives the run. Its `star eval` runs beside the fleet as
    a managed process on the devices the placement gives validations, one at a time (later due
    versions wait their turn), so that the controller keeps publishing and the fleet never idles
    while a version is evaluated. With `after_fleet` (a colocated placement with no room for a
    validation's engine beside the fleet), the due versions queue until `wait()`, which the stage calls
    once the fleet has given its GPUs back. With `keep="best"`, a validated version's copy is removed
    once another version is better, so the run folder holds the best weights and the queue's, not
    every validated version's; its entry stays in the history, marked pruned."""

    run: Run
    split: str
    every: int
    after_fleet: bool = False
    keep: str = "best"  # "best" | "all": rl.keep_validated
    history: list[dict[str, Any]] = field(default_factory=list)
    waiting: list[tuple[int, str]] = field(default_factory=list)  # (version, model folder)
    running: tuple[int, str, Managed] | None = None

    def __post_init__(self) -> None:
        # A restarted controller keeps what the one before it validated, so the best-checkpoint
        # pick covers the whole run, not just the versions since the restart.
        if self.run is None:  # no run folder: nothing was kept
            return
        path = self.history_path
        if path.is_file():
            try:
                kept = json.loads(path.read_text())
            except ValueError:
                kept = []
            self.history = [
                h
                for h in kept
                if isinstance(h, dict)
                and "version" in h
                and "success" in h
                and (h.get("pruned") or Path(h.get("model", "")).exists())
            ]

    @property
    def history_path(self) -> Path:
        return self.run.folder / "validation" / "history.json"

    def seen(self, version: int) -> bool:
        """Validated, under way or queued."""
        return (
            any(h["version"] == version for h in self.history)
            or any(v == version for v, _ in self.waiting)
            or (self.running is not None and self.running[0] == version)
        )

    def due(self, version: int) -> bool:
        return self.every > 0 and version > 0 and version % self.every == 0 and not self.seen(version)

    def folder(self, version: int) -> Path:
        return self.run.folder / "validation" / f"v{version}"

    def submit(self, version: int, uri: str, keep: bool = True) -> None:
        """Queue version's evaluation (started at once if none is running). With `keep`, its weights
        are hard-linked (copied across filesystems) into the run folder first; without, they are
        evaluated where they are (the starting model, which nothing prunes)."""
        import shutil

        model = self.folder(version) / "model"
        if keep and not model.exists():
            shutil.copytree(uri, model, copy_function=_link_or_copy)
        self.waiting.append((version, str(model) if keep else uri))
        self._start_next()

    def poll(self) -> list[dict[str, Any]]:
        """The validations that finished since the last call (a failed one raises StageFailed)."""
        done: list[dict[str, Any]] = []
        if self.running is not None and self.running[2].exited() is not None:
            done.append(self._finish())
            self._start_next()
        return done

    def wait(self) -> list[dict[str, Any]]:
        """Every queued validation, run to its end (the fleet has ended: the queue may start)."""
        self.after_fleet = False
        self._start_next()
        done: list[dict[str, Any]] = []
        while self.running is not None:
            self.running[2].proc.wait()
            done += self.poll()
        return done

    def stop(self) -> None:
        """Abandon the validation under way and the queued ones (the stage is failing or interrupted)."""
        if self.running is not None:
            self.running[2].stop()
            self.running = None
        self.waiting.clear()

    def best(self) -> dict[str, Any] | None:
        """The best RL version (v0, the starting model, is the baseline, not a candidate); ties go to the
        later version: it has trained on more data."""
        trained = [h for h in self.history if h["version"] > 0 and not h.get("pruned")]
        return max(trained, key=lambda h: (h["success"], h["version"])) if trained else None

    def _name(self, version: int) -> str:
        return f"validate-v{version}"

    def _start_next(self) -> None:
        if self.running is not None or not self.waiting or self.after_fleet:
            return
        version, model = self.waiting.pop(0)
        share = self.run.placement.validation_memory_share if self.run.placement else None
        argv = stage.eval_argv(
            self.run, model, self.split, self.folder(version) / "eval", self.run.config.eval.limit, memory_share=share
        )
        name = self._name(version)
        devices = self.run.placement.validation_env() if self.run.placement else {}
        self.running = (version, model, Managed(name, argv, {**self.run.env, **devices}, self.run.log(name)).start())

    def _finish(self) -> dict[str, Any]:
        from services.evaluation.runfolder import RunFolder

        version, model, process = self.running  # type: ignore[misc]
        self.running = None
        name = self._name(version)
        check_exit(self.run, name, process.exited())
        out = RunFolder(self.folder(version) / "eval")
        metrics = out.metrics() or {}
        if metrics.get("final_pass_rate") is None:
            # Not 0: a success read from the wrong key as 0 % would "pick" the last version every time.
            raise StageFailed(f"{name} exited cleanly but left no success in {out.metrics_path}")
        entry = {"version": version, "model": model, "success": metrics["final_pass_rate"], "metrics": metrics}
        self.history.append(entry)
        if self.keep == "best":
            self._prune_all_but_best()
        self.history_path.write_text(json.dumps(self.history, indent=2))
        return entry

    def _prune_all_but_best(self) -> None:
        """Remove the copies of validated versions that another version beats; the starting model,
        evaluated where it lies, is never ours to remove."""
        import shutil

        best = self.best()
        for h in self.history:
            ours = self.folder(h["version"]) / "model"
            if h is best or h.get("pruned") or Path(h["model"]) != ours:
                continue
            shutil.rmtree(ours, ignore_errors=True)
            h["pruned"] = True


def print_validations(entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        console.print(f"validation v{entry['version']}: success {entry['success']:.1f} %")  # star eval's percent


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        import shutil

        shutil.copy2(src, dst)


@dataclass(frozen=True)
class Ending:
    """Why the RL stage stopped: "done" (every step trained) or "budget" (`rl.max_minutes` spent),
    and how many steps the learner had trained by then."""

    reason: str
    steps: int


def drive(
    run: Run,
    f: Fleet | ExternalFleet,
    client: redis.Redis,
    names: StreamNames,
    publisher: TaskPublisher,
    schedule: Schedule,
    poll_s: float = 0.5,
    validation: Validation | None = None,
    deadline: float | None = None,
) -> Ending:
    """Publish, watch, restart, until the learner has consumed every step (it counts a step once
    that step's weights are out) or, past `deadline` (time.monotonic()), at once: the steps under
    way are dropped and the latest published weights are the stage's result. The fleet says how its
    learner is doing and what it restarts; the loop is the same for an embedded and an external one."""
    total = schedule.total_steps
    columns = (
        TextColumn("[bold]rl"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("rl", total=total, info="")
        redis_down_since: float | None = None
        said = ""
        deps = Dependencies(f.dependencies())
        while True:
            try:
                progress = learner_progress(client, names)
                down = deps.check()
                version = weights_version(client, names)
                if not down:
                    publisher.publish_ready(progress, version)
                latest_raw = client.get(names.weights_latest)
                published = publisher.next_step()
                trim_streams(client, names)
                if redis_down_since is not None:
                    console.print(f"redis is back after {time.monotonic() - redis_down_since:.0f} s")
                    redis_down_since = None
            except (redis.ConnectionError, redis.TimeoutError):
                # Redis restarting (its AOF brings the streams back): keep the processes alive and
                # wait, up to REDIS_DOWN_LIMIT_S; then fail, naming it, rather than wait forever
                now = time.monotonic()
                if redis_down_since is None:
                    redis_down_since = now
                    console.print(f"[yellow]redis at {redact(f.redis_url)} unavailable; waiting for it to come back[/]")
                elif now - redis_down_since > REDIS_DOWN_LIMIT_S:
                    log = f"; see {f.redis_log}" if f.redis_log else ""
                    raise StageFailed(
                        f"redis at {redact(f.redis_url)} unreachable for {now - redis_down_since:.0f} s{log}"
                    )
                f.keep_alive()
                time.sleep(poll_s)
                continue
            validating = f" · validating v{validation.running[0]}" if validation and validation.running else ""
            info = f"published {published}/{total} · weights v{version}{validating}"
            bar.update(task, completed=min(progress, total), info=info)
            said = say_progress(min(progress, total), total, info, said)
            if validation is not None:
                latest = json.loads(latest_raw) if latest_raw else None
                if latest and validation.due(latest["version"]):
                    validation.submit(latest["version"], latest["uri"])
                print_validations(validation.poll())
            if progress >= total:
                _await_last_publication(f)
                return Ending("done", progress)
            if deadline is not None and time.monotonic() >= deadline:
                console.print(f"[yellow]rl.max_minutes spent: stopping after {progress} of {total} steps[/]")
                return Ending("budget", progress)
            for name in f.keep_alive():
                console.print(f"[yellow]{name} died; restarted[/]")
            report = f.learner_report()
            if not report.running:
                if report.state == "finished":
                    final = _progress_or(client, names, progress)
                    if final >= total:
                        return Ending("done", final)
                f.learner_ended(report)
            time.sleep(poll_s)


def say_progress(done: int, total: int, info: str, said: str) -> str:
    """A line per change of the RL progress where the console is no terminal (a container's log, a
    file), which a progress bar reaches only when it ends; returns the line now said."""
    line = f"rl {done}/{total} steps trained · {info}"
    if line != said and not console.is_terminal:
        console.print(line, soft_wrap=True)
    return line


def trim_streams(client: redis.Redis, names: StreamNames) -> None:
    """Drop what every consumer group has acknowledged: the streams stay as long as the work in
    flight, not the run."""
    for stream in (names.tasks, names.trajectories, names.scored):
        try:
            trim_consumed(client, stream)
        except (redis.ResponseError, ValueError) as exc:  # housekeeping: never worth the stage
            console.print(f"[yellow]could not trim {stream}: {exc}[/]")


@dataclass
class Dependencies:
    """Services the stage cannot train without, probed on /readyz every HEALTH_EVERY_S. While one
    is down no new step is published (a rollout against a dead sandbox scores 0, and that would be
    trained); down longer than SANDBOX_DOWN_LIMIT_S, the stage fails, naming it. (A dead process
    is restarted by the supervisor meanwhile; this covers one that runs but does not answer.)"""

    urls: dict[str, str]
    limit_s: float = SANDBOX_DOWN_LIMIT_S
    down_since: dict[str, float] = field(default_factory=dict)
    checked_at: float = 0.0

    def check(self) -> list[str]:
        """The names down now (as of the last probe)."""
        now = time.monotonic()
        if now - self.checked_at >= HEALTH_EVERY_S:
            self.checked_at = now
            for name, url in self.urls.items():
                if ready(url):
                    if name in self.down_since:
                        console.print(f"{name} is back after {now - self.down_since.pop(name):.0f} s; publishing again")
                elif name not in self.down_since:
                    self.down_since[name] = now
                    console.print(f"[yellow]{name} at {url} is not ready: publishing paused[/]")
        for name, since in self.down_since.items():
            if now - since > self.limit_s:
                raise StageFailed(f"{name} at {self.urls[name]} has not been ready for {now - since:.0f} s")
        return list(self.down_since)


def _await_last_publication(f: Fleet | ExternalFleet, timeout_s: float = 120.0) -> None:
    """The learner counts the last batch once its weights are out; give it a while to write its
    final status and exit before the fleet stops. Bounded, so that a learner stuck in its
    teardown cannot hang the run."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = f.learner_report()
        if not report.running or report.state == "finished":
            return
        time.sleep(0.5)


def _progress_or(client: redis.Redis, names: StreamNames, fallback: int) -> int:
    try:
        return learner_progress(client, names)
    except (redis.ConnectionError, redis.TimeoutError):
        return fallback


def _read_json(path: Path | None) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}
