"""Learner on several GPUs: our RL step under ZeRO-3 against HF + Liger-Kernel and plain HF under DeepSpeed
ZeRO-3, same ranks, same rows, one job.

    python bench/learner_multigpu.py --nproc 2 --shape 1.5b --rows recipe --name learner_recipe      # 1.5B on 2 GPUs
    python bench/learner_multigpu.py --nproc 4 --shape 7b --rows recipe --name learner_recipe_7b     # 7B on 4 GPUs
    python bench/learner_multigpu.py --nproc 2 --shape tiny --device cpu --steps 2 --warmup 1 --rows recipe \\
        --row-tokens 512 --name learner_recipe_cpu_smoke                     # the script end to end on CPU (gloo)
    python bench/learner_multigpu.py --nproc 2 --rows single                 # one unpacked 16K row a rank (old shape)

The device run (liger-kernel from its wheel on PYTHONPATH):

    CUDA_VISIBLE_DEVICES=2,3 python bench/learner_multigpu.py --nproc 2 --shape 1.5b --rows recipe --name learner_recipe
    python bench/learner_multigpu.py --nproc 4 --shape 7b --rows recipe --name learner_recipe_7b

Rows (`--rows`):
- recipe (default): each step trains packed rows of `--row-tokens` (the recipes' micro_batch_tokens, 32,768)
  filled with trajectories whose lengths are drawn from a log-normal (sigma `--length-sigma`, 0.6) clipped to
  [`--length-min`, `--length-max`] = [512, 30,000] with its location set so that the clipped mean is
  `--length-mean`, 10,300 tokens (the SFT trajectories' mean; 30K the recipes' max_context_tokens); all three
  scale with `--row-tokens` / 32,768 (a 512-token row: mean 161, at most 469). The stream of lengths is seeded by
  the step, so every side trains the same rows. A step takes the longest prefix of the stream that the learner's
  packing (services/learner/batching.py, first-fit decreasing) puts in exactly `--rows-per-rank` rows a rank,
  with none left over (2: about 64K tokens a rank and step at 32K rows); positions restart at each trajectory.
- single: one unpacked `--seq`-token sequence a rank (the learner_multigpu record's shape).

Sides (`--sides`, each in processes of its own under `--nproc`; the record is rewritten after each):
- ours: services.learner's PolicyEngine and rl_step (the clipped policy loss on rollout logprobs) on its real
  path: packed attention by sequence boundaries (services/learner/attention.py: varlen or SDPA per sequence,
  no [T, T] mask), the vocabulary head fused with the log-prob in chunks of `--chunk` tokens; `--recompute`
  picks none, mlp (each layer's MLP recomputed in backward) or layers (full gradient checkpointing); auto,
  the default, takes the first that fits in memory (each attempt recorded).
- liger: HF Qwen2 with Liger-Kernel's RoPE, RMSNorm and SwiGLU (apply_liger_kernel_to_qwen2), and as loss
  Liger's LigerFusedLinearGRPOLoss, the same clipped token-level policy loss as ours (eps 0.2 / 0.28, DAPO
  token mean, no KL term) with the head fused in sequence × vocabulary chunks. Its advantages are one per
  row, and a packed row mixes trajectories, so each token is handed over as a row of one. Packed rows go in
  as transformers takes them (`--baseline-attn`): position ids restarting per trajectory, from which it builds
  the [B, 1, T, T] block mask for SDPA or the block mask of flex_attention; or, with a varlen attention
  registered through transformers' AttentionInterface (star_varlen: services/learner/attention.py's), the
  row's cu_seq_lens once per row, as transformers' flattening collator hands them (flash-attn and `kernels`
  are not installed on the devices). Without the Triton kernels (CPU) the side runs the Liger loss alone,
  marked in the record.
- plain: HF Qwen2 and HF's loss (cross-entropy over the full logits, labels -100 off the loss tokens).
Both baselines: random-init weights built under deepspeed.zero.Init, the same plain ZeRO-3 config (bf16, fp32
gradient accumulation, overlap_comm, AdamW, DeepSpeed's gradient accumulation over the rank's rows) with ours'
weight persistence and gradient-reduce dtype (services/learner/engine.py deepspeed_config), without
gradient checkpointing first and with it where that runs out of memory (`--baseline-checkpointing`, every
attempt recorded). In-process (under torchrun) liger runs last, since its patches change HF's Qwen2 classes.

MFU (services/learner/flops.py): PaLM count (6·N + 12·L·d·s per token, s each trajectory's own length, so a
packed row counts the sum over its trajectories) and causal-half beside it, against the card's dense bf16 peak.
tokens/s: trajectory tokens (no padding) over the timed steps' time; min/max per step beside it.
Targets (issue 45): ours >= 1.15x the Liger baseline's tokens/s, >= 50 % MFU (PaLM), <= 80 GiB a card at 1.5B.
Results: bench/results/<name>.json and .md (rank 0 writes).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_shapes import SHAPES, qwen2_config  # noqa: E402

RECOMPUTE = ("none", "mlp", "layers")
# the memory options a side may name: RECOMPUTE (the auto order) and the lean activations (activation_memory lean,
# alone or with each MLP recomputed); mlpN and lean+mlpN recompute the MLPs of the first N layers only
MEMORY_OPTIONS = (*RECOMPUTE, "lean", "lean+mlp", "mlpN", "lean+mlpN")


MEMORY_OPTION = re.compile(r"(none|layers|mlp(?P<n>[1-9]\d*)?)|lean(\+mlp(?P<ln>[1-9]\d*)?)?")


def memory_option(name: str) -> dict[str, object] | None:
    """A memory option's learner settings (EngineConfig fields), or None when `name` is not one."""
    match = MEMORY_OPTION.fullmatch(name)
    if match is None:
        return None
    mlp = "mlp" in name
    count = match["n"] or match["ln"]
    return {
        "gradient_checkpointing": name == "layers",
        "recompute_mlp": mlp,
        "recompute_mlp_layers": int(count) if count else None,
        "activation_memory": "lean" if name.startswith("lean") else "keep",
    }


SIDES = ("ours", "liger", "plain")
RECIPE_ROW_TOKENS = 32768  # configs/qwen2.5-{7b,1.5b}-*.yaml learner.micro_batch_tokens
RECIPE_LENGTHS = {
    "mean": 10300,
    "min": 512,
    "max": 30000,
}  # tokens at RECIPE_ROW_TOKENS (bench/time_model.py, rl.sampling)
TARGETS = {"speedup_vs_liger_min": 1.15, "mfu_min": 0.5, "peak_gib_max": 80}


def _sides(text: str) -> tuple[str, ...]:
    """`--sides`: which implementations run, in order."""
    sides = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in sides if t not in SIDES]
    if bad or not sides:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of {', '.join(SIDES)}")
    return sides


