"""The ``status`` table shows holds and measured usage, not only pools; ``status --json`` keeps its
fields and only gains new ones.  A real broker and the real CLI, on a simulated device that
measures this process as NVML would."""

from __future__ import annotations

import json
import os
import subprocess

from helpers import CLI, GIB, connect

#: The per-instance and per-session fields of ``status --json`` before name collisions were shown.
INSTANCE_FIELDS = {
    "name", "max_bytes", "min_bytes", "weight", "priority", "limits_revision", "reserved_bytes", "granted_bytes",
    "unreported_bytes", "charged_bytes", "grantable_bytes", "held_bytes", "pools", "holds", "usage_breakdown",
    "sessions", "fair_share_bytes", "pressure",
}
SESSION_FIELDS = {
    "id", "rank", "tp_size", "pid", "pid_verified", "state", "page_bytes", "granted_pages", "reserve_pages",
    "reserved_bytes", "granted_bytes", "held_bytes", "measured_bytes", "pools", "holds", "usage_breakdown",
    "idle_s", "client", "adapter", "report_mapping", "unmapped_pages", "phase",
    "idle_pages",
}


def status_cli(b, *args: str) -> str:
    out = subprocess.run([*CLI, "status", "--endpoint", b.endpoint, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def lines_of(table: str, start: str) -> list[str]:
    return [line for line in table.splitlines() if line.lstrip().startswith(start)]


def test_the_table_shows_a_hold_and_what_the_device_measures(broker):
    with connect(broker, "sizing") as c, connect(broker, "plain") as plain:
        c.reserve({"runtime_base": 2 * GIB}, holds={"kv_sizing_hold": 20 * GIB})
        plain.reserve({"kv_static": GIB})
        with broker.admin() as admin:
            admin.simulate(process_bytes={os.getpid(): 30 * GIB})  # the weights this process loaded
        try:
            table = status_cli(broker)
        finally:
            with broker.admin() as admin:
                admin.simulate(process_bytes={os.getpid(): 0})
    (hold,) = lines_of(table, "kv_sizing_hold")
    assert "20.00 GiB" in hold and hold.endswith("hold")
    (base,) = lines_of(table, "runtime_base")
    assert not base.endswith("hold")
    (session,) = lines_of(table, c.session_id)
    assert "held 20.00 GiB" in session and "measured 30.00 GiB" in session and f"pid {os.getpid()}" in session
    (mine,) = lines_of(table, plain.session_id)  # one process, so both its sessions are measured 30 GiB
    assert "held" not in mine and "measured 30.00 GiB" in mine
    instance_lines = lines_of(table, "(instance)")
    assert any("held 20.00 GiB" in line and "unreported" in line for line in instance_lines)


def test_a_session_with_nothing_held_or_measured_adds_no_line(broker):
    with connect(broker, "quiet") as c:
        c.reserve({"kv_static": GIB})
        table = status_cli(broker)
    assert lines_of(table, c.session_id) == [] and lines_of(table, "(instance)") == []
    assert [line for line in table.splitlines() if line.endswith("hold")] == []


def test_status_json_keeps_its_fields_and_gains_conflicts(broker):
    with connect(broker, "m") as c:
        c.reserve({"kv_static": GIB}, holds={"kv_sizing_hold": GIB})
        doc = json.loads(status_cli(broker, "--json"))
    (inst,) = doc["instances"]
    assert set(inst) == INSTANCE_FIELDS | {"conflicts"} and inst["conflicts"] == []
    assert set(inst["sessions"][0]) == SESSION_FIELDS
