"""Colocation on one GPU: a sleeping vLLM engine and the learner take turns with the card.

    python bench/colocate_gpu.py                  # one H100/H200, vLLM 0.26 and DeepSpeed (bench/gpu_device.sh)
    python bench/colocate_gpu.py --level 2        # level-2 sleep (weights discarded, buffers restored and checked)
    python bench/colocate_gpu.py --dry            # CPU: the same cycles, a scripted engine standing in for vLLM

The rollout side is the real server: `VllmEngine` (started with `enable_sleep_mode`, its KV cache sized
from its memory share) inside `RolloutService`, behind the rollout API (`embedded_server`) on its own
event loop in a thread; vLLM's engine core runs in its own process, as in a rollout worker. The learner
side is the project's `PolicyEngine` (DeepSpeed ZeRO-3, one rank) in this process, driving the server
through `ColocatedSync` over HTTP, exactly as the trainer does with `weight_sync: ipc`.

Three cycles of: sample a batch (16 turns) → `POST /sleep` (a turn submitted now must wait) → one RL step
on a packed row → wake the weights, send the new version by CUDA IPC (`POST /weights/ipc`), wake the KV
cache → the held turn finishes, stamped with the new version → a sha256 of every parameter on the engine
(`GET /weights/digests`) equals the learner's, and the engine's greedy log-probs match the learner's
forward → sample again. Recorded in bench/results/colocate_gpu.json: sleep, wake and transfer seconds
per cycle, the card's free memory at each phase, the learner's peak, and every check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def card_memory() -> dict[str, float]:
    """The card's free and total memory, GiB (every process on it counted)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"free_gib": round(free / 2**30, 2), "total_gib": round(total / 2**30, 2)}


class ServerHost:
    """A rollout server on an event loop of its own (a thread): its engine, its service, its HTTP API."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-server", daemon=True)
        self.thread.start()
        self.server = None
        self.service = None
        self.url = ""

    def run(self, coro, timeout: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def start(self, make_engine, settings, tools) -> None:
        import httpx

        from services.common.redis import free_port
        from services.rollout.app import embedded_server
        from services.rollout.service import RolloutService

        async def build():
            return RolloutService(make_engine(), tools, settings=settings)

        self.service = self.run(build())
        port = free_port()
        self.server = embedded_server(self.service, settings, "127.0.0.1", port)
        self.submit(self.server.serve())
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the rollout server did not become ready")

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            time.sleep(0.5)
        if self.service is not None:
            try:
                self.run(self.service.engine.close(), 60)
            except Exception as exc:  # noqa: BLE001 - shutting down
                log(f"engine close: {exc}")
        self.loop.call_soon_threadsafe(self.loop.stop)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1000) for _ in range(length)] for _ in range(n)]


def sample(host: ServerHost, batch: list[list[int]], tokens: int) -> dict[str, Any]:
    from services.rollout.engines.base import TurnParams

    engine = host.service.engine
    t0 = time.perf_counter()

    async def all_turns():
        return await asyncio.gather(
            *[engine.generate(p, TurnParams(max_tokens=tokens, temperature=1.0), f"s{i}") for i, p in enumerate(batch)]
        )

    gens = host.run(all_turns())
    sampled = sum(len(g.token_ids) for g in gens)
    return {
        "turns": len(gens),
        "tokens": sampled,
        "seconds": time.perf_counter() - t0,
        "versions": sorted({g.policy_version for g in gens}),
    }


def learner(model_dir: Path, args):
    from services.learner.config import EngineConfig, ScheduleConfig
    from services.learner.engine import PolicyEngine

    cfg = EngineConfig(
        zero_stage=args.zero,
        precision="auto",
        gradient_checkpointing=True,
        micro_batch_tokens=args.row_tokens,
        attn_implementation="sdpa",
    )
    return PolicyEngine(model_dir, cfg, ScheduleConfig(lr=args.lr), total_steps=100)


def train_step(policy, args, k: int) -> dict[str, float]:
    """One RL step on a packed row of `args.row_tokens` tokens (four trajectories)."""
    from bench.learner_gpu import sequences
    from services.learner.steps import rl_step

    seqs = sequences(4, args.row_tokens // 4, seed=k, vocab=policy.lm_config.vocab_size)
    m = rl_step(policy, seqs, eps_low=0.2, eps_high=0.28).metrics
    return {"train_s": m["time_compute_s"], "loss": m["loss"], "tokens": float(sum(len(s) for s in seqs))}


def check_weights(host: ServerHost, policy, version: int, zero3: bool, dry: bool) -> dict[str, Any]:
    """Every parameter on the engine against the learner's; the engine's greedy log-probs against the
    learner's forward on the same tokens."""
    if dry:  # the scripted engine holds no weights: only the version stamp is checked
        return {"version": host.service.weights_info()["version"]}
    from bench.weight_sync_gpu import check

    policy.eval()
    try:
        verdict = check(host.url, policy.hf_model, zero3, version, {})
    finally:
        policy.train()
    verdict.pop("digests_after", None)
    verdict.pop("tensors_changed", None)
    return verdict


