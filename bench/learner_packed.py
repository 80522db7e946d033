"""The learner on the recipe's packed rows against one long sequence and against HF + Liger-Kernel: one job,
one GPU capped at 80 GiB (issue 63's figures).

    python bench/learner_packed.py                                   # one H200: 1.5B shape, 20 timed steps a side
    python bench/learner_packed.py --shape tiny --device cpu --steps 2 --warmup 1 --row-tokens 512 --single-seq 512 \\
        --name learner_packed_cpu_smoke                              # the record path end to end on CPU

Three sides in this one process (world of one rank, ZeRO-3 as the learner runs it), each reusing
bench/learner_multigpu.py's runs on the same random-init model:
- single: ours (services.learner) on one unpacked `--single-seq`-token sequence a step (16K): the MFU the
  packed rows are held to (`single_mfu`);
- ours: ours on the recipe's packed rows (`--row-tokens` 32,768, trajectories of the recipe's length
  distribution, `--rows-per-rank` rows a step) with the memory option the 1.5B recipe ships
  (configs/qwen2.5-1.5b-*.yaml learner: gradient_checkpointing → layers, recompute_mlp → mlp, with
  recompute_mlp_layers N → mlpN, activation_memory lean → lean+…, else none),
  then the others in order where it runs out of memory;
- liger: HF Qwen2 with Liger-Kernel's RoPE, RMSNorm and SwiGLU and its LigerFusedLinearGRPOLoss on the same
  rows, through the varlen attention a user can register with transformers' AttentionInterface
  (`--baseline-attn`, default star_varlen: services/learner/attention.py's function, handed the rows'
  cu_seq_lens once per row as transformers' flattening collator hands them), with our weight persistence and
  gradient-reduce dtype. Its loss runs compiled where it compiles and eager where it does not, each variant
  recorded with the reason of any failure: compiled with static shapes (one graph per padded length, at most
  row_tokens / chunk of them), compiled with dynamic shapes, eager. The side runs last: Liger's patches change
  HF's Qwen2 classes for the rest of the process.
A side that fails is recorded and the next runs; ours falls back to PyTorch's SDPA order where the
benchmark's kernel order fails other than by memory. On a machine without liger-kernel (CPU) the liger side
records "liger-kernel unavailable".

Record: bench/results/<name>.json, .md and .png (tokens/s by timed step for each side): `single_mfu`, `mfu`,
`tokens_per_s`, `baseline_tokens_per_s` (the fastest Liger variant that ran), `peak_gib` (ours on packed
rows), `card_gib`, `timed_steps`, `device`, each side's per-step tokens/s and spread, and the targets with
pass/fail: mfu >= 0.9 x single_mfu and >= 0.48 (PaLM count, a fraction of 1), tokens_per_s >= 1.15 x the
baseline, peak <= 80 GiB. `--profile` (auto: on GPU) profiles one more step of ours on packed rows, untimed;
the record lists its operators of most device time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import learner_multigpu as lm  # noqa: E402
from bench.gpu_shapes import SHAPES  # noqa: E402

RECIPE = ROOT / "configs" / "qwen2.5-1.5b-arpo-macro.yaml"
TARGETS = {"mfu_vs_single_min": 0.9, "mfu_min": 0.48, "speedup_vs_baseline_min": 1.15, "peak_gib_max": 80}
LIGER_VARIANTS = ("compiled-static", "compiled-dynamic", "eager")
SIDE_NAMES = {
    "single": "ours, one unpacked sequence",
    "ours": "ours, the recipe's packed rows",
    "liger": "HF + Liger-Kernel, the same packed rows",
}


PACKED_ATTENTION_CHOICES = ("learner", "auto", "varlen", "varlen-gqa", "per-sequence")


def _packed_attention_list(text: str) -> tuple[str, ...]:
    order = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [t for t in order if t not in PACKED_ATTENTION_CHOICES]
    if bad or not order:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a comma-separated list of {', '.join(PACKED_ATTENTION_CHOICES)}"
        )
    return order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each side (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--single-seq", type=int, default=16384, help="tokens of the single side's one sequence")
    ap.add_argument("--row-tokens", type=int, default=lm.RECIPE_ROW_TOKENS, help="a packed row's capacity")
    ap.add_argument("--rows-per-rank", type=int, default=1, help="packed rows a step")
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe whose learner memory option ours runs")
    ap.add_argument(
        "--recompute",
        default="recipe",
        help="ours on packed rows: recipe (the recipe's option first, then the others) or a "
        "comma-separated order of none, mlp, layers, lean, lean+mlp, mlpN, lean+mlpN (lean: activation_memory lean; "
        "mlpN: the MLPs of the first N layers recomputed)",
    )
    ap.add_argument("--single-recompute", default="none,mlp,layers", help="the single side's order")
    ap.add_argument(
        "--baseline-attn",
        default="star_varlen",
        help="the Liger side's attn_implementation (star_varlen, flex_attention, sdpa, ...)",
    )
    ap.add_argument(
        "--liger-variants",
        default="auto",
        help=f"comma-separated, of {', '.join(LIGER_VARIANTS)} (auto: all on GPU, eager on CPU); a "
        "compiled one runs where no compiled one before it ran, eager always; the fastest is the "
        "baseline",
    )
    ap.add_argument("--baseline-checkpointing", choices=["auto", "off", "on"], default="auto")
    ap.add_argument("--sdpa", default="cudnn+flash", help="ours: SDPA kernel order ('default': PyTorch's)")
    ap.add_argument(
        "--packed-attention",
        type=_packed_attention_list,
        default=("learner",),
        help="ours on packed rows: comma-separated packed_attention values (auto, varlen, varlen-gqa, per-sequence), "
        "each run in turn, the fastest kept as ours and every one recorded; learner: the learner's default",
    )
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per chunk of the vocabulary head (both sides)")
    ap.add_argument("--card-gib", type=float, default=80.0, help="GiB the process may use of its GPU (0: all)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument(
        "--profile",
        choices=["auto", "on", "off"],
        default="auto",
        help="one more untimed step of ours on packed rows under torch.profiler (auto: on GPU)",
    )
    ap.add_argument("--name", default="learner_packed_h200", help="results file stem under bench/results/")
    ap.add_argument("--workdir", default=None, help="where the random-init model is written (default: a temp dir)")
    # internal: one side in a process of its own, its result written as JSON (every side starts on an empty GPU)
    ap.add_argument("--one-side", choices=["single", "ours", "liger"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--side-out", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def recipe_recompute(recipe: Path) -> str:
    """The memory option a recipe's learner section ships, as the benchmark names it."""
    import yaml

    learner = (yaml.safe_load(recipe.read_text()) or {}).get("learner") or {}
    if learner.get("gradient_checkpointing"):
        return "layers"
    lean = "lean" if learner.get("activation_memory") == "lean" else ""
    mlp = f"mlp{learner.get('recompute_mlp_layers') or ''}" if learner.get("recompute_mlp") else ""
    return "+".join(x for x in (lean, mlp) if x) or "none"


