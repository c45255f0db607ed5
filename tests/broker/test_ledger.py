"""The ledger alone: examples, and a Hypothesis state machine that checks the invariant after every step."""

from __future__ import annotations

import copy
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvcached_broker.broker.accounts import Claim, DeviceInfo, SessionState
from kvcached_broker.broker.ledger import Ledger
from kvcached_broker.broker.refusal_errors import refusal_of
from kvcached_broker.client.errors import BadRequest, BudgetExceeded, LimitExceeded, StaleRevision

GIB = 1 << 30
MIB = 1 << 20
DEVICE = DeviceInfo(index=0, uuid="SIM-GPU-0", name="sim", simulated=True)


def new_ledger(total=80 * GIB, headroom=4 * GIB) -> Ledger:
    return Ledger(DEVICE, total_bytes=total, headroom_bytes=headroom)


def open_session(ledger, sid="s1", instance="a", pid=100, page_bytes=2 * MIB, **kw):
    return ledger.open_session(
        sid, instance=instance, pid=pid, pid_verified=True, tp_rank=0, tp_size=1, page_bytes=page_bytes, now_s=0.0, **kw
    )


def test_reserve_replaces_the_map_and_zero_removes_a_pool():
    ledger = new_ledger()
    open_session(ledger)
    assert ledger.reserve("s1", {"swa_kv_pool": 3 * GIB, "c4_kv_pool": GIB}) == {"swa_kv_pool": 3 * GIB, "c4_kv_pool": GIB}
    assert ledger.reserved_bytes == 4 * GIB
    assert ledger.reserve("s1", {"swa_kv_pool": 2 * GIB, "c4_kv_pool": 0}) == {"swa_kv_pool": 2 * GIB}
    assert ledger.reserved_bytes == 2 * GIB
    assert ledger.free_bytes == 76 * GIB - 2 * GIB


def test_refused_reservation_names_the_pool_and_changes_nothing():
    ledger = new_ledger()
    open_session(ledger)
    ledger.reserve("s1", {"weights": 70 * GIB})
    before = copy.deepcopy(ledger.sessions["s1"].pools)
    with pytest.raises(BudgetExceeded) as info:
        ledger.reserve("s1", {"weights": 70 * GIB, "c4_kv_pool": 7 * GIB})
    err = info.value
    assert err.code == "budget_exceeded"
    assert "c4_kv_pool" in err.message and "6.00 GiB free" in err.message
    assert err.details["pool"] == "c4_kv_pool"
    assert err.details["asked_bytes"] == 7 * GIB
    assert err.details["free_bytes"] == 6 * GIB
    assert ledger.sessions["s1"].pools == before
    assert ledger.reserved_bytes == 70 * GIB
    # the broker's own decisions read the refusal the error carries, typed, not the details it sends
    refusal = refusal_of(err)
    assert refusal is not None and (refusal.code, refusal.asked_bytes, refusal.free_bytes) == ("budget_exceeded", 7 * GIB, 6 * GIB)
    assert refusal.for_room and not refusal.held and refusal.details == err.details and refusal.message == err.message


def test_a_refusal_for_a_cap_or_a_recovery_hold_is_not_one_for_room():
    ledger = new_ledger()
    open_session(ledger)
    ledger.set_limits("a", max_bytes=GIB)
    with pytest.raises(LimitExceeded) as capped:
        ledger.reserve("s1", {"kv": 2 * GIB})
    refusal = refusal_of(capped.value)
    assert refusal is not None and refusal.code == capped.value.code == "limit_exceeded" and not refusal.for_room
    ledger.set_limits("a", max_bytes=None)
    ledger.hold_growth("the state was damaged")
    grant = ledger.acquire("s1", 1)
    assert grant.refusal is not None and grant.refusal.code == "budget_exceeded"
    assert grant.refusal.held and not grant.refusal.for_room and grant.refusal.details["held"]


def test_acquire_is_all_or_nothing_unless_min_pages():
    ledger = new_ledger(total=100 * MIB, headroom=0)
    open_session(ledger, page_bytes=10 * MIB)
    assert ledger.acquire("s1", 7).pages == 7
    refused = ledger.acquire("s1", 4)
    assert refused.pages == 0 and refused.refusal.code == "budget_exceeded"
    assert ledger.sessions["s1"].granted_pages == 7
    assert ledger.acquire("s1", 4, min_pages=2).pages == 3
    assert ledger.free_bytes == 0
    assert ledger.acquire("s1", 1, min_pages=0).pages == 0


