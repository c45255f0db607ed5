"""Constants and small helpers shared by the tests (import as ``from helpers import ...``)."""

from __future__ import annotations

import os
import time

GIB = 1 << 30
MIB = 1 << 20


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last value: {last!r})")


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVCACHED_BROKER", None)
    return env
