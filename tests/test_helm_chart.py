"""The Helm chart (deploy/helm/kvcached-broker), rendered by Helm's own engine (helm-python-sdk).

Rendering, linting and the values schema are Helm's; the brokers the chart describes are started
here as real processes, with the chart's own command, arguments and environment (on a simulated
GPU, with the host paths moved under a temporary directory).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.launch import BrokerLauncher

from chart_render import CHART, NAMESPACE, ROOT, one, render
from helpers import MIB

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the test extra) renders the chart")


def test_the_chart_lints_clean():
    report = helm.lint(CHART, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 is info ("icon is recommended")
    assert not report["errors"] and not problems, report


def test_one_broker_container_per_gpu_with_its_own_metrics_port():
    docs = render({"gpusPerNode": 4, "metrics": {"enabled": True, "port": 9500, "address": "0.0.0.0"}})
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["enableServiceLinks"] is False
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    containers = pod["containers"]
    assert [c["name"] for c in containers] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    for gpu, c in enumerate(containers):
        assert c["command"] == ["kvcached-broker", "serve"]
        assert f"--device={gpu}" in c["args"] and f"--metrics-port={9500 + gpu}" in c["args"]
        assert c["ports"] == [{"name": f"metrics-gpu{gpu}", "containerPort": 9500 + gpu, "protocol": "TCP"}]
        assert c["readinessProbe"]["exec"]["command"] == ["kvcached-broker", "status", f"--device={gpu}"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts == {"kvcached-run": "/run/kvcached", "kvcached-state": "/var/lib/kvcached-broker"}
    service = one(docs, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [(f"metrics-gpu{i}", 9500 + i) for i in range(4)]
    assert not [d for d in docs if d["kind"] in ("ServiceMonitor", "ConfigMap")]  # both off by default


def test_groups_config_and_socket_naming_reach_every_broker():
    config = 'headroom = "6GiB"\n[limits.dsv4-prod]\nmin = "30GiB"\n'
    docs = render({"gpusPerNode": 2, "socketGroup": 2000000000, "adminGroup": 2001, "config": config,
                   "socketNaming": "index", "extraArgs": ["--log-json"]})
    ds = one(docs, "DaemonSet")
    assert one(docs, "ConfigMap")["data"]["broker.toml"].strip() == config.strip()
    assert "checksum/config" in ds["spec"]["template"]["metadata"]["annotations"]  # a new config rolls the pods
    for c in ds["spec"]["template"]["spec"]["containers"]:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["KVCACHED_BROKER"] == "ipc:///run/kvcached/gpu{device}.sock"
        # a large gid stays a number the broker reads (Helm holds numbers as floats: not "2e+09")
        assert env["KVCACHED_BROKER_SOCKET_GROUP"] == "2000000000" and env["KVCACHED_BROKER_ADMIN_GROUP"] == "2001"
        assert "--config=/etc/kvcached-broker/broker.toml" in c["args"] and "--log-json" in c["args"]
    default = one(render(), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in default["env"]}
    assert env["KVCACHED_BROKER"] == "ipc:///run/kvcached/{uuid}.sock" and "KVCACHED_BROKER_ADMIN_GROUP" not in env


@pytest.mark.parametrize("values,needle", [
    ({"gpusPerNode": 0}, "/gpusPerNode"),
    ({"socketNaming": "name"}, "/socketNaming"),
    ({"socketGroup": "kvcached"}, "/socketGroup"),
    ({"hostPaths": {"runtimeDir": "run/kvcached", "stateDir": "/var/lib/kvcached-broker"}}, "/hostPaths/runtimeDir"),
    ({"metrics": {"enabled": True, "port": 65500, "address": "0.0.0.0"}}, "/metrics/port"),
    ({"serviceMonitor": {"enabled": True, "interval": "soon"}}, "/serviceMonitor/interval"),
    ({"gpuPerNode": 4}, "gpuPerNode"),  # a misspelt key is refused, not ignored
])
def test_bad_values_are_refused_naming_the_value(values, needle):
    with pytest.raises(helm.HelmValuesError) as refused:
        render(values)
    assert needle in str(refused.value)


def test_a_service_monitor_without_metrics_is_refused():
    with pytest.raises(helm.HelmRenderError, match="serviceMonitor.enabled needs metrics.enabled"):
        render({"serviceMonitor": {"enabled": True}, "metrics": {"enabled": False, "port": 9400, "address": "0.0.0.0"}})


def test_the_plain_daemonset_is_the_chart_rendered():
    out = subprocess.run([sys.executable, str(ROOT / "scripts/render-k8s.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------- the brokers the chart runs
def _consecutive_free_ports(n: int) -> int:
    """A port P with P .. P+n-1 free on loopback (for metrics.port with n GPUs)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        held = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise AssertionError(f"no {n} consecutive free ports")