def _recompute_order(text: str) -> tuple[str, ...]:
    """`--recompute`: the recomputation modes to try, in order, until one fits in memory."""
    order = RECOMPUTE if text == "auto" else tuple(t.strip() for t in text.split(","))
    bad = [t for t in order if memory_option(t) is None]
    if bad or not order:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give auto or a comma-separated list of {', '.join(MEMORY_OPTIONS)}"
        )
    return order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument(
        "--rows",
        choices=["recipe", "single"],
        default="recipe",
        help="recipe: packed rows of trajectories drawn like the recipe's; single: one --seq row a rank",
    )
    ap.add_argument("--seq", type=int, default=16384, help="--rows single: tokens per sequence, one sequence per rank")
    ap.add_argument(
        "--row-tokens",
        type=int,
        default=RECIPE_ROW_TOKENS,
        help="--rows recipe: a packed row's capacity (the recipes' micro_batch_tokens)",
    )
    ap.add_argument("--rows-per-rank", type=int, default=2, help="--rows recipe: packed rows a rank trains per step")
    ap.add_argument(
        "--length-mean",
        type=float,
        default=None,
        help=f"trajectory tokens, mean of the clipped log-normal (default {RECIPE_LENGTHS['mean']:,} "
        f"scaled by --row-tokens / {RECIPE_ROW_TOKENS:,})",
    )
    ap.add_argument(
        "--length-min", type=int, default=None, help=f"shortest trajectory (default {RECIPE_LENGTHS['min']} scaled)"
    )
    ap.add_argument(
        "--length-max", type=int, default=None, help=f"longest trajectory (default {RECIPE_LENGTHS['max']:,} scaled)"
    )
    ap.add_argument("--length-sigma", type=float, default=0.6, help="the log-normal's sigma (spread of log length)")
    ap.add_argument(
        "--sides", type=_sides, default=SIDES, help=f"--rows recipe: comma-separated, of {', '.join(SIDES)}"
    )
    ap.add_argument("--baseline-attn", default="sdpa", help="the baselines' attn_implementation (transformers')")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="add this run's sides to the record under --name "
        "(the --nproc wrapper passes it to every side after the first)",
    )
    ap.add_argument(
        "--more-attempts",
        action="store_true",
        help="keep the side's earlier attempts in the record (the --nproc wrapper's later options of a side)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps (after --warmup); default 4 recipe, 5 single")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument(
        "--recompute",
        type=_recompute_order,
        default="auto",
        help="none, mlp or layers, or several tried in order until one fits (e.g. mlp,layers); auto: "
        "none,mlp,layers (every attempt recorded)",
    )
    ap.add_argument(
        "--card-gib",
        type=float,
        default=80.0,
        help="GiB of GPU memory each rank may use (torch's per-process cap, where the card has more): "
        "the memory options are chosen as on a card of that size (default 80: A100/H100 80 GB; "
        "0: the whole card)",
    )
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per chunk of the vocabulary head")
    ap.add_argument(
        "--liger-compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="the Liger side's chunked loss under torch.compile (Liger's own default; auto: on GPU), or "
        "eager where its compilation fails on the device's torch",
    )
    ap.add_argument(
        "--head-kernels",
        choices=["auto", "compiled", "eager"],
        default="auto",
        help="the fused vocabulary head's element-wise work (auto: compiled on GPU)",
    )
    ap.add_argument(
        "--grad-reduce",
        choices=["fp32", "bf16"],
        default="fp32",
        help="ours: the gradient reduction's dtype, accumulation staying fp32 (fp32: the learner's default)",
    )
    ap.add_argument(
        "--fuse-pointwise",
        choices=["auto", "on", "off"],
        default="auto",
        help="ours: RMSNorm, rotary and SwiGLU as compiled functions (services/learner/pointwise.py); auto: on GPU",
    )
    ap.add_argument(
        "--layer-units",
        choices=["on", "off"],
        default="on",
        help="ours: each decoder layer one ZeRO-3 unit (DeepSpeed leaf module; EngineConfig.zero3_layer_units)",
    )
    ap.add_argument(
        "--persist-gib",
        type=float,
        default=None,
        help="ours: GiB per rank of weights ZeRO-3 keeps whole (EngineConfig.persistent_weights_gib; "
        "default: the learner's; 0: shard all)",
    )
    ap.add_argument(
        "--nccl-proto",
        default=None,
        help="ours: NCCL_PROTO (EngineConfig.nccl_protocol; default: the "
        "learner's; 'nccl': NCCL's own choice). The baseline keeps NCCL's choice.",
    )
    ap.add_argument(
        "--packed-attention",
        choices=["auto", "varlen", "varlen-gqa", "per-sequence", "mask"],
        default=None,
        help="ours: how a packed row's sequences are kept apart (EngineConfig.packed_attention; default: the "
        "learner's)",
    )
    ap.add_argument("--reduce-bucket", type=float, default=50, help="ours: ZeRO reduce bucket, millions of elements")
    ap.add_argument("--sdpa", default="cudnn+flash", help="SDPA kernel order on GPU ('default': PyTorch's)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (ours)")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument(
        "--profile", action="store_true", help="profile one more step of ours (bench/results/<name>_profile.txt)"
    )
    ap.add_argument(
        "--baseline-checkpointing",
        choices=["auto", "off", "on"],
        default="auto",
        help="auto: without, then with gradient checkpointing on OOM (in new processes under several ranks)",
    )
    ap.add_argument(
        "--skip-ours",
        action="store_true",
        help="measure the baseline alone (in processes of its own, "
        "so nothing of ours holds memory) and complete the record ours left under --name",
    )
    ap.add_argument("--nproc", type=int, default=None, help="not under torchrun: launch this many ranks under it")
    ap.add_argument("--name", default="learner_multigpu", help="results file stem under bench/results/")
    ap.add_argument(
        "--plot",
        nargs="+",
        metavar="LABEL=JSON",
        default=None,
        help="draw bench/results/<name>.png and exit: the first record with its baseline, then other runs "
        "of ours from the same machine, each labelled",
    )
    ap.add_argument("--workdir", default=None, help="where the random-init model is written (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.rows == "recipe" else 5
    scale = args.row_tokens / RECIPE_ROW_TOKENS
    for key in ("mean", "min", "max"):
        if getattr(args, f"length_{key}") is None:
            setattr(args, f"length_{key}", max(2, round(RECIPE_LENGTHS[key] * scale)))
    if not args.length_min <= args.length_mean <= args.length_max <= args.row_tokens:
        ap.error("need --length-min <= --length-mean <= --length-max <= --row-tokens")
    return args


def launched() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def one_rank_env() -> None:
    """The environment of a process group of this process alone (not under torchrun)."""
    from services.learner.engine import free_port

    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    )


def without(argv: list[str], flag: str) -> list[str]:
    """argv less `flag` and its value (`flag V` or `flag=V`)."""
    return [
        a for i, a in enumerate(argv) if a != flag and (i == 0 or argv[i - 1] != flag) and not a.startswith(flag + "=")
    ]


def relaunch(args: argparse.Namespace, argv: list[str], extra: tuple[str, ...] = ()) -> int:
    """Run this script under torchrun with --nproc ranks (the wrapper form of the single command)."""
    from services.learner.engine import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve()),
        *without(argv, "--nproc"),
        *extra,
    ]
    return subprocess.call(cmd)


OOM_EXIT = 75  # a rank that ran out of memory under several ranks ends its launch with this status
OOM_MARK = "STAR_BENCH_OOM_MARK"  # where that rank writes its error, for the --nproc wrapper


