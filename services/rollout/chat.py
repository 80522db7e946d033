"""The conversation in the model's own format: the prompt, what the environment appends after a
sampled turn, and how a turn is recorded.

Two styles:

- `template`: everything the environment adds comes from the tokenizer's chat template, with the
  tools passed to it (`tools=`) and the family's tool format (tool_formats.py). The prompt is the
  template's rendering of [system, user] with the generation prompt. After a turn, the template
  renders the conversation with the last assistant message replaced by a marker, followed by the
  new environment messages and the generation prompt; the text after the marker, less the end-of-turn
  token the engine already sampled, is tokenized and appended. The sampled ids themselves are never
  re-tokenized, so the learner trains on exactly what was sampled, and the whole sequence equals the
  template's rendering of the conversation wherever the template renders earlier turns as they were
  sampled (tests/rollout/test_families.py checks it per family).
- `chatml`: the Agent-STAR protocol in ChatML by hand (tools listed in the system prompt, tool
  output as a user message in `<tool_response>`): for a tokenizer with no template, or a ChatML
  template that has no tool support (the project's own tokenizers, SmolLM2).

`auto` picks `chatml` for those two cases and `template` otherwise; a recipe may name either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.rollout import tool_formats
from services.rollout.protocol import (
    FORMAT_ERROR,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    Turn,
    parse_turn,
    system_prompt,
    tool_response,
)

ChatStyle = Literal["auto", "template", "chatml"]
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# each family's end of message: ChatML, Llama-3's end of turn and end of message, Gemma's end of turn
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")
MARKER = "STARMARKER7Q"  # stands for the last assistant reply while the template renders what follows it
# the message fields a template reads; the record's own (tokens, timings) are left out
_TEMPLATE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content")


class ChatTemplateError(ValueError):
    """The chat template cannot render the conversation the agent needs."""


class ChatOptions(BaseModel):
    """How the agent talks to the model (a recipe's `services.chat`, `STAR_ROLLOUT_CHAT`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    style: ChatStyle = Field(
        "auto",
        description=(
            "template: prompts and turns from the tokenizer's chat template, tools passed to it; chatml: the "
            "Agent-STAR protocol in ChatML by hand; auto: chatml for a tokenizer without a template or with a "
            "ChatML template that has no tools, else template."
        ),
    )
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral", "react"] = Field(
        "auto",
        description=(
            "How the model writes a tool call: hermes `<tool_call>` JSON (Qwen), llama3_json (Llama-3.x), mistral "
            "`[TOOL_CALLS]`, react (Action / Action Input lines); auto: from the chat template (hermes for chatml)."
        ),
    )
    thinking: bool | None = Field(
        None,
        description=(
            "Thinking models' mode (Qwen3's enable_thinking): true thinks, false prompts an empty thought; "
            "unset: the template's default."
        ),
    )


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Token ids that end a model turn: the tokenizer's end of sequence and each family's end of message."""
    if tokenizer is None:
        return set()
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for t in END_OF_TURN:
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i >= 0 and i != getattr(tokenizer, "unk_token_id", None):
            ids.add(i)
    return ids


def has_tool_support(template: str | None) -> bool:
    return bool(template) and "tools" in template


def resolve_style(tokenizer: Any, style: ChatStyle = "auto") -> str:
    template = getattr(tokenizer, "chat_template", None)
    if style == "template" and not template:
        raise ChatTemplateError("chat style 'template' needs a tokenizer with a chat template; this one has none")
    if style != "auto":
        return style
    if not template or (IM_START in template and not has_tool_support(template)):
        return "chatml"
    return "template"


@dataclass
class Chat:
    """One model family's conversation format, for one agent."""

    tokenizer: Any
    style: str
    tool_format: str
    tools: list[dict[str, Any]] | None = None  # OpenAI-form schemas the template renders
    thinking: bool | None = None
    stop_ids: set[int] = field(default_factory=set)

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        options: ChatOptions | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        stop_ids: set[int] | None = None,
    ) -> Chat:
        options = options or ChatOptions()
        style = resolve_style(tokenizer, options.style)
        template = getattr(tokenizer, "chat_template", None)
        if options.tool_format != "auto":
            fmt = options.tool_format
        else:
            fmt = "hermes" if style == "chatml" else tool_formats.detect(template)
        templated_tools = tools if style == "template" and has_tool_support(template) and fmt != "react" else None
        return cls(tokenizer, style, fmt, templated_tools, options.thinking, set(stop_ids or ()))

    @classmethod
    def for_agent(
        cls,
        tokenizer: Any,
        options: ChatOptions | None = None,
        *,
        tool_names: list[str] | None = None,
        stop_ids: set[int] | None = None,
    ) -> Chat:
        """The agent's format for this tokenizer: the sandbox's tools (those named) passed to the template.
        The rollout and SFT both build it here, so both train on the same format."""
        from services.sandbox.tools.registry import tool_schemas

        names = set(tool_names) if tool_names is not None else None
        schemas = [s for s in tool_schemas("openai") if names is None or s["function"]["name"] in names]
        return cls.for_tokenizer(
            tokenizer,
            options,
            tools=schemas or None,
            stop_ids=end_of_turn_ids(tokenizer) if stop_ids is None else stop_ids,
        )

    def system_prompt(self) -> str:
        """The agent's system message in this format: the Agent-STAR one for ChatML; otherwise the
        family's call syntax, and no tool list where the template lists the tools."""
        if self.style == "chatml":
            return system_prompt()
        return system_prompt(
            call=tool_formats.call_instructions(self.tool_format), tools_listed_elsewhere=self.tools_in_template
        )

    # -- what the model is told ----------------------------------------------------------------

    @property
    def tools_in_template(self) -> bool:
        return self.tools is not None

    @property
    def tool_role(self) -> str:
        """The role of the message carrying a tool's output."""
        return "tool" if self.style == "template" and self.tools_in_template else "user"

    def _kwargs(self) -> dict[str, Any]:
        return {} if self.thinking is None else {"enable_thinking": self.thinking}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The template's text for `messages` (only the fields a template reads)."""
        clean = [{k: m[k] for k in _TEMPLATE_FIELDS if k in m} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                clean, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt, **self._kwargs()
            )
        except Exception as exc:  # noqa: BLE001 - jinja raises its own types; the caller decides
            raise ChatTemplateError(f"the chat template cannot render this conversation: {exc}") from exc

    def ids(self, text: str) -> list[int]:
        """Template text to ids: its special tokens as themselves."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text_ids(self, text: str) -> list[int]:
        """Free text to ids: a control token written in it stays text (split_special_tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.style == "template":
            return self.ids(self.render(messages, True))
        if getattr(self.tokenizer, "chat_template", None):  # a ChatML template without tools
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
        ids: list[int] = []
        for m in messages:
            ids += self._chatml_message(m["role"], m["content"])
        return ids + self._chatml_header("assistant")

    def opening(self, system: str, user: str) -> list[dict[str, Any]]:
        """The first messages. A template that moves the system message as the conversation grows
        (Mistral's puts it in the last user message) would make the prompt of a later turn differ
        from the tokens already sampled on; for it, the system text opens the user message instead
        (when that makes the prompt stable; Qwen3's non-thinking prompt is not, whatever the opening:
        its template drops the empty reasoning block of earlier turns)."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        if self.style != "template" or self._prefix_stable(messages):
            return messages
        folded = [{"role": "user", "content": f"{system}\n\n{user}"}]
        return folded if self._prefix_stable(folded) else messages

    def _prefix_stable(self, messages: list[dict[str, Any]]) -> bool:
        """Whether the prompt stays the start of the conversation once a turn and a tool output follow."""
        grown = [*messages, {"role": "assistant", "content": MARKER}, self.tool_message("x", tool_formats.call_id(0))]
        try:
            return self.render(grown, True).startswith(self.render(messages, True))
        except ChatTemplateError:
            return False

    # -- what the environment appends -----------------------------------------------------------

    def env_ids(self, messages: list[dict[str, Any]], closed: bool, new: list[dict[str, Any]]) -> list[int]:
        """The ids after the last sampled turn (the last message of `messages`, an assistant one):
        its end-of-turn token when the engine did not sample it, the `new` environment messages, and
        the next generation prompt."""
        if self.style == "chatml":
            content = new[-1]["content"] if new else None
            return self._chatml_segment(closed, content)
        probe = [*messages[:-1], {"role": "assistant", "content": MARKER}, *new]
        text = self.render(probe, True)
        at = text.rfind(MARKER)
        if at < 0:
            raise ChatTemplateError("the chat template drops the last assistant message; its turns cannot be appended")
        suffix = text[at + len(MARKER) :]
        if closed:
            suffix = self._without_end_of_turn(suffix)
        return self.ids(suffix)

    def _without_end_of_turn(self, suffix: str) -> str:
        """The suffix less the end-of-turn token the engine sampled (the template writes it too)."""
        for tid in self.stop_ids:
            token = self.tokenizer.convert_ids_to_tokens(tid)
            if isinstance(token, str) and token and suffix.startswith(token):
                return suffix[len(token) :]
        return suffix

    # -- supervised turns (SFT) --------------------------------------------------------------------

    @property
    def keeps_thoughts(self) -> bool:
        """Whether a reasoning block has a place in this format's turns (Qwen3 thinking; and the
        Agent-STAR protocol, whose turns open with `<think>`)."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return self.style == "chatml" or (THINK_OPEN in template and self.thinking is not False)

    def assistant_ids(self, messages: list[dict[str, Any]], message: dict[str, Any]) -> list[int]:
        """What the model writes for assistant `message` after `messages` in this format, up to and
        including its end-of-turn token: the ids a rollout samples for that turn."""
        if self.style == "chatml":
            return self.ids(message["content"]) + [self._special(IM_END)]
        prompt = self.render(messages, True)
        whole = self.render([*messages, message], False)
        if not whole.startswith(prompt):
            raise ChatTemplateError("the chat template rewrites the prompt when an assistant turn follows it")
        ids = self.ids(whole[len(prompt) :])
        end = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
        if end is None:
            raise ChatTemplateError("the chat template ends an assistant turn with no end-of-turn token")
        return ids[: end + 1]

    def closing_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """What the template writes after the last assistant turn's end-of-turn token (ChatML's newline)."""
        if self.style == "chatml":
            return self.text_ids("\n")
        text = self.render([*messages[:-1], {"role": "assistant", "content": MARKER}], False)
        at = text.rfind(MARKER)
        if at < 0:
            raise ChatTemplateError("the chat template drops the last assistant message")
        return self.ids(self._without_end_of_turn(text[at + len(MARKER) :]))

    def from_agent_star(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """An Agent-STAR chat (SFT data: the system prompt, `<think>` + `<tool_call>` turns, tool output
        in user `<tool_response>` messages) as the rollout writes it in this format: the agent's system
        prompt and opening, each call in the family's syntax (its `tool_calls` entry where the template
        reads one), the reasoning where the format has a place for it, tool output in the family's tool
        role. ChatML keeps the chat as it is."""
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.style == "chatml":
            return plain
        first = next((i for i, m in enumerate(plain) if m["role"] == "assistant"), len(plain))
        head = plain[:first]
        if [m["role"] for m in head] == ["system", "user"]:
            system = self.system_prompt() if head[0]["content"] == system_prompt() else head[0]["content"]
            head = self.opening(system, head[1]["content"])
        out, calls, last_call = head, 0, None
        for m in plain[first:]:
            if m["role"] == "assistant":
                message, last_call = self._turn_in_format(m["content"], calls)
                calls += last_call is not None
                out.append(message)
            elif m["role"] == "user" and last_call is not None and _wrapped(m["content"]):
                inner = m["content"][len(TOOL_RESPONSE_OPEN) : -len(TOOL_RESPONSE_CLOSE)]
                out.append(self.tool_message(inner, last_call))
                last_call = None
            else:
                out.append(m)
        return out

    def _turn_in_format(self, content: str, index: int) -> tuple[dict[str, Any], str | None]:
        turn = parse_turn(content)
        thought = _thought(content)
        if turn.runnable and self.tool_format == "hermes":
            call = json.dumps({"name": turn.name, "arguments": turn.arguments}, ensure_ascii=False)
            body = f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"
        elif turn.runnable:
            body = tool_formats.format_call(self.tool_format, turn.name, turn.arguments, think=thought, index=index)
        else:
            body = tool_formats.reply_part(content).lstrip()
        if self.keeps_thoughts and thought and self.tool_format != "react":
            body = f"{THINK_OPEN}\n{thought}\n{THINK_CLOSE}\n\n{body}"
        return self.assistant_message(body, turn, index)

    def supervised(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """Token ids and loss mask of a chat, built as a rollout builds its trajectory: the prompt,
        then each assistant turn as the model writes it in this format with its end-of-turn token
        (mask 1), what the environment appends after it (mask 0), and the template's closing text."""
        chat = self.from_agent_star(messages)
        at = next((i for i, m in enumerate(chat) if m["role"] == "assistant"), None)
        if at is None:
            raise ValueError("a chat needs an assistant turn to train on")
        ids = self.prompt_ids(chat[:at])
        mask = [0] * len(ids)
        while True:
            turn = self.assistant_ids(chat[:at], chat[at])
            ids, mask = ids + turn, mask + [1] * len(turn)
            following = next((j for j in range(at + 1, len(chat)) if chat[j]["role"] == "assistant"), None)
            if following is None:  # what follows the last turn trains nothing
                tail = self.closing_ids(chat[: at + 1])
                return ids + tail, mask + [0] * len(tail)
            new = chat[at + 1 : following]
            if not new and not self.renders_turns_in_a_row:
                # as the agent does: a template whose roles must alternate hears why no tool ran
                new = [{"role": "user", "content": FORMAT_ERROR}]
                chat = [*chat[: at + 1], *new, *chat[following:]]
                following += 1
            env = self.env_ids(chat[: at + 1], True, new)
            ids, mask = ids + env, mask + [0] * len(env)
            at = following

    @cached_property
    def renders_turns_in_a_row(self) -> bool:
        """Whether the template renders an assistant turn right after another (Mistral's and Gemma 3's
        refuse: roles must alternate)."""
        if self.style == "chatml":
            return True
        turns = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "a"},
            {"role": "assistant", "content": "b"},
        ]
        try:
            self.render(turns, False)
        except ChatTemplateError:
            return False
        return True

    # -- records -----------------------------------------------------------------------------------

    def decode(self, ids: list[int]) -> str:
        """A sampled turn's text, without its end-of-turn token. The template style keeps control
        tokens that carry meaning (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`)."""
        kept = [t for t in ids if t not in self.stop_ids]
        return self.tokenizer.decode(kept, skip_special_tokens=self.style == "chatml")

    def parse(self, text: str, tools: list[str]) -> Turn:
        if self.style == "chatml" and self.tool_format == "hermes":
            return parse_turn(text, tools)  # the Agent-STAR reading order, think block included
        return tool_formats.parse(self.tool_format, text, tools)

    def assistant_message(self, text: str, turn: Turn, call_index: int) -> tuple[dict[str, Any], str | None]:
        """The assistant turn as the template takes it, and the id of its call (None without one).
        Families whose templates render calls from `tool_calls` (Llama, Mistral) get that field;
        Hermes templates render the call from the content itself. A malformed call gets the field
        too (its name as read, no arguments): Mistral's template counts a turn without it as a reply
        and would then refuse the conversation (roles must alternate)."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if turn.kind != "tool_call" or self.tool_format not in ("llama3_json", "mistral"):
            return message, (tool_formats.call_id(call_index) if turn.kind == "tool_call" else None)
        given = _given_id(text) if self.tool_format == "mistral" else None
        call = tool_formats.ToolCall(
            turn.name or "unreadable", turn.arguments, given or tool_formats.call_id(call_index)
        )
        message["tool_calls"] = [call.message_entry()]
        return message, call.id

    def tool_message(self, text: str, call_id: str | None) -> dict[str, Any]:
        if self.style == "template":
            text = self.defused(text)
        if self.tool_role == "tool":
            message = {"role": "tool", "content": text}
            if call_id is not None:
                message["tool_call_id"] = call_id
            return message
        return {"role": "user", "content": tool_response(text)}

    @cached_property
    def control_tokens(self) -> list[str]:
        """The control tokens text could spell: the special ones among those the tokenizer matches whole."""
        added = {str(t) for t in self.tokenizer.added_tokens_decoder.values() if getattr(t, "special", False)}
        added |= set(self.tokenizer.all_special_tokens)
        return sorted((t for t in added if len(t) > 1 and t.strip() == t), key=len, reverse=True)

    def defused(self, text: str) -> str:
        """Environment text with every control token it spells broken by a zero-width space: the
        template's text is tokenized with control tokens parsed, and a tool output must not add one
        (the ChatML style tokenizes environment text apart, with control tokens split instead)."""
        for token in self.control_tokens:
            if token in text:
                text = text.replace(token, token[0] + "\u200b" + token[1:])
        return text

    # -- ChatML by hand ---------------------------------------------------------------------------------

    def _special(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or tid < 0 or tid == getattr(self.tokenizer, "unk_token_id", None):
            raise ChatTemplateError(f"ChatML needs the token {token} in the vocabulary")
        return tid

    def _chatml_header(self, role: str) -> list[int]:
        return [self._special(IM_START)] + self.text_ids(role + "\n")

    def _chatml_message(self, role: str, content: str) -> list[int]:
        return (
            [self._special(IM_START)]
            + self.text_ids(f"{role}\n{content}")
            + [self._special(IM_END)]
            + self.text_ids("\n")
        )

    def _chatml_segment(self, closed: bool, user_content: str | None) -> list[int]:
        """`<|im_end|>` if the engine did not sample it, then (with a user message) the user turn,
        then the next assistant header."""
        ids = [] if closed else [self._special(IM_END)]
        ids += self.text_ids("\n")
        if user_content is not None:
            ids += self._chatml_message("user", user_content)
        return ids + self._chatml_header("assistant")


def _wrapped(text: str) -> bool:
    return text.startswith(TOOL_RESPONSE_OPEN) and text.endswith(TOOL_RESPONSE_CLOSE)


def _thought(content: str) -> str:
    """The reasoning of an Agent-STAR turn (its `<think>` block), stripped."""
    start = content.find(THINK_OPEN)
    end = content.find(THINK_CLOSE, start + 1)
    return content[start + len(THINK_OPEN) : end].strip() if 0 <= start < end else ""


def _given_id(text: str) -> str | None:
    """The id a Mistral call carries, when it has a usable one (9 alphanumerics)."""
    try:
        calls = json.JSONDecoder().raw_decode(text.split(tool_formats.MISTRAL_CALLS, 1)[1].lstrip())[0]
        given = calls[0].get("id") if isinstance(calls, list) else calls.get("id")
    except (ValueError, IndexError, AttributeError):
        return None
    return given if isinstance(given, str) and len(given) == 9 and given.isalnum() else None
