"""Monotonic counters the broker keeps for status and metrics (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .histogram import Histogram


@dataclass
class Counters:
    requests: int = 0
    grants: int = 0
    refusals: dict[str, int] = field(default_factory=dict)  # by error code
    reclaims: dict[str, int] = field(default_factory=dict)  # by cause: closed, exited, evicted, exited_while_down
    bad_frames: int = 0
    latency: Histogram = field(default_factory=Histogram)  # a round's service time, once per request

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "grants": self.grants,
            "refusals": dict(self.refusals),
            "reclaims": dict(self.reclaims),
            "bad_frames": self.bad_frames,
            "request_latency": self.latency.to_dict(),
        }

    def refused(self, code: str) -> None:
        self.refusals[code] = self.refusals.get(code, 0) + 1

    def reclaimed(self, cause: str) -> None:
        self.reclaims[cause] = self.reclaims.get(cause, 0) + 1
