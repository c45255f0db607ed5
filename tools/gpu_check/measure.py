"""Small helpers the parts share: waiting on a condition, percentiles, a broker's status by instance."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence


def wait_for(condition: Callable[[], bool], timeout_s: float, step_s: float = 0.01) -> float | None:
    """Poll ``condition`` until it holds; the seconds that took, or None if it did not within
    ``timeout_s`` (a measurement's bound, not a synchronisation: the caller records either)."""
    start = time.monotonic()
    while True:
        if condition():
            return time.monotonic() - start
        if time.monotonic() - start >= timeout_s:
            return None
        time.sleep(step_s)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of the values that are not None; None if there are none."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    return present[min(len(present) - 1, int(q * len(present)))]


def spread(stem: str, values: Sequence[float | None], unit: str = "_s") -> dict[str, Any]:
    """``{stem}_p50{unit}``, ``{stem}_max{unit}`` and ``{stem}_missing`` (how many are None)."""
    present = [v for v in values if v is not None]
    return {f"{stem}_p50{unit}": percentile(present, 0.5), f"{stem}_max{unit}": max(present) if present else None,
            f"{stem}_missing": len(values) - len(present)}


def instance(status: dict[str, Any], name: str) -> dict[str, Any] | None:
    for inst in status["instances"]:
        if inst["name"] == name:
            return inst
    return None


def session_of(status: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The first session of instance ``name`` (the check's instances have one each), or None."""
    inst = instance(status, name)
    return inst["sessions"][0] if inst and inst["sessions"] else None


def charged_by_pid(status: dict[str, Any]) -> dict[int, int]:
    """What each process reported to the broker (its pools and holds) plus the pages granted to it:
    what the broker charges it unless the device measures more."""
    charged: dict[int, int] = {}
    for inst in status["instances"]:
        for session in inst["sessions"]:
            pid = session["pid"]
            charged[pid] = charged.get(pid, 0) + session["reserved_bytes"] + session["granted_bytes"]
    return charged


def granted_by_pid(status: dict[str, Any]) -> dict[int, int]:
    """Bytes of pages the broker granted each process."""
    granted: dict[int, int] = {}
    for inst in status["instances"]:
        for session in inst["sessions"]:
            pid = session["pid"]
            granted[pid] = granted.get(pid, 0) + session["granted_pages"] * session["page_bytes"]
    return granted
