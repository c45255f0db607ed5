"""Asks that wait at the broker for memory to come back (``acquire``'s ``wait_s``), idle pages,
soft pressure, watermarks and reclaim priority: the request core alone, then real clients."""

from __future__ import annotations

import threading

import msgspec
import pytest

from kvcached_broker.broker.security import Peer
from kvcached_broker.client import BrokerClient
from kvcached_broker.client import protocol as proto
from kvcached_broker.client.results import as_map
from kvcached_broker.client.errors import BadRequest

from helpers import GIB, make_core, wait_for

A_PID, B_PID = 4242, 4343
A_PEER = Peer(uid=1000, gid=1000, pid=A_PID, address="localhost:1000:1000:4242")
B_PEER = Peer(uid=1000, gid=1000, pid=B_PID, address="localhost:1000:1000:4343")


def ask(core, message, rid, peer, now=0.0):
    reply = core.handle(rid, peer, proto.encode(message), now)
    return None if reply is None else msgspec.msgpack.decode(reply)


def two_sessions(total_bytes=8 * GIB):
    """A core with session ``a`` (rid ``ra``) and ``b`` (rid ``rb``), 1 GiB pages; their tokens."""
    core = make_core(total_bytes)
    tokens = {}
    for name, rid, peer, pid in (("a", b"ra", A_PEER, A_PID), ("b", b"rb", B_PEER, B_PID)):
        hello = proto.Hello(id=1, versions=[1], instance=name, pid=pid, page_bytes=GIB, nonce=f"nonce-{name}-0001")
        tokens[name] = ask(core, hello, rid, peer)["result"]["session"]
    return core, tokens


def pushed(core):
    """The outbox, decoded: [(routing id, message)]."""
    return [(rid, msgspec.msgpack.decode(frame)) for rid, frame in core.take_pushes()]


def test_an_ask_that_does_not_fit_waits_and_is_granted_in_the_round_memory_comes_back():
    core, t = two_sessions()
    assert ask(core, proto.Acquire(id=2, session=t["a"], pages=8), b"ra", A_PEER)["result"]["granted"] == 8
    waiting = proto.Acquire(id=2, session=t["b"], pages=3, wait_s=2.0)
    assert ask(core, waiting, b"rb", B_PEER, now=1.0) is None  # no answer yet: it waits
    assert ask(core, waiting, b"rb", B_PEER, now=1.5) is None  # the client's resend: still waiting, not applied twice
    (b_session,) = [s for s in core.ledger.sessions.values() if s.instance == "b"]
    assert b_session.granted_pages == 0
    status = as_map(core.status(1.5))
    assert {i["name"]: i["pressure"]["waiting_asks"] for i in status["instances"]} == {"a": 0, "b": 1}
    asks = [m for _, m in pushed(core) if m["type"] == "pressure"]
    assert asks and asks[0]["pages"] >= 3  # the others are asked for all of it at once
    released = ask(core, proto.Release(id=3, session=t["a"], pages=3), b"ra", A_PEER, now=1.6)
    assert released["result"]["granted_pages"] == 5
    (late,) = [(rid, m) for rid, m in pushed(core) if m["type"] == "reply"]
    assert late[0] == b"rb" and late[1]["id"] == 2 and late[1]["result"]["granted"] == 3
    assert late[1]["result"]["waited_s"] == pytest.approx(0.6)
    assert b_session.granted_pages == 3
    again = ask(core, waiting, b"rb", B_PEER, now=2.0)  # a resend after the answer: the cached reply
    assert again == late[1] and b_session.granted_pages == 3
    core.ledger.check_invariant()


def test_an_ask_still_short_when_its_time_is_up_is_refused_and_changes_nothing():
    core, t = two_sessions()
    ask(core, proto.Acquire(id=2, session=t["a"], pages=8), b"ra", A_PEER)
    assert ask(core, proto.Acquire(id=2, session=t["b"], pages=3, wait_s=0.5), b"rb", B_PEER, now=1.0) is None
    core.serve_waiting(1.2)
    assert not [m for _, m in pushed(core) if m["type"] == "reply"]
    core.serve_waiting(1.5)
    (late,) = [m for _, m in pushed(core) if m["type"] == "reply"]
    assert late["result"]["granted"] == 0 and late["result"]["refused"]["code"] == "budget_exceeded"
    assert not core.waiting
    assert sum(s.granted_pages for s in core.ledger.sessions.values() if s.instance == "b") == 0


def test_only_a_refusal_for_room_waits():
    """Its own cap is not room another instance gives back: such an ask is answered at once."""
    core, t = two_sessions()
    core.ledger.set_limits("b", max_bytes=2 * GIB)
    reply = ask(core, proto.Acquire(id=2, session=t["b"], pages=3, wait_s=2.0), b"rb", B_PEER)
    assert reply["result"]["granted"] == 0 and reply["result"]["refused"]["code"] == "limit_exceeded"
    assert not core.waiting


