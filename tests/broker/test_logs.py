"""Logs (broker/logs.py): --log-json writes one JSON event per line; one line per refusal."""

from __future__ import annotations

import json
import logging
import os

import pytest

from kvcached_broker.client import BrokerClient, BudgetExceeded
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB, CoreSession, make_core


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


def test_every_refusal_is_one_line(short_tmp):
    """The README promises a line per refusal: a refused acquire as much as a refused reserve
    (one each, naming the session, the operation and the code); a granted one logs nothing."""
    broker = BrokerLauncher(f"ipc://{short_tmp}/gpu0.sock", simulate="8GiB", args=["--log-json", "--headroom", "0"],
                            capture=True)
    with broker:
        with BrokerClient.connect("refused", endpoint=broker.endpoint, credit_pages=0, page_bytes=1 << 30) as c:
            assert c.acquire(6) == 6
            assert c.acquire(3) == 0  # 2 GiB left
            with pytest.raises(BudgetExceeded):
                c.reserve({"weights": 4 << 30})
            session = c.session_id
    events = [json.loads(line) for line in broker.stderr().strip().splitlines()]
    refusals = [e for e in events if e.get("event") == "refusal"]
    assert [(e["op"], e["code"], e["session"]) for e in refusals] == [
        ("acquire", "budget_exceeded", session), ("reserve", "budget_exceeded", session)]


def test_a_retried_refusal_is_answered_again_without_a_second_line(caplog):
    core = make_core(8 * GIB)
    c = CoreSession(core, page_bytes=GIB)
    assert c.acquire(8) == 8
    refused = {"op": "acquire", "id": 50, "session": c.token, "pages": 1}
    with caplog.at_level(logging.INFO, logger="kvcached_broker"):
        first, again = c.ask(refused), c.ask(refused)
    assert first == again and first["result"]["granted"] == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=refusal")]
    assert len(lines) == 1 and "op=acquire" in lines[0] and f"session={c.session_id}" in lines[0]