def make_vllm(model_dir: Path, args):
    from services.common.schemas import VllmArgs
    from services.rollout.engines.vllm_engine import VllmEngine

    vllm_args = VllmArgs(
        gpu_memory_utilization=args.engine_share,
        kv_cache_from_share=True,
        enable_sleep_mode=True,
        enforce_eager=True,
        max_num_seqs=64,
    )
    return lambda: VllmEngine(model_dir, max_model_len=args.max_model_len, args=vllm_args)


class DrySleeper:
    """The CPU stand-in for vLLM: a scripted engine with the sleep-mode surface (no memory moves)."""

    @staticmethod
    def make(model_dir: Path):
        from transformers import AutoTokenizer

        from services.rollout.engines.scripted import ScriptedEngine

        class Engine(ScriptedEngine):
            supports_sleep = True

            async def sleep(self, level: int) -> None:
                await asyncio.sleep(0.01)

            async def wake(self, tags=None) -> None:
                await asyncio.sleep(0.01)

            async def receive_ipc(self, chunk, *, first, last, version):
                if not last:
                    return {}
                return await self.load_version(version, f"ipc:v{version}", lambda: asyncio.sleep(0))

        return Engine(AutoTokenizer.from_pretrained(str(model_dir)), lambda prompt, turn: [7, 8, 9])