def recompute_order(args: argparse.Namespace) -> str:
    if args.recompute != "recipe":
        return args.recompute
    first = recipe_recompute(args.recipe)
    return ",".join([first, *(r for r in lm.RECOMPUTE if r != first)])


def side_args(args: argparse.Namespace, side: str, on_gpu: bool) -> argparse.Namespace:
    """bench/learner_multigpu.py's options for one side of this benchmark."""
    common = [
        "--shape",
        args.shape,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--chunk",
        str(args.chunk),
        "--card-gib",
        str(args.card_gib),
        "--device",
        args.device,
        "--sdpa",
        args.sdpa,
        "--name",
        args.name,
        "--row-tokens",
        str(args.row_tokens),
        "--seq",
        str(args.single_seq),
        "--rows-per-rank",
        str(args.rows_per_rank),
        "--baseline-attn",
        args.baseline_attn,
        "--baseline-checkpointing",
        args.baseline_checkpointing,
    ]
    if side == "single":
        out = lm.parse_args([*common, "--rows", "single", "--recompute", args.single_recompute])
    else:
        attention = args.packed_attention[0]
        packed = [] if side != "ours" or attention == "learner" else ["--packed-attention", attention]
        out = lm.parse_args([*common, "--rows", "recipe", "--recompute", recompute_order(args), *packed])
    out.profile = side == "ours" and (args.profile == "on" or (args.profile == "auto" and on_gpu))
    return out


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:500]}"


