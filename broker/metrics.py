"""Prometheus metrics (``serve --metrics-port``), read from the same document as ``status --json``.

Each scrape asks the server thread for a status snapshot, so every number matches what
``status --json`` says at that moment, and the request path pays nothing for metrics.
Everything is named ``kvcached_broker_*`` with the unit in the name; counters end in
``_total``.  Every series carries the GPU's identity (:class:`GpuLabels`): ``device`` (the NVML
index, as the broker was told it) and the labels by which DCGM exporter names the same GPU
(``UUID``, ``modelName``, and the host as ``Hostname`` and ``hostname``), so that a PromQL
``on (UUID)`` join puts the broker's series next to the GPU's own.  The label names are a
contract (docs/design.md, "Metrics"): they only grow.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

log = logging.getLogger("kvcached_broker")

DEVICE_GAUGES = {
    "total_bytes": "Device memory in total",
    "headroom_bytes": "Memory the broker keeps free",
    "external_bytes": "Memory used by processes not registered with the broker",
    "budget_bytes": "total - headroom - external: what the broker may hand out",
    "reserved_bytes": "Static reservations of every session",
    "granted_bytes": "Elastic pages granted to every session",
    "unreported_bytes": "Measured usage of registered processes beyond what they reported",
    "free_bytes": "budget - reserved - granted - unreported (0 when overcommitted)",
}


@dataclass(frozen=True)
class GpuLabels:
    """The labels every series carries, in :data:`NAMES` order, fixed for the broker's life.

    ``uuid`` is the GPU's NVML UUID (``GPU-...``; ``SIM-GPU-N`` when simulated) and the join key
    with DCGM exporter, whose ``UUID`` label holds the same string.  ``device`` is the NVML index
    the broker serves: it depends on which GPUs the broker's container sees, so it is not DCGM
    exporter's ``gpu`` (nor its ``device``, which is ``nvidiaN``) and is no join key.  The host
    is exported twice because DCGM exporter renamed its label: ``Hostname`` in its releases up
    to 4.5.3-4.8.2, ``hostname`` after May 2026 (a Kubernetes node name where the chart sets it).
    """

    device: str
    uuid: str
    model_name: str
    hostname: str

    NAMES = ("device", "UUID", "modelName", "Hostname", "hostname")

    def values(self) -> list[str]:
        return [self.device, self.uuid, self.model_name, self.hostname, self.hostname]


def missing_package() -> str | None:
    """The package ``/metrics`` needs, if it is not installed (checked before the broker starts)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("prometheus_client") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "prometheus_client"


