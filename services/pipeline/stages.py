"""The synth, SFT and eval stages of `star train`: each runs as its own process through the same
entry points people use (`star synth …`, the learner worker, `star eval`), or, with an external fleet,
its model work on the fleet's learner and rollout servers. The controller runs them in order
(services/controller/train.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.settings import get_settings
from services.pipeline.config import EvalSpec
from services.pipeline.external import FleetAddress, fleet_weights, train_on_learner
from services.pipeline.stage import Run, StageFailed, console, eval_argv, run_process, star_argv


def stage_synth(run: Run) -> dict[str, Any]:
    s = run.config.synth
    data = run.folder / "data"
    total = s.sft_queries + s.rl_queries + s.val_queries + s.heldout_queries
    run_process(
        run,
        "synth-queries",
        star_argv(
            "synth",
            "queries",
            "--n",
            str(total),
            "--mix",
            ":".join(map(str, s.mix)),
            "--splits",
            f"{s.sft_queries}:{s.rl_queries}:{s.val_queries}:{s.heldout_queries}",
            "--out",
            str(data),
            "--seed",
            str(s.seed),
            "--days",
            ",".join(map(str, s.days)),
            "--flight-share",
            str(s.flight_share),
            "--db",
            run.world_url,
            *(["--rl-mix", ":".join(map(str, s.rl_mix))] if s.rl_mix else []),
        ),
    )
    outputs = {
        "queries": str(data),
        "sft_queries": str(data / "sft.jsonl"),
        "rl_queries": str(data / "rl.jsonl"),
        "val_queries": str(data / "validation.jsonl"),
    }
    if s.heldout_queries:
        outputs["heldout_queries"] = str(data / "heldout.jsonl")
    if s.sft_queries:
        run_process(
            run,
            "synth-teacher",
            star_argv(
                "synth",
                "teacher",
                "--queries",
                str(data / "sft.jsonl"),
                "--teacher",
                s.teacher,
                "--out",
                str(data / "teacher"),
                "--seed",
                str(s.seed),
                "--db",
                run.world_url,
            ),
        )
        outputs["sft_data"] = str(data / "teacher" / "sft.jsonl")
    return outputs


def stage_sft(run: Run, synth: dict[str, Any]) -> dict[str, Any]:
    from services.learner.config import SFTConfig
    from services.learner.trainer import read_status

    s = run.config.sft
    out = run.folder / "sft"
    cfg = SFTConfig(
        model=run.base_model,
        data=synth["sft_data"],
        output_dir=str(out),
        lr=s.lr,
        epochs=s.epochs,
        batch_size=s.batch_size,
        warmup_ratio=s.warmup_ratio,
        max_seq_len=s.max_seq_len,
        max_steps=s.max_steps,
        chat=run.config.services.chat,
        engine=run.config.learner.engine(run.config.services.zero_stage, run.config.seed, ranks=run.learner_ranks),
    )
    path = run.folder / "sft.json"
    path.write_text(cfg.model_dump_json(indent=2))
    if run.config.deployment.fleet == "external":  # on the fleet's learner, where its accelerators are
        train_on_learner(FleetAddress.from_settings(get_settings()), "sft", json.loads(path.read_text()))
    else:
        argv, env = run.learner_launch("sft", path)
        run_process(run, "sft", argv, env=env)
    status = read_status(out)
    if not status.get("export"):
        raise StageFailed(f"SFT finished without an exported model; see {out / 'status.json'}")
    return {"model": status["export"], "steps": status.get("step"), "metrics": str(out / "metrics.jsonl")}


def evaluate_model(
    run: Run, model: str | None, split: str | Path, out: Path, name: str, limit: int | None
) -> dict[str, Any]:
    """`star eval` of one model on one split into `out`; returns its metrics.json (or {})."""
    from services.evaluation.runfolder import RunFolder

    run_process(run, name, eval_argv(run, model, split, out, limit))
    return RunFolder(out).analysis() or {}


def eval_split(e: EvalSpec, synth: dict[str, Any] | None) -> str | None:
    """The queries the eval stage scores: eval.split, else the synthesized held-out queries (validation
    may have picked the RL checkpoint), else the validation queries."""
    return e.split or (synth or {}).get("heldout_queries") or (synth or {}).get("val_queries")


def stage_eval(run: Run, model: str, synth: dict[str, Any] | None, rl: dict[str, Any] | None = None) -> dict[str, Any]:
    e = run.config.eval
    split = eval_split(e, synth)
    if not split:
        raise StageFailed("eval needs eval.split or a synth stage that wrote held-out or validation queries")
    if (rl or {}).get("best_success") is not None and split == (synth or {}).get("val_queries"):
        # the load-time check reads the recipe; a folder synthesized without held-out queries gets here
        raise StageFailed(
            f"the RL checkpoint was picked on {split}, and eval would report on the same queries: "
            "set synth.heldout_queries and run the synth stage again, or set eval.split"
        )
    out = run.folder / "eval"
    address = FleetAddress.from_settings(get_settings(), wait_s=run.config.controller.fleet_wait_s)
    # on the fleet's engines, which hold RL's last version: unless validation picked another one
    picked = (rl or {}).get("best_success") is not None
    if run.config.deployment.fleet == "external" and address.rollout_urls and not picked:
        held = fleet_weights(address)
        console.print(f"eval on the fleet's rollout servers, which hold {held}")
        result = evaluate_model(run, None, split, out, "eval", e.limit)
        return {"folder": str(out), "model": held, "metrics": result or None}
    if run.config.deployment.fleet == "external":
        why = (
            "validation picked a version the fleet no longer holds"
            if picked
            else "the fleet names no rollout server (STAR_ROLLOUT_URLS)"
        )
        console.print(f"[yellow]{why}: eval runs here[/]")
    result = evaluate_model(run, model, split, out, "eval", e.limit)
    return {"folder": str(out), "model": model, "metrics": result or None}