def run_ours(largs: argparse.Namespace, model_dir: Path, on_gpu: bool) -> tuple[dict, list[dict]]:
    """Ours under each memory option in turn until one runs (an option out of memory or failing is recorded and
    the next one tried); where every option fails under the benchmark's SDPA kernel order other than by
    memory, the same again under PyTorch's order. (result, every attempt)."""
    attempts: list[dict] = []
    orders = list(dict.fromkeys([largs.sdpa, "default"]))
    error = None
    for sdpa in orders:
        largs.sdpa = sdpa
        failed = False
        for recompute in largs.recompute:
            try:
                r = lm.attempt(lm.run_ours, largs, model_dir, 0, 1, on_gpu, recompute)
            except Exception as exc:  # recorded; the next option runs
                error, failed = error_text(exc), True
                attempts.append({"recompute": recompute, "sdpa": sdpa, "error": error})
                lm.log(0, f"ours (recompute {recompute}, sdpa {sdpa}) failed: {error}")
                lm.release(on_gpu)
                continue
            attempts.append({"recompute": recompute, "sdpa": sdpa, **r})
            if not r.get("oom"):
                return r, attempts
        if not failed:
            return {"oom": True, "error": "out of memory with every option"}, attempts
    return {"error": error}, attempts


@contextmanager
def loss_compilation(variant: str):
    """torch.compile's shape settings for a Liger variant: static (a graph per padded length; the loss's
    inputs are padded to whole chunks, so there are at most row_tokens / chunk lengths) or dynamic from the
    first call (no automatic switch to dynamic shapes on the second length, where torch 2.11 failed building
    its shape guards: IndexError)."""
    import torch

    torch._dynamo.reset()
    limit = {"recompile_limit": 64} if hasattr(torch._dynamo.config, "recompile_limit") else {"cache_size_limit": 64}
    patches = {
        "compiled-static": {"automatic_dynamic_shapes": False, **limit},
        "compiled-dynamic": {"assume_static_by_default": False, **limit},
    }.get(variant, {})
    try:
        with torch._dynamo.config.patch(**patches):
            yield
    finally:
        torch._dynamo.reset()


def liger_variants(args: argparse.Namespace, on_gpu: bool) -> tuple[str, ...]:
    if args.liger_variants == "auto":
        return LIGER_VARIANTS if on_gpu else ("eager",)
    chosen = tuple(v.strip() for v in args.liger_variants.split(",") if v.strip())
    bad = [v for v in chosen if v not in LIGER_VARIANTS]
    if bad or not chosen:
        raise SystemExit(f"--liger-variants {args.liger_variants!r}: give auto or of {', '.join(LIGER_VARIANTS)}")
    return chosen


