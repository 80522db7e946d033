"""Chat model families: each family's real chat template through the agent, and its architecture
through the learner, on CPU.

    PYTHONPATH=$PWD .venv/bin/python bench/model_families.py

For each family of services/model_families.py (Qwen2.5, Qwen3 thinking and not, Llama-3, Mistral,
SmolLM2, Gemma 3): the chat style and tool format the agent picks, token-in/token-out (every turn's
prompt is the tokens so far, and equals the template's rendering of the conversation so far) on a
conversation of two real tool calls (the official world's sandbox) and an answer, and, on a tiny
random-init model of the family's architecture, which fused paths the learner takes, how far its
log-probs are from log_softmax of the model's own logits, and (where the transformers rollout engine
runs the family's layers) from the log-probs that engine reported for the tokens it sampled. Results: bench/results/model_families.json
(docs/models.md is the table).
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.settings import get_settings  # noqa: E402
from services.model_families import FAMILIES, FamilyUnavailable, engine_report, learner_report, tito_report  # noqa: E402

OUT = ROOT / "bench" / "results" / "model_families.json"


def local_tools(folder: Path):
    from services.rollout.tools import LocalToolClient
    from services.sandbox.tools.toolbox import ToolBox
    from services.sandbox.world import World
    from services.sandbox.world.build import build_official_world

    data = get_settings().travelplanner_dir
    url = f"sqlite:///{folder / 'world.sqlite'}"
    build_official_world(url, data / "database", seed=0, ref_info=[data / "train" / "train_ref_info.jsonl"])
    return LocalToolClient(ToolBox(World(url), dialect="star", cache_size=0))


def main() -> int:
    started = time.perf_counter()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tools = local_tools(Path(tmp))
        for name, family in FAMILIES.items():
            t0 = time.perf_counter()
            row = {"template_source": family.template_source, "tokenizer_source": family.tokenizer_source}
            try:
                row |= tito_report(name, tools)
                row |= learner_report(name)
                row |= engine_report(name) or {"engine": "vllm (the transformers engine does not run these layers)"}
            except FamilyUnavailable as exc:
                row["unavailable"] = str(exc)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows[name] = row
            print(name, json.dumps(row), flush=True)
    result = {"python": platform.python_version(), "device": "cpu", "dtype": "float32",
              "seconds": round(time.perf_counter() - started, 1), "families": rows}
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
