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
import threading
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

    def describe(self) -> list[Any]:
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
        yield from self._state_writes(family, status["broker"].get("state_writes"))
        yield from self._limits(family, status["broker"].get("limits") or {})
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
    def _state_writes(family: _Families, writes: dict[str, Any] | None) -> Iterator[Any]:
        if writes is None:  # --no-state
            return
        failing = family.gauge("kvcached_broker_state_write_failing",
                               "1 while writes to the state directory fail and the broker serves from memory")
        failing.add([], 1 if writes["failing"] else 0)
        failures = family.counter("kvcached_broker_state_write_failures", "Writes to the state directory that failed")
        failures.add([], writes["failures"])
        yield from (failing.metric, failures.metric)

    @staticmethod
    def _limits(family: _Families, limits: dict[str, Any]) -> Iterator[Any]:
        """Each bound on what peers may hold of the broker (``kvcached_broker_limit{limit}``), and
        what met it."""
        bound = family.gauge("kvcached_broker_limit", "A bound on what peers may hold of the broker (status broker.limits)",
                             ["limit"])
        open_files = limits.get("open_files")
        if open_files:
            bound.add(["open_files"], open_files["soft"])
        connections = limits.get("connections")
        if connections:
            bound.add(["connections"], connections["max"])
            bound.add(["connections_per_peer"], connections["max_per_peer"])
            now = family.gauge("kvcached_broker_connections", "Connections to the broker's socket it serves")
            now.add([], connections["admitted"])
            refused = family.counter("kvcached_broker_connections_refused",
                                     "Connections closed on arrival, by the bound they met", ["bound"])
            for reason, n in sorted(connections["refused"].items()):
                refused.add([reason], n)
            yield from (now.metric, refused.metric)
        requests, replies, cache = limits.get("requests"), limits.get("replies"), limits.get("reply_cache")
        if requests:
            bound.add(["request_bytes"], requests["max_bytes"])
            bound.add(["requests_per_connection"], requests["per_connection"])
        if replies:
            for key in ("per_connection", "large_bytes", "large_per_connection", "large_bytes_per_peer",
                        "large_bytes_total"):
                bound.add([f"replies_{key}"], replies[key])
            waiting = family.gauge("kvcached_broker_large_replies_waiting_bytes",
                                   "Large replies (status documents) sent and not yet taken by their peers")
            waiting.add([], replies["large_waiting_bytes"])
            dropped = family.counter("kvcached_broker_replies_dropped",
                                     "Replies dropped for a peer that does not read them, by the bound they met",
                                     ["bound"])
            for reason, n in sorted(replies["dropped"].items()):
                dropped.add([reason], n)
            yield from (waiting.metric, dropped.metric)
        if cache:
            bound.add(["reply_cache_replies"], cache["replies"])
            bound.add(["reply_cache_bytes"], cache["bytes"])
            held = family.gauge("kvcached_broker_reply_cache_bytes", "Replies every session keeps for retried requests")
            held.add([], cache["held_bytes"])
            yield held.metric
        metrics = limits.get("metrics")
        if metrics:
            bound.add(["metrics_threads"], metrics["threads"])
            bound.add(["metrics_queue"], metrics["queue"])
            bound.add(["metrics_timeout_s"], metrics["timeout_s"])
            refused = family.counter("kvcached_broker_metrics_connections_refused",
                                     "/metrics connections closed on arrival: every thread busy and the queue full")
            refused.add([], metrics["refused"])
            yield refused.metric
        yield bound.metric

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


#: ``/metrics`` is served by this many threads, with this many connections waiting for one; a
#: connection past those is closed at once.  Every read and write on a connection times out.
METRICS_THREADS = 4
METRICS_QUEUE = 16
METRICS_TIMEOUT_S = 5.0


class MetricsServer:
    """``/metrics`` over HTTP/1.0 (one request per connection) from a bounded pool of threads.

    Invariant: at most ``threads + queue`` connections are open at once (each one file
    descriptor), and none is held longer than ``timeout_s`` without a byte moving, so idle
    connections, open to any local user, cannot take the descriptors the broker's workers
    need (prometheus_client's own server starts a thread per connection, without a bound)."""

    def __init__(self, address: str, port: int, handler: type, *, threads: int = METRICS_THREADS,
                 queue_size: int = METRICS_QUEUE, timeout_s: float = METRICS_TIMEOUT_S):
        import http.server
        import queue
        import socket

        self.threads = threads
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.served = 0
        self.refused = 0
        # (request, client address) as socketserver hands them over, for a worker to answer
        self._queue: queue.Queue[tuple[socket.socket | tuple[bytes, socket.socket], Any]] = queue.Queue(maxsize=queue_size)
        owner = self
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]

        class _Server(http.server.HTTPServer):
            address_family = family
            request_queue_size = queue_size

            def process_request(self, request: socket.socket | tuple[bytes, socket.socket],
                                client_address: Any) -> None:  # called by serve_forever's thread
                try:
                    owner._queue.put_nowait((request, client_address))
                except queue.Full:
                    owner.refused += 1
                    self.shutdown_request(request)

        handler_class = type("BoundedMetricsHandler", (handler,), {"timeout": timeout_s})
        self._server = _Server((address, port), handler_class)
        self._workers = [threading.Thread(target=self._work, name=f"kvcached-broker-metrics-{i}", daemon=True)
                         for i in range(threads)]
        for worker in self._workers:
            worker.start()
        self._acceptor = threading.Thread(target=self._server.serve_forever, name="kvcached-broker-metrics",
                                          daemon=True)
        self._acceptor.start()

    def _work(self) -> None:
        while True:
            request, client_address = self._queue.get()
            try:
                self._server.finish_request(request, client_address)
                self.served += 1
            except Exception:  # noqa: BLE001 - a timeout or a peer that went away: that connection only
                pass
            finally:
                self._server.shutdown_request(request)

    def view(self) -> dict[str, Any]:
        return {"threads": self.threads, "queue": self.queue_size, "timeout_s": self.timeout_s,
                "waiting": self._queue.qsize(), "served": self.served, "refused": self.refused}


def start_metrics_server(port: int, address: str, snapshot: Callable[[], dict[str, Any] | None],
                         gpu: GpuLabels) -> MetricsServer:
    """Serve ``/metrics`` on ``address:port`` from a bounded pool of daemon threads, every series
    labelled ``gpu``."""
    try:
        from prometheus_client import CollectorRegistry, MetricsHandler
    except ImportError as exc:
        raise RuntimeError("--metrics-port needs prometheus_client: pip install 'kvcached-broker[metrics]'") from exc
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot, gpu))
    server = MetricsServer(address, port, MetricsHandler.factory(registry))
    log.info("event=metrics address=%s port=%d uuid=%s hostname=%s threads=%d queue=%d timeout_s=%g", address, port,
             gpu.uuid, gpu.hostname, server.threads, server.queue_size, server.timeout_s)
    return server
