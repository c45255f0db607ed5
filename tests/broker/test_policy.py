"""Arbitration policy: floors, caps, weighted fair shares and pressure."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcached_broker.broker.accounts import DeviceInfo, Limits
from kvcached_broker.broker.ledger import Ledger
from kvcached_broker.broker.policy import PressureBook, fair_shares
from kvcached_broker.client.results import PressureView
from kvcached_broker.client import BrokerClient

from helpers import GIB, wait_for

DEVICE = DeviceInfo(0, "SIM-GPU-0", "sim", True)


def ledger_with(*instances, budget=100 * GIB):
    ledger = Ledger(DEVICE, total_bytes=budget, headroom_bytes=0)
    for i, name in enumerate(instances):
        ledger.open_session(f"s{i}", instance=name, pid=100 + i, pid_verified=True, tp_rank=0, tp_size=1,
                            page_bytes=GIB, now_s=0.0)
    return ledger


def test_fair_shares_follow_weights_floors_and_caps():
    ledger = ledger_with("a", "b", "c")
    assert fair_shares(ledger) == {"a": pytest.approx(100 * GIB / 3, abs=2), "b": pytest.approx(100 * GIB / 3, abs=2),
                                   "c": pytest.approx(100 * GIB / 3, abs=2)}
    ledger.set_limits("a", weight=2.0)
    shares = fair_shares(ledger)
    assert shares["a"] == pytest.approx(50 * GIB, abs=2) and shares["b"] == pytest.approx(25 * GIB, abs=2)
    ledger.set_limits("b", max_bytes=10 * GIB)  # capped: the rest is shared by weight
    ledger.set_limits("c", min_bytes=40 * GIB)
    shares = fair_shares(ledger)
    assert shares["b"] == 10 * GIB and shares["c"] == pytest.approx(40 * GIB, abs=2)
    assert shares["a"] == pytest.approx(50 * GIB, abs=2)
    assert sum(shares.values()) <= 100 * GIB
    ledger.set_limits("later", min_bytes=5 * GIB)  # a floor for an instance not here yet takes part
    assert "later" in fair_shares(ledger)


def test_pressure_asks_those_above_their_share_and_counts_what_comes_back():
    ledger = ledger_with("idle", "starved")
    assert ledger.acquire("s0", 90).pages == 90
    assert ledger.acquire("s1", 20).pages == 0
    book = PressureBook(retry_s=1.0, expire_s=5.0)
    asks = book.plan(ledger, "starved", need_bytes=10 * GIB, now_s=0.0)
    assert [(a.session_id, a.pages) for a in asks] == [("s0", 10)]
    assert book.plan(ledger, "starved", need_bytes=10 * GIB, now_s=0.5) == []  # fresh ask: not again
    ledger.release("s0", 4)
    assert book.on_release("s0", 4) == 4
    view = book.instance_view("idle")
    assert view == PressureView(pending_bytes=6 * GIB, asks=1, soft_asks=0, asked_bytes=10 * GIB,
                                returned_bytes=4 * GIB, ignored_bytes=0)
    assert [sid for sid, _ in book.expire(now_s=6.0)] == ["s0"]
    assert book.instance_view("idle").ignored_bytes == 6 * GIB
    assert ledger.sessions["s0"].granted_pages == 86  # ignoring an ask never cuts what it holds


def test_refusals_in_a_row_escalate_the_pressure_within_the_deficit():
    """A burst is refused ask after ask: each refusal within the window doubles what the others
    are asked for, never past what the starved instance lacks of its fair share."""
    ledger = ledger_with("idle", "burst")
    assert ledger.acquire("s0", 100).pages == 100
    book = PressureBook(retry_s=0.0, expire_s=60.0, escalate_window_s=2.0)

    def asked(now_s):
        asks = book.plan(ledger, "burst", need_bytes=GIB, now_s=now_s)
        for ask in asks:  # the idle instance gives back what it was asked for
            ledger.release(ask.session_id, ask.pages)
            book.on_release(ask.session_id, ask.pages)
        return sum(a.pages for a in asks)

    assert [asked(t) for t in (0.0, 0.1, 0.2, 0.3)] == [1, 2, 4, 8]
    assert asked(0.4) == 16
    assert asked(0.5) == 19  # 32 wanted, but the idle instance is only 100 - 31 - 50 = 19 above its share
    assert asked(0.6) == 0  # the idle instance is at its share: it is not asked any more
    assert asked(5.0) == 0
    three = ledger_with("idle", "burst", "other")  # shares of 33.3 GiB each
    three.acquire("s0", 60)
    three.acquire("s1", 20)
    book3 = PressureBook(retry_s=0.0, escalate_window_s=2.0)
    wanted = [sum(a.pages for a in book3.plan(three, "burst", need_bytes=GIB, now_s=t_s)) for t_s in (0.0, 0.1, 0.2, 0.3, 0.4)]
    assert wanted == [1, 2, 4, 8, 14]  # 16 would pass what it lacks of its share: 33.3 - 20, in whole pages
    fresh = ledger_with("idle", "burst")
    fresh.acquire("s0", 100)
    book2 = PressureBook(retry_s=0.0, escalate_window_s=2.0)
    book2.plan(fresh, "burst", need_bytes=GIB, now_s=0.0)
    assert sum(a.pages for a in book2.plan(fresh, "burst", need_bytes=GIB, now_s=3.0)) == 1  # a pause resets it
    book2.expire(now_s=10.0)
    assert book2.streaks == {}


def test_no_pressure_for_an_instance_at_or_above_its_share():
    ledger = ledger_with("a", "b")
    ledger.acquire("s0", 50)
    ledger.acquire("s1", 50)
    assert PressureBook().plan(ledger, "b", need_bytes=GIB, now_s=0.0) == []


def test_three_floors_and_a_greedy_instance(inproc_factory):
    b = inproc_factory(total_bytes=80 * GIB)
    with b.admin() as admin:
        for name in ("model-a", "model-b", "model-c"):
            admin.limit(name, min_bytes=16 * GIB)
        admin.limit("greedy", max_bytes=24 * GIB)
    clients = {name: BrokerClient.connect(name, endpoint=b.endpoint, page_bytes=GIB, credit_pages=0)
               for name in ("greedy", "model-a", "model-b", "model-c")}
    try:
        assert clients["greedy"].acquire(80, min_pages=1) == 24  # capped
        for name in ("model-a", "model-b", "model-c"):
            assert clients[name].acquire(16) == 16  # floors always reachable
        assert clients["model-a"].acquire(100, min_pages=1) == 8  # the last of the budget
        s = b.status()
        by = {i["name"]: i for i in s["instances"]}
        assert by["greedy"]["granted_bytes"] == 24 * GIB and by["greedy"]["max_bytes"] == 24 * GIB
        assert all(by[n]["min_bytes"] == 16 * GIB for n in ("model-a", "model-b", "model-c"))
        assert {"fair_share_bytes", "pressure", "weight"} <= set(by["greedy"])
        assert s["free_bytes"] == 0
    finally:
        for c in clients.values():
            c.close()


def test_a_floor_set_after_others_hold_memory_is_kept_free_as_it_is_released(inproc_factory):
    b = inproc_factory(total_bytes=20 * GIB)
    with BrokerClient.connect("early", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as early:
        assert early.acquire(20) == 20
        with b.admin() as admin:
            admin.limit("late", min_bytes=8 * GIB)
        early.release(10)
        assert early.acquire(3) == 0  # the 10 free GiB are the late floor's first 8
        assert early.acquire(2) == 2


PRESSURED = r"""
import sys, threading
from kvcached_broker.client import BrokerClient
endpoint, pages = sys.argv[1], int(sys.argv[2])
c = BrokerClient.connect("idle-hoarder", endpoint=endpoint, page_bytes=1 << 30, credit_pages=0)
c.acquire(pages)
cached = [pages]       # pages it keeps as cache: it can free them when asked
def give_back(n):
    n = min(n, cached[0])
    if n:
        c.release(n)
        cached[0] -= n
    return n
