"""The GPU check's two outputs: the JSON document, and the summary a person reads.

The JSON (``gpu-check.json``)::

    {"schema": 1, "mode": "gpu" | "simulate", "ok": bool, "started": "...", "wall_s": ..., "budget_s": ...,
     "machine": {...}, "install": {...},
     "parts": {NAME: {"title", "status", "why", "wall_s", "limit_s",
                      "figures": {KEY: value}, "assumed": {KEY: value}, "checks": [{"name", "ok", "detail"}],
                      "notes": [...], "log_tail"}},
     "derived": {"handover_pages_moved", "handover_floor_s", "handover_over_floor"},  # two parts together
     "differences": [{"part", "key", "measured", "assumed"}],        # where a figure is not what the simulation assumes
     "comparison": {"reference": PATH, "rows": [{"part", "key", "here", "reference", "ratio"}]} | null}

``ok`` is true when every part that ran passed its checks (a skipped part does not fail the run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...client.units import format_bytes

SCHEMA = 1


def differences(parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every figure that has an assumption and is not equal to it."""
    found = []
    for name, part in parts.items():
        figures = part.get("figures", {})
        for key, assumed in part.get("assumed", {}).items():
            if key in figures and figures[key] != assumed:
                found.append({"part": name, "key": key, "measured": figures[key], "assumed": assumed})
    return found


def load_reference(path: Path) -> dict[str, Any]:
    """A GPU run's JSON to compare with; ValueError (one line) if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("parts"), dict):
        raise ValueError(f"{path} is not a GPU check's JSON (schema {SCHEMA})")
    if data.get("mode") != "gpu":
        raise ValueError(f"{path} is a {data.get('mode')!r} run, not a GPU run")
    return data


def newest_reference(folder: Path) -> Path | None:
    """The newest GPU run kept in ``folder`` (docs/gpu-check/*.json, by name), or None."""
    runs = sorted(Path(folder).glob("*.json")) if Path(folder).is_dir() else []
    return runs[-1] if runs else None


def compare(parts: dict[str, dict[str, Any]], reference: dict[str, Any]) -> list[dict[str, Any]]:
    """Every numeric figure present in both runs, side by side, with here / reference."""
    rows = []
    for name, part in parts.items():
        theirs = reference["parts"].get(name, {}).get("figures", {})
        for key, value in part.get("figures", {}).items():
            other = theirs.get(key)
            if _number(value) and _number(other):
                rows.append({"part": name, "key": key, "here": value, "reference": other,
                             "ratio": value / other if other else None})
    return rows


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def shown(key: str, value: Any) -> str:
    """A figure as a person reads it, by its unit suffix."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and key.endswith("_s"):
        if abs(value) >= 1:
            return f"{value:.2f} s"
        if abs(value) >= 1e-3:
            return f"{value * 1e3:.2f} ms"
        return f"{value * 1e6:.1f} us"
    if isinstance(value, int) and "_bytes" in key:
        return format_bytes(value) if abs(value) >= 1 << 10 else f"{value} B"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render(doc: dict[str, Any]) -> str:
    """The readable summary of a run."""
    machine = doc.get("machine", {})
    lines = [f"kvcached-broker GPU check: {doc['mode']} run, {doc.get('started', '')}, "
             f"{machine.get('device', 'no device')}; {doc.get('wall_s', 0):.0f} s of {doc.get('budget_s', 0):.0f} s; "
             f"{'all parts passed' if doc.get('ok') else 'SOME PARTS DID NOT PASS'}"]
    if doc["mode"] == "simulate":
        lines.append("(simulated device: these figures are what the simulation assumes, not measurements of a GPU)")
    for key, value in doc.get("install", {}).items():
        lines.append(f"install: {key}: {value}")
    for name, part in doc["parts"].items():
        lines.append("")
        lines.append(f"[{part['status']}] {name}: {part.get('title', '')} "
                     f"({part.get('wall_s', 0):.1f} s of {part.get('limit_s', 0):.0f} s)")
        if part.get("why"):
            lines.append(f"    {part['why']}")
        assumed = part.get("assumed", {})
        for key, value in part.get("figures", {}).items():
            extra = f"   (simulation assumes {shown(key, assumed[key])})" if key in assumed else ""
            lines.append(f"    {key:<44} {shown(key, value):>16}{extra}")
        for check in part.get("checks", []):
            detail = f": {check['detail']}" if check.get("detail") and not check["ok"] else ""
            lines.append(f"    {'ok  ' if check['ok'] else 'FAIL'}  {check['name']}{detail}")
        for note in part.get("notes", []):
            lines.append(f"    note: {note}")
        if part["status"] in ("error", "timeout") and part.get("log_tail"):
            lines.append("    log: " + part["log_tail"].strip().replace("\n", "\n         ")[-1500:])
    if doc.get("derived"):
        lines.append("")
        lines.append("together (kvcached_pools with vmm_pages): the hand-over against the driver's floor")
        if doc["mode"] == "simulate":
            lines.append("    (simulated: kvcached's test double charges a whole pool page in one call, so this floor is "
                         "only the arithmetic, not a floor)")
        for key, value in doc["derived"].items():
            lines.append(f"    {key:<44} {shown(key, value):>16}")
    if doc["mode"] == "gpu":
        lines.append("")
        diffs = doc.get("differences", [])
        lines.append(f"where this device differs from what the simulation assumes: {len(diffs) or 'nowhere'}")
        for d in diffs:
            lines.append(f"    {d['part']}.{d['key']}: {shown(d['key'], d['measured'])} "
                         f"(the simulation assumes {shown(d['key'], d['assumed'])})")
    comparison = doc.get("comparison")
    if comparison:
        lines.append("")
        lines.append(f"compared with the GPU run {comparison['reference']} (simulated / GPU):")
        for row in comparison["rows"]:
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3g}"
            lines.append(f"    {row['part']}.{row['key']:<40} {shown(row['key'], row['here']):>14} "
                         f"{shown(row['key'], row['reference']):>14} {ratio:>8}")
    elif doc["mode"] == "simulate":
        lines.append("")
        lines.append("no GPU run to compare with (docs/gpu-check/*.json): the check has not run on a GPU yet")
    return "\n".join(lines) + "\n"
