"""The growth hold after damaged state (docs/reliability.md, "The state directory").

While the broker holds growth, nobody may add charge except to re-assert what it held: a
session opened by a resume hello whose record was lost may grow back by what that hello
claimed (capped by what the device measures its process using), a restored session adopts
its claims through admission at its resume and no more, and everyone else is refused
(``details.held``).  A client whose restored session's claims are refused books what the
broker charges, and says so in one error line.

The ledger alone; then the hellos' allowances through the request core, restored from damaged
state with a holder that has not come back (``Restored``, as a journal replay hands it over);
then real brokers and clients across a damaged restart.
"""

from __future__ import annotations

import logging
import os
import signal

from kvcached_broker.client.results import as_map
from kvcached_broker.broker.accounts import DeviceInfo
from kvcached_broker.broker.journal import Restored
from kvcached_broker.broker.ledger import Ledger
from kvcached_broker.broker.quotas import SessionQuotas
from kvcached_broker.broker.state_records import SessionRecord
from kvcached_broker.broker.tokens import SessionTokens, holder_of
from kvcached_broker.client import BrokerClient

from helpers import (GIB, CoreConnection, CoreSession, FakeProcesses, Worker, local_peer, make_core, restarted_core,
                     session_of)


# ----------------------------------------------------------------------- the ledger alone
def _held_ledger() -> Ledger:
    ledger = Ledger(DeviceInfo(0, "SIM-GPU-0", "sim", True), total_bytes=16 * GIB, headroom_bytes=0)
    ledger.hold_growth("damaged state")
    return ledger


def _open(ledger: Ledger, sid: str, **kw):
    return ledger.open_session(sid, instance=sid, pid=100 + len(ledger.sessions), pid_verified=True, tp_rank=0,
                               tp_size=1, page_bytes=GIB, now_s=0.0, **kw)


def test_an_allowance_is_used_up_by_reservations_and_pages_alike():
    ledger = _held_ledger()
    _open(ledger, "lost")
    assert ledger.allow_reassertion("lost", 3 * GIB) == 3 * GIB
    ledger.reserve("lost", {"weights": GIB})
    assert ledger.acquire("lost", 4, min_pages=1).pages == 2  # what is left of the allowance
    refused = ledger.acquire("lost", 1)
    assert refused.pages == 0 and refused.refusal.held
    ledger.release_growth()
    assert ledger.sessions["lost"].reassert_allowance_bytes == 0
    assert ledger.acquire("lost", 1).pages == 1  # the hold is over: admission as usual


def test_a_restored_session_is_not_exempt_from_the_hold_for_later_growth():
    ledger = _held_ledger()
    _open(ledger, "restored", granted_pages=2, restored=True)
    ledger.resume("restored", 1.0, holdings=None)
    refused = ledger.acquire("restored", 1)
    assert refused.pages == 0 and refused.refusal.held


def test_measured_usage_caps_the_allowance_and_is_never_held():
    ledger = _held_ledger()
    lost = _open(ledger, "lost")
    ledger.allow_reassertion("lost", 8 * GIB)
    ledger.observe_device(measured_by_pid={lost.pid: GIB})
    assert ledger.acquire("lost", 8, min_pages=1).pages == 1  # a process cannot hold more than it uses
    assert ledger.acquire("lost", 1).pages == 0
    other = _open(ledger, "other")  # no allowance, but measured usage it has not reported yet
    ledger.observe_device(measured_by_pid={lost.pid: GIB, other.pid: 2 * GIB})
    assert ledger.acquire("other", 3, min_pages=1).pages == 2  # adds no charge, so the hold does not stop it
    ledger.check_invariant()


# ------------------------------------------------------- the request core, growth held
HOLDER_PID = 4242
DAMAGE = {"damaged_records": 1, "damaged_bytes": 40, "torn_bytes": 0, "snapshot": None}
TORN = {"damaged_records": 0, "damaged_bytes": 0, "torn_bytes": 9, "snapshot": None}  # no whole record lost
#: The state directory's secret, as the restore hands it over: tokens it issued verify.
SECRET = bytes(range(32))


