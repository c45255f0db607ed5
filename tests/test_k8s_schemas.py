"""Every Kubernetes object the project ships, checked against Kubernetes' own schemas.

The chart's objects (rendered by Helm's engine, for several sets of values) and the plain
manifests in deploy/k8s are validated with kubernetes-validate, which bundles the JSON schemas
generated from each Kubernetes release's OpenAPI document, in strict mode (an unknown field is an
error), at the oldest version the chart supports (Chart.yaml's kubeVersion) and the newest the
tool has.  Those schemas check structure and types, not what the API server checks besides (enums,
name formats, cross-references), so the checks the server would make on these objects follow.
The ServiceMonitor is a CRD, absent from Kubernetes' schemas: tests/schemas has one for the
fields the chart uses.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from chart_render import CHART, ROOT, one, render

pytest.importorskip("helm_python", reason="helm-python-sdk (the test extra) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra)")
jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")

NEWEST = kubernetes_validate.utils.latest_version()
SERVICE_MONITOR_SCHEMA = json.loads((ROOT / "tests/schemas/servicemonitor-v1.schema.json").read_text())


def _oldest_supported() -> str:
    """The oldest Kubernetes the chart's Chart.yaml accepts (``kubeVersion: ">=1.25.0-0"``)."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    found = re.fullmatch(r">=\s*(\d+)\.(\d+)\.\d+(-0)?", chart["kubeVersion"])
    assert found, f"kubeVersion {chart['kubeVersion']!r} is not of the form >=X.Y.Z"
    return f"{found[1]}.{found[2]}"


VERSIONS = sorted({_oldest_supported(), NEWEST})

#: Value sets that between them render every template and every optional field.
VALUE_SETS = {
    "defaults": {},
    "everything": {
        "gpusPerNode": 2, "socketNaming": "index", "socketGroup": 2000, "adminGroup": 2001,
        "config": 'headroom = "6GiB"\n', "extraArgs": ["--log-json"],
        "extraEnv": [{"name": "KVCACHED_BROKER_LOG_LEVEL", "value": "debug"}],
        "imagePullSecrets": [{"name": "registry"}], "runtimeClassName": "nvidia",
        "podAnnotations": {"example.com/team": "serving"}, "podLabels": {"tier": "gpu"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu.count", "operator": "In", "values": ["2"]}]}]}}},
        "serviceMonitor": {
            "enabled": True, "interval": "15s", "scrapeTimeout": "5s", "additionalLabels": {"release": "prom"},
            "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}],
            "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "kvcached_broker_sessions", "action": "drop"}],
        },
    },
    "one GPU, no metrics, no groups": {"gpusPerNode": 1, "socketGroup": None,
                                       "metrics": {"enabled": False, "port": 9400, "address": "0.0.0.0"}},
}

PLAIN = sorted((ROOT / "deploy/k8s").glob("*.yaml"))


def validate(obj: dict[str, Any], version: str) -> None:
    """Kubernetes' schema for ``obj``'s kind at ``version``, strict; the ServiceMonitor against ours."""
    if obj["kind"] == "ServiceMonitor":
        jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA, cls=jsonschema.Draft7Validator)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS, ids=list(VALUE_SETS))
def test_the_rendered_chart_is_valid_kubernetes(values, version):
    docs = render(VALUE_SETS[values])
    assert docs
    for obj in docs:
        validate(obj, version)
        check_as_the_api_server_would(obj)
    check_references(docs)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", PLAIN, ids=[p.name for p in PLAIN])
def test_the_plain_manifests_are_valid_kubernetes(path, version):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for obj in docs:
        validate(obj, version)
        check_as_the_api_server_would(obj)
    check_references(docs)


def test_the_chart_covers_every_template():
    rendered = {d["kind"] for values in VALUE_SETS.values() for d in render(values)}
    assert rendered == {"DaemonSet", "Service", "ConfigMap", "ServiceMonitor"}


