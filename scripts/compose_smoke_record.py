"""The record of scripts/compose-smoke: reads what the run left (the run folder from the host, the
controller's log, the fleet's /world answers, `docker compose ps`) and writes
bench/results/compose_smoke.json with the commit it ran on and the digests of the files it tested.
Exit status 0 only when the run passed every check. (Also imported by tests/test_compose_smoke.py for
`watched_digests`.)"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import yaml

# What the smoke tests: a change to any of these calls for a new run (tests/test_compose_smoke.py).
WATCHED = (
    "compose.yaml",
    "Dockerfile",
    "Dockerfile.cuda",
    "deploy",
    "services/pipeline/external.py",
    "services/controller/external_fleet.py",
)
RECIPE_RUN = "tiny"  # configs/tiny.yaml's name: its run folder is runs/tiny


def watched_digests(root: Path) -> dict[str, str]:
    """sha256 of each watched file (every file under a watched folder), by path from `root`."""
    out: dict[str, str] = {}
    for name in WATCHED:
        path = root / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            out[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def checks(work: Path) -> tuple[dict, list[str]]:
    """What the run shows, and what of it failed."""
    run = work / "runs-kept" / RECIPE_RUN
    stages = _json(run / "stages.json")
    rl = (stages.get("rl") or {}).get("outputs") or {}
    config = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else {}
    max_steps = (config.get("rl") or {}).get("max_steps")
    log = (work / "train.log").read_text(errors="replace") if (work / "train.log").is_file() else ""
    world = {
        "controller": _json(run / "world.json").get("world_hash"),
        "sandbox": _json(work / "sandbox-world.json").get("world_hash"),
        "scorer": _json(work / "reward-world.json").get("world_hash"),
    }
    found = {
        "stages": {name: s.get("state") for name, s in stages.items()},
        "rl": {k: rl.get(k) for k in ("ended", "steps_trained", "learner_run")},
        "rl_steps_wanted": max_steps,
        "world_hash": world,
        "world": _json(work / "sandbox-world.json").get("source"),
        "results_on_host": sorted(p.name for p in run.iterdir()) if run.is_dir() else [],
        "progress_lines": [line for line in log.splitlines() if line.startswith("rl ") and "steps trained" in line],
        # where the model work ran: SFT on the learner service, eval on the rollout servers
        "placed": [
            line
            for line in log.splitlines()
            if "started on the learner at" in line or line.startswith("eval on the fleet's rollout servers")
        ],
        "controller_log_tail": log.splitlines()[-40:],
        "services": (work / "ps.txt").read_text().splitlines() if (work / "ps.txt").is_file() else [],
        "redis": (work / "redis-version.txt").read_text().strip() if (work / "redis-version.txt").is_file() else "",
    }
    failed = []
    if [found["stages"].get(s) for s in ("synth", "sft", "rl", "eval")] != ["done"] * 4:
        failed.append(f"stages not all done: {found['stages']}")
    if not max_steps or rl.get("steps_trained") != max_steps:
        failed.append(f"RL trained {rl.get('steps_trained')} of {max_steps} steps")
    if None in world.values() or len(set(world.values())) != 1:
        failed.append(f"the world hashes differ: {world}")
    if not {"report.md", "plots"} <= set(found["results_on_host"]):
        failed.append("no report.md and plots/ in ./runs/tiny on the host")
    if len(found["placed"]) != 2:
        failed.append(f"SFT on the learner and eval on the rollout servers not both in the log: {found['placed']}")
    if not found["progress_lines"]:
        failed.append("no step-by-step RL progress in `docker compose logs train`")
    if "7.0." not in found["redis"]:
        failed.append(f"not the project's Redis image (7.0): {found['redis']!r}")
    return found, failed


def main() -> int:
    env = os.environ
    work, repo = Path(env["SMOKE_WORK"]), Path(env["SMOKE_REPO"])
    found, failed = checks(work)
    status = env.get("SMOKE_STATUS", "ok")
    passed = status == "ok" and not failed
    record = {
        "commit": env.get("SMOKE_COMMIT"),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "passed": passed,
        "status": status,
        "failed": failed,
        "commands": [
            "scripts/compose-env",
            "docker compose up -d",
            "docker compose --profile train up -d",
            "docker compose logs -f train",
        ],
        "recipe": "configs/tiny.yaml",
        "seconds": {k: int(v) for k, v in (kv.split("=") for kv in env.get("SMOKE_SECONDS", "").split(",") if kv) if v},
        "base_image": env.get("SMOKE_BASE"),
        "docker": env.get("SMOKE_DOCKER"),
        "compose": env.get("SMOKE_COMPOSE"),
        "cores": os.cpu_count(),
        **found,
        "tested_files": watched_digests(Path(env.get("SMOKE_TESTED", repo))),
    }
    if not passed and (work / "logs.txt").is_file():
        record["logs_tail"] = (work / "logs.txt").read_text(errors="replace")[-6000:]
    out = repo / "bench" / "results" / "compose_smoke.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("tested_files", "logs_tail")}, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
