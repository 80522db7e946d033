"""Compare recorded H100 proof runs: wall time per RL step, synchronous baseline against
asynchronous, and how each run learned.

    python bench/gpu_proof_runs.py 8 9 --out bench/results/runs/gpu_proof/compare/gpu_proof_runs89.png
    python bench/gpu_proof_runs.py 15 17 18 19 --learning bench/results/runs/gpu_proof/compare/gpu_proof_learning1519.png

Reads bench/results/runs/gpu_proof/run{N}/gpu_proof_rl_{sync,async}.jsonl (the learner's per-step metrics that
`bench/gpu_proof_device.sh poll` brings back; a run without a synchronous baseline has no sync
file), from the runs' archive where the run's folder is not unpacked, prints each
run's seconds per step and speed-up, and plots the wall time of every step.
Seconds per step are taken between the first and the last step's end, so the fleet's start (model
loads), which both modes pay alike, is left out. `--learning` plots the asynchronous run's
training success, grad norm, entropy and, where run{N}/gpu_proof_rl_samples.jsonl.gz was kept, the
share of stated preferences the policy's first thoughts restate, step by step.

The archive (bench/results/runs/gpu_proof.tar.xz) is kept in the repository's history, not in the
working tree, which every GPU device call carries: it is read from the commit before the last one that
removed it, or from the tree where `--restore-archive` put it back (to add a run).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu_proof import restated_by_step, step_summary  # noqa: E402 - after the path, as a script needs it
from services.common.files import iter_jsonl  # noqa: E402

RUNS = Path(__file__).resolve().parent / "results" / "runs" / "gpu_proof"  # one folder per run, as `poll` wrote it
ARCHIVE = RUNS.parent / "gpu_proof.tar.xz"  # the runs' files but their notes and reports, under gpu_proof/
REPO = RUNS.parents[3]
ARCHIVE_PATH = ARCHIVE.relative_to(REPO).as_posix()  # as git names it


def _git(*args: str) -> bytes:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def archive_from_history() -> bytes:
    """The newest archive in history: the one in the tree before the last commit that removed it."""
    removed = _git("log", "-1", "--format=%H", "--diff-filter=D", "--", ARCHIVE_PATH).decode().strip()
    if not removed:
        raise SystemExit(
            f"{ARCHIVE_PATH} is neither in the tree nor removed in this clone's history (a shallow clone?)"
        )
    return _git("show", f"{removed}^:{ARCHIVE_PATH}")


@functools.cache
def archive() -> Path:
    """The runs' archive: in the tree where it was restored, else a temporary copy from history
    (taken once per process, however many runs are read)."""
    if ARCHIVE.is_file():
        return ARCHIVE
    out = Path(tempfile.mkdtemp(prefix="gpu_proof_archive-")) / ARCHIVE.name
    atexit.register(shutil.rmtree, out.parent, True)
    out.write_bytes(archive_from_history())
    return out


def restore_archive() -> Path:
    """Put the archive back into the tree (to add a run: pack it, commit, then `git rm` it again)."""
    if not ARCHIVE.is_file():
        ARCHIVE.write_bytes(archive_from_history())
    return ARCHIVE


def run_folder(run: str) -> Path:
    """Run N's files: its folder when unpacked there, else a temporary copy taken from the archive."""
    folder = RUNS / f"run{run}"
    if (folder / "gpu_proof_rl_async.jsonl").is_file():
        return folder
    prefix = f"gpu_proof/run{run}/"
    out = Path(tempfile.mkdtemp(prefix=f"gpu_proof_run{run}-"))
    atexit.register(shutil.rmtree, out, True)
    with tarfile.open(archive()) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(out, members=members, filter="data")
    return out


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise SystemExit(f"no such file: {path}")
    return [step for _, step in iter_jsonl(path, SystemExit)]


def seconds_per_step(steps: list[dict[str, Any]]) -> float | None:
    """The proof report's own figure (gpu_proof.step_summary), so both print the same speed-up."""
    return step_summary({"steps": steps})["per_step_s"]


