"""Analyses of scored trajectories (the reward scorer's output: `ScoredTrajectory` JSON lines,
e.g. a dump of the scored stream of an RL step), where each query has G samples.

Every sample is one record, so the metrics are over trajectories; the group signals (reward
variance within each group, share of zero-variance groups that GRPO learns nothing from) are
what this view adds to a single-sample eval run.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.common.schemas import ScoredTrajectory
from services.evaluation.records import QueryRecord, TrajectorySummary
from services.evaluation.runfolder import RunFolder


class ScoredFileError(ValueError):
    pass


def read_scored(path: str | Path) -> list[tuple[QueryRecord, ScoredTrajectory]]:
    path = Path(path)
    if not path.is_file():
        raise ScoredFileError(f"{path}: no such file")
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            st = ScoredTrajectory.model_validate_json(line)
        except ValueError as exc:
            raise ScoredFileError(f"{path}:{lineno}: not a scored trajectory: {str(exc).splitlines()[0]}") from None
        if st.query is None:
            raise ScoredFileError(f"{path}:{lineno}: the trajectory carries no query, so it cannot be analysed")
        qid = f"{st.task_id}#{st.sample_index}"
        plan = [d.model_dump() for d in st.plan.days] if st.plan is not None else None
        record = QueryRecord(
            index=len(out),
            query_id=qid,
            query=st.query,
            plan=plan,
            plan_text=st.answer,
            delivered=plan is not None,
            score=st.score,
            trajectory=TrajectorySummary.of(st, st.reward),
        )
        out.append((record, st))
    if not out:
        raise ScoredFileError(f"{path}: no scored trajectories")
    return out


def scored_to_folder(path: str | Path, out: str | Path) -> RunFolder:
    """A run folder (scores + trajectories) from a scored-trajectories file, ready to finalise."""
    items = read_scored(path)
    folder = RunFolder(out)
    folder.path.mkdir(parents=True, exist_ok=True)
    modes = {st.score.mode for _, st in items}
    if len(modes) != 1:
        raise ScoredFileError(f"{path}: trajectories scored in several modes ({', '.join(sorted(modes))})")
    manifest = {
        "version": 1,
        "config_hash": "",
        "scoring": {"evaluator": {"mode": modes.pop()}, "source": {"kind": "scored", "path": str(path)}},
    }
    folder.manifest_path.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    with open(folder.scores_path, "w", encoding="utf-8") as fh:
        for record, _ in items:
            fh.write(record.model_dump_json() + "\n")
    with open(folder.trajectories_path, "w", encoding="utf-8") as fh:
        for record, st in items:
            fh.write(json.dumps({"query_id": record.query_id, "trajectory": st.model_dump(mode="json")}) + "\n")
    return folder
