"""GPU memory per decoder layer of the learner on the recipe's packed rows, at a model's width with fewer layers
than it has, so that a width too large for one card is measured on one card (issue 63: the 7B recipe's memory
option chosen from figures).

    python bench/layer_memory.py                                 # one GPU: 7B width, 2 and 4 layers, 80 GiB cap
    python bench/layer_memory.py --shape tiny --device cpu --layers 1,2 --row-tokens 512 --steps 1 \\
        --name layer_memory_cpu_smoke                            # the record path on CPU (no memory figures)

For each memory option (`--options`, bench/learner_multigpu.py's names: none, mlp, layers, lean, lean+mlp, mlpN,
lean+mlpN) and each layer count (`--layers`), ours (services.learner, ZeRO-3 on one rank) trains `--steps` steps of
one packed row of the recipe's trajectories (`--row-tokens`, 32,768), each run in a process of its own. Measured:
the peak of allocated memory over the steps, and what stays allocated between steps (weights, gradients and
optimizer state: `resident_gib`); their difference is the step's activations. Per layer, between the fewest and the
most layers: Δ / Δlayers of each. Projected for the model's own layer count on one rank: the fewest layers' figure
plus the layers it lacks at the per-layer rate; under ZeRO-3 over R ranks the resident part per layer divides by R,
the activations do not.

Record: bench/results/<name>.{json,md}: `device`, `card_gib`, `shape`, `row_tokens`, per option the runs
(`layers`, `peak_gib`, `resident_gib`, `activation_gib`, or the error), `per_layer` (`resident_gib`,
`activation_gib`, `peak_gib`) and `projected_peak_gib` at the model's layer count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import learner_multigpu as lm  # noqa: E402
from bench.gpu_shapes import SHAPES  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--layers", default="2,4", help="comma-separated layer counts (at least two, all different)")
    ap.add_argument("--options", default="lean+mlp,lean,layers", help="memory options, comma-separated")
    ap.add_argument("--row-tokens", type=int, default=lm.RECIPE_ROW_TOKENS, help="a packed row's capacity")
    ap.add_argument("--steps", type=int, default=2, help="steps a run (after one warm-up step)")
    ap.add_argument("--card-gib", type=float, default=80.0, help="GiB the process may use of its GPU (0: all)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--workdir", default=None, help="where the random-init models are written (default: a temp dir)")
    ap.add_argument("--name", default="layer_memory_7b")
    ap.add_argument("--one", nargs=2, metavar=("LAYERS", "OPTION"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.layer_counts = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--layers: give whole numbers, not {args.layers!r}")
    if len(args.layer_counts) < 2 or args.layer_counts[0] < 1:
        ap.error(f"--layers: give at least two different counts of 1 or more, not {args.layers!r}")
    full = SHAPES[args.shape]["num_hidden_layers"]
    if args.layer_counts[-1] > full:
        ap.error(f"--layers: the {args.shape} shape has {full} layers, fewer than {args.layer_counts[-1]}")
    args.option_list = [o for o in args.options.split(",") if o.strip()]
    if bad := [o for o in args.option_list if lm.memory_option(o) is None] or not args.option_list:
        ap.error(f"--options: unknown {bad or args.options!r} (none, mlp, layers, lean, lean+mlp, mlpN, lean+mlpN)")
    return args


def run_args(args: argparse.Namespace, layers: int) -> argparse.Namespace:
    """bench/learner_multigpu.py's options for one run: ours on one recipe row a step, `layers` layers."""
    largs = lm.parse_args(
        [
            "--shape",
            args.shape,
            "--rows",
            "recipe",
            "--rows-per-rank",
            "1",
            "--row-tokens",
            str(args.row_tokens),
            "--steps",
            str(args.steps),
            "--warmup",
            "1",
            "--card-gib",
            str(args.card_gib),
            "--device",
            args.device,
            "--sides",
            "ours",
            "--name",
            args.name,
        ]  # fmt: skip
    )
    largs.layers, largs.profile = layers, False
    return largs


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """`--one LAYERS OPTION`: that run alone in this process."""
    layers, option = int(args.one[0]), args.one[1]
    lm.one_rank_env()
    largs = run_args(args, layers)
    rank, world, on_gpu = lm.setup(largs)
    work = Path(args.workdir or tempfile.gettempdir()) / f"star-layer-memory-{args.shape}-{layers}"
    model = lm.build_model(largs, work / "model", rank, on_gpu)
    try:
        r = lm.attempt(lm.run_ours, largs, model, rank, world, on_gpu, option)
    except Exception as exc:  # the run's cell, never the job's end
        r = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    out = {"layers": layers, **{k: r.get(k) for k in ("peak_gib", "resident_gib", "tokens_per_s", "error", "oom")}}
    if out["peak_gib"] is not None and out["resident_gib"] is not None:
        out["activation_gib"] = round(out["peak_gib"] - out["resident_gib"], 2)
    return out


