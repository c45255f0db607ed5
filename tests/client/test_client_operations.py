"""``client/operations.py`` alone: every call driven as a generator against a scripted broker.

No socket, thread or clock: :class:`Script` is a driver (as ``BrokerClient._run`` is) whose
``Send`` goes to :class:`FakeBroker`, a page-level model of the broker with a reply cache and
faults a test switches on (a reply lost after the request was applied, a broker that does
not answer, a connection replaced, a session lost, a refusal).  What these tests check is the
books: after every scenario the broker charges what the client's books say it holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcached_broker.client import protocol as proto
from kvcached_broker.client import results
from kvcached_broker.client.core import ClientCore
from kvcached_broker.client.errors import BadRequest, BrokerError, BrokerUnavailable, SessionEvicted
from kvcached_broker.client.operations import Invoke, Operations, Resume, Send, drive

PAGE_BYTES = 1 << 20


@dataclass
class FakeBroker:
    """One session's side of a broker, in pages, answering requests by id exactly once."""

    free_pages: int = 100
    token: str = "token-one"
    session_id: str = "s-1"
    granted_pages: int = 0
    pools: dict[str, int] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)
    replies: dict[int, proto.Reply] = field(default_factory=dict)  # the reply cache
    hellos: list[proto.Hello] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # ops applied, in order (repeats are not)
    lose_next_reply: set[str] = field(default_factory=set)  # apply, then drop the reply once
    refuse_next: dict[str, str] = field(default_factory=dict)  # op -> error code, once
    down: bool = False
    rebound: bool = False  # the connection was replaced: not_owner until a resume hello
    lost: bool = False  # restarted without state: unknown_session, a resume opens a new session

    def answer(self, payload: bytes) -> proto.Reply:
        if self.down:
            raise BrokerUnavailable("scripted: the broker does not answer")
        req = proto.decode_request(payload)
        if req.id in self.replies and not isinstance(req, proto.Hello):
            return self.replies[req.id]
        reply = self._handle(req)
        op = type(req).__name__.lower()
        if op in self.lose_next_reply:
            self.lose_next_reply.discard(op)
            self.replies[req.id] = reply
            raise BrokerUnavailable("scripted: the reply was lost")
        return reply

    def _handle(self, req: Any) -> proto.Reply:
        op = type(req).__name__.lower()
        if op == "hello":
            return self._hello(req)
        if self.lost:
            return _error(req.id, "unknown_session")
        if self.rebound:
            return _error(req.id, "not_owner")
        if op in self.refuse_next:
            return _error(req.id, self.refuse_next.pop(op))
        reply = _ok(req.id, getattr(self, f"_{op}")(req))
        if op in ("acquire", "release", "reserve"):
            self.replies[req.id] = reply
            self.applied.append(op)
        return reply

    def _hello(self, req: proto.Hello) -> proto.Reply:
        self.hellos.append(req)
        resumed = req.resume == self.token and not self.lost
        if not resumed and req.resume is not None:
            self.token, self.session_id = self.token + "x", self.session_id + "x"
            self.granted_pages, self.pools, self.holds, self.replies = 0, {}, {}, {}
        self.lost = self.rebound = False
        return _ok(req.id, results.HelloResult(
            session=self.token, session_id=self.session_id, version=1, lease_s=8.0, heartbeat_s=2.0,
            resumed=resumed, claims="kept" if resumed else "ignored",
            holdings=proto.Holdings(pools=dict(self.pools), granted_pages=self.granted_pages, holds=dict(self.holds)),
        ))

    def _acquire(self, req: proto.Acquire) -> results.AcquireResult:
        floor = req.pages if req.min_pages is None else req.min_pages
        granted = min(req.pages, self.free_pages)
        granted = granted if granted >= floor else 0
        self.free_pages -= granted
        self.granted_pages += granted
        return results.AcquireResult(granted=granted, granted_pages=self.granted_pages)

    def _release(self, req: proto.Release) -> results.ReleaseResult:
        assert req.pages <= self.granted_pages, "the fake never sees more released than granted"
        self.free_pages += req.pages
        self.granted_pages -= req.pages
        return results.ReleaseResult(granted_pages=self.granted_pages)

    def _reserve(self, req: proto.Reserve) -> results.ReserveResult:
        self.pools = {k: v for k, v in req.pools.items() if v}
        if req.holds is not None:
            self.holds = {k: v for k, v in req.holds.items() if v}
        return results.ReserveResult(pools=dict(self.pools), holds=dict(self.holds),
                                     reserved_bytes=sum(self.pools.values()) + sum(self.holds.values()),
                                     measured_bytes=0, grantable_bytes=0, ever_bytes=0)

    def _heartbeat(self, req: proto.Heartbeat) -> results.HeartbeatResult:
        return results.HeartbeatResult(state="active", granted_pages=self.granted_pages)

    def _status(self, req: proto.Status) -> results.StatusDocument:
        total = 64 * (2 << 20)
        return results.StatusDocument(
            device=results.DeviceInfo(index=0, uuid="GPU-fake", name="fake", simulated=True), total_bytes=total,
            headroom_bytes=0, external_bytes=0, budget_bytes=total, reserved_bytes=0,
            granted_bytes=self.granted_pages * (2 << 20), unreported_bytes=0, held_bytes=0,
            free_bytes=self.free_pages * (2 << 20), overcommitted=False, instances=[], broker={})

    def _close(self, req: proto.Close) -> results.CloseResult:
        return results.CloseResult(closed=self.session_id, freed_bytes=0)