def test_release_more_than_held_is_bad_request_and_changes_nothing():
    ledger = new_ledger()
    open_session(ledger)
    ledger.acquire("s1", 5)
    with pytest.raises(BadRequest):
        ledger.release("s1", 6)
    assert ledger.sessions["s1"].granted_pages == 5
    assert ledger.release("s1", 5) == 0


def test_cap_refuses_with_limit_exceeded():
    ledger = new_ledger()
    open_session(ledger, page_bytes=GIB)
    ledger.set_limits("a", max_bytes=3 * GIB)
    grant = ledger.acquire("s1", 4)
    assert grant.pages == 0 and grant.refusal.code == "limit_exceeded"
    assert ledger.acquire("s1", 4, min_pages=1).pages == 3
    with pytest.raises(LimitExceeded):
        ledger.reserve("s1", {"x": 1})


def test_limit_for_unregistered_instance_applies_when_it_arrives():
    ledger = new_ledger()
    ledger.set_limits("later", max_bytes=GIB)
    open_session(ledger, instance="later", page_bytes=GIB)
    assert ledger.acquire("s1", 2).pages == 0
    assert ledger.acquire("s1", 1).pages == 1


def test_limit_changes_are_validated_and_revisioned():
    ledger = new_ledger()
    with pytest.raises(LimitExceeded):
        ledger.set_limits("a", max_bytes=GIB, min_bytes=2 * GIB)
    assert ledger.set_limits("a", max_bytes=GIB).revision == 1
    with pytest.raises(StaleRevision):
        ledger.set_limits("a", max_bytes=2 * GIB, revision=0)
    assert ledger.set_limits("a", max_bytes=None, revision=1).max_bytes is None
    with pytest.raises(LimitExceeded):
        ledger.set_limits("b", min_bytes=77 * GIB)
    assert "b" not in ledger.limits


def test_floors_of_others_cannot_be_eaten():
    ledger = new_ledger(total=10 * GIB, headroom=0)
    ledger.set_limits("guaranteed", min_bytes=4 * GIB)
    open_session(ledger, sid="g", instance="guaranteed", pid=1, page_bytes=GIB)
    open_session(ledger, sid="x", instance="greedy", pid=2, page_bytes=GIB)
    assert ledger.acquire("x", 100, min_pages=1).pages == 6
    assert ledger.acquire("g", 4).pages == 4  # its floor was kept for it
    assert ledger.free_bytes == 0


def test_external_growth_overcommits_and_blocks_new_grants_only():
    ledger = new_ledger(total=10 * GIB, headroom=0)
    open_session(ledger, page_bytes=GIB)
    assert ledger.acquire("s1", 8).pages == 8
    ledger.observe_device(external_bytes=4 * GIB)
    assert ledger.overcommitted and ledger.free_bytes == 0
    grant = ledger.acquire("s1", 1)
    assert grant.pages == 0 and grant.refusal is not None and grant.refusal.code == "overcommitted"
    ledger.release("s1", 2)  # decreases are always allowed
    assert not ledger.overcommitted
    assert ledger.acquire("s1", 1).pages == 0  # exactly at budget
    ledger.observe_device(external_bytes=3 * GIB)
    assert ledger.acquire("s1", 1).pages == 1


def test_measured_usage_above_reported_is_charged_as_unreported():
    ledger = new_ledger(total=10 * GIB, headroom=0)
    open_session(ledger, page_bytes=GIB)
    ledger.acquire("s1", 2)
    ledger.observe_device(measured_by_pid={100: 5 * GIB})
    assert ledger.unreported_bytes == 3 * GIB
    assert ledger.free_bytes == 5 * GIB
    assert ledger.acquire("s1", 3).pages == 3  # inside what it already uses: no new charge
    assert ledger.unreported_bytes == 0 and ledger.free_bytes == 5 * GIB
    assert ledger.acquire("s1", 6).pages == 0


def test_stale_sessions_stay_charged_and_revive():
    ledger = new_ledger()
    open_session(ledger)
    ledger.acquire("s1", 10)
    assert [s.id for s in ledger.expire_leases(now_s=11.0, lease_s=10.0)] == ["s1"]
    assert ledger.sessions["s1"].state is SessionState.STALE
    assert ledger.granted_bytes == 10 * 2 * MIB
    assert ledger.touch("s1", 12.0) is True
    assert ledger.sessions["s1"].state is SessionState.LIVE


