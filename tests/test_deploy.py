"""The deploy files: the systemd unit, the Kubernetes manifests and the Dockerfile."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


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
                   "Restart=on-failure", "WatchdogSec=", "NoNewPrivileges=yes", "LimitNOFILE=1048576",
                   "ExecStart=/usr/local/bin/kvcached-broker serve --device %i"):
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
    ds, service = yaml.safe_load_all((ROOT / "deploy/k8s/daemonset.yaml").read_text())
    assert ds["kind"] == "DaemonSet" and ds["spec"]["template"]["spec"]["hostPID"] is True
    paths = [v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"]]
    assert "/run/kvcached" in paths
    assert service["kind"] == "Service"  # the rest is the chart's, checked in tests/test_helm_chart.py


def _dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions, one list per ``FROM``."""
    stages: list[list[str]] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):  # a continued instruction: one entry
            pending += line[:-1].strip() + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("FROM"):
            stages.append([])
        stages[-1].append(line)
    return stages


def test_dockerfile_builds_the_wheel_from_every_package_directory():
    tomllib = pytest.importorskip("tomllib")
    build = _dockerfile_stages()[0]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = {source for line in build if line.startswith("COPY") for source in line.split()[1:-1]}
    needed = set(pyproject["tool"]["setuptools"]["package-dir"].values()) | {"pyproject.toml", "setup.py", "README.md"}
    assert needed <= copied, f"the wheel stage does not copy {sorted(needed - copied)}"
    (wheel,) = [line for line in build if line.startswith("RUN") and "KVCACHED_BROKER_COMPILE=1 pip wheel" in line]
    assert "--build-constraint constraints/build.txt" in wheel  # built as the tests' build was


def test_dockerfile_installs_what_the_tests_resolved():
    *_, lines = _dockerfile_stages()
    (install,) = [line for line in lines if line.startswith("RUN") and "[metrics]" in line]
    assert install.count("-c /wheels/constraints.txt") == 2  # pip itself, then the wheel and its dependencies


def test_dockerfile_runs_the_broker_as_non_root_with_a_healthcheck():
    *_, lines = _dockerfile_stages()
    assert "slim" in lines[0] and any(line.startswith("COPY --from=") for line in lines)  # the wheel, no compiler
    user = next(line for line in lines if line.startswith("USER"))
    assert user.split()[1] not in ("root", "0")
    assert any(line.startswith("HEALTHCHECK") for line in lines) and any("kvcached-broker status" in line for line in lines)
    assert any(line.startswith('ENTRYPOINT ["kvcached-broker", "serve"]') for line in lines)
    assert any(line.startswith("VOLUME") and "/run/kvcached" in line for line in lines)