def _held_core(damage=DAMAGE, **kwargs):
    """A 16 GiB core restored from damaged state: the holder's latest record (6 pages) was the
    damaged one, so it comes back with none and, not having re-asserted, keeps growth held."""
    holder = SessionRecord(id="s-00000001", token="token-holder-0001", nonce="nonce-holder", instance="holder",
                           pid=HOLDER_PID, pid_verified=True, page_bytes=GIB, granted_pages=0)
    core = make_core(16 * GIB, quotas=SessionQuotas(lease_s=30.0), **kwargs)
    core.restore(Restored([holder], damage=damage, found_state=True, secret=SECRET), now=0.0)
    assert as_map(core.status(0.0))["broker"]["growth_held"]
    return core


def lost_token(session_id: str, pid: int | None = None, start_ticks: int = 1) -> str:
    """The token a broker with ``SECRET`` issued to process ``pid`` (this one) for a session whose
    record was then lost (``FakeProcesses`` says every process started at tick 1)."""
    return SessionTokens(SECRET).issue(session_id, holder_of(pid or os.getpid(), True, start_ticks, None))


def _resume_hello(core, nonce: str, instance: str, peer=None, resume: str | None = None, **holdings):
    """A hello naming a session the broker does not know (a made-up token unless ``resume``),
    claiming ``holdings``: (connection, token)."""
    conn = CoreConnection(core, peer)
    reply = conn.hello(nonce, instance=instance, page_bytes=GIB, resume=resume or "Z" * 32, holdings=holdings or None)
    assert reply["ok"] and reply["result"]["resumed"] is False
    return conn, reply["result"]["session"]


def _acquire(conn, token: str, request_id: int, pages: int, min_pages: int | None = None) -> dict:
    return conn.ask({"op": "acquire", "id": request_id, "session": token, "pages": pages,
                     "min_pages": pages if min_pages is None else min_pages})["result"]


def test_a_resume_for_a_lost_record_grows_back_only_what_it_claimed():
    core = _held_core()
    conn, token = _resume_hello(core, "empty-nonce-1", "empty", resume=lost_token("s-0000e0e0"))
    empty = _acquire(conn, token, 2, 16, min_pages=1)
    assert empty["granted"] == 0 and empty["refused"]["details"]["held"]  # it claimed nothing
    conn, token = _resume_hello(core, "claimer-nonce-1", "claimer", resume=lost_token("s-0000c1a1"), granted_pages=2)
    assert _acquire(conn, token, 2, 16, min_pages=1)["granted"] == 2
    assert _acquire(conn, token, 3, 1)["refused"]["details"]["held"]
    s = conn.status()
    assert s["granted_bytes"] == 2 * GIB and not s["overcommitted"]


def test_a_forged_resume_gets_no_allowance(caplog):
    """Issue 26, item 3: a process that was running before the restart, resuming with a made-up
    token, was given the whole budget to re-assert.  A token the broker cannot verify (not made
    with its secret for this process) earns nothing; nor does another process's token, nor a
    genuine one re-asserted a second time."""
    core = _held_core()
    with caplog.at_level(logging.INFO, logger="kvcached_broker"):
        forged, forged_token = _resume_hello(core, "forger-nonce-1", "forger", granted_pages=16)
        borrowed, borrowed_token = _resume_hello(core, "borrower-nonce-1", "borrower",
                                                 resume=lost_token("s-0000b0b0", pid=HOLDER_PID), granted_pages=16)
        genuine, genuine_token = _resume_hello(core, "genuine-nonce-1", "genuine",
                                               resume=lost_token("s-00006e00"), granted_pages=2)
        again, again_token = _resume_hello(core, "genuine-nonce-2", "genuine",
                                           resume=lost_token("s-00006e00"), granted_pages=2)
    for conn, token in ((forged, forged_token), (borrowed, borrowed_token), (again, again_token)):
        refused = _acquire(conn, token, 2, 16, min_pages=1)
        assert refused["granted"] == 0 and refused["refused"]["details"]["held"], refused
    assert _acquire(genuine, genuine_token, 2, 2)["granted"] == 2
    assert caplog.text.count("event=reassertion_refused") == 3
    assert "detail=the_token_was_not_issued_to_this_process_by_this_broker" in caplog.text
    assert "reasserted_already" in caplog.text
    assert forged.status()["granted_bytes"] == 2 * GIB


