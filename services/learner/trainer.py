"""The training loops: SFT over a chat file, and RL over the scored stream.

RL step (`RLTrainer.train_step` lists the order): rank 0's `GroupCollector` (services.learner.groups)
waits for the step's complete groups on the scored stream and notes them in the journal
(rl/journal.jsonl, one short line) → advantages and filters → the optimizer steps → every
`save_every` steps (and at the end) a checkpoint (model, optimizer, the ids of the consumed
messages), then the acknowledgement of every message since the previous one (the full optimizer
state is not written at every step) → publish weights v+1 → count the batch for the controller.

A learner killed anywhere resumes from its last checkpoint and replays the batches since from the
stream: their messages were never acknowledged, so they come back, and the journal says which
groups made each batch, so each replayed step trains exactly the batch it trained before (versions
already published are not published again, nor are their metrics logged twice). Messages trained
and checkpointed but not yet acknowledged are recognised by id and skipped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import torch

from services.common.schemas import ScoredTrajectory
from services.common.settings import get_settings
from services.common.streams import REDIS_DOWN, StreamNames, until_redis
from services.learner import algorithms as alg
from services.learner.batching import RLBatch, chat_to_sequence, rl_sequences
from services.learner.config import RLConfig, SFTConfig
from services.learner.engine import PolicyEngine
from services.learner.groups import GroupCollector, NoData, StepGroups, TrainedRecord, WeightsWanted
from services.learner.nccl_env import peer_protocol
from services.learner.runlog import RunLog
from services.learner.steps import loss_bounds, rl_step, sft_step
from services.learner.timesplit import step_split, stream_seconds
from services.weights.files import StorePublisher, write_version
from services.weights.nccl import FleetSync, NcclPublisher, nccl_master_key, resolve_master

log = logging.getLogger(__name__)
RESEND_EVERY_S = 30.0  # a rollout server's request for the weights is answered at most this often


def write_status(folder: Path, **fields: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / ".status.json.tmp"
    tmp.write_text(json.dumps({"updated": time.time(), "pid": os.getpid(), **fields}))
    os.replace(tmp, folder / "status.json")


def read_status(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "status.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _broadcast(obj: Any, engine: PolicyEngine) -> Any:
    if engine.world_size == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def stop_agreed(stop: threading.Event, engine: PolicyEngine) -> bool:
    """Whether any rank was asked to stop. SIGTERM reaches the ranks at different moments; deciding on
    each rank's own flag, one rank would leave the loop while another entered the next step and waited
    in its collectives for ever. Every rank calls this at the same point of each step."""
    if engine.world_size == 1:
        return stop.is_set()
    flag = torch.tensor([1.0 if stop.is_set() else 0.0], device=engine.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if flag.item() and not stop.is_set():
        stop.set()
    return bool(flag.item())


# ---- SFT ---------------------------------------------------------------------------------------


def load_chats(path: Path) -> list[list[dict[str, Any]]]:
    from services.common.files import iter_jsonl

    chats = []
    for n, record in iter_jsonl(path):
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{path}:{n}: expected an object with a non-empty 'messages' list")
        chats.append(messages)
    if not chats:
        raise ValueError(f"{path}: no chats")
    return chats


class SFTTrainer:
    def __init__(self, cfg: SFTConfig, stop: threading.Event | None = None) -> None:
        from transformers import AutoTokenizer

        from services.rollout.chat import Chat

        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.stop = stop or threading.Event()
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        chats = load_chats(Path(cfg.data))
        chat = Chat.for_agent(tokenizer, cfg.chat)  # the rollout's format: SFT and RL train on the same one
        self.sequences = [
            chat_to_sequence(tokenizer, c, cfg.max_seq_len, index=i, chat=chat) for i, c in enumerate(chats)
        ]
        self.total_steps = cfg.max_steps or math.ceil(len(self.sequences) * cfg.epochs / cfg.batch_size)
        self.engine = PolicyEngine(
            cfg.model, cfg.engine, cfg.schedule_config(), self.total_steps, home=get_settings().home
        )
        self.runlog = RunLog(self.out, enabled=self.engine.rank == 0)

    def batch_indices(self, step: int) -> list[int]:
        """The sequences of optimizer step `step`: epochs are seeded shuffles laid end to end, so
        the data of any step is known from its number alone (exact resume needs no data state)."""
        n, b = len(self.sequences), self.cfg.batch_size
        out = []
        for pos in range(step * b, (step + 1) * b):
            epoch, i = divmod(pos, n)
            perm = list(range(n))
            random.Random(self.cfg.engine.seed * 1_000_003 + epoch).shuffle(perm)
            out.append(perm[i])
        return out

    def run(self) -> dict[str, Any]:
        ckpt = self.out / "checkpoints"
        self.engine.load_checkpoint(ckpt)
        write_status(self.out, state="running", step=self.engine.step_count, total_steps=self.total_steps)
        from tqdm import tqdm

        bar = tqdm(total=self.total_steps, initial=self.engine.step_count, desc="sft", disable=self.engine.rank != 0)
        last: dict[str, Any] = {}
        while self.engine.step_count < self.total_steps and not stop_agreed(self.stop, self.engine):
            step = self.engine.step_count
            seqs = [self.sequences[i] for i in self.batch_indices(step)]
            last = sft_step(self.engine, seqs).metrics
            self.runlog.write(self.engine.step_count, last)
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.4f}")
            every = self.cfg.save_every
            if (every and self.engine.step_count % every == 0) or self.engine.step_count == self.total_steps:
                self.engine.save_checkpoint(ckpt, {"kind": "sft"})
            if self.engine.rank == 0:
                write_status(
                    self.out, state="running", step=self.engine.step_count, total_steps=self.total_steps, metrics=last
                )
        bar.close()
        export = None
        if self.engine.step_count >= self.total_steps:
            export = export_model(self.engine, self.out / "export", self.engine.step_count)
        state = "finished" if self.engine.step_count >= self.total_steps else "stopped"
        if self.engine.rank == 0:
            write_status(
                self.out,
                state=state,
                step=self.engine.step_count,
                total_steps=self.total_steps,
                metrics=last,
                export=str(export) if export else None,
            )
        self.runlog.close()
        return {"state": state, "step": self.engine.step_count, "export": export, "metrics": last}


def export_model(engine: PolicyEngine, root: Path, version: int) -> Path | None:
    """The HF model folder of the current weights (rank 0 writes; every rank joins the gather)."""
    buckets = engine.iter_weight_buckets(dtype=None)
    if engine.rank != 0:
        for _ in buckets:
            pass
        return None
    folder, *_ = write_version(root, version, buckets, config=engine.lm_config, source_dir=engine.model_dir)
    return folder


# ---- RL ----------------------------------------------------------------------------------------


def score_rates(trajs: list[ScoredTrajectory]) -> dict[str, float]:
    """The benchmark's view of a batch: mean scores and each check's pass rate (where it applies),
    so learning curves show success and constraints, not only the shaped reward."""
    if not trajs:
        return {}
    n = len(trajs)
    out = {
        f"{k}_rate": sum(getattr(t.score, k) for t in trajs) / n
        for k in ("success", "cs_micro", "cs_macro", "hard_micro", "hard_macro")
    }
    out["answered_rate"] = sum(t.finish_reason == "answer" for t in trajs) / n
    for family in ("commonsense", "hard"):
        names = sorted({c for t in trajs for c in getattr(t.score, family)})
        for name in names:
            verdicts = [getattr(t.score, family)[name].passed for t in trajs if name in getattr(t.score, family)]
            applied = [v for v in verdicts if v is not None]
            if applied:
                out[f"check/{name}"] = sum(applied) / len(applied)
    return out


ROLLOUT_TIMINGS = ("total_s", "generate_s", "tool_s", "turns", "sampled_tokens")
SCORING_TIMINGS = ("score_s",)


def rollout_timings(trajs: list[ScoredTrajectory]) -> dict[str, float]:
    """Where a batch's episodes spent their time (mean per episode, and the slowest one, which
    a synchronous step waits for): tells a slow engine from slow tools, and from slow scoring."""
    out: dict[str, float] = {}
    for prefix, keys in (("rollout", ROLLOUT_TIMINGS), ("scoring", SCORING_TIMINGS)):
        for key in keys:
            values = [t.timings[key] for t in trajs if key in t.timings]
            if values:
                s = alg.summarize(values)
                out[f"{prefix}/{key}_mean"], out[f"{prefix}/{key}_max"] = s["mean"], s["max"]
    return out


TOKEN_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768)


def length_histogram(trajs: list[ScoredTrajectory]) -> dict[str, float]:
    """How many of a batch's trajectories fall in each length bucket (tokens, at most the bucket's bound)."""
    out = {f"trajectory_tokens/le_{b}": 0.0 for b in TOKEN_BUCKETS} | {"trajectory_tokens/over": 0.0}
    for t in trajs:
        n = len(t.token_ids)
        out[next((f"trajectory_tokens/le_{b}" for b in TOKEN_BUCKETS if n <= b), "trajectory_tokens/over")] += 1
    return out


def batch_figures(trajs: list[ScoredTrajectory], advantages: list[float], cfg: RLConfig) -> dict[str, float]:
    """A batch's figures beside the loss: benchmark rates, rollout timings, rewards and advantages."""
    rewards = [alg.effective_reward(t.reward, t.finish_reason, cfg.filters.zero_reward_finish_reasons) for t in trajs]
    rs, ads = alg.summarize(rewards), alg.summarize(advantages)
    return {
        **score_rates(trajs),
        **rollout_timings(trajs),
        **length_histogram(trajs),
        "reward_mean": rs["mean"],
        "reward_std": rs["std"],
        "reward_max": rs["max"],
        "advantage_mean": ads["mean"],
        "advantage_std": ads["std"],
        "advantage_min": ads["min"],
        "advantage_max": ads["max"],
    }


