"""``client/core.py`` alone: the session's books, with no I/O.

What a hello carries and how its answer is taken (a lost session, a restored one adopted or
refused), the outstanding requests (tracked until answered, in doubt once their caller gives
up), pages the broker does not charge, argument checks and when the core refuses to be used.
"""

from __future__ import annotations

import os

import pytest

from kvcached_broker.client import protocol as proto
from kvcached_broker.client import results
from kvcached_broker.client.core import ClientCore, check_ask, check_pages, check_pools
from kvcached_broker.client.errors import BadRequest, BrokerError, SessionEvicted

PAGE_BYTES = 1 << 20


def _core(credit_pages: int = 4, **kwargs) -> ClientCore:
    return ClientCore(instance="m", tp_rank=0, tp_size=1, page_bytes=PAGE_BYTES, credit_pages=credit_pages,
                      device_uuid=None, **kwargs)


def _opened(credit_pages: int = 4) -> ClientCore:
    core = _core(credit_pages)
    core.on_hello(_hello({"session": "token-one", "session_id": "s-1", "lease_s": 8.0, "heartbeat_s": 2.0}))
    return core


def _hello(result: dict) -> results.HelloResult:
    """A hello's answer as the client decodes it off the wire."""
    return results.decode(result, results.HelloResult)


def _reply_error(code: str) -> proto.Reply:
    return proto.decode_broker_message(proto.error_reply(3, code, f"scripted {code}"))


# ------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kwargs", [
    {"tp_size": 0}, {"tp_rank": -1}, {"tp_rank": 2, "tp_size": 2}, {"page_bytes": 0}, {"credit_pages": -1},
    {"instance": ""}, {"limits": {"max_gib": 1}}, {"limits": {"weight": 0}}, {"adapter": {"runtime": 3}},
    # the wire's bounds, checked before a hello is sent (the broker would refuse it as a bad request)
    {"limits": {"weight": 2e6}}, {"limits": {"priority": 1001}}, {"limits": {"priority": True}},
    {"limits": {"min_bytes": None}}, {"limits": {"max_bytes": -1}},
])
def test_a_core_refuses_bad_arguments(kwargs):
    base = dict(instance="m", tp_rank=0, tp_size=1, page_bytes=PAGE_BYTES, credit_pages=4, device_uuid=None)
    with pytest.raises(BadRequest):
        ClientCore(**{**base, **kwargs})


def test_hello_limits_are_sent_as_asked_and_a_key_left_out_is_left_to_the_broker():
    base = dict(instance="m", tp_rank=0, tp_size=1, page_bytes=PAGE_BYTES, credit_pages=4, device_uuid=None)
    core = ClientCore(**base, limits={"max_bytes": None, "weight": 3, "priority": -7})
    sent = core.hello(resume=False).limits
    assert sent == proto.LimitsRequest(max_bytes=None, weight=3.0, priority=-7)
    assert sent.min_bytes is proto.UNSET


def test_check_ask_takes_pages_from_1_and_min_pages_up_to_pages():
    check_ask(1, None)
    check_ask(5, 0)
    check_ask(5, 5)
    for pages, min_pages in [(0, None), (5, 6), (5, -1), (False, None), (proto.MAX_PAGES + 1, None)]:
        with pytest.raises(BadRequest):
            check_ask(pages, min_pages)
    assert check_pages("pages", 3, minimum=1) == 3
    assert check_pools({"a": 1, "b": 0}) == {"a": 1, "b": 0}
    for pools in ([("a", 1)], {"": 1}, {"a": -1}, {"a": 1.0}, {f"p{i}": 1 for i in range(proto.MAX_POOLS + 1)}):
        with pytest.raises(BadRequest):
            check_pools(pools)