class ChartContainer(BrokerLauncher):
    """One broker container of the rendered DaemonSet, run as a process: its command, arguments and
    environment as rendered (``fieldRef: spec.nodeName`` resolved to ``node``), on a simulated GPU."""

    def __init__(self, container: dict[str, Any], endpoint: str, node: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_BROKER")}
        for var in container["env"]:
            if "value" in var:
                env[var["name"]] = var["value"]
            else:
                assert var["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}, var
                env[var["name"]] = node
        super().__init__(endpoint, env=env, capture=True)
        self.container = container

    def command(self) -> list[str]:
        exe, *rest = self.container["command"]
        assert exe == "kvcached-broker"
        return [str(Path(sys.executable).with_name(exe)), *rest, *self.container["args"], "--simulate", "8GiB"]

    def probe(self, kind: str) -> subprocess.CompletedProcess:
        """Run the container's ``readinessProbe`` or ``livenessProbe`` command in its environment."""
        exe, *rest = self.container[kind]["exec"]["command"]
        return subprocess.run([str(Path(sys.executable).with_name(exe)), *rest], env=self.env,
                              capture_output=True, text=True, timeout=60)


def _chart_values(tmp: Path, port: int, naming: str) -> dict[str, Any]:
    return {"gpusPerNode": 2, "socketNaming": naming, "socketGroup": os.getgid(),
            "hostPaths": {"runtimeDir": str(tmp / "run"), "stateDir": str(tmp / "state")},
            "metrics": {"enabled": True, "port": port, "address": "127.0.0.1"}}


def test_the_rendered_brokers_serve_uuid_sockets_and_labelled_metrics(short_tmp, monkeypatch):
    """With the default socket naming, each container's broker binds RUNDIR/<its GPU's UUID>.sock,
    a serving process that knows its GPU's UUID reaches it through the KVCACHED_BROKER the chart's
    NOTES give, and its metrics (on the port the container declares) name the node."""
    from prometheus_client.parser import text_string_to_metric_families

    port = _consecutive_free_ports(2)
    docs = render(_chart_values(short_tmp, port, "uuid"))
    containers = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    run = short_tmp / "run"
    brokers = [ChartContainer(c, f"ipc://{run}/SIM-GPU-{i}.sock", "node-a") for i, c in enumerate(containers)]
    try:
        for b in brokers:
            b.start()
        monkeypatch.setenv("KVCACHED_BROKER", f"ipc://{run}/{{uuid}}.sock")  # what a serving pod sets
        with BrokerClient.connect("llama", device=0, device_uuid="SIM-GPU-1", page_bytes=64 * MIB,
                                  credit_pages=0) as worker:
            assert worker.acquire(3) == 3
            assert worker.endpoint == f"ipc://{run}/SIM-GPU-1.sock"
            declared = containers[1]["ports"][0]["containerPort"]
            text = urllib.request.urlopen(f"http://127.0.0.1:{declared}/metrics", timeout=60).read().decode()
        granted = [s for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "kvcached_broker_instance_granted_bytes"]
        assert [(s.labels["device"], s.labels["UUID"], s.labels["Hostname"], s.labels["hostname"], s.value)
                for s in granted] == [("1", "SIM-GPU-1", "node-a", "node-a", 3 * 64 * MIB)]
        assert (short_tmp / "state").is_dir()
    finally:
        for b in brokers:
            b.stop()


def test_the_probes_pass_against_the_broker_and_fail_without_it(short_tmp):
    """The probes run `kvcached-broker status --device=N` in the container's environment.  Without
    NVML the UUID of an index cannot be looked up, so this runs with socketNaming=index; on a GPU
    node the same command finds the UUID-named socket through NVML."""
    port = _consecutive_free_ports(2)
    container = one(render(_chart_values(short_tmp, port, "index")), "DaemonSet")["spec"]["template"]["spec"]["containers"][1]
    broker = ChartContainer(container, f"ipc://{short_tmp}/run/gpu1.sock", "node-a")
    assert broker.probe("readinessProbe").returncode == 3  # nobody there yet: not ready
    with broker:
        for kind in ("readinessProbe", "livenessProbe"):
            out = broker.probe(kind)
            assert out.returncode == 0, out.stderr
    assert broker.probe("livenessProbe").returncode == 3
