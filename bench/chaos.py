"""Operations benchmark: Redis memory over a long tiny run, kill -9 chaos per process kind, and kill -9 on
the NCCL weight path on GPUs.

    .venv/bin/python bench/chaos.py memory [--steps 50]            # + a baseline run with trimming off
    .venv/bin/python bench/chaos.py kill [--kinds learner,redis] [--kills 3] [--steps 10]
    .venv/bin/python bench/chaos.py gpu --smoke --steps 6          # CPU: learner_rank1's plumbing (gloo, files)
    .venv/bin/python bench/chaos.py episodes [--episodes 24 --kills 2] # the episode API (bench/episodes_chaos.py)

    # GPUs (2-4× H100/H200; on 4 about 10 minutes, on 2 the runs go one after another): vLLM 0.26.0 + DeepSpeed and
    # the SmolLM2-135M GGUF from bench/gpu_device.sh (pack here once; put and install on the device), then
    bench/gpu_device.sh start python bench/chaos.py gpu --parallel
    bench/gpu_device.sh poll 'chaos_gpu*'        # until it says the job has ended

Both drive `star train configs/tiny.yaml` (stages synth → rl, RL from the tiny base policy) as a
real subprocess with its own STAR_HOME and run folder, and watch the run's Redis from outside (its
port is in the run's fleet.json, its password in redis/redis.password).

memory: used memory (INFO memory) at every learner batch, with the streams trimmed as they are
consumed, and the same recipe with trimming switched off (STAR_STREAM_TRIM=0) as the baseline, in
the same invocation. `bounded`: the trimmed run's growth per step over its second half is under a
tenth of the baseline's and the streams hold no more than a few steps' entries at the end.

kill: for each kind (controller, learner, rollout, reward, sandbox, redis), one run during which
that kind is SIGKILLed `--kills` times at random moments (a killed controller is started again,
as an operator would: the rerun stops what the dead one left and resumes). The ledger is kept by
an audit consumer group on each stream (created before the first task, acknowledging at once, so
trimming goes on): samples produced and scored, and from the learner's checkpoint which scored
messages each step trained. lost: samples of published tasks never trained (dead letters
included); duplicated: (task, sample) pairs trained more than once, or a group trained twice.

gpu: the three faults of the weights' NCCL path, each in a `star train` run of its own (the same tiny recipe
with SmolLM2-135M-Instruct, converted from its GGUF as bench/gpu_proof.py does, on one vLLM engine on a GPU of
its own fed over NCCL: `deployment.weight_sync: nccl`, 12 steps of episodes forced to a small fixed shape), the
fault injected once at its moment after step 2 rather than at random:
  learner_broadcast  SIGKILL of the learner's rank 0 (1 rank: 2 GPUs) as soon as the rollout server's
                     GET /weights reports an NCCL receive under way (`receiving`, polled every few ms)
  rollout_receive    SIGKILL of that rollout worker at the same moment (1 rank: 2 GPUs)
  learner_rank1      SIGKILL of rank 1 of a 2-rank learner (3 GPUs) while it holds a whole batch; on a 2-GPU
                     machine the engine shares rank 1's GPU by memory (`deployment.share_gpus`), outside rank 0's
                     GPU, so the weights still travel over NCCL
With --parallel the runs whose GPUs are free go at once (4 GPUs: the first two together, then the third).
After each: the run completed (exit 0, every step trained), the ledger's lost and trained twice, each rollout
server's last GET /weights (not broken, not receiving, on the learner's final version), what was restarted
and the recovery time (from the kill until a step past it is trained and every server serves the version
last published).

Results: bench/results/chaos.json (`redis_memory`, `kinds`), chaos.md and chaos_memory.png; gpu:
bench/results/chaos_gpu.json and chaos_gpu.md (--smoke: var/bench/chaos/chaos_gpu_smoke.*).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.redis import local_url, redis_password  # noqa: E402
from services.common.streams import StreamNames, decode, ensure_group, trim_consumed  # noqa: E402
from services.common.supervisor import alive  # noqa: E402
from services.controller.loop import weights_version  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VAR = ROOT / "var" / "bench" / "chaos"
NAMES = StreamNames("star:tiny")
PROMPTS, G, QUERIES = 2, 2, 8  # configs/tiny.yaml: batch_prompts, group_size, rl_queries
KINDS = ("controller", "learner", "rollout", "reward", "sandbox", "redis")


# ---- one run of the tiny recipe ------------------------------------------------------------------


class TinyRun:
    """`star train configs/tiny.yaml` (synth → rl) in its own folder, restartable."""

    def __init__(self, name: str, steps: int, env: dict[str, str] | None = None, sets: list[str] = ()) -> None:
        self.folder = VAR / name
        if self.folder.exists():
            import shutil

            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)
        self.steps = steps
        epochs = math.ceil(steps * PROMPTS / QUERIES)
        self.argv = [
            sys.executable,
            "-m",
            "services.cli",
            "train",
            str(ROOT / "configs" / "tiny.yaml"),
            "--run-dir",
            str(self.folder / "run"),
            "--stage",
            "synth",
            "--stage",
            "rl",
            "--set",
            f"rl.max_steps={steps}",
            "--set",
            f"rl.epochs={epochs}",
            *[a for item in sets for a in ("--set", item)],
        ]
        self.env = {
            **os.environ,
            "STAR_HOME": str(self.folder / "home"),
            "STAR_LOG_JSON": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        log = open(self.folder / "controller.log", "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self.starts += 1

    @property
    def run(self) -> Path:
        return self.folder / "run"

    def record(self) -> dict[str, Any]:
        try:
            return json.loads((self.run / "fleet.json").read_text())
        except (OSError, ValueError):
            return {}

    def client(self) -> redis.Redis | None:
        port = self.record().get("redis_port")
        pw_file = self.run / "redis" / "redis.password"
        if not port or not pw_file.is_file():
            return None
        return redis.Redis.from_url(local_url(port, redis_password(self.run / "redis")), socket_timeout=5)

    def pid_of(self, kind: str) -> int | None:
        if kind == "controller":
            return self.proc.pid if self.proc and self.proc.poll() is None else None
        for c in self.record().get("children", []):
            if c["name"] == kind or c["name"].startswith(f"{kind}-"):
                if c.get("pid") and alive(c["pid"], c.get("started")):
                    return c["pid"]
        return None

    def finished(self) -> bool:
        return self.rl_record().get("state") == "done"

    def rl_record(self) -> dict[str, Any]:
        try:
            return json.loads((self.run / "stages.json").read_text()).get("rl", {})
        except (OSError, ValueError):
            return {}

    def rollout_servers(self) -> list[str]:
        """The rollout workers' HTTP faces (weights over NCCL), from the learner's rl.json."""
        try:
            return list(json.loads((self.run / "rl.json").read_text()).get("rollout_servers") or [])
        except (OSError, ValueError):
            return []


class Audit(threading.Thread):
    """One more consumer group on each stream, recording every entry; follows Redis to a new port
    when a restarted controller starts it again."""

    def __init__(self, run: TinyRun) -> None:
        super().__init__(daemon=True)
        self.run_ = run
        self.entries: dict[str, dict[str, dict[str, Any]]] = {s: {} for s in self.streams}
        self.halt = threading.Event()
        self.ready = threading.Event()
        self.batches = 0  # the learner's batches consumed, as last read
        self.published = 0  # the newest weights version published (services.controller.loop.weights_version)
        self.start()

    @property
    def streams(self) -> tuple[str, ...]:
        return (NAMES.tasks, NAMES.trajectories, NAMES.scored)

    def drain(self, client: redis.Redis) -> int:
        n = 0
        for stream in self.streams:
            ensure_group(client, stream, "audit", "0")
            reply = client.xreadgroup("audit", "auditor", {stream: ">"}, count=500)
            for entry, fields in reply[0][1] if reply else []:
                if fields is not None:
                    self.entries[stream][entry.decode()] = decode(fields)
                client.xack(stream, "audit", entry)
                n += 1
        return n

    def run(self) -> None:
        client = None
        while not self.halt.is_set():
            try:
                client = client or self.run_.client()
                if client is None:
                    time.sleep(0.05)
                    continue
                self.drain(client)
                self.batches = int(client.get(NAMES.learner_batches) or 0)
                self.published = weights_version(client, NAMES)
                self.ready.set()
                time.sleep(0.05)
            except (redis.RedisError, OSError):
                client = None  # down, or moved with a restarted controller
                time.sleep(0.1)

    def finish(self) -> None:
        self.halt.set()
        self.join(10)


# ---- memory ----------------------------------------------------------------------------------------


def watch_memory(run: TinyRun, timeout_s: float) -> dict[str, Any]:
    run.start()
    samples: dict[int, float] = {}
    lengths: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    client = None
    while run.proc.poll() is None and time.monotonic() < deadline:
        try:
            client = client or run.client()
            if client is not None:
                batches = int(client.get(NAMES.learner_batches) or 0)
                used = client.info("memory")["used_memory"] / 2**20
                if batches and batches not in samples:
                    samples[batches] = used
                lengths = {s.rsplit(":", 1)[1]: client.xlen(s) for s in (NAMES.tasks, NAMES.trajectories, NAMES.scored)}
        except (redis.RedisError, OSError):
            client = None
        time.sleep(0.2)
    if run.proc.poll() is None:
        run.proc.kill()
    rc = run.proc.wait()
    steps = sorted(samples)
    return {
        "steps": len(steps),
        "used_mb": [round(samples[s], 4) for s in steps],
        "step_ids": steps,
        "stream_lengths_at_end": lengths,
        "exit_code": rc,
        "completed": run.finished(),
    }


def slope(xs: list[int], ys: list[float]) -> float:
    import numpy as np

    if len(xs) < 2:
        return 0.0
    return float(np.polyfit(xs, ys, 1)[0])


def memory(steps: int, timeout_s: float, baseline_steps: int | None = None) -> dict[str, Any]:
    print(f"memory: {steps} steps with trimming, then the baseline without", flush=True)
    trimmed = watch_memory(TinyRun("memory", steps), timeout_s)
    baseline = watch_memory(TinyRun("memory-baseline", baseline_steps or steps, {"STAR_STREAM_TRIM": "0"}), timeout_s)
    out: dict[str, Any] = {}
    for name, r in (("trimmed", trimmed), ("baseline", baseline)):
        xs, ys = r["step_ids"], r["used_mb"]
        half = len(xs) // 2
        r["first_mb"] = ys[0] if ys else None
        r["last_mb"] = ys[-1] if ys else None
        r["kb_per_step_second_half"] = round(slope(xs[half:], ys[half:]) * 1024, 3)
        out[name] = r
    t, b = out["trimmed"], out["baseline"]
    in_flight = 3 * PROMPTS * G  # a few steps' worth of entries may be in flight
    bounded = (
        t["steps"] >= steps
        and b["kb_per_step_second_half"] > 0
        and t["kb_per_step_second_half"] < 0.1 * b["kb_per_step_second_half"]
        and all(n <= in_flight for n in t["stream_lengths_at_end"].values())
    )
    result = {
        "steps": t["steps"],
        "first_mb": t["first_mb"],
        "last_mb": t["last_mb"],
        "bounded": bounded,
        "kb_per_step": t["kb_per_step_second_half"],
        "baseline": {
            k: b[k] for k in ("steps", "first_mb", "last_mb", "kb_per_step_second_half", "stream_lengths_at_end")
        },
        "stream_lengths_at_end": t["stream_lengths_at_end"],
        "used_mb": t["used_mb"],
        "baseline_used_mb": b["used_mb"],
        "completed": t["completed"] and b["completed"],
    }
    plot_memory(result)
    return result


def plot_memory(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(result["used_mb"]) + 1), result["used_mb"], label="streams trimmed once consumed")
    ax.plot(range(1, len(result["baseline_used_mb"]) + 1), result["baseline_used_mb"], label="never trimmed (baseline)")
    ax.set_xlabel("RL step (learner batch)")
    ax.set_ylabel("Redis used memory (MiB)")
    ax.set_title("Redis memory over a tiny RL run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "chaos_memory.png", dpi=110)


# ---- chaos ---------------------------------------------------------------------------------------------


def checkpoint_state(rl: Path) -> dict[str, Any]:
    import torch

    ckpt = rl / "checkpoints"
    if not (ckpt / "latest").is_file():
        return {}
    tag = (ckpt / "latest").read_text().strip()
    state = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: state[k] for k in ("version", "consumed", "groups", "batches") if k in state}


def chaos_kind(kind: str, kills: int, steps: int, rng: random.Random, timeout_s: float) -> dict[str, Any]:
    run = TinyRun(f"kill-{kind}", steps)
    audit = Audit(run)
    run.start()
    events: list[str] = []
    orphans_left = 0
    deadline = time.monotonic() + timeout_s
    audit.ready.wait(timeout_s)
    while len(events) < kills and time.monotonic() < deadline and not run.finished():
        time.sleep(rng.uniform(3.0, 20.0))
        pid = run.pid_of(kind)
        if pid is None or run.finished():
            continue
        children = [c for c in run.record().get("children", []) if c.get("pid")]
        os.kill(pid, signal.SIGKILL)
        events.append(f"{time.strftime('%H:%M:%S')} killed {kind} pid {pid}")
        print(f"  {kind}: kill {len(events)} (pid {pid})", flush=True)
        if kind == "controller":
            run.proc.wait(30)
            time.sleep(5)  # its children had SIGTERM from the kernel; give them their shutdown
            orphans_left += sum(1 for c in children if alive(c["pid"], c.get("started")))
            run.start()  # the operator's rerun
        else:
            wait_for(lambda: run.pid_of(kind) not in (None, pid), 120)
    rc = run_end(run, deadline)
    audit.finish()
    ledger = count(run, audit)
    return {
        "kills": len(events),
        "lost": ledger["lost"],
        "duplicated": ledger["duplicated"],
        "completed": rc == 0 and run.finished(),
        "exit_code": rc,
        "controller_starts": run.starts,
        "orphans_left_after_controller_kill": orphans_left if kind == "controller" else None,
        "events": events,
        **{k: v for k, v in ledger.items() if k not in ("lost", "duplicated")},
    }


def run_end(run: TinyRun, deadline: float) -> int:
    """The controller's exit status, once it ends or is killed at `deadline` (time.monotonic())."""
    try:
        run.proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        run.proc.kill()
    return run.proc.wait()


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def count(run: TinyRun, audit: Audit) -> dict[str, Any]:
    tasks = audit.entries[NAMES.tasks]
    trajs = audit.entries[NAMES.trajectories]
    scored = audit.entries[NAMES.scored]
    task_ids = [d["task_id"] for d in tasks.values()]
    expected = {(t, i) for t in set(task_ids) for i in range(G)}
    key_of = {entry: (d["task_id"], d["sample_index"]) for entry, d in scored.items()}
    state = checkpoint_state(run.run / "rl")
    consumed = [i for ids in state.get("consumed", []) for i in ids]
    trained = Counter(key_of[i] for i in consumed if i in key_of)
    groups = Counter(g for ids in state.get("groups", []) for g in ids)
    dead: list[str] = []
    client = run.client()
    if client is not None:
        try:
            for stream in audit.streams:
                dead += [json.dumps(decode(f)["payload"])[:200] for _, f in client.xrange(StreamNames.dead(stream))]
                trim_consumed(client, stream)
        except redis.RedisError:
            pass
    unknown = [i for i in consumed if i not in key_of]
    return {
        "tasks_published": len(task_ids),
        "tasks_published_twice": len(task_ids) - len(set(task_ids)),
        "samples_expected": len(expected),
        "samples_produced": len(trajs),
        "samples_produced_unique": len({(d["task_id"], d["sample_index"]) for d in trajs.values()}),
        "samples_scored": len(scored),
        "samples_trained": sum(trained.values()),
        "lost": len(expected - set(trained)),
        "duplicated": sum(n - 1 for n in trained.values() if n > 1) + sum(n - 1 for n in groups.values() if n > 1),
        "trained_ids_not_in_audit": len(unknown),
        "dead_letters": len(dead),
        "dead_letter_heads": dead[:3],
        "weights_version": state.get("version"),
    }


