"""Human views of a status document: the ``status`` table and the ``--watch`` bars."""

from __future__ import annotations

import shutil
from typing import Any

from ..client.units import format_bytes

CLEAR_HOME = "\x1b[H\x1b[J"
RESERVED_CHAR = "█"
GRANTED_CHAR = "▒"
FREE_CHAR = "·"


def render_table(status: dict[str, Any]) -> str:
    """A readable table: a device header, then one row per instance and one per pool."""
    dev = status["device"]
    broker = status.get("broker", {})
    kind = "simulated" if dev["simulated"] else dev["name"]
    lines = [
        f"GPU {dev['index']}  {dev['uuid']}  ({kind})   broker {broker.get('version', '?')} pid {broker.get('pid', '?')}"
        f"  {broker.get('endpoint', '')}",
        "  ".join(
            f"{label} {format_bytes(status[key])}"
            for label, key in (
                ("total", "total_bytes"),
                ("headroom", "headroom_bytes"),
                ("external", "external_bytes"),
                ("budget", "budget_bytes"),
            )
        ),
        "  ".join(
            f"{label} {format_bytes(status[key])}"
            for label, key in (
                ("reserved", "reserved_bytes"),
                ("granted", "granted_bytes"),
                ("unreported", "unreported_bytes"),
                ("free", "free_bytes"),
            )
        )
        + ("   OVERCOMMITTED" if status["overcommitted"] else ""),
        "",
    ]
    header = f"{'INSTANCE / POOL':<34}{'SESSIONS':>9}{'RESERVED':>13}{'GRANTED':>13}{'MIN':>12}{'MAX':>12}"
    lines.append(header)
    if not status["instances"]:
        lines.append("  (no instances)")
    for inst in status["instances"]:
        states = _session_states(inst)
        lines.append(
            f"{_clip(inst['name'], 33):<34}{len(inst['sessions']):>9}{format_bytes(inst['reserved_bytes']):>13}"
            f"{format_bytes(inst['granted_bytes']):>13}{format_bytes(inst['min_bytes']):>12}"
            f"{format_bytes(inst['max_bytes']):>12}{states}"
        )
        for pool, size in inst["pools"].items():
            lines.append(f"  {_clip(pool, 31):<32}{'':>9}{format_bytes(size):>13}")
    return "\n".join(lines)


def render_bars(status: dict[str, Any], width: int | None = None) -> str:
    """Per-instance bars of reserved (█) and granted (▒) against the budget."""
    columns = width or shutil.get_terminal_size((100, 24)).columns
    bar_width = max(10, min(60, columns - 50))
    budget = max(1, status["budget_bytes"])
    lines = [render_table(status), "", f"{'':<24}0{'budget ' + format_bytes(status['budget_bytes']):>{bar_width}}"]
    for inst in status["instances"]:
        lines.append(f"{_clip(inst['name'], 23):<24}{_bar(inst['reserved_bytes'], inst['granted_bytes'], budget, bar_width)}")
    total = _bar(status["reserved_bytes"], status["granted_bytes"], budget, bar_width)
    lines.append(f"{'(all)':<24}{total}")
    lines.append(f"{'':<24}{RESERVED_CHAR} reserved  {GRANTED_CHAR} granted  {FREE_CHAR} free")
    return "\n".join(lines)


def _bar(reserved: int, granted: int, budget: int, width: int) -> str:
    r = min(width, round(width * reserved / budget))
    g = min(width - r, round(width * granted / budget))
    return "[" + RESERVED_CHAR * r + GRANTED_CHAR * g + FREE_CHAR * (width - r - g) + "]"


def _session_states(inst: dict[str, Any]) -> str:
    odd = [s["state"] for s in inst["sessions"] if s["state"] != "live"]
    if not odd:
        return ""
    counts: dict[str, int] = {}
    for state in odd:
        counts[state] = counts.get(state, 0) + 1
    return "  (" + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) + ")"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
