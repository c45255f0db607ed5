"""Prometheus metrics (broker/metrics.py): they match status, and without the extra the broker fails before ready."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from kvcached_broker.client import BrokerClient

from helpers import GIB, MIB, free_port, serve, stop, try_status, wait_for


def test_metrics_match_status_while_workers_hold_memory(short_tmp):
    from prometheus_client.parser import text_string_to_metric_families

    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    port = free_port()
    proc = serve(["--simulate", "80GiB", "--endpoint", endpoint, "--no-state", "--metrics-port", str(port)])
    try:
        wait_for(lambda: try_status(endpoint), what="broker")
        with BrokerClient.connect("dsv4", endpoint=endpoint, credit_pages=0) as a, \
                BrokerClient.connect("llama", endpoint=endpoint, credit_pages=0, page_bytes=64 * MIB) as b:
            a.reserve({"swa_kv_pool": 3 * GIB, "c4_kv_pool": GIB})
            a.acquire(10)
            b.acquire(5)
            b.acquire(10 ** 6)  # refused: counted
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            status = try_status(endpoint)
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
    finally:
        stop(proc)


def test_metrics_without_the_extra_fail_before_ready(short_tmp):
    script = (
        "import sys; sys.modules['prometheus_client'] = None;"
        "from kvcached_broker.broker.cli import main;"
        f"sys.exit(main(['serve', '--simulate', '8GiB', '--no-state', '--endpoint', 'ipc://{short_tmp}/m.sock',"
        "'--metrics-port', '9', '--log-level', 'info']))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "event=ready" not in out.stderr + out.stdout
    assert "kvcached-broker[metrics]" in out.stderr