# ---- chaos on the NCCL path (GPUs) ---------------------------------------------------------------------

# fault → learner ranks of its layout (each layout: those ranks' GPUs + one vLLM engine on a GPU of its own)
GPU_FAULTS = {"learner_broadcast": 1, "rollout_receive": 1, "learner_rank1": 2}
GPU_STEPS = 12
FORCED = {"tool_calls": 2, "turn_tokens": 32, "answer_tokens": 32}  # every episode the same small shape


def gpus_needed(fault: str, visible: int) -> tuple[int, bool]:
    """GPUs a fault's run takes on a machine showing `visible`, and whether its engine shares a learner
    rank's GPU: a GPU of its own where there are enough, else beside the last rank (never rank 0's)."""
    ranks = GPU_FAULTS[fault]
    if visible >= ranks + 1 or ranks == 1:
        return ranks + 1, False
    return ranks, True


def gpu_sets(fault: str, model: str | None, smoke: bool = False, share: bool = False) -> list[str]:
    """The recipe overrides of a fault's run: configs/tiny.yaml with `model` (None: tiny's own policy) on a vLLM
    engine fed over NCCL, the learner's ranks as the fault's layout needs (`share`: the engine beside rank 1),
    episodes of a fixed small shape. `smoke`: the same on CPU (the transformers engine, weights through files)."""
    sets = [
        f"deployment.learner_ranks={GPU_FAULTS[fault]}",
        "rl.val_every=0",
        f"rl.sampling.forced_turns={json.dumps(FORCED)}",
        "rl.sampling.max_context_tokens=4096",
    ]
    if model is not None:
        sets += ["model.tiny=null", f"model.path={model}"]
    if not smoke:
        sets += ["services.engine=vllm", "services.vllm={compile: false}", "deployment.weight_sync=nccl"]
        if share:
            sets += ["deployment.share_gpus=true"]
    return sets