def test_the_ask_of_a_session_that_ends_while_it_waits_is_dropped():
    core, t = two_sessions()
    ask(core, proto.Acquire(id=2, session=t["a"], pages=8), b"ra", A_PEER)
    assert ask(core, proto.Acquire(id=2, session=t["b"], pages=3, wait_s=2.0), b"rb", B_PEER) is None
    ask(core, proto.Close(id=3, session=t["b"]), b"rb", B_PEER)
    ask(core, proto.Release(id=3, session=t["a"], pages=8), b"ra", A_PEER)
    core.serve_waiting(0.1)
    assert not core.waiting and not [m for _, m in pushed(core) if m["type"] == "reply"]


def test_the_most_starved_instance_is_served_first():
    core, t = two_sessions()
    peer_c = Peer(uid=1000, gid=1000, pid=4444, address="localhost:1000:1000:4444")
    hello = proto.Hello(id=1, versions=[1], instance="c", pid=4444, page_bytes=GIB, nonce="nonce-c-0001")
    t["c"] = ask(core, hello, b"rc", peer_c)["result"]["session"]
    ask(core, proto.Acquire(id=2, session=t["a"], pages=6), b"ra", A_PEER)
    ask(core, proto.Acquire(id=2, session=t["b"], pages=2), b"rb", B_PEER)  # b holds 2: c (0) is more starved
    assert ask(core, proto.Acquire(id=3, session=t["b"], pages=1, wait_s=2.0), b"rb", B_PEER, now=1.0) is None
    assert ask(core, proto.Acquire(id=2, session=t["c"], pages=1, wait_s=2.0), b"rc", peer_c, now=1.1) is None
    pushed(core)
    ask(core, proto.Release(id=3, session=t["a"], pages=1), b"ra", A_PEER, now=1.2)  # room for one of them
    replies = {rid: m["result"]["granted"] for rid, m in pushed(core) if m["type"] == "reply"}
    assert replies == {b"rc": 1}


def test_idle_pages_go_with_requests_and_show_in_status():
    core, t = two_sessions()
    ask(core, proto.Acquire(id=2, session=t["a"], pages=5, idle_pages=2), b"ra", A_PEER)
    assert _session(core, "a").idle_pages == 2
    ask(core, proto.Heartbeat(id=3, session=t["a"], idle_pages=4), b"ra", A_PEER)
    (a,) = [i for i in as_map(core.status(0.0))["instances"] if i["name"] == "a"]
    assert a["sessions"][0]["idle_pages"] == 4


def test_a_refused_instance_at_its_share_asks_idle_pages_softly():
    """b is at its share, so nobody owes it memory; but a holds idle pages (its cache): b's
    refusal asks for those, softly (never what a's running requests use)."""
    core, t = two_sessions(total_bytes=8 * GIB)
    ask(core, proto.Acquire(id=2, session=t["a"], pages=4, idle_pages=3), b"ra", A_PEER)
    ask(core, proto.Acquire(id=2, session=t["b"], pages=4), b"rb", B_PEER)
    pushed(core)
    reply = ask(core, proto.Acquire(id=3, session=t["b"], pages=2), b"rb", B_PEER, now=1.0)
    assert reply["result"]["granted"] == 0
    (push,) = [m for rid, m in pushed(core) if m["type"] == "pressure"]
    assert push["soft"] is True and push["pages"] == 2
    # asked for idle pages it no longer has: nothing more than it said it holds idle
    ask(core, proto.Heartbeat(id=3, session=t["a"], idle_pages=0), b"ra", A_PEER, now=2.5)
    ask(core, proto.Acquire(id=4, session=t["b"], pages=2), b"rb", B_PEER, now=2.6)
    assert not [m for rid, m in pushed(core) if m["type"] == "pressure"]


def test_idle_pages_under_a_floor_are_never_asked_for():
    """What an instance holds under its floor is its own: given back, it would be its unfilled
    floor, which no other instance may be granted, so a soft ask of it only costs the floored
    instance its cache."""
    core, t = two_sessions(total_bytes=8 * GIB)
    core.ledger.set_limits("a", min_bytes=6 * GIB)
    ask(core, proto.Acquire(id=2, session=t["a"], pages=4, idle_pages=3), b"ra", A_PEER)
    assert ask(core, proto.Acquire(id=2, session=t["b"], pages=2), b"rb", B_PEER)["result"]["granted"] == 2
    pushed(core)
    reply = ask(core, proto.Acquire(id=3, session=t["b"], pages=1), b"rb", B_PEER, now=1.0)
    assert reply["result"]["granted"] == 0
    assert not [m for _, m in pushed(core) if m["type"] == "pressure"]
    core.ledger.set_limits("a", min_bytes=3 * GIB)  # one page above its floor now: only that one is asked
    reply = ask(core, proto.Acquire(id=4, session=t["b"], pages=5), b"rb", B_PEER, now=2.0)
    assert reply["result"]["granted"] == 0
    (push,) = [m for _, m in pushed(core) if m["type"] == "pressure"]
    assert push["soft"] is True and push["pages"] == 1