def _ok(request_id: int, result: Any) -> proto.Reply:
    return proto.decode_broker_message(proto.ok_reply(request_id, result))


def _error(request_id: int, code: str) -> proto.Reply:
    return proto.decode_broker_message(proto.error_reply(request_id, code, f"scripted {code}"))


class Script:
    """A driver, as ``BrokerClient``'s, whose sends go to a :class:`FakeBroker`; it records them."""

    def __init__(self, credit_pages: int = 4, **broker: Any):
        self.core = ClientCore(instance="m", tp_rank=0, tp_size=1, page_bytes=PAGE_BYTES,
                               credit_pages=credit_pages, device_uuid=None)
        self.ops = Operations(self.core)
        self.broker = FakeBroker(**broker)
        self.sent: list[Send] = []
        self.resumes = 0
        self.run(self.ops.open(resume=False))
        self.sent.clear()

    def run(self, op) -> Any:
        return drive(op, self.do)

    def do(self, action: Send | Resume | Invoke) -> Any:
        if isinstance(action, Send):
            self.sent.append(action)
            return self.broker.answer(action.payload)
        if isinstance(action, Resume):
            self.resumes += 1
            if self.core.token == action.token:
                self.run(self.ops.open(resume=True))
            return None
        return action.fn(*action.args)

    def ops_sent(self) -> list[str]:
        return [type(proto.decode_request(s.payload)).__name__.lower() for s in self.sent]

    def last_sent(self) -> Any:
        return proto.decode_request(self.sent[-1].payload)

    def books_match(self) -> bool:
        """The invariant: what the broker charges is what the books say (none uncharged here)."""
        core = self.core
        return (core.credit.granted_pages - core.uncharged_pages, core.pools, core.holds) == (
            self.broker.granted_pages, self.broker.pools, self.broker.holds)

    def acquire(self, pages: int, min_pages: int | None = None) -> int:
        return self.run(self.ops.acquire(pages, min_pages))

    def release(self, pages: int) -> None:
        self.run(self.ops.release(pages))


class Reduce:
    """A ``reduce_min`` that records each call and answers ``answer(value)``."""

    def __init__(self, answer=lambda value: value):
        self.calls: list[int] = []
        self.answer = answer

    def __call__(self, value: int) -> int:
        self.calls.append(value)
        return self.answer(value)


# ------------------------------------------------------------------- the credit reserve
def test_a_first_acquire_asks_for_the_pages_plus_a_full_reserve():
    s = Script(credit_pages=4)
    assert s.acquire(3) == 3
    sent = s.last_sent()
    assert (sent.pages, sent.min_pages, sent.caller_pages, sent.reserve_pages) == (7, 3, 3, 0)
    assert (s.core.credit.held_pages, s.core.credit.reserve_pages) == (3, 4)
    assert s.books_match()


def test_the_reserve_serves_acquires_and_takes_releases_with_no_send():
    s = Script(credit_pages=4)
    s.acquire(1)
    s.sent.clear()
    for _ in range(4):
        assert s.acquire(1) == 1  # 4 in reserve: served locally
    for _ in range(5):
        s.release(1)  # back to 5 in reserve, under the high watermark of 8
    assert s.sent == []
    assert (s.core.credit.held_pages, s.core.credit.reserve_pages) == (0, 5)
    assert s.books_match()


