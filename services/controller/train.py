"""`star train CONFIG`: the STAR pipeline (synthesis → SFT → RL → eval) as configured.

Each stage runs as its own process through the same entry points people use (`star synth …`,
the learner worker, `star rollout worker`, `star reward worker`, `star eval`), so a stage here
behaves exactly like a stage run by hand, and the RL stage is the real distributed system: tasks,
trajectories and scores flow through Redis Streams between separate processes. The run folder
records which stages finished; running the same command again resumes after the last one.

    runs/<name>/
      config.yaml          the resolved recipe
      stages.json          per stage: state, outputs, seconds
      data/                queries (sft / rl / validation) and teacher trajectories
      sft/  rl/            learner run folders (metrics.jsonl, TensorBoard, checkpoints, exports)
      eval/                the evaluation run folder (metrics, report)
      logs/                one log per process
      report.md, plots/    learning curves
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from services.common.settings import get_settings
from services.common.supervisor import RunLock, SupervisorError
from services.controller.launcher import ensure_world
from services.controller.loop import stage_rl
from services.pipeline.config import STAGES, PipelineConfig, dump_config
from services.pipeline.external import (
    FleetAddress,
    check_reachable,
    engines_take,
    fleet_weight_states,
    fleet_world,
)
from services.pipeline.placement import PlacementError, external_weight_sync, placement_for_recipe, weight_sync
from services.pipeline.report import write_report
from services.pipeline.stage import Run, StageFailed, console
from services.pipeline.stages import stage_eval, stage_sft, stage_synth

# ---- preparation -------------------------------------------------------------------------------


def recipe_identity(config: PipelineConfig) -> PipelineConfig:
    """What must match for a run folder to be resumed: the recipe without which stages run
    (--stage), the RL stage's time budget, who runs its fleet (--fleet), how its weights travel
    and how long the controller waits on its processes, all of which may change between invocations."""
    deployment = config.deployment.model_copy(update={"fleet": "embedded", "weight_sync": "auto"})
    rl = config.rl.model_copy(update={"max_minutes": None})
    return config.model_copy(update={"stages": [], "rl": rl, "deployment": deployment, "controller": None})


def prepare(config: PipelineConfig, folder: Path) -> Run:
    folder.mkdir(parents=True, exist_ok=True)
    resolved = folder / "config.yaml"
    if resolved.is_file():
        from services.pipeline.config import load_pipeline_config

        if recipe_identity(load_pipeline_config(resolved)) != recipe_identity(config):
            raise StageFailed(f"{folder} holds a run of a different recipe; use another --run-dir or remove it")
    try:  # refused before anything is written or started
        placement = placement_for_recipe(config)
        local = "rl" in config.stages and config.deployment.fleet != "external"
        sync = weight_sync(config.deployment, config.services.engine, placement) if local else None
    except PlacementError as exc:
        raise StageFailed(f"{exc}") from None
    run = Run(config, folder, placement=placement, weight_sync=sync)
    if config.deployment.fleet == "external":  # the fleet's world and a model its engines load, or refused
        address = FleetAddress.from_settings(get_settings(), wait_s=config.controller.fleet_wait_s)
        check_reachable(address)
        run.world_url = get_settings().world_url
        world = fleet_world(address, config.world, config.seed, run.world_url)
        console.print(f"world: the fleet's, {world['source']}, hash {world['world_hash']}")
        (folder / "world.json").write_text(json.dumps(world, indent=1))  # which world the run trained on
        run.base_model = prepare_model(config)
        engines_take(address, run.base_model)
        if "rl" in config.stages:  # NCCL when the engine every rollout server reports running can receive
            try:
                run.weight_sync = external_weight_sync(config.deployment, fleet_weight_states(address))
            except PlacementError as exc:
                raise StageFailed(f"{exc}") from None
    else:
        run.world_url = prepare_world(config, folder)
        run.base_model = prepare_model(config)
    resolved.write_text(dump_config(config))  # once the recipe is taken: a refused one can be mended and rerun
    settings = get_settings()
    # DeepSpeed's accelerator defaults to CPU unless told: follow the hardware unless the caller chose
    run.env = {
        "STAR_HOME": str(settings.home),
        "STAR_DB_URL": run.world_url,
        "STAR_LOG_JSON": "false",
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", placement.accelerator),
    }
    console.print(placement.describe())
    return run


def prepare_world(config: PipelineConfig, folder: Path) -> str:
    from services.sandbox.world import World, build

    if config.world.db_url:
        return config.world.db_url
    if config.world.source == "official":
        url = get_settings().world_url
        ensure_world(url)
        return url
    url = f"sqlite:///{folder / 'world.sqlite'}"
    if World(url).problem() is not None:
        console.print(f"building a {config.world.synthetic_size} synthetic world")
        build.build_synthetic_world(url, size=config.world.synthetic_size, seed=config.seed)
    return url


def prepare_model(config: PipelineConfig) -> str:
    if config.model.path:
        if not (Path(config.model.path) / "config.json").is_file():
            raise StageFailed(f"model.path {config.model.path} is not an HF model folder (no config.json)")
        return config.model.path
    from services.models import tiny_qwen2

    t = config.model.tiny
    return str(
        tiny_qwen2(
            hidden=t.hidden, layers=t.layers, heads=t.heads, kv_heads=t.kv_heads, seed=t.seed, tokenizer=t.tokenizer
        )
    )


# ---- the stages in order -----------------------------------------------------------------------


def starting_model(base: str, outputs: dict[str, Any], stages: list[str]) -> str:
    """The model the first configured stage starts from: the last one the stages before it made
    in this run folder. (RL run on its own after SFT must not start from the base model: it would
    sample the untrained policy, whose trajectories break the protocol.)"""
    model = base
    for stage in STAGES:
        if stage in stages:
            break
        model = (outputs.get(stage) or {}).get("model", model)
    return model


def train(config: PipelineConfig, folder: Path) -> Run:
    """Run (or resume) every configured stage in order, holding the run folder's lock."""

    folder.mkdir(parents=True, exist_ok=True)
    try:
        lock = RunLock(folder).acquire()  # one controller per run folder
    except SupervisorError as exc:
        raise StageFailed(str(exc)) from None
    try:
        return _train(config, folder)
    finally:
        lock.release()