def side_options(args: argparse.Namespace, side: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """A side's memory options in the order they are tried: (record key, value, the child's arguments)."""
    if side == "ours":
        return [("recompute", r, ("--recompute", r)) for r in args.recompute]
    choice = {"auto": (False, True), "off": (False,), "on": (True,)}[args.baseline_checkpointing]
    return [("gradient_checkpointing", c, ("--baseline-checkpointing", "on" if c else "off")) for c in choice]


def relaunch_sides(args: argparse.Namespace, argv: list[str]) -> int:
    """Each side under torchrun in processes of its own, in turn, each adding itself to the record; a side
    that fails does not stop the next. Under several ranks each memory option of a side is a launch of its
    own: ranks do not run out of memory at the same instruction, and one that goes on to the next option
    while another still waits in the last one's collective hangs both. A rank out of memory ends its launch
    (`OOM_EXIT`), and the next option starts in fresh processes. Returns the worst exit status."""
    rest = [
        a
        for a in without(without(without(argv, "--sides"), "--recompute"), "--baseline-checkpointing")
        if a not in ("--merge", "--more-attempts")
    ]
    codes = []
    launches = 0
    if not args.merge:  # a new record: nothing of an earlier run's may pass for this one's
        record_path(args).unlink(missing_ok=True)
    for side in args.sides:
        print(f"[{time.strftime('%H:%M:%S')}] side {side}: {args.nproc} ranks", flush=True)
        forget_side(args, side)
        options = side_options(args, side)
        for j, (key, value, option) in enumerate(options):
            merge = ("--merge",) if launches or args.merge else ()
            mark = record_path(args).with_suffix(".oom")
            mark.unlink(missing_ok=True)
            os.environ[OOM_MARK] = str(mark)
            code = relaunch(args, rest, ("--sides", side, *option, *merge, *(("--more-attempts",) if j else ())))
            launches += 1
            oom = mark.read_text() if mark.is_file() else None
            mark.unlink(missing_ok=True)
            fitted = record_option_outcome(args, side, key, value, code, oom, last=j == len(options) - 1)
            if fitted is not False:  # it ran (or failed other than by memory): the side is done
                if code:
                    print(f"[{time.strftime('%H:%M:%S')}] side {side} exited with {code}", flush=True)
                codes.append(code)
                break
            print(f"[{time.strftime('%H:%M:%S')}] side {side}: out of memory with {key}={value}", flush=True)
        else:
            codes.append(0)  # out of memory with every option: recorded, not a failure of the benchmark
    return max(codes)


def record_path(args: argparse.Namespace) -> Path:
    return ROOT / "bench" / "results" / f"{args.name}.json"


def write_record(out: Path, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")


def forget_side(args: argparse.Namespace, side: str) -> None:
    """Before a side's first option: a record kept from an earlier run holds nothing of this side, so what
    the launches add is this run's alone."""
    out = record_path(args)
    if not out.is_file():
        return
    record = json.loads(out.read_text())
    for key in ("sides", "attempts"):
        record.setdefault(key, {}).pop(side, None)
    write_record(out, record)


def record_option_outcome(
    args: argparse.Namespace, side: str, key: str, value: object, code: int, oom: str | None, *, last: bool
) -> bool | None:
    """After a launch of one option: False where it ran out of memory (the next option follows), True where
    it ran, None where it failed otherwise. A launch a rank ended out of memory (`oom`: its error) wrote no
    record of its own (rank 0 may have been the one waiting): the attempt is added here (to the JSON; the
    next launch, which merges it, writes the markdown)."""
    out = record_path(args)
    record = json.loads(out.read_text()) if out.is_file() else {"name": args.name}
    tries = record.setdefault("attempts", {}).setdefault(side, [])
    mine = [t for t in tries if t.get(key) == value]
    if oom is not None and not mine:
        tries.append({key: value, "oom": True, "error": oom[:600]})
        sides = record.setdefault("sides", {})
        sides[side] = {"oom": True, "error": "out of memory with every option"} if last else sides.get(side, {})
        finish_record(record)
        write_record(out, record)
        return False
    if mine and mine[-1].get("oom"):
        return False
    if code and not mine:  # a rank failed and ended the launch before any record of it
        record.setdefault("sides", {})[side] = {"error": f"a rank failed (exit {code}); its traceback is in the log"}
        tries.append({key: value, **record["sides"][side]})
        finish_record(record)
        write_record(out, record)
    return True if code == 0 and mine else None


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def setup(args: argparse.Namespace) -> tuple[int, int, bool]:
    import torch

    on_gpu = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
    if not on_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the engine picks gloo and fp32 on a machine without CUDA
    import deepspeed

    if on_gpu and not args.skip_ours and (args.rows == "single" or "ours" in args.sides):
        # NCCL reads its protocol when the first collective makes a communicator, so ours sets it here;
        # a baseline in these processes shares it (recorded), one run with --skip-ours keeps NCCL's choice
        from services.learner.config import EngineConfig
        from services.learner.nccl_env import set_learner_protocol

        set_learner_protocol(EngineConfig(**engine_options(args)).nccl_protocol)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        cap_memory(args.card_gib)
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), on_gpu


def cap_memory(card_gib: float) -> float | None:
    """Let this process allocate at most `card_gib` of its GPU (as on a card of that size); the fraction set,
    or None where the card is not larger or no cap is asked."""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if not card_gib or card_gib * 2**30 >= total:
        return None
    fraction = card_gib * 2**30 / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def build_model(args: argparse.Namespace, folder: Path, rank: int, on_gpu: bool) -> Path:
    """Rank 0 writes the random-init model once; the others wait for it."""
    import torch
    from transformers import Qwen2ForCausalLM

    if rank == 0 and not (folder / "config.json").is_file():
        # `layers` (bench/layer_memory.py): the shape's width with fewer layers
        config = qwen2_config(args.shape, max(32768, args.seq, args.row_tokens), getattr(args, "layers", None))
        torch.manual_seed(0)
        with torch.device("cuda" if on_gpu else "cpu"):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16 if on_gpu else torch.float32)
        model.save_pretrained(folder, safe_serialization=True)
        del model
    torch.distributed.barrier()
    return folder