# --------------------------------------------------------------------------------- hello
def test_a_first_hello_claims_nothing_and_a_resume_claims_the_books():
    core = _opened()
    first = _core().hello(resume=False)
    assert (first.resume, first.holdings, first.settled) == (None, None, [])
    core.credit.reserve_pages, core.credit.held_pages = 2, 3
    core.pools, core.holds = {"w": 10}, {"kv": 5}
    core.track(7, b"release", booked=True)
    core.track(8, b"acquire")
    again = core.hello(resume=True)
    assert again.resume == "token-one" and again.settled == [7]  # only what the books already show
    assert again.holdings == proto.Holdings(pools={"w": 10}, granted_pages=5, reserve_pages=2, holds={"kv": 5})
    assert (core.session_id, core.lease_s, core.heartbeat_s) == ("s-1", 8.0, 2.0)


def test_a_hello_that_opens_a_new_session_where_one_was_means_it_was_lost():
    core = _opened()
    core.track(5, b"acquire")
    assert core.on_hello(_hello({"session": "token-two", "session_id": "s-2", "resumed": False})) is True
    assert core.outstanding == {} and core.token == "token-two"
    assert core.heartbeat_s == core.lease_s / 4  # no heartbeat_s: a quarter of the lease


def test_an_adopted_resume_charges_the_held_pages_first():
    core = _opened()
    core.credit.held_pages, core.credit.reserve_pages = 3, 2
    result = {"session": "token-one", "session_id": "s-1", "resumed": True, "claims": "adopted",
              "holdings": {"pools": {}, "granted_pages": 4, "holds": {}}}
    assert core.on_hello(_hello(result)) is False
    assert (core.credit.held_pages, core.credit.reserve_pages, core.uncharged_pages) == (3, 1, 0)


def test_a_refused_resume_follows_the_brokers_figures_and_drops_booked_releases():
    core = _opened()
    core.credit.held_pages, core.pools = 5, {"w": 100}
    core.track(9, b"release", booked=True)
    core.track(10, b"acquire")
    result = {"session": "token-one", "session_id": "s-1", "resumed": True, "claims": "refused",
              "holdings": {"pools": {"w": 40}, "granted_pages": 2, "holds": {}}}
    core.on_hello(_hello(result))
    assert core.pools == {"w": 40} and list(core.outstanding) == [10]
    assert (core.credit.held_pages, core.credit.reserve_pages, core.uncharged_pages) == (5, 0, 3)


# ---------------------------------------------------------------------- uncharged pages
def _lost(core: ClientCore) -> None:
    assert core.on_hello(_hello({"session": "token-two", "session_id": "s-2", "resumed": False})) is True


def test_uncharged_pages_are_released_first_without_a_request():
    core = _opened(credit_pages=0)
    core.credit.held_pages = 5
    _lost(core)
    core.book_reasserted_pages(2, mapped=False)  # the broker could give back only 2
    core.reasserted()
    assert core.uncharged_pages == 3
    assert core.put_back(4) == 1  # 3 leave the books alone; 1 was charged: back to the broker
    assert (core.credit.held_pages, core.uncharged_pages) == (1, 0)
    with pytest.raises(BadRequest):
        core.put_back(2)
    assert (core.credit.held_pages, core.uncharged_pages) == (1, 0)


def test_a_lost_session_charges_nothing_until_the_books_are_asked_for_again():
    """The new session is empty: the books say so at once (held pages uncharged, the reserve
    gone, pools wanted again), and each re-asserted answer, late or not, charges them back."""
    core = _opened()
    core.report_mapping = True
    core.pools, core.holds = {"w": 1}, {"kv": 2}
    core.credit.held_pages, core.credit.reserve_pages, core.mapped_pages = 3, 4, 2
    _lost(core)
    assert (core.pools, core.holds, core.credit.reserve_pages, core.uncharged_pages) == ({}, {}, 0, 3)
    assert core.reassert_pools == ({"w": 1}, {"kv": 2}) and core.reassert_mapped_pages == 2 and core.reasserting
    assert core.visible_uncharged_pages() == 0  # still being asked for: not short yet
    core.book_reasserted_pools(_reserved({"w": 1}, {"kv": 2}))
    core.book_reasserted_pages(2, mapped=True)
    assert (core.uncharged_pages, core.mapped_pages, core.reassert_pools) == (1, 2, None)
    assert core.put_back(1) == 0  # an uncharged page freed meanwhile leaves the books alone
    core.book_reasserted_pages(1, mapped=False)  # asked for before: it goes to the reserve
    core.reasserted()
    assert (core.credit.held_pages, core.credit.reserve_pages, core.uncharged_pages) == (2, 1, 0)