def in_process(argv: list[str], layers: int, option: str, work: Path) -> dict[str, Any]:
    out = work / f"run-{layers}-{option}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--one", str(layers), option, "--one-out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT)
    if out.is_file():
        return json.loads(out.read_text())
    return {"layers": layers, "error": f"the run's process ended with code {proc.returncode} and no result"}


def per_layer(runs: list[dict[str, Any]], full_layers: int) -> dict[str, Any]:
    """Δ / Δlayers of the resident, activation and peak memory between the fewest and the most layers that ran
    with figures, and the peak projected at `full_layers`; empty where fewer than two such runs exist."""
    done = sorted((r for r in runs if r.get("peak_gib") is not None and r.get("resident_gib") is not None),
                  key=lambda r: r["layers"])  # fmt: skip
    if len(done) < 2 or done[0]["layers"] == done[-1]["layers"]:
        return {}
    lo, hi = done[0], done[-1]
    span = hi["layers"] - lo["layers"]
    rate = {k: round((hi[k] - lo[k]) / span, 3) for k in ("resident_gib", "activation_gib", "peak_gib")}
    return {
        "per_layer": rate,
        "between_layers": [lo["layers"], hi["layers"]],
        "projected_peak_gib": round(lo["peak_gib"] + rate["peak_gib"] * (full_layers - lo["layers"]), 1),
        "projected_activation_gib": round(
            lo["activation_gib"] + rate["activation_gib"] * (full_layers - lo["layers"]), 1
        ),
    }


def markdown(rec: dict[str, Any]) -> str:
    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return "–" if x is None else fmt.format(x)

    lines = [
        f"# Learner memory per layer: {rec['shape']} width, {rec['device']}",
        "",
        f"`{rec['command']}` (method in bench/layer_memory.py). One packed row of {rec['row_tokens']:,} tokens of the "
        f"recipe's trajectories a step, ZeRO-3 on one rank, capped at {f(rec['card_gib'], '{:.0f}')} GiB. Resident: "
        "allocated between steps; activations: the steps' peak less it.",
        "",
        "| option | layers | peak GiB | resident GiB | activations GiB | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for option, o in rec["options"].items():
        for r in o["runs"]:
            if r.get("error") or r.get("oom"):
                lines.append(f"| {option} | {r['layers']} | {(r.get('error') or 'out of memory')[:120]} | | | |")
                continue
            lines.append(
                f"| {option} | {r['layers']} | {f(r.get('peak_gib'))} | {f(r.get('resident_gib'))} | "
                f"{f(r.get('activation_gib'))} | {f(r.get('tokens_per_s'), '{:,.0f}')} |"
            )
    lines += [
        "",
        f"| option | resident GiB a layer | activations GiB a layer | projected peak at {rec['full_layers']} layers, "
        f"one rank | projected activations at {rec['full_layers']} layers |",
        "|---|---|---|---|---|",
    ]
    for option, o in rec["options"].items():
        p = o.get("per_layer") or {}
        lines.append(
            f"| {option} | {f(p.get('resident_gib'), '{:.3f}')} | {f(p.get('activation_gib'), '{:.3f}')} | "
            f"{f(o.get('projected_peak_gib'), '{:.1f}')} | {f(o.get('projected_activation_gib'), '{:.1f}')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.one:
        result = run_one(args)
        args.one_out.write_text(json.dumps(result, default=str))
        return 0
    work = Path(args.workdir or tempfile.gettempdir()) / "star-layer-memory"
    work.mkdir(parents=True, exist_ok=True)
    import torch

    on_gpu = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    full = SHAPES[args.shape]["num_hidden_layers"]
    rec: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "card_gib": args.card_gib if on_gpu else None,
        "shape": args.shape,
        "full_layers": full,
        "row_tokens": args.row_tokens,
        "steps": args.steps,
        "command": f"python bench/layer_memory.py {' '.join(argv)}".strip(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "options": {},
    }
    out = ROOT / "bench" / "results" / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for option in args.option_list:
        runs = []
        for layers in args.layer_counts:
            print(f"[layer_memory] {option}, {layers} layers", flush=True)
            runs.append(in_process(argv, layers, option, work))
            rec["options"][option] = {"runs": runs, **per_layer(runs, full)}
            out.write_text(json.dumps(rec, indent=1) + "\n")  # a job cut short keeps what ran
            out.with_suffix(".md").write_text(markdown(rec))
    print(markdown(rec))
    return 0 if all(r.get("error") is None for o in rec["options"].values() for r in o["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