def test_a_token_of_a_session_this_broker_issued_earns_no_allowance():
    """A session opened during the hold is no lost record: closing it and resuming its token
    with claims gets nothing."""
    core = _held_core()
    conn = CoreConnection(core)
    opened = conn.hello("own-nonce-1", instance="own", page_bytes=GIB)["result"]
    assert conn.ask({"op": "close", "id": 2, "session": opened["session"]})["ok"]
    conn, token = _resume_hello(core, "own-nonce-2", "own", resume=opened["session"], granted_pages=4)
    assert _acquire(conn, token, 3, 4)["refused"]["details"]["held"]


def test_a_token_issued_before_a_restart_verifies_after_its_record_is_lost(tmp_path):
    """The secret lives in the state directory: a broker restarted from it verifies the tokens
    its predecessor issued, with no record of them."""
    state = tmp_path / "state"
    quotas = SessionQuotas(lease_s=30.0)
    core = restarted_core(state, 16 * GIB, quotas=quotas)
    owner = CoreSession(core, "owner", page_bytes=GIB)
    assert owner.acquire(4) == 4
    core.journal.commit(0.0)
    core.journal.store.close()  # SIGKILLed: nothing more is written
    journal = state / "gpu0.journal"
    data = bytearray(journal.read_bytes())
    data[12] ^= 0x01  # inside the session's own record: the broker loses it whole
    journal.write_bytes(bytes(data))
    core = restarted_core(state, 16 * GIB, quotas=quotas)
    assert not core.ledger.sessions and core.ledger.growth_hold is not None
    forger, forged_token = _resume_hello(core, "forger-nonce-9", "owner", granted_pages=4)
    assert _acquire(forger, forged_token, 2, 4)["refused"]["details"]["held"]
    back, token = _resume_hello(core, "owner-nonce-9", "owner", resume=owner.token, granted_pages=4)
    assert _acquire(back, token, 2, 4)["granted"] == 4


def test_a_process_started_after_the_broker_gets_no_allowance(caplog):
    """It cannot have held memory from the broker whose state was lost, whatever it claims."""
    processes = FakeProcesses()
    late = 5151
    processes.ticks[late] = 2  # started after the broker (tick 1)
    core = _held_core(processes=processes)
    with caplog.at_level(logging.INFO, logger="kvcached_broker"):
        conn, token = _resume_hello(core, "late-forger-nonce", "late", peer=local_peer(pid=late),
                                    resume=lost_token("s-0000a7e0", pid=late, start_ticks=2), granted_pages=16)
    result = _acquire(conn, token, 2, 16, min_pages=1)
    assert [result["granted"], bool(result.get("refused", {}).get("details", {}).get("held"))] == [0, True]
    assert "event=reassertion_refused" in caplog.text
    assert conn.status()["granted_bytes"] == 0


def test_measured_usage_caps_what_a_lost_record_may_grow_back():
    core = _held_core(is_admin=lambda peer: True)
    conn, token = _resume_hello(core, "claimer-nonce-2", "claimer", resume=lost_token("s-0000c1a2"), granted_pages=8)
    simulated = conn.ask({"op": "simulate", "id": 9, "process_bytes": {os.getpid(): GIB}})
    assert simulated["ok"], simulated  # the device sees this process using 1 GiB
    assert _acquire(conn, token, 2, 8, min_pages=1)["granted"] == 1
    assert _acquire(conn, token, 3, 1)["refused"]["details"]["held"]


