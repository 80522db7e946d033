"""How each model family writes a tool call, and how such a turn is read.

A turn is read into the same `Turn` whatever the family (protocol.py): a tool call (well formed or
with the error to send back), an answer (`<answer>…</answer>`, the plan the reward reads), or a
format error. Only the tool-call syntax differs:

- `hermes`: `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen2.5, Qwen3, the Agent-STAR
  checkpoints, Hermes): exactly `parse_turn`.
- `llama3_json`: the reply is a JSON object `{"name": …, "parameters": {…}}`, optionally after
  `<|python_tag|>` (Llama-3.1/3.2/3.3 with custom tools).
- `mistral`: `[TOOL_CALLS] [{"name": …, "arguments": {…}, "id": …}]` (Mistral v0.3 and later).
- `react`: `Action: <tool>` then `Action Input: {…}` lines, for models whose template has no tool
  format.

A reasoning block (`<think>…</think>`) before the reply is never searched for a call or an answer:
what a model thinks is not what it does. Each family takes the first call when a reply has several
(one call per turn, as the Agent-STAR protocol).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from services.rollout.protocol import (
    ANSWER_OPEN,
    FORMAT_ERROR,
    THINK_CLOSE,
    Turn,
    call_error,
    format_tool_call,
    parse_turn,
    unknown_tool,
)

ToolFormatName = Literal["hermes", "llama3_json", "mistral", "react"]
TOOL_FORMATS: tuple[str, ...] = ("hermes", "llama3_json", "mistral", "react")

PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
_ACTION = re.compile(r"^\s*Action\s*:\s*(?P<name>[^\n]+?)\s*$", re.MULTILINE)
_ACTION_INPUT = re.compile(r"^\s*Action Input\s*:\s*", re.MULTILINE)


@dataclass(frozen=True)
class ToolCall:
    """A parsed call as a chat template takes it (`tool_calls` entry), with the id some families need."""

    name: str
    arguments: dict[str, Any]
    id: str

    def message_entry(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def reply_part(text: str) -> str:
    """The reply after a reasoning block (the whole text when there is none)."""
    return text.rsplit(THINK_CLOSE, 1)[-1] if THINK_CLOSE in text else text


def call_id(index: int) -> str:
    """A 9-character alphanumeric call id (Mistral's templates require exactly that form)."""
    return f"call{index:05d}"[-9:].rjust(9, "0")


def parse(fmt: str, text: str, tools: Iterable[str] | None = None) -> Turn:
    """Read one model turn in the tool format `fmt`."""
    if fmt == "hermes":
        return parse_turn(reply_part(text), tools)
    known = set(tools) if tools is not None else None
    reply = reply_part(text)
    if fmt == "llama3_json":
        found = _llama_call(reply)
    elif fmt == "mistral":
        found = _mistral_call(reply)
    elif fmt == "react":
        found = _react_call(reply)
    else:
        raise ValueError(f"unknown tool format {fmt!r}; use one of {', '.join(TOOL_FORMATS)}")
    if found is None:
        # no call: the answer rules are the protocol's own (a bare reply is a format error)
        return parse_turn(reply, tools) if ANSWER_OPEN in reply else Turn("format_error", error=FORMAT_ERROR)
    return _checked(found, known)


def _checked(found: dict[str, Any] | Exception, known: set[str] | None) -> Turn:
    if isinstance(found, Exception):
        return Turn("tool_call", error=call_error(found))
    name, arguments = found.get("name"), found.get("arguments")
    if not isinstance(name, str) or (known is not None and name not in known):
        return Turn("tool_call", name=str(name), error=unknown_tool(name))
    if not isinstance(arguments, dict):
        return Turn(
            "tool_call",
            name=name,
            error=call_error(TypeError(f"arguments must be a JSON object, got {type(arguments).__name__}")),
        )
    return Turn("tool_call", name=name, arguments=arguments)


def _json_prefix(text: str) -> Any:
    """The first JSON value at the start of `text` (what follows it is ignored)."""
    value, _ = json.JSONDecoder().raw_decode(text.lstrip())
    return value


def _llama_call(reply: str) -> dict[str, Any] | Exception | None:
    body = reply.split(PYTHON_TAG, 1)[1] if PYTHON_TAG in reply else reply
    if not body.lstrip().startswith("{"):
        return None
    try:
        call = _json_prefix(body)
    except ValueError as exc:
        return exc
    if not isinstance(call, dict) or "name" not in call:
        return None if ANSWER_OPEN in reply else KeyError("name")
    return {"name": call["name"], "arguments": call.get("parameters", call.get("arguments"))}


def _mistral_call(reply: str) -> dict[str, Any] | Exception | None:
    if MISTRAL_CALLS not in reply:
        return None
    try:
        calls = _json_prefix(reply.split(MISTRAL_CALLS, 1)[1])
        call = calls[0] if isinstance(calls, list) else calls
        return {"name": call["name"], "arguments": call["arguments"], "id": call.get("id")}
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return exc


def _react_call(reply: str) -> dict[str, Any] | Exception | None:
    action = _ACTION.search(reply)
    if action is None:
        return None
    rest = reply[action.end() :]
    given = _ACTION_INPUT.search(rest)
    if given is None:
        return {"name": action.group("name"), "arguments": {}}
    try:
        return {"name": action.group("name"), "arguments": _json_prefix(rest[given.end() :])}
    except ValueError as exc:
        return exc


def format_call(fmt: str, name: str, arguments: dict[str, Any], *, think: str = "", index: int = 0) -> str:
    """A well-formed tool-call reply in `fmt`, as the family's model writes it."""
    if fmt == "hermes":
        return format_tool_call(name, arguments, think)
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    if fmt == "mistral":
        call = {"name": name, "arguments": arguments, "id": call_id(index)}
        return f"{MISTRAL_CALLS} {json.dumps([call], ensure_ascii=False)}"
    if fmt == "react":
        return f"Thought: {think}\nAction: {name}\nAction Input: {json.dumps(arguments, ensure_ascii=False)}"
    raise ValueError(f"unknown tool format {fmt!r}; use one of {', '.join(TOOL_FORMATS)}")


def call_instructions(fmt: str) -> str:
    """How the system prompt tells a model of this format to call a tool (the tool list itself
    comes from the chat template where it has one)."""
    if fmt == "hermes":
        return '<tool_call>\n{"name": "<tool name>", "arguments": {"<parameter>": "<value>"}}\n</tool_call>'
    if fmt == "llama3_json":
        return '{"name": "<tool name>", "parameters": {"<parameter>": "<value>"}}'
    if fmt == "mistral":
        return '[TOOL_CALLS] [{"name": "<tool name>", "arguments": {"<parameter>": "<value>"}}]'
    if fmt == "react":
        return 'Thought: <what you know so far and what you need next>\nAction: <tool name>\nAction Input: {"<parameter>": "<value>"}'
    raise ValueError(f"unknown tool format {fmt!r}; use one of {', '.join(TOOL_FORMATS)}")


def detect(chat_template: str | None) -> str:
    """The tool format a chat template speaks: what its tool-call rendering writes."""
    source = chat_template or ""
    if MISTRAL_CALLS in source:
        return "mistral"
    if "<tool_call>" in source:
        return "hermes"
    if "ipython" in source or PYTHON_TAG in source or '"parameters": ' in source:
        return "llama3_json"
    return "react"