def check_fleet(config: PipelineConfig, folder: Path) -> None:
    """An external fleet that the RL stage will drive must answer before any stage starts."""
    if config.deployment.fleet == "external" and "rl" in config.stages and not Run(config, folder).done("rl"):
        check_reachable(FleetAddress.from_settings(get_settings(), wait_s=config.controller.fleet_wait_s))


def _train(config: PipelineConfig, folder: Path) -> Run:
    check_fleet(config, folder)
    run = prepare(config, folder)
    outputs: dict[str, Any] = {
        name: rec.get("outputs") for name, rec in run.stage_records().items() if rec.get("state") == "done"
    }
    model = starting_model(run.base_model, outputs, config.stages)
    from services.common.tracking import Trackers

    trackers = Trackers.open(folder, config.name, {"recipe": config.name, "stages": ",".join(config.stages)})
    try:
        _run_stages(run, config, outputs, model, trackers)
    finally:
        trackers.close()
    write_report(run)
    return run


def stage_metrics(stage: str, result: dict[str, Any]) -> dict[str, float]:
    """A stage's numbers for the experiment trackers: its outputs' scalars and, one level down, its
    metrics (the evaluation's pass rates), each under `<stage>/`."""
    out: dict[str, Any] = {}
    for key, value in result.items():
        if isinstance(value, dict):
            out.update({f"{stage}/{key}/{k}": v for k, v in value.items()})
        else:
            out[f"{stage}/{key}"] = value
    return out


def _run_stages(run: Run, config: PipelineConfig, outputs: dict[str, Any], model: str, trackers) -> None:
    for index, stage in enumerate(config.stages):
        done = run.done(stage)
        if done:
            console.print(f"[dim]{stage}: done earlier, skipped[/]")
            model = (done.get("outputs") or {}).get("model", model)
            continue
        console.rule(f"[bold]{stage}")
        t0 = time.monotonic()
        run.record(stage, state="running", started=time.time())
        try:
            if stage == "synth":
                result = stage_synth(run)
            elif stage == "sft":
                result = stage_sft(run, outputs.get("synth") or {})
                model = result["model"]
            elif stage == "rl":
                result = stage_rl(run, model, outputs.get("synth") or {})
                model = result.get("model", model)
            else:
                result = stage_eval(run, model, outputs.get("synth"), outputs.get("rl"))
        except BaseException as exc:
            run.record(stage, state="failed", error=f"{type(exc).__name__}: {exc}")
            raise
        outputs[stage] = result
        run.record(stage, state="done", outputs=result, seconds=round(time.monotonic() - t0, 1))
        trackers.log({**stage_metrics(stage, result), f"{stage}/seconds": time.monotonic() - t0}, index)
        console.print(f"{stage}: done in {time.monotonic() - t0:.0f} s")