def rank_of(environ: bytes) -> int | None:
    """The torchrun RANK in a process's /proc/PID/environ, or None."""
    for item in environ.split(b"\0"):
        if item.startswith(b"RANK="):
            try:
                return int(item[5:])
            except ValueError:
                return None
    return None


def learner_rank_pid(run: TinyRun, rank: int, ranks: int) -> int | None:
    """The process of the learner's `rank` (of `ranks`): the learner itself when it runs alone, else the
    torchrun child whose RANK it is (None between restarts)."""
    from services.learner.launch import child_pids

    pid = run.pid_of("learner")
    if pid is None or ranks == 1:
        return pid if rank == 0 else None
    for child in child_pids(pid):
        try:
            if rank_of(Path(f"/proc/{child}/environ").read_bytes()) == rank:
                return child
        except OSError:
            continue
    return None


def fleet_pids(run: TinyRun, ranks: int) -> dict[str, int]:
    """Every fleet process and learner rank alive now, by name."""
    pids = {
        c["name"]: c["pid"]
        for c in run.record().get("children", [])
        if c.get("pid") and alive(c["pid"], c.get("started"))
    }
    if ranks > 1:
        for rank in range(ranks):
            pid = learner_rank_pid(run, rank, ranks)
            if pid is not None:
                pids[f"learner-rank{rank}"] = pid
    return pids