def host_facts(on_gpu: bool) -> dict:
    """What differs between machines of one kind and moves a host-bound step: the CPU model, the GPUs'
    clocks and power limit (nvidia-smi), NCCL settings from the environment."""
    facts: dict = {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if on_gpu:
        query = "clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu,pstate"
        try:
            done = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            facts["gpus"] = [
                dict(zip(query.split(","), (v.strip() for v in line.split(","))))
                for line in done.stdout.strip().splitlines()
            ]
        except (OSError, subprocess.SubprocessError):
            pass
    return facts


def peak_gib(on_gpu: bool) -> float | None:
    """The largest per-rank peak of allocated GPU memory (None on CPU)."""
    import torch

    if not on_gpu:
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return round(float(peak.item()), 2)


def resident_gib(on_gpu: bool) -> float | None:
    """The largest per-rank GPU memory still allocated between steps (weights, gradients and optimizer state as
    ZeRO-3 holds them; a step's activations are gone by then). None on CPU."""
    import torch

    if not on_gpu:
        return None
    torch.cuda.synchronize()
    now = torch.tensor([torch.cuda.memory_allocated() / 2**30], device="cuda")
    torch.distributed.all_reduce(now, op=torch.distributed.ReduceOp.MAX)
    return round(float(now.item()), 2)


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def release(on_gpu: bool) -> None:
    import torch

    gc.collect()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def summary(
    step_s: list[float],
    tokens: list[int],
    flops: list[float],
    flops_half: list[float],
    world: int,
    peak: float | None,
    mem: float | None,
) -> dict:
    """A side's figures from its timed steps (`tokens`, `flops`: each step's). Steps of equal work: the median
    step; steps of different work (recipe rows): the timed steps' work over their time. tokens_per_s_min/max:
    the spread of the steps' own rates."""
    s = statistics.median(step_s)
    if len(set(tokens)) == 1:
        time_, tok, fl, half = s, tokens[0], flops[0], flops_half[0]
    else:
        time_, tok, fl, half = sum(step_s), sum(tokens), sum(flops), sum(flops_half)
    rates = [t / x for t, x in zip(tokens, step_s)]
    return {
        "step_s": round(s, 4),
        "tokens_per_s": round(tok / time_, 1),
        "tokens_per_s_min": round(min(rates), 1),
        "tokens_per_s_max": round(max(rates), 1),
        "mfu": round(fl / time_ / (peak * world), 4) if peak else None,
        "mfu_causal_half": round(half / time_ / (peak * world), 4) if peak else None,
        "peak_gib": mem,
        "steps_s": [round(x, 4) for x in step_s],
        "tokens_per_step": tokens,
    }


def length_location(mean: float, sigma: float, low: float, high: float) -> float:
    """The log-normal's mu whose draws, clipped to [low, high], average `mean` (bisection on the closed form
    E[clip(X, low, high)] = low·P(X<low) + high·P(X>high) + e^(mu+sigma²/2)·[Φ(b-sigma) - Φ(a-sigma)])."""

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    def clipped_mean(mu: float) -> float:
        a, b = (math.log(low) - mu) / sigma, (math.log(high) - mu) / sigma
        return low * phi(a) + high * (1 - phi(b)) + math.exp(mu + sigma**2 / 2) * (phi(b - sigma) - phi(a - sigma))

    lo, hi = math.log(low) - 10 * sigma, math.log(high) + 10 * sigma
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    return (lo + hi) / 2


def recipe_lengths(args: argparse.Namespace, step: int, world: int):
    """The step's trajectory lengths and the generator that then draws their tokens: the longest prefix of a
    seeded stream of lengths that the learner packs into exactly --rows-per-rank rows a rank, every rank the
    same count (so no filler rows); a stream that has none such is replaced by the next (another seed)."""
    import torch

    from services.learner.batching import Sequence_, pack_sequences, shard_rows

    mu = length_location(args.length_mean, args.length_sigma, args.length_min, args.length_max)
    want = args.rows_per_rank * world
    for attempt_ in range(100):
        g = torch.Generator().manual_seed(1_000_003 * step + attempt_)
        lengths: list[int] = []
        while sum(lengths) <= want * args.row_tokens:
            x = float(torch.empty(1).log_normal_(mu, args.length_sigma, generator=g))
            lengths.append(int(min(max(round(x), args.length_min), args.length_max)))
        for n in range(len(lengths), 0, -1):
            rows = pack_sequences([Sequence_([0] * m, [0] * m) for m in lengths[:n]], args.row_tokens)
            if len(rows) < want:
                break
            shares = [sum(int(r.seq_index[0]) >= 0 for r in shard_rows(rows, world, k)) for k in range(world)]
            if len(rows) == want and shares == [args.rows_per_rank] * world:
                return lengths[:n], g
    raise RuntimeError(f"no stream of trajectories packs into {args.rows_per_rank} rows a rank of {world}")


def recipe_sequences(args: argparse.Namespace, step: int, world: int, vocab: int) -> list:
    """The step's trajectories, the same on every rank and every side (`recipe_lengths`)."""
    from bench.learner_gpu import _trajectory

    lengths, g = recipe_lengths(args, step, world)
    return [_trajectory(i, m, g, vocab) for i, m in enumerate(lengths)]


def step_sequences(args: argparse.Namespace, step: int, world: int, vocab: int) -> list:
    """The whole step's sequences, the same on every rank and side (rl_step and the baselines each take
    this rank's rows of them)."""
    if args.rows == "recipe":
        return recipe_sequences(args, step, world, vocab)
    from bench.learner_gpu import sequences

    return sequences(world, args.seq, seed=step, vocab=vocab)


def row_capacity(args: argparse.Namespace) -> int:
    return args.row_tokens if args.rows == "recipe" else args.seq


def rows_per_rank(args: argparse.Namespace) -> int:
    return args.rows_per_rank if args.rows == "recipe" else 1


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the options given on the command line (the rest stay the learner's)."""
    out: dict = {}
    if args.persist_gib is not None:
        out["persistent_weights_gib"] = args.persist_gib
    if args.nccl_proto is not None:
        out["nccl_protocol"] = None if args.nccl_proto == "nccl" else args.nccl_proto
    if getattr(args, "packed_attention", None) is not None:
        out["packed_attention"] = args.packed_attention
    return out


def run_ours(args: argparse.Namespace, model_dir: Path, rank: int, world: int, on_gpu: bool, recompute: str) -> dict:
    from services.learner.config import EngineConfig, ScheduleConfig
    from services.learner.engine import PolicyEngine
    from services.learner.flops import model_shape, peak_flops, train_flops
    from services.learner.steps import rl_step

    cfg = EngineConfig(
        zero_stage=3,
        precision="auto",
        micro_batch_tokens=row_capacity(args),
        micro_batch_rows=1,
        pad_to_multiple=256 if on_gpu else 1,
        logprob_chunk_tokens=args.chunk,
        head_kernels=args.head_kernels,
        **memory_option(recompute),
        attn_implementation="sdpa",
        sdpa_backends=None if args.sdpa == "default" else args.sdpa.split("+"),
        compile_layers=args.compile,
        zero_init=True,
        grad_reduce_dtype=args.grad_reduce,
        fuse_pointwise={"on": True, "off": False}.get(args.fuse_pointwise),
        overlap_comm=on_gpu,
        reduce_bucket_size=int(args.reduce_bucket * 1e6),
        zero3_layer_units=args.layer_units == "on",
        **engine_options(args),
    )
    engine = PolicyEngine(model_dir, cfg, ScheduleConfig(lr=2e-6), total_steps=100)
    n_params = engine.num_parameters()
    layers, width = model_shape(engine.lm_config)
    log(
        rank,
        f"ours: {n_params / 1e9:.3f} B params, {world} ranks, ZeRO-3, bf16={engine.bf16}, "
        f"recompute={recompute}, packed attention {cfg.packed_attention}",
    )
    times, tokens, flops, half = [], [], [], []
    try:
        for k in range(args.warmup + args.steps):
            if os.environ.get("STAR_BENCH_OOM") == f"{recompute}:{rank}":  # fault injection (the wrapper's test)
                import torch

                raise torch.OutOfMemoryError(f"CUDA out of memory (injected on rank {rank})")
            # the whole step's sequences: rl_step packs them and hands each rank its rows
            seqs = step_sequences(args, k, world, engine.lm_config.vocab_size)
            m = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28).metrics
            log(
                rank,
                f"ours step {k}: {m['time_compute_s']:.3f} s, {m['tokens_per_s']:.0f} tok/s, "
                f"mfu {m.get('mfu', float('nan')):.3f}, loss {m['loss']:.4f}",
            )
            if k >= args.warmup:
                lens = [len(q) for q in seqs]
                times.append(m["time_compute_s"])
                tokens.append(sum(lens))
                flops.append(train_flops(n_params, layers, width, lens))
                half.append(train_flops(n_params, layers, width, lens, causal_half=True))
        where = profile_step(engine, world, args, rank, on_gpu) if args.profile else None
        out = summary(times, tokens, flops, half, world, peak_flops() if on_gpu else None, peak_gib(on_gpu))
        return {
            "params": n_params,
            "layers": layers,
            "resident_gib": resident_gib(on_gpu),
            "recompute": recompute,
            "chunk": args.chunk,
            "head_kernels": args.head_kernels,
            "grad_reduce": args.grad_reduce,
            "compile_layers": args.compile,
            "fuse_pointwise": args.fuse_pointwise,
            "reduce_bucket_m": args.reduce_bucket,
            "layer_units": args.layer_units,
            "persistent_weights_gib": cfg.persistent_weights_gib,
            "packed_attention": cfg.packed_attention,
            "sdpa": args.sdpa,
            "nccl_proto": os.environ.get("NCCL_PROTO"),
            **({"profile": where} if where else {}),
            **out,
        }
    finally:
        engine.close()
        del engine
        release(on_gpu)


def profile_step(engine, world: int, args: argparse.Namespace, rank: int, on_gpu: bool) -> dict:
    """One more step of ours under torch.profiler: where its time goes, by operator (rank 0's view),
    written to bench/results/<name>_profile.txt; returned: the step's time and its operators of most
    self time (device time on GPU)."""
    from torch.profiler import ProfilerActivity, profile

    from services.learner.steps import rl_step

    seqs = step_sequences(args, 10_000, world, engine.lm_config.vocab_size)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        seconds = rl_step(engine, seqs, eps_low=0.2, eps_high=0.28).metrics["time_compute_s"]
    averages = prof.key_averages()
    path = ROOT / "bench" / "results" / f"{args.name}_profile.txt"
    if rank == 0:
        key = "cuda_time_total" if on_gpu else "cpu_time_total"
        table = averages.table(sort_by=key, row_limit=45, max_name_column_width=70)
        path.write_text(
            f"# one step of ours under torch.profiler ({seconds:.3f} s with the profiler on), "
            f"shape {args.shape}, rows {args.rows}, {world} ranks, sorted by {key}\n\n{table}\n"
        )
        log(rank, f"profile: {path}")
    return {
        "step_s": round(seconds, 4),
        "file": str(path.relative_to(ROOT)),
        "top_self": top_operators(averages, on_gpu),
    }


def top_operators(averages, on_gpu: bool, n: int = 12) -> list[dict]:
    """The `n` operators of most self time in a profile (device time on GPU, host time on CPU), in ms."""

    def self_us(e) -> float:
        if not on_gpu:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    events = sorted(averages, key=self_us, reverse=True)[:n]
    total = sum(self_us(e) for e in averages) or 1.0
    return [
        {
            "op": e.key[:90],
            "self_ms": round(self_us(e) / 1000, 2),
            "share": round(self_us(e) / total, 4),
            "calls": e.count,
        }
        for e in events
    ]


def liger_kernels(on_gpu: bool) -> tuple[object | None, list[str], str | None]:
    """Liger-Kernel's GRPO loss class, the kernels applied to HF's Qwen2 (before the model is built), and why
    a part is missing: (None, [], reason) without the package; the loss alone without CUDA (its Triton kernels
    do not run on CPU)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2
    except ImportError as exc:
        return None, [], f"liger-kernel not importable: {exc}"
    if not on_gpu:
        return LigerFusedLinearGRPOLoss, [], "no CUDA: Liger's Triton kernels (RoPE, RMSNorm, SwiGLU) not applied"
    apply_liger_kernel_to_qwen2(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
    )
    return LigerFusedLinearGRPOLoss, ["rope", "rms_norm", "swiglu", "fused_linear_cross_entropy"], None


def liger_policy(lm, loss_cls, chunk: int, compiled: bool):
    """The Liger side's module: HF's decoder, then Liger's fused linear GRPO loss on its last hidden states
    (as TRL's use_liger_loss); forward(ids, positions, targets, mask, old logprobs, advantages) → loss.
    Tokens go to the loss as rows of one ([N, 1, H]): its advantages are one per row and a packed row
    holds several trajectories, so this keeps each token's own advantage; DAPO's normalizer (loss tokens of
    the micro-batch) is the same token mean. The token rows are padded (masked out) to a whole number of
    chunks: every chunk then has one shape and the compiled chunk function compiles once (with a ragged last
    chunk, torch 2.11's automatic dynamic shapes failed building its guards on the second shape)."""
    import torch
    import torch.nn.functional as F

    class _Policy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm
            self.loss = loss_cls(
                beta=0.0,
                use_ref_model=False,
                compiled=compiled,
                chunk_size=chunk,
                epsilon_low=0.2,
                epsilon_high=0.28,
                loss_type="dapo",
                temperature=1.0,
            )

        def forward(self, ids, positions, targets, mask, old, adv, **bounds):
            hidden = self.lm.model(input_ids=ids, position_ids=positions, use_cache=False, **bounds).last_hidden_state
            extra = -hidden.shape[0] * hidden.shape[1] % chunk  # masked tokens up to a whole chunk

            def one(t):  # [B, T] → one token a row, padded
                return F.pad(t.reshape(-1), (0, extra)).reshape(-1, 1)

            rows = F.pad(hidden.reshape(-1, hidden.shape[-1]), (0, 0, 0, extra)).unsqueeze(1)
            loss, _ = self.loss(
                rows,
                self.lm.lm_head.weight,
                one(targets),
                one(mask),
                one(adv).reshape(-1).float(),
                old_per_token_logps=one(old).float(),
            )
            return loss

    return _Policy()


def baseline_ds_config(on_gpu: bool, world: int, micro_batches: int, ours: dict | None = None) -> dict:
    """The baselines' plain ZeRO-3 (as ../shared/tools/deepspeed_zero3_probe.py), with DeepSpeed's own
    gradient accumulation over the rank's `micro_batches` rows of a step. `ours`: our engine's DeepSpeed
    config, whose weight persistence (the ZeRO-3 weights kept whole) and gradient-reduce dtype the baseline
    then takes, so that neither side differs from the other there."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batches * world,
        "bf16": {"enabled": on_gpu},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": on_gpu,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-6, "torch_adam": True, "adam_w_mode": True}},
        "steps_per_print": 10**9,
    }
    if on_gpu:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if ours:
        zero = ours.get("zero_optimization", {})
        cfg["zero_optimization"].update({k: zero[k] for k in PERSISTENCE_KEYS if k in zero})
        if "communication_data_type" in ours:
            cfg["communication_data_type"] = ours["communication_data_type"]
    return cfg


PERSISTENCE_KEYS = ("stage3_param_persistence_threshold", "stage3_model_persistence_threshold")


def ours_ds_config(args: argparse.Namespace, on_gpu: bool, world: int) -> dict:
    """Our engine's DeepSpeed config for these options (services/learner/engine.py deepspeed_config)."""
    from services.learner.config import EngineConfig
    from services.learner.engine import deepspeed_config

    cfg = EngineConfig(zero_stage=3, grad_reduce_dtype=args.grad_reduce, **engine_options(args))
    return deepspeed_config(cfg, bf16=on_gpu, world_size=world, on_gpu=on_gpu)


def hf_labels(batch) -> object:
    """HF's `labels` for a packed micro-batch: HF predicts labels[t + 1] at t, so labels[t + 1] is the learner's
    target at t where it carries loss, and -100 elsewhere (never across a trajectory's boundary)."""
    import torch

    labels = torch.full_like(batch.input_ids, -100)
    labels[:, 1:] = torch.where(batch.mask[:, :-1] > 0, batch.targets[:, :-1], -100)
    return labels


def run_baseline(
    args: argparse.Namespace,
    model_dir: Path,
    rank: int,
    world: int,
    on_gpu: bool,
    checkpointing: bool,
    side: str = "plain",
) -> dict:
    """A baseline under plain DeepSpeed ZeRO-3 on the rows ours trains: plain (HF's model and loss over the
    full logits) or liger (HF's model with Liger's kernels and fused GRPO loss)."""
    import deepspeed
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    from services.learner.attention import PACKED_IMPLEMENTATIONS, packed_kwargs
    from services.learner.batching import rank_micro_batches
    from services.learner.flops import model_shape, peak_flops, train_flops

    bf16 = on_gpu
    ds_cfg = baseline_ds_config(on_gpu, world, rows_per_rank(args), ours_ds_config(args, on_gpu, world))
    extra: dict = {}
    if side == "liger":
        loss_cls, kernels, missing = liger_kernels(on_gpu)
        if loss_cls is None:
            return {"skipped": missing}
        extra = {
            "liger_kernels": kernels,
            "liger_loss": "LigerFusedLinearGRPOLoss(loss_type=dapo, beta=0)",
            **({"liger_missing": missing} if missing else {}),
        }
    attn = args.baseline_attn if args.rows == "recipe" else "sdpa"
    config = AutoConfig.from_pretrained(model_dir, attn_implementation=attn)
    # Built as the probe builds it: random init, each parameter partitioned as it is created. (Loaded
    # through from_pretrained instead, the first step's full fp32 logits ran out of memory on 80 GB.)
    # Seeded: every attention implementation of a baseline starts from the same weights.
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg, dtype=torch.bfloat16 if bf16 else torch.float32):
        model = Qwen2ForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    module = model
    if side == "liger":
        compiled = on_gpu if args.liger_compile == "auto" else args.liger_compile == "on"
        extra["liger_compiled"] = compiled
        module = liger_policy(model, loss_cls, args.chunk, compiled=compiled)
        # the loss reads the head's weight directly, not through lm_head's forward (whose hooks would gather it)
        deepspeed.zero.register_external_parameter(module, model.lm_head.weight)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=ds_cfg)
    device = engine.device
    pad = 256 if on_gpu else 1
    times, tokens, flops, half, losses = [], [], [], [], []
    layers, width = model_shape(config)
    log(
        rank,
        f"{side}: HF model{' + Liger' if side == 'liger' else ''}, ZeRO-3, checkpointing={checkpointing}, "
        f"attention {attn}{', ' + str(extra) if extra else ''}",
    )
    try:
        for k in range(args.warmup + args.steps):
            seqs = step_sequences(args, k, world, config.vocab_size)
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            batches = rank_micro_batches(seqs, row_capacity(args), world, rank, 1, pad)
            if len(batches) != rows_per_rank(args):
                raise RuntimeError(
                    f"{len(batches)} micro-batches on rank {rank}, DeepSpeed set for {rows_per_rank(args)}"
                )
            for b in batches:
                ids, pos = b.input_ids.to(device), b.position_ids.to(device)
                # a varlen attention registered with transformers: the row's boundaries once per row, as
                # transformers' own flattening collator hands them (cu_seq_lens_q/k, max_length_q/k)
                bounds = packed_kwargs(pos) if attn in PACKED_IMPLEMENTATIONS else {}
                if side == "liger":
                    loss = engine(
                        ids,
                        pos,
                        b.targets.to(device),
                        b.mask.to(device),
                        b.old_logp.to(device),
                        b.advantages.to(device),
                        **bounds,
                    )
                elif args.rows == "recipe":
                    # use_cache=False: with a cache (HF's default outside gradient checkpointing) transformers
                    # reads no packed sequences from the position ids and attends across trajectories
                    loss = engine(
                        input_ids=ids, position_ids=pos, labels=hf_labels(b).to(device), use_cache=False, **bounds
                    ).loss
                else:
                    loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()  # DeepSpeed's boundary: the optimizer steps after the rank's last row
            if on_gpu:
                torch.cuda.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(dt, op=torch.distributed.ReduceOp.MAX)  # the slowest rank's step
            log(rank, f"{side} step {k}: {dt.item():.3f} s, loss {loss.item():.4f}")
            losses.append(round(float(loss.item()), 6))
            if k >= args.warmup:
                lens = [len(q) for q in seqs]
                times.append(float(dt.item()))
                tokens.append(sum(lens))
                flops.append(train_flops(n_params, layers, width, lens))
                half.append(train_flops(n_params, layers, width, lens, causal_half=True))
        out = summary(times, tokens, flops, half, world, peak_flops() if on_gpu else None, peak_gib(on_gpu))
        zero = ds_cfg["zero_optimization"]
        return {
            "params": n_params,
            "gradient_checkpointing": checkpointing,
            "attn_implementation": attn,
            "nccl_proto": os.environ.get("NCCL_PROTO"),
            "grad_reduce": ds_cfg.get("communication_data_type"),
            "persistence": {k: zero[k] for k in PERSISTENCE_KEYS if k in zero},
            "losses": losses,
            **extra,
            **out,
        }
    finally:
        engine.destroy()
        del engine, model, module
        release(on_gpu)


def attempt(fn, *a, **kw) -> dict:
    """Run a side; an out-of-memory is recorded, not fatal. Under several ranks it ends the process
    (`OOM_EXIT`; the ranks need not run out at the same point, and the others may be waiting in a
    collective): the --nproc wrapper records it and launches the next option. A failed option's engine
    and activations stay alive through the exception's traceback
    (DeepSpeed's engine in reference cycles besides), so they are collected here, once the exception is
    gone: the next option starts from an empty GPU, not beside the last one's leftovers. `left_gib`: what
    was still allocated after that (a leak shows there)."""
    error = None
    try:
        result = fn(*a, **kw)
    except Exception as exc:
        if not is_oom(exc):
            raise
        error, result = f"OOM: {str(exc)[:600]}", {}
    if error is None:
        return result
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # the other ranks may be waiting in this option's collectives: only a new launch is safe
        print(f"rank {dist.get_rank()}: {error[:300]}", flush=True)
        if mark := os.environ.get(OOM_MARK):  # torchrun reports any failed rank as 1: the wrapper reads this
            Path(mark).write_text(error)
        os._exit(OOM_EXIT)

    on_gpu = torch.cuda.is_available()
    release(on_gpu)
    return {
        "oom": True,
        "error": error,
        "left_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if on_gpu else None,
    }


def recipe_rows_facts(args: argparse.Namespace, world: int, on_gpu: bool) -> dict:
    """What the recipe rows were: the length distribution and, per timed step, the trajectories drawn."""
    steps = []
    for k in range(args.warmup, args.warmup + args.steps):
        lengths, _ = recipe_lengths(args, k, world)
        steps.append(
            {
                "step": k,
                "trajectories": len(lengths),
                "tokens": sum(lengths),
                "mean": round(sum(lengths) / len(lengths)),
                "max": max(lengths),
                "min": min(lengths),
            }
        )
    every = [s["tokens"] / s["trajectories"] for s in steps]
    return {
        "mode": "recipe",
        "row_tokens": args.row_tokens,
        "rows_per_rank": args.rows_per_rank,
        "pad_to_multiple": 256 if on_gpu else 1,
        "lengths": {
            "distribution": "log-normal, clipped",
            "mean": args.length_mean,
            "min": args.length_min,
            "max": args.length_max,
            "sigma": args.length_sigma,
            "mu": round(length_location(args.length_mean, args.length_sigma, args.length_min, args.length_max), 4),
        },
        "drawn_mean": round(statistics.mean(every)),
        "timed_steps": steps,
    }


def finish_record(record: dict) -> None:
    """Ratios, ours' figures at the top level (as the single-row record has them) and the targets."""
    sides = record["sides"]
    ours, liger, plain = (sides.get(k) or {} for k in SIDES)

    def ratio(a: dict, b: dict) -> float | None:
        return (
            round(a["tokens_per_s"] / b["tokens_per_s"], 3) if a.get("tokens_per_s") and b.get("tokens_per_s") else None
        )

    record["speedup_vs_liger"] = ratio(ours, liger)
    record["speedup_vs_plain"] = ratio(ours, plain)
    for key in ("tokens_per_s", "mfu", "mfu_causal_half", "peak_gib", "step_s"):
        record[key] = ours.get(key)
    record["targets"] = TARGETS
    record["targets_met"] = {
        "speedup_vs_liger": None
        if record["speedup_vs_liger"] is None
        else record["speedup_vs_liger"] >= TARGETS["speedup_vs_liger_min"],
        "mfu": None if ours.get("mfu") is None else ours["mfu"] >= TARGETS["mfu_min"],
        "peak_gib": None if ours.get("peak_gib") is None else ours["peak_gib"] <= TARGETS["peak_gib_max"],
    }


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f} %"


