"""A latency histogram for the request path: one bisect and one increment per sample."""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

#: Upper bounds in seconds, Prometheus-style (the last bucket is +Inf).
DEFAULT_BOUNDS_S = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3)


class Histogram:
    def __init__(self, bounds_s: tuple[float, ...] = DEFAULT_BOUNDS_S):
        self.bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)
        self.sum_s = 0.0
        self.count = 0

    def observe(self, seconds: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds_s, seconds)] += times
        self.sum_s += seconds * times
        self.count += times

    def to_dict(self) -> dict[str, Any]:
        """Cumulative buckets, as Prometheus exposes them."""
        cumulative, running = [], 0
        for bound, count in zip(list(self.bounds_s) + [float("inf")], self.counts):
            running += count
            cumulative.append(["+Inf" if bound == float("inf") else bound, running])
        return {"buckets": cumulative, "sum_s": self.sum_s, "count": self.count}