def restarted(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The names whose process changed (or is gone) between two `fleet_pids` snapshots."""
    return sorted(name for name, pid in before.items() if after.get(name) != pid)


def step_under_way(batches: int, scored: int, per_step: int) -> bool:
    """The learner holds a whole batch beyond the `batches` it consumed: it is inside a step."""
    return scored >= (batches + 1) * per_step


def server_problems(answers: dict[str, dict[str, Any] | None], version: int | None) -> list[str]:
    """What is wrong with the rollout servers' last GET /weights answers: a server that never answered,
    one broken, one still receiving (left paused) or one on another version than `version`."""
    problems = []
    for url, info in answers.items():
        if info is None:
            problems.append(f"{url}: never answered")
            continue
        if info.get("broken"):
            problems.append(f"{url}: broken ({str(info['broken'])[:120]})")
        if info.get("receiving"):
            problems.append(f"{url}: left receiving version {info['receiving'].get('version')}")
        if version is not None and info.get("version") != version:
            problems.append(f"{url}: on version {info.get('version')}, not {version}")
    return problems


def recovered(batches: int, batches_at_kill: int, answers: dict[str, dict[str, Any] | None], published: int) -> bool:
    """Training went on past the step of the kill and every server serves the version last published."""
    return batches > batches_at_kill and not server_problems(answers, published)


class Servers(threading.Thread):
    """Polls every rollout server's GET /weights: keeps each one's last answer (None while it does not
    answer) and, while armed, calls `on_receiving(url, info)` the moment one reports an NCCL receive
    under way (polled fast then: a small model's broadcast lasts a fraction of a second)."""

    def __init__(self, run: TinyRun) -> None:
        super().__init__(daemon=True)
        self.run_ = run
        self.answers: dict[str, dict[str, Any] | None] = {}
        self.seen: dict[str, dict[str, Any]] = {}  # each server's last answer ever (kept through restarts)
        self.on_receiving = None
        self.halt = threading.Event()
        self.start()

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=1.0) as http:
            while not self.halt.is_set():
                for url in self.run_.rollout_servers():
                    try:
                        info = http.get(f"{url}/weights").json()
                    except (httpx.HTTPError, ValueError):
                        info = None
                    self.answers[url] = info
                    if info is not None:
                        self.seen[url] = info
                    arrival = (info or {}).get("receiving")
                    act = self.on_receiving
                    if act is not None and arrival and arrival.get("via") == "nccl" and act(url, info):
                        self.on_receiving = None
                time.sleep(0.002 if self.on_receiving else 0.25)

    def finish(self) -> None:
        self.halt.set()
        self.join(10)


def inject(
    fault: str, run: TinyRun, audit: Audit, servers: Servers, after_step: int, until: float
) -> dict[str, Any] | None:
    """SIGKILL the fault's process at its moment, once `after_step` steps are trained; None if the moment
    did not come before `until` (time.monotonic()) or the run's end. learner_broadcast: the learner's rank 0
    while a server receives its broadcast; rollout_receive: that server's process while it receives;
    learner_rank1: rank 1 while the learner holds a whole batch (inside a step). The victims' pids are
    looked up ahead, so the kill follows the moment's signal at once."""
    ranks = GPU_FAULTS[fault]
    while audit.batches < after_step and time.monotonic() < until and run.proc.poll() is None:
        time.sleep(0.1)
    done: dict[str, Any] = {}
    fired = threading.Event()
    ahead: dict[str, Any] = {}

    def look_up() -> None:
        ahead.update(before=fleet_pids(run, ranks), servers=run.rollout_servers())

    def kill(name: str, **about: Any) -> bool:
        pid = ahead["before"].get(name)
        if pid is None or fired.is_set():
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # restarted since it was looked up: the next moment will do
            return False
        done.update(
            killed=name,
            pid=pid,
            at=time.monotonic(),
            step=audit.batches,
            version=audit.published,
            before=ahead["before"],
            **about,
        )
        fired.set()
        return True

    look_up()
    if fault in ("learner_broadcast", "rollout_receive"):

        def on_receiving(url: str, info: dict[str, Any]) -> bool:
            arriving = info["receiving"]["version"]
            if fault == "learner_broadcast":
                return kill("learner" if ranks == 1 else "learner-rank0", server=url, receiving=arriving)
            return kill(f"rollout-{ahead['servers'].index(url)}", server=url, receiving=arriving)

        servers.on_receiving = on_receiving
        while not fired.wait(0.5) and time.monotonic() < until and run.proc.poll() is None:
            look_up()
        servers.on_receiving = None
    else:
        per_step = PROMPTS * G
        while not fired.is_set() and time.monotonic() < until and run.proc.poll() is None:
            look_up()
            scored = len({(d["task_id"], d["sample_index"]) for d in list(audit.entries[NAMES.scored].values())})
            if step_under_way(audit.batches, scored, per_step) and kill(f"learner-rank{ranks - 1}"):
                break
            time.sleep(0.05)
    return done or None


def chaos_gpu_fault(
    fault: str,
    steps: int,
    gpus: list[str],
    model: str | None,
    timeout_s: float,
    after_step: int = 2,
    smoke: bool = False,
    share: bool = False,
) -> dict[str, Any]:
    """One `star train` RL stage on `gpus` with `fault` injected once at its moment; the run's ledger, how it
    recovered, and every rollout server's state at the end."""
    env = {} if smoke else {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    run = TinyRun(f"gpu-{fault}", steps, env, gpu_sets(fault, model, smoke, share))
    audit = Audit(run)
    started = time.monotonic()
    run.start()
    servers = Servers(run)
    deadline = started + timeout_s
    print(f"  {fault}: started on GPU {','.join(gpus) or 'none (CPU)'}", flush=True)
    shot = inject(fault, run, audit, servers, after_step, min(deadline, started + timeout_s / 2))
    record: dict[str, Any] = {
        "fault": fault,
        "learner_ranks": GPU_FAULTS[fault],
        "gpus": gpus,
        "steps": steps,
        "engine_beside_rank": GPU_FAULTS[fault] - 1 if share else None,
        "injected": shot is not None,
    }
    if shot is not None:
        print(f"  {fault}: killed {shot['killed']} (pid {shot['pid']}) at step {shot['step']}", flush=True)
        while time.monotonic() < deadline and run.proc.poll() is None:
            if recovered(audit.batches, shot["step"], servers.answers, audit.published):
                shot["recovered_at"] = time.monotonic()
                break
            time.sleep(0.2)
        after = fleet_pids(run, GPU_FAULTS[fault])
        record.update(
            {
                "killed": shot["killed"],
                "injected_s": round(shot["at"] - started, 1),
                "injected_at_step": shot["step"],
                "version_at_kill": shot["version"],
                "receiving_version": shot.get("receiving"),
                "restarted": restarted(shot["before"], after),
                "recovery_s": round(shot["recovered_at"] - shot["at"], 1) if "recovered_at" in shot else None,
                "recovered_at_step": audit.batches if "recovered_at" in shot else None,
            }
        )
    rc = run_end(run, deadline)
    servers.finish()
    audit.finish()
    ledger = count(run, audit)
    trained = checkpoint_state(run.run / "rl").get("batches")
    problems = server_problems({u: servers.seen.get(u) for u in run.rollout_servers()}, ledger["weights_version"])
    record.update(
        {
            "exit_code": rc,
            "completed": rc == 0 and run.finished(),
            "steps_trained": trained,
            "lost": ledger["lost"],
            "duplicated": ledger["duplicated"],
            "servers_at_end": problems or "ok",
            "wall_s": round(time.monotonic() - started, 1),
            **{k: v for k, v in ledger.items() if k not in ("lost", "duplicated")},
        }
    )
    record["passed"] = bool(
        record["injected"]
        and record["completed"]
        and trained == steps
        and not ledger["lost"]
        and not ledger["duplicated"]
        and not problems
    )
    return record


class GpuPool:
    """Hands out disjoint sets of GPUs to runs going on at once; a run waits until enough are free."""

    def __init__(self, gpus: list[str]) -> None:
        self.free = list(gpus)
        self.cond = threading.Condition()

    def take(self, n: int) -> list[str]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.free) >= n)
            taken, self.free = self.free[:n], self.free[n:]
            return taken

    def give(self, gpus: list[str]) -> None:
        with self.cond:
            self.free = sorted(self.free + gpus, key=int)
            self.cond.notify_all()