def test_a_release_above_the_high_watermark_returns_the_surplus_down_to_the_target():
    s = Script(credit_pages=4)
    assert s.acquire(10) == 10  # reserve 4
    s.sent.clear()
    s.release(5)  # reserve 9 > 8: 5 go back, 4 stay
    assert s.ops_sent() == ["release"] and s.last_sent().pages == 5
    assert (s.core.credit.held_pages, s.core.credit.reserve_pages) == (5, 4)
    assert s.books_match()


def test_the_background_refills_below_the_low_watermark_and_heartbeats_when_due():
    s = Script(credit_pages=4)
    s.acquire(1)
    s.acquire(3)  # reserve 1 < low 2
    s.sent.clear()
    pressure_log: list = []
    s.run(s.ops.background_round([], None, lambda: False, pressure_log))
    sent = s.last_sent()
    assert s.ops_sent() == ["acquire"] and (sent.pages, sent.min_pages, sent.caller_pages) == (3, 0, 0)
    assert s.core.credit.reserve_pages == 4 and s.books_match()
    s.sent.clear()
    s.run(s.ops.background_round([], None, lambda: False, pressure_log))
    assert s.sent == []  # at the target: nothing to do, and no heartbeat is due
    s.run(s.ops.background_round([], None, lambda: True, pressure_log))
    assert s.ops_sent() == ["heartbeat"] and pressure_log == []


def test_no_refill_for_a_session_that_never_asked_or_has_no_reserve():
    for credit_pages in (4, 0):
        s = Script(credit_pages=credit_pages)
        if credit_pages == 0:
            s.acquire(1)
        s.run(s.ops.refill())
        assert s.ops_sent() == (["acquire"] if credit_pages == 0 else [])


def test_no_refill_while_a_callers_acquire_is_in_flight():
    s = Script(credit_pages=4)
    s.acquire(4)  # reserve 4
    s.acquire(4)  # reserve 0: a refill is wanted
    s.sent.clear()
    waiting = s.ops.acquire(10, None)
    send = next(waiting)  # an asyncio caller's acquire, waiting for its reply
    assert isinstance(send, Send) and s.core.in_flight()
    s.run(s.ops.refill())
    assert s.sent == []  # the caller's own grant refills the reserve
    with pytest.raises(StopIteration) as done:
        waiting.send(s.broker.answer(send.payload))
    assert done.value.value == 10 and s.books_match()


def test_pressure_takes_the_reserve_first_then_asks_the_runtime():
    s = Script(credit_pages=4)
    s.acquire(6)  # held 6, reserve 4
    asked = []

    def callback(pages: int) -> int:
        asked.append(pages)
        s.release(pages)  # the runtime frees and releases them itself
        return pages

    pressure_log: list = []
    push = proto.Pressure(session_id=s.core.session_id, pages=6)
    s.run(s.ops.background_round([push], callback, lambda: False, pressure_log))
    assert asked == [2] and pressure_log == [{"asked": 6, "from_reserve": 4, "from_runtime": 2}]
    assert (s.core.credit.held_pages, s.core.credit.reserve_pages) == (4, 2)
    assert s.books_match()


def test_a_failing_pressure_callback_is_logged_and_gives_nothing():
    s = Script(credit_pages=0)
    s.acquire(3)

    def callback(pages: int) -> int:
        raise RuntimeError("the runtime cannot free now")

    answer = s.run(s.ops.answer_pressure(proto.Pressure(session_id="s-1", pages=2), callback))
    assert answer == {"asked": 2, "from_reserve": 0, "from_runtime": 0} and s.books_match()


# ---------------------------------------------------------------------------- exactly once
def test_an_acquire_whose_reply_was_lost_is_sent_again_first_and_booked_once():
    s = Script(credit_pages=4)
    s.broker.lose_next_reply.add("acquire")
    with pytest.raises(BrokerUnavailable):
        s.acquire(2)  # the broker granted 6; the caller never heard
    first = s.sent[-1]
    assert s.core.credit.granted_pages == 0 and [o.waiting for o in s.core.outstanding.values()] == [False]
    assert s.broker.granted_pages == 6
    s.sent.clear()
    assert s.acquire(2) == 2  # the repeat's late grant went to the reserve and serves this
    assert s.sent == [first]  # the same id and bytes, and nothing else
    assert s.broker.applied == ["acquire"] and not s.core.outstanding
    assert (s.core.credit.held_pages, s.core.credit.reserve_pages) == (2, 4)
    assert s.books_match()


