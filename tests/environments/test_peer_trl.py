"""The peer benchmark (bench/peer_trl.py) end to end on CPU: the tiny recipe's SFT, two RL steps of ours and two
of TRL's GRPOTrainer over the episode API, four held-out queries evaluated before and after each, the record.

Runs in `.venv-trl` (scripts/test-adapters); skipped where TRL is not installed. The driver and our side run in
the main environment's Python (adapter_server.MAIN_PYTHON), TRL's side in this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.environments.adapter_server import MAIN_PYTHON, ROOT, main_python_problem
from tests.environments.conftest import library_or_skip

library_or_skip("trl", ".venv-trl")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_both_sides_train_two_steps_and_are_recorded(tmp_path):
    problem = main_python_problem()
    if problem is not None:
        pytest.fail(problem)
    out = tmp_path / "results"
    argv = [str(MAIN_PYTHON), "bench/peer_trl.py", "--config", "configs/tiny.yaml", "--steps", "2", "--heldout", "4",
            "--work", str(tmp_path / "work"), "--out", str(out), "--trl-python", sys.executable]  # fmt: skip
    env = {**os.environ, "STAR_HOME": str(tmp_path / "home"), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    record = json.loads((out / "peer_trl.json").read_text())
    for name in ("ours", "trl"):
        side = record["sides"][name]
        assert side["steps"] == 2, name
        assert side["steps_per_hour"] > 0 and side["step_s_median"] > 0, name
        for key in ("heldout_success_before", "heldout_success_after"):
            assert 0.0 <= side[key] <= 1.0, (name, key)
        assert side["heldout"]["after"]["strict"]["queries"] == 4
    assert record["sides"]["ours"]["heldout_success_before"] == record["sides"]["trl"]["heldout_success_before"]
    # every TRL step carries its own generation's reward and tokens (TRL's log, not the step after's)
    assert all(c["reward"] is not None for c in record["sides"]["trl"]["curve"])
    assert record["sides"]["trl"]["trajectory_tokens_per_s"] > 0
    assert record["goal"]["steps_asked"] == 2 and record["goal"]["sides_short_of_steps"] == []
    grpo = record["settings"]["trl_grpo_config"]
    assert (
        grpo["num_generations"] == 2
        and grpo["per_device_train_batch_size"] * grpo["steps_per_generation"] == 4
        and grpo["shuffle_dataset"] is False
    )
    assert record["versions"]["trl_side"]["trl"] == "1.16.0"
    assert (out / "peer_trl.md").read_text().startswith("# Peer trainer")
    assert (out / "peer_trl.png").stat().st_size > 0


def _protocol_turns() -> tuple[str, str]:
    """Our protocol's tool-call turn and tool-output message (services/rollout/protocol.py), from the main
    environment (the module needs the sandbox's dependencies)."""
    code = (
        "import json; from services.rollout.protocol import format_tool_call, tool_response; "
        "print(json.dumps([format_tool_call('SearchCity', {'state': 'Texas'}, 'which cities'), tool_response('Austin')]))"
    )
    out = subprocess.run([str(MAIN_PYTHON), "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    call, response = json.loads(out)
    return call, response


def test_the_trl_side_renders_our_protocol_and_reads_its_turns(tmp_path, monkeypatch):
    """TRL renders the conversation as our rollout's chatml style does, and its parser reads the tool-call turn
    our SFT data teaches (so the SFT checkpoint's calls reach the environment)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, qwen3_template, supports_tool_calling

    from bench.peer_trl_side import AGENT_STAR_CHATML
    from services.common.settings import get_settings
    from services.models import tiny_qwen2

    monkeypatch.setenv("STAR_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2(tmp_path / "tiny", hidden=64, layers=1, heads=1, kv_heads=1))
    get_settings.cache_clear()
    tokenizer.chat_template, tokenizer.response_template = AGENT_STAR_CHATML, qwen3_template
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)

    call, response = _protocol_turns()
    turn = tokenizer.parse_response(tokenizer(call + "<|im_end|>")["input_ids"], prefix="")
    assert turn["reasoning_content"] == "which cities"
    assert turn["tool_calls"][0]["function"] == {"name": "SearchCity", "arguments": {"state": "Texas"}}
    conversation = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "reasoning_content": turn["reasoning_content"], "tool_calls": turn["tool_calls"]},
        {"role": "tool", "content": "Austin"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        f"<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n{call}<|im_end|>\n"
        f"<|im_start|>user\n{response}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_table_datasets_cannot_hash_gets_a_random_fingerprint(monkeypatch):
    # the GPU machine's failure: generate_fingerprint raised while pickling the prompt rows' table
    from datasets import Dataset, fingerprint

    from bench.peer_trl_side import fingerprints_that_fall_back

    def unpicklable(cls, value):
        raise TypeError("Can't pickle <class 'MonthDayNano'>")

    monkeypatch.setattr(fingerprint.Hasher, "hash", classmethod(unpicklable))
    with pytest.raises(Exception, match="MonthDayNano"):
        Dataset.from_list([{"query": "{}"}])
    from datasets import arrow_dataset

    monkeypatch.setattr(arrow_dataset, "generate_fingerprint", arrow_dataset.generate_fingerprint)  # undone after
    fingerprints_that_fall_back()
    first, second = Dataset.from_list([{"query": "{}"}]), Dataset.from_list([{"query": "{}"}])
    assert first[0] == {"query": "{}"} and first._fingerprint != second._fingerprint  # random, not a crash
