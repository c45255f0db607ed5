"""Prometheus metrics (broker/metrics.py): they match status, and without the extra the broker fails before ready."""

from __future__ import annotations

import os
import urllib.request

from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB, MIB, free_port


def test_metrics_match_status_while_workers_hold_memory(short_tmp):
    from prometheus_client.parser import text_string_to_metric_families

    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    port = free_port()
    with BrokerLauncher(endpoint, simulate="80GiB", args=["--metrics-port", str(port)]) as broker:
        with BrokerClient.connect("dsv4", endpoint=endpoint, credit_pages=0) as a, \
                BrokerClient.connect("llama", endpoint=endpoint, credit_pages=0, page_bytes=64 * MIB) as b:
            a.reserve({"swa_kv_pool": 3 * GIB, "c4_kv_pool": GIB})
            a.acquire(10)
            b.acquire(5)
            b.acquire(10 ** 6)  # refused: counted
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
            status = broker.status()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        dev = (("device", "0"),)
        for key in ("total_bytes", "budget_bytes", "external_bytes", "reserved_bytes", "granted_bytes", "free_bytes"):
            assert samples[(f"kvcached_broker_device_{key}", dev)] == status[key], key
        pool = lambda inst, p: samples[("kvcached_broker_instance_pool_bytes",
                                        (("device", "0"), ("instance", inst), ("pool", p)))]
        assert pool("dsv4", "swa_kv_pool") == 3 * GIB and pool("dsv4", "c4_kv_pool") == GIB
        granted = samples[("kvcached_broker_instance_granted_bytes", (("device", "0"), ("instance", "llama")))]
        assert granted == 5 * 64 * MIB
        assert samples[("kvcached_broker_refusals_total", (("code", "budget_exceeded"), ("device", "0")))] == 1
        assert samples[("kvcached_broker_grants_total", dev)] == 2
        assert samples[("kvcached_broker_request_duration_seconds_count", dev)] >= 6
        assert "kvcached_broker_reclaims_total" in text


def test_metrics_without_the_extra_fail_before_ready(short_tmp):
    hidden = short_tmp / "hidden"  # a sitecustomize that makes prometheus_client unimportable
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['prometheus_client'] = None\n")
    path = os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")]))
    out = BrokerLauncher(f"ipc://{short_tmp}/m.sock", simulate="8GiB", args=["--metrics-port", "9", "--log-level", "info"],
                         extra_env={"PYTHONPATH": path}).expect_refusal()
    assert out.returncode == 1
    assert "event=ready" not in out.stderr + out.stdout
    assert "kvcached-broker[metrics]" in out.stderr


def test_metrics_show_every_bound_on_peers_and_what_met_it(inproc):
    """Each limit in status ``broker.limits`` is a ``kvcached_broker_limit`` sample, with its counters."""
    from kvcached_broker.broker.metrics import StatusCollector

    samples = {}
    for family in StatusCollector(inproc.server.snapshot).collect():
        for sample in family.samples:
            samples[(sample.name, sample.labels.get("limit") or sample.labels.get("bound"))] = sample.value
    limits = inproc.status()["broker"]["limits"]
    assert samples[("kvcached_broker_limit", "open_files")] == limits["open_files"]["soft"]
    assert samples[("kvcached_broker_limit", "connections")] == limits["connections"]["max"]
    assert samples[("kvcached_broker_limit", "requests_per_connection")] == 16
    assert samples[("kvcached_broker_limit", "replies_per_connection")] == 256
    assert samples[("kvcached_broker_limit", "replies_large_bytes_per_peer")] == 32 << 20
    assert samples[("kvcached_broker_limit", "reply_cache_bytes")] == 64 << 10
    assert ("kvcached_broker_connections_refused_total", "per_peer") in samples
    assert ("kvcached_broker_large_replies_waiting_bytes", None) in samples
