"""Operations benchmark: Redis memory over a long tiny run, and kill -9 chaos per process kind.

    .venv/bin/python bench/chaos.py memory [--steps 50]            # + a baseline run with trimming off
    .venv/bin/python bench/chaos.py kill [--kinds learner,redis] [--kills 3] [--steps 10]

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

Results: bench/results/chaos.json (`redis_memory`, `kinds`), chaos.md and chaos_memory.png.
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

RESULTS = ROOT / "bench" / "results"
VAR = ROOT / "var" / "bench" / "chaos"
NAMES = StreamNames("star:tiny")
PROMPTS, G, QUERIES = 2, 2, 8  # configs/tiny.yaml: batch_prompts, group_size, rl_queries
KINDS = ("controller", "learner", "rollout", "reward", "sandbox", "redis")


# ---- one run of the tiny recipe ------------------------------------------------------------------

class TinyRun:
    """`star train configs/tiny.yaml` (synth → rl) in its own folder, restartable."""

    def __init__(self, name: str, steps: int, env: dict[str, str] | None = None) -> None:
        self.folder = VAR / name
        if self.folder.exists():
            import shutil

            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)
        self.steps = steps
        epochs = math.ceil(steps * PROMPTS / QUERIES)
        self.argv = [sys.executable, "-m", "services.cli", "train", str(ROOT / "configs" / "tiny.yaml"),
                     "--run-dir", str(self.folder / "run"), "--stage", "synth", "--stage", "rl",
                     "--set", f"rl.max_steps={steps}", "--set", f"rl.epochs={epochs}"]
        self.env = {**os.environ, "STAR_HOME": str(self.folder / "home"), "STAR_LOG_JSON": "false",
                    "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                    **(env or {})}
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
        try:
            return json.loads((self.run / "stages.json").read_text()).get("rl", {}).get("state") == "done"
        except (OSError, ValueError):
            return False


class Audit(threading.Thread):
    """One more consumer group on each stream, recording every entry; follows Redis to a new port
    when a restarted controller starts it again."""

    def __init__(self, run: TinyRun) -> None:
        super().__init__(daemon=True)
        self.run_ = run
        self.entries: dict[str, dict[str, dict[str, Any]]] = {s: {} for s in self.streams}
        self.halt = threading.Event()
        self.ready = threading.Event()
        self.start()

    @property
    def streams(self) -> tuple[str, ...]:
        return (NAMES.tasks, NAMES.trajectories, NAMES.scored)

    def drain(self, client: redis.Redis) -> int:
        n = 0
        for stream in self.streams:
            ensure_group(client, stream, "audit", "0")
            reply = client.xreadgroup("audit", "auditor", {stream: ">"}, count=500)
            for entry, fields in (reply[0][1] if reply else []):
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
    return {"steps": len(steps), "used_mb": [round(samples[s], 4) for s in steps], "step_ids": steps,
            "stream_lengths_at_end": lengths, "exit_code": rc, "completed": run.finished()}


def slope(xs: list[int], ys: list[float]) -> float:
    import numpy as np

    if len(xs) < 2:
        return 0.0
    return float(np.polyfit(xs, ys, 1)[0])


def memory(steps: int, timeout_s: float, baseline_steps: int | None = None) -> dict[str, Any]:
    print(f"memory: {steps} steps with trimming, then the baseline without", flush=True)
    trimmed = watch_memory(TinyRun("memory", steps), timeout_s)
    baseline = watch_memory(TinyRun("memory-baseline", baseline_steps or steps, {"STAR_STREAM_TRIM": "0"}),
                            timeout_s)
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
    bounded = (t["steps"] >= steps and b["kb_per_step_second_half"] > 0
               and t["kb_per_step_second_half"] < 0.1 * b["kb_per_step_second_half"]
               and all(n <= in_flight for n in t["stream_lengths_at_end"].values()))
    result = {"steps": t["steps"], "first_mb": t["first_mb"], "last_mb": t["last_mb"], "bounded": bounded,
              "kb_per_step": t["kb_per_step_second_half"], "baseline": {k: b[k] for k in
                                                                        ("steps", "first_mb", "last_mb",
                                                                         "kb_per_step_second_half",
                                                                         "stream_lengths_at_end")},
              "stream_lengths_at_end": t["stream_lengths_at_end"], "used_mb": t["used_mb"],
              "baseline_used_mb": b["used_mb"], "completed": t["completed"] and b["completed"]}
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
    if run.proc.poll() is None:
        try:
            run.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.proc.kill()
    rc = run.proc.wait()
    audit.finish()
    ledger = count(run, audit)
    return {"kills": len(events), "lost": ledger["lost"], "duplicated": ledger["duplicated"],
            "completed": rc == 0 and run.finished(), "exit_code": rc, "controller_starts": run.starts,
            "orphans_left_after_controller_kill": orphans_left if kind == "controller" else None,
            "events": events, **{k: v for k, v in ledger.items() if k not in ("lost", "duplicated")}}


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
    return {"tasks_published": len(task_ids), "tasks_published_twice": len(task_ids) - len(set(task_ids)),
            "samples_expected": len(expected), "samples_produced": len(trajs),
            "samples_produced_unique": len({(d["task_id"], d["sample_index"]) for d in trajs.values()}),
            "samples_scored": len(scored), "samples_trained": sum(trained.values()),
            "lost": len(expected - set(trained)),
            "duplicated": sum(n - 1 for n in trained.values() if n > 1) + sum(n - 1 for n in groups.values() if n > 1),
            "trained_ids_not_in_audit": len(unknown), "dead_letters": len(dead), "dead_letter_heads": dead[:3],
            "weights_version": state.get("version")}


# ---- results -------------------------------------------------------------------------------------

def save(update: dict[str, Any]) -> dict[str, Any]:
    path = RESULTS / "chaos.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    if "kinds" in update:
        data["kinds"] = {**data.get("kinds", {}), **update.pop("kinds")}
    data.update(update)
    data["machine"] = f"{os.cpu_count()} cores (shared)"
    path.write_text(json.dumps(data, indent=1))
    (RESULTS / "chaos.md").write_text(report(data))
    return data


def report(data: dict[str, Any]) -> str:
    lines = ["# Operations: Redis memory and kill -9 chaos (bench/chaos.py)", ""]
    m = data.get("redis_memory")
    if m:
        b = m["baseline"]
        lines += ["## Redis memory over a tiny RL run", "",
                  f"`star train configs/tiny.yaml` (synth → rl, {m['steps']} steps), used memory at each learner "
                  "batch; the baseline is the same recipe with trimming off (STAR_STREAM_TRIM=0), same invocation.", "",
                  "| | steps | first MiB | last MiB | KiB/step (2nd half) | stream lengths at the end |",
                  "|---|---:|---:|---:|---:|---|",
                  f"| trimmed once consumed | {m['steps']} | {m['first_mb']:.3f} | {m['last_mb']:.3f} | "
                  f"{m['kb_per_step']:.2f} | {m['stream_lengths_at_end']} |",
                  f"| never trimmed (baseline) | {b['steps']} | {b['first_mb']:.3f} | {b['last_mb']:.3f} | "
                  f"{b['kb_per_step_second_half']:.2f} | {b['stream_lengths_at_end']} |", "",
                  f"bounded: **{m['bounded']}**  ·  plot: chaos_memory.png", ""]
        if b["steps"] < m["steps"]:
            lines += [f"The baseline ran {b['steps']} steps (`--baseline-steps`): enough for its growth per step, "
                      "which is linear; the trimmed run is the one that must stay flat over the whole run.", ""]
    kinds = data.get("kinds")
    if kinds:
        lines += ["## kill -9 during a tiny run, per process kind", "",
                  "| kind | kills | lost | trained twice | completed | samples expected / produced / scored / trained "
                  "| dead letters |", "|---|---:|---:|---:|---|---|---:|"]
        for kind in KINDS:
            k = kinds.get(kind)
            if k:
                lines.append(f"| {kind} | {k['kills']} | {k['lost']} | {k['duplicated']} | {k['completed']} | "
                             f"{k['samples_expected']} / {k['samples_produced']} / {k['samples_scored']} / "
                             f"{k['samples_trained']} | {k['dead_letters']} |")
        lines += ["", "lost: samples of published tasks never trained (dead letters included); trained twice: a "
                  "(task, sample) trained more than once or a group in two steps. Produced/scored above trained "
                  "means a task ran again after a kill and the learner dropped the copy.", ""]
    lines.append(f"Machine: {data.get('machine')}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    mem = sub.add_parser("memory")
    mem.add_argument("--steps", type=int, default=50)
    mem.add_argument("--baseline-steps", type=int, default=None, help="(default: --steps) a shorter baseline "
                     "still shows its growth per step")
    mem.add_argument("--timeout", type=float, default=3600)
    kill = sub.add_parser("kill")
    kill.add_argument("--kinds", default=",".join(KINDS))
    kill.add_argument("--kills", type=int, default=3)
    kill.add_argument("--steps", type=int, default=10)
    kill.add_argument("--seed", type=int, default=0)
    kill.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
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