class StatusCollector:
    """A prometheus_client collector over a ``snapshot()`` callable returning the status document.

    Every sample it yields carries ``gpu``'s labels first (:attr:`GpuLabels.NAMES`), then its own.
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any] | None], gpu: GpuLabels):
        self._snapshot = snapshot
        self._gpu = gpu

    def describe(self) -> list:
        return []  # unchecked collector: metrics are known only from a snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        family = _Families(self._gpu, GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)
        status = self._snapshot()
        up = family.gauge("kvcached_broker_up", "1 if the broker answered this scrape")
        up.add([], 0 if status is None else 1)
        yield up.metric
        if status is None:
            return
        for key, doc in DEVICE_GAUGES.items():
            g = family.gauge(f"kvcached_broker_device_{key}", doc)
            g.add([], status[key])
            yield g.metric
        over = family.gauge("kvcached_broker_overcommitted", "1 while charges exceed the budget")
        over.add([], 1 if status["overcommitted"] else 0)
        yield over.metric
        yield from self._instances(family, status)
        yield from self._counters(family, status["broker"].get("counters", {}))

    @staticmethod
    def _instances(family: _Families, status: dict[str, Any]) -> Iterator[Any]:
        pool = family.gauge("kvcached_broker_instance_pool_bytes", "Reserved bytes by instance and pool",
                            ["instance", "pool"])
        reserved = family.gauge("kvcached_broker_instance_reserved_bytes", "Reserved bytes by instance", ["instance"])
        granted = family.gauge("kvcached_broker_instance_granted_bytes", "Granted elastic bytes by instance",
                               ["instance"])
        floor = family.gauge("kvcached_broker_instance_min_bytes", "Guaranteed floor by instance", ["instance"])
        cap = family.gauge("kvcached_broker_instance_max_bytes", "Cap by instance (absent when unset)", ["instance"])
        sessions = family.gauge("kvcached_broker_sessions", "Sessions by instance and state", ["instance", "state"])
        share = family.gauge("kvcached_broker_instance_fair_share_bytes",
                             "What the instance may hold while others want memory (weights, floors, caps)", ["instance"])
        pending = family.gauge("kvcached_broker_instance_pressure_pending_bytes",
                               "Bytes the broker has asked the instance to give back and not yet had", ["instance"])
        pressure = {key: family.counter(f"kvcached_broker_instance_pressure_{key}", doc, ["instance"]) for key, doc in (
            ("asks", "Pressure asks sent to the instance's sessions"),
            ("asked_bytes", "Bytes asked back from the instance"),
            ("returned_bytes", "Asked bytes the instance gave back (released, or freed with a session)"),
            ("ignored_bytes", "Asked bytes still held when the ask expired"),
        )}
        for inst in status["instances"]:
            name = inst["name"]
            for pool_name, size in inst["pools"].items():
                pool.add([name, pool_name], size)
            reserved.add([name], inst["reserved_bytes"])
            granted.add([name], inst["granted_bytes"])
            floor.add([name], inst["min_bytes"])
            if inst["max_bytes"] is not None:
                cap.add([name], inst["max_bytes"])
            states: dict[str, int] = {"live": 0, "stale": 0, "recovering": 0}
            for s in inst["sessions"]:
                states[s["state"]] = states.get(s["state"], 0) + 1
            for state, count in states.items():
                sessions.add([name, state], count)
            if "fair_share_bytes" in inst:
                share.add([name], inst["fair_share_bytes"])
            if "pressure" in inst:
                pending.add([name], inst["pressure"]["pending_bytes"])
                for key, counter in pressure.items():
                    counter.add([name], inst["pressure"][key])
        yield from (f.metric for f in (pool, reserved, granted, floor, cap, sessions, share, pending, *pressure.values()))

    @staticmethod
    def _counters(family: _Families, counters: dict[str, Any]) -> Iterator[Any]:
        requests = family.counter("kvcached_broker_requests", "Requests received")
        requests.add([], counters.get("requests", 0))
        grants = family.counter("kvcached_broker_grants", "Elastic grants made")
        grants.add([], counters.get("grants", 0))
        refusals = family.counter("kvcached_broker_refusals", "Requests refused, by error code", ["code"])
        for code, n in sorted(counters.get("refusals", {}).items()):
            refusals.add([code], n)
        reclaims = family.counter("kvcached_broker_reclaims", "Sessions ended, by cause", ["cause"])
        for cause, n in sorted(counters.get("reclaims", {}).items()):
            reclaims.add([cause], n)
        bad = family.counter("kvcached_broker_bad_frames", "Frames that were not valid requests")
        bad.add([], counters.get("bad_frames", 0))
        yield from (f.metric for f in (requests, grants, refusals, reclaims, bad))
        hist = counters.get("request_latency")
        if hist:
            h = family.histogram("kvcached_broker_request_duration_seconds", "Time to serve a round of requests")
            buckets = [(("+Inf" if b == "+Inf" else repr(float(b))), n) for b, n in hist["buckets"]]
            h.metric.add_metric(h.gpu_values, buckets, sum_value=hist["sum_s"])
            yield h.metric


class _Family:
    """One metric family whose samples all start with the GPU's labels."""

    def __init__(self, metric: Any, gpu: GpuLabels):
        self.metric = metric
        self.gpu_values = gpu.values()

    def add(self, own_labels: list[str], value: float) -> None:
        self.metric.add_metric(self.gpu_values + own_labels, value)


class _Families:
    """Makes the families of one scrape, each labelled ``GpuLabels.NAMES`` + its own labels."""

    def __init__(self, gpu: GpuLabels, gauge_type: Any, counter_type: Any, histogram_type: Any):
        self._gpu = gpu
        self._types = {"gauge": gauge_type, "counter": counter_type, "histogram": histogram_type}

    def _make(self, kind: str, name: str, doc: str, own: list[str] | None) -> _Family:
        labels = [*GpuLabels.NAMES, *(own or [])]
        return _Family(self._types[kind](name, doc, labels=labels), self._gpu)

    def gauge(self, name: str, doc: str, own: list[str] | None = None) -> _Family:
        return self._make("gauge", name, doc, own)

    def counter(self, name: str, doc: str, own: list[str] | None = None) -> _Family:
        return self._make("counter", name, doc, own)

    def histogram(self, name: str, doc: str) -> _Family:
        return self._make("histogram", name, doc, None)


def start_metrics_server(port: int, address: str, snapshot: Callable[[], dict[str, Any] | None], gpu: GpuLabels):
    """Serve ``/metrics`` on ``address:port`` from a daemon thread, every series labelled ``gpu``;
    returns the HTTP server."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        raise RuntimeError("--metrics-port needs prometheus_client: pip install 'kvcached-broker[metrics]'") from exc
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot, gpu))
    server, _thread = start_http_server(port, addr=address, registry=registry)
    log.info("event=metrics address=%s port=%d uuid=%s hostname=%s", address, port, gpu.uuid, gpu.hostname)
    return server