def test_a_hello_never_answered_is_sent_again_with_its_nonce():
    core = _opened()
    first = core.hello(resume=True).nonce
    assert core.hello(resume=True).nonce == first  # no answer came: the same hello again
    core.on_hello(_hello({"session": "token-one", "session_id": "s-1", "resumed": True, "claims": "kept"}))
    assert core.hello(resume=True).nonce != first


# -------------------------------------------------------------------------- outstanding
def test_a_request_stays_outstanding_until_answered_and_is_in_doubt_once_given_up():
    core = _opened()
    booked = []
    core.track(1, b"a", on_answer=booked.append)
    core.track(2, b"b")
    assert core.in_flight() and core.in_doubt() == []
    core.gave_up(1)
    core.gave_up(99)  # nothing outstanding: nothing happens
    assert [rid for rid, _ in core.in_doubt()] == [1] and core.in_flight()  # 2 is still waited on
    core.outstanding[1].on_answer({"granted": 3})
    assert booked == [{"granted": 3}]
    assert core.answered(2) is not None and core.answered(2) is None
    core.gave_up(2)  # answered already: still nothing in doubt for it
    assert not core.in_flight() and list(core.outstanding) == [1]


def test_a_late_grant_goes_to_the_reserve_and_a_reserve_answer_books_pools():
    core = _opened()
    core.book_late_grant(results.AcquireResult(granted=6, granted_pages=6))
    core.book_pools(_reserved({"w": 3}))
    assert core.credit.reserve_pages == 6 and (core.pools, core.holds) == ({"w": 3}, {})
    assert core.last_reserve is not None and core.last_reserve.pools == {"w": 3}


# ------------------------------------------------------------------------------ usability
def test_usable_until_evicted_closed_or_forked():
    core = _opened()
    core.check_usable()
    assert not core.ended
    err = core.error_of(_reply_error("evicted"))
    assert isinstance(err, SessionEvicted) and core.evicted and core.ended
    with pytest.raises(SessionEvicted):
        core.check_usable()
    closed = _opened()
    closed.closed = True
    with pytest.raises(BrokerError, match="closed"):
        closed.check_usable()
    forked = _core(pid=os.getpid() + 1)
    with pytest.raises(BrokerError, match="after fork") as info:
        forked.check_usable()
    assert info.value.code == "not_owner"


# Python 3.12+ warns that fork() in a process with threads (the suite's brokers and clients)
# may deadlock the child; this child only writes to a pipe and leaves with os._exit.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_real_fork_makes_the_parents_core_unusable_in_the_child():
    core = _opened()
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its copy of the parent's core must refuse
        verdict = b"usable"
        try:
            core.check_usable()
        except BrokerError as exc:
            verdict = exc.code.encode()
        finally:
            os.write(write_end, verdict)
            os._exit(0)
    os.close(write_end)
    verdict = os.read(read_end, 64)
    os.close(read_end)
    os.waitpid(child, 0)
    assert verdict == b"not_owner"
    core.check_usable()  # still usable in the parent


def test_other_errors_leave_the_session_usable():
    core = _opened()
    err = core.error_of(_reply_error("budget_exceeded"))
    assert err.code == "budget_exceeded" and err.retryable and not core.evicted


def test_requests_need_a_session_token_first():
    with pytest.raises(AssertionError, match="hello first"):
        _core().session_token()
    build = _opened().reserve_request({"w": 1}, None, {"kv": 2}, True)
    req = build(11)
    assert (req.id, req.session, req.pools, req.holds, req.usage, req.measured_base) == (
        11, "token-one", {"w": 1}, {"kv": 2}, None, True)


def _reserved(pools: dict[str, int], holds: dict[str, int] | None = None) -> results.ReserveResult:
    """A reserve's answer with these pools and holds (the instance's room left at 0)."""
    return results.ReserveResult(pools=pools, holds=holds or {}, reserved_bytes=0, measured_bytes=0,
                                 grantable_bytes=0, ever_bytes=0)