def test_after_records_were_lost_a_reassertion_is_charged_even_where_restored_figures_over_charge():
    """A zero-filled journal leaves the snapshot's older figures: A restored with 8 pages it has
    since given back to 2, and B's record (8 pages) gone.  B re-asserts before A resumes: were
    its re-assertion admitted against A's stale 8 pages, 6 of B's pages would stay uncharged
    and, once A came back, free for a newcomer.  It is charged in full (overcommitted, said so
    in status) until A re-asserts its real 2 pages."""
    a = SessionRecord(id="s-0000000a", token="token-a-restored", nonce="nonce-a", instance="a",
                      pid=HOLDER_PID, pid_verified=True, page_bytes=GIB, granted_pages=8)
    core = make_core(10 * GIB, quotas=SessionQuotas(lease_s=30.0))
    core.restore(Restored([a], damage={**DAMAGE, "damaged_records": 0, "damaged_bytes": 4096}, found_state=True,
                          secret=SECRET), now=0.0)
    b, token = _resume_hello(core, "b-nonce-1", "b", resume=lost_token("s-0000000b"), granted_pages=8)
    assert _acquire(b, token, 2, 8, min_pages=0)["granted"] == 8
    s = b.status()
    assert s["granted_bytes"] == 16 * GIB and s["overcommitted"]  # honest: A's restored 8 are stale
    back = CoreConnection(core, local_peer(pid=HOLDER_PID))
    reply = back.hello("a-nonce-2", instance="a", page_bytes=GIB, resume="token-a-restored",
                       holdings={"pools": {}, "granted_pages": 2, "reserve_pages": 0})
    assert reply["result"]["claims"] == "adopted"
    s = b.status()
    assert s["granted_bytes"] == 10 * GIB and not s["overcommitted"]
    core.ledger.check_invariant()


# ------------------------------------------------------------------- real brokers
def _damaged_restart(b) -> None:
    """SIGKILL the broker, flip a bit in the journal's last record, start it again: growth is held."""
    b.kill()
    journal = b.state_dir / "gpu0.journal"
    data = bytearray(journal.read_bytes())
    data[-1] ^= 0x01
    journal.write_bytes(bytes(data))
    b.start()
    assert b.status()["broker"]["growth_held"]


def _stopped_holder(b, workers, pages: int) -> Worker:
    """A worker holding ``pages`` that cannot re-assert them (SIGSTOPped): the hold stays on."""
    w = Worker(b.endpoint, "holder", {}, pages=pages, page_bytes=GIB)
    workers.append(w)
    w.signal(signal.SIGSTOP)
    return w


def test_a_restored_session_does_not_grow_past_its_claims_while_growth_is_held(broker_factory, workers):
    b = broker_factory(simulate="16GiB", extra_args=["--headroom", "0"], lease_s=30.0)
    with BrokerClient.connect("restored", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0,
                              background=False) as c:
        assert c.acquire(2) == 2
        _stopped_holder(b, workers, pages=6)  # its record is the journal's last: the damaged one
        _damaged_restart(b)
        assert c.acquire(1) == 0  # resumes (its 2 pages adopted), then asks for more: held
        assert session_of(b.status(), c.session_id)["granted_pages"] == 2 == c.held_pages


