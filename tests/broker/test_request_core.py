"""The request core alone (no sockets, files or processes): bytes and a clock value in, bytes out."""

from __future__ import annotations

import msgspec
import pytest

from kvcached_broker.broker.journal import Restored
from kvcached_broker.broker.accounts import SessionState
from kvcached_broker.broker.security import Peer
from kvcached_broker.broker.state_records import SessionRecord
from kvcached_broker.client import protocol as proto

from helpers import GIB, FakeProcesses, make_core

PID = 4242
PEER = Peer(uid=1000, gid=1000, pid=PID, address="localhost:1000:1000:4242")


def ask(core, message, now=0.0, rid=b"r1", peer=PEER):
    return msgspec.msgpack.decode(core.handle(rid, peer, proto.encode(message), now))


def hello(request_id=1, nonce="nonce-0001", **kw):
    return proto.Hello(id=request_id, versions=[1], instance="m", pid=PID, page_bytes=GIB, nonce=nonce, **kw)


def test_a_resent_resume_hello_is_answered_as_a_resume():
    core = make_core(8 * GIB)
    token = ask(core, hello())["result"]["session"]
    first = ask(core, hello(2, nonce="nonce-0002", resume=token), rid=b"r2")
    again = ask(core, hello(2, nonce="nonce-0002", resume=token), rid=b"r3")  # its first reply was lost
    assert first["result"]["resumed"] is True and again["result"]["resumed"] is True
    assert again["result"]["session"] == token


def test_tp_rank_must_be_below_tp_size():
    core = make_core()
    reply = ask(core, hello(tp_rank=2, tp_size=2))
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request" and "tp_rank" in reply["error"]["message"]
    assert not core.ledger.sessions


def test_a_cached_reply_renews_the_lease():
    core = make_core()
    token = ask(core, hello())["result"]["session"]
    acquire = proto.Acquire(id=5, session=token, pages=1)
    ask(core, acquire, now=1.0)
    (session,) = core.ledger.sessions.values()
    ask(core, acquire, now=9.0)  # a retry, answered from the cache
    assert session.last_seen_s == 9.0 and session.granted_pages == 1
    core.expire_leases(15.0)  # 6 s since the retry, within the 10 s lease
    assert session.state is SessionState.LIVE


def _record(session_id="s-00000001", token="token-000000001", pages=3):
    return SessionRecord(id=session_id, token=token, nonce="nonce-restored", instance="m", pid=PID,
                         pid_verified=True, page_bytes=GIB, granted_pages=pages)


def test_a_restored_session_turns_stale_past_its_lease_and_holds_growth_until_twice_it():
    core = make_core(8 * GIB, processes=FakeProcesses())
    core.restore(Restored([_record()], damage={"damaged_records": 1, "damaged_bytes": 40, "torn_bytes": 0,
                                                 "snapshot": None}, found_state=True), now=0.0)
    assert core.ledger.growth_hold is not None
    core.expire_leases(11.0)  # a lease has passed without a word from its worker
    (session,) = core.ledger.sessions.values()
    assert session.state is SessionState.STALE and session.restored  # evictable, still awaited
    core.lift_growth_hold(11.0)
    assert core.ledger.growth_hold is not None  # its worker has not re-asserted, and not yet twice the lease
    core.lift_growth_hold(20.5)
    assert core.ledger.growth_hold is None


TORN = {"damaged_records": 0, "damaged_bytes": 0, "torn_bytes": 7, "snapshot": None}


def test_a_restored_session_whose_worker_is_back_lifts_the_hold_after_a_torn_tail():
    """A torn tail took nothing answered: once the restored sessions' workers are back, all
    of what anyone holds is known again."""
    core = make_core(8 * GIB)
    core.restore(Restored([_record()], damage=TORN, found_state=True), now=0.0)
    neighbour = Peer(1000, 1000, PID + 1, "localhost:1000:1000:4243")
    other = ask(core, proto.Hello(id=1, versions=[1], instance="n", pid=PID + 1, page_bytes=GIB, nonce="nonce-other"),
                rid=b"o", peer=neighbour)["result"]["session"]
    held = ask(core, proto.Acquire(id=2, session=other, pages=1), rid=b"o", peer=neighbour)
    assert held["result"]["granted"] == 0 and held["result"]["refused"]["details"]["held"]
    back = ask(core, hello(3, nonce="nonce-back", resume="token-000000001",
                           holdings=proto.Holdings(granted_pages=5)), rid=b"b")
    assert back["result"]["resumed"] and back["result"]["holdings"]["granted_pages"] == 5  # re-asserted, through admission
    core.lift_growth_hold(1.0)
    assert core.ledger.growth_hold is None


