"""The OOD tool set: one tool, `Search(query)`, over a `PassageIndex`.

It answers with the same `ToolResult` shape as the travel sandbox, so the agent loop can point
at either tool set unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from services.common.schemas import ToolResult
from services.qa.retriever import PassageIndex, render_hits
from services.sandbox.tools.toolbox import UnknownTool

MAX_QUERY_CHARS = 1000

SEARCH_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "Search",
        "description": "Look up passages of the local encyclopedia that are most relevant to a query. "
        "Returns the top passages, each with its title.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to look up, as a short question or phrase."}
            },
            "required": ["query"],
        },
    },
}


class SearchToolSet:
    """Runs `Search` calls; a bad argument is the agent's mistake and comes back as tool text.
    Top-5 by default, as the STAR paper states for its OOD runs (Search-R1's own scripts use 3)."""

    def __init__(self, index: PassageIndex, top_k: int = 5) -> None:
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        self.index = index
        self.top_k = top_k

    @staticmethod
    def names() -> list[str]:
        return ["Search"]

    @staticmethod
    def schemas() -> list[dict[str, Any]]:
        return [SEARCH_SCHEMA]

    def call(self, name: str, arguments: Mapping[str, Any] | None = None, *, top_k: int | None = None) -> ToolResult:
        t0 = time.perf_counter()
        if name.lower() != "search":
            raise UnknownTool(name)
        query = (arguments or {}).get("query")
        if not isinstance(query, str) or not query.strip():
            text, ok = "Error: Search needs a non-empty 'query' string.", False
        elif len(query) > MAX_QUERY_CHARS:
            text, ok = f"Error: the query is longer than {MAX_QUERY_CHARS} characters.", False
        else:
            text, ok = render_hits(self.index.search(query.strip(), top_k or self.top_k)), True
        return ToolResult(name="Search", text=text, ok=ok, elapsed_ms=(time.perf_counter() - t0) * 1000.0)
