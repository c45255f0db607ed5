"""Every broker failure leaves SGLang running unprotected with one warning, or stops it under REQUIRE.

Each failure kind (``tests/broker_failures.py``) is met on SGLang's real start-up path: the
installed release's ``_profile_available_bytes``, a real ``DeepSeekV4TokenToKVPool`` and the
pools' charge.  Without ``KVCACHED_REQUIRE`` nothing raises, SGLang keeps its own figure,
and exactly one ``event=unprotected`` line names the reason; with it, the start fails with
that reason.  An eviction is fatal in both.  Two TP processes, one of them unprotected,
still agree through every collective.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

import broker_failures
import sglang_cpu
from helpers import MIB

from kvcached_broker.adapters import background, sessions
from kvcached_broker.adapters.sglang import kv_sizing, parallel
from kvcached_broker.client import SessionEvicted

pytestmark = pytest.mark.runtime("sglang")

WORKER = os.path.join(os.path.dirname(__file__), "sglang_worker.py")


def _start_sglang() -> int:
    """SGLang's start: profile the KV budget, build a DeepSeek-V4 pool, charge it."""
    kv_bytes = sglang_cpu.profile(100 * MIB)
    pool = sglang_cpu.build_dsv4_pool(full_pages=8, swa_pages=4)
    kv_sizing.charge_pools("cpu", 0, pool)
    return kv_bytes


@pytest.mark.parametrize("kind", broker_failures.KINDS)
def test_a_broker_failure_leaves_sglang_unprotected_with_one_warning(kind, request, monkeypatch, adapter_state,
                                                                     patched_sglang, capsys):
    failing = broker_failures.arrange(kind, request, monkeypatch)
    failing.break_after_open(parallel.identity("cpu"))
    if kind == "evicted":
        with pytest.raises(SessionEvicted):  # its memory was given away: fatal in every mode
            _start_sglang()
        return
    assert _start_sglang() == 100 * MIB  # no exception, and SGLang's own figure
    lines = broker_failures.unprotected_lines(capsys.readouterr().err)
    assert len(lines) == 1 and failing.reason in lines[0], lines
    assert sessions.session(parallel.identity("cpu")) is None


@pytest.mark.parametrize("kind", broker_failures.KINDS)
def test_under_require_a_broker_failure_stops_the_start_with_the_reason(kind, request, monkeypatch, adapter_state,
                                                                        patched_sglang):
    failing = broker_failures.arrange(kind, request, monkeypatch)
    failing.break_after_open(parallel.identity("cpu"))
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    expected = SessionEvicted if kind == "evicted" else sessions.BrokerRequired
    with pytest.raises(expected) as caught:
        _start_sglang()
    if failing.reason:
        assert failing.reason in str(caught.value) and "KVCACHED_REQUIRE=1" in str(caught.value)


@pytest.mark.skipif(not sglang_cpu.at_least("0.5.21"), reason="the DSV4.1 request window arrived in 0.5.21")
def test_no_broker_round_trip_runs_inside_the_forward_pass(sg_broker, monkeypatch):
    """The request window grows inside a forward pass: its re-measure runs on another thread."""
    pool = sglang_cpu.build_dsv4_pool(full_pages=16, swa_pages=4, request_window=True)
    client = sessions.session(parallel.identity("cpu")).client
    callers: list[int] = []
    real = client.reserve

    def reserve(*args, **kwargs):
        callers.append(threading.get_ident())
        raise broker_failures.error_from_wire("internal", "ledger invariant check failed", {})

    monkeypatch.setattr(client, "reserve", reserve)
    window = pool.request_window
    window._ensure_workspace(window.workspace.size * 4)  # SGLang's forward pass: nothing raises here
    assert background.drain()
    assert callers and threading.get_ident() not in callers  # the one round trip ran elsewhere
    monkeypatch.setattr(client, "reserve", real)


# ------------------------------------------------------------------ tensor parallel, 2 processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not sglang_cpu.at_least("0.5.13"), reason="0.5.12 finds its TP group as 0.5.13 does (suite time)")
def test_an_unprotected_tp_rank_still_joins_every_collective(broker_factory):
    """Rank 1's endpoint is invalid: it runs unprotected, rank 0's small GPU decides the KV size
    for both (the world min-reduce), and each rank builds and reports its own pools."""
    small = broker_factory(device=0, simulate="64MiB", extra_args=["--headroom", "0"])
    port = _free_port()
    endpoints = (small.endpoint, "ipc://relative/gpu{device}.sock")
    procs = []
    for rank, endpoint in enumerate(endpoints):
        env = {**os.environ, "ENABLE_KVCACHED": "1", "KVCACHED_BROKER": endpoint, "KVCACHED_BROKER_INSTANCE": "tp2"}
        procs.append(subprocess.Popen([sys.executable, WORKER, "tp", str(rank), "2", str(port), "8", str(1 << 30)],
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    killer = threading.Timer(120, lambda: [proc.kill() for proc in procs])  # a deadlock fails, not hangs
    killer.start()
    try:
        reports = []
        for proc in procs:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-3000:]
            reports.append(json.loads(line))
        assert reports[0]["kv_bytes"] == reports[1]["kv_bytes"] == 64 * MIB  # the world min-reduce agreed
        (inst,) = small.status()["instances"]
        assert {name: size for name, size in inst["pools"].items() if name != "runtime_base"} == reports[0]["pools"]
    finally:
        killer.cancel()
        for proc in procs:
            proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=60)
        errors = [proc.stderr.read() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert broker_failures.unprotected_lines(errors[0]) == []
    (line,) = broker_failures.unprotected_lines(errors[1])
    assert "an ipc path must be absolute" in line