def test_a_release_is_booked_before_it_is_sent_and_applied_once():
    s = Script(credit_pages=0)
    s.acquire(5)
    s.broker.lose_next_reply.add("release")
    with pytest.raises(BrokerUnavailable):
        s.release(3)
    assert s.core.credit.held_pages == 2 and s.broker.granted_pages == 2  # both already moved
    s.run(s.ops.status())
    assert s.ops_sent()[-3:] == ["release", "release", "status"]  # the repeat, then the call
    assert s.broker.applied == ["acquire", "release"] and s.books_match()


def test_a_request_the_broker_never_saw_stays_in_doubt_until_it_answers():
    s = Script(credit_pages=0)
    s.acquire(4)
    s.broker.down = True
    with pytest.raises(BrokerUnavailable):
        s.release(4)
    with pytest.raises(BrokerUnavailable):
        s.run(s.ops.status())  # the release goes first, and is still unanswered
    assert len(s.core.in_doubt()) == 1
    s.broker.down = False
    s.run(s.ops.heartbeat())
    assert s.broker.applied == ["acquire", "release"] and not s.core.outstanding and s.books_match()


def test_a_refused_release_puts_its_pages_back_in_the_reserve():
    s = Script(credit_pages=0)
    s.acquire(3)
    s.broker.refuse_next["release"] = "internal"
    with pytest.raises(BrokerError):
        s.release(2)
    assert (s.core.credit.held_pages, s.core.credit.reserve_pages) == (1, 2)  # still charged
    assert s.books_match()


def test_a_late_grant_above_the_high_watermark_is_trimmed_back():
    s = Script(credit_pages=2)
    s.broker.lose_next_reply.add("acquire")
    with pytest.raises(BrokerUnavailable):
        s.acquire(10)  # 12 granted, unheard
    s.run(s.ops.heartbeat())  # the repeat books 12 in the reserve: above 4, back to 2
    assert s.ops_sent() == ["acquire", "acquire", "release", "heartbeat"]
    assert s.core.credit.reserve_pages == 2 and s.books_match()


# ---------------------------------------------------------------------------------- resume
def test_not_owner_resumes_the_same_session_and_sends_the_request_again():
    s = Script(credit_pages=0)
    s.acquire(2)
    s.sent.clear()
    s.broker.rebound = True
    assert s.acquire(3) == 3
    assert s.resumes == 1 and s.ops_sent() == ["acquire", "hello", "acquire"]
    first, again = s.sent[0], s.sent[2]
    assert (first.request_id, first.payload) == (again.request_id, again.payload)
    hello = s.broker.hellos[-1]
    assert hello.resume == "token-one" and hello.holdings.granted_pages == 2
    assert s.core.token == "token-one" and s.books_match()


def test_a_broker_that_restarts_again_and_again_while_a_call_waits_is_followed():
    """The chaos run's restarts in a row: each resend found a broker restarted once more, and a
    release gave up with not_owner after its third resume, the caller told it failed while its
    pages had gone to the reserve (a book drift).  Every resume is answered: it is followed."""
    s = Script(credit_pages=0)
    s.acquire(4)
    restarts = iter(range(5))
    handle = s.broker._handle

    def restarting(req):
        if not isinstance(req, proto.Hello) and next(restarts, None) is not None:
            s.broker.rebound = True  # restarted again: not_owner until the next resume
        return handle(req)

    s.broker._handle = restarting
    s.release(2)
    assert s.resumes == 5 and s.broker.applied == ["acquire", "release"] and s.books_match()


def test_a_resume_names_the_booked_release_in_doubt_as_settled():
    s = Script(credit_pages=0)
    s.acquire(4)
    s.broker.down = True
    with pytest.raises(BrokerUnavailable):
        s.release(1)
    (release_id, _), = s.core.in_doubt()
    s.broker.down, s.broker.rebound = False, True
    s.run(s.ops.status())
    assert s.broker.hellos[-1].settled == [release_id]
    assert s.broker.hellos[-1].holdings.granted_pages == 3  # the release is already in the books


def test_unknown_session_reopens_and_reasserts_the_books_once():
    s = Script(credit_pages=2)
    s.run(s.ops.reserve({"weights": 5 * PAGE_BYTES}, None, {"kv": PAGE_BYTES}, False))
    s.acquire(3)  # held 3, reserve 2
    s.broker.lost = True
    s.sent.clear()
    s.run(s.ops.status())
    assert s.ops_sent() == ["status", "hello", "reserve", "acquire", "status"]
    # the 3 held pages are asked for again; the lost session's reserve, used by nobody, is not
    assert s.core.token == "token-onex" and s.broker.granted_pages == 3
    assert s.books_match() and s.core.uncharged_pages == 0 and not s.core.reasserting


