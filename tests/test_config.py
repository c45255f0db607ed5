"""Operations: systemd notify, the config file, Prometheus metrics, JSON logs, deploy files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvcached_broker.client import BrokerClient
from kvcached_broker.client.admin import AdminClient

from helpers import GIB, MIB, wait_for

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "kvcached_broker.broker.cli"]


def serve(args, env=None, **kw):
    return subprocess.Popen(CLI + ["serve", *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def test_sd_notify_ready_only_once_status_answers_then_watchdog_and_stopping(short_tmp):
    notify_path = short_tmp / "notify.sock"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(notify_path))
    sink.settimeout(15)
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    proc = serve(["--simulate", "8GiB", "--endpoint", endpoint, "--no-state"],
                 env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"})
    try:
        first = sink.recv(4096).decode().split("\n")
        assert "READY=1" in first and any(line.startswith("STATUS=serving GPU 0") for line in first)
        with AdminClient(endpoint, timeout_s=0.5) as admin:  # the moment READY arrives, status answers
            assert admin.status()["total_bytes"] == 8 * GIB
        messages = [sink.recv(4096).decode() for _ in range(3)]
        assert sum("WATCHDOG=1" in m for m in messages) >= 2  # every half WatchdogSec (0.1 s)
        proc.send_signal(signal.SIGTERM)
        seen = []
        while not any("STOPPING=1" in m for m in seen):
            seen.append(sink.recv(4096).decode())
        assert proc.wait(timeout=10) == 0
    finally:
        stop(proc)
        sink.close()


def test_config_file_options_limits_and_precedence(short_tmp):
    config = short_tmp / "gpu0.toml"
    config.write_text(
        'simulate = "16GiB"\nheadroom = "1GiB"\nlease = 3\n'
        '[limits.capped]\nmax = "2GiB"\n[limits.floored]\nmin = "4GiB"\nweight = 2\n'
    )
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    proc = serve(["--config", str(config), "--endpoint", endpoint, "--no-state", "--headroom", "2GiB"],
                 env={"KVCACHED_BROKER_LEASE_S": "4"})
    try:
        status = wait_for(lambda: _try_status(endpoint), what="broker with config")
        assert status["total_bytes"] == 16 * GIB  # file
        assert status["headroom_bytes"] == 2 * GIB  # CLI beats file
        assert status["broker"]["lease_s"] == 4.0  # env beats file
        by_name = {i["name"]: i for i in status["instances"]}
        assert by_name["capped"]["max_bytes"] == 2 * GIB
        assert by_name["floored"]["min_bytes"] == 4 * GIB and by_name["floored"]["weight"] == 2.0
        with BrokerClient.connect("capped", endpoint=endpoint, page_bytes=GIB, credit_pages=0) as c:
            assert c.acquire(3) == 0 and c.acquire(2) == 2  # the configured cap applies on arrival
    finally:
        stop(proc)


def _try_status(endpoint):
    try:
        with AdminClient(endpoint, timeout_s=0.5) as admin:
            return admin.status()
    except Exception:
        return None


@pytest.mark.parametrize(
    "text,needle",
    [
        ('lease = "soon"\n', "key 'lease'"),
        ('headroom = "5GB"\n', "key 'headroom'"),
        ('leese = 3\n', "unknown key 'leese'"),
        ('[limits.x]\nmax = "lots"\n', "limits.x.max"),
        ('[limits.x]\ncap = "1GiB"\n', "limits.x.cap"),
        ("lease = [\n", "not valid TOML"),
    ],
)
def test_bad_config_is_a_one_line_error_naming_the_key(short_tmp, text, needle):
    config = short_tmp / "bad.toml"
    config.write_text(text)
    out = subprocess.run(CLI + ["serve", "--simulate", "8GiB", "--config", str(config), "--no-state",
                                "--endpoint", f"ipc://{short_tmp}/gpu0.sock"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_bad_environment_value_names_the_variable(short_tmp):
    out = subprocess.run(CLI + ["serve", "--simulate", "8GiB", "--no-state", "--endpoint", f"ipc://{short_tmp}/g.sock"],
                         capture_output=True, text=True, timeout=30, env={**os.environ, "KVCACHED_BROKER_LEASE_S": "-2"})
    assert out.returncode == 2 and "KVCACHED_BROKER_LEASE_S" in out.stderr


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_match_status_while_workers_hold_memory(short_tmp):
    from prometheus_client.parser import text_string_to_metric_families

    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    port = _free_port()
    proc = serve(["--simulate", "80GiB", "--endpoint", endpoint, "--no-state", "--metrics-port", str(port)])
    try:
        wait_for(lambda: _try_status(endpoint), what="broker")
        with BrokerClient.connect("dsv4", endpoint=endpoint, credit_pages=0) as a, \
                BrokerClient.connect("llama", endpoint=endpoint, credit_pages=0, page_bytes=64 * MIB) as b:
            a.reserve({"swa_kv_pool": 3 * GIB, "c4_kv_pool": GIB})
            a.acquire(10)
            b.acquire(5)
            b.acquire(10 ** 6)  # refused: counted
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            status = _try_status(endpoint)
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


def test_json_logs_one_event_per_line(short_tmp):
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    proc = serve(["--simulate", "8GiB", "--endpoint", endpoint, "--no-state", "--log-json"])
    try:
        wait_for(lambda: _try_status(endpoint), what="broker")
        with BrokerClient.connect("logged", endpoint=endpoint, credit_pages=0) as c:
            c.acquire(1)
    finally:
        _, err = stop(proc)
    events = [json.loads(line) for line in err.strip().splitlines()]
    names = [e.get("event") for e in events]
    assert "ready" in names and "session_open" in names and "session_end" in names and "stopping" in names
    opened = next(e for e in events if e.get("event") == "session_open")
    assert opened["instance"] == "logged" and opened["pid"] == os.getpid() and opened["level"] == "info"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies(tmp_path):
    unit = (ROOT / "deploy/systemd/kvcached-broker@.service").read_text()
    exe = shutil.which("kvcached-broker") or str(Path(sys.executable).with_name("kvcached-broker"))
    target = tmp_path / "kvcached-broker@0.service"
    target.write_text(unit.replace("/usr/local/bin/kvcached-broker", exe))
    out = subprocess.run(["systemd-analyze", "verify", str(target)], capture_output=True, text=True)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if "kvcached-broker@0.service" in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
    for needed in ("Type=notify", "RuntimeDirectory=kvcached", "StateDirectory=kvcached-broker",
                   "Restart=on-failure", "WatchdogSec=", "NoNewPrivileges=yes", "ExecStart=/usr/local/bin/kvcached-broker serve --device %i"):
        assert needed in unit


def test_kubernetes_manifests_wire_the_socket_and_pids():
    yaml = pytest.importorskip("yaml")
    pod = yaml.safe_load((ROOT / "deploy/k8s/sidecar-pod.yaml").read_text())
    spec = pod["spec"]
    assert pod["kind"] == "Pod" and spec["shareProcessNamespace"] is True
    run_volume = next(v for v in spec["volumes"] if v["name"] == "kvcached-run")
    assert "emptyDir" in run_volume
    broker, sglang = spec["containers"]
    for container in (broker, sglang):
        assert {"name": "kvcached-run", "mountPath": "/run/kvcached"} in container["volumeMounts"]
    env = {e["name"]: e["value"] for e in sglang["env"]}
    assert env["KVCACHED_BROKER"] == "ipc:///run/kvcached/gpu{device}.sock" and env["ENABLE_KVCACHED"] == "1"
    assert broker["readinessProbe"]["exec"]["command"][:2] == ["kvcached-broker", "status"]
    ds = yaml.safe_load((ROOT / "deploy/k8s/daemonset.yaml").read_text())
    assert ds["kind"] == "DaemonSet" and ds["spec"]["template"]["spec"]["hostPID"] is True
    paths = [v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"]]
    assert "/run/kvcached" in paths


def test_dockerfile_runs_the_broker_as_non_root_with_a_healthcheck():
    lines = [l.strip() for l in (ROOT / "Dockerfile").read_text().splitlines() if l.strip() and not l.startswith("#")]
    instructions = [l.split()[0] for l in lines if l.split()[0].isupper()]
    assert instructions[0] == "FROM" and "slim" in lines[0]
    user = next(l for l in lines if l.startswith("USER"))
    assert user.split()[1] not in ("root", "0")
    assert any(l.startswith("HEALTHCHECK") for l in lines) and any("kvcached-broker status" in l for l in lines)
    assert any(l.startswith('ENTRYPOINT ["kvcached-broker", "serve"]') for l in lines)
    assert any(l.startswith("VOLUME") and "/run/kvcached" in l for l in lines)
