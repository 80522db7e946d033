"""The TRL side of the peer benchmark (bench/peer_trl.py): TRL's own GRPOTrainer over our episode API.

Runs in TRL's environment (`.venv-trl` here; on the GPU machine the device Python with the TRL wheels on
PYTHONPATH) and starts nothing itself: the episode API it talks to is the one bench/peer_trl.py serves over the
run's world. Its input is one JSON file (`--spec`, written by peer_trl.py):

    {"url", "token", "model", "out", "prompts": [query, ...] (in the order our side trained them),
     "grpo": {GRPOConfig keyword arguments}, "episode": {"mode", "reward", "max_tool_calls"},
     "steps": N, "updates_per_step": k, "time_cap_s": seconds}

Every prompt row carries its query inline (JSON text) and the system prompt and task the episode API gives
for it: the Agent-STAR prompt with the tools listed, which the SFT checkpoint was trained on. The chat template
is `AGENT_STAR_CHATML`, our rollout's `chatml` style as a Jinja template (tools listed in the system prompt,
`<think>` + `<tool_call>` JSON turns, tool output as a user message in `<tool_response>`); TRL parses the turns
with its Qwen3 response template (the same `<think>` / `<tool_call>` tags). The trained model is saved as an HF
folder with the tokenizer's own chat template, and `side.json` holds per RL step (one generation of
`prompts per step × group` rollouts, `updates_per_step` optimizer steps) its wall time, and TRL's log history,
from which bench/peer_trl.py reads each step's reward and tokens.

vLLM: TRL 1.16 accepts vLLM 0.22.0 … 0.31.0 (trl/import_utils.py `is_vllm_available`), so 0.26.0 is in range. In
`vllm_mode="colocate"` it builds `LLM(..., distributed_executor_backend="external_launcher",
logprobs_mode="processed_logprobs")` in the trainer's process and loads weights through
`llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights` (trl/generation/vllm_generation.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Our rollout's `chatml` style (services/rollout/chat.py) as a chat template TRL can render: the tools are in
# the system prompt already, so `tools` is not rendered again.
AGENT_STAR_CHATML = (  # no whitespace control: every newline here is one the protocol writes
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
    "{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}"
    "{% set f = c.function if c.function is defined else c %}"
    '<tool_call>\n{"name": {{ f.name | tojson }}, "arguments": {{ f.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] trl: {msg}", flush=True)


def prompt_rows(client, prompts: list[dict[str, Any]], epoch: int) -> list[dict[str, Any]]:
    """One conversational row per query, in the given order: the episode API's system prompt and task, and the
    query inline (JSON text) for `TravelPlannerEnv.reset`."""
    rows = []
    for query in prompts:
        started = client.start(query=query)
        client.close(started.episode_id)
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": started.system_prompt},
                    {"role": "user", "content": started.task},
                ],
                "query": json.dumps(query),
                "epoch": epoch,  # a curriculum reward's stage
            }
        )
    return rows


def fingerprints_that_fall_back() -> None:
    """Make a new `datasets.Dataset` take a random fingerprint where hashing its table fails, as datasets' own
    transforms already do (`update_fingerprint`). On the GPU machine's Python 3.12, `Dataset.from_list` of the
    prompt rows failed in `generate_fingerprint` (dill: PicklingError on pyarrow's MonthDayNano type) before TRL
    started; the fingerprint only names cache files, which this side never reuses."""
    from datasets import arrow_dataset
    from datasets.fingerprint import generate_random_fingerprint

    hashed = arrow_dataset.generate_fingerprint

    def generate_fingerprint(dataset):
        try:
            return hashed(dataset)
        except Exception as exc:  # noqa: BLE001 - any pickling failure; the reason is logged
            log(f"datasets could not hash a table ({type(exc).__name__}: {str(exc)[:120]}): random fingerprint")
            return generate_random_fingerprint()

    arrow_dataset.generate_fingerprint = generate_fingerprint


def step_timer(updates_per_step: int, time_cap_s: float | None, steps: list[dict[str, Any]]):
    """A TrainerCallback that records one entry per RL step (every `updates_per_step` optimizer steps) with its
    wall time, and stops training once `time_cap_s` has passed. The step's reward and tokens are read from TRL's
    log history afterwards (bench/peer_trl.py trl_steps); the reward shown here is only progress."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.start = self.last = time.perf_counter()
            self.reward = "not logged"

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % updates_per_step:
                return control
            now = time.perf_counter()
            steps.append(
                {
                    "step": state.global_step // updates_per_step,
                    "step_s": now - self.last,
                    "wall_s": now - self.start,
                }
            )
            log(f"step {steps[-1]['step']}: {steps[-1]['step_s']:.1f} s, reward {self.reward}")
            self.last = now
            if time_cap_s and now - self.start > time_cap_s:
                log(f"time cap of {time_cap_s:.0f} s reached: stopping")
                control.should_training_stop = True
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            # a generation's reward is logged with the first update of its RL step, before the step ends
            if logs and "reward" in logs:
                self.reward = f"{logs['reward']:.3f}"
            return control

    return StepTimer()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, required=True, help="the side's settings (written by bench/peer_trl.py)")
    args = ap.parse_args()
    spec = json.loads(args.spec.read_text())
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from services.environments.trl import (
        close_environments,
        environment_factory,
        travelplanner_reward,
    )
    from services.episodes.client import EpisodeClient

    fingerprints_that_fall_back()
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    with EpisodeClient(spec["url"], spec["token"]) as client:
        dataset = Dataset.from_list(prompt_rows(client, spec["prompts"], spec.get("epoch", 1)))
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    own_template = tokenizer.chat_template
    tokenizer.chat_template = AGENT_STAR_CHATML
    tokenizer.response_template = qwen3_template  # transformers >= 5.13 (TRL's gate); the device has 5.17
    gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16 if gpu else torch.float32)
    grpo = dict(spec["grpo"])
    if not gpu:  # plain transformers generation on CPU
        grpo.update(use_vllm=False, use_cpu=True, bf16=False)
    config = GRPOConfig(output_dir=str(out / "trainer"), report_to="none", save_strategy="no", **grpo)
    steps: list[dict[str, Any]] = []
    timer = step_timer(spec["updates_per_step"], spec.get("time_cap_s"), steps)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[travelplanner_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=environment_factory(spec["url"], spec["token"], **spec["episode"]),
        callbacks=[timer],
    )
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    log(f"{len(dataset)} prompts, {spec['steps']} steps of {spec['updates_per_step']} updates; GPU {gpu}")
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    close_environments([e for pool in trainer._environment_pool.values() for e in pool])
    tokenizer.chat_template = own_template  # the folder our evaluator reads keeps the model's own template
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    import transformers
    import trl

    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    try:
        import vllm

        versions["vllm"] = vllm.__version__
    except ImportError:
        versions["vllm"] = None
    record = {
        "model": str(out / "model"),
        "steps": steps,
        "train_s": train_s,
        "optimizer_steps": trainer.state.global_step,
        "torch_peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "versions": versions,
        "config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))},
        "log_history": trainer.state.log_history,
        "step_s_median": statistics.median(s["step_s"] for s in steps) if steps else None,
    }
    (out / "side.json").write_text(json.dumps(record, indent=1, default=str))
    log(f"{len(steps)} steps in {train_s:.0f} s; model in {out / 'model'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
