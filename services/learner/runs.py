"""Training runs as processes: start from a config, read their state from the run folder, stop them.

DeepSpeed holds one process group per process, so every run is its own process
(`python -m services.learner.worker KIND CONFIG`, under torchrun for `engine.ranks` > 1); the API
process only starts, watches and signals it. A run's truth is its folder (config.json, run.json, log.txt) and
its output folder (status.json, metrics.jsonl; the run folder itself unless the config names another
`output_dir`, as `star train` does). run.json names the process (pid and start time), so an API process
restarted meanwhile still tells whether the run lives and can stop it.

On a multi-node learner (launch.Nodes) node 0 takes the runs and asks every other node to join each one
(`POST /runs/{id}/join`): the run folder is on a volume all nodes share, and each node starts its own
torchrun (log.node<R>.txt) at the run's rendezvous.
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

import httpx
from pydantic import BaseModel, Field, ValidationError

from services.common.supervisor import alive, process_start_time, spawn, stop_process
from services.learner.config import RLConfig, SFTConfig, load_config
from services.learner.launch import Nodes, RankError, resolve_ranks, worker_argv, worker_env
from services.learner.runlog import read_metrics
from services.learner.trainer import read_status

RunKind = Literal["sft", "rl"]
GONE = "its process is gone (the learner restarted); start it again to resume from its checkpoint"


class RunRequest(BaseModel):
    kind: RunKind
    config: dict[str, Any] = Field(description="An SFTConfig or RLConfig; output_dir defaults to the run folder.")
    max_steps: int | None = Field(None, ge=1)


class JoinRequest(BaseModel):
    kind: RunKind
    max_steps: int | None = Field(None, ge=1)


class RunNotFound(KeyError):
    pass


class RunConfigError(ValueError):
    pass


class JoinError(RuntimeError):
    """A node of a multi-node learner did not join the run."""


@dataclass
class Run:
    id: str
    kind: str
    folder: Path
    output: Path  # where the run writes status.json and metrics.jsonl
    process: subprocess.Popen | None = None
    gone: bool = False  # started by an earlier learner process, whose run process is no longer there
    pid: int | None = None
    created: float = 0.0  # wall clock at the start: an older status.json in `output` is an earlier run's


class RunManager:
    def __init__(
        self, root: Path, nodes: Nodes = Nodes(), peers: list[str] | None = None, token: str | None = None
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.runs: dict[str, Run] = {}
        self.nodes = nodes
        self.peers = list(peers or [])  # node 0: the other nodes' base URLs, in node order
        self.token = token
        if nodes.rank == 0 and len(self.peers) != nodes.count - 1:
            raise ValueError(
                f"a learner of {nodes.count} nodes needs {nodes.count - 1} peer URLs "
                f"(STAR_LEARNER_PEER_URLS), got {len(self.peers)}"
            )

    def start(self, request: RunRequest, env: dict[str, str] | None = None) -> Run:
        if self.nodes.rank != 0:
            raise RunConfigError(f"this is learner node {self.nodes.rank}: node 0 takes the runs")
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
        process = self._launch(run_id, request.kind, folder, ranks, request.max_steps, env, folder / "log.txt")
        run = Run(run_id, request.kind, folder, Path(model.output_dir), process, pid=process.pid, created=created)
        self.runs[run_id] = run
        (folder / "run.json").write_text(
            json.dumps(
                {
                    "id": run_id,
                    "kind": request.kind,
                    "pid": process.pid,
                    "ranks": ranks,
                    "nodes": self.nodes.count,
                    "started": process_start_time(process.pid),
                    "created": created,
                }
            )
        )
        try:
            self._join_peers(run_id, request)
        except JoinError:
            stop_process(process, timeout=10)
            raise
        return run

    def join(self, run_id: str, kind: RunKind, max_steps: int | None = None) -> Run:
        """Node 1..: start this node's ranks of run `run_id`, which node 0 started in the shared runs folder."""
        if self.nodes.rank == 0:
            raise RunConfigError("node 0 starts runs; it joins none")
        joined = self.runs.get(run_id)
        if joined is not None and joined.process is not None and joined.process.poll() is None:
            return joined  # a repeated request: this node's ranks are already at the rendezvous
        folder = self.root / run_id
        if "/" in run_id or ".." in run_id or not (folder / "config.json").is_file():
            raise RunNotFound(run_id)
        config = load_config(folder / "config.json", SFTConfig if kind == "sft" else RLConfig)
        try:
            ranks = resolve_ranks(config.engine.ranks)
        except RankError as exc:
            raise RunConfigError(str(exc)) from None
        process = self._launch(run_id, kind, folder, ranks, max_steps, None, folder / f"log.node{self.nodes.rank}.txt")
        run = Run(run_id, kind, folder, Path(config.output_dir), process, pid=process.pid)
        self.runs[run_id] = run
        return run

    def _launch(
        self,
        run_id: str,
        kind: str,
        folder: Path,
        ranks: int,
        max_steps: int | None,
        env: dict[str, str] | None,
        log: Path,
    ) -> subprocess.Popen:
        cmd = worker_argv(kind, folder / "config.json", ranks, max_steps, nodes=self.nodes, run_id=run_id)
        # Its own process group (a torchrun's ranks stop with it). Not tied to the API process's
        # life: requests run on pool threads that come and go, and a run is its folder's, so it
        # may outlive an API restart; run.json names it (pid and start time) for whoever stops it.
        return spawn(
            cmd,
            env={**os.environ, **worker_env(ranks, self.nodes), **(env or {})},
            log_path=log,
            group=0,
            die_with_parent=False,
            cwd=Path(__file__).resolve().parents[2],
        )

    def _join_peers(self, run_id: str, request: RunRequest) -> None:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        for rank, url in enumerate(self.peers, start=1):
            try:
                r = httpx.post(
                    f"{url.rstrip('/')}/runs/{run_id}/join",
                    headers=headers,
                    timeout=30,
                    json=JoinRequest(kind=request.kind, max_steps=request.max_steps).model_dump(),
                )
            except httpx.HTTPError as exc:
                raise JoinError(f"learner node {rank} ({url}) did not answer: {exc}") from None
            if r.status_code != 201:
                raise JoinError(f"learner node {rank} ({url}) did not join: {r.status_code} {r.text[:300]}")

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
            run = Run(run_id, meta["kind"], folder, output, pid=meta["pid"], created=meta.get("created", 0.0))
            run.gone = not alive(meta["pid"], meta.get("started"))
        return run

    def describe(self, run_id: str) -> dict[str, Any]:
        run = self.get(run_id)
        status = read_status(run.output)
        if status.get("updated", 0.0) < run.created:  # a resumed run's folder: the status is its predecessor's
            status = {}
        state = status.get("state", "starting")
        exit_code = run.process.poll() if run.process else None
        if (exit_code is not None or run.gone) and state in ("starting", "running"):
            # The process ended without recording an end state, or (a run of an earlier learner process,
            # e.g. before its pod restarted) is no longer there: its checkpoints stay for a resumed run.
            state = "failed"
        metrics = read_metrics(run.output)
        out = {
            "id": run.id,
            "kind": run.kind,
            "state": state,
            "step": status.get("step", 0),
            "version": status.get("version"),
            "folder": str(run.folder),
            "exit_code": exit_code,
            "metrics": metrics[-1] if metrics else {},
            "steps_logged": len(metrics),
        }
        if state == "failed":
            out["error"] = status.get("error") or (GONE if run.gone else _tail(run.folder / "log.txt"))
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
        elif run.process is None and not run.gone:
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
