"""Logs (broker/logs.py): --log-json writes one JSON event per line."""

from __future__ import annotations

import json
import os

from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.launch import BrokerLauncher


def test_json_logs_one_event_per_line(short_tmp):
    broker = BrokerLauncher(f"ipc://{short_tmp}/gpu0.sock", simulate="8GiB", args=["--log-json"], capture=True)
    with broker:
        with BrokerClient.connect("logged", endpoint=broker.endpoint, credit_pages=0) as c:
            c.acquire(1)
    events = [json.loads(line) for line in broker.stderr().strip().splitlines()]
    names = [e.get("event") for e in events]
    assert "ready" in names and "session_open" in names and "session_end" in names and "stopping" in names
    opened = next(e for e in events if e.get("event") == "session_open")
    assert opened["instance"] == "logged" and opened["pid"] == os.getpid() and opened["level"] == "info"
