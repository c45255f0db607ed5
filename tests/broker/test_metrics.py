"""Prometheus metrics (broker/metrics.py): they match status, and without the extra the broker fails before ready."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request

import pytest

from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB, MIB, free_port, wait_for


def _scrape(port: int) -> tuple[set[str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """``/metrics``: the families' names, and the samples as ``{(name, sorted label pairs): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    families = list(text_string_to_metric_families(text))
    return {f.name for f in families}, {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                                        for family in families for sample in family.samples}


#: The labels of GPU 0 of a broker started with --simulate on a host named ``node-a``.
GPU0 = {"device": "0", "UUID": "SIM-GPU-0", "modelName": "simulated GPU 0", "Hostname": "node-a", "hostname": "node-a"}


def _key(name: str, **own: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted({**GPU0, **own}.items()))


def test_metrics_match_status_while_workers_hold_memory(short_tmp):
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    port = free_port()
    with BrokerLauncher(endpoint, simulate="80GiB", args=["--metrics-port", str(port), "--metrics-hostname", "node-a"]) as broker:
        with BrokerClient.connect("dsv4", endpoint=endpoint, credit_pages=0) as a, \
                BrokerClient.connect("llama", endpoint=endpoint, credit_pages=0, page_bytes=64 * MIB) as b:
            a.reserve({"swa_kv_pool": 3 * GIB, "c4_kv_pool": GIB})
            a.acquire(10)
            b.acquire(5)
            b.acquire(10 ** 6)  # refused: counted
            families, samples = _scrape(port)
            status = broker.status()
        for key in ("total_bytes", "budget_bytes", "external_bytes", "reserved_bytes", "granted_bytes", "free_bytes"):
            assert samples[_key(f"kvcached_broker_device_{key}")] == status[key], key
        assert samples[_key("kvcached_broker_instance_pool_bytes", instance="dsv4", pool="swa_kv_pool")] == 3 * GIB
        assert samples[_key("kvcached_broker_instance_pool_bytes", instance="dsv4", pool="c4_kv_pool")] == GIB
        assert samples[_key("kvcached_broker_instance_granted_bytes", instance="llama")] == 5 * 64 * MIB
        assert samples[_key("kvcached_broker_refusals_total", code="budget_exceeded")] == 1
        assert samples[_key("kvcached_broker_grants_total")] == 2
        assert samples[_key("kvcached_broker_request_duration_seconds_count")] >= 6
        assert "kvcached_broker_reclaims" in families  # no session has ended yet: no sample


def test_every_series_carries_the_labels_that_join_with_dcgm_exporter(short_tmp):
    """device (NVML index) stays; UUID, modelName and the host as Hostname and hostname, as DCGM exporter
    names them, are on every sample, the up gauge and the histogram's buckets included."""
    endpoint = f"ipc://{short_tmp}/gpu3.sock"
    port = free_port()
    with BrokerLauncher(endpoint, simulate="8GiB", device=3, args=["--metrics-port", str(port)]):
        with BrokerClient.connect("llama", endpoint=endpoint, credit_pages=0, page_bytes=64 * MIB) as b:
            b.acquire(2)
            _, samples = _scrape(port)
    gpu = {"device": "3", "UUID": "SIM-GPU-3", "modelName": "simulated GPU 3",
           "Hostname": socket.gethostname(), "hostname": socket.gethostname()}
    names = {name for name, _ in samples}
    assert {"kvcached_broker_up", "kvcached_broker_instance_granted_bytes",
            "kvcached_broker_request_duration_seconds_bucket", "kvcached_broker_sessions"} <= names
    for name, labels in samples:
        assert gpu.items() <= dict(labels).items(), (name, labels)
    assert samples[("kvcached_broker_up", tuple(sorted(gpu.items())))] == 1


@pytest.mark.parametrize("source", ["flag", "env"])
@pytest.mark.parametrize("bad", ["node a", ".node", "x" * 254])
def test_a_bad_metrics_hostname_is_a_usage_error_naming_it(short_tmp, source, bad):
    args, env = ([f"--metrics-hostname={bad}"], None) if source == "flag" else ([], {"KVCACHED_BROKER_METRICS_HOSTNAME": bad})
    out = BrokerLauncher(f"ipc://{short_tmp}/h.sock", simulate="8GiB", args=["--metrics-port", str(free_port()), *args],
                         extra_env=env).expect_refusal()
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]  # argparse prints its usage before the error line
    assert "expected a host name" in last, out.stderr
    assert ("--metrics-hostname" if source == "flag" else "KVCACHED_BROKER_METRICS_HOSTNAME") in last
    if source == "env":
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


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


HOARDER = r"""
import sys, threading
from kvcached_broker.client import BrokerClient
c = BrokerClient.connect("hoarder", endpoint=sys.argv[1], page_bytes=1 << 30, credit_pages=0)
c.acquire(int(sys.argv[2]))
def give_back(n):
    c.release(n)
    return n
c.on_pressure(give_back)
print("ready", flush=True)
threading.Event().wait()  # until the test kills it
"""


def test_pressure_and_fair_shares_are_exported_as_status_has_them(short_tmp):
    """What the broker asked an instance to give back, and what came back, for the dashboard's
    pressure and reclaim panels: the same numbers as status's per-instance ``pressure``."""
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    port = free_port()
    with BrokerLauncher(endpoint, simulate="40GiB", args=["--headroom", "0", "--metrics-port", str(port),
                                                          "--metrics-hostname", "node-a"]) as broker:
        hoarder = subprocess.Popen([sys.executable, "-c", HOARDER, endpoint, "36"], stdout=subprocess.PIPE, text=True)
        try:
            assert hoarder.stdout.readline().strip() == "ready"
            with BrokerClient.connect("starved", endpoint=endpoint, page_bytes=GIB, credit_pages=0) as starved:
                assert starved.acquire(16) == 0  # refused: pressure asks the hoarder
                wait_for(lambda: starved.acquire(16), what="memory moved under pressure")

                def settled():  # every ask answered: nothing changes between the scrape and status
                    hoarder_view = next(i for i in broker.status()["instances"] if i["name"] == "hoarder")
                    return hoarder_view["pressure"]["pending_bytes"] == 0

                wait_for(settled, what="the hoarder to answer every ask")
                _, samples = _scrape(port)
                by_name = {i["name"]: i for i in broker.status()["instances"]}
        finally:
            hoarder.kill()
            hoarder.wait()
    asked = by_name["hoarder"]["pressure"]
    assert asked["asks"] >= 1 and asked["returned_bytes"] >= 12 * GIB
    for key in ("asks", "asked_bytes", "returned_bytes", "ignored_bytes"):
        assert samples[_key(f"kvcached_broker_instance_pressure_{key}_total", instance="hoarder")] == asked[key], key
    assert samples[_key("kvcached_broker_instance_pressure_pending_bytes", instance="hoarder")] == asked["pending_bytes"]
    for name in ("hoarder", "starved"):
        share = samples[_key("kvcached_broker_instance_fair_share_bytes", instance=name)]
        assert share == by_name[name]["fair_share_bytes"] > 0


def test_metrics_show_every_bound_on_peers_and_what_met_it(inproc):
    """Each limit in status ``broker.limits`` is a ``kvcached_broker_limit`` sample, with its counters."""
    from kvcached_broker.broker.metrics import GpuLabels, StatusCollector

    samples = {}
    for family in StatusCollector(inproc.server.snapshot, GpuLabels("0", "SIM-GPU-0", "sim", "host")).collect():
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
