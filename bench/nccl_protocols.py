"""NCCL's protocols on this machine's GPUs: all-gather and reduce-scatter bandwidth at the message sizes
ZeRO-3 sends (one decoder layer's weights, a gradient bucket), for each protocol NCCL_PROTO can force
and for NCCL's own choice. The learner's `nccl_protocol` default comes from these figures.

    python bench/nccl_protocols.py --nproc 2        # launches one process per protocol setting, 2 ranks each

NCCL reads NCCL_PROTO when a communicator is made, so every setting runs in processes of its own.
Results: bench/results/nccl_protocols.json (one row per protocol, operation and size: GB/s per rank's
buffer, as nccl-tests' algbw)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("default", "Simple", "LL128", "LL", "^LL")


def measure(sizes_m: list[float], dtype_name: str, iters: int) -> list[dict]:
    """Time all-gather and reduce-scatter of each size (millions of elements of the whole tensor)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    rows = []
    for size_m in sizes_m:
        n = int(size_m * 1e6) // world * world
        whole = torch.ones(n, dtype=dtype, device="cuda")
        shard = torch.ones(n // world, dtype=dtype, device="cuda")
        for op in ("all_gather", "reduce_scatter"):

            def once() -> None:
                if op == "all_gather":
                    dist.all_gather_into_tensor(whole, shard)
                else:
                    dist.reduce_scatter_tensor(shard, whole)

            for _ in range(3):
                once()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                once()
            torch.cuda.synchronize()
            s = (time.perf_counter() - t0) / iters
            rows.append(
                {
                    "op": op,
                    "elements_m": size_m,
                    "dtype": dtype_name,
                    "ms": round(s * 1e3, 3),
                    "algbw_gb_s": round(whole.numel() * whole.element_size() / s / 1e9, 1),
                }
            )
    return rows


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    rows = measure(args.sizes, "bfloat16", args.iters) + measure(args.sizes, "float32", args.iters)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument(
        "--sizes",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[1.0, 12.0, 47.0],
        help="millions of elements (47: one 1.5B-shape decoder layer)",
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, str(ROOT))
    from services.learner.engine import free_port

    record = {"nproc": args.nproc, "rows": []}
    for setting in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k != "NCCL_PROTO"}
        if setting != "default":
            env["NCCL_PROTO"] = setting
        out = Path(f"/tmp/nccl-proto-{os.getpid()}.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.nproc),
            "--master_port",
            str(free_port()),
            __file__,
            "--worker",
            "--out",
            str(out),
            "--iters",
            str(args.iters),
            "--sizes",
            ",".join(str(s) for s in args.sizes),
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            print(f"{setting}: failed\n{done.stderr[-2000:]}", flush=True)
            continue
        for row in json.loads(out.read_text()):
            record["rows"].append({"protocol": setting, **row})
            print(
                f"{setting:8} {row['op']:15} {row['dtype']:9} {row['elements_m']:6.1f}M  {row['ms']:8.3f} ms  "
                f"{row['algbw_gb_s']:7.1f} GB/s",
                flush=True,
            )
    import torch

    record["device"] = torch.cuda.get_device_name(0)
    record["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    path = ROOT / "bench" / "results" / "nccl_protocols.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
