"""Offline models: the converted Qwen2.5 tokenizer agrees with the tiktoken reference; the tiny
policy loads in transformers with the shape vLLM's CPU kernels need."""

from __future__ import annotations

import json

import pytest

from services.models import qwen_tokenizer, tiny_qwen2

SAMPLES = [
    "Day 1:\nCurrent City: from St. Petersburg to Rockford\nTransportation: Flight Number: F3573659",
    "  leading spaces, tabs\tand CRLF\r\nline; émigré café 東京 🚀 $1,234.50",
    '<tool_call>{"name": "SearchFlight", "arguments": {"departure": "Dallas"}}</tool_call>',
]


@pytest.fixture(scope="module")
def tok():
    return qwen_tokenizer()


def test_tokenizer_matches_tiktoken_reference(tok):
    import os

    import qwen_tokenizer as pkg
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(os.path.join(os.path.dirname(pkg.__file__), "resources", "qwen.tiktoken"))
    ref = tiktoken.Encoding("qwen", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
    for text in SAMPLES[:2]:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text)


def test_special_ids_are_qwen25(tok):
    assert tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    ) == [151643, 151644, 151645, 151657, 151658]
    ids = tok.encode(SAMPLES[2], add_special_tokens=False)
    assert ids[0] == 151657 and 151658 in ids


def test_chat_template_is_chatml(tok):
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_qwen2_is_cached_deterministic_and_loadable():
    import torch
    from transformers import AutoModelForCausalLM

    folder = tiny_qwen2()
    assert tiny_qwen2() == folder
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198]])).logits
    assert logits.shape == (1, 3, 151936)
    with pytest.raises(ValueError, match="head_dim"):
        tiny_qwen2(hidden=64, heads=4)


def test_travel_tokenizer_round_trips_agent_text_and_is_small():
    from services.models import TRAVEL_VOCAB, travel_tokenizer
    from services.rollout.protocol import system_prompt

    tok = travel_tokenizer()
    assert len(tok) <= TRAVEL_VOCAB
    for text in SAMPLES + [system_prompt()]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # cheaper than bytes: merges learned from travel text actually apply
    prompt = system_prompt()
    assert len(tok.encode(prompt, add_special_tokens=False)) < len(prompt.encode()) / 2.5
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    folder = tiny_qwen2(tokenizer="travel")
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == TRAVEL_VOCAB