def test_a_release_made_moot_by_a_lost_session_is_not_sent_again():
    s = Script(credit_pages=0)
    s.acquire(4)
    s.broker.lost = True
    s.release(1)  # unknown_session: the new session is given the books (3), the release is moot
    assert s.ops_sent() == ["acquire", "release", "hello", "acquire"]
    assert s.broker.granted_pages == 3 and s.books_match() and not s.core.outstanding


def test_an_acquire_across_a_lost_session_is_rebuilt_for_the_new_session():
    s = Script(credit_pages=0)
    s.acquire(1)
    s.broker.lost = True
    assert s.acquire(2) == 2
    assert s.last_sent().session == "token-onex" and s.broker.granted_pages == 3 and s.books_match()


# -------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("pages, min_pages", [(0, None), (-1, None), (True, None), (2, 3), (2, -1), (1.5, None)])
def test_refused_arguments_raise_bad_request_and_send_nothing(pages, min_pages):
    s = Script()
    with pytest.raises(BadRequest):
        s.acquire(pages, min_pages)
    with pytest.raises(BadRequest):
        s.release(pages if min_pages is None else 0)
    assert s.sent == [] and s.core.credit.granted_pages == 0


def test_releasing_more_than_held_is_refused_and_changes_nothing():
    s = Script(credit_pages=4)
    s.acquire(2)
    books = (s.core.credit.held_pages, s.core.credit.reserve_pages)
    s.sent.clear()
    with pytest.raises(BadRequest, match="only 2 are held"):
        s.release(3)
    assert s.sent == [] and (s.core.credit.held_pages, s.core.credit.reserve_pages) == books


def test_a_refused_acquire_returns_0_and_books_nothing():
    s = Script(credit_pages=4, free_pages=3)
    assert s.acquire(5) == 0
    assert s.acquire(5, min_pages=2) == 3  # the most that fit, nothing left for the reserve
    assert s.core.credit.reserve_pages == 0 and s.books_match()


def test_an_evicted_session_refuses_every_call_with_no_send():
    s = Script()
    s.broker.refuse_next["heartbeat"] = "evicted"
    with pytest.raises(SessionEvicted):
        s.run(s.ops.heartbeat())
    assert s.core.evicted and s.core.ended
    s.sent.clear()
    for op in (s.ops.acquire(1, None), s.ops.release(1), s.ops.status()):
        with pytest.raises(SessionEvicted):
            s.run(op)
    s.run(s.ops.close(1.0))
    assert s.sent == [] and s.core.closed


def test_close_ends_the_session_and_tolerates_a_broker_that_forgot_it():
    s = Script()
    s.broker.lost = True
    s.run(s.ops.close(1.0))  # no resume on close: unknown_session is the end already
    assert s.ops_sent() == ["close"] and s.core.closed
    with pytest.raises(BrokerError, match="closed"):
        s.acquire(1)


# ------------------------------------------------------------------------------ acquire_tp
def _tp(s: Script, pages: int, reduce: Reduce, min_pages: int | None = None) -> Any:
    return s.run(s.ops.acquire_tp(pages, reduce, min_pages))


def test_acquire_tp_agrees_on_the_minimum_and_releases_the_surplus():
    s = Script(credit_pages=0)
    reduce = Reduce(lambda value: 2)
    assert _tp(s, 5, reduce) == 2
    assert reduce.calls == [5] and s.core.credit.held_pages == 2 and s.books_match()


def test_acquire_tp_on_a_refusal_contributes_0():
    s = Script(credit_pages=0, free_pages=1)
    reduce = Reduce()
    assert _tp(s, 4, reduce) == 0
    assert reduce.calls == [0] and s.books_match()


@pytest.mark.parametrize("failure", ["unreachable", "evicted", "closed", "bad_args", "refused_internal"])
def test_acquire_tp_calls_reduce_min_exactly_once_when_this_rank_fails(failure):
    s = Script(credit_pages=0)
    pages, expected = 4, BrokerError
    if failure == "unreachable":
        s.broker.down, expected = True, BrokerUnavailable
    elif failure == "evicted":
        s.core.evicted, expected = True, SessionEvicted
    elif failure == "closed":
        s.run(s.ops.close(1.0))
    elif failure == "bad_args":
        pages, expected = 0, BadRequest
    else:
        s.broker.refuse_next["acquire"] = "internal"
    reduce = Reduce()
    with pytest.raises(expected):
        _tp(s, pages, reduce)
    assert reduce.calls == [0]