def test_the_lowest_priority_is_asked_first_then_the_one_idle_longest(caplog):
    core = make_core(12 * GIB)
    peers, tokens = {}, {}
    for i, name in enumerate(("old", "new", "high", "asker")):
        peers[name] = Peer(uid=1000, gid=1000, pid=5000 + i, address=f"localhost:1000:1000:{5000 + i}")
        hello = proto.Hello(id=1, versions=[1], instance=name, pid=5000 + i, page_bytes=GIB, nonce=f"nonce-{name}-01")
        tokens[name] = ask(core, hello, name.encode(), peers[name])["result"]["session"]
    core.ledger.set_limits("high", priority=5)
    for name, now in (("high", 0.0), ("old", 1.0), ("new", 2.0)):
        ask(core, proto.Acquire(id=2, session=tokens[name], pages=3, idle_pages=3), name.encode(), peers[name], now=now)
    ask(core, proto.Acquire(id=2, session=tokens["asker"], pages=3), b"asker", peers["asker"], now=3.0)
    pushed(core)
    with caplog.at_level("INFO", logger="kvcached_broker"):
        reply = ask(core, proto.Acquire(id=3, session=tokens["asker"], pages=4), b"asker", peers["asker"], now=4.0)
    assert reply["result"]["granted"] == 0
    asked = [(rid, m["pages"]) for rid, m in pushed(core) if m["type"] == "pressure"]
    assert asked == [(b"old", 3), (b"new", 1)]  # priority 0 before 5; then who asked for memory least recently
    lines = [r.getMessage() for r in caplog.records if "event=pressure" in r.getMessage()]
    assert any("instance=old priority=0 kind=idle" in line for line in lines)


def test_priority_shows_in_status_and_comes_from_an_admin_or_a_hello():
    core, t = two_sessions()
    core.ledger.set_limits("a", priority=-3)
    (a,) = [i for i in as_map(core.status(0.0))["instances"] if i["name"] == "a"]
    assert a["priority"] == -3
    hello = proto.Hello(id=1, versions=[1], instance="c", pid=4444, page_bytes=GIB, nonce="nonce-c-0001",
                        limits=proto.LimitsRequest(priority=-7))  # within hello_max_priority (0)
    reply = ask(core, hello, b"rc", Peer(uid=1000, gid=1000, pid=4444, address="localhost:1000:1000:4444"))
    assert reply["result"]["limits"]["priority"] == -7


def test_the_watermarks_keep_memory_free_for_an_instance_below_its_share():
    """a holds nearly all of the device, most of it idle cache, above its share; b is below its
    share and idle.  Free memory under the low mark is refilled from a's idle pages above its
    share, softly, up to the high mark; an instance that asked for memory a moment ago is not
    asked (what it was just granted is about to be used)."""
    core, t = two_sessions(total_bytes=20 * GIB)
    ask(core, proto.Acquire(id=2, session=t["b"], pages=1), b"rb", B_PEER, now=0.0)
    ask(core, proto.Acquire(id=2, session=t["a"], pages=19, idle_pages=15), b"ra", A_PEER, now=1.0)
    pushed(core)
    core.replenish(1.1)  # a is growing: its pages are not taken
    assert not pushed(core)
    core.replenish(2.0)
    (push,) = [m for _, m in pushed(core)]
    assert push["type"] == "pressure" and push["soft"] is True and push["pages"] == 2  # 10% of 20 GiB free
    core.replenish(2.1)  # asked already, nothing came back yet: not asked again
    assert not pushed(core)


def test_a_waiting_acquire_through_the_client_gets_what_another_gives_back(inproc_factory):
    """Two real clients on a real broker: b's acquire waits while a is asked, a gives back from
    its pressure callback, and b's call returns the grant with how long it waited."""
    b = inproc_factory(total_bytes=8 * GIB)
    holder = BrokerClient.connect("holder", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0)
    bursty = BrokerClient.connect("bursty", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0)
    try:
        assert holder.acquire(8) == 8
        asked = threading.Event()

        def give_back(pages: int) -> int:
            asked.set()
            holder.release(pages)
            return pages

        holder.on_pressure(give_back)
        assert bursty.acquire(3, wait_s=5.0) == 3
        assert asked.is_set() and bursty.last_acquire.waited_s > 0
        assert wait_for(lambda: holder.held_pages == 5)
        with pytest.raises(BadRequest):
            bursty.acquire(1, wait_s=0)
        with pytest.raises(BadRequest):
            bursty.acquire(1, wait_s=proto.MAX_WAIT_S + 1)
    finally:
        bursty.close()
        holder.close()


def _session(core, instance):
    (session,) = [s for s in core.ledger.sessions.values() if s.instance == instance]
    return session
