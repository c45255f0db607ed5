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
    """A readable table: a device header, then one row per instance and one per pool.

    Under an instance, only what is there is shown: a pool that is a hold is marked ``hold``;
    a line with the instance's held and unreported bytes if either is nonzero; a line per
    session with nonzero held or measured bytes; and, with a ``!COLLISION`` marker on the
    instance's row, a ``!`` line per name collision (``conflicts`` in ``status --json``)."""
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
            f"{format_bytes(inst['max_bytes']):>12}{states}{_collision_marker(inst)}"
        )
        lines.extend(_instance_details(inst))
    return "\n".join(lines)


def _instance_details(inst: dict[str, Any]) -> list[str]:
    """The lines under an instance's row: pools, then held/measured figures, then collisions."""
    holds = inst.get("holds", {})
    lines = [
        f"  {_clip(pool, 31):<32}{'':>9}{format_bytes(size):>13}" + ("  hold" if pool in holds else "")
        for pool, size in inst["pools"].items()
    ]
    figures = _nonzero_figures(("held", inst.get("held_bytes", 0)), ("unreported", inst.get("unreported_bytes", 0)))
    if figures:
        lines.append(f"  {'(instance)':<32}{figures}")
    for session in inst["sessions"]:
        figures = _nonzero_figures(("held", session.get("held_bytes", 0)), ("measured", session.get("measured_bytes", 0)))
        if figures:
            who = f"{session['id']} rank {session['rank']} pid {session['pid']}"
            lines.append(f"  {_clip(who, 31):<32}{figures}")
    lines.extend(f"  ! {_describe_conflict(conflict)}" for conflict in inst.get("conflicts", []))
    return lines


def _nonzero_figures(*figures: tuple[str, int]) -> str:
    """``"held 2.00 GiB  measured 30.00 GiB"`` for the nonzero ones ("" when all are 0)."""
    return "  ".join(f"{label} {format_bytes(size_bytes)}" for label, size_bytes in figures if size_bytes)


def _collision_marker(inst: dict[str, Any]) -> str:
    return "  !COLLISION" if inst.get("conflicts") else ""


def _describe_conflict(conflict: dict[str, Any]) -> str:
    pids = ", ".join(map(str, conflict["pids"]))
    sessions = ", ".join(conflict["sessions"])
    if conflict["kind"] == "rank":
        return f"name collision: rank {conflict['rank']} is held by pids {pids} (sessions {sessions})"
    sizes = ", ".join(map(str, conflict["tp_sizes"]))
    return f"name collision: sessions disagree on tp_size ({sizes}; pids {pids}, sessions {sessions})"


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