def test_acquire_tp_refuses_a_reduce_above_this_ranks_grant_and_gives_it_all_back():
    s = Script(credit_pages=0)
    reduce = Reduce(lambda value: value + 1)
    with pytest.raises(BadRequest, match="reduce_min returned 4"):
        _tp(s, 3, reduce)
    assert reduce.calls == [3] and s.core.credit.held_pages == 0 and s.books_match()


def test_acquire_tp_served_from_the_reserve_still_calls_reduce_once():
    s = Script(credit_pages=4)
    s.acquire(1)
    s.sent.clear()
    reduce = Reduce(lambda value: 1)
    assert _tp(s, 3, reduce) == 1
    assert reduce.calls == [3] and s.sent == []  # 3 from the reserve, 2 back into it
    assert (s.core.credit.held_pages, s.core.credit.reserve_pages) == (2, 3)


# ================================================= every order, against a real broker that restarts
# Issue 26, item 2: a request that timed out while the broker was down stayed in doubt; after the
# restart the next call was a release, booked at once; the in-doubt request, sent again first,
# resumed the session asserting books that already left the release out without naming it as
# settled, and the broker then applied the release too (the client held 6 pages, the broker
# charged 2).  Here the client's operations run against a real request core with a state
# directory, which a fault restarts as a SIGKILL would (what was written stays; the connection
# is new), and every order a client produces is driven: a call left in doubt in each way, then
# each next call, with a fault at each of its first sends, then a quiet call.  After each, the
# broker charges exactly what the books say, and nothing else.
FAULTS = ("lost_request", "lost_reply", "restart_before", "restart_after", "wiped_before", "wiped_after")


class RestartingBroker:
    """A real :class:`RequestCore` with a journal, as the shell runs it (a group commit before
    each reply, the deferred records' timer), that a test can SIGKILL and start again."""

    def __init__(self, state_dir, total_bytes: int):
        from helpers import restarted_core

        from kvcached_broker.broker.quotas import SessionQuotas

        self._make = lambda: restarted_core(state_dir, total_bytes, now=self.now, quotas=SessionQuotas(lease_s=1e6))
        self.state_dir = state_dir
        self.now = 0.0
        self.connection = 0
        self.core = self._make()

    def answer(self, payload: bytes) -> proto.Reply:
        from helpers import local_peer

        self.now += 0.004
        reply = self.core.handle(b"connection-%d" % self.connection, local_peer(), payload, self.now)
        self.core.journal.commit(self.now)  # before the reply goes out
        self.core.journal.flush_due(self.now)
        self.core.take_pushes()
        assert reply is not None
        return proto.decode_broker_message(reply)

    def restart(self, wipe: bool = False) -> None:
        """SIGKILL (records that wait are lost, what is written stays) and start again; the
        client's socket reconnects as a new connection."""
        import shutil

        self.core.journal.store.close()
        if wipe:
            shutil.rmtree(self.state_dir)
        self.now += 1.0
        self.core = self._make()
        self.connection += 1

    def close(self) -> None:
        """Close the journal's files, as a broker's exit does (thousands of orders run)."""
        self.core.journal.store.close()

    def charged(self, session_id: str) -> tuple[int, dict, dict] | None:
        session = self.core.ledger.sessions.get(session_id)
        if session is None:
            return None
        return session.granted_pages, dict(session.pools), dict(session.holds)


class FaultyDriver:
    """A driver (as ``BrokerClient._run``) whose sends go to a :class:`RestartingBroker`, with a
    fault on chosen sends: ``plan[(call, send)] = fault``.  A fault ends the call as the
    transport's timeout does (``BrokerUnavailable``)."""

    def __init__(self, broker: RestartingBroker, core: ClientCore):
        self.broker = broker
        self.core = core
        self.ops = Operations(core)
        self.plan: dict[tuple[int, int], str] = {}
        self.call = -1
        self.sends = 0

    def run(self, op) -> Any:
        return drive(op, self.do)

    def next_call(self) -> None:
        self.call += 1
        self.sends = 0

    def do(self, action: Send | Resume | Invoke) -> Any:
        if isinstance(action, Resume):
            if self.core.token == action.token:
                self.run(self.ops.open(resume=True))
            return None
        if isinstance(action, Invoke):
            return action.fn(*action.args)
        fault = self.plan.pop((self.call, self.sends), None)
        self.sends += 1
        broker = self.broker
        if fault in ("restart_before", "wiped_before"):
            broker.restart(wipe=fault == "wiped_before")
        if fault in (None, "lost_reply", "restart_after", "wiped_after"):
            reply = broker.answer(action.payload)
            if fault is None:
                return reply
        if fault in ("restart_after", "wiped_after"):
            broker.restart(wipe=fault == "wiped_after")
        raise BrokerUnavailable(f"scripted: {fault}")


