"""The search agent's prompt and how its answer is read (our own words; the STAR protocol of
agent-star.md §1.2 with `Search` as the only tool)."""

from __future__ import annotations

import json
import re

from services.qa.tools import SEARCH_SCHEMA

SEARCH_SYSTEM_PROMPT = """You answer factual questions. You may consult a local encyclopedia through one tool.

<tools>
{tools}
</tools>

How to work:
- Each reply starts with your reasoning inside <think>...</think>.
- After the reasoning, either call the tool once, written as
  <tool_call>{{"name": "Search", "arguments": {{"query": "..."}}}}</tool_call>
  or give the final answer as <answer>...</answer>. Never both in one reply.
- Passages come back in a user message wrapped in <tool_response>...</tool_response>. Trust them over
  your memory. Search again with a sharper query when they do not settle the question; questions that
  chain facts usually need one search per fact.
- The final answer is a short phrase (a name, a date, a number, yes or no), not a sentence. For example:
  <answer>Paris</answer>
"""


def search_system_prompt() -> str:
    return SEARCH_SYSTEM_PROMPT.format(tools=json.dumps(SEARCH_SCHEMA, ensure_ascii=False))


def search_messages(question: str) -> list[dict[str, str]]:
    """The opening chat of one question."""
    return [
        {"role": "system", "content": search_system_prompt()},
        {"role": "user", "content": f"Question: {question.strip()}"},
    ]


_ANSWER = re.compile(r"<answer>(.*)</answer>", re.DOTALL | re.IGNORECASE)


def extract_answer(text: str | None) -> str | None:
    """The text from the first <answer> to the last </answer> (the protocol's rule); an opened
    but unclosed tag takes the rest; None when there is no answer."""
    if not text:
        return None
    match = _ANSWER.search(text)
    if match:
        return match.group(1).strip()
    start = text.lower().find("<answer>")
    if start >= 0:
        return text[start + len("<answer>") :].strip()
    return None
