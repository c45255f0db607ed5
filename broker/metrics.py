"""Prometheus metrics (``serve --metrics-port``), read from the same document as ``status --json``.

Each scrape asks the server thread for a status snapshot, so every number matches what
``status --json`` says at that moment, and the request path pays nothing for metrics.
Everything is named ``kvcached_broker_*`` with the unit in the name; counters end in
``_total``.  Every series carries the ``device`` label (the NVML index).
"""

from __future__ import annotations

import logging
import threading
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


def missing_package() -> str | None:
    """The package ``/metrics`` needs, if it is not installed (checked before the broker starts)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("prometheus_client") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "prometheus_client"


class StatusCollector:
    """A prometheus_client collector over a ``snapshot()`` callable returning the status document."""

    def __init__(self, snapshot: Callable[[], dict[str, Any] | None]):
        self._snapshot = snapshot

    def describe(self) -> list:
        return []  # unchecked collector: metrics are known only from a snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        status = self._snapshot()
        up = GaugeMetricFamily("kvcached_broker_up", "1 if the broker answered this scrape", labels=["device"])
        if status is None:
            up.add_metric(["unknown"], 0)
            yield up
            return
        device = str(status["device"]["index"])
        up.add_metric([device], 1)
        yield up
        for key, doc in DEVICE_GAUGES.items():
            g = GaugeMetricFamily(f"kvcached_broker_device_{key}", doc, labels=["device"])
            g.add_metric([device], status[key])
            yield g
        over = GaugeMetricFamily("kvcached_broker_overcommitted", "1 while charges exceed the budget", labels=["device"])
        over.add_metric([device], 1 if status["overcommitted"] else 0)
        yield over
        yield from self._instances(device, status, GaugeMetricFamily)
        yield from self._state_writes(device, status["broker"].get("state_writes"), GaugeMetricFamily,
                                      CounterMetricFamily)
        yield from self._limits(device, status["broker"].get("limits") or {}, GaugeMetricFamily, CounterMetricFamily)
        yield from self._counters(device, status["broker"].get("counters", {}), CounterMetricFamily, HistogramMetricFamily)

    @staticmethod
    def _instances(device: str, status: dict[str, Any], gauge) -> Iterator[Any]:
        pool = gauge("kvcached_broker_instance_pool_bytes", "Reserved bytes by instance and pool",
                     labels=["device", "instance", "pool"])
        reserved = gauge("kvcached_broker_instance_reserved_bytes", "Reserved bytes by instance",
                         labels=["device", "instance"])
        granted = gauge("kvcached_broker_instance_granted_bytes", "Granted elastic bytes by instance",
                        labels=["device", "instance"])
        floor = gauge("kvcached_broker_instance_min_bytes", "Guaranteed floor by instance", labels=["device", "instance"])
        cap = gauge("kvcached_broker_instance_max_bytes", "Cap by instance (absent when unset)",
                    labels=["device", "instance"])
        sessions = gauge("kvcached_broker_sessions", "Sessions by instance and state",
                         labels=["device", "instance", "state"])
        for inst in status["instances"]:
            name = inst["name"]
            for pool_name, size in inst["pools"].items():
                pool.add_metric([device, name, pool_name], size)
            reserved.add_metric([device, name], inst["reserved_bytes"])
            granted.add_metric([device, name], inst["granted_bytes"])
            floor.add_metric([device, name], inst["min_bytes"])
            if inst["max_bytes"] is not None:
                cap.add_metric([device, name], inst["max_bytes"])
            states: dict[str, int] = {"live": 0, "stale": 0, "recovering": 0}
            for s in inst["sessions"]:
                states[s["state"]] = states.get(s["state"], 0) + 1
            for state, count in states.items():
                sessions.add_metric([device, name, state], count)
        yield from (pool, reserved, granted, floor, cap, sessions)

    @staticmethod
    def _state_writes(device: str, writes: dict[str, Any] | None, gauge, counter) -> Iterator[Any]:
        if writes is None:  # --no-state
            return
        failing = gauge("kvcached_broker_state_write_failing",
                        "1 while writes to the state directory fail and the broker serves from memory",
                        labels=["device"])
        failing.add_metric([device], 1 if writes["failing"] else 0)
        failures = counter("kvcached_broker_state_write_failures", "Writes to the state directory that failed",
                           labels=["device"])
        failures.add_metric([device], writes["failures"])
        yield from (failing, failures)

    @staticmethod
    def _limits(device: str, limits: dict[str, Any], gauge, counter) -> Iterator[Any]:
        """Each bound on what peers may hold of the broker (``kvcached_broker_limit{limit}``), and
        what met it."""
        bound = gauge("kvcached_broker_limit", "A bound on what peers may hold of the broker (status broker.limits)",
                      labels=["device", "limit"])
        open_files = limits.get("open_files")
        if open_files:
            bound.add_metric([device, "open_files"], open_files["soft"])
        connections = limits.get("connections")
        metrics = limits.get("metrics")
        if connections:
            bound.add_metric([device, "connections"], connections["max"])
            bound.add_metric([device, "connections_per_peer"], connections["max_per_peer"])
            now = gauge("kvcached_broker_connections", "Connections to the broker's socket it serves",
                        labels=["device"])
            now.add_metric([device], connections["admitted"])
            refused = counter("kvcached_broker_connections_refused",
                              "Connections closed on arrival, by the bound they met", labels=["device", "bound"])
            for reason, n in sorted(connections["refused"].items()):
                refused.add_metric([device, reason], n)
            yield from (now, refused)
        requests, replies, cache = limits.get("requests"), limits.get("replies"), limits.get("reply_cache")
        if requests:
            bound.add_metric([device, "request_bytes"], requests["max_bytes"])
            bound.add_metric([device, "requests_per_connection"], requests["per_connection"])
        if replies:
            for key in ("per_connection", "large_bytes", "large_per_connection", "large_bytes_per_peer",
                        "large_bytes_total"):
                bound.add_metric([device, f"replies_{key}"], replies[key])
            waiting = gauge("kvcached_broker_large_replies_waiting_bytes",
                            "Large replies (status documents) sent and not yet taken by their peers",
                            labels=["device"])
            waiting.add_metric([device], replies["large_waiting_bytes"])
            dropped = counter("kvcached_broker_replies_dropped",
                              "Replies dropped for a peer that does not read them, by the bound they met",
                              labels=["device", "bound"])
            for reason, n in sorted(replies["dropped"].items()):
                dropped.add_metric([device, reason], n)
            yield from (waiting, dropped)
        if cache:
            bound.add_metric([device, "reply_cache_replies"], cache["replies"])
            bound.add_metric([device, "reply_cache_bytes"], cache["bytes"])
            held = gauge("kvcached_broker_reply_cache_bytes", "Replies every session keeps for retried requests",
                         labels=["device"])
            held.add_metric([device], cache["held_bytes"])
            yield held
        if metrics:
            bound.add_metric([device, "metrics_threads"], metrics["threads"])
            bound.add_metric([device, "metrics_queue"], metrics["queue"])
            bound.add_metric([device, "metrics_timeout_s"], metrics["timeout_s"])
            refused = counter("kvcached_broker_metrics_connections_refused",
                              "/metrics connections closed on arrival: every thread busy and the queue full",
                              labels=["device"])
            refused.add_metric([device], metrics["refused"])
            yield refused
        yield bound

    @staticmethod
    def _counters(device: str, counters: dict[str, Any], counter, histogram) -> Iterator[Any]:
        requests = counter("kvcached_broker_requests", "Requests received", labels=["device"])
        requests.add_metric([device], counters.get("requests", 0))
        grants = counter("kvcached_broker_grants", "Elastic grants made", labels=["device"])
        grants.add_metric([device], counters.get("grants", 0))
        refusals = counter("kvcached_broker_refusals", "Requests refused, by error code", labels=["device", "code"])
        for code, n in sorted(counters.get("refusals", {}).items()):
            refusals.add_metric([device, code], n)
        reclaims = counter("kvcached_broker_reclaims", "Sessions ended, by cause", labels=["device", "cause"])
        for cause, n in sorted(counters.get("reclaims", {}).items()):
            reclaims.add_metric([device, cause], n)
        bad = counter("kvcached_broker_bad_frames", "Frames that were not valid requests", labels=["device"])
        bad.add_metric([device], counters.get("bad_frames", 0))
        yield from (requests, grants, refusals, reclaims, bad)
        hist = counters.get("request_latency")
        if hist:
            h = histogram("kvcached_broker_request_duration_seconds", "Time to serve a round of requests",
                          labels=["device"])
            buckets = [(("+Inf" if b == "+Inf" else repr(float(b))), n) for b, n in hist["buckets"]]
            h.add_metric([device], buckets, sum_value=hist["sum_s"])
            yield h


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
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        owner = self
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]

        class _Server(http.server.HTTPServer):
            address_family = family
            request_queue_size = queue_size

            def process_request(self, request, client_address):  # called by serve_forever's thread
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

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def _work(self) -> None:
        while True:
            request, client_address = self._queue.get()
            try:
                self._server.finish_request(request, client_address)
                self.served += 1
            except Exception:  # a timeout or a peer that went away: that connection only
                pass
            finally:
                self._server.shutdown_request(request)

    def view(self) -> dict[str, Any]:
        return {"threads": self.threads, "queue": self.queue_size, "timeout_s": self.timeout_s,
                "waiting": self._queue.qsize(), "served": self.served, "refused": self.refused}



def start_metrics_server(port: int, address: str, snapshot: Callable[[], dict[str, Any] | None]) -> MetricsServer:
    """Serve ``/metrics`` on ``address:port`` from a bounded pool of daemon threads."""
    try:
        from prometheus_client import CollectorRegistry, MetricsHandler
    except ImportError as exc:
        raise RuntimeError("--metrics-port needs prometheus_client: pip install 'kvcached-broker[metrics]'") from exc
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot))
    server = MetricsServer(address, port, MetricsHandler.factory(registry))
    log.info("event=metrics address=%s port=%d threads=%d queue=%d timeout_s=%g", address, port, server.threads,
             server.queue_size, server.timeout_s)
    return server
