"""The run folder of one evaluation, and its manifest.

    RUN/
      manifest.json       what was evaluated and how; `config_hash` pins the scoring setup
      scores.jsonl        one QueryRecord per finished query, appended as they finish
      trajectories.jsonl  {query_id, trajectory} per query when an agent ran
      predictions.jsonl   the official submission file ({idx, query, plan}, dataset order)
      metrics.json        Table-1 metrics and every analysis
      report.md           the short report
      plots/*.png

Resumable by design: a rerun reads scores.jsonl and skips finished query ids. It refuses to
resume when the scoring setup (evaluator mode and code, formatter, split, world, prediction
source) hashes differently from the run's manifest: metrics of one run never mix two setups.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from services.evaluation.records import QueryRecord, read_records

MANIFEST_VERSION = 1


class RunMismatch(RuntimeError):
    """The folder holds a run made with another scoring setup."""


def config_hash(scoring: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(scoring, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def evaluator_code_sha256() -> str:
    """Hash of the evaluator's source files: a change to any check changes every run's hash."""
    import services.reward.evaluator as package

    digest = hashlib.sha256()
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class RunFolder:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    manifest_path = property(lambda self: self.path / "manifest.json")
    scores_path = property(lambda self: self.path / "scores.jsonl")
    trajectories_path = property(lambda self: self.path / "trajectories.jsonl")
    predictions_path = property(lambda self: self.path / "predictions.jsonl")
    metrics_path = property(lambda self: self.path / "metrics.json")
    report_path = property(lambda self: self.path / "report.md")
    plots_dir = property(lambda self: self.path / "plots")

    def manifest(self) -> dict[str, Any] | None:
        if not self.manifest_path.is_file():
            return None
        return json.loads(self.manifest_path.read_text(encoding="utf-8"))

    def open(self, scoring: dict[str, Any], extra: dict[str, Any] | None = None) -> list[QueryRecord]:
        """Start or resume: write the manifest (or check it) and return the finished records."""
        self.path.mkdir(parents=True, exist_ok=True)
        digest = config_hash(scoring)
        old = self.manifest()
        if old is not None and old.get("config_hash") != digest:
            changed = sorted(
                k for k in set(scoring) | set(old.get("scoring", {})) if scoring.get(k) != old.get("scoring", {}).get(k)
            )
            raise RunMismatch(
                f"{self.path} holds a run with another scoring setup (config hash "
                f"{old.get('config_hash', '?')[:12]} ≠ {digest[:12]}; changed: {', '.join(changed)}); "
                "use a new --out folder"
            )
        if old is None:
            manifest = {"version": MANIFEST_VERSION, "config_hash": digest, "scoring": scoring, **(extra or {})}
            self.manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
        records = read_records(self.scores_path)
        self._drop_torn_tail(len(records))
        return records

    def _drop_torn_tail(self, kept: int) -> None:
        """Rewrite scores.jsonl without a half-written last line, so appends start clean."""
        if not self.scores_path.is_file():
            return
        lines = [line for line in self.scores_path.read_text(encoding="utf-8").splitlines() if line.strip()]
        raw = self.scores_path.read_bytes()
        if len(lines) != kept or (raw and not raw.endswith(b"\n")):
            self.scores_path.write_text("".join(line + "\n" for line in lines[:kept]), encoding="utf-8")

    def analysis(self) -> dict[str, Any] | None:
        """metrics.json as `finalize` wrote it (the Table-1 figures under "metrics", then every analysis);
        None before that."""
        if not self.metrics_path.is_file():
            return None
        return json.loads(self.metrics_path.read_text(encoding="utf-8"))

    def metrics(self) -> dict[str, Any] | None:
        """The Table-1 figures (percent), None before `finalize`."""
        return (self.analysis() or {}).get("metrics")

    def records(self) -> list[QueryRecord]:
        return sorted(read_records(self.scores_path), key=lambda r: r.index)

    def trajectories(self) -> dict[str, dict[str, Any]]:
        """query id → trajectory dict (the last one written wins)."""
        out: dict[str, dict[str, Any]] = {}
        if self.trajectories_path.is_file():
            for line in self.trajectories_path.read_text(encoding="utf-8").splitlines():
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn line of an interrupted run; the query was re-run
                out[str(item["query_id"])] = item["trajectory"]
        return out
