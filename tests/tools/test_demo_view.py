"""The demo's parts that need neither torch nor kvcached, against a real broker in its own process.

* the DeepSeek-V4-shaped server (``tools/dsv4_server.py``) goes through its start-up with the
  adapters' own calls: phases ``sizing``, ``warming``, ``serving`` in status, its side pools
  reported per pool, its books covering what the shared simulated device measures at every
  step, its pools unchanged once it serves;
* the frame checks (``tools/demo_view.py``): a budget that adds up passes; a real overcommit
  (external memory the broker did not grant, or a process using more than it was promised)
  fails; memory charged twice, promised and already measured (pages mapped before their report,
  a warm-up inside its slack hold), is the only excess tolerated; usage beyond a charge and
  changed static pools fail;
* a frame fits 80 to 100 columns; the demo's shell stops with exit status 1 and says why at
  the first frame that does not add up.

(``tests/adapters/kvcached/test_mission_demo.py`` runs the whole demo, kvcached pools included.)
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from helpers import GIB, device_and_status

from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.demo_view import Budget, EventLog, Frame, FrameChecks, Server, render
from kvcached_broker.tools.dsv4_shape import POOLS, Dsv4Shape

CAP = 30 * GIB


class Dsv4:
    def __init__(self, usage: Path, endpoint: str, log: Path):
        env = {**os.environ, "KVCACHED_BROKER": endpoint}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcached_broker.tools.dsv4_server", str(usage), str(80 * GIB), "dsv4-flash"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)
        self.pid = json.loads(self.proc.stdout.readline())["pid"]

    def request(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.request("exit")
            self.proc.wait(timeout=30)


def _frame(usage: Path, admin, server: Server, t_s: float = 0.0) -> Frame:
    device, status = device_and_status(usage, admin)
    return Frame(t_s, status, device, {}, {}, frozenset({server.instance}), {server.instance: "testing"})


def _instance(status: dict, name: str) -> dict:
    return next(i for i in status["instances"] if i["name"] == name)


def test_the_dsv4_server_reports_its_side_pools_per_pool_through_its_start_up_and_holds_them_static(
        broker_factory, short_tmp):
    usage = short_tmp / "gpu0"
    broker = broker_factory(extra_args=["--simulate-usage-dir", str(usage)])
    with broker.admin() as admin:
        admin.limit("dsv4-flash", max_bytes=CAP)
        dsv4 = Dsv4(usage, broker.endpoint, short_tmp / "dsv4.err")
        server = Server("dsv4-flash", dsv4.pid, "test", elastic=False)
        checks = FrameChecks([server])
        try:
            assert "refused" not in dsv4.request("load", weights_bytes=18 * GIB)

            sized = dsv4.request("size", mem_fraction_static=0.95, max_running_requests=64)
            frame = _frame(usage, admin, server)
            inst = _instance(frame.status, "dsv4-flash")
            assert frame.phase("dsv4-flash") == "sizing"
            assert set(inst["holds"]) == {"kv_sizing_hold", "runtime_slack_hold"}
            assert sized["asked_kv_bytes"] > sized["kv_bytes"] > 0  # SGLang's own figure, capped by the broker
            assert inst["charged_bytes"] <= CAP and checks.check(frame) == []

            built = dsv4.request("build")
            frame = _frame(usage, admin, server)
            inst = _instance(frame.status, "dsv4-flash")
            assert frame.phase("dsv4-flash") == "warming"
            assert set(inst["holds"]) == {"runtime_slack_hold"}  # the KV hold turned into the pools
            assert {p: inst["pools"][p] for p in POOLS} == Dsv4Shape(request_slots=65).pools(built["full_tokens"])
            assert sum(inst["pools"][p] for p in POOLS) <= sized["kv_bytes"]
            assert checks.check(frame) == []

            dsv4.request("warm_up", graphs_bytes=GIB, activations_bytes=3 * GIB // 2)
            serving = _frame(usage, admin, server)
            inst = _instance(serving.status, "dsv4-flash")
            assert serving.phase("dsv4-flash") == "serving" and inst["holds"] == {}
            assert inst["pools"]["runtime_slack"] > 0 and inst["charged_bytes"] <= CAP
            assert checks.check(serving) == []
            assert checks.check(_frame(usage, admin, server)) == []  # static: the same pools a frame later

            grown = dict(serving.status, instances=[dict(inst, pools={**inst["pools"], "swa_kv_pool": 1})])
            changed = Frame(1.0, grown, serving.device, {}, {}, serving.admitted, {})
            assert any("static pools changed" in p for p in checks.check(changed))
            beyond = Frame(1.0, serving.status, {dsv4.pid: inst["charged_bytes"] + 1}, {}, {}, serving.admitted, {})
            assert any("uses" in p and "charges it" in p for p in checks.check(beyond))
        finally:
            dsv4.stop()


def test_the_budget_check_fails_a_real_overcommit_and_tolerates_only_pages_charged_twice(broker):
    page = 2 << 20
    with broker.admin() as admin, BrokerClient.connect("elastic", endpoint=broker.endpoint, page_bytes=page,
                                                       credit_pages=0, report_mapping=True) as client:
        budget = admin.status()["budget_bytes"]
        client.reserve({"runtime_base": budget - 2 * GIB, "activations": GIB})
        assert client.acquire(GIB // page) == GIB // page  # granted, not mapped yet: promised
        status = admin.status()
        assert status["free_bytes"] == 0 and Budget.of(status).problems(status) == [] and Budget.of(status).over == 0

        # the device shows 512 MiB of those pages mapped before the pool says so: charged twice
        admin.simulate(process_bytes={os.getpid(): budget - GIB + GIB // 2})
        status = admin.status()
        checked = Budget.of(status)
        assert status["overcommitted"] and checked.over == GIB // 2 == checked.counted_twice
        assert checked.problems(status) == []

        admin.simulate(external_bytes=4 * GIB)  # memory nobody was granted: a real overcommit
        status = admin.status()
        problems = Budget.of(status).problems(status)
        assert problems and "overcommitted" in problems[0], problems


def test_a_warm_up_inside_its_slack_hold_is_charged_twice_and_anything_beyond_the_hold_fails(broker):
    with broker.admin() as admin, BrokerClient.connect("dsv4-flash", endpoint=broker.endpoint) as client:
        budget = admin.status()["budget_bytes"]
        client.reserve({"runtime_base": budget - 2 * GIB}, holds={"runtime_slack_hold": 2 * GIB})
        admin.simulate(process_bytes={os.getpid(): budget - GIB})  # 1 GiB of graphs inside the slack hold
        status = admin.status()
        checked = Budget.of(status)
        assert checked.over == GIB == checked.counted_twice and checked.problems(status) == []

        admin.simulate(process_bytes={os.getpid(): budget + GIB})  # 1 GiB beyond what it was promised
        status = admin.status()
        checked = Budget.of(status)
        assert checked.over == 3 * GIB and checked.counted_twice == 2 * GIB
        assert any("overcommitted" in p for p in checked.problems(status))


def test_a_frame_fits_80_to_100_columns_and_shows_every_pool(broker):
    with broker.admin() as admin, BrokerClient.connect("dsv4-flash", endpoint=broker.endpoint) as client:
        client.reserve({**Dsv4Shape().pools(1 << 20), "runtime_base": 20 * GIB}, holds={"runtime_slack_hold": GIB})
        server = Server("dsv4-flash", os.getpid(), "a DeepSeek-V4-Flash-like rank, static pools", elastic=False)
        frame = Frame(12.5, admin.status(), {}, {}, {}, frozenset(), {"dsv4-flash": "serving " * 20})
        events = EventLog()
        events.add(1.0, "an event long enough to be cut at the frame's width " * 3)
        for width in (80, 96, 100):
            text = render(frame, [server], events, ["a failed check " * 10], width=width, title="demo")
            assert max(map(len, text.splitlines())) <= width, text
            for pool in (*POOLS, "runtime_base", "runtime_slack_hold"):
                assert f"  {pool} " in text
            assert "adds up" in text and "CHECK FAILED" in text


def test_the_dsv4_shape_fills_its_budget_with_whole_pages():
    shape = Dsv4Shape()
    for budget in (GIB, 7 * GIB + 12345, 40 * GIB):
        tokens = shape.full_tokens_for(budget)
        assert tokens % shape.page_tokens == 0 and tokens > 0
        assert sum(shape.pools(tokens).values()) <= budget < sum(shape.pools(tokens + shape.page_tokens).values())
        assert all(shape.pools(tokens)[p] > 0 for p in POOLS)
    assert shape.full_tokens_for(1 << 20) == 0  # not even the request-scoped state fits


def test_the_demo_stops_with_status_1_at_the_first_frame_that_does_not_add_up(broker, short_tmp):
    from kvcached_broker.tools.kvcached_sim.mission_demo import Clock, Show

    class Idle:  # the demo's script, with nothing left to do
        def __init__(self):
            self.events, self.kv_base, self.admitted, self.activity = EventLog(), {}, set(), {}
            self.done = threading.Event()
            self.done.set()

        def run(self):
            pass

        def took_frame(self):
            pass

    with broker.admin() as admin, BrokerClient.connect("dsv4-flash", endpoint=broker.endpoint) as client:
        client.reserve({"c4_kv_pool": 70 * GIB})
        admin.simulate(external_bytes=8 * GIB)
        out = io.StringIO()
        servers = [Server("dsv4-flash", os.getpid(), "test", elastic=False)]
        (short_tmp / "gpu0").mkdir()
        code = Show(Idle(), servers, admin, short_tmp / "gpu0", [], Clock(), out).run(0.0)
    assert code == 1
    assert "CHECK FAILED: the budget does not add up: overcommitted" in out.getvalue()
    assert "kvcached-broker demo: FAILED at t =" in out.getvalue()


def test_the_event_log_keeps_every_event_no_frame_has_shown_yet():
    events = EventLog(keep=4)
    for second in range(7):  # a slow machine: seven events before the next frame
        events.add(float(second), f"event {second}")
    assert [line.split("  ")[-1] for line in events.lines] == [f"event {n}" for n in range(7)]
    events.shown(5)  # a frame rendered after five of them was shown
    assert len(events.lines) == 4 and events.lines[-1].endswith("event 6")
    events.shown(7)
    events.add(7.0, "event 7")
    assert [line.split("  ")[-1] for line in events.lines] == [f"event {n}" for n in range(4, 8)]
