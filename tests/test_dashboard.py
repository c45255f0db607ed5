"""The Grafana dashboard (deploy/grafana/kvcached-broker.json) queries what a served broker exports.

Every PromQL expression in it (panel targets and variable queries) is parsed with a real PromQL
parser (promql-parser), and every metric it selects, every label it matches on, groups by or
joins on, is checked against a scrape of a served broker that has been through everything the
dashboard shows: pools, grants, refusals, pressure, a closed session, a cap.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB, free_port, wait_for

promql = pytest.importorskip("promql_parser", reason="promql-parser (the test extra) parses the dashboard's queries")

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = json.loads((ROOT / "deploy/grafana/kvcached-broker.json").read_text())
#: DCGM exporter's series (and labels) that the panel joining with it may name; no other panel may.
DCGM_METRICS = {"DCGM_FI_DEV_FB_USED"}
DCGM_PANEL = "GPU memory in use (DCGM exporter) and charged by the broker"
#: Grafana's own variables, replaced by a duration as Grafana does before it sends a query.
GRAFANA_DURATIONS = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}")
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\)$")


def _panels() -> Iterator[dict[str, Any]]:
    for panel in DASHBOARD["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def queries() -> list[tuple[str, str, str | None]]:
    """``(where, PromQL, label)`` for every query: panel targets, and the variables' ``label_values``."""
    found = []
    for panel in _panels():
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"], None))
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            text = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            m = LABEL_VALUES.match(text)
            assert m, f"variable {variable['name']}: {text!r} is not label_values(SELECTOR, LABEL)"
            found.append((f"variable {variable['name']}", m["selector"], m["label"]))
    return found


def parse(expr: str):
    return promql.parse(GRAFANA_DURATIONS.sub("5m", expr))


