"""Plots (PNG, matplotlib Agg) and the short markdown report of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.evaluation.analysis import METRIC_KEYS, METRIC_NAMES


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(directory: Path, result: dict[str, Any]) -> list[Path]:
    plt = _plt()
    directory.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = directory / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    metrics = result["metrics"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    values = [metrics[k] for k in METRIC_KEYS]
    ax.bar([METRIC_NAMES[k].replace(" ", "\n") for k in METRIC_KEYS], values, color="#4c72b0")
    for i, v in enumerate(values):
        ax.text(i, v + 1, f"{v:.1f}", ha="center", fontsize=8)
    ax.set_ylim(0, 105)
    ax.set_ylabel("%")
    ax.set_title("TravelPlanner metrics")
    save(fig, "metrics.png")

    rows = [r for r in result["constraints"] if r["pass_rate"] is not None]
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(rows) + 1))
    ax.barh([f"{r['name']} ({r['group'][0]})" for r in rows], [r["pass_rate"] for r in rows], color="#55a868")
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("pass rate over applicable queries, %")
    save(fig, "constraints.png")

    if result["failures"]:
        failures = result["failures"][:15]
        fig, ax = plt.subplots(figsize=(7, 0.3 * len(failures) + 1))
        ax.barh([f["category"] for f in failures], [f["queries"] for f in failures], color="#c44e52")
        ax.invert_yaxis()
        ax.set_xlabel("failed queries")
        save(fig, "failures.png")

    cohorts = result["cohorts"]
    if cohorts:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        labels = [f"{c['value']}" for c in cohorts]
        ax.bar(range(len(cohorts)), [c["final_pass_rate"] for c in cohorts], color="#8172b2")
        ax.set_xticks(range(len(cohorts)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("final pass rate, %")
        ax.set_ylim(0, 105)
        save(fig, "cohorts.png")
    hist = result.get("trajectory", {}).get("steps_histogram")
    if hist:
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.bar([int(k) for k in hist], list(hist.values()), color="#937860")
        ax.set_xlabel("model turns per trajectory")
        ax.set_ylabel("trajectories")
        save(fig, "steps.png")
    return paths


def _table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def write_report(path: Path, result: dict[str, Any], manifest: dict[str, Any], plots: list[Path]) -> None:
    m = result["metrics"]
    scoring = manifest.get("scoring", {})
    counts = m["counts"]
    parts = [
        "# TravelPlanner evaluation (in domain)",
        "",
        f"- queries: {counts['queries']} ({'official ' + m['split'] + ' denominators' if m['split'] else 'computed denominators'}),"
        f" evaluator mode: **{m['mode']}**",
        f"- formatter: `{scoring.get('formatter', {}).get('kind', '?')}`; config hash `{manifest.get('config_hash', '?')[:16]}`",
        f"- source: {scoring.get('source', {})}",
        "",
        "## Metrics (%)",
        "",
        _table([[METRIC_NAMES[k], f"{m[k]:.2f}"] for k in METRIC_KEYS], ["metric", "value"]),
        "",
        "## Constraints",
        "",
        _table(
            [
                [
                    r["name"],
                    r["group"],
                    str(r["passed"]),
                    str(r["failed"]),
                    str(r["not_applicable"]),
                    _pct(r["pass_rate"]),
                ]
                for r in result["constraints"]
            ],
            ["check", "group", "passed", "failed", "n/a", "pass %"],
        ),
        "",
        "## Failure categories",
        "",
        _table(
            [[f["category"], str(f["queries"]), f"{f['share_of_failures']:.1f}"] for f in result["failures"]],
            ["category", "failed queries", "% of failures"],
        )
        if result["failures"]
        else "No failed queries.",
        "",
        *(
            [
                "Examples:",
                "",
                _table(
                    [
                        [
                            e["query_id"],
                            str(e["level"]),
                            str(e["days"]),
                            ", ".join(e["categories"]),
                            e["reason"].replace("|", "/"),
                        ]
                        for e in result.get("failure_examples", [])
                    ],
                    ["query", "level", "days", "categories", "first reason"],
                ),
                "",
            ]
            if result.get("failure_examples")
            else []
        ),
        "## Cohorts",
        "",
        _table(
            [[c["cohort"], c["value"], str(c["n"]), *(f"{c[k]:.1f}" for k in METRIC_KEYS)] for c in result["cohorts"]],
            ["cohort", "value", "n", *(METRIC_NAMES[k] for k in METRIC_KEYS)],
        ),
        "",
    ]
    t = result["trajectory"]
    if t.get("trajectories"):
        b, s = result["backtracking"], result["tool_selection"]
        parts += [
            "## Trajectories",
            "",
            f"- trajectories: {t['trajectories']}; task completion (answered): {t['task_completion']:.1f}%;"
            f" finish reasons: {t['finish_reasons']}",
            f"- steps per task p50 / p99: {t['steps_p50']:.1f} / {t['steps_p99']:.1f};"
            f" tool calls p50 / p99: {t['tool_calls_p50']:.1f} / {t['tool_calls_p99']:.1f}",
            f"- tokens per trajectory mean / p50 / p99: {_num(t['tokens_mean'])} / {_num(t['tokens_p50'])} / {_num(t['tokens_p99'])}",
            f"- tool calls well-formed: {_pct(s['well_formed_rate'])}%; tool-selection accuracy: {_pct(s['accuracy'])}%",
            f"- backtracking: {b['dead_ends_of_earlier_choices']} dead ends of earlier choices in "
            f"{b['trajectories']} trajectories, revised {_pct(b['revised_rate'])}%; failed trajectories with an "
            f"unrevised dead end: {b['failed_with_unrevised_dead_end']} of {b['failed_trajectories']}",
        ]
        g = result["group_reward_variance"]
        if g.get("groups"):
            parts.append(
                f"- reward variance per group: mean {g['mean_variance']:.4f} over {g['groups']} groups;"
                f" zero-variance groups {g['zero_variance_share']:.1f}%"
            )
        parts.append("")
    if plots:
        parts += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    path.write_text("\n".join(parts), encoding="utf-8")


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"
