"""The six TravelPlanner tools over the travel world, in two output dialects.

- `registry`: names, parameters, descriptions and agent-prompt schemas (the one source of truth);
- `star`: Agent-STAR's output strings (what the released checkpoints were trained on);
- `official`: the TravelPlanner benchmark's strings and pandas-style tables (`table`);
- `faults`: seeded failure injection;
- `toolbox`: the dispatcher (`ToolBox.call`) with an LRU result cache and counters.
"""

from services.sandbox.tools.registry import TOOLS, resolve_tool, tool_schemas
from services.sandbox.tools.toolbox import DIALECTS, BackendError, ToolBox, UnknownTool

__all__ = ["DIALECTS", "TOOLS", "BackendError", "ToolBox", "UnknownTool", "resolve_tool", "tool_schemas"]
