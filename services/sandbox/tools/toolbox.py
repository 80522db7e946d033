"""The dispatcher: one call in, one `ToolResult` out, in either dialect, with faults and a cache.

`ToolBox.call` is what the HTTP layer, the agent loop (in-process) and the benchmarks use. It
never raises for any argument value; it raises `UnknownTool` for a name that is not one of the
six tools (or their official aliases), `ValueError` for an unknown dialect or a bad per-call
fault rate, and `BackendError` when the world database cannot answer.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from services.common.schemas import ToolResult
from services.sandbox.tools.faults import FaultInjector, fault_text
from services.sandbox.tools.lookup import BackendError, WorldLookup
from services.sandbox.tools.official import OfficialTools
from services.sandbox.tools.registry import TOOLS, resolve_tool, tool_names
from services.sandbox.tools.star import StarTools
from services.sandbox.world import World

DIALECTS = ("star", "official")
# Longer argument values are not cached: the key would pin them in memory, and no real
# city/state/date is anywhere near this long.
MAX_CACHED_ARG_CHARS = 256

__all__ = ["DIALECTS", "BackendError", "ToolBox", "UnknownTool"]


class UnknownTool(LookupError):
    """The name is not one of the six tools."""

    def __init__(self, name: object) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown tool {self.name!r}"


def check_dialect(dialect: str) -> str:
    if dialect not in DIALECTS:
        raise ValueError(f"unknown tool dialect {dialect!r}; use one of {', '.join(DIALECTS)}")
    return dialect


_MISSING = object()
_COUNTERS = ("calls", "ok", "errors", "faults", "cache_hits")


class ToolBox:
    """The six tools over one world.

    - `dialect`: default output dialect (`star` or `official`), overridable per call;
    - `fault_rate`, `fault_seed`, `per_tool_fault_rates`: run-level failure injection;
    - `cache_size`: rendered results kept in an LRU keyed by (dialect, tool, arguments); 0 = off;
    - `city_set`, `restaurant_index`: official-dialect options (see `OfficialTools`).
    """

    def __init__(
        self,
        world: World,
        dialect: str = "star",
        fault_rate: float = 0.0,
        fault_seed: int = 0,
        cache_size: int = 4096,
        *,
        per_tool_fault_rates: Mapping[str, float] | None = None,
        city_set: Sequence[str] | None = None,
        restaurant_index: bool = False,
    ) -> None:
        self.world = world
        self.dialect = check_dialect(dialect)
        reader = WorldLookup(world)
        self._impl = {
            "star": StarTools(world, reader=reader),
            "official": OfficialTools(world, city_set=city_set, restaurant_index=restaurant_index, reader=reader),
        }
        self.faults = FaultInjector(fault_rate, fault_seed, _canonical_rates(per_tool_fault_rates))
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, tuple[str, bool]] = OrderedDict()
        self._cache_size = max(0, int(cache_size))
        self._cache_misses = 0
        self._stats = {name: dict.fromkeys(_COUNTERS, 0) for name in tool_names()}
        self._unknown = 0

    @classmethod
    def from_settings(cls, world: World, settings: Any) -> ToolBox:
        return cls(
            world,
            dialect=settings.tool_dialect,
            fault_rate=settings.fault_rate,
            fault_seed=settings.fault_seed,
            cache_size=settings.tool_cache_size,
        )

    # --- calling --------------------------------------------------------------------------
    def call(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        dialect: str | None = None,
        fault_rate: float | None = None,
        fault_seed: int | None = None,
        fault_key: str | None = None,
    ) -> ToolResult:
        """Run tool `name` (star or official name) with `arguments`."""
        t0 = time.perf_counter()
        spec = resolve_tool(name)
        if spec is None:
            with self._lock:
                self._unknown += 1
            raise UnknownTool(name)
        dialect = self.dialect if dialect is None else check_dialect(dialect)
        if arguments is None:
            arguments = {}
        faulted = self.faults.draw(spec.name, rate=fault_rate, seed=fault_seed, key=fault_key)
        if faulted:
            text, ok, hit = fault_text(name), False, False
        else:
            text, ok, hit = self._run(dialect, spec.name, arguments)
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        with self._lock:
            counters = self._stats[spec.name]
            counters["calls"] += 1
            counters["faults" if faulted else ("ok" if ok else "errors")] += 1
            counters["cache_hits"] += hit
        return ToolResult(name=name, text=text, ok=ok, fault_injected=faulted, elapsed_ms=elapsed_ms)

    def _run(self, dialect: str, tool: str, arguments: Any) -> tuple[str, bool, bool]:
        key = self._cache_key(dialect, tool, arguments) if self._cache_size else None
        if key is not None:
            with self._lock:
                cached = self._cache.get(key)
                if cached is not None:
                    self._cache.move_to_end(key)
                    return cached[0], cached[1], True
        text, ok = self._impl[dialect].run(tool, arguments)
        if key is not None:
            with self._lock:
                self._cache_misses += 1
                self._cache[key] = (text, ok)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return text, ok, False

    @staticmethod
    def _cache_key(dialect: str, tool: str, arguments: Any) -> tuple | None:
        """(dialect, tool, values of the parameters the tool reads), or None when not cacheable.

        Only string values are cached: `1`, `1.0` and `True` are equal as dict keys but print
        differently. The official dialect also reads parameter aliases, so they are part of its key.
        """
        if not isinstance(arguments, Mapping):
            return None
        values: list[Any] = []
        for param in TOOLS[tool].params:
            names = (param.name,) if dialect == "star" else (param.name, *param.aliases)
            for n in names:
                v = arguments.get(n, _MISSING)
                if v is not _MISSING and (type(v) is not str or len(v) > MAX_CACHED_ARG_CHARS):
                    return None
                values.append(v)
        return (dialect, tool, *values)

    # --- introspection and control ---------------------------------------------------------
    @staticmethod
    def names() -> list[str]:
        """The six tool names (star names; official aliases resolve to them)."""
        return tool_names()

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """Per-tool counters: calls = ok + errors + faults; cache_hits ⊆ ok + errors."""
        with self._lock:
            return {name: dict(c) for name, c in self._stats.items()}

    def stats_snapshot(self) -> dict[str, Any]:
        """Counters plus the number of calls to unknown tools (JSON-ready)."""
        snap: dict[str, Any] = {"tools": self.stats}
        with self._lock:
            snap["unknown_tool_calls"] = self._unknown
        return snap

    def cache_info(self) -> dict[str, int | bool]:
        with self._lock:
            hits = sum(c["cache_hits"] for c in self._stats.values())
            return {
                "enabled": self._cache_size > 0,
                "max_size": self._cache_size,
                "size": len(self._cache),
                "hits": hits,
                "misses": self._cache_misses,
            }

    def set_cache_size(self, size: int) -> None:
        """Resize the result cache; 0 switches it off (and empties it)."""
        with self._lock:
            self._cache_size = max(0, int(size))
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def set_faults(self, *, rate: float = 0.0, seed: int = 0, per_tool: Mapping[str, float] | None = None) -> None:
        """Replace the run-level failure injection (restarts the unkeyed stream from `seed`)."""
        self.faults.configure(rate=rate, seed=seed, per_tool=_canonical_rates(per_tool))

    def fault_config(self) -> dict[str, Any]:
        return self.faults.config()


def _canonical_rates(per_tool: Mapping[str, float] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, rate in (per_tool or {}).items():
        spec = resolve_tool(name)
        if spec is None:
            raise ValueError(f"unknown tool {name!r} in per-tool fault rates; known: {', '.join(tool_names())}")
        out[spec.name] = rate
    return out