def test_a_resume_whose_claims_are_refused_books_what_the_broker_charges(broker_factory, caplog):
    b = broker_factory(simulate="16GiB", extra_args=["--headroom", "0"], lease_s=30.0)
    with BrokerClient.connect("a", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0, background=False) as a:
        assert a.acquire(6) == 6
        _damaged_restart(b)  # its 6-page record is lost: it is restored with none
        with b.admin() as admin:
            admin.simulate(process_bytes={os.getpid(): GIB})  # it uses 1 GiB: it cannot hold 4 pages
        with caplog.at_level(logging.ERROR, logger="kvcached_broker.client"):
            a.release(2)  # resumes claiming 4 pages (the release booked): refused
        refused = [r.getMessage() for r in caplog.records if "event=resume_claims_refused" in r.getMessage()]
        assert len(refused) == 1 and f"short_bytes={4 * GIB}" in refused[0] and "uncharged_pages=4" in refused[0]
        assert a.held_pages == 4
        assert session_of(b.status(), a.session_id)["granted_pages"] == 0
        a.release(4)  # uncharged: they leave the books without a request the broker would refuse
        assert a.held_pages == 0
        assert session_of(b.status(), a.session_id)["granted_pages"] == 0


# ------------------------------------------- a restored session that never comes back
def test_a_restored_session_silent_past_its_lease_turns_stale_and_can_be_evicted(caplog):
    """docs/protocol.md §9: a restored session shows ``recovering`` until its worker resumes
    it, or ``stale`` once silent for ``lease_s`` since the restart; an operator waiting for
    ``stale`` then evicts it.  It stayed ``recovering`` forever before."""
    holder = SessionRecord(id="s-00000002", token="token-holder-0002", nonce="nonce-holder-2", instance="holder",
                           pid=HOLDER_PID, pid_verified=True, page_bytes=GIB, granted_pages=6)
    core = make_core(16 * GIB, quotas=SessionQuotas(lease_s=10.0), is_admin=lambda peer: True)
    core.restore(Restored([holder], found_state=True), now=100.0)

    def state(now: float) -> str:
        core.expire_leases(now)
        return session_of(as_map(core.status(now)), holder.id)["state"]

    assert state(105.0) == "recovering"
    with caplog.at_level(logging.WARNING, logger="kvcached_broker"):
        assert state(110.5) == "stale"
    assert "event=session_stale session=s-00000002" in caplog.text
    assert as_map(core.status(110.5))["granted_bytes"] == 6 * GIB  # stale stays charged
    admin = CoreConnection(core, now=110.5)
    evicted = admin.ask({"op": "evict", "id": 1, "session_id": holder.id})
    assert evicted["ok"], evicted
    assert as_map(core.status(110.5))["granted_bytes"] == 0


def test_a_stale_restored_session_keeps_growth_held_and_its_worker_can_still_resume():
    """Turning stale does not count as having re-asserted: the hold after a torn tail lasts
    until the worker resumes (or twice the lease), and the resume adopts its claims."""
    core = _held_core(TORN)  # lease 30 s; the holder restored with no pages at t=0
    core.expire_leases(31.0)
    assert session_of(as_map(core.status(31.0)), "s-00000001")["state"] == "stale"
    core.lift_growth_hold(31.0)
    assert as_map(core.status(31.0))["broker"]["growth_held"]
    conn = CoreConnection(core, local_peer(pid=HOLDER_PID), now=32.0)
    reply = conn.hello("nonce-holder-resume", instance="holder", page_bytes=GIB, resume="token-holder-0001",
                       holdings={"pools": {}, "granted_pages": 6, "reserve_pages": 0})
    assert reply["ok"] and reply["result"]["resumed"] and reply["result"]["claims"] == "adopted", reply
    assert session_of(as_map(core.status(32.0)), "s-00000001")["state"] == "live"
    core.lift_growth_hold(32.0)
    assert not as_map(core.status(32.0))["broker"]["growth_held"]  # nobody left to wait for


def test_the_hold_still_ends_after_twice_the_lease_when_the_stale_worker_never_returns():
    core = _held_core()
    core.expire_leases(31.0)
    core.lift_growth_hold(59.0)
    assert as_map(core.status(59.0))["broker"]["growth_held"]
    core.lift_growth_hold(60.0)
    assert not as_map(core.status(60.0))["broker"]["growth_held"]