def dry_chunks(tensors, buffer_bytes):
    """No CUDA on CPU: the chunks' layout without handles a process could open."""
    names = [n for n, _ in tensors]
    for i in range(0, len(names), 64):
        part = names[i : i + 64]
        yield {
            "names": part,
            "dtype_names": ["float32"] * len(part),
            "shapes": [[1]] * len(part),
            "tensor_sizes": [4] * len(part),
            "handles": "ZHJ5",
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b")
    ap.add_argument("--level", type=int, choices=(1, 2), default=1)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4, help="large enough that bf16 weights change every step")
    ap.add_argument("--row-tokens", type=int, default=8192)
    ap.add_argument("--engine-share", type=float, default=0.30)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--dry", action="store_true", help="CPU: tiny model, scripted engine, no IPC")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with our functions
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in conf:  # vLLM's sleep-mode allocator refuses it
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf.replace("expandable_segments:True", "").strip(",")
    if not args.dry:
        os.environ.setdefault("DS_ACCELERATOR", "cuda")
    t_start = time.perf_counter()
    import torch

    from bench.gpu_shapes import model_folder
    from services.common.settings import Settings
    from services.learner.colocate import ColocatedServers, ColocatedSync
    from services.rollout.tools import LocalToolClient

    work = Path(tempfile.mkdtemp(prefix="colocate-"))
    shape = "tiny" if args.dry else args.shape
    if args.dry:
        from services.models import tiny_qwen2

        model_dir = Path(tiny_qwen2(tokenizer="travel"))  # a 4K vocabulary: a cheap output layer on CPU
        args.row_tokens, args.turns = min(args.row_tokens, 512), min(args.turns, 4)
    else:
        model_dir = model_folder(work / "model", shape)
    log(f"model {shape} at {model_dir}")
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.node(),
        "shape": shape,
        "level": args.level,
        "zero_stage": args.zero,
        "engine_share": args.engine_share,
        "row_tokens": args.row_tokens,
        "dry": args.dry,
        "cycles": [],
    }
    settings = Settings(home=work, weights_root=work / "weights", log_json=False, log_level="WARNING")
    host = ServerHost()
    try:
        t0 = time.perf_counter()
        make = (lambda: DrySleeper.make(model_dir)) if args.dry else make_vllm(model_dir, args)
        host.start(make, settings, LocalToolClient(None))
        record["engine_start_s"] = time.perf_counter() - t0
        record["memory_engine_up"] = card_memory()
        log(f"engine up in {record['engine_start_s']:.1f} s; {record['memory_engine_up']}")
        t0 = time.perf_counter()
        policy = learner(model_dir, args)
        record["learner_start_s"] = time.perf_counter() - t0
        record["memory_both_up"] = card_memory()
        log(
            f"learner up in {record['learner_start_s']:.1f} s ({policy.num_parameters() / 1e9:.2f} B params); "
            f"{record['memory_both_up']}"
        )
        zero3 = policy.cfg.zero_stage == 3
        servers = ColocatedServers([host.url], level=args.level, timeout_s=120)
        sync = ColocatedSync(None, servers, files_every=10**9, **({"chunks": dry_chunks} if args.dry else {}))
        vocab = policy.lm_config.vocab_size
        batch = prompts(args.turns, 256, vocab, seed=0)
        if not args.dry:
            record["check_before"] = check_weights(host, policy, 0, zero3, args.dry)
            log(
                f"before any step: tensors equal {record['check_before']['all_tensors_equal']}, "
                f"log-prob diff {record['check_before']['logprob_max_abs_diff']:.3f}"
            )
        version = 0
        for k in range(args.cycles):
            cycle: dict[str, Any] = {"cycle": k + 1}
            cycle["sample"] = sample(host, batch, args.turn_tokens)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            cycle.update(sync.sleep())
            cycle["memory_asleep"] = card_memory()
            held = host.submit(host.service.engine.generate(batch[0], _turn(args), "held"))
            time.sleep(0.2)
            cycle["held_turn_waited"] = not held.done()
            cycle.update(train_step(policy, args, k))
            version += 1
            cycle["memory_trained"] = card_memory()
            cycle["learner_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            cycle.update(
                sync.publish(
                    version, policy.hf_model, zero3=zero3, buckets=lambda: iter(()), config=None, source_dir=None
                )
            )
            cycle["memory_awake"] = card_memory()
            gen = held.result(120)
            cycle["held_turn_version"] = gen.policy_version
            cycle["check"] = check_weights(host, policy, version, zero3, args.dry)
            cycle["sample_after"] = sample(host, batch, args.turn_tokens)
            cycle["server_sleep"] = host.service.sleep_state.info()
            record["cycles"].append(cycle)
            ok = cycle["check"].get("all_tensors_equal", cycle["check"].get("version") == version)
            log(
                f"cycle {k + 1}: sleep {cycle['colocate_sleep_s']:.2f} s, train {cycle['train_s']:.2f} s, wake "
                f"{cycle['colocate_wake_s']:.2f} s, weights {cycle.get('colocate_weights_s', 0):.2f} s; "
                f"held turn waited {cycle['held_turn_waited']} and ran on v{gen.policy_version}; weights equal {ok}; "
                f"free asleep {cycle['memory_asleep'].get('free_gib')} GiB, learner peak "
                f"{cycle['learner_peak_gib']} GiB"
            )
        record["passed"] = all(
            c["held_turn_waited"]
            and c["held_turn_version"] == c["cycle"]
            and c["check"].get("all_tensors_equal", c["check"].get("version") == c["cycle"])
            and (args.dry or c["check"]["logprob_max_abs_diff"] < 0.25)
            for c in record["cycles"]
        )
        policy.close()
    finally:
        host.stop()
    record["total_s"] = time.perf_counter() - t_start
    out = Path(args.out) if args.out else RESULTS / ("colocate_gpu.dry.json" if args.dry else "colocate_gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str))
    log(f"{'PASSED' if record['passed'] else 'FAILED'} in {record['total_s']:.0f} s; wrote {out}")
    sys.stdout.flush()
    os._exit(0 if record["passed"] else 1)  # vLLM's shutdown may keep the process alive otherwise


def _turn(args):
    from services.rollout.engines.base import TurnParams

    return TurnParams(max_tokens=args.turn_tokens, temperature=1.0)


if __name__ == "__main__":
    main()
