"""Random-weight HF model folders at the shapes the GPU benchmarks measure.

A folder holds config.json, bf16 safetensors (random init from a seed) and a small word-level
tokenizer that knows the chat stop tokens: the engines only read their ids from it, and the
benchmarks feed token ids, so the device needs no model hub and no Qwen vocabulary package.
"""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    # SmolLM2-135M-Instruct (the proof's model)
    "smollm": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
}
STOP_TOKENS = ("<|endoftext|>", "<|im_end|>")  # ids 0 and 1 of the stand-in vocabulary


def qwen2_config(shape: str, max_positions: int = 32768, layers: int | None = None):
    """The shape's Qwen2 config; `layers`: its width with that many decoder layers instead."""
    from transformers import Qwen2Config

    return Qwen2Config(
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        torch_dtype="bfloat16",
        bos_token_id=0,
        eos_token_id=0,
        **{**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})},
    )


def shape_params(shape: str) -> int:
    """Parameters of a `shape` Qwen2 model, counted on the meta device (no memory)."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen2_config(shape))
    return sum(p.numel() for p in model.parameters())


def model_folder(
    folder: str | Path, shape: str, *, seed: int = 0, device: str | None = None, max_positions: int = 32768
) -> Path:
    """Build (once) a random `shape` Qwen2 model in bf16 at `folder`; returns the folder."""
    import torch
    from transformers import Qwen2ForCausalLM

    folder = Path(folder)
    stamp = folder / "shape.json"
    want = {"shape": shape, "seed": seed, "max_positions": max_positions}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    config = qwen2_config(shape, max_positions)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the engines measured next run in processes of their own
    save_stop_tokenizer(folder)
    stamp.write_text(json.dumps(want))
    return folder


def save_stop_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(STOP_TOKENS)} | {"<unk>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(folder)