def _calls(ops: Operations) -> dict[str, Any]:
    """Every call a client makes, by name (each a fresh operation)."""
    return {
        "acquire": lambda: ops.acquire(3, None),
        "acquire_min": lambda: ops.acquire(9, 1),
        "release": lambda: ops.release(2),
        "release_all": lambda: ops.release(ops.core.credit.held_pages or 1),
        "reserve": lambda: ops.reserve({"weights": 3 * PAGE_BYTES + ops.core.credit.held_pages}, None,
                                       {"kv_hold": PAGE_BYTES}, False),
        "refill": lambda: ops.refill(),
        "pressure": lambda: ops.answer_pressure(proto.Pressure(session_id=ops.core.session_id or "s-1", pages=3), None),
        "mapped": lambda: ops.mapped(ops.core.credit.granted_pages // 2) if ops.core.report_mapping else ops.status(),
        "heartbeat": lambda: ops.heartbeat(),
        "status": lambda: ops.status(),
    }


#: Calls that change holdings: the ones a fault leaves in doubt.
IN_DOUBT_CALLS = ("acquire", "acquire_min", "release", "reserve", "refill", "pressure", "mapped")


def _run_order(tmp_path, credit_pages: int, first: str, first_fault: str, second: str,
               second_fault: tuple[int, str] | None, report_mapping: bool = False, third: str | None = None) -> str | None:
    """One order; returns what went wrong, or None."""
    broker = RestartingBroker(tmp_path / "state", 64 << 30)
    try:
        return _drive_order(broker, credit_pages, first, first_fault, second, second_fault, report_mapping, third)
    finally:
        broker.close()


def _drive_order(broker: RestartingBroker, credit_pages: int, first: str, first_fault: str, second: str,
                 second_fault: tuple[int, str] | None, report_mapping: bool, third: str | None) -> str | None:
    core = ClientCore(instance="m", tp_rank=0, tp_size=1, page_bytes=PAGE_BYTES, credit_pages=credit_pages,
                      device_uuid=None, report_mapping=report_mapping)
    driver = FaultyDriver(broker, core)
    driver.run(driver.ops.open(resume=False))
    driver.run(driver.ops.reserve({"weights": 4 * PAGE_BYTES}, None, None, False))
    driver.run(driver.ops.acquire(6, None))  # held 6, and a reserve of credit_pages
    calls = _calls(driver.ops)
    driver.plan[(0, 0)] = first_fault
    if second_fault is not None:
        driver.plan[(1, second_fault[0])] = second_fault[1]
    refused: list[str] = []
    for name in (first, second, *([third] if third else []), "heartbeat", "status"):
        driver.next_call()
        try:
            driver.run(calls[name]())
        except BrokerUnavailable:
            pass
        except BrokerError as exc:  # a broker that refuses what the books say is held: a mismatch
            refused.append(f"{name}: {exc}")
    charged = broker.charged(core.session_id)
    books = (core.credit.granted_pages - core.uncharged_pages, core.pools, core.holds)
    broker.core.ledger.check_invariant()
    others = sorted(set(broker.core.ledger.sessions) - {core.session_id})
    if charged != books or core.uncharged_pages or core.outstanding or others or refused:
        return (f"broker {charged}, books {books} (uncharged {core.uncharged_pages}, outstanding "
                f"{sorted(core.outstanding)}, other sessions {others}, refused {refused})")
    return None


@pytest.fixture
def state_root(tmp_path):
    """Where the orders keep their state directories: in memory where the machine has a tmpfs
    (thousands of small files come and go), else the test's own directory."""
    import shutil
    import tempfile

    shm = "/dev/shm"
    root = Path(tempfile.mkdtemp(prefix="kb-orders-", dir=shm)) if os.access(shm, os.W_OK) else tmp_path
    yield root
    if root != tmp_path:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("credit_pages, report_mapping", [(0, False), (2, True)])
def test_every_order_of_calls_around_faults_and_restarts_applies_each_request_once(state_root, credit_pages,
                                                                                  report_mapping):
    tmp_path = state_root
    failures: list[str] = []
    orders = 0
    names = list(_calls(Operations(ClientCore(instance="m", tp_rank=0, tp_size=1, page_bytes=PAGE_BYTES,
                                              credit_pages=0, device_uuid=None))))
    for first in IN_DOUBT_CALLS:
        for first_fault in FAULTS:
            for second in names:
                for second_fault in [None] + [(send, fault) for send in range(3) for fault in FAULTS]:
                    orders += 1
                    where = tmp_path / f"order-{orders}"
                    problem = _run_order(where, credit_pages, first, first_fault, second, second_fault, report_mapping)
                    if problem is not None:
                        failures.append(f"{first}/{first_fault} then {second}/{second_fault}: {problem}")
    assert orders == len(IN_DOUBT_CALLS) * len(FAULTS) * len(names) * (1 + 3 * len(FAULTS))
    assert not failures, f"{len(failures)} of {orders} orders went wrong, e.g.:\n" + "\n".join(failures[:12])


def test_a_reassertion_cut_short_goes_on_before_any_next_call_and_loses_none_of_it(state_root):
    """The broker lost the session (its state wiped) while an acquire was in doubt; the next
    call's re-assertion is cut short on one of its sends; then each call: the re-assertion goes
    on first, and the call's own request (a release booked already) is neither lost nor
    applied twice."""
    failures, orders = [], 0
    names = list(_calls(Operations(ClientCore(instance="m", tp_rank=0, tp_size=1, page_bytes=PAGE_BYTES,
                                              credit_pages=0, device_uuid=None))))
    for credit_pages, report_mapping in ((0, False), (2, True)):
        for send in (1, 2, 3):
            for fault in FAULTS:
                for third in names:
                    orders += 1
                    problem = _run_order(state_root / f"order-{orders}", credit_pages, "acquire", "wiped_before",
                                         "heartbeat", (send, fault), report_mapping, third=third)
                    if problem is not None:
                        failures.append(f"heartbeat/({send}, {fault}) then {third}: {problem}")
    assert not failures, f"{len(failures)} of {orders} orders went wrong, e.g.:\n" + "\n".join(failures[:12])


def test_a_release_after_a_restart_with_another_request_in_doubt_is_applied_once(tmp_path):
    """The issue's own order, deterministic: the client holds 6 pages, an acquire times out
    while the broker is down, the broker comes back, the next call releases 2."""
    assert _run_order(tmp_path, 0, "acquire", "restart_before", "release", None) is None


# ------------------------------------------------------------------- waiting, idle pages, soft asks
def test_an_acquire_that_may_wait_says_so_and_a_bad_wait_changes_nothing():
    s = Script(credit_pages=0)
    assert s.run(s.ops.acquire(2, None, 1.5)) == 2
    assert s.last_sent().wait_s == 1.5 and s.core.last_acquire.granted == 2
    s.sent.clear()
    for bad in (0, -1, proto.MAX_WAIT_S + 0.5, True, "1"):
        with pytest.raises(BadRequest):
            s.run(s.ops.acquire(1, None, bad))
    assert s.sent == [] and s.books_match()


def test_idle_pages_the_runtime_reports_go_with_the_next_request_or_a_heartbeat():
    """No round trip of its own: the figure (with the reserve) rides on the next request; a
    background round with nothing else to send heartbeats once to carry it."""
    s = Script(credit_pages=2)
    s.acquire(4)  # held 4, reserve 2
    assert s.last_sent().idle_pages is None  # never reported: nothing said
    s.core.idle_pages = 3
    assert s.core.idle_unsent()
    s.run(s.ops.background_round([], None, lambda: False, []))
    assert s.ops_sent()[-1] == "heartbeat" and s.last_sent().idle_pages == 5  # 3 idle + the reserve of 2
    assert not s.core.idle_unsent()
    s.sent.clear()
    s.run(s.ops.background_round([], None, lambda: False, []))
    assert s.sent == []  # unchanged: nothing to send
    s.core.idle_pages = 6
    s.release(1)  # into the reserve (3): no request
    s.acquire(9)
    assert s.last_sent().idle_pages is not None


def test_a_soft_ask_goes_to_the_soft_callback_only():
    s = Script(credit_pages=0)
    s.acquire(6)
    hard, soft = [], []

    def soft_callback(pages: int) -> int:
        soft.append(pages)
        s.release(1)
        return 1

    push = proto.Pressure(session_id=s.core.session_id, pages=3, soft=True)
    answer = s.run(s.ops.answer_pressure(push, hard.append, soft_callback))
    assert soft == [3] and hard == [] and answer["from_runtime"] == 1
    s.run(s.ops.answer_pressure(push, hard.append))  # no soft callback: the reserve only (empty)
    assert hard == [] and s.books_match()
