"""The learner process: one training run (SFT, or RL consuming the scored stream) per process.

`python -m services.learner.worker rl run.json` (or `sft`). DeepSpeed owns one process group per
process, so the API starts each run as its own process and talks to it through the run folder
(status.json, metrics.jsonl) and signals: SIGTERM stops it after the current step. Under
torchrun every rank runs this same entry point (services.learner.launch builds the command).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from services.common.logging import configure_logging
from services.common.settings import get_settings
from services.learner.config import RLConfig, SFTConfig, load_config


def die_with_launcher() -> None:
    """Under torchrun: end this rank when torchrun itself is killed (SIGKILL cannot be forwarded), so
    that no orphaned rank keeps its GPU and its place in a collective."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the call above
        os._exit(1)


def run_file(kind: str, config_path: Path, max_steps: int | None = None) -> dict:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    settings = get_settings()
    configure_logging("learner", settings.log_level, settings.log_json)
    from services.learner.trainer import RLTrainer, SFTTrainer, write_status

    if kind == "sft":
        cfg = load_config(config_path, SFTConfig)
        trainer = SFTTrainer(cfg, stop=stop)
        return trainer.run()
    if kind == "rl":
        cfg = load_config(config_path, RLConfig)
        try:
            trainer = RLTrainer(cfg, stop=stop)
        except Exception as exc:
            if os.environ.get("RANK", "0") == "0":
                write_status(Path(cfg.output_dir), state="failed", error=f"{type(exc).__name__}: {exc}")
            raise
        return trainer.run(max_steps=max_steps)
    raise ValueError(f"unknown run kind {kind!r} (sft | rl)")


def leave_process_group() -> None:
    """After a run that ended normally on every rank: the ranks leave their process group together. A rank
    that exits while a peer's gloo threads still talk to it aborts that peer ("terminate called without an
    active exception"), which torchrun then reports as a failed run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@record  # under torchrun: a failing rank's error and traceback reach torchrun's summary
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        print("usage: python -m services.learner.worker sft|rl CONFIG [MAX_STEPS]", file=sys.stderr)
        return 2
    die_with_launcher()
    result = run_file(argv[0], Path(argv[1]), int(argv[2]) if len(argv) == 3 else None)
    if result["state"] == "finished":  # every rank ran the same last step; a stopped or failed rank may not have
        leave_process_group()
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({k: v for k, v in result.items() if k != "metrics"}, default=str))
    return 0 if result["state"] in ("finished", "stopped") else 1


if __name__ == "__main__":
    sys.exit(main())