@pytest.mark.parametrize("break_it,needle", [
    (lambda docs: one(docs, "DaemonSet")["spec"]["template"]["spec"].update(hostPid=True), "hostPid"),
    (lambda docs: one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0].update(ports=[{"containerPort": "9400"}]),
     "'9400' is not of type 'integer'"),
    (lambda docs: one(docs, "Service")["spec"].update(clusterIp="None"), "clusterIp"),
    (lambda docs: one(docs, "ServiceMonitor")["spec"]["endpoints"][0].update(interval="30 seconds"), "30 seconds"),
    (lambda docs: one(docs, "ServiceMonitor")["spec"]["endpoints"][0].update(honorlabels=True), "honorlabels"),
])
def test_the_validation_refuses_a_broken_object(break_it, needle):
    """The checks can fail: a misspelt field, a wrong type, a bad duration are each refused."""
    docs = copy.deepcopy(render(VALUE_SETS["everything"]))
    break_it(docs)
    with pytest.raises(jsonschema.ValidationError) as refused:
        for obj in docs:
            validate(obj, NEWEST)
    assert needle in str(refused.value)


@pytest.mark.parametrize("break_it,needle", [
    (lambda docs: one(docs, "ServiceMonitor")["spec"]["endpoints"][1].update(port="metrics-gpu9"), "metrics-gpu9"),
    (lambda docs: one(docs, "Service")["spec"]["selector"].update({"app.kubernetes.io/name": "other"}), "selects no pod"),
    (lambda docs: one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][1].update(name="gpu0"), "twice"),
])
def test_the_reference_checks_refuse_a_dangling_reference(break_it, needle):
    docs = copy.deepcopy(render(VALUE_SETS["everything"]))
    break_it(docs)
    with pytest.raises(AssertionError, match=needle):
        check_references(docs)
        for obj in docs:
            check_as_the_api_server_would(obj)


# ------------------------------------------------------- what the API server checks beyond the schema
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
PORT_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?$")  # IANA_SVC_NAME, no "--"


def check_as_the_api_server_would(obj: dict[str, Any]) -> None:
    """The rules of Kubernetes' validation that these objects could break and its schemas omit."""
    meta = obj["metadata"]
    assert DNS_LABEL.match(meta["name"]) and len(meta["name"]) <= 63, meta["name"]
    if obj["kind"] == "DaemonSet":
        template = obj["spec"]["template"]
        selector = obj["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), "the selector must match the template"
        pod = template["spec"]
        names = [c["name"] for c in pod["containers"]]
        assert len(names) == len(set(names)), f"a container name is used twice: {names}"
        volumes = {v["name"] for v in pod["volumes"]}
        ports = []
        for c in pod["containers"]:
            assert DNS_LABEL.match(c["name"]), c["name"]
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes
            for p in c.get("ports", []):
                assert PORT_NAME.match(p["name"]) and "--" not in p["name"], p["name"]
                ports.append((p["containerPort"], p.get("protocol", "TCP")))
                assert 0 < p["containerPort"] < 65536
            for probe in ("readinessProbe", "livenessProbe"):
                assert c[probe]["exec"]["command"], probe
        assert len(ports) == len(set(ports)), f"a port is used twice in the pod: {ports}"
    if obj["kind"] == "Service":
        for p in obj["spec"]["ports"]:
            assert PORT_NAME.match(p["name"]), p["name"]


def check_references(docs: list[dict[str, Any]]) -> None:
    """Objects that name each other agree: the Service selects the pods and targets their ports,
    the ServiceMonitor selects the Service in its namespace and scrapes ports it has."""
    pods = [(d["metadata"]["namespace"], d["spec"]["template"]) for d in docs if d["kind"] in ("DaemonSet",)]
    pods += [(d["metadata"].get("namespace", "default"), d) for d in docs if d["kind"] == "Pod"]
    for service in (d for d in docs if d["kind"] == "Service"):
        ns = service["metadata"]["namespace"]
        selected = [t for n, t in pods if n == ns and service["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        container_ports = {p["name"] for t in selected for c in t["spec"]["containers"] for p in c.get("ports", [])}
        targets = {p["targetPort"] for p in service["spec"]["ports"]}
        assert targets <= container_ports, f"Service targets ports no container has: {targets - container_ports}"
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        namespaces = monitor["spec"]["namespaceSelector"]["matchNames"]
        wanted = monitor["spec"]["selector"]["matchLabels"]
        services = [d for d in docs if d["kind"] == "Service" and d["metadata"]["namespace"] in namespaces
                    and wanted.items() <= d["metadata"]["labels"].items()]
        assert len(services) == 1, f"the ServiceMonitor selects {len(services)} Services"
        port_names = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names, f"the ServiceMonitor scrapes port {endpoint['port']}, not on the Service"
            assert endpoint["honorLabels"] is True  # the broker's instance label is the serving instance