def step_walls(steps: list[dict[str, Any]]) -> list[float]:
    """Wall time of each step after the first: end to end of consecutive steps."""
    return [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]


def summarize(run: str) -> dict[str, Any]:
    folder = run_folder(run)
    sync_file = folder / "gpu_proof_rl_sync.jsonl"
    sync = read_steps(sync_file) if sync_file.is_file() else []  # runs that skipped the baseline
    asyn = read_steps(folder / "gpu_proof_rl_async.jsonl")
    s, a = seconds_per_step(sync), seconds_per_step(asyn)
    return {
        "run": run,
        "sync_steps": len(sync),
        "async_steps": len(asyn),
        "sync_s": s,
        "async_s": a,
        "speedup": s / a if s and a else None,
        "sync": sync,
        "async": asyn,
        "restated": restated_by_step(folder / "gpu_proof_rl_samples.jsonl.gz"),
    }


def describe(r: dict[str, Any]) -> str:
    def per_step(mode: str) -> str:
        sec = r[f"{mode}_s"]
        return f"{mode} {sec:.1f} s/step ({r[f'{mode}_steps']} steps)" if sec else f"{mode}: none"

    speedup = f"speed-up {r['speedup']:.2f}×" if r["speedup"] else "no speed-up (one mode only)"
    return f"run {r['run']}: {per_step('sync')}, {per_step('async')}, {speedup}"


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, r in zip(axes[0], runs):
        for mode, style in (("sync", "o-"), ("async", "s-")):
            if not r[f"{mode}_s"]:
                continue
            walls = step_walls(r[mode])
            ax.plot(range(2, len(walls) + 2), walls, style, label=f"{mode}: {r[f'{mode}_s']:.1f} s/step")
        ax.set_title(f"run {r['run']}: speed-up {r['speedup']:.2f}×" if r["speedup"] else f"run {r['run']}")
        ax.set_xlabel("RL step")
        ax.set_ylabel("wall time of the step (s, log)")
        ax.set_yscale("log")  # a 600-s stall must not flatten the rest
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


LEARNING_PANELS = (  # (title, per-step metric or "restated", log scale)
    ("training success (batch)", "success_rate", False),
    ("grad norm before clipping", "grad_norm", True),
    ("entropy of sampled tokens", "entropy", False),
    ("stated preferences restated in the first thought", "restated", False),
)


def plot_learning(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (title, key, log_scale) in zip(axes.flat, LEARNING_PANELS):
        for colour, r in enumerate(runs):  # one colour per run in every panel, though some lack samples
            values = r["restated"] if key == "restated" else [s.get(key) for s in r["async"]]
            points = [(i, v) for i, v in enumerate(values, start=1) if v is not None]
            if points:
                ax.plot(*zip(*points), "o-", ms=3, color=f"C{colour}", label=f"run {r['run']}")
        ax.set_title(title)
        ax.set_xlabel("RL batch (skipped ones count)")
        if log_scale:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="run numbers, as in bench/results/runs/gpu_proof/run{N}/")
    ap.add_argument(
        "--restore-archive",
        action="store_true",
        help=f"write the runs' archive from history back to {ARCHIVE_PATH} and stop",
    )
    ap.add_argument("--out", type=Path, default=None, help="PNG of the per-step wall times")
    ap.add_argument(
        "--learning",
        type=Path,
        default=None,
        help="PNG of the per-step training success, grad norm, entropy and restated preferences",
    )
    args = ap.parse_args()
    if args.restore_archive:
        print(f"restored: {restore_archive()}")
        return
    if not args.runs:
        ap.error("give run numbers, or --restore-archive")
    runs = [summarize(r) for r in args.runs]
    for r in runs:
        print(describe(r))
    if args.out:
        plot(runs, args.out)
        print(f"plot: {args.out}")
    if args.learning:
        plot_learning(runs, args.learning)
        print(f"plot: {args.learning}")


if __name__ == "__main__":
    main()
