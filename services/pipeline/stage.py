"""A stage of `star train`: its record in the run folder and the processes it runs.

The RL stage, the report and the stage sequence in `train` all build on these, so they live apart
from each of them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from services.pipeline.config import PipelineConfig
from services.pipeline.placement import Placement, WeightSyncChoice

console = Console(stderr=True)


class StageFailed(RuntimeError):
    """A stage's process failed; the message names the log to read."""


@dataclass
class Run:
    config: PipelineConfig
    folder: Path
    world_url: str = ""
    base_model: str = ""
    env: dict[str, str] = field(default_factory=dict)
    placement: Placement | None = None
    weight_sync: WeightSyncChoice | None = None  # None: files (no RL stage, or no placement)

    @property
    def nccl(self) -> bool:
        """The RL stage's learner broadcasts weights into its engines over NCCL."""
        return self.weight_sync is not None and self.weight_sync.method == "nccl"

    @property
    def learner_ranks(self) -> int:
        """The learner's ranks on this machine: the placement's (colocated: every GPU), else the recipe's."""
        return self.placement.learner_ranks if self.placement else self.config.deployment.learner_ranks or 1

    @property
    def colocated(self) -> bool:
        """The RL stage's engines share the learner's GPUs in time (asleep while it trains; weights by IPC)."""
        return self.weight_sync is not None and self.weight_sync.method == "ipc"

    @property
    def serves_http(self) -> bool:
        """Rollout workers serve their HTTP API for the learner (NCCL groups, or colocation's sleep and wake)."""
        return self.nccl or self.colocated

    def learner_launch(self, kind: str, config: Path) -> tuple[list[str], dict[str, str]]:
        """The command and environment (beside `env`) that start this run's learner for `kind` on its
        placement: one process, or its ranks under torchrun, on the learner's devices."""
        from services.learner.launch import worker_argv, worker_env

        ranks = self.placement.learner_ranks if self.placement else 1
        devices = self.placement.learner_env() if self.placement else {}
        return worker_argv(kind, config, ranks), {**devices, **worker_env(ranks)}

    @property
    def stages_file(self) -> Path:
        return self.folder / "stages.json"

    def stage_records(self) -> dict[str, Any]:
        return json.loads(self.stages_file.read_text()) if self.stages_file.is_file() else {}

    def record(self, stage: str, **fields: Any) -> None:
        records = self.stage_records()
        records[stage] = {**records.get(stage, {}), **fields}
        self.stages_file.write_text(json.dumps(records, indent=2, default=str))

    def done(self, stage: str) -> dict[str, Any] | None:
        rec = self.stage_records().get(stage)
        return rec if rec and rec.get("state") == "done" else None

    def log(self, name: str) -> Path:
        path = self.folder / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path


def star_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception|Interrupt)\b:?")
# torchrun's own report of a failed rank: it names the rank, not the cause
_LAUNCHER_LINE = re.compile(r"ChildFailedError|torch\.distributed\.elastic|^\s*raise ")


def log_tail(log: Path, lines: int, max_bytes: int = 256 * 1024) -> list[str]:
    """The last `lines` non-empty lines of a process's log (reading at most its last `max_bytes`)."""
    if not log.is_file():
        return []
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
        text = f.read().decode(errors="replace")
    return [line for line in text.splitlines() if line.strip()][-lines:]


def failure_cause(log: Path) -> str | None:
    """The last line of a failed process's log that names an error (the exception a rank raised, not
    the launcher's summary of it), or None where there is none."""
    for line in reversed(log_tail(log, 400)):
        if _ERROR_LINE.search(line) and not _LAUNCHER_LINE.search(line):
            return line.strip()[:400]
    return None


def check_exit(run: Run, name: str, rc: int) -> None:
    """A stage process that failed, as a StageFailed naming its log and last lines."""
    if rc != 0:
        log = run.log(name)
        raise StageFailed(f"{name} exited with {rc}; see {log}\n  " + "\n  ".join(log_tail(log, 5)))


def run_process(
    run: Run, name: str, argv: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
) -> None:
    """Run one stage process to completion, its output in logs/<name>.log."""
    log = run.log(name)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, env={**os.environ, **run.env, **(env or {})}, stdout=out, stderr=out, stdin=subprocess.DEVNULL
        )
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise StageFailed(f"{name} did not finish within {timeout:.0f}s; see {log}") from None
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            raise
    check_exit(run, name, rc)


def eval_argv(
    run: Run, model: str | None, split: str | Path, out: Path, limit: int | None, *, memory_share: float | None = None
) -> list[str]:
    """`star eval` of one model on one split into `out`, with the recipe's evaluation settings;
    `memory_share`: the share of its GPUs a vLLM engine beside others may take."""
    e = run.config.eval
    # `model` None: the weights an external fleet's rollout servers hold, on their engines
    source = ["--model", model, "--engine", run.config.services.engine] if model else ["--fleet"]
    argv = star_argv(
        "eval",
        *source,
        "--split",
        str(split),
        "--mode",
        e.mode,
        "--out",
        str(out),
        "--db",
        run.world_url,
        "--temperature",
        str(e.sampling.temperature),
        "--top-p",
        str(e.sampling.top_p),
        "--max-context",
        str(e.sampling.max_context_tokens),
        "--max-tokens",
        str(e.sampling.max_tokens_per_turn),
        "--max-tool-calls",
        str(e.sampling.max_tool_calls),
        "--concurrency",
        str(e.concurrency),
    )
    if model and run.config.services.engine == "vllm":
        vllm = run.config.services.vllm
        if memory_share is not None:
            # beside the fleet: its KV cache sized from the share (a measurement would count the others')
            vllm = vllm.model_copy(update={"gpu_memory_utilization": memory_share, "kv_cache_from_share": True})
        argv += ["--vllm-args", vllm.model_dump_json()]
    if e.sampling.summarize_at_limit:
        argv += ["--summarize-at-limit"]
    if limit:
        argv += ["-n", str(limit)]
    return argv