def used(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """The metrics ``expr`` selects, each with the labels its selector matches on, and the labels
    it groups by (``by``, ``without``) or joins on (``on``, ``ignoring``, ``group_left``)."""
    selected: dict[str, set[str]] = {}
    grouping: set[str] = set()

    def visit(node):
        if isinstance(node, promql.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            selected.setdefault(node.name, set()).update(m.name for m in node.matchers.matchers)
        elif isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif isinstance(node, promql.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                grouping.update(node.modifier.matching.labels)
            grouping.update(node.modifier.group_labels or [])

    promql.walk(parse(expr), pre_visit=visit)
    return selected, grouping


# ------------------------------------------------------------------------- the served broker
HOARDER = r"""
import sys, threading
from kvcached_broker.client import BrokerClient
c = BrokerClient.connect("hoarder", endpoint=sys.argv[1], page_bytes=1 << 30, credit_pages=0)
c.reserve({"kv_static": 1 << 30})
c.acquire(30)
def give_back(n):
    c.release(n)
    return n
c.on_pressure(give_back)
print("ready", flush=True)
threading.Event().wait()  # until the test kills it
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    """Every sample name a served broker exports, with the label names it carries, after a
    workload that makes every family the dashboard needs have samples."""
    from prometheus_client.parser import text_string_to_metric_families

    tmp = Path(tmp_path_factory.mktemp("dash", numbered=True))
    endpoint = f"ipc://{tmp}/gpu0.sock"
    port = free_port()
    with BrokerLauncher(endpoint, simulate="40GiB", args=["--headroom", "0", "--metrics-port", str(port)]) as broker:
        with broker.admin() as admin:
            admin.limit("capped", max_bytes=2 * GIB)
        hoarder = subprocess.Popen([sys.executable, "-c", HOARDER, endpoint], stdout=subprocess.PIPE, text=True)
        try:
            assert hoarder.stdout.readline().strip() == "ready"
            with BrokerClient.connect("capped", endpoint=endpoint, page_bytes=GIB, credit_pages=0) as capped:
                assert capped.acquire(3) == 0  # over its cap: refused
            with BrokerClient.connect("burst", endpoint=endpoint, page_bytes=GIB, credit_pages=0) as burst:
                burst.reserve({"swa_kv_pool": GIB})
                assert burst.acquire(16) == 0  # the GPU is full: refused, and pressure asks the hoarder
                wait_for(lambda: burst.acquire(16), what="memory moved under pressure")
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
        finally:
            hoarder.kill()
            hoarder.wait()
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


# ---------------------------------------------------------------------------------- the tests
def test_every_query_parses():
    assert len(queries()) >= 25
    for where, expr, _ in queries():
        try:
            parse(expr)
        except Exception as exc:  # noqa: BLE001 - the parser's error names the position
            pytest.fail(f"{where}: {expr!r} does not parse: {exc}")


def test_every_metric_and_label_the_queries_name_is_exported(exported):
    all_labels = set().union(*exported.values())
    for where, expr, variable_label in queries():
        selected, grouping = used(expr)
        for name, matched in selected.items():
            if name in DCGM_METRICS:
                assert DCGM_PANEL in where, f"{where}: only the DCGM panel may name DCGM exporter's {name}"
                assert matched <= {"UUID"}, f"{where}: {name} is matched on {matched}, not its UUID"
                continue
            assert name in exported, f"{where}: {name} is not a series the broker exports"
            assert matched <= exported[name], f"{where}: {name} has no label {matched - exported[name]}"
            if variable_label is not None:
                assert variable_label in exported[name], f"{where}: {name} has no label {variable_label}"
        assert grouping <= all_labels, f"{where}: groups or joins on {grouping - all_labels}, not exported"


def test_the_dashboard_shows_what_an_operator_looks_for():
    """Budget, charges by instance and pool, pressure, refusals, reclaims and their latency, and
    the join with DCGM exporter, each in a panel."""
    names = {name for _, expr, _ in queries() for name in used(expr)[0]}
    for needed in ("kvcached_broker_device_budget_bytes", "kvcached_broker_instance_reserved_bytes",
                   "kvcached_broker_instance_granted_bytes", "kvcached_broker_instance_pool_bytes",
                   "kvcached_broker_instance_pressure_pending_bytes", "kvcached_broker_instance_pressure_returned_bytes_total",
                   "kvcached_broker_refusals_total", "kvcached_broker_reclaims_total",
                   "kvcached_broker_request_duration_seconds_bucket", "DCGM_FI_DEV_FB_USED"):
        assert needed in names, needed
    titles = [p["title"] for p in _panels()]
    assert any("Reclaim latency" in t for t in titles) and DCGM_PANEL in titles


def test_the_dashboard_is_well_formed():
    assert DASHBOARD["uid"] == "kvcached-broker" and DASHBOARD["schemaVersion"] >= 36
    panels = list(_panels())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    for p in panels:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"] and p.get("description"), p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]
            for t in p["targets"]:
                for var in re.findall(r"\$(?!__)\{?([A-Za-z_][A-Za-z0-9_]*)", t["expr"]):
                    assert var in variables, f"{p['title']}: ${var} is not a dashboard variable"


# ------------------------------------------------------------- the queries run by a real Prometheus
#: DCGM exporter's exposition for the simulated GPU, as its releases up to 4.5.3-4.8.2 write it
#: (a test double: the labels of its gpu metrics template, values in MiB).
FAKE_DCGM = (
    "# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n"
    "# TYPE DCGM_FI_DEV_FB_USED gauge\n"
    'DCGM_FI_DEV_FB_USED{gpu="0",UUID="SIM-GPU-0",pci_bus_id="00000000:00:00.0",device="nvidia0",'
    'modelName="simulated GPU 0",Hostname="node-a"} 20480\n'
)


@pytest.fixture
def fake_dcgm_exporter():
    """An HTTP server on loopback that answers /metrics with :data:`FAKE_DCGM`; yields its port."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = FAKE_DCGM.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _prometheus_api(port: int, path: str, **params: str) -> Any:
    from urllib.parse import urlencode

    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urlencode(params)}"
    body = json.loads(urllib.request.urlopen(url, timeout=30).read().decode())
    assert body["status"] == "success", body
    return body["data"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="the prometheus server is not installed (Debian: apt-get install prometheus)")
def test_a_real_prometheus_answers_every_query_with_data(short_tmp, fake_dcgm_exporter):
    """Prometheus scrapes a served broker (honor_labels, as the chart's ServiceMonitor) and a DCGM
    exporter double; every dashboard query then evaluates without error, and the panels an operator
    reads first have data: charges by instance and pool, the variables' values, and the DCGM join."""
    broker_port, prom_port = free_port(), free_port()
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    config = short_tmp / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: kvcached-broker, honor_labels: true, static_configs: [{{targets: ['127.0.0.1:{broker_port}']}}]}}\n"
        f"  - {{job_name: dcgm-exporter, static_configs: [{{targets: ['127.0.0.1:{fake_dcgm_exporter}']}}]}}\n"
    )
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={short_tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with BrokerLauncher(endpoint, simulate="40GiB", args=["--metrics-port", str(broker_port),
                                                               "--metrics-hostname", "node-a"]):
            with BrokerClient.connect("llama", endpoint=endpoint, page_bytes=GIB, credit_pages=0) as llama, \
                    BrokerClient.connect("dsv4", endpoint=endpoint, page_bytes=GIB, credit_pages=0) as dsv4:
                dsv4.reserve({"swa_kv_pool": 2 * GIB, "c4_kv_pool": GIB})
                assert llama.acquire(4) == 4 and llama.acquire(1000) == 0

                def result(expr: str, duration: str = "10s") -> list[dict[str, Any]]:
                    text = GRAFANA_DURATIONS.sub(duration, expr).replace("$hostname", ".*").replace(
                        "$gpu", ".*").replace("$instance", ".*")
                    return _prometheus_api(prom_port, "query", query=text)["result"]

                rate_query = 'sum(rate(kvcached_broker_requests_total[10s]))'
                wait_for(lambda: prometheus.poll() is None and _try(lambda: result(rate_query)),
                         what="Prometheus to have two scrapes of the broker")
                wait_for(lambda: _try(lambda: result("DCGM_FI_DEV_FB_USED")), what="a scrape of the DCGM double")
                for where, expr, label in queries():
                    if label is None:
                        result(expr)  # evaluates: no parse, type or many-to-many matching error
                    else:
                        values = _prometheus_api(prom_port, f"label/{label}/values", **{"match[]": expr.replace(
                            "$hostname", ".*").replace("$gpu", ".*")})
                        assert values, f"{where}: no values"
                charges = {r["metric"]["instance"] for r in result(_expr("Charges by instance", "A"))}
                assert charges == {"llama", "dsv4"}  # honor_labels kept the serving instance
                pools = {(r["metric"]["instance"], r["metric"]["pool"]): float(r["value"][1])
                         for r in result(_expr("Reserved by instance and pool", "A"))}
                assert pools == {("dsv4", "swa_kv_pool"): 2 * GIB, ("dsv4", "c4_kv_pool"): GIB}
                assert {r["metric"]["code"] for r in result(_expr("Refusals by code", "A"), "1m")} == {"budget_exceeded"}
                in_use, charged = (result(_expr(DCGM_PANEL, ref)) for ref in ("A", "B"))
                assert [(r["metric"]["UUID"], float(r["value"][1])) for r in in_use] == [("SIM-GPU-0", 20 * GIB)]
                assert [(r["metric"]["UUID"], float(r["value"][1])) for r in charged] == [("SIM-GPU-0", 7 * GIB)]
                hosts = _prometheus_api(prom_port, "label/hostname/values", **{"match[]": "kvcached_broker_up"})
                assert hosts == ["node-a"]
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(30)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()


def _try(fn) -> Any:
    """``fn()``, or None while Prometheus is not answering yet."""
    try:
        return fn()
    except OSError:
        return None


def _expr(title: str, ref: str) -> str:
    panel = next(p for p in _panels() if p["title"] == title)
    return next(t["expr"] for t in panel["targets"] if t["refId"] == ref)