@pytest.mark.parametrize("damage", [
    {"damaged_records": 1, "damaged_bytes": 40, "torn_bytes": 0, "snapshot": None},
    {"damaged_records": 0, "damaged_bytes": 4096, "torn_bytes": 0, "snapshot": None},  # a zero-filled journal
    {"damaged_records": 0, "damaged_bytes": 0, "torn_bytes": 0, "snapshot": "checksum mismatch"},
    {"damaged_records": 0, "damaged_bytes": 0, "torn_bytes": 0, "snapshot": None, "missing": ["gpu0.snapshot"],
     "lost_records": 0, "records_lost": True},
    {"damaged_records": 0, "damaged_bytes": 0, "torn_bytes": 0, "snapshot": None, "missing": [],
     "lost_records": 3, "records_lost": True},
])
def test_damage_that_may_have_taken_whole_records_holds_growth_for_twice_the_lease(damage):
    """Issue 26, item 1: when the damage erased the damaged sessions' own records, nothing was
    left recovering and the hold lifted at once, so a newcomer was granted what a live worker
    still held.  Whoever may have lost a record cannot be named, so the hold lasts until every
    live worker has had the time to re-assert (twice the lease), whoever has resumed meanwhile."""
    core = make_core(8 * GIB)
    core.restore(Restored([_record()], damage=damage, found_state=True), now=0.0)
    back = ask(core, hello(3, nonce="nonce-back", resume="token-000000001", holdings=proto.Holdings(granted_pages=3)),
               rid=b"b")
    assert back["result"]["resumed"]
    core.lift_growth_hold(1.0)
    assert core.ledger.growth_hold is not None  # the one restored session is back; others may be out there
    neighbour = Peer(1000, 1000, PID + 1, "localhost:1000:1000:4243")
    other = ask(core, proto.Hello(id=1, versions=[1], instance="n", pid=PID + 1, page_bytes=GIB, nonce="nonce-other"),
                rid=b"o", peer=neighbour)["result"]["session"]
    held = ask(core, proto.Acquire(id=2, session=other, pages=1), rid=b"o", peer=neighbour)
    assert held["result"]["granted"] == 0 and held["result"]["refused"]["details"]["held"]
    core.lift_growth_hold(19.9)
    assert core.ledger.growth_hold is not None
    core.lift_growth_hold(20.0)
    assert core.ledger.growth_hold is None
    assert ask(core, proto.Acquire(id=3, session=other, pages=1), rid=b"o", peer=neighbour)["result"]["granted"] == 1


def test_a_process_already_gone_at_hello_is_reclaimed_at_once():
    processes = FakeProcesses()
    processes.dead.add(PID)
    core = make_core(processes=processes)
    reply = ask(core, hello())
    assert reply["ok"] and not core.ledger.sessions  # answered, and its session freed in the same step


@pytest.mark.parametrize("kill", [False, True])
def test_evict_fences_and_kills_through_process_ops(kill):
    processes = FakeProcesses()
    core = make_core(processes=processes, is_admin=lambda peer: True)
    reply = ask(core, hello())
    session_id, token = reply["result"]["session_id"], reply["result"]["session"]
    root = Peer(0, 0, 1, "localhost:0:0:1")
    evicted = ask(core, proto.Evict(id=9, session_id=session_id, kill=kill), rid=b"admin", peer=root)
    assert evicted["result"]["killed"] is kill and processes.killed == ([PID] if kill else [])
    after = ask(core, proto.Heartbeat(id=3, session=token))
    assert after["error"]["code"] == "evicted"
