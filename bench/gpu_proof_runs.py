"""Compare recorded H100 proof runs: wall time per RL step, synchronous baseline against asynchronous.

    python bench/gpu_proof_runs.py 8 9 --out bench/results/gpu_proof_runs89.png

Reads bench/results/gpu_proof_run{N}_rl_{sync,async}.jsonl (the learner's per-step metrics that
`bench/gpu_proof_device.sh poll` brings back), prints each run's seconds per step and speed-up, and
plots the wall time of every step. Seconds per step are taken between the first and the last
step's end, so the fleet's start (model loads), which both modes pay alike, is left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu_proof import step_summary  # noqa: E402 - after the path, as a script needs it

RESULTS = Path(__file__).resolve().parent / "results"


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise SystemExit(f"no such file: {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def seconds_per_step(steps: list[dict[str, Any]]) -> float | None:
    """The proof report's own figure (gpu_proof.step_summary), so both print the same speed-up."""
    return step_summary({"steps": steps})["per_step_s"]


def step_walls(steps: list[dict[str, Any]]) -> list[float]:
    """Wall time of each step after the first: end to end of consecutive steps."""
    return [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]


def summarize(run: str) -> dict[str, Any]:
    sync = read_steps(RESULTS / f"gpu_proof_run{run}_rl_sync.jsonl")
    asyn = read_steps(RESULTS / f"gpu_proof_run{run}_rl_async.jsonl")
    s, a = seconds_per_step(sync), seconds_per_step(asyn)
    return {"run": run, "sync_steps": len(sync), "async_steps": len(asyn), "sync_s": s, "async_s": a,
            "speedup": s / a if s and a else None, "sync": sync, "async": asyn}


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, r in zip(axes[0], runs):
        for mode, style in (("sync", "o-"), ("async", "s-")):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run numbers, as in gpu_proof_run{N}_rl_sync.jsonl")
    ap.add_argument("--out", type=Path, default=None, help="PNG of the per-step wall times")
    args = ap.parse_args()
    runs = [summarize(r) for r in args.runs]
    for r in runs:
        print(f"run {r['run']}: sync {r['sync_s']:.1f} s/step ({r['sync_steps']} steps), "
              f"async {r['async_s']:.1f} s/step ({r['async_steps']} steps), speed-up {r['speedup']:.2f}×")
    if args.out:
        plot(runs, args.out)
        print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
