#!/usr/bin/env python3
"""Write deploy/k8s/daemonset.yaml: the Helm chart rendered with its default values.

    render-k8s.py [--check]

The plain manifest is for clusters without Helm; the chart (deploy/helm/kvcached-broker) is the
source, so the two cannot drift: this script renders the chart as release ``kvcached-broker`` in
namespace ``kube-system`` with Helm's own template engine (helm-python-sdk, from the ``test``
extra), drops the two labels that say Helm manages the objects, and writes the DaemonSet and the
metrics Service under a header.  ``--check`` writes nothing and exits 1 if the file differs
(tests/test_helm_chart.py runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/helm/kvcached-broker"
TARGET = ROOT / "deploy/k8s/daemonset.yaml"
RELEASE, NAMESPACE = "kvcached-broker", "kube-system"
#: The rendered templates that make up the plain manifest, in this order.
TEMPLATES = ("daemonset.yaml", "service.yaml")
HELM_ONLY_LABEL = re.compile(r"^\s*(helm\.sh/chart|app\.kubernetes\.io/managed-by):.*\n", re.MULTILINE)

HEADER = """\
# One broker per GPU on every GPU node (nvidia.com/gpu.present=true): a DaemonSet whose pod runs
# a broker container per NVML index 0-7, with its socket in the host's /run/kvcached and its
# checkpoint in /var/lib/kvcached-broker, and a headless Service over the metrics ports.
# Serving pods on the node mount /run/kvcached and set
#   KVCACHED_BROKER=ipc:///run/kvcached/{uuid}.sock
# (a non-root one also needs supplementalGroups: [10001]).  On nodes with fewer GPUs, delete the
# containers and Service ports beyond their count, or use the Helm chart (--set gpusPerNode=N).
#
# GENERATED from deploy/helm/kvcached-broker with its default values by scripts/render-k8s.py
# (release kvcached-broker, namespace kube-system).  Edit the chart and rerun the script; a test
# fails while this file differs from the chart.
"""


def render() -> str:
    """The plain manifest's text."""
    try:
        import helm_python
    except ImportError:
        sys.exit("render-k8s.py needs helm-python-sdk: pip install -e '.[test]'")
    rendered = helm_python.Chart.load(CHART).render(name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for template in TEMPLATES:
        text = rendered[f"{CHART.name}/templates/{template}"]
        docs.append(HELM_ONLY_LABEL.sub("", text).strip() + "\n")
    return HEADER + "---\n" + "---\n".join(docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs; write nothing")
    args = parser.parse_args(argv)
    text = render()
    current = TARGET.read_text() if TARGET.exists() else ""
    if args.check:
        if current != text:
            print(f"{TARGET.relative_to(ROOT)} differs from the chart: run scripts/render-k8s.py", file=sys.stderr)
            return 1
        return 0
    if current != text:
        TARGET.write_text(text)
        print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