def write_markdown(record: dict, path: Path) -> None:
    """The record as a table: one line per side, then the ratios against the targets and every attempt."""
    rows = record["rows"]
    cap = record.get("card_gib")
    lines = [
        f"# The learner on the recipe's rows: {record['world_size']}× {record['device']}, {record['shape']} shape, "
        f"ZeRO-3",
        "",
        *(
            [
                f"Each rank capped at {cap:g} GiB of GPU memory (as on an {cap:g} GB card): memory options "
                "are chosen as there.",
                "",
            ]
            if cap
            else []
        ),
        f"Written by `bench/learner_multigpu.py` (`{record['name']}.json`). Rows: {rows['rows_per_rank']} packed rows "
        f"of {rows['row_tokens']:,} tokens a rank and step, trajectories of log-normal lengths (sigma "
        f"{rows['lengths']['sigma']}) clipped to {rows['lengths']['min']:,}-{rows['lengths']['max']:,}, mean "
        f"{rows['lengths']['mean']:,} (drawn: {rows['drawn_mean']:,}); the same rows for every side. "
        f"tokens/s: trajectory tokens over the timed steps' time (min-max of the steps' own rates).",
        "",
        "| side | tokens/s | min-max | MFU (PaLM) | MFU (causal-half) | peak GiB | step s | memory option |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {"ours": "ours (services.learner)", "liger": "HF + Liger-Kernel", "plain": "plain HF"}
    for side in SIDES:
        r = record["sides"].get(side)
        if r is None:
            continue
        if not r.get("tokens_per_s"):
            why = r.get("skipped") or r.get("error") or "out of memory"
            lines.append(f"| {names[side]} | {why} | | | | | | |")
            continue
        option = (
            f"recompute {r['recompute']}"
            if side == "ours"
            else "gradient checkpointing"
            if r.get("gradient_checkpointing")
            else "none"
        )
        lines.append(
            f"| {names[side]} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_min']:,.0f}-"
            f"{r['tokens_per_s_max']:,.0f} | {_pct(r['mfu'])} | {_pct(r['mfu_causal_half'])} | "
            f"{r['peak_gib'] if r['peak_gib'] is not None else ''} | {r['step_s']} | {option} |"
        )
    t = record["targets"]

    def times(x: float | None) -> str:
        return "n/a" if x is None else f"{x}×"

    lines += [
        "",
        f"ours / Liger: **{times(record['speedup_vs_liger'])}** (target ≥ {t['speedup_vs_liger_min']}×); "
        f"ours / plain: {times(record['speedup_vs_plain'])}; ours' MFU (PaLM) {_pct(record['mfu']) or 'n/a'} "
        f"(target ≥ {_pct(t['mfu_min'])}); peak {record['peak_gib'] or 'n/a'} GiB (target ≤ {t['peak_gib_max']} "
        f"at 1.5B). "
        f"Targets met: {record['targets_met']}.",
        "",
        "Attempts (each side's memory options, in order):",
        "",
    ]
    for side, tries in record["attempts"].items():
        for a in tries:
            option = {k: a[k] for k in ("recompute", "gradient_checkpointing") if k in a}
            outcome = a.get("error") or a.get("skipped") or f"{a.get('tokens_per_s', 0):,.0f} tokens/s"
            lines.append(f"- {side} {option}: {outcome}")
    liger = record["sides"].get("liger") or {}
    if liger.get("liger_missing") or liger.get("skipped"):
        lines += ["", f"Liger side: {liger.get('liger_missing') or liger.get('skipped')}."]
    if liger.get("liger_compiled") is False:
        lines += ["", "Liger's chunked loss ran eager (`--liger-compile off`), not under torch.compile."]
    how = (
        "the rows' cu_seq_lens through transformers' AttentionInterface"
        if record["baseline_attn"].startswith("star_")
        else "from position ids (transformers' block mask)"
    )
    lines += [
        "",
        f"Baselines' attention: `{record['baseline_attn']}`, {how}.",
        f"torch {record['torch']}, transformers {record['transformers']}, deepspeed {record['deepspeed']}, "
        f"liger-kernel {record['liger_kernel']}; {record['date']}.",
        "",
    ]
    path.write_text("\n".join(lines))


def run_recipe(args: argparse.Namespace, argv: list[str], model_dir: Path, rank: int, world: int, on_gpu: bool) -> int:
    """The sides on recipe rows, in these processes, the record (JSON and .md) rewritten after each side.
    A side that fails is recorded and the next one runs. Returns 1 where a side failed."""
    import traceback
    from importlib import metadata

    import torch

    out = record_path(args)
    record = json.loads(out.read_text()) if args.merge and out.is_file() else {}
    versions = {}
    for package in ("transformers", "deepspeed", "liger_kernel"):
        try:
            versions[package] = metadata.version(package.replace("_", "-"))
        except metadata.PackageNotFoundError:
            mod = sys.modules.get(package)
            versions[package] = getattr(mod, "__version__", None) if mod else None
    device = torch.cuda.get_device_name(0) if on_gpu else f"cpu ({platform.processor() or platform.machine()})"
    record.update(
        {
            "name": args.name,
            "device": device,
            "world_size": world,
            "zero_stage": 3,
            "shape": args.shape,
            "rows": recipe_rows_facts(args, world, on_gpu) if rank == 0 else None,
            "baseline_attn": args.baseline_attn,
            "host": host_facts(on_gpu),
            "card_gib": args.card_gib,
            "torch": torch.__version__,
            **versions,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    )
    for key in ("sides", "attempts", "commands"):
        record.setdefault(key, {})
    command = f"torchrun --nproc_per_node {world} bench/learner_multigpu.py {' '.join(argv)}"
    failed = False
    # in these processes Liger's patches of HF's Qwen2 classes would reach every side after it: liger last
    for side in sorted(args.sides, key=lambda x: x == "liger"):
        log(rank, f"side {side}: start")
        tries: list[dict] = list(record["attempts"].get(side, [])) if args.more_attempts else []
        result: dict = {}
        try:
            if side == "ours":
                options = [
                    ("recompute", r, lambda r=r: attempt(run_ours, args, model_dir, rank, world, on_gpu, r))
                    for r in args.recompute
                ]
            else:
                choice = {"auto": (False, True), "off": (False,), "on": (True,)}[args.baseline_checkpointing]
                options = [
                    (
                        "gradient_checkpointing",
                        c,
                        lambda c=c, side=side: attempt(run_baseline, args, model_dir, rank, world, on_gpu, c, side),
                    )
                    for c in choice
                ]
            for key, value, run in options:
                r = run()
                tries.append({key: value, **r})
                if not r.get("oom"):
                    result = r
                    break
            else:
                result = {"oom": True, "error": "out of memory with every option"}
        except Exception as exc:  # recorded; the next side still runs
            failed = True
            if world > 1:  # the other ranks may wait in a collective this one left: end the launch
                traceback.print_exc()
                sys.stdout.flush()
                os._exit(1)
            if rank == 0:
                traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            release(on_gpu)
        record["sides"][side] = result
        record["attempts"][side] = tries
        record["commands"][side] = command
        if rank == 0:
            finish_record(record)
            write_record(out, record)
            write_markdown(record, out.with_suffix(".md"))
        log(
            rank,
            f"side {side}: "
            + json.dumps(
                {
                    k: result.get(k)
                    for k in ("tokens_per_s", "mfu", "mfu_causal_half", "peak_gib", "step_s", "error", "skipped")
                }
            ),
        )
    if rank == 0:
        print(
            json.dumps(
                {
                    k: record.get(k)
                    for k in (
                        "device",
                        "world_size",
                        "tokens_per_s",
                        "mfu",
                        "peak_gib",
                        "speedup_vs_liger",
                        "speedup_vs_plain",
                    )
                }
            ),
            flush=True,
        )
        print(f"wrote {out} and {out.with_suffix('.md')}", flush=True)
    return 1 if failed else 0


def plot_runs(items: list[str], path: Path) -> None:
    """Tokens/s of each run of ours (LABEL=JSON) and of the first record's baseline, MFU written on each
    bar, with the tokens/s that 50 % MFU takes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for item in items:
        label, _, file = item.partition("=")
        if not file:
            raise SystemExit(f"--plot {item!r}: give LABEL=JSON")
        runs.append((label, json.loads(Path(file).read_text())))
    first = runs[0][1]
    bars = [(label, r["tokens_per_s"], r["mfu"]) for label, r in runs]
    if first.get("baseline"):
        base = first["baseline"]
        bars.append(
            (
                "plain ZeRO-3 (HF model + loss" + (", checkpointing)" if base.get("gradient_checkpointing") else ")"),
                base["tokens_per_s"],
                base["mfu"],
            )
        )
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(bars) + 1.4))
    ys = list(range(len(bars)))[::-1]
    ax.barh(ys, [b[1] for b in bars], color=["tab:blue"] * len(runs) + ["tab:gray"] * (len(bars) - len(runs)))
    for y, (_, tps, mfu) in zip(ys, bars):
        ax.text(tps, y, f" {tps / 1000:.1f}K, {100 * mfu:.1f} %", va="center", fontsize=8)
    ax.axvline(first["tokens_per_s"] * 0.5 / first["mfu"], color="tab:red", ls="--", lw=1, label="50 % MFU (PaLM)")
    ax.set_yticks(ys, [b[0] for b in bars], fontsize=8)
    ax.set_xlabel("tokens/s, both ranks")
    ax.set_xlim(0, max(b[1] for b in bars) * 1.3)
    ax.set_title(
        f"Learner, {first['shape']} shape, ZeRO-3, {first['seq']:,} tokens a rank\n"
        f"{first['world_size']}× {first['device']}, one job",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.plot:
        path = ROOT / "bench" / "results" / f"{args.name}.png"
        plot_runs(args.plot, path)
        print(f"wrote {path}")
        return 0
    if not launched():
        if args.nproc:
            return relaunch_sides(args, argv) if args.rows == "recipe" else relaunch(args, argv)
        one_rank_env()
    rank, world, on_gpu = setup(args)
    import tempfile

    import torch

    work = Path(args.workdir or tempfile.gettempdir()) / f"star-learner-multigpu-{args.shape}"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(args, work / "model", rank, on_gpu)
    if args.rows == "recipe":
        code = run_recipe(args, argv, model_dir, rank, world, on_gpu)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return code
    ours: dict = {}
    ours_attempts = []
    out = ROOT / "bench" / "results" / f"{args.name}.json"
    kept = (
        "params",
        "mfu",
        "mfu_causal_half",
        "tokens_per_s",
        "peak_gib",
        "step_s",
        "recompute",
        "chunk",
        "head_kernels",
        "grad_reduce",
        "compile_layers",
        "fuse_pointwise",
        "reduce_bucket_m",
        "layer_units",
        "persistent_weights_gib",
        "nccl_proto",
    )
    prev: dict = {}
    if args.skip_ours:
        prev = json.loads(out.read_text())
        ours, ours_attempts = {k: prev.get(k) for k in kept}, prev.get("attempts", [])
    for recompute in () if args.skip_ours else args.recompute:
        result = attempt(run_ours, args, model_dir, rank, world, on_gpu, recompute)
        ours_attempts.append({"recompute": recompute, **result})
        if not result.get("oom"):
            ours = result
            break
    baseline: dict = {}
    attempts = []
    if not args.skip_baseline:
        choice = {"auto": (False, True), "off": (False,), "on": (True,)}[args.baseline_checkpointing]
        for checkpointing in choice:
            result = attempt(run_baseline, args, model_dir, rank, world, on_gpu, checkpointing)
            attempts.append({"gradient_checkpointing": checkpointing, **result})
            if not result.get("oom"):
                baseline = result
                break
    if rank == 0:
        device = torch.cuda.get_device_name(0) if on_gpu else f"cpu ({platform.processor() or platform.machine()})"
        common = {"device": device, "world_size": world, "zero_stage": 3, "seq": args.seq}
        this_command = f"torchrun --nproc_per_node {world} bench/learner_multigpu.py {' '.join(argv)}"
        host = host_facts(on_gpu)
        record = {
            **common,
            "shape": args.shape,
            **{k: ours.get(k) for k in kept},
            "baseline": {**common, **baseline} if baseline else None,
            "attempts": ours_attempts,
            "baseline_attempts": attempts,
            "speedup_tokens_per_s": (
                round(ours["tokens_per_s"] / baseline["tokens_per_s"], 3)
                if baseline and ours.get("tokens_per_s")
                else None
            ),
            "targets": {"speedup_min": 1.1, "mfu_min": 0.5, "peak_gib_max": 80},
            # each side's own command where they ran apart (--skip-baseline, then --skip-ours)
            "command": prev.get("command") or this_command,
            "baseline_command": this_command if baseline else None,
            "host": host,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        write_record(out, record)
        print(
            json.dumps(
                {
                    k: record[k]
                    for k in ("device", "world_size", "tokens_per_s", "mfu", "peak_gib", "speedup_tokens_per_s")
                }
            ),
            flush=True,
        )
        print(f"wrote {out}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
