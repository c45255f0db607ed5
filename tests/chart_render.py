"""The Helm chart rendered by Helm's own engine (helm-python-sdk), for the chart's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/helm/kvcached-broker"
RELEASE, NAMESPACE = "kvcached-broker", "kube-system"


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's objects for ``values`` (laid over values.yaml), as ``helm template`` renders them."""
    import helm_python
    import yaml

    chart = helm_python.Chart.load(CHART)
    rendered = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for name, text in sorted(rendered.items()) if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The only object of ``kind`` among ``docs``."""
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]
