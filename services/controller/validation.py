"""Validation beside the RL fleet: every `rl.val_every` versions, `star eval` on the validation queries
as a managed process, and the best version kept."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.supervisor import Child, spawn, stop_process
from services.pipeline import stage
from services.pipeline.stage import Run, StageFailed, check_exit, console


class Managed(Child):
    """A process of the stage outside the fleet's supervisor (a validation's `star eval`), started
    and stopped the same way: output to its log, dies with the controller."""

    def start(self) -> Managed:
        self.proc = spawn(self.argv, env={**os.environ, **self.env}, log_path=self.log)
        self.started_at = time.monotonic()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        stop_process(self.proc, timeout)


@dataclass
class Validation:
    """Every `every` versions: evaluate that version on the validation queries, keep the best. The
    starting model is validated too (version 0), as the baseline of the curve.

    A due version is hard-linked into the run folder at once, so the learner pruning old versions
    cannot pull it away, and the best one survives the run. Its `star eval` runs beside the fleet as
    a managed process on the devices the placement gives validations, one at a time (later due
    versions wait their turn), so that the controller keeps publishing and the fleet never idles
    while a version is evaluated. With `after_fleet` (a colocated placement with no room for a
    validation's engine beside the fleet), the due versions queue until `wait()`, which the stage calls
    once the fleet has given its GPUs back. With `keep="best"`, a validated version's copy is removed
    once another version is better, so the run folder holds the best weights and the queue's, not
    every validated version's; its entry stays in the history, marked pruned."""

    run: Run
    split: str
    every: int
    after_fleet: bool = False
    keep: str = "best"  # "best" | "all": rl.keep_validated
    history: list[dict[str, Any]] = field(default_factory=list)
    waiting: list[tuple[int, str]] = field(default_factory=list)  # (version, model folder)
    running: tuple[int, str, Managed] | None = None

    def __post_init__(self) -> None:
        # A restarted controller keeps what the one before it validated, so the best-checkpoint
        # pick covers the whole run, not just the versions since the restart.
        if self.run is None:  # no run folder: nothing was kept
            return
        path = self.history_path
        if path.is_file():
            try:
                kept = json.loads(path.read_text())
            except ValueError:
                kept = []
            self.history = [
                h
                for h in kept
                if isinstance(h, dict)
                and "version" in h
                and "success" in h
                and (h.get("pruned") or Path(h.get("model", "")).exists())
            ]

    @property
    def history_path(self) -> Path:
        return self.run.folder / "validation" / "history.json"

    def seen(self, version: int) -> bool:
        """Validated, under way or queued."""
        return (
            any(h["version"] == version for h in self.history)
            or any(v == version for v, _ in self.waiting)
            or (self.running is not None and self.running[0] == version)
        )

    def due(self, version: int) -> bool:
        return self.every > 0 and version > 0 and version % self.every == 0 and not self.seen(version)

    def folder(self, version: int) -> Path:
        return self.run.folder / "validation" / f"v{version}"

    def submit(self, version: int, uri: str, keep: bool = True) -> None:
        """Queue version's evaluation (started at once if none is running). With `keep`, its weights
        are hard-linked (copied across filesystems) into the run folder first; without, they are
        evaluated where they are (the starting model, which nothing prunes)."""
        import shutil

        model = self.folder(version) / "model"
        if keep and not model.exists():
            shutil.copytree(uri, model, copy_function=_link_or_copy)
        self.waiting.append((version, str(model) if keep else uri))
        self._start_next()

    def poll(self) -> list[dict[str, Any]]:
        """The validations that finished since the last call (a failed one raises StageFailed)."""
        done: list[dict[str, Any]] = []
        if self.running is not None and self.running[2].exited() is not None:
            done.append(self._finish())
            self._start_next()
        return done

    def wait(self) -> list[dict[str, Any]]:
        """Every queued validation, run to its end (the fleet has ended: the queue may start)."""
        self.after_fleet = False
        self._start_next()
        done: list[dict[str, Any]] = []
        while self.running is not None:
            self.running[2].proc.wait()
            done += self.poll()
        return done

    def stop(self) -> None:
        """Abandon the validation under way and the queued ones (the stage is failing or interrupted)."""
        if self.running is not None:
            self.running[2].stop()
            self.running = None
        self.waiting.clear()

    def best(self) -> dict[str, Any] | None:
        """The best RL version (v0, the starting model, is the baseline, not a candidate); ties go to the
        later version: it has trained on more data."""
        trained = [h for h in self.history if h["version"] > 0 and not h.get("pruned")]
        return max(trained, key=lambda h: (h["success"], h["version"])) if trained else None

    def _name(self, version: int) -> str:
        return f"validate-v{version}"

    def _start_next(self) -> None:
        if self.running is not None or not self.waiting or self.after_fleet:
            return
        version, model = self.waiting.pop(0)
        share = self.run.placement.validation_memory_share if self.run.placement else None
        argv = stage.eval_argv(
            self.run, model, self.split, self.folder(version) / "eval", self.run.config.eval.limit, memory_share=share
        )
        name = self._name(version)
        devices = self.run.placement.validation_env() if self.run.placement else {}
        self.running = (version, model, Managed(name, argv, {**self.run.env, **devices}, self.run.log(name)).start())

    def _finish(self) -> dict[str, Any]:
        from services.evaluation.runfolder import RunFolder

        version, model, process = self.running  # type: ignore[misc]
        self.running = None
        name = self._name(version)
        check_exit(self.run, name, process.exited())
        out = RunFolder(self.folder(version) / "eval")
        metrics = out.metrics() or {}
        if metrics.get("final_pass_rate") is None:
            # Not 0: a success read from the wrong key as 0 % would "pick" the last version every time.
            raise StageFailed(f"{name} exited cleanly but left no success in {out.metrics_path}")
        entry = {"version": version, "model": model, "success": metrics["final_pass_rate"], "metrics": metrics}
        self.history.append(entry)
        if self.keep == "best":
            self._prune_all_but_best()
        self.history_path.write_text(json.dumps(self.history, indent=2))
        return entry

    def _prune_all_but_best(self) -> None:
        """Remove the copies of validated versions that another version beats; the starting model,
        evaluated where it lies, is never ours to remove."""
        import shutil

        best = self.best()
        for h in self.history:
            ours = self.folder(h["version"]) / "model"
            if h is best or h.get("pruned") or Path(h["model"]) != ours:
                continue
            shutil.rmtree(ours, ignore_errors=True)
            h["pruned"] = True


def print_validations(entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        console.print(f"validation v{entry['version']}: success {entry['success']:.1f} %")  # star eval's percent


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        import shutil

        shutil.copy2(src, dst)