def test_resume_adopts_reasserted_holdings_only_for_restored_sessions():
    ledger = new_ledger()
    open_session(ledger, granted_pages=10, state=SessionState.RECOVERING, restored=True)
    ledger.resume("s1", 1.0, holdings=Claim({"swa_kv_pool": GIB}, 6, 2))
    s = ledger.sessions["s1"]
    assert (s.pools, s.granted_pages, s.reserve_pages, s.state) == ({"swa_kv_pool": GIB}, 6, 2, SessionState.LIVE)
    ledger.resume("s1", 2.0, holdings=Claim({}, 0, 0))  # no longer restored: the broker's figures stand
    assert ledger.sessions["s1"].granted_pages == 6


# --------------------------------------------------------------------------- state machine
POOL_NAMES = ["swa_kv_pool", "c4_kv_pool", "c128_kv_pool", "weights"]
HOLD_NAMES = ["kv_sizing_hold", "draft_hold"]
SIZES = st.integers(min_value=0, max_value=12 * GIB)


class LedgerMachine(RuleBasedStateMachine):
    """Random sequences of every ledger operation; after each: totals recomputed from scratch
    agree, charges never exceed the budget after a grant, refusals change nothing."""

    sessions = Bundle("sessions")

    def __init__(self):
        super().__init__()
        self.ledger = Ledger(DEVICE, total_bytes=64 * GIB, headroom_bytes=GIB)
        self.counter = 0
        self.now = 0.0
        self.measured_by_pid: dict[int, int] = {}

    def _snapshot(self):
        return {
            sid: (dict(s.pools), dict(s.holds), s.granted_pages, s.reserve_pages, s.unmapped_pages)
            for sid, s in self.ledger.sessions.items()
        }, self.ledger.charged_bytes

    def _assert_admitted(self, instance, charged_before, instance_before):
        """After a grant: within budget and cap, and other instances' floors kept free.

        A grant inside memory its process is already measured to use adds no charge, so it
        is checked only when charges actually grew."""
        led = self.ledger
        assert led.charged_bytes <= led.budget_bytes
        others = sum(led.unfilled_floor_bytes(n) for n in set(led.limits) if n != instance)
        if led.charged_bytes > charged_before:
            assert led.charged_bytes + others <= led.budget_bytes
        cap = led.limits.get(instance)
        if cap is not None and cap.max_bytes is not None and led.instance_charge_bytes(instance) > instance_before:
            assert led.instance_charge_bytes(instance) <= cap.max_bytes

    @rule(
        target=sessions,
        instance=st.sampled_from(["a", "b", "c"]),
        pid=st.integers(min_value=1, max_value=4),
        page_bytes=st.sampled_from([MIB, 2 * MIB, 3 * MIB, 256 * MIB]),
        verified=st.booleans(),
        report_mapping=st.booleans(),
    )
    def open(self, instance, pid, page_bytes, verified, report_mapping):
        self.counter += 1
        sid = f"s{self.counter}"
        self.ledger.open_session(
            sid, instance=instance, pid=pid, pid_verified=verified, tp_rank=0, tp_size=1,
            page_bytes=page_bytes, now_s=self.now, report_mapping=report_mapping,
        )
        return sid

    @rule(
        sid=sessions,
        pools=st.dictionaries(st.sampled_from(POOL_NAMES), SIZES, max_size=4),
        holds=st.one_of(st.none(), st.dictionaries(st.sampled_from(HOLD_NAMES), SIZES, max_size=2)),
        measured_base=st.booleans(),
        least=st.one_of(st.none(), st.floats(min_value=0.0, max_value=1.0)),
    )
    def reserve(self, sid, pools, holds, measured_base, least):
        if sid not in self.ledger.sessions:
            return
        before = self._snapshot()
        session = self.ledger.sessions[sid]
        instance = session.instance
        charged, inst_charge = self.ledger.charged_bytes, self.ledger.instance_charge_bytes(instance)
        flexible = sorted(holds)[0] if least is not None and holds else None
        min_holds = {flexible: int(holds[flexible] * least)} if flexible else None
        try:
            self.ledger.reserve(sid, pools, holds=holds, measured_base=measured_base, min_holds=min_holds)
        except BudgetExceeded:
            assert self._snapshot() == before
            return
        expected = {k: v for k, v in pools.items() if v and k != "runtime_base"}
        assert {k: v for k, v in session.pools.items() if k != "runtime_base"} == expected
        if flexible:  # the one hold that may shrink: between what was asked and the least of it
            assert min_holds[flexible] <= session.holds.get(flexible, 0) <= holds[flexible]
            assert {k: v for k, v in session.holds.items() if k != flexible} == {
                k: v for k, v in holds.items() if v and k != flexible}
        elif holds is not None:
            assert session.holds == {k: v for k, v in holds.items() if v}
        if self.ledger.charged_bytes > charged or self.ledger.instance_charge_bytes(instance) > inst_charge:
            self._assert_admitted(instance, charged, inst_charge)  # charges_follow_the_model: holds in full

    @rule(sid=sessions, pages=st.integers(min_value=1, max_value=20_000), partial=st.booleans(), mapped=st.booleans(),
          data=st.data())
    def acquire(self, sid, pages, partial, mapped, data):
        if sid not in self.ledger.sessions:
            return
        min_pages = data.draw(st.integers(min_value=0, max_value=pages)) if partial else None
        before = self._snapshot()
        held = self.ledger.sessions[sid].granted_pages
        instance = self.ledger.sessions[sid].instance
        charged, inst_charge = self.ledger.charged_bytes, self.ledger.instance_charge_bytes(instance)
        grant = self.ledger.acquire(sid, pages, min_pages, mapped)
        if grant.pages == 0:
            assert grant.refusal is not None
            assert self._snapshot() == before
        else:
            assert (min_pages if min_pages is not None else pages) <= grant.pages <= pages
            assert self.ledger.sessions[sid].granted_pages == held + grant.pages
            self._assert_admitted(instance, charged, inst_charge)

    @rule(sid=sessions, pages=st.integers(min_value=1, max_value=20_000),
          mapped=st.one_of(st.none(), st.floats(min_value=0.0, max_value=1.2)))
    def release(self, sid, pages, mapped):
        if sid not in self.ledger.sessions:
            return
        session = self.ledger.sessions[sid]
        held = session.granted_pages
        mapped_pages = None if mapped is None else int(max(0, held - pages) * mapped)
        before = self._snapshot()
        refused = pages > held or (mapped_pages is not None and (not session.report_mapping or mapped_pages > held - pages))
        if refused:
            with pytest.raises(BadRequest):
                self.ledger.release(sid, pages, mapped_pages)
            assert self._snapshot() == before
            return
        charged = self.ledger.charged_bytes
        mapped_before = session.mapped_pages
        assert self.ledger.release(sid, pages, mapped_pages) == held - pages
        if mapped_pages is None:  # the unmapped pages go first: what was mapped stays resident
            assert session.mapped_pages == min(mapped_before, held - pages)
        if mapped_pages is None or mapped_pages >= mapped_before:
            assert self.ledger.charged_bytes <= charged  # giving back never charges more

    @rule(sid=sessions, mapped=st.floats(min_value=0.0, max_value=1.2))
    def mapped(self, sid, mapped):
        if sid not in self.ledger.sessions:
            return
        session = self.ledger.sessions[sid]
        mapped_pages = int(session.granted_pages * mapped)
        before = self._snapshot()
        if not session.report_mapping or mapped_pages > session.granted_pages:
            with pytest.raises(BadRequest):
                self.ledger.set_mapped(sid, mapped_pages)
            assert self._snapshot() == before
            return
        charged, mapped_before = self.ledger.charged_bytes, session.mapped_pages
        assert self.ledger.set_mapped(sid, mapped_pages) == session.granted_pages - mapped_pages
        if mapped_pages >= mapped_before:
            assert self.ledger.charged_bytes <= charged  # mapping a promised page never adds charge

    @rule(sid=consumes(sessions))
    def close(self, sid):
        if sid in self.ledger.sessions:
            self.ledger.close_session(sid)

    @rule(
        instance=st.sampled_from(["a", "b", "c", "d"]),
        max_bytes=st.one_of(st.none(), SIZES),
        min_bytes=st.integers(min_value=0, max_value=30 * GIB),
    )
    def limits(self, instance, max_bytes, min_bytes):
        before = dict(self.ledger.limits)
        try:
            self.ledger.set_limits(instance, max_bytes=max_bytes, min_bytes=min_bytes)
        except LimitExceeded:
            assert self.ledger.limits == before
            return
        floors = sum(lim.min_bytes for lim in self.ledger.limits.values())
        assert floors <= self.ledger.budget_bytes

    @rule(external=st.integers(min_value=0, max_value=70 * GIB))
    def external(self, external):
        self.ledger.observe_device(external_bytes=external)

    @rule(measured=st.dictionaries(st.integers(min_value=1, max_value=4), SIZES, max_size=4))
    def measured(self, measured):
        self.measured_by_pid = dict(measured)
        self.ledger.observe_device(measured_by_pid=measured)

    @rule(sid=sessions, reserve=st.integers(min_value=0, max_value=50))
    def reserve_pages(self, sid, reserve):
        if sid in self.ledger.sessions:
            self.ledger.set_reserve_pages(sid, reserve)

    @rule(dt=st.floats(min_value=0.0, max_value=20.0))
    def tick(self, dt):
        self.now += dt
        for session in self.ledger.expire_leases(self.now, 10.0):
            assert session.state is SessionState.STALE

    @invariant()
    def charges_follow_the_model(self):
        """charge(process) = max(measured, pools + mapped pages) + holds + unmapped pages,
        recomputed from the sessions."""
        led = self.ledger
        accounts: dict[object, list] = {}
        for s in led.sessions.values():
            accounts.setdefault(s.pid if s.pid_verified else s.id, []).append(s)
        charged = 0
        for key, members in accounts.items():
            measured = self.measured_by_pid.get(key, 0) if isinstance(key, int) else 0
            mapped = [s.granted_pages - s.unmapped_pages if s.report_mapping else s.granted_pages for s in members]
            resident = sum(sum(s.pools.values()) + m * s.page_bytes for s, m in zip(members, mapped))
            promised = sum(sum(s.holds.values()) + (s.granted_pages - m) * s.page_bytes for s, m in zip(members, mapped))
            charged += max(measured, resident) + promised
        assert led.charged_bytes == charged

    @invariant()
    def totals_agree(self):
        self.ledger.check_invariant()
        led = self.ledger
        assert led.free_bytes == max(0, led.budget_bytes - led.reserved_bytes - led.granted_bytes - led.unreported_bytes)
        assert led.overcommitted == (led.charged_bytes > led.budget_bytes)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(
    max_examples=int(os.environ.get("LEDGER_EXAMPLES", "150")), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _colocated(measured_weights=30 * GIB):
    """80 GiB, no headroom, two processes that each loaded 30 GiB of weights (as NVML shows)."""
    ledger = new_ledger(total=80 * GIB, headroom=0)
    open_session(ledger, "a", instance="a", pid=101)
    open_session(ledger, "b", instance="b", pid=102)
    ledger.observe_device(measured_by_pid={101: measured_weights, 102: measured_weights})
    return ledger


def test_a_hold_is_never_absorbed_by_what_the_process_already_uses():
    """The issue's example: with 30 GiB of weights in each of two processes, A holds 20 GiB
    and nothing is left for B's hold; nothing can overbook once both allocate."""
    ledger = _colocated()
    assert ledger.free_bytes == 20 * GIB
    ledger.reserve("a", {}, holds={"kv_sizing_hold": 20 * GIB}, measured_base=True)
    assert ledger.free_bytes == 0 and ledger.sessions["a"].pools == {"runtime_base": 30 * GIB}
    with pytest.raises(BudgetExceeded) as info:
        ledger.reserve("b", {}, holds={"kv_sizing_hold": 20 * GIB}, measured_base=True)
    assert info.value.details["pool"] == "kv_sizing_hold" and info.value.details["free_bytes"] == 0
    assert ledger.charged_bytes == 80 * GIB and not ledger.overcommitted


def test_a_hold_turns_into_its_pools_in_one_call_without_a_dip():
    ledger = _colocated()
    ledger.reserve("a", {}, holds={"kv_sizing_hold": 20 * GIB}, measured_base=True)
    # one call: the pools appear as the hold goes; the device has not measured them yet
    ledger.reserve("a", {"runtime_base": 30 * GIB, "kv_static": 18 * GIB, "draft_kv": 2 * GIB}, holds={})
    assert ledger.charged_bytes == 80 * GIB  # 30 measured for b, 30 + 20 reported for a
    ledger.observe_device(measured_by_pid={101: 50 * GIB + 512 * MIB, 102: 30 * GIB})  # allocated, plus activations
    assert ledger.unreported_bytes == 30 * GIB + 512 * MIB and ledger.overcommitted  # b's 30 and a's 512 MiB
    ledger.observe_device(measured_by_pid={101: 50 * GIB, 102: 30 * GIB})
    assert ledger.charged_bytes == 80 * GIB and not ledger.overcommitted


def test_without_a_pinned_base_the_pools_dip_inside_the_measured_weights():
    """Why ``measured_base``: measured usage covers resident pools, and lags their allocation."""
    ledger = _colocated()
    ledger.reserve("a", {}, holds={"kv_sizing_hold": 20 * GIB})
    assert ledger.free_bytes == 0  # the hold alone is charged on top
    ledger.reserve("a", {"kv_static": 20 * GIB}, holds={})
    assert ledger.free_bytes == 20 * GIB  # until the device measures the new 20 GiB


def test_measured_base_counts_only_what_the_process_does_not_report():
    ledger = _colocated()
    ledger.reserve("a", {"weights": 25 * GIB}, measured_base=True)
    assert ledger.sessions["a"].pools == {"weights": 25 * GIB, "runtime_base": 5 * GIB}
    ledger.observe_device(measured_by_pid={101: 20 * GIB, 102: 30 * GIB})
    ledger.reserve("a", {"weights": 25 * GIB}, measured_base=True)
    assert ledger.sessions["a"].pools == {"weights": 25 * GIB}  # nothing beyond its reports


def test_a_pool_cannot_be_both_reserved_and_held():
    ledger = _colocated()
    with pytest.raises(BadRequest, match="both"):
        ledger.reserve("a", {"kv": GIB}, holds={"kv": GIB})


def test_grantable_bytes_is_the_room_after_other_floors_and_within_the_cap():
    ledger = new_ledger(total=80 * GIB, headroom=0)
    open_session(ledger, "a", instance="a", pid=101)
    open_session(ledger, "b", instance="b", pid=102)
    ledger.set_limits("b", min_bytes=20 * GIB)
    ledger.reserve("a", {"weights": 30 * GIB})
    assert ledger.grantable_bytes("a") == 30 * GIB  # 50 free, 20 of them b's floor
    assert ledger.grantable_bytes("b") == 50 * GIB
    ledger.set_limits("a", max_bytes=40 * GIB)
    assert ledger.grantable_bytes("a") == 10 * GIB
    with pytest.raises(LimitExceeded):
        ledger.reserve("a", {"weights": 30 * GIB + 10 * GIB + 1})
    ledger.reserve("a", {"weights": 40 * GIB})  # exactly what it said
    assert ledger.grantable_bytes("a") == 0
    ledger.observe_device(external_bytes=50 * GIB)
    assert ledger.overcommitted and ledger.grantable_bytes("b") == 0


# ------------------------------------------------------------- pages that report mapping
def _mapping(total=4 * GIB):
    """A kvcached-mode process ``a`` (it reports which pages it mapped) and a neighbour ``b``."""
    ledger = new_ledger(total=total, headroom=0)
    open_session(ledger, "a", instance="a", pid=101, report_mapping=True)
    open_session(ledger, "b", instance="b", pid=102)
    ledger.observe_device(measured_by_pid={101: GIB})  # a's weights and context
    ledger.reserve("a", {}, measured_base=True)
    return ledger


def test_what_a_process_allocates_after_its_base_pin_never_hides_in_pages_it_has_not_mapped():
    """The whole-footprint issue's kvcached case: before, a 384 MiB allocation outside the pool
    vanished inside granted but unmapped pages, and the neighbour was granted memory that was
    physically taken."""
    ledger = _mapping()
    assert ledger.acquire("a", 512).pages == 512  # 1 GiB of 2 MiB pages, none mapped yet
    ledger.set_mapped("a", 296)
    ledger.observe_device(measured_by_pid={101: GIB + 296 * 2 * MIB + 384 * MIB})  # mapped, plus graphs
    free_before = ledger.free_bytes
    assert free_before == 4 * GIB - (GIB + 512 * 2 * MIB + 384 * MIB)  # every byte taken or promised
    assert ledger.acquire("b", free_before // (2 * MIB) + 1).pages == 0
    assert ledger.acquire("b", free_before // (2 * MIB)).pages == free_before // (2 * MIB)
    assert ledger.free_bytes == 0 and not ledger.overcommitted


def test_without_reporting_mapping_the_same_allocation_hides_inside_the_grant():
    """Why ``report_mapping``: a granted page counts as mapped, so measured usage covers it."""
    ledger = new_ledger(total=4 * GIB, headroom=0)
    open_session(ledger, "a", instance="a", pid=101)
    ledger.observe_device(measured_by_pid={101: GIB})
    ledger.reserve("a", {}, measured_base=True)
    ledger.acquire("a", 512)
    ledger.observe_device(measured_by_pid={101: GIB + 296 * 2 * MIB + 384 * MIB})
    assert ledger.free_bytes == 2 * GIB  # the 384 MiB is nowhere in the charge


def test_mapping_pages_moves_them_from_promised_to_resident_with_no_dip():
    ledger = _mapping()
    ledger.acquire("a", 100)
    charged = ledger.charged_bytes
    assert ledger.set_mapped("a", 60) == 40  # the device has not measured them yet
    assert ledger.charged_bytes == charged
    ledger.observe_device(measured_by_pid={101: GIB + 60 * 2 * MIB})
    assert ledger.charged_bytes == charged and ledger.unreported_bytes == 0
    assert ledger.sessions["a"].mapped_pages == 60


def test_a_release_gives_back_unmapped_pages_first_unless_it_says_what_stays_mapped():
    ledger = _mapping()
    ledger.acquire("a", 100)
    ledger.set_mapped("a", 60)
    ledger.release("a", 30)  # the 40 unmapped pages go first
    assert ledger.sessions["a"].unmapped_pages == 10 and ledger.sessions["a"].mapped_pages == 60
    ledger.release("a", 20, mapped_pages=40)  # unmapped 20 of them and gave those back
    assert ledger.sessions["a"].granted_pages == 50 and ledger.sessions["a"].unmapped_pages == 10
    ledger.check_invariant()


def test_mapped_counts_are_checked_and_a_bad_one_changes_nothing():
    ledger = _mapping()
    ledger.acquire("a", 10)
    ledger.acquire("b", 10)
    before = (ledger.charged_bytes, ledger.sessions["a"].unmapped_pages)
    with pytest.raises(BadRequest, match="between 0 and the 10"):
        ledger.set_mapped("a", 11)
    with pytest.raises(BadRequest, match="between 0 and the 5"):
        ledger.release("a", 5, mapped_pages=6)
    with pytest.raises(BadRequest, match="does not report mapping"):
        ledger.set_mapped("b", 5)
    with pytest.raises(BadRequest, match="does not report mapping"):
        ledger.release("b", 5, mapped_pages=5)
    assert (ledger.charged_bytes, ledger.sessions["a"].unmapped_pages) == before
    assert ledger.sessions["a"].granted_pages == 10 and ledger.sessions["b"].granted_pages == 10


def test_unmapped_pages_are_never_covered_by_usage_the_device_already_measures():
    ledger = _mapping()
    ledger.observe_device(measured_by_pid={101: 3 * GIB})  # 2 GiB above what a reports
    assert ledger.unreported_bytes == 2 * GIB and ledger.free_bytes == GIB
    assert ledger.acquire("a", 513).pages == 0  # a resident growth could use that; a promise cannot
    assert ledger.acquire("a", 512).pages == 512 and ledger.free_bytes == 0


def test_pages_asked_for_as_mapped_already_are_covered_by_what_the_device_measures():
    """A worker re-asserting pages to a broker that lost its session: the pages it has mapped
    are in the device's measurement already, so they are resident, as any resident growth."""
    ledger = _mapping()
    ledger.observe_device(measured_by_pid={101: 3 * GIB})  # 2 GiB of pages mapped before the loss
    assert ledger.acquire("a", 1024).pages == 0  # as promised pages they would not fit
    assert ledger.acquire("a", 1024, mapped=True).pages == 1024
    assert ledger.sessions["a"].unmapped_pages == 0 and ledger.free_bytes == GIB


def test_a_resumed_claim_restores_which_pages_were_mapped():
    ledger = new_ledger(total=8 * GIB, headroom=0)
    open_session(ledger, "a", instance="a", pid=101, report_mapping=True, granted_pages=100, unmapped_pages=100,
                 restored=True, state=SessionState.RECOVERING)
    session, adopted = ledger.resume("a", 1.0, holdings=Claim({}, 100, 0, {}, mapped_pages=70))
    assert adopted and session.unmapped_pages == 30 and session.mapped_pages == 70
    ledger.check_invariant()


# ------------------------------------------------------------- a hold that fits
def test_a_hold_with_a_least_size_shrinks_to_the_largest_that_fits():
    ledger = _colocated()  # 20 GiB free
    ledger.reserve("a", {}, holds={"runtime_slack_hold": 4 * GIB, "kv_sizing_hold": 30 * GIB},
                   min_holds={"kv_sizing_hold": GIB}, measured_base=True)
    assert ledger.sessions["a"].holds == {"runtime_slack_hold": 4 * GIB, "kv_sizing_hold": 16 * GIB}
    assert ledger.free_bytes == 0


def test_a_hold_whose_least_does_not_fit_is_refused_and_changes_nothing():
    ledger = _colocated()
    ledger.set_limits("a", max_bytes=40 * GIB)
    with pytest.raises(LimitExceeded):  # 30 weights + 4 slack leave 6 under the cap, not 8
        ledger.reserve("a", {}, holds={"runtime_slack_hold": 4 * GIB, "kv_sizing_hold": 16 * GIB},
                       min_holds={"kv_sizing_hold": 8 * GIB}, measured_base=True)
    assert ledger.sessions["a"].holds == {} and ledger.free_bytes == 20 * GIB
    ledger.reserve("a", {}, holds={"runtime_slack_hold": 4 * GIB, "kv_sizing_hold": 16 * GIB},
                   min_holds={"kv_sizing_hold": GIB}, measured_base=True)
    assert ledger.sessions["a"].holds["kv_sizing_hold"] == 6 * GIB  # the cap binds, not the device


@pytest.mark.parametrize("min_holds, match", [
    ({"kv_sizing_hold": GIB, "runtime_slack_hold": GIB}, "one hold"),
    ({"other": GIB}, "does not hold"),
    ({"kv_sizing_hold": 3 * GIB}, "between 0 and the hold"),
])
def test_min_holds_are_checked(min_holds, match):
    ledger = _colocated()
    with pytest.raises(BadRequest, match=match):
        ledger.reserve("a", {}, holds={"kv_sizing_hold": 2 * GIB, "runtime_slack_hold": GIB}, min_holds=min_holds)
    assert ledger.sessions["a"].holds == {}


def test_a_refusal_names_the_ask_the_room_and_who_holds_the_rest_without_contradicting_itself():
    ledger = _colocated()
    ledger.reserve("b", {}, holds={"kv_sizing_hold": 20 * GIB - 13_108})
    with pytest.raises(BudgetExceeded) as info:
        ledger.reserve("a", {}, holds={"kv_sizing_hold": 13_108 + 1})
    message = info.value.message
    assert "asked 13,109 B, 13,108 B free" in message and "held by b 50.00 GiB" in message
    assert info.value.details["holders"] == [{"instance": "b", "charged_bytes": 50 * GIB - 13_108}]


def test_a_cap_refusal_says_the_ask_and_the_room_without_contradicting_itself():
    ledger = _colocated()
    ledger.set_limits("a", max_bytes=32 * GIB)  # a is charged 30: its cap leaves 2 GiB
    with pytest.raises(LimitExceeded) as info:
        ledger.reserve("a", {}, holds={"kv_sizing_hold": 2 * GIB + 13 * 1024})
    message = info.value.message
    assert "asked 2,147,496,960 B, its cap of 32.00 GiB leaves 2,147,483,648 B" in message, message
    assert info.value.details["asked_bytes"] == 2 * GIB + 13 * 1024 and "starting" in info.value.details
    assert ledger.sessions["a"].holds == {}


def test_a_refusal_names_the_start_ups_in_progress_that_hold_memory():
    ledger = _colocated()
    ledger.reserve("b", {}, holds={"kv_sizing_hold": 20 * GIB})
    with pytest.raises(BudgetExceeded) as info:
        ledger.reserve("a", {}, holds={"runtime_slack_hold": GIB})
    assert info.value.details["starting"] == [{"instance": "b", "held_bytes": 20 * GIB}]
    assert info.value.message.endswith("; start-ups in progress hold 20.00 GiB (b)")


def test_ever_bytes_is_what_the_instance_could_have_once_the_others_are_at_their_floors():
    ledger = _colocated()
    ledger.set_limits("b", min_bytes=35 * GIB)
    assert ledger.ever_bytes("a") == 80 * GIB - 35 * GIB - 30 * GIB
    ledger.set_limits("a", max_bytes=32 * GIB)
    assert ledger.ever_bytes("a") == 2 * GIB
