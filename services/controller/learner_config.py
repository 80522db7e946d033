"""The learner's RLConfig for a run: the recipe's RL settings, where its weights go and how they travel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.redis import free_port
from services.common.settings import get_settings
from services.common.streams import StreamNames
from services.pipeline.stage import Run, StageFailed


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
    if run.nccl and external:  # rank 0 announces its address to the fleet's servers (services.weights.nccl)
        sync = {
            "weight_sync": "nccl",
            "nccl_master": "auto",
            "files_every": r.val_every or 10,
            "nccl_timeout_s": run.config.deployment.nccl_timeout_s,
        }
    if run.colocated:
        sync = colocated_sync(run, servers or [])
    cfg = RLConfig(
        **r.learner_fields(),
        model=model,
        output_dir=str(run.folder / "rl"),
        total_steps=total_steps,
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
