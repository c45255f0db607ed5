"""The client's credit reserve alone (``client/credit.py``): examples, and a Hypothesis state
machine that drives a :class:`CreditReserve` against a simulated broker and checks its
documented invariants and watermarks after every step."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcached_broker.client.credit import (
    DEFAULT_CREDIT_BYTES,
    MAX_DEFAULT_CREDIT_PAGES,
    CreditReserve,
    default_credit_pages,
    split_grant,
)
from kvcached_broker.client.errors import BadRequest

EXAMPLES = int(os.environ.get("CREDIT_EXAMPLES", "100"))
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])

PAGES = st.integers(min_value=1, max_value=40)


def _asks():
    """``(pages, min_pages)`` as the client accepts them: pages >= 1, min_pages None or 0..pages."""
    return PAGES.flatmap(lambda p: st.tuples(st.just(p), st.none() | st.integers(min_value=0, max_value=p)))


def _books(credit: CreditReserve) -> tuple[int, int, bool]:
    return credit.reserve_pages, credit.held_pages, credit.used


# ----------------------------------------------------------------------------- examples
def test_watermarks_follow_the_target():
    credit = CreditReserve(8)
    assert (credit.low_pages, credit.high_pages) == (4, 16)
    assert (CreditReserve(1).low_pages, CreditReserve(1).high_pages) == (0, 2)
    assert (CreditReserve(0).low_pages, CreditReserve(0).high_pages) == (0, 0)


def test_a_negative_target_is_refused():
    with pytest.raises(ValueError, match="credit_pages must be >= 0"):
        CreditReserve(-1)


def test_default_credit_is_about_64_mib_between_1_and_32_pages():
    assert default_credit_pages(2 << 20) == 32  # 64 MiB of 2 MiB pages
    assert default_credit_pages(4 << 20) == 16
    assert default_credit_pages(4096) == MAX_DEFAULT_CREDIT_PAGES  # 16384 pages, capped
    assert default_credit_pages(DEFAULT_CREDIT_BYTES) == 1
    assert default_credit_pages(1 << 30) == 1  # one page is larger than 64 MiB: still one
    assert default_credit_pages(0) == MAX_DEFAULT_CREDIT_PAGES  # no division by zero


def test_a_first_acquire_asks_for_the_pages_plus_a_full_reserve():
    credit = CreditReserve(8)
    assert not credit.take(3) and credit.used
    assert credit.ask(3, None) == (11, 3)
    assert credit.settle(3, None, 11) == 3
    assert _books(credit) == (8, 3, True)
    assert credit.take(5) and _books(credit) == (3, 8, True)  # no round trip
    assert credit.refill_wanted() == 5  # 3 < low watermark 4: top up to 8


def test_a_short_reserve_asks_only_the_shortfall_as_the_minimum():
    credit = CreditReserve(4, reserve_pages=3)
    assert credit.ask(10, None) == (11, 7)  # 7 more are needed; the 4 of refill only if they fit
    assert credit.ask(10, 2) == (11, 0)  # the reserve already covers the minimum
    assert credit.ask(10, 5) == (11, 2)
    assert credit.settle(10, 5, 2) == 5 and _books(credit) == (0, 5, False)  # the most there is


def test_a_refused_all_or_nothing_grant_keeps_what_came_in_the_reserve():
    credit = CreditReserve(4, reserve_pages=3)
    assert credit.settle(10, None, 6) == 0  # 9 < 10: refused
    assert _books(credit) == (9, 0, False)  # still charged to the session, kept at hand
    assert credit.trim() == 5 and credit.reserve_pages == 4  # 9 > 8: back down to the target


def test_put_back_keeps_the_reserve_between_the_watermarks():
    credit = CreditReserve(4, held_pages=20)
    assert credit.put_back(8) == 0 and credit.reserve_pages == 8  # at the high watermark: kept
    assert credit.put_back(1) == 5 and credit.reserve_pages == 4  # above it: back to the target
    assert credit.held_pages == 11


def test_put_back_of_more_than_held_is_bad_request_and_changes_nothing():
    credit = CreditReserve(4, reserve_pages=2, held_pages=3)
    with pytest.raises(BadRequest) as info:
        credit.put_back(4)
    assert info.value.code == "bad_request" and info.value.details == {"pages": 4, "held_pages": 3}
    assert _books(credit) == (2, 3, False)


def test_no_reserve_with_credit_pages_0():
    credit = CreditReserve(0)
    assert not credit.take(2) and credit.ask(2, None) == (2, 2)
    assert credit.settle(2, None, 2) == 2 and _books(credit) == (0, 2, True)
    assert credit.put_back(2) == 2 and credit.reserve_pages == 0  # every freed page goes back
    assert credit.refill_wanted() == 0


def test_no_background_refill_before_the_first_ask():
    credit = CreditReserve(8)
    assert credit.refill_wanted() == 0  # a session that only reserves keeps no idle credit
    credit.take(1)
    assert credit.refill_wanted() == 8


def test_detach_and_reattach_move_only_reserve_pages():
    credit = CreditReserve(8, reserve_pages=5, held_pages=2)
    assert credit.detach(9) == 5 and _books(credit) == (0, 2, False)
    credit.reattach(5)  # the give-back failed: the pages are still this session's
    assert _books(credit) == (5, 2, False)


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(
    reserve=st.integers(min_value=0, max_value=64),
    granted=st.integers(min_value=0, max_value=64),
    ask=_asks(),
)
def test_split_grant_gives_the_caller_all_it_may_have_or_nothing(reserve, granted, ask):
    pages, min_pages = ask
    floor = pages if min_pages is None else min_pages
    give, reserve_after = split_grant(reserve, granted, pages, min_pages)
    assert give + reserve_after == reserve + granted  # nothing lost or made up
    assert reserve_after >= 0
    assert give == 0 or floor <= give <= pages
    most = min(pages, reserve + granted)
    assert give == (most if most >= floor and most > 0 else 0)  # the most, or refused


# ----------------------------------------------------------------------------- state machine
class CreditMachine(RuleBasedStateMachine):
    """A credit reserve and the broker's side of its books.

    ``granted`` is what the simulated broker has granted the session and not been given back;
    an ask may be answered with any grant of 0..ask pages, possibly after other calls ran
    (many calls may be in flight on one asyncio client).
    """

    @initialize(credit_pages=st.integers(min_value=0, max_value=12))
    def start(self, credit_pages):
        self.credit = CreditReserve(credit_pages)
        self.target = credit_pages
        self.granted = 0
        self.took = False  # whether any call asked for a page yet
        self.in_flight: list[tuple[int, int | None, int, int, int]] = []

    # -- calls that need no broker
    @rule(pages=PAGES)
    def take(self, pages):
        before = self.credit.reserve_pages
        served = self.credit.take(pages)
        self.took = True
        assert served == (before >= pages)
        assert self.credit.reserve_pages == (before - pages if served else before)

    @rule(data=st.data())
    def put_back(self, data):
        credit = self.credit
        if credit.held_pages == 0:
            return
        pages = data.draw(st.integers(min_value=1, max_value=credit.held_pages), label="pages")
        surplus = credit.put_back(pages)
        assert surplus >= 0
        self.granted -= surplus  # the surplus goes back to the broker
        assert credit.reserve_pages <= credit.high_pages
        if surplus:
            assert credit.reserve_pages == self.target  # back down to the target, not below
        if self.target == 0:
            assert credit.reserve_pages == 0 and credit.low_pages == credit.high_pages == 0

    @rule(extra=st.integers(min_value=1, max_value=10))
    def put_back_more_than_held_is_refused(self, extra):
        before = _books(self.credit)
        pages = self.credit.held_pages + extra
        with pytest.raises(BadRequest):
            self.credit.put_back(pages)
        assert _books(self.credit) == before

    # -- calls that go to the broker
    @rule(ask=_asks())
    def ask(self, ask):
        """An acquire the reserve cannot serve: what it asks the broker for."""
        pages, min_pages = ask
        credit = self.credit
        if credit.take(pages):  # the client tries the reserve first
            self.took = True
            return
        self.took = True
        floor = pages if min_pages is None else min_pages
        ask_pages, ask_min = credit.ask(pages, min_pages)
        assert ask_pages == pages - credit.reserve_pages + self.target  # the shortfall plus a refill
        assert 0 <= ask_min <= ask_pages
        assert ask_min == max(0, floor - credit.reserve_pages)
        self.in_flight.append((pages, min_pages, ask_pages, ask_min, credit.reserve_pages))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def settle(self, data):
        index = data.draw(st.integers(min_value=0, max_value=len(self.in_flight) - 1), label="which")
        pages, min_pages, ask_pages, ask_min, reserve_at_ask = self.in_flight.pop(index)
        edges = {0, max(0, ask_min - 1), ask_min, ask_pages - self.target, ask_pages}  # where the split turns
        granted = data.draw(st.sampled_from(sorted(edges)) | st.integers(min_value=0, max_value=ask_pages),
                            label="granted")
        credit = self.credit
        reserve_now = credit.reserve_pages
        self.granted += granted
        give = credit.settle(pages, min_pages, granted)
        floor = pages if min_pages is None else min_pages
        assert give == 0 or floor <= give <= pages
        if reserve_now == reserve_at_ask:
            # nothing changed the reserve meanwhile: the broker's split is the client's
            assert (give, credit.reserve_pages) == split_grant(reserve_at_ask, granted, pages, min_pages)
            if granted >= ask_min and floor > 0:
                assert give >= floor  # the broker granted the caller's minimum: not refused
            if granted >= ask_pages - self.target:
                assert give == pages  # the shortfall came: the caller gets all it asked for
            if granted == ask_pages:
                assert credit.reserve_pages == self.target  # topped up to the target

    @rule()
    def trim(self):
        surplus = self.credit.trim()
        self.granted -= surplus
        assert self.credit.reserve_pages <= self.credit.high_pages
        if surplus:
            assert self.credit.reserve_pages == self.target

    @rule(pages=st.integers(min_value=1, max_value=60), give_back_fails=st.booleans())
    def detach(self, pages, give_back_fails):
        """Pressure: reserve pages go back first; a failed give-back reattaches them."""
        before = self.credit.reserve_pages
        taken = self.credit.detach(pages)
        assert taken == min(pages, before) and self.credit.reserve_pages == before - taken
        if give_back_fails:
            self.credit.reattach(taken)
            assert self.credit.reserve_pages == before
        else:
            self.granted -= taken

    @rule(pages=st.integers(min_value=0, max_value=30))
    def late_grant(self, pages):
        """The answer to an acquire whose caller gave up goes to the reserve."""
        self.credit.reattach(pages)
        self.granted += pages

    @rule(data=st.data())
    def refill(self, data):
        credit = self.credit
        wanted = credit.refill_wanted()
        should = self.took and self.target > 0 and credit.reserve_pages < credit.low_pages
        assert wanted == (self.target - credit.reserve_pages if should else 0)
        if wanted:
            granted = data.draw(st.integers(min_value=0, max_value=wanted), label="refill granted")
            credit.reattach(granted)
            self.granted += granted
            assert credit.reserve_pages <= self.target

    # -- after every step
    @invariant()
    def books_match_the_broker(self):
        credit = self.credit
        assert credit.reserve_pages >= 0 and credit.held_pages >= 0
        assert credit.reserve_pages + credit.held_pages == credit.granted_pages == self.granted
        assert credit.used == self.took
        assert credit.target_pages == self.target
        assert (credit.low_pages, credit.high_pages) == (self.target // 2, 2 * self.target)


TestCreditMachine = CreditMachine.TestCase
TestCreditMachine.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, **SETTINGS)