def run_liger(
    args: argparse.Namespace, largs: argparse.Namespace, model_dir: Path, on_gpu: bool
) -> tuple[dict, list[dict]]:
    """The Liger side compiled (static shapes, else dynamic) and eager, gradient checkpointing only where the
    row does not fit without it (found once, kept for the later variants); a variant that fails is recorded
    with its reason and the next runs. The result: the fastest variant that ran, every variant's figures
    beside it."""
    loss_cls, _, missing = lm.liger_kernels(on_gpu)
    if loss_cls is None:
        return {"skipped": f"liger-kernel unavailable ({missing})"}, []
    attempts: list[dict] = []
    choice = {"auto": [False, True], "off": [False], "on": [True]}[args.baseline_checkpointing]
    for variant in liger_variants(args, on_gpu):
        if variant != "eager" and any(a.get("tokens_per_s") and a["variant"] != "eager" for a in attempts):
            continue  # one compiled variant ran: the others are fallbacks
        largs.liger_compile = "off" if variant == "eager" else "on"
        try:
            with loss_compilation(variant):
                for checkpointing in list(choice):
                    r = lm.attempt(lm.run_baseline, largs, model_dir, 0, 1, on_gpu, checkpointing, "liger")
                    attempts.append({"variant": variant, "gradient_checkpointing": checkpointing, **r})
                    if not r.get("oom"):
                        break
                    choice.remove(checkpointing)  # did not fit: the later variants start past it
        except Exception as exc:  # a compilation failure among them: recorded, the next variant runs
            attempts.append({"variant": variant, "error": error_text(exc)})
            lm.log(0, f"liger {variant} failed: {attempts[-1]['error']}")
        lm.release(on_gpu)
        if not choice:
            break  # out of memory with every option: no variant fits
    ran = [a for a in attempts if a.get("tokens_per_s")]
    if not ran:
        reasons = "; ".join(f"{a['variant']}: {a.get('error') or 'out of memory'}" for a in attempts)
        return {"error": f"no variant ran ({reasons})"[:1200]}, attempts
    best = max(ran, key=lambda a: a["tokens_per_s"])
    return {
        **best,
        "variants": {a["variant"]: {k: a.get(k) for k in ("tokens_per_s", "mfu", "peak_gib")} for a in ran},
    }, attempts


def step_rates(result: dict) -> dict:
    """A side's tokens/s at each timed step and their spread."""
    steps, tokens = result.get("steps_s") or [], result.get("tokens_per_step") or []
    rates = [round(t / s, 1) for t, s in zip(tokens, steps) if s]
    if not rates:
        return {}
    mean = statistics.mean(rates)
    sd = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return {
        "tokens_per_s_by_step": rates,
        "spread": {
            "min": min(rates),
            "max": max(rates),
            "stdev": round(sd, 1),
            "cv": round(sd / mean, 4) if mean else None,
        },
    }


def finish(record: dict) -> None:
    """The top-level figures and the targets, from the sides."""
    single, ours, liger = (record["sides"].get(k) or {} for k in ("single", "ours", "liger"))
    record.update(
        {
            "single_mfu": single.get("mfu"),
            "single_tokens_per_s": single.get("tokens_per_s"),
            "mfu": ours.get("mfu"),
            "mfu_causal_half": ours.get("mfu_causal_half"),
            "tokens_per_s": ours.get("tokens_per_s"),
            "peak_gib": ours.get("peak_gib"),
            "memory_option": ours.get("recompute"),
            "baseline_tokens_per_s": liger.get("tokens_per_s"),
            "baseline_variant": liger.get("variant"),
        }
    )
    t = TARGETS
    mfu, single_mfu, tps, base, peak = (
        record[k] for k in ("mfu", "single_mfu", "tokens_per_s", "baseline_tokens_per_s", "peak_gib")
    )
    record["speedup_vs_baseline"] = round(tps / base, 3) if tps and base else None
    record["targets"] = {
        "mfu_vs_single": {
            "want": f">= {t['mfu_vs_single_min']} x single_mfu",
            "value": round(mfu / single_mfu, 3) if mfu and single_mfu else None,
            "pass": None if not (mfu and single_mfu) else mfu >= t["mfu_vs_single_min"] * single_mfu,
        },
        "mfu": {"want": f">= {t['mfu_min']}", "value": mfu, "pass": None if mfu is None else mfu >= t["mfu_min"]},
        "speedup_vs_baseline": {
            "want": f">= {t['speedup_vs_baseline_min']}",
            "value": record["speedup_vs_baseline"],
            "pass": None
            if record["speedup_vs_baseline"] is None
            else record["speedup_vs_baseline"] >= t["speedup_vs_baseline_min"],
        },
        "peak_gib": {
            "want": f"<= {t['peak_gib_max']}",
            "value": peak,
            "pass": None if peak is None else peak <= t["peak_gib_max"],
        },
    }
    record["targets_missed"] = [k for k, v in record["targets"].items() if v["pass"] is False]


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f} %"


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:,.0f}"


