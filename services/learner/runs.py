"""Training runs as processes: start from a config, read their state from the run folder, stop them.

DeepSpeed holds one process group per process, so every run is its own process
(`python -m services.learner.worker KIND CONFIG`, under torchrun for `engine.ranks` > 1); the API
process only starts, watches and signals it. A run's truth is its folder (config.json, run.json, log.txt) and
its output folder (status.json, metrics.jsonl; the run folder itself unless the config names another
`output_dir`, as `star train` does). run.json names the process (pid and start time), so an API process
restarted meanwhile still tells whether the run lives and can stop it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from services.common.supervisor import alive, process_start_time, spawn
from services.learner.config import RLConfig, SFTConfig
from services.learner.launch import RankError, resolve_ranks, worker_argv, worker_env
from services.learner.runlog import read_metrics
from services.learner.trainer import read_status

RunKind = Literal["sft", "rl"]


class RunRequest(BaseModel):
    kind: RunKind
    config: dict[str, Any] = Field(description="An SFTConfig or RLConfig; output_dir defaults to the run folder.")
    max_steps: int | None = Field(None, ge=1)


class RunNotFound(KeyError):
    pass


class RunConfigError(ValueError):
    pass


@dataclass
class Run:
    id: str
    kind: str
    folder: Path
    output: Path  # where the run writes status.json and metrics.jsonl
    process: subprocess.Popen | None = None
    pid: int | None = None
    started: int | None = None  # the kernel's start time of `pid`
    created: float = 0.0  # wall clock at the start: an older status.json in `output` is an earlier run's

    def exit_code(self) -> int | None:
        """The process's exit status; None while it runs, or when it ran under another API process."""
        return self.process.poll() if self.process else None

    def running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return self.pid is not None and alive(self.pid, self.started)


class RunManager:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.runs: dict[str, Run] = {}

    def start(self, request: RunRequest, env: dict[str, str] | None = None) -> Run:
        run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        folder = self.root / run_id
        config = dict(request.config)
        config.setdefault("output_dir", str(folder))
        try:
            model = (SFTConfig if request.kind == "sft" else RLConfig).model_validate(config)
        except ValidationError as exc:
            raise RunConfigError(_errors(exc)) from None
        if not Path(model.model).exists():
            raise RunConfigError(f"model folder {model.model} does not exist")
        if isinstance(model, SFTConfig) and not Path(model.data).is_file():
            raise RunConfigError(f"data file {model.data} does not exist")
        try:
            ranks = resolve_ranks(model.engine.ranks)
        except RankError as exc:
            raise RunConfigError(str(exc)) from None
        folder.mkdir(parents=True)
        created = time.time()
        (folder / "config.json").write_text(model.model_dump_json(indent=1))
        cmd = worker_argv(request.kind, folder / "config.json", ranks, request.max_steps)
        # Its own process group (a torchrun's ranks stop with it). Not tied to the API process's
        # life: requests run on pool threads that come and go, and a run is its folder's, so it
        # may outlive an API restart; run.json names it (pid and start time) for whoever stops it.
        process = spawn(cmd, env={**os.environ, **worker_env(ranks), **(env or {})}, log_path=folder / "log.txt",
                        group=0, die_with_parent=False, cwd=Path(__file__).resolve().parents[2])
        run = Run(run_id, request.kind, folder, Path(model.output_dir), process, process.pid, created=created)
        self.runs[run_id] = run
        (folder / "run.json").write_text(json.dumps({"id": run_id, "kind": request.kind, "pid": process.pid,
                                                     "ranks": ranks, "started": process_start_time(process.pid),
                                                     "created": created}))
        return run

    def get(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            folder = self.root / run_id
            if "/" in run_id or ".." in run_id or not (folder / "run.json").is_file():
                raise RunNotFound(run_id)
            meta = json.loads((folder / "run.json").read_text())
            try:
                output = Path(json.loads((folder / "config.json").read_text())["output_dir"])
            except (OSError, ValueError, KeyError):
                output = folder
            run = Run(run_id, meta["kind"], folder, output, pid=meta.get("pid"), started=meta.get("started"),
                      created=meta.get("created", 0.0))
        return run

    def describe(self, run_id: str) -> dict[str, Any]:
        run = self.get(run_id)
        status = read_status(run.output)
        if status.get("updated", 0.0) < run.created:  # a resumed run's folder: the status is its predecessor's
            status = {}
        state = status.get("state", "starting")
        exit_code = run.exit_code()
        if not run.running() and state in ("starting", "running"):
            state = "failed"  # the process ended without recording an end state
        metrics = read_metrics(run.output)
        out = {"id": run.id, "kind": run.kind, "state": state, "step": status.get("step", 0),
               "version": status.get("version"), "folder": str(run.folder), "exit_code": exit_code,
               "metrics": metrics[-1] if metrics else {}, "steps_logged": len(metrics)}
        if state == "failed":
            out["error"] = status.get("error") or _tail(run.folder / "log.txt")
        if status.get("export"):
            out["export"] = status["export"]
        return out

    def stop(self, run_id: str, timeout_s: float = 0.0) -> dict[str, Any]:
        """SIGTERM: the run finishes its current step, checkpoints and ends as `stopped`."""
        run = self.get(run_id)
        if run.process is not None and run.process.poll() is None:
            run.process.send_signal(signal.SIGTERM)
            if timeout_s:
                try:
                    run.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    pass
        elif run.process is None and run.running():
            os.kill(run.pid, signal.SIGTERM)  # started by an earlier API process
        return self.describe(run_id)

    def list(self) -> list[dict[str, Any]]:
        ids = sorted(p.name for p in self.root.iterdir() if (p / "run.json").is_file())
        return [self.describe(i) for i in ids]


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())


def _tail(path: Path, limit: int = 2000) -> str:
    if not path.is_file():
        return ""
    return path.read_text(errors="replace")[-limit:]