def step_samples(trajs: list[ScoredTrajectory], limit: int) -> list[dict[str, Any]]:
    """Up to `limit` of a step's trajectories for samples.jsonl: each group's lowest sample index, in the
    order the groups came, so the choice does not depend on the reward."""
    firsts: dict[str, ScoredTrajectory] = {}
    for t in trajs:
        if t.group_id not in firsts or t.sample_index < firsts[t.group_id].sample_index:
            firsts[t.group_id] = t
    return [
        {
            "group_id": t.group_id,
            "prompt_id": t.prompt_id,
            "sample_index": t.sample_index,
            "policy_version": t.policy_version,
            "reward": t.reward,
            "rewards": t.rewards,
            # which of `rewards` is `reward`: a curriculum changes it by epoch or step
            "reward_kind": t.reward_kind,
            "epoch": t.epoch,
            "finish_reason": t.finish_reason,
            "tokens": len(t.token_ids),
            "tool_calls": t.tool_calls,
            "query": t.query.model_dump(mode="json") if t.query else None,
            "messages": t.messages,
        }
        for t in list(firsts.values())[:limit]
    ]


def old_policy_from_rollouts(cfg: RLConfig) -> bool:
    """Whether the rollouts' recorded log-probs take part in the loss. The engines record the distribution
    they sampled from: at any temperature the learner's own (it divides by T too), under a top-p/top-k
    cut another one, which can stand only as the behaviour policy of an importance correction."""
    return cfg.use_rollout_logprobs and (not cfg.sampling_cut or cfg.importance_sampling != "off")


