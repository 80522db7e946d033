"""The run report: learning curves (PNG) and a markdown summary of every stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.files import iter_jsonl
from services.pipeline.stage import Run

# (metric keys to draw together, title); drawn when the run logged any of them.
CURVES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("loss",), "loss"),
    (("reward_mean", "reward_max"), "reward"),
    (("success_rate", "cs_macro_rate", "hard_macro_rate"), "success and constraint rates"),
    (("entropy",), "entropy"),
    (("clip_fraction", "clip_fraction_low", "clip_fraction_high"), "clipped tokens"),
    (("mismatch_kl",), "train/inference mismatch KL"),
    (
        (
            "samples_stale",
            "samples_duplicate",
            "samples_masked_overlength",
            "samples_format_error",
            "samples_truncated",
        ),
        "samples dropped, masked or truncated",
    ),
    (("time_wait_s", "time_compute_s", "time_sync_s"), "step time split (s)"),
    (("grad_norm",), "gradient norm"),
)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [row for _, row in iter_jsonl(path, skip_bad=True)]  # skip a line cut by a crash


def plot_curves(rows: list[dict[str, Any]], title: str, out: Path) -> list[Path]:
    """One PNG per curve group with data; x is the RL batch where logged (a skipped batch keeps
    the step of the last trained one), else the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    checks = tuple(sorted({k for r in rows for k in r if k.startswith("check/")}))
    x_key = "batch" if any("batch" in r for r in rows) else "step"
    for keys, name in CURVES + (((checks, "per-constraint pass rates"),) if checks else ()):
        present = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in present:
            pts = [(r.get(x_key, i), r[k]) for i, r in enumerate(rows) if isinstance(r.get(k), (int, float))]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=k.removeprefix("check/"))
        ax.set_title(f"{title}: {name}")
        ax.set_xlabel(x_key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{title}-{name.split(' ')[0].replace('/', '-')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_report(run: Run) -> Path:
    records = run.stage_records()
    lines = [
        f"# Run {run.config.name}",
        "",
        f"Folder: `{run.folder}`",
        "",
        "| stage | state | seconds |",
        "|---|---|---|",
    ]
    for stage in run.config.stages:
        rec = records.get(stage, {})
        lines.append(f"| {stage} | {rec.get('state', 'not run')} | {rec.get('seconds', '')} |")
    plots = run.folder / "plots"
    for stage in ("sft", "rl"):
        rows = read_jsonl(run.folder / stage / "metrics.jsonl")
        if not rows:
            continue
        lines += ["", f"## {stage.upper()} ({len(rows)} logged steps)", ""]
        last = rows[-1]
        keys = [
            k
            for k in (
                "loss",
                "reward_mean",
                "success_rate",
                "entropy",
                "clip_fraction",
                "mismatch_kl",
                "grad_norm",
                "tokens_per_s",
                "mfu",
                "version",
            )
            if isinstance(last.get(k), (int, float))
        ]
        if keys:
            lines += [
                "| " + " | ".join(keys) + " |",
                "|" + "---|" * len(keys),
                "| " + " | ".join(f"{last[k]:.4g}" for k in keys) + " |",
                "",
            ]
        for png in plot_curves(rows, stage, plots):
            lines.append(f"![{png.stem}](plots/{png.name})")
    ev = (records.get("eval", {}).get("outputs") or {}).get("metrics")
    if ev:
        lines += ["", "## Evaluation", "", "```json", json.dumps(ev, indent=2)[:4000], "```"]
    path = run.folder / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
