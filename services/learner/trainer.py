"""The training loops: SFT over a chat file, and RL over the scored stream.

RL step (DESIGN.md "Data flow"): wait for `batch_prompts` complete groups on the scored stream →
note the batch's groups in the journal (rl/journal.jsonl, one short line) → advantages and filters →
one optimizer step → publish weights v+1. Every `save_every` steps (and at the end) a checkpoint
(model, optimizer, the ids of the consumed messages), then the acknowledgement of every message
since the previous one: the full optimizer state is not written at every step.

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
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from services.common.schemas import ScoredTrajectory
from services.common.settings import get_settings
from services.common.streams import REDIS_DOWN, StreamNames, decode, until_redis
from services.learner import algorithms as alg
from services.learner.batching import chat_to_sequence, rl_sequences
from services.learner.config import RLConfig, SFTConfig
from services.learner.engine import PolicyEngine
from services.learner.runlog import RunLog
from services.learner.steps import loss_bounds, rl_step, sft_step
from services.learner.weights import FleetSync, NcclPublisher, StorePublisher, write_version

log = logging.getLogger(__name__)
CONSUMED_STEPS_KEPT = 16  # steps whose message ids stay in the checkpoint for de-duplication (at least save_every)
JOURNAL = "journal.jsonl"


class NoData(TimeoutError):
    """No (complete) group arrived within the configured wait."""


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

        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.stop = stop or threading.Event()
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        chats = load_chats(Path(cfg.data))
        self.sequences = [chat_to_sequence(tokenizer, c, cfg.max_seq_len, index=i) for i, c in enumerate(chats)]
        self.total_steps = cfg.max_steps or math.ceil(len(self.sequences) * cfg.epochs / cfg.batch_size)
        self.engine = PolicyEngine(cfg.model, cfg.engine, cfg.schedule_config(), self.total_steps,
                                   home=get_settings().home)
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
                write_status(self.out, state="running", step=self.engine.step_count, total_steps=self.total_steps,
                             metrics=last)
        bar.close()
        export = None
        if self.engine.step_count >= self.total_steps:
            export = export_model(self.engine, self.out / "export", self.engine.step_count)
        state = "finished" if self.engine.step_count >= self.total_steps else "stopped"
        if self.engine.rank == 0:
            write_status(self.out, state=state, step=self.engine.step_count, total_steps=self.total_steps,
                         metrics=last, export=str(export) if export else None)
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
    out = {f"{k}_rate": sum(getattr(t.score, k) for t in trajs) / n
           for k in ("success", "cs_micro", "cs_macro", "hard_micro", "hard_macro")}
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


def rollout_timings(trajs: list[ScoredTrajectory]) -> dict[str, float]:
    """Where a batch's episodes spent their time (mean per episode, and the slowest one, which
    a synchronous step waits for): tells a slow engine from slow tools."""
    out: dict[str, float] = {}
    for key in ROLLOUT_TIMINGS:
        values = [t.timings[key] for t in trajs if key in t.timings]
        if values:
            s = alg.summarize(values)
            out[f"rollout/{key}_mean"], out[f"rollout/{key}_max"] = s["mean"], s["max"]
    return out


def step_samples(trajs: list[ScoredTrajectory], limit: int) -> list[dict[str, Any]]:
    """Up to `limit` of a step's trajectories for samples.jsonl: each group's lowest sample index, in the
    order the groups came, so the choice does not depend on the reward."""
    firsts: dict[str, ScoredTrajectory] = {}
    for t in trajs:
        if t.group_id not in firsts or t.sample_index < firsts[t.group_id].sample_index:
            firsts[t.group_id] = t
    return [{"group_id": t.group_id, "prompt_id": t.prompt_id, "sample_index": t.sample_index,
             "policy_version": t.policy_version, "reward": t.reward, "rewards": t.rewards,
             # which of `rewards` is `reward`: a curriculum changes it by epoch or step
             "reward_kind": t.reward_kind, "epoch": t.epoch, "finish_reason": t.finish_reason,
             "query": t.query.model_dump(mode="json") if t.query else None,
             "messages": t.messages} for t in list(firsts.values())[:limit]]


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
        self.engine = PolicyEngine(cfg.model, cfg.engine, cfg.schedule_config(), cfg.total_steps * cfg.mini_batches,
                                   home=settings.home)
        self.rank0 = self.engine.rank == 0
        self.runlog = RunLog(self.out, enabled=self.rank0)
        self.version = 0
        self.consumed: list[list[str]] = []
        # group ids trained per step (the whole run): a task rolled out a second time
        # publishes its group again under new message ids, and that copy must not be trained too
        self.trained_groups: list[list[str]] = []
        self.duplicates = 0  # samples of already trained groups dropped since the last step
        # groups whose rollout task was dead-lettered (it failed on every attempt): group id → step.
        # A batch does not wait for them; without this it waited `straggler_wait_s` for a group
        # that could never come, and the whole fleet with it (e.g. behind a broken rollout engine).
        self.lost: dict[str, int] = {}
        self._dead_cursor = "0-0"
        self.batches = 0  # step batches consumed, trained or skipped: the controller paces on it
        self.held: list[str] = []  # rank 0: ids of messages consumed since the last checkpoint, not acknowledged
        self.replay: dict[int, dict[str, Any]] = {}  # rank 0: journaled batches after the checkpoint, by number
        self.published = 0  # the newest version already published when this process started
        self.logged_batches = 0  # batches already in metrics.jsonl when this process started
        self.groups: OrderedDict[str, list[tuple[Any, ScoredTrajectory]]] = OrderedDict()
        self.reference = self.engine.reference_policy() if cfg.kl_coef > 0 else None
        # log-probs of the distribution the rollouts sample from (logits / T), the policy's and the reference's
        self.engine.module.temperature = cfg.temperature
        if self.reference is not None:
            self.reference.temperature = cfg.temperature
        self.consumer = None
        self.publisher = None
        if self.rank0:
            from services.common.streams import StreamConsumer

            if redis_client is None:
                import redis

                redis_client = redis.Redis.from_url(cfg.redis_url or settings.redis_url or "redis://127.0.0.1:6379/0")
            self.redis = redis_client
            self.names = StreamNames(cfg.stream_prefix)
            self.stream = self.names.scored
            self.consumer = StreamConsumer(redis_client, self.stream, cfg.consumer_group, cfg.consumer_name,
                                           claim_idle_ms=600_000, max_deliveries=10)
            if cfg.publish_weights:
                root = Path(cfg.weights_dir) if cfg.weights_dir else settings.weights_dir
                self.publisher = StorePublisher(root, redis_client=redis_client, key_prefix=cfg.stream_prefix,
                                                servers=cfg.rollout_servers, keep=cfg.keep_versions,
                                                api_token=settings.api_token)
        self.fleet_sync = None
        if cfg.publish_weights and cfg.weight_sync == "nccl":
            nccl = None
            if self.rank0:
                host, _, port = cfg.nccl_master.rpartition(":")
                nccl = NcclPublisher(cfg.rollout_servers, master_address=host, master_port=int(port),
                                     api_token=settings.api_token)
            self.fleet_sync = FleetSync(self.publisher, nccl, files_every=cfg.files_every)

    # -- resume ----------------------------------------------------------------------------------

    def resume(self) -> bool:
        state = self.engine.load_checkpoint(self.out / "checkpoints")
        if state is None:
            return False
        self.version = int(state.get("version", self.engine.step_count))
        self.consumed = [list(ids) for ids in state.get("consumed", [])]
        self.trained_groups = [list(ids) for ids in state.get("groups", [])]
        self.batches = int(state.get("batches", self.engine.step_count))
        return True

    def _read_journal(self) -> None:
        """Rank 0: the batches journaled after the checkpoint, to replay; and how far the metrics got."""
        path = self.out / JOURNAL
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    batch = int(entry["batch"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a kill
                if batch >= self.batches:
                    self.replay[batch] = entry
        from services.learner.runlog import read_metrics

        self.logged_batches = max((int(m.get("batch", 0)) for m in read_metrics(self.out)), default=0)

    def _journal(self, chosen: list[str], lost: list[str]) -> None:
        with open(self.out / JOURNAL, "a") as fh:
            fh.write(json.dumps({"batch": self.batches, "groups": chosen, "lost": lost}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _kept(self) -> int:
        return max(CONSUMED_STEPS_KEPT, self.cfg.save_every + 1)

    def _already_trained(self) -> set[str]:
        return {i for ids in self.consumed for i in ids}

    # -- data --------------------------------------------------------------------------------------

    def _useful(self, members: list[tuple[Any, ScoredTrajectory]]) -> bool:
        """Would this group survive the staleness and DAPO filters? (Refill reads until enough do.)"""
        f = self.cfg.filters
        trajs = [t for _, t in members]
        if not alg.split_stale([t.policy_version for t in trajs], self.version, f.max_staleness)[0]:
            return False
        if f.dynamic_sampling:
            rewards = [alg.effective_reward(t.reward, t.finish_reason, f.zero_reward_finish_reasons) for t in trajs]
            return not alg.is_flat(rewards, f.zero_variance_eps)
        return True

    def _complete(self) -> list[str]:
        return [g for g, m in self.groups.items() if len(m) >= self.cfg.group_size]

    def _step_of(self, group: str) -> int:
        step = self.groups[group][0][1].step
        return -1 if step is None else step

    def _candidates(self, waited_s: float) -> list[str]:
        """Complete groups this batch may take, oldest step first. A later step's groups wait
        while this step's are still coming: with several steps in flight the later step's fast
        groups finish first, and taken now they would leave this step's slow groups to the next
        batch, one version staler and, at the staleness bound, dropped (up to half of a
        batch's samples). After `straggler_wait_s`, or when refilling (DAPO reads beyond the
        step), any complete group goes, so a lost group cannot stall the run."""
        complete = sorted(self._complete(), key=self._step_of)  # stable: arrival order within a step
        if self.cfg.filters.refill or waited_s >= self.cfg.straggler_wait_s:
            return complete
        return [g for g in complete if self._step_of(g) <= self.batches]

    def _enough(self, chosen: list[str], useful: int) -> bool:
        """Without refill a step takes the next `batch_prompts` groups (filters may shrink it), less
        those of its own that were lost; with refill it reads on until that many groups survive, at
        most max_refill_rounds batches more."""
        n, f = self.cfg.batch_prompts, self.cfg.filters
        if not f.refill:
            return len(chosen) + self._lost_at(self.batches) >= n
        if useful >= n:
            return True
        return f.max_refill_rounds > 0 and len(chosen) >= n * (1 + f.max_refill_rounds)

    def _lost_at(self, step: int) -> int:
        return sum(1 for s in self.lost.values() if s == step)

    def _read_lost(self) -> None:
        """Note the training tasks dead-lettered since the last look (rank 0)."""
        dead = StreamNames.dead(self.names.tasks)
        try:
            entries = self.redis.xrange(dead, min=f"({self._dead_cursor}", count=1000)
        except REDIS_DOWN:
            return
        for entry, fields in entries:
            self._dead_cursor = entry.decode() if isinstance(entry, bytes) else entry
            try:
                task = decode(fields)["payload"]
                group, step = task["task_id"], task.get("step")
            except (KeyError, TypeError, ValueError):
                continue  # not a task we could have trained
            if isinstance(step, int) and step >= self.batches and group not in self.groups:
                self.lost[group] = step
                log.warning("a rollout task was dead-lettered; its step goes without it",
                            extra={"group": group, "step": step})

    def collect(self) -> tuple[list[Any], list[ScoredTrajectory], list[str], float]:
        """Rank 0: messages and trajectories of the next step's groups (oldest step first), and
        the ids of the groups it went without because they were lost."""
        cfg = self.cfg
        t0 = time.perf_counter()
        trained = self._already_trained()
        trained_groups = {g for ids in self.trained_groups for g in ids}
        chosen: list[str] = []
        useful = 0
        started = time.monotonic()
        deadline = started + cfg.wait_timeout_s
        plan = self.replay.pop(self.batches, None)  # a batch trained before the last kill, to train again
        holding = set(self.held)
        while True:
            self._read_lost()
            if plan is not None:
                if all(len(self.groups.get(g, ())) >= cfg.group_size for g in plan["groups"]):
                    chosen = list(plan["groups"])
                    break
            else:
                for g in self._candidates(time.monotonic() - started):
                    if g in chosen or self._enough(chosen, useful):
                        continue
                    chosen.append(g)
                    useful += self._useful(self.groups[g])
                if self._enough(chosen, useful):
                    break
            if self.stop.is_set():
                raise NoData("stopped while waiting for data")
            if time.monotonic() > deadline:
                raise NoData(f"no complete group arrived within {cfg.wait_timeout_s:.0f} s")
            try:
                arrived = self.consumer.read(count=cfg.group_size * cfg.batch_prompts, block_ms=cfg.read_block_ms)
            except REDIS_DOWN as exc:
                # Redis restarting: what was read stays pending there, so wait and read on
                log.warning("redis unavailable; waiting for data", extra={"error": str(exc)})
                self.stop.wait(1.0)
                continue
            for msg in arrived:
                if msg.id in holding:
                    continue  # ours, held unacknowledged until the next checkpoint (re-claimed after idling)
                if msg.id in trained:
                    until_redis(lambda m=msg: self.consumer.ack(m), what="acknowledging")  # trained before a crash
                    continue
                try:
                    traj = ScoredTrajectory.model_validate(msg.data)
                except ValueError as exc:
                    msg.deliveries = self.consumer.max_deliveries  # a bad payload never gets better
                    self.consumer.fail(msg, f"not a ScoredTrajectory: {str(exc)[:500]}")
                    continue
                if traj.group_id in trained_groups:
                    # the whole group was trained from another run of its task: acknowledged, dropped
                    until_redis(lambda m=msg: self.consumer.ack(m), what="acknowledging a re-run group")
                    self.duplicates += 1
                    continue
                members = self.groups.setdefault(traj.group_id, [])
                held = next((m for m, t in members if t.sample_index == traj.sample_index), None)
                if held is not None:
                    # The same sample again: our own pending message re-delivered after idling
                    # while we waited (the copy we hold stands), or a task that ran twice (this
                    # copy is acknowledged now, never trained).
                    if held.id != msg.id:
                        until_redis(lambda m=msg: self.consumer.ack(m), what="acknowledging a duplicate")
                    continue
                members.append((msg, traj))
        # this step's lost groups are settled now (a late copy of one is dropped like a re-run)
        lost = list(plan["lost"]) if plan is not None else [g for g, s in self.lost.items() if s <= self.batches]
        for g in lost:
            self.lost.pop(g, None)
        if plan is None:
            self._journal(chosen, lost)
        messages, trajs = [], []
        for g in chosen:
            for msg, traj in self.groups.pop(g):
                messages.append(msg)
                trajs.append(traj)
        return messages, trajs, lost, time.perf_counter() - t0

    # -- one step ------------------------------------------------------------------------------------

    def train_step(self, final: bool = False) -> dict[str, Any]:
        """One batch. `final`: the run's last, checkpointed whatever `save_every` says, so that nothing
        is left unacknowledged."""
        cfg = self.cfg
        messages: list[Any] = []
        trajs_payload = None
        lost: list[str] = []
        wait_s = 0.0
        no_data: str | None = None
        if self.rank0:
            try:
                messages, trajs, lost, wait_s = self.collect()
                trajs_payload = [t.model_dump(mode="json") for t in trajs]
            except NoData as exc:
                no_data = str(exc)  # told to every rank, which would otherwise wait for this batch for ever
        trajs_payload, lost, no_data = _broadcast((trajs_payload, lost, no_data), self.engine)
        if no_data is not None:
            raise NoData(no_data)
        trajs = [ScoredTrajectory.model_validate(t) for t in trajs_payload]
        batch = rl_sequences(trajs, cfg.filters, learner_version=self.version, std_normalize=cfg.std_normalize,
                             negative_scale=cfg.negative_scale)
        metrics: dict[str, Any] = {"time_wait_s": wait_s, **batch.stats,
                                   "samples_duplicate": float(_broadcast(self.duplicates, self.engine)),
                                   "groups_lost": float(len(lost))}
        self.duplicates = 0
        rewards = [alg.effective_reward(t.reward, t.finish_reason, cfg.filters.zero_reward_finish_reasons)
                   for t in trajs]
        rs, ads = alg.summarize(rewards), alg.summarize(batch.advantages)
        metrics.update(score_rates(trajs))
        metrics.update(rollout_timings(trajs))
        metrics.update({"reward_mean": rs["mean"], "reward_std": rs["std"], "reward_max": rs["max"],
                        "advantage_mean": ads["mean"], "advantage_std": ads["std"], "advantage_min": ads["min"],
                        "advantage_max": ads["max"]})
        trainable = [s for s in batch.sequences if sum(s.loss_mask) > 0]
        if trainable:
            out = rl_step(self.engine, batch.sequences, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                          bounds=loss_bounds(cfg), loss_agg=cfg.loss_agg,
                          use_rollout_logprobs=old_policy_from_rollouts(cfg),
                          kl_coef=cfg.kl_coef, reference=self.reference, mini_batches=cfg.mini_batches,
                          batch_groups=cfg.batch_prompts)
            metrics.update(out.metrics)
            self.version += 1
        else:
            metrics["skipped"] = 1.0  # nothing carries gradient (rLLM skips such steps too)
        # Checkpoint first (with what was consumed), then acknowledge: a crash in between re-reads
        # the messages and skips them by id.
        self.consumed = (self.consumed + [[m.id for m in messages]])[-self._kept():]
        self.consumed = _broadcast(self.consumed, self.engine)
        # from the broadcast trajectories, so every rank holds the same list
        settled = sorted({t.group_id for t in trajs} | set(lost))
        # every step's, for the whole run: a task rolled out again however late is still caught
        self.trained_groups = self.trained_groups + [settled]
        self.held += [m.id for m in messages]
        replaying = self.batches < self.logged_batches
        self.batches += 1
        t_save = time.perf_counter()
        due = (trainable and self.version % cfg.save_every == 0) or final
        if due and self._checkpoint(last_id=messages[-1].id if messages else None):
            metrics["time_checkpoint_s"] = time.perf_counter() - t_save
        if trainable and cfg.publish_weights and self.version > self.published:
            metrics.update(self.publish())
        metrics["time_step_s"] = (metrics.get("time_wait_s", 0.0) + metrics.get("time_compute_s", 0.0)
                                  + metrics.get("time_sync_s", 0.0))
        metrics["version"] = self.version
        # `step` is the version (a skipped batch repeats it); `batch` counts every batch, so curves
        # of rollout figures have one point per batch
        metrics["batch"] = self.batches
        if not replaying:  # a replayed batch's line is in metrics.jsonl from before the kill
            self.runlog.write(self.version, metrics)  # a step is a trained batch, whatever its optimizer steps
            self.runlog.write_samples(self.version, [{"batch": self.batches, **r}
                                                     for r in step_samples(trajs, cfg.samples_per_step)])
        if self.rank0:
            # Counted last: the controller publishes the next steps' tasks on this count, with the
            # weights version it reads then as their oldest allowed sampler. Counted before the
            # publication, the next step would go out asking for the previous weights and its samples
            # would arrive one version stale, to be dropped.
            until_redis(self._count_batches, what="counting batches")
        if os.environ.get("STAR_LEARNER_CRASH_AFTER_STEP") == str(self.version) and not replaying:
            # Fault injection for the replay test: die after a step that no checkpoint holds.
            os.kill(os.getpid(), 9)
        return metrics

    def _checkpoint(self, last_id: str | None = None) -> bool:
        """Every rank: save a checkpoint of the batches consumed so far, then (rank 0) acknowledge the
        messages held since the previous one. The tag names the batch too, so a checkpoint after a
        skipped batch never overwrites the one `latest` names. False when nothing was held."""
        if not _broadcast(bool(self.held), self.engine):
            return False
        tag = f"step{self.engine.step_count:07d}-b{self.batches:07d}"
        self.engine.save_checkpoint(self.out / "checkpoints", {
            "kind": "rl", "version": self.version, "consumed": self.consumed, "groups": self.trained_groups,
            "batches": self.batches,
            "stream": {"name": getattr(self, "stream", None), "group": self.cfg.consumer_group,
                       "last_id": last_id}}, tag=tag)
        if os.environ.get("STAR_LEARNER_CRASH_AFTER_CHECKPOINT") == str(self.version):
            # Fault injection for the resume test: die between checkpoint and acknowledgement.
            os.kill(os.getpid(), 9)
        if self.rank0 and self.held:
            # (the checkpoint holds these ids: a learner that dies waiting for Redis skips them on resume)
            held = self.held
            until_redis(lambda: self.consumer.client.xack(self.consumer.stream, self.consumer.group, *held),
                        what="acknowledging the messages since the last checkpoint")
        self.held = []
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
            if not self.replay:  # batches journaled since the checkpoint are trained again, counted as they go
                self.batches = max(self.batches, int(raw) if raw else 0)
            until_redis(self._count_batches, what="counting batches")
        self.batches = int(_broadcast(self.batches, self.engine))

    def _publish_unannounced(self) -> None:
        """A learner killed after checkpointing a step but before publishing its weights resumes
        with that version unannounced (the controller may already count the step as done): publish
        it from the checkpoint, which holds exactly those weights. Every rank joins the gather."""
        behind = False
        if self.rank0 and self.publisher is not None:
            latest = until_redis(self.publisher.latest, what="reading the published weights version")
            self.published = latest.version if latest else 0
            behind = self.published < self.version
        self.published = _broadcast(self.published, self.engine)
        if _broadcast(behind, self.engine):
            log.info("publishing the resumed version", extra={"version": self.version})
            self.publish()

    def publish(self) -> dict[str, float]:
        if self.fleet_sync is not None:
            dtype = torch.bfloat16 if self.engine.bf16 else None
            return self.fleet_sync.publish(self.version, self.engine.hf_model, zero3=self.engine.cfg.zero_stage == 3,
                                           buckets=lambda: self.engine.iter_weight_buckets(dtype=dtype),
                                           config=self.engine.lm_config, source_dir=self.engine.model_dir)
        t0 = time.perf_counter()
        buckets = self.engine.iter_weight_buckets(dtype=torch.bfloat16 if self.engine.bf16 else None)
        if not self.rank0:
            for _ in buckets:
                pass
            return {}
        result = self.publisher.publish(self.version, buckets, config=self.engine.lm_config,
                                        source_dir=self.engine.model_dir)
        return {**result.metrics(), "time_sync_s": time.perf_counter() - t0}

    def run(self, max_steps: int | None = None) -> dict[str, Any]:
        from tqdm import tqdm

        resumed = self.resume()
        if self.rank0:
            self._read_journal()
        self.logged_batches = _broadcast(self.logged_batches, self.engine)
        if resumed or self.logged_batches:
            self._publish_unannounced()
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
                    write_status(self.out, state="running", step=self.version, version=self.version,
                                 metrics=last)
            if self.batches < limit:
                state = "stopped"
                self._checkpoint()  # what was trained since the last checkpoint is kept and acknowledged
        except NoData as exc:
            state = "stopped" if self.stop.is_set() else "failed"
            last = {**last, "error": str(exc)}
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

