"""Waiting in a test for something another process does, with a bound."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def until(
    condition: Callable[[], Any], timeout: float = 30.0, what: str = "the condition", poll_s: float = 0.05
) -> Any:
    """`condition()`'s first true value within `timeout` seconds; an AssertionError naming `what` after."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = condition()
        if out:
            return out
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")