c.on_pressure(give_back)
print("ready", flush=True)
threading.Event().wait()  # until the test kills it, however long the test takes
"""


def test_pressure_moves_memory_from_an_idle_instance_to_a_starved_one(broker_factory):
    b = broker_factory(simulate="40GiB", extra_args=["--headroom", "0"])
    idle = subprocess.Popen([sys.executable, "-c", PRESSURED, b.endpoint, "36"], stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout.readline().strip() == "ready"
        with BrokerClient.connect("starved", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as starved:
            assert starved.acquire(16) == 0  # refused: the idle instance holds 36 of 40 GiB
            t0 = time.monotonic()
            got = wait_for(lambda: starved.acquire(16), timeout_s=60, interval_s=0.05, what="memory under pressure")
            moved_s = time.monotonic() - t0
            assert got == 16
            idle_view = next(i for i in b.status()["instances"] if i["name"] == "idle-hoarder")
            assert idle_view["pressure"]["asks"] >= 1 and idle_view["pressure"]["returned_bytes"] >= 12 * GIB
            assert idle_view["granted_bytes"] <= 24 * GIB
            print(f"pressure moved memory in {moved_s * 1000:.0f} ms")
        assert "event=pressure for=starved" in b.log()
    finally:
        idle.kill()
        idle.wait()


def test_pressure_reads_the_device_so_memory_already_returned_is_not_asked_for_twice(inproc_factory, monkeypatch):
    """An instance that answered an ask unmapped that memory before it released the pages, but
    the broker's last device reading still has it (NVML is read every probe interval).
    Pressure reads the device before it plans, so the next refusal does not take the same
    memory from that instance again and push it below its share."""
    from kvcached_broker.broker import request_core

    monkeypatch.setattr(request_core, "PRESSURE_READ_S", 0.0)  # a reading for every plan here
    b = inproc_factory(total_bytes=100 * GIB, probe_interval_s=3600.0)  # and no timed readings
    idle = subprocess.Popen([sys.executable, "-c", PRESSURED, b.endpoint, "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout.readline().strip() == "ready"
        with b.admin() as admin:
            admin.simulate(process_bytes={idle.pid: 60 * GIB})  # what NVML measures it using

        def idle_view():
            return next(i for i in b.status()["instances"] if i["name"] == "idle-hoarder")

        with BrokerClient.connect("burst", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as burst:
            assert burst.acquire(45) == 0  # 40 free: the idle one, 10 above its share, is asked for 5
            wait_for(lambda: idle_view()["granted_bytes"] == 55 * GIB, what="the idle instance to give 5 back")
            b.probe.set_process_bytes({idle.pid: 55 * GIB})  # the device says so; the broker has not read it
            assert b.ledger.measured_bytes(idle_view()["sessions"][0]["id"]) == 60 * GIB
            assert burst.acquire(46) == 0  # refused on the old reading (40 free), twice in a row: 12 wanted
            wait_for(lambda: idle_view()["pressure"]["pending_bytes"] == 0, what="the second ask to be answered")
            assert idle_view()["pressure"]["asked_bytes"] == 10 * GIB  # 5, then the 5 it is still above its share
            assert idle_view()["granted_bytes"] == 50 * GIB  # at its share, never below it
            b.probe.set_process_bytes({idle.pid: 50 * GIB})
            assert wait_for(lambda: burst.acquire(46), what="the burst to get its memory") == 46
    finally:
        idle.kill()
        idle.wait()


def test_a_client_that_ignores_pressure_keeps_what_it_holds(inproc_factory):
    b = inproc_factory(total_bytes=10 * GIB)
    with BrokerClient.connect("deaf", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as deaf, \
            BrokerClient.connect("needy", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as needy:
        assert deaf.acquire(10) == 10
        assert needy.acquire(5) == 0
        # the push arrives; the deaf client has no callback and no reserve, so gives nothing back
        wait_for(lambda: deaf.pressure_log, timeout_s=60, what="the pressure push to reach the deaf client")
        assert deaf.pressure_log[0] == {"asked": 5, "from_reserve": 0, "from_runtime": 0}
        assert b.ledger.sessions[deaf.session_id].granted_pages == 10
        view = next(i for i in b.status()["instances"] if i["name"] == "deaf")
        assert view["pressure"]["pending_bytes"] == 5 * GIB


def test_hello_limits_are_a_request_that_admin_policy_clamps(inproc_factory):
    b = inproc_factory(total_bytes=10 * GIB)
    with b.admin() as admin:
        admin.limit("admin-set", max_bytes=GIB)
    with BrokerClient.connect("self-limited", endpoint=b.endpoint, credit_pages=0,
                              limits={"min_bytes": 50 * GIB, "weight": 3}) as c:
        inst = next(i for i in c.status()["instances"] if i["name"] == "self-limited")
        assert inst["min_bytes"] == 5 * GIB and inst["weight"] == 3.0  # floor cut to half the budget
    assert "self-limited" not in {i["name"] for i in b.status()["instances"]}  # its asked-for floor left with it
    with BrokerClient.connect("admin-set", endpoint=b.endpoint, credit_pages=0, limits={"max_bytes": 5 * GIB}) as c:
        inst = next(i for i in c.status()["instances"] if i["name"] == "admin-set")
        assert inst["max_bytes"] == GIB  # the admin's limit stands


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@example(specs=[(0, 1, 0.3125)], budget_gib=1)  # a float level one byte short, once
@given(st.lists(st.tuples(st.integers(0, 20), st.one_of(st.none(), st.integers(0, 40)), st.floats(0.1, 8.0)),
                min_size=1, max_size=6),
       st.integers(1, 100))
def test_fair_shares_fill_the_budget_by_weight_within_floors_and_caps(specs, budget_gib):
    ledger = Ledger(DeviceInfo(0, "SIM", "sim", True), total_bytes=budget_gib * GIB, headroom_bytes=0)
    for i, (floor, cap, weight) in enumerate(specs):
        floor_bytes = floor * GIB + 1  # a floor makes an instance take part before it registers
        cap_bytes = None if cap is None else max(cap * GIB, floor_bytes)
        ledger.restore_limits(f"i{i}", Limits(max_bytes=cap_bytes, min_bytes=floor_bytes, weight=weight))
    shares = fair_shares(ledger)
    limits = {f"i{i}": ledger.limits[f"i{i}"] for i in range(len(specs))}
    for name, share in shares.items():
        lim = limits[name]
        assert share >= lim.min_bytes - 1 and (lim.max_bytes is None or share <= lim.max_bytes)
    total = sum(shares.values())
    floors = sum(lim.min_bytes for lim in limits.values())
    capped = all(lim.max_bytes is not None for lim in limits.values())
    if floors >= ledger.budget_bytes:
        assert total == floors
    elif capped and sum(lim.max_bytes for lim in limits.values()) <= ledger.budget_bytes:
        assert total == sum(lim.max_bytes for lim in limits.values())
    else:  # the budget is filled, and instances between their floor and cap share it by weight
        assert abs(total - ledger.budget_bytes) <= len(shares) + 1
        free = [n for n, lim in limits.items()
                if lim.min_bytes + 1 < shares[n] and (lim.max_bytes is None or shares[n] < lim.max_bytes - 1)]
        ratios = [shares[n] / limits[n].weight for n in free]
        assert not ratios or max(ratios) - min(ratios) <= 2 * max(1.0, max(ratios) * 1e-9)