class RLTrainer:
    def __init__(self, cfg: RLConfig, redis_client: Any = None, stop: threading.Event | None = None) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.stop = stop or threading.Event()
        settings = get_settings()
        # the schedule counts optimizer steps: mini_batches of them per batch
        # ranks 1..n wait in the step's first broadcast while rank 0 waits for the stream's data
        self.engine = PolicyEngine(
            cfg.model,
            cfg.engine,
            cfg.schedule_config(),
            cfg.total_steps * cfg.mini_batches,
            home=settings.home,
            data_wait_s=cfg.wait_timeout_s,
        )
        self.rank0 = self.engine.rank == 0
        self.runlog = RunLog(self.out, enabled=self.rank0)
        self.version = 0
        # every rank: the message and group ids trained, which the checkpoint holds
        self.trained = TrainedRecord(keep=TrainedRecord.kept_steps(cfg.save_every))
        self.batches = 0  # step batches consumed, trained or skipped: the controller paces on it
        self.published = 0  # the newest version already published when this process started
        self.start_version = 0  # the version this process started from (its checkpoint's)
        self.logged_batches = 0  # batches already in metrics.jsonl when this process started
        self.reference = self.engine.reference_policy() if cfg.kl_coef > 0 else None
        # log-probs of the distribution the rollouts sample from (logits / T), the policy's and the reference's
        self.engine.module.temperature = cfg.temperature
        if self.reference is not None:
            self.reference.temperature = cfg.temperature
        self.collector: GroupCollector | None = None  # rank 0 reads the stream
        self.publisher = None
        if self.rank0:
            if redis_client is None:
                import redis

                redis_client = redis.Redis.from_url(cfg.redis_url or settings.redis_url or "redis://127.0.0.1:6379/0")
            self.redis = redis_client
            self.names = StreamNames(cfg.stream_prefix)
            self.collector = GroupCollector(cfg, redis_client, self.trained, self.stop)
            if cfg.publish_weights:
                root = Path(cfg.weights_dir) if cfg.weights_dir else settings.weights_dir
                self.publisher = StorePublisher(
                    root,
                    redis_client=redis_client,
                    key_prefix=cfg.stream_prefix,
                    servers=cfg.rollout_servers,
                    keep=cfg.keep_versions,
                    api_token=settings.api_token,
                )
        self.fleet_sync = None
        if cfg.publish_weights and cfg.weight_sync == "nccl":
            nccl = None
            if self.rank0:
                host, port = resolve_master(cfg.nccl_master, cfg.rollout_servers, settings)
                nccl = NcclPublisher(
                    cfg.rollout_servers,
                    master_address=host,
                    master_port=port,
                    api_token=settings.api_token,
                    timeout_s=cfg.nccl_timeout_s,
                    forming=peer_protocol,  # the learner's own NCCL protocol kept out of the fleet's group
                )
                if getattr(self, "redis", None) is not None:  # where the servers meet rank 0, for operators
                    self.redis.set(nccl_master_key(cfg.stream_prefix), f"{host}:{port}")
                log.info(
                    "weight sync: nccl", extra={"nccl_master": f"{host}:{port}", "servers": len(cfg.rollout_servers)}
                )
            self.fleet_sync = FleetSync(self.publisher, nccl, files_every=cfg.files_every)
            if self.collector is not None:
                self.collector.weights_wanted = self._weights_wanted
        if cfg.publish_weights and cfg.weight_sync == "ipc":  # engines colocated on this learner's GPUs
            from services.learner.colocate import ColocatedServers, ColocatedSync

            servers = (
                ColocatedServers(
                    cfg.rollout_servers,
                    level=cfg.sleep_level,
                    timeout_s=cfg.sleep_timeout_s,
                    api_token=settings.api_token,
                )
                if self.rank0
                else None
            )
            self.fleet_sync = ColocatedSync(self.publisher, servers, files_every=cfg.files_every)
        self._resent_at = -math.inf  # when a server's request for the weights was last answered

    # -- resume ----------------------------------------------------------------------------------

    def resume(self) -> bool:
        state = self.engine.load_checkpoint(self.out / "checkpoints")
        if state is None:
            return False
        self.version = int(state.get("version", self.engine.step_count))
        self.trained.restore(state)
        self.batches = int(state.get("batches", self.engine.step_count))
        return True

    def _read_metrics_progress(self) -> None:
        """Rank 0: how many batches metrics.jsonl already logs (a replayed batch is not logged again)."""
        from services.learner.runlog import read_metrics

        self.logged_batches = max((int(m.get("batch", 0)) for m in read_metrics(self.out)), default=0)

    # -- one step ------------------------------------------------------------------------------------

    def train_step(self, final: bool = False) -> dict[str, Any]:
        """One batch, in this order (each step relies on the one before):

        1. rank 0 collects the step's groups (journaled first) and every rank gets them;
        2. advantages, filters and the optimizer steps: version v+1 when anything carried gradient;
        3. the batch is recorded as trained and its messages held unacknowledged;
        4. when due (`save_every`, or `final`: the run's last batch), a checkpoint with what was
           consumed, then the acknowledgement of the messages held since the previous one: a crash
           in between re-reads them and skips them by id;
        5. the weights of v+1 are published;
        6. the metrics are logged (not for a batch replayed after a kill: its line is there);
        7. rank 0 counts the batch in Redis, last: the controller publishes the next steps' tasks on
           this count, with the weights version it reads then as their oldest allowed sampler; counted
           before the publication, the next step would ask for the previous weights and its samples
           would arrive one version stale, to be dropped.
        """
        cfg = self.cfg
        replayed = self.collector is not None and self.batches in self.collector.replay
        renumbered = self._number_past_the_fleet(_broadcast(replayed, self.engine))
        began = time.perf_counter()
        step = self._gather()
        waited_until = time.time()
        trajs = step.trajectories
        batch = rl_sequences(
            trajs,
            cfg.filters,
            learner_version=self.version,
            std_normalize=cfg.std_normalize,
            negative_scale=cfg.negative_scale,
        )
        duplicates = self.collector.take_duplicates() if self.collector else 0
        metrics: dict[str, Any] = {
            "time_wait_s": step.wait_s,
            **batch.stats,
            "samples_duplicate": float(_broadcast(duplicates, self.engine)),
            "groups_lost": float(len(step.lost)),
            **step.counts,
        }
        metrics.update(batch_figures(trajs, batch.advantages, cfg))
        metrics.update(renumbered)
        colocated = cfg.publish_weights and cfg.weight_sync == "ipc"
        if colocated and any(sum(s.loss_mask) > 0 for s in batch.sequences):
            metrics.update(self.fleet_sync.sleep())  # the engines on these GPUs free them, or no step
        trainable = self._train(batch, metrics)
        self._record_trained(step)
        replaying = self.batches < self.logged_batches
        self.batches += 1
        t_save = time.perf_counter()
        due = (trainable and self.version % cfg.save_every == 0) or final
        if due and self._checkpoint(last_id=step.messages[-1].id if step.messages else None):
            metrics["time_checkpoint_s"] = time.perf_counter() - t_save
        if trainable and cfg.publish_weights and self.version > self.published:
            metrics.update(self.publish())
        if colocated:  # slept but published nothing new (a batch replayed after a resume): the current version
            metrics.update(
                self.fleet_sync.wake(self.version, self.engine.hf_model, zero3=self.engine.cfg.zero_stage == 3)
            )
        if final:
            metrics.update(self._keep_last_version())
        metrics.update(
            step_split(
                wall_s=time.perf_counter() - began,
                wait_s=step.wait_s,
                waited_until=waited_until,
                episode_ends=[t.timings.get("ended_at") for t in trajs],
                scored_at=[stream_seconds(m.id) for m in step.messages],
                training_s=metrics.get("time_compute_s", 0.0) + metrics.get("time_checkpoint_s", 0.0),
                sync_s=metrics.get("time_sync_s", 0.0) + metrics.get("colocate_sleep_s", 0.0),
            )
        )
        self._log_step(metrics, trajs, replaying)
        if self.rank0:
            until_redis(self._count_batches, what="counting batches")
        if get_settings().learner_crash_after_step == self.version and not replaying:
            # Fault injection for the replay test: die after a step that no checkpoint holds.
            os.kill(os.getpid(), 9)
        return metrics

    def _gather(self) -> StepGroups:
        """The step's groups on every rank: rank 0 collects them, the others get the trajectories and
        the lost group ids (the messages stay with rank 0). NoData on rank 0 is raised on every rank,
        which would otherwise wait for this batch for ever. A rollout server asking for the weights
        meanwhile (WeightsWanted) gets them from every rank's gathers, and the step is collected again."""
        while True:
            step, no_data, wanted = StepGroups([], [], [], 0.0), None, False
            payload = None
            if self.collector is not None:
                try:
                    step = self.collector.collect(self.batches, self.version)
                    payload = [t.model_dump(mode="json") for t in step.trajectories]
                except NoData as exc:
                    no_data = str(exc)
                except WeightsWanted:
                    wanted = True
            payload, lost, dropped, counts, no_data, wanted = _broadcast(
                (payload, step.lost, step.dropped, step.counts, no_data, wanted), self.engine
            )
            if not wanted:
                break
            log.info(
                "a rollout server asked for the weights: sending the current version again",
                extra={"version": self.version},
            )
            self.publish()
        if no_data is not None:
            raise NoData(no_data)
        if self.collector is None:
            step = StepGroups([], [ScoredTrajectory.model_validate(t) for t in payload], lost, 0.0, dropped, counts)
        else:
            step.trajectories = [ScoredTrajectory.model_validate(t) for t in payload]
        return step

    def _train(self, batch: RLBatch, metrics: dict[str, Any]) -> bool:
        """The batch's optimizer steps, when any sequence carries gradient (rLLM skips such batches
        too); whether it trained."""
        cfg = self.cfg
        if not any(sum(s.loss_mask) > 0 for s in batch.sequences):
            metrics["skipped"] = 1.0
            return False
        out = rl_step(
            self.engine,
            batch.sequences,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            bounds=loss_bounds(cfg),
            loss_agg=cfg.loss_agg,
            use_rollout_logprobs=old_policy_from_rollouts(cfg),
            kl_coef=cfg.kl_coef,
            reference=self.reference,
            mini_batches=cfg.mini_batches,
            batch_groups=cfg.batch_prompts,
        )
        metrics.update(out.metrics)
        self.version += 1
        return True

    def _record_trained(self, step: StepGroups) -> None:
        """Every rank records the batch's message ids (rank 0's) and its groups, trained or lost (from
        the broadcast trajectories, so every rank holds the same list); rank 0 holds its messages
        until the next checkpoint."""
        ids = _broadcast([m.id for m in step.messages], self.engine)
        settled = sorted({t.group_id for t in step.trajectories} | set(step.lost) | set(step.dropped))
        self.trained.add(ids, settled)
        if self.collector is not None:
            self.collector.hold(step.messages)

    def _log_step(self, metrics: dict[str, Any], trajs: list[ScoredTrajectory], replaying: bool) -> None:
        """The step's metrics and samples. `step` is the version (a skipped batch repeats it), `batch`
        counts every batch, so curves of rollout figures have one point per batch."""
        metrics["time_step_s"] = (
            metrics.get("time_wait_s", 0.0) + metrics.get("time_compute_s", 0.0) + metrics.get("time_sync_s", 0.0)
        )
        metrics["version"] = self.version
        metrics["batch"] = self.batches
        if replaying:  # a replayed batch's line is in metrics.jsonl from before the kill
            return
        self.runlog.write(self.version, metrics)  # a step is a trained batch, whatever its optimizer steps
        self.runlog.write_samples(
            self.version, [{"batch": self.batches, **r} for r in step_samples(trajs, self.cfg.samples_per_step)]
        )

    def _checkpoint(self, last_id: str | None = None) -> bool:
        """Every rank: save a checkpoint of the batches consumed so far, then (rank 0) acknowledge the
        messages held since the previous one. The tag names the batch too, so a checkpoint after a
        skipped batch never overwrites the one `latest` names. False when nothing was held."""
        held = bool(self.collector.held) if self.collector is not None else False
        if not _broadcast(held, self.engine):
            return False
        tag = f"step{self.engine.step_count:07d}-b{self.batches:07d}"
        self.engine.save_checkpoint(
            self.out / "checkpoints",
            {
                "kind": "rl",
                "version": self.version,
                "consumed": self.trained.consumed,
                "groups": self.trained.groups,
                "batches": self.batches,
                "stream": {
                    "name": self.collector.stream if self.collector else None,
                    "group": self.cfg.consumer_group,
                    "last_id": last_id,
                },
            },
            tag=tag,
        )
        if get_settings().learner_crash_after_checkpoint == self.version:
            # Fault injection for the resume test: die between checkpoint and acknowledgement.
            os.kill(os.getpid(), 9)
        if self.collector is not None:
            self.collector.acknowledge_held()
        return True

    def _count_batches(self) -> None:
        """Publish the consumed-batch count (rank 0), never lowering it: a replayed batch was counted."""
        current = self.redis.get(self.names.learner_batches)
        self.redis.set(self.names.learner_batches, max(self.batches, int(current) if current else 0))

    def _recount_batches(self) -> None:
        """At start, agree with Redis on the batch count, never lowering it: batches skipped after
        the last checkpoint (or before the first) were counted there and will never be delivered
        again, and a learner killed between publishing a step and counting it must still count it."""
        if self.rank0:
            raw = until_redis(lambda: self.redis.get(self.names.learner_batches), what="reading the batch count")
            # batches journaled since the checkpoint are trained again, and counted as they go
            if not self.collector.replaying:
                self.batches = max(self.batches, int(raw) if raw else 0)
            until_redis(self._count_batches, what="counting batches")
        self.batches = int(_broadcast(self.batches, self.engine))

    def _publish_unannounced(self) -> None:
        """A learner killed after checkpointing a step but before publishing its weights resumes
        with that version unannounced (the controller may already count the step as done): publish
        it from the checkpoint, which holds exactly those weights. With `publish_start`, a run that
        has announced nothing yet publishes its starting weights as version 0 the same way, for
        rollout workers started on another model (the controller sends no task before it is out).
        Every rank joins the gather. Over NCCL a version counts as announced once recorded
        (`weights:version`), files or not: the versions an earlier process published past this one's
        checkpoint are in engines already, and the learner, training those steps again, sends none
        of those numbers again (`retrained`), so that none ever names two sets of weights."""
        behind = False
        if self.rank0 and self.publisher is not None:
            latest = until_redis(self.publisher.latest, what="reading the published weights version")
            behind = self._highest_published() < self.version or (latest is None and self.cfg.publish_start)
        self.published = _broadcast(self.published, self.engine)
        self.start_version = self.version
        if _broadcast(behind, self.engine):
            log.info("publishing an unannounced version", extra={"version": self.version})
            self.publish()
        else:
            self._record_start()

    def _highest_published(self) -> int:
        """Rank 0: note (`published`) and return the highest version number this run has published by
        any path and process: the store's and Redis' records (`StorePublisher.highest_version`) and
        the versions the NCCL fleet's engines report (0 when none)."""
        self.published = max(
            0,
            until_redis(self.publisher.highest_version, what="reading the highest published weights version"),
            self._engines_highest(),
        )
        return self.published

    def _engines_highest(self) -> int:
        """The highest version the NCCL fleet's engines report holding (-1: none answers, or no NCCL):
        a learner killed between a broadcast and its record left it in the engines alone."""
        nccl = getattr(self.fleet_sync, "nccl", None)
        if nccl is None:
            return -1
        return max((int(info.get("version") or 0) for info in nccl.survey().values() if info), default=-1)

    def _number_past_the_fleet(self, replayed: bool) -> dict[str, float]:
        """Before a batch that no journal replays, a learner behind the highest number published (it
        resumed from an older checkpoint than the versions an earlier process published, or without
        their journal, or an earlier attempt of the stage left them) publishes the weights it holds
        as the next number above them all, and trains on from there: its weights differ from what the
        fleet holds under the numbers in between, and the fleet samples on its weights again before
        its next batch. A replayed batch keeps its number (the same batch from the same weights gives
        the version the earlier process published under it) and is not published again (`retrained`).
        Every rank calls it (the publication gathers)."""
        if replayed or self.version >= self.published or not self.cfg.publish_weights:
            return {}
        log.warning(
            "publishing the current weights under a number above the fleet's",
            extra={"version": self.version, "highest_published": self.published, "as": self.published + 1},
        )
        self.version = self.published + 1
        return self.publish()

    def _weights_wanted(self) -> bool:
        """Rank 0, while it waits for data: whether a rollout server asked for the current version
        (`weights:wanted`, taken off as it is read). A server that restarted holds the newest version
        with files, older than the one broadcast last, and takes no task until it has that one: with
        no other server feeding the learner, nothing else would send it. Answered at most once per
        RESEND_EVERY_S, and only once a version was trained."""
        if self.version == 0 or time.monotonic() - self._resent_at < RESEND_EVERY_S or self.retrained():
            return False
        try:
            asked = bool(self.redis.delete(self.names.weights_wanted))
        except REDIS_DOWN:
            return False
        if asked:
            self._resent_at = time.monotonic()
        return asked

    def retrained(self) -> bool:
        """Whether this process holds a version it trained again after a restart, whose number an
        earlier process already published with its own weights: it is never sent (the engines that
        ask for weights meanwhile wait for the next new version)."""
        return self.start_version < self.version <= self.published

    def _record_start(self) -> None:
        """Over NCCL, a learner that publishes nothing as it starts records its own version as the
        newest (`weights:version`): one left by an earlier attempt of the stage would name a version
        the engines may never get, and they would take no task while waiting for it."""
        if self.rank0 and self.fleet_sync is not None and self.publisher is not None:
            self.publisher.record_version(self.version)

    def _keep_last_version(self) -> dict[str, float]:
        """Over NCCL, the version the run ends on is written to the store too (every rank gathers):
        it is the stage's result, and what a later stage or a restarted server loads."""
        if self.fleet_sync is None or not self.cfg.publish_weights or self.version == 0:
            return {}
        return self.fleet_sync.write_files(self.version, **self._store_args())

    def _store_args(self) -> dict[str, Any]:
        """What the weights store writes a version from: the weights in buckets (bf16 when training
        in bf16; a callable, as the buckets are gathered only when files are written), the model's
        config and the folder its tokenizer comes from."""
        dtype = torch.bfloat16 if self.engine.bf16 else None
        return {
            "buckets": lambda: self.engine.iter_weight_buckets(dtype=dtype),
            "config": self.engine.lm_config,
            "source_dir": self.engine.model_dir,
        }

    def publish(self) -> dict[str, float]:
        if self.fleet_sync is not None:
            metrics = self.fleet_sync.publish(
                self.version, self.engine.hf_model, zero3=self.engine.cfg.zero_stage == 3, **self._store_args()
            )
            if self.rank0:  # every server has this version now, or was sent its files: requests are answered
                until_redis(lambda: self.redis.delete(self.names.weights_wanted), what="clearing weight requests")
            return metrics
        t0 = time.perf_counter()
        store = self._store_args()
        buckets = store.pop("buckets")()
        if not self.rank0:
            for _ in buckets:
                pass
            return {}
        result = self.publisher.publish(self.version, buckets, **store)
        return {**result.metrics(), "time_sync_s": time.perf_counter() - t0}

    def run(self, max_steps: int | None = None) -> dict[str, Any]:
        from tqdm import tqdm

        resumed = self.resume()
        if self.collector is not None:
            self.collector.load_journal(self.batches)
            self._read_metrics_progress()
        self.logged_batches = _broadcast(self.logged_batches, self.engine)
        if resumed or self.logged_batches or self.cfg.publish_start:
            self._publish_unannounced()
        else:  # a fresh start still numbers its versions above what an earlier attempt published
            if self.rank0 and self.publisher is not None:
                self._highest_published()
            self.published = _broadcast(self.published, self.engine)
            self._record_start()
        self._recount_batches()
        # A step is one batch of the controller's schedule, trained or skipped (all samples stale
        # or without gradient): the controller publishes exactly `limit` batches, so a learner that
        # counted only trained steps would wait forever for a batch that never comes.
        limit = max_steps or self.cfg.max_steps or self.cfg.total_steps
        if self.rank0:
            write_status(self.out, state="running", step=self.version, version=self.version)
        bar = tqdm(total=limit, initial=min(self.batches, limit), desc="rl", disable=not self.rank0)
        last: dict[str, Any] = {}
        state = "finished"
        try:
            while self.batches < limit and not stop_agreed(self.stop, self.engine):
                last = self.train_step(final=self.batches + 1 >= limit)
                bar.update(1)
                bar.set_postfix(loss=f"{last.get('loss', float('nan')):.4f}", reward=f"{last['reward_mean']:.3f}")
                if self.rank0:
                    write_status(self.out, state="running", step=self.version, version=self.version, metrics=last)
            if self.batches < limit:
                state = "stopped"
                self._checkpoint()  # what was trained since the last checkpoint is kept and acknowledged
                self._keep_last_version()
        except NoData as exc:
            state = "stopped" if self.stop.is_set() else "failed"
            last = {**last, "error": str(exc)}
            if stop_agreed(self.stop, self.engine):  # every rank is here (NoData is raised on each)
                self._keep_last_version()
        except BaseException as exc:
            state = "failed"  # not "finished": the controller reads this to decide on a restart
            last = {**last, "error": f"{type(exc).__name__}: {exc}"}
            raise
        finally:
            bar.close()
            if self.rank0:
                write_status(self.out, state=state, step=self.version, version=self.version, metrics=last)
            self.runlog.close()
        return {"state": state, "step": self.version, "version": self.version, "metrics": last}