def visible_gpus() -> list[str]:
    from services.pipeline.placement import visible_gpu_ids

    return visible_gpu_ids()


def device_name() -> str:
    try:
        out = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            )
            .stdout.strip()
            .splitlines()
        )
        return out[0] if out else "no GPU"
    except (OSError, subprocess.SubprocessError):
        return "no GPU"


def smollm_folder(gguf: str | None) -> str:
    """SmolLM2-135M-Instruct as an HF folder, converted once from its GGUF (bench/gpu_proof.py's conversion)."""
    from bench.gpu_proof import convert_gguf

    source = Path(gguf) if gguf else next(iter(sorted(Path("/tmp/star-gguf").glob("*.gguf"))), None)
    if source is None or not source.is_file():
        raise SystemExit(
            "no SmolLM2 GGUF (bench/gpu_device.sh install puts it in /tmp/star-gguf): give --gguf, or --model PATH|tiny"
        )
    out = VAR / "smollm2-135m-instruct"
    if not (out / "config.json").is_file():
        convert_gguf(source, out)
    return str(out)


def chaos_gpu(
    faults: list[str], steps: int, model: str | None, timeout_s: float, parallel: bool, smoke: bool = False
) -> dict[str, Any]:
    """Each fault in a run of its own, on GPUs of its own; with `parallel` the runs that fit go at once."""
    from concurrent.futures import ThreadPoolExecutor

    gpus = [] if smoke else visible_gpus()
    need = {f: gpus_needed(f, len(gpus)) for f in faults}
    if not smoke and max(n for n, _ in need.values()) > len(gpus):
        raise SystemExit(
            f"{', '.join(f for f in faults if need[f][0] > len(gpus))} need(s) "
            f"{max(n for n, _ in need.values())} GPUs; {len(gpus)} visible"
        )
    pool = GpuPool(gpus)

    def one(fault: str) -> dict[str, Any]:
        n, share = need[fault]
        taken = [] if smoke else pool.take(n)
        try:
            return chaos_gpu_fault(fault, steps, taken, model, timeout_s, smoke=smoke, share=share and not smoke)
        except Exception as exc:  # noqa: BLE001 - one fault's failure is its row, not the others' end
            return {"fault": fault, "passed": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            pool.give(taken)

    with ThreadPoolExecutor(max_workers=len(faults) if parallel else 1) as ex:
        return {r["fault"]: r for r in ex.map(one, faults)}


# ---- results -------------------------------------------------------------------------------------


def save(
    update: dict[str, Any], name: str = "chaos", render=None, machine: str | None = None, folder: Path = RESULTS
) -> dict[str, Any]:
    """Merge `update` into FOLDER/NAME.json (per-kind and per-fault rows kept across invocations) and
    write NAME.md with `render` (default: the CPU report)."""
    path = folder / f"{name}.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    for key in ("kinds", "faults"):
        if key in update:
            data[key] = {**data.get(key, {}), **update.pop(key)}
    data.update(update)
    data["machine"] = machine or f"{os.cpu_count()} cores (shared)"
    path.write_text(json.dumps(data, indent=1))
    (folder / f"{name}.md").write_text((render or report)(data))
    return data


def report(data: dict[str, Any]) -> str:
    lines = ["# Operations: Redis memory and kill -9 chaos (bench/chaos.py)", ""]
    m = data.get("redis_memory")
    if m:
        b = m["baseline"]
        lines += [
            "## Redis memory over a tiny RL run",
            "",
            f"`star train configs/tiny.yaml` (synth → rl, {m['steps']} steps), used memory at each learner "
            "batch; the baseline is the same recipe with trimming off (STAR_STREAM_TRIM=0), same invocation.",
            "",
            "| | steps | first MiB | last MiB | KiB/step (2nd half) | stream lengths at the end |",
            "|---|---:|---:|---:|---:|---|",
            f"| trimmed once consumed | {m['steps']} | {m['first_mb']:.3f} | {m['last_mb']:.3f} | "
            f"{m['kb_per_step']:.2f} | {m['stream_lengths_at_end']} |",
            f"| never trimmed (baseline) | {b['steps']} | {b['first_mb']:.3f} | {b['last_mb']:.3f} | "
            f"{b['kb_per_step_second_half']:.2f} | {b['stream_lengths_at_end']} |",
            "",
            f"bounded: **{m['bounded']}**  ·  plot: chaos_memory.png",
            "",
        ]
        if b["steps"] < m["steps"]:
            lines += [
                f"The baseline ran {b['steps']} steps (`--baseline-steps`): enough for its growth per step, "
                "which is linear; the trimmed run is the one that must stay flat over the whole run.",
                "",
            ]
    kinds = data.get("kinds")
    if kinds:
        lines += [
            "## kill -9 during a tiny run, per process kind",
            "",
            "| kind | kills | lost | trained twice | completed | samples expected / produced / scored / trained "
            "| dead letters |",
            "|---|---:|---:|---:|---|---|---:|",
        ]
        for kind in KINDS:
            k = kinds.get(kind)
            if k:
                lines.append(
                    f"| {kind} | {k['kills']} | {k['lost']} | {k['duplicated']} | {k['completed']} | "
                    f"{k['samples_expected']} / {k['samples_produced']} / {k['samples_scored']} / "
                    f"{k['samples_trained']} | {k['dead_letters']} |"
                )
        lines += [
            "",
            "lost: samples of published tasks never trained (dead letters included); trained twice: a "
            "(task, sample) trained more than once or a group in two steps. Produced/scored above trained "
            "means a task ran again after a kill and the learner dropped the copy.",
            "",
        ]
    e = data.get("episodes")
    if e:
        lines += [
            "## kill -9 of the sandbox and of the episode service mid-episode (`bench/chaos.py episodes`)",
            "",
            f"{e['episodes_per_round']} episodes at once per round, {e['tool_calls']} tool calls each, then two "
            f"finishes at once per episode; each round kills the sandbox during the tool calls and the episode "
            f"service (the scorer) while finishes hold their claims; {e['kills']['episodes']} rounds.",
            "",
            "| episodes | finished | scored twice | never scored | claims lost to a kill (re-scored) "
            "| replies differing | tool calls over- / under-counted | 503s while the sandbox was away | passed |",
            "|---:|---:|---:|---:|---:|---:|---|---:|---|",
            f"| {e['episodes']} | {e['finished']} | {e['scored_twice']} | {e['never_scored']} | "
            f"{e['lapsed_claims']} | {e['differing_replies']} | {e['calls_overcounted']} / "
            f"{e['calls_undercounted']} | {e.get('calls_503_while_sandbox_away', '-')} | {e['passed']} |",
            "",
            "Scored twice: more than one result stored for an episode; a claim lost to a kill is a scoring the "
            "killed service never finished, done again by the next finish after the restart. Every finish "
            "reply and the episode's state carry the same result.",
            "",
        ]
    lines.append(f"Machine: {data.get('machine')}.")
    return "\n".join(lines) + "\n"


def report_gpu(data: dict[str, Any]) -> str:
    lines = [
        "# kill -9 on the NCCL weight path during a `star train` RL stage (bench/chaos.py gpu)",
        "",
        f"Recipe: configs/tiny.yaml, stages synth → rl, {data.get('steps')} RL steps of {PROMPTS} prompts × {G} "
        f"samples, episodes forced to {FORCED}; policy {data.get('model')}; {data.get('engine')}. "
        "Each fault in a run of its own: one vLLM engine on a GPU of its own, the learner's ranks on "
        "GPUs of their own, except where a row says the engine shares a rank's GPU (by memory share; never "
        "rank 0's, which broadcasts the weights).",
        "",
        "| fault | learner ranks + engine (GPUs) | killed | at (s, step) | restarted | recovery s | steps trained "
        "| lost | trained twice | rollout servers at the end | exit | passed |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for fault in GPU_FAULTS:
        r = data.get("faults", {}).get(fault)
        if not r:
            continue
        if "error" in r:
            lines.append(f"| {fault} | | | | | | | | | {r['error'][:200]} | | False |")
            continue
        at = f"{r['injected_s']}, {r['injected_at_step']}" if r.get("injected") else "not injected"
        beside = f", engine beside rank {r['engine_beside_rank']}" if r.get("engine_beside_rank") is not None else ""
        lines.append(
            f"| {fault} | {r['learner_ranks']} + 1 ({','.join(r['gpus']) or 'CPU'}{beside}) | {r.get('killed', '')} | "
            f"{at} | {', '.join(r.get('restarted') or []) or '-'} | {r.get('recovery_s')} | "
            f"{r.get('steps_trained')} / {r['steps']} | {r['lost']} | {r['duplicated']} | "
            f"{r['servers_at_end'] if isinstance(r['servers_at_end'], str) else '; '.join(r['servers_at_end'])} "
            f"| {r['exit_code']} | {r['passed']} |"
        )
    lines += [
        "",
        "learner_broadcast: SIGKILL of the learner's rank 0 the moment a rollout server's GET /weights "
        "reports an NCCL receive under way (`receiving`); rollout_receive: SIGKILL of that rollout worker "
        "then; learner_rank1: SIGKILL of rank 1 of a 2-rank learner while it holds a whole batch. "
        "recovery: from the kill until the learner trained past the step of the kill and every rollout "
        "server answered, not broken, not receiving, on the version last published. lost / trained twice: "
        "the ledger of the CPU chaos runs (chaos.md). rollout servers at the end: each one's last GET "
        "/weights before the fleet stopped, against the learner's final version.",
        "",
        f"Machine: {data.get('machine')}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    mem = sub.add_parser("memory")
    mem.add_argument("--steps", type=int, default=50)
    mem.add_argument(
        "--baseline-steps",
        type=int,
        default=None,
        help="(default: --steps) a shorter baseline still shows its growth per step",
    )
    mem.add_argument("--timeout", type=float, default=3600)
    kill = sub.add_parser("kill")
    kill.add_argument("--kinds", default=",".join(KINDS))
    kill.add_argument("--kills", type=int, default=3)
    kill.add_argument("--steps", type=int, default=10)
    kill.add_argument("--seed", type=int, default=0)
    kill.add_argument("--timeout", type=float, default=1200)
    episodes = sub.add_parser(
        "episodes", help="the episode API: sandbox and episode service killed mid-episode (bench/episodes_chaos.py)"
    )
    episodes.add_argument("--episodes", type=int, default=24, help="episodes at once per round")
    episodes.add_argument("--kills", type=int, default=2, help="rounds (each kills the sandbox and the service)")
    episodes.add_argument("--tool-calls", type=int, default=6)
    episodes.add_argument("--db", default=None, help="a built world (default: one built from the data)")
    gpu = sub.add_parser("gpu", help="the NCCL weight path's faults, each at its moment, in runs on GPUs")
    gpu.add_argument("--faults", default=",".join(GPU_FAULTS))
    gpu.add_argument("--steps", type=int, default=GPU_STEPS)
    gpu.add_argument(
        "--model",
        default="smollm",
        help="smollm (converted from --gguf), tiny (the recipe's own random policy) or an HF folder",
    )
    gpu.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct GGUF (default: /tmp/star-gguf/*.gguf)")
    gpu.add_argument("--parallel", action="store_true", help="runs whose GPUs are free go at once")
    gpu.add_argument("--timeout", type=float, default=900, help="seconds per run")
    gpu.add_argument(
        "--smoke",
        action="store_true",
        help="CPU plumbing check: learner_rank1 on 2 gloo ranks, the "
        "tiny policy on the transformers engine, weights through files; written under var/",
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.what == "gpu":
        faults = args.faults.split(",")
        for fault in faults:
            if fault not in GPU_FAULTS:
                parser.error(f"unknown fault {fault!r}; one of {', '.join(GPU_FAULTS)}")
        if args.smoke:
            faults = [f for f in faults if f == "learner_rank1"] or parser.error("--smoke runs learner_rank1 only")
        VAR.mkdir(parents=True, exist_ok=True)
        model = (
            None
            if args.smoke or args.model == "tiny"
            else (smollm_folder(args.gguf) if args.model == "smollm" else args.model)
        )
        results = chaos_gpu(faults, args.steps, model, args.timeout, args.parallel, smoke=args.smoke)
        gpus = visible_gpus() if not args.smoke else []
        machine = f"{len(gpus)}× {device_name()}, {os.cpu_count()} cores" if gpus else f"CPU, {os.cpu_count()} cores"
        save(
            {
                "faults": results,
                "steps": args.steps,
                "model": model or "tiny.yaml's random Qwen2",
                "engine": "transformers, weights through files (CPU smoke)"
                if args.smoke
                else "vLLM (compile off), deployment.weight_sync nccl",
            },
            "chaos_gpu_smoke" if args.smoke else "chaos_gpu",
            report_gpu,
            machine,
            VAR if args.smoke else RESULTS,
        )
        for r in results.values():
            print(json.dumps(r), flush=True)
        sys.exit(0 if all(r.get("passed") for r in results.values()) else 1)
    if args.what == "episodes":
        from bench.episodes_chaos import chaos_episodes

        result = chaos_episodes(args.episodes, args.kills, args.tool_calls, args.db)
        save({"episodes": result})
        print(json.dumps({k: v for k, v in result.items() if k != "events"}), flush=True)
        sys.exit(0 if result["passed"] else 1)
    if args.what == "memory":
        result = memory(args.steps, args.timeout, args.baseline_steps)
        save({"redis_memory": result})
        print(json.dumps({k: v for k, v in result.items() if "used_mb" not in k}, indent=1))
        return
    rng = random.Random(args.seed)
    for kind in args.kinds.split(","):
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
        print(f"kill: {kind}", flush=True)
        result = chaos_kind(kind, args.kills, args.steps, rng, args.timeout)
        save({"kinds": {kind: result}})
        print(json.dumps({k: v for k, v in result.items() if k != "events"}), flush=True)


if __name__ == "__main__":
    main()