def side_line(side: str, r: dict) -> str:
    if not r.get("tokens_per_s"):
        why = (r.get("skipped") or r.get("error") or "out of memory").replace("\n", " ").replace("|", "/")
        return f"| {SIDE_NAMES[side]} | {why} | | | | | | |"
    spread = r.get("spread") or {}
    if side == "liger":
        option = f"{r.get('variant')} loss, " + (
            "gradient checkpointing" if r.get("gradient_checkpointing") else "no checkpointing"
        )
    else:
        option = f"recompute {r.get('recompute')}, SDPA {r.get('sdpa')}, packed attention {r.get('packed_attention')}"
    return (
        f"| {SIDE_NAMES[side]} | {_num(r['tokens_per_s'])} | {_num(spread.get('min'))}-{_num(spread.get('max'))} "
        f"| {_num(spread.get('stdev'))} | {_pct(r.get('mfu'))} | {r.get('peak_gib') or ''} | "
        f"{len(r.get('steps_s') or [])} | {option} |"
    )


def write_markdown(record: dict, path: Path) -> None:
    rows = record.get("rows") or {}
    lines = [
        f"# The learner on the recipe's packed rows: one {record['device']}, {record['shape']} shape",
        "",
        f"Written by `bench/learner_packed.py` (`{record['name']}.json`), all sides in one job"
        + (f", the process capped at {record['card_gib']:g} GiB of GPU memory" if record.get("card_gib") else "")
        + f". Packed rows: {rows.get('rows_per_rank')} row(s) of {rows.get('row_tokens', 0):,} tokens a step, "
        f"trajectories of the recipe's lengths (drawn mean {rows.get('drawn_mean', 0):,}); the single side: one "
        f"unpacked {record['single_seq']:,}-token sequence a step. tokens/s: trajectory tokens over the timed "
        "steps' time; min-max and stdev: of the steps' own rates. MFU: PaLM count, a fraction of the card's "
        "dense bf16 peak.",
        "",
        "| side | tokens/s | min-max | stdev | MFU | peak GiB | timed steps | option |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side in ("single", "ours", "liger"):
        if side in record["sides"]:
            lines.append(side_line(side, record["sides"][side]))
    lines += ["", "| target | want | value | pass |", "|---|---|---|---|"]
    for key, t in record["targets"].items():
        lines.append(
            f"| {key} | {t['want']} | {'' if t['value'] is None else t['value']} | "
            f"{'n/a' if t['pass'] is None else 'yes' if t['pass'] else 'no'} |"
        )
    lines += ["", "Attempts, in order:", ""]
    for side, tries in record["attempts"].items():
        for a in tries:
            keys = ("recompute", "sdpa", "packed_attention", "variant", "gradient_checkpointing")
            option = {k: a[k] for k in keys if k in a}
            outcome = a.get("error") or a.get("skipped") or f"{a.get('tokens_per_s', 0):,.0f} tokens/s"
            outcome = outcome.replace("\n", " ")
            lines.append(f"- {side} {option}: {outcome}")
    prof = (record["sides"].get("ours") or {}).get("profile")
    if prof:
        lines += [
            "",
            f"Where a step of ours on packed rows spends its time (one more step under the profiler, "
            f"{prof['step_s']} s; `{prof['file']}`), operators of most self time:",
            "",
            "| operator | self ms | share | calls |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{o['op']}` | {o['self_ms']} | {_pct(o['share'])} | {o['calls']} |" for o in prof["top_self"]]
    liger = record["sides"].get("liger") or {}
    if liger.get("liger_missing"):
        lines += ["", f"Liger side: {liger['liger_missing']} (its loss alone ran)."]
    lines += [
        "",
        f"The Liger side's attention: `{record['baseline_attn']}` through transformers' AttentionInterface "
        "(the row's cu_seq_lens handed once per row); its loss LigerFusedLinearGRPOLoss (DAPO token mean, "
        "eps 0.2/0.28, beta 0); our weight persistence and gradient-reduce dtype"
        + (f" ({liger.get('persistence')}, {liger.get('grad_reduce')})" if liger.get("persistence") else "")
        + ".",
        f"torch {record['torch']}, transformers {record['transformers']}, deepspeed {record['deepspeed']}, "
        f"liger-kernel {record['liger_kernel']}; {record['date']}.",
        "",
    ]
    path.write_text("\n".join(lines))


def plot(record: dict, path: Path) -> None:
    """Tokens/s at each timed step, a line per side (and per Liger variant that ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    lines = [(SIDE_NAMES[s], record["sides"].get(s) or {}) for s in ("single", "ours")]
    lines += [
        (f"HF + Liger, {a['variant']} loss", step_rates(a))
        for a in record["attempts"].get("liger", [])
        if a.get("tokens_per_s")
    ]
    drawn = 0
    for label, r in lines:
        rates = r.get("tokens_per_s_by_step")
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", ms=3, label=label)
            drawn += 1
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("timed step")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"Learner, {record['shape']} shape, one {record['device']}"
        + (f" capped at {record['card_gib']:g} GiB" if record.get("card_gib") else ""),
        fontsize=9,
    )
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(record: dict) -> None:
    finish(record)
    out = lm.record_path(argparse.Namespace(name=record["name"]))
    lm.write_record(out, record)
    write_markdown(record, out.with_suffix(".md"))
    plot(record, out.with_suffix(".png"))


def versions() -> dict:
    from importlib import metadata

    out = {}
    for package in ("torch", "transformers", "deepspeed", "liger_kernel"):
        try:
            out[package] = metadata.version(package.replace("_", "-"))
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.one_side:
        return run_side(argv)
    lm.one_rank_env()
    probe = side_args(args, "ours", on_gpu=False)
    rank, world, on_gpu = lm.setup(probe)
    import torch

    work = Path(args.workdir or tempfile.gettempdir()) / f"star-learner-packed-{args.shape}"
    work.mkdir(parents=True, exist_ok=True)
    lm.build_model(probe, work / "model", rank, on_gpu)
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    card = None
    if on_gpu:
        card = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    record = {
        "name": args.name,
        "device": device,
        "device_gib": card,
        "card_gib": (args.card_gib or card) if on_gpu else None,
        "shape": args.shape,
        "world_size": world,
        "zero_stage": 3,
        "single_seq": args.single_seq,
        "timed_steps": args.steps,
        "warmup_steps": args.warmup,
        "baseline_attn": args.baseline_attn,
        "recipe": str(args.recipe.relative_to(ROOT)) if args.recipe.is_relative_to(ROOT) else str(args.recipe),
        "recipe_memory_option": recipe_recompute(args.recipe),
        "rows": lm.recipe_rows_facts(side_args(args, "ours", on_gpu), world, on_gpu),
        "host": lm.host_facts(on_gpu),
        "command": f"python bench/learner_packed.py {' '.join(argv)}",
        **versions(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "sides": {},
        "attempts": {},
    }
    torch.distributed.destroy_process_group()
    if on_gpu:
        torch.cuda.empty_cache()
    started = time.perf_counter()
    for side in ("single", "ours", "liger"):
        lm.log(rank, f"side {side}: start")
        options = side_args(args, side, on_gpu).recompute
        if side == "ours":
            result, tries = ours_by_attention(argv, work, options, args.packed_attention)
        else:
            result, tries = side_in_processes(argv, side, work, options)
        record["sides"][side] = {**result, **step_rates(result)}
        record["attempts"][side] = tries
        record["wall_s"] = round(time.perf_counter() - started, 1)
        write(record)
        lm.log(
            rank,
            f"side {side}: "
            + json.dumps({k: result.get(k) for k in ("tokens_per_s", "mfu", "peak_gib", "error", "skipped")}),
        )
    out = lm.record_path(args)
    print(
        json.dumps(
            {
                k: record.get(k)
                for k in (
                    "device",
                    "single_mfu",
                    "mfu",
                    "tokens_per_s",
                    "baseline_tokens_per_s",
                    "peak_gib",
                    "targets_missed",
                    "wall_s",
                )
            }
        ),
        flush=True,
    )
    print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}", flush=True)
    return 0


def ours_by_attention(argv: list[str], work: Path, options: tuple[str, ...], attentions: tuple[str, ...]):
    """Ours on packed rows under each `--packed-attention` in turn (each with the memory options in order): the
    fastest that ran is ours, every run an attempt. (result, every attempt)."""

    def ran(r: dict | None) -> bool:
        return bool(r) and r.get("tokens_per_s") is not None and not r.get("oom") and not r.get("error")

    best: dict | None = None
    attempts: list[dict] = []
    for attention in attentions:
        one = [*lm.without(argv, "--packed-attention"), "--packed-attention", attention]
        result, tries = side_in_processes(one, "ours", work, options)
        attempts.extend(tries)
        if best is None or (ran(result) and (not ran(best) or result["tokens_per_s"] > best["tokens_per_s"])):
            best = result
    return best or {}, attempts


def side_in_processes(argv: list[str], side: str, work: Path, options: tuple[str, ...]) -> tuple[dict, list[dict]]:
    """Ours on packed rows: each memory option in a process of its own, in order, until one does not run out of
    memory (an option that ran out leaves the next one an empty GPU); the other sides in one process each."""
    if side != "ours":
        return side_in_process(argv, side, work)
    attempts: list[dict] = []
    result: dict = {}
    for option in options:
        result, tries = side_in_process([*lm.without(argv, "--recompute"), "--recompute", option], side, work)
        attempts.extend(tries)
        if not result.get("oom"):
            return result, attempts
    return result, attempts


def side_in_process(argv: list[str], side: str, work: Path) -> tuple[dict, list[dict]]:
    """One side run by a process of its own, so that it starts on an empty GPU whatever the side before it left
    allocated (an engine kept alive by reference cycles, Liger's patches of HF's classes); a process that dies
    is that side's error cell. (result, every attempt)."""
    out = work / f"side-{side}.json"
    out.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *argv, "--one-side", side, "--side-out", str(out)], cwd=ROOT
    )
    if out.is_file():
        done = json.loads(out.read_text())
        return done["result"], done["attempts"]
    return {"error": f"the side's process ended with code {proc.returncode} and no result"}, []


def run_side(argv: list[str]) -> int:
    """`--one-side`: that side alone in this process, its result and attempts written to `--side-out`."""
    args = parse_args(argv)
    lm.one_rank_env()
    largs = side_args(args, args.one_side, on_gpu=False)
    rank, world, on_gpu = lm.setup(largs)
    largs = side_args(args, args.one_side, on_gpu)
    work = Path(args.workdir or tempfile.gettempdir()) / f"star-learner-packed-{args.shape}"
    try:
        if args.one_side == "liger":
            result, tries = run_liger(args, largs, work / "model", on_gpu)
        else:
            result, tries = run_ours(largs, work / "model", on_gpu)
    except Exception as exc:  # a side's failure is its cell, never the job's end
        result, tries = {"error": error_text(exc)}, []
    args.side_out.write_text(json.dumps({"result": result, "attempts": tries}, default=str))
    import torch

    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
