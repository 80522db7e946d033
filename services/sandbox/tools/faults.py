"""Tool-failure injection (STAR's environment-stability experiments, spec agent-star.md §4.7).

A faulted call returns exactly `Error: Current tool {tool_name} is not available.` instead of
running the tool. Whether a call faults is a Bernoulli draw with a rate chosen per call, per
tool or globally, from one of two seeded sources:

- keyed: a stable id of the call (`fault_key`, e.g. "traj-7/3") hashed with the seed, so a
  replayed trajectory sees the same failures whatever else runs concurrently or in what order;
- unkeyed: the injector's own seeded stream, reproducible for a fixed sequence of calls.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Mapping

FAULT_TEMPLATE = "Error: Current tool {tool_name} is not available."
_TWO_64 = float(1 << 64)


def fault_text(tool_name: str) -> str:
    return FAULT_TEMPLATE.format(tool_name=tool_name)


def keyed_uniform(seed: int, key: str) -> float:
    """A uniform draw in [0, 1) determined only by (seed, key)."""
    data = f"{seed}\x1f{key}".encode("utf-8", "surrogatepass")  # any str key, lone surrogates too
    digest = hashlib.blake2b(data, digest_size=8, person=b"star-fault").digest()
    return int.from_bytes(digest, "big") / _TWO_64


def check_rate(rate: float, what: str = "fault rate") -> float:
    rate = float(rate)
    if not 0.0 <= rate <= 1.0:  # also rejects NaN
        raise ValueError(f"{what} must be within [0, 1], got {rate}")
    return rate


class FaultInjector:
    """Decides, per call, whether a tool fails. Thread-safe.

    `rate` is the global probability; `per_tool` maps tool names to their own rate (overriding
    the global one); a per-call `rate` overrides both. `seed` seeds the unkeyed stream and is the
    default seed of keyed draws.
    """

    def __init__(self, rate: float = 0.0, seed: int = 0, per_tool: Mapping[str, float] | None = None) -> None:
        self._lock = threading.Lock()
        self.configure(rate=rate, seed=seed, per_tool=per_tool)

    def configure(self, *, rate: float = 0.0, seed: int = 0, per_tool: Mapping[str, float] | None = None) -> None:
        """Replace the run-level settings; restarts the unkeyed stream from `seed`."""
        checked = {str(k): check_rate(v, f"fault rate of {k}") for k, v in (per_tool or {}).items()}
        with self._lock:
            self.rate = check_rate(rate)
            self.seed = int(seed)
            self.per_tool = checked
            self._stream = random.Random(self.seed)

    def rate_for(self, tool: str, override: float | None = None) -> float:
        if override is not None:
            return check_rate(override)
        return self.per_tool.get(tool, self.rate)

    def draw(self, tool: str, *, rate: float | None = None, seed: int | None = None, key: str | None = None) -> bool:
        """True when this call of `tool` should fail.

        With a key the outcome depends only on (seed, key); with a per-call seed but no key, only
        on the seed; otherwise the next number of the run's stream is used.
        """
        p = self.rate_for(tool, rate)
        if p <= 0.0:
            return False
        if p >= 1.0:
            return True
        if key is not None:
            return keyed_uniform(self.seed if seed is None else seed, key) < p
        if seed is not None:
            return keyed_uniform(seed, "") < p
        with self._lock:
            u = self._stream.random()
        return u < p

    def config(self) -> dict:
        return {"rate": self.rate, "seed": self.seed, "per_tool": dict(self.per_tool)}
