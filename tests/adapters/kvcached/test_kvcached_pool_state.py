"""adapters/kvcached/pool_state.py: the pool's phases, and the invariant it keeps with the governor.

The property test drives the real ``PoolGovernor`` against models of kvcached 0.1.6 and of a
broker (tests/adapters/kvcached/kvcached_model.py), with the engine's allocations and frees, kvcached's prealloc
thread and a prefix cache's evictions run *between any two of the governor's own calls*, as
their threads can, and checks at every mutation, not only between steps:

* ``mapped <= limit``: kvcached maps at most its allocator's size (the model's own rule);
* ``limit <= granted`` while the pool is governed: every size kvcached is given, and every grant
  the broker takes back, keeps the size at most what the broker granted;
* ``said <= mapped``: every count of mapped pages the broker is told is at most what the device
  would measure then (the engine's alloc counts a page in use before it has mapped it, and the
  broker takes a page said mapped off its promised charge);
* the locks: the broker is never called while the governor holds kvcached's manager lock, and a
  closed pool's reserve is trimmed only under it (kvcached's own trim and resize unmap outside
  the allocator's mutex: an engine's ``alloc_page`` meeting that moment would wait for ever);

and after each rule: what the pool's state says the broker was told (``Told``) is what the
broker took, an ungoverned pool holds no operator cap, the governor never gets a ``stale`` or ``conflict`` from kvcached (its
revisions are newer than any the pool saw), never calls the broker once it stopped governing
(except the best-effort give-back of a failed start), and a pool that closed, once the engine
freed its blocks, gave back its whole grant.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcached_broker.adapters.kvcached import eviction
from kvcached_broker.adapters.kvcached.policy import RAMP_AHEAD_S
from kvcached_broker.adapters.kvcached.pool_state import (
    _NEXT,
    AskBook,
    Event,
    GrowPacing,
    Phase,
    PoolState,
    PoolStateError,
    Standing,
    Told,
    limit_after_grant,
    surplus_pages,
)

from kvcached_model import ModelPool

PAGE_SIZE = 4096  # per-layer bytes of one page id; one layer, one buffer: a pool page is 4 KiB
VIRTUAL_PAGES = 48


# ---------------------------------------------------------------- the phase table
def _state_in(phase: Phase) -> PoolState:
    state = PoolState(governed=True)
    state.phase = phase
    if phase is Phase.DEFERRING:
        state.pending_limit = 3
    return state


def _fire(state: PoolState, event: Event) -> None:
    {Event.DEFER: lambda: state.defer(2, "deferred"), Event.SETTLE: state.settle,
     Event.UNGOVERN: lambda: state.ungovern("gone"), Event.CLOSE: state.close, Event.FORGET: state.forget}[event]()


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("event", list(Event))
def test_every_event_goes_where_the_table_says_or_is_refused_and_changes_nothing(phase, event):
    state = _state_in(phase)
    before = (state.phase, state.pending_limit, state.blocked, state.why_ungoverned)
    allowed = (phase, event) in _NEXT
    # ungovern and close say "already" where the pool is past them, and a round under way when the
    # pool stopped being governed (or was closed) defers and settles nothing: no error, no change
    quiet = ((event is Event.UNGOVERN and phase is Phase.DONE)
             or (event is Event.CLOSE and phase in (Phase.CLOSING, Phase.DONE))
             or (event in (Event.DEFER, Event.SETTLE) and phase in (Phase.UNGOVERNED, Phase.CLOSING, Phase.DONE)))
    if allowed or quiet:
        _fire(state, event)
        assert state.phase is (_NEXT[(phase, event)] if allowed else phase)
        if quiet:
            assert (state.phase, state.pending_limit, state.blocked, state.why_ungoverned) == before
    else:
        with pytest.raises(PoolStateError, match=f"phase {phase.value} cannot {event.value}"):
            _fire(state, event)
        assert (state.phase, state.pending_limit, state.blocked, state.why_ungoverned) == before
    if state.phase is Phase.DEFERRING:
        assert state.pending_limit is not None
    elif state.phase in (Phase.GOVERNED, Phase.UNGOVERNED):
        assert state.pending_limit is None


def test_ungoverning_a_deferring_pool_drops_its_pending_limit_and_says_why_once():
    state = _state_in(Phase.DEFERRING)
    assert state.ungovern("evicted") and state.phase is Phase.UNGOVERNED and state.pending_limit is None
    assert not state.ungovern("later") and state.why_ungoverned == "evicted"
    assert not state.governed and not state.closed


def test_a_closing_pool_counts_as_governed_until_its_grant_is_forgotten():
    state = PoolState(governed=True)
    assert state.close() and state.governed and state.closed and not state.close()
    state.forget()
    assert state.done and not state.governed and state.closed


def test_revisions_are_newer_than_any_the_pool_saw():
    state = PoolState(governed=True)
    assert state.next_revision(-1, -1) == 1
    assert state.next_revision(7, 2) == 8  # an outside caller's
    assert state.next_revision(-1, 20) == 21  # kvcached's own
    assert state.next_revision(-1, -1) == 22


def test_the_ask_book_keeps_the_largest_miss_sums_asks_and_refuses_an_older_outside_revision():
    counters = {"pressure_asks": 0, "misses": 0}
    book = AskBook(counters)
    book.missed(3)
    book.missed(2)
    book.ask_back(4)
    book.ask_back(5, soft=True)
    assert book.outside_limit(10, revision=5) and not book.outside_limit(9, revision=4)
    asks = book.take(polled_pages=2)
    assert (asks.pressure_pages, asks.soft_pages, asks.short_pages) == (6, 5, 3)
    assert counters == {"pressure_asks": 3, "misses": 2}
    assert book.take_outside_cap() == 10 and book.take_outside_cap() is None
    assert not book.take().any_pressure and book.outside_revision == 5


def test_pacing_backs_off_after_refusals_and_asks_for_the_whole_batch_every_other_time():
    pacing = GrowPacing()
    assert pacing.may_grow(0.0, short=False) and pacing.min_pages(8, 1, waiting=False) == 1
    pacing.refused(1.0)
    assert not pacing.may_grow(1.01, short=False) and pacing.may_grow(1.01, short=True)
    assert pacing.may_grow(1.05, short=False) and pacing.min_pages(8, 1, waiting=False) == 8
    assert pacing.min_pages(8, 1, waiting=True) == 1
    pacing.refused(2.0)
    assert not pacing.may_grow(2.09, short=False) and pacing.min_pages(8, 1, waiting=False) == 1
    pacing.granted()
    pacing.quiet(3.0)
    assert not pacing.may_grow(4.9, short=False) and pacing.may_grow(5.0, short=False)


def test_the_limit_never_passes_the_grant_nor_the_ceiling_and_only_what_is_above_the_size_goes_back():
    assert limit_after_grant(10, 6) == 6 and limit_after_grant(4, 6) == 4 and limit_after_grant(-1, 6) == 0
    assert surplus_pages(10, 7) == 3 and surplus_pages(10, 7, at_most=2) == 2 and surplus_pages(5, 7) == 0


def test_the_first_round_syncs_once_and_kvcacheds_size_falling_is_seen_against_the_last_round():
    state = PoolState(governed=True)
    assert state.take_sync() and not state.take_sync() and not state.take_sync()
    assert not state.limit_fell(0)  # no round ended yet: nothing to compare with
    state.round_ended(10)
    assert state.limit_fell(9) and not state.limit_fell(10) and not state.limit_fell(11)
    state.round_ended(4)
    assert not state.limit_fell(9)


def test_an_operator_cap_bounds_the_ceiling_until_it_is_lifted_or_the_pool_is_ungoverned():
    state = PoolState(governed=True)
    assert state.ceiling(48) == 48 and state.operator_cap_pages is None
    assert state.take_cap(10) and not state.take_cap(10) and state.ceiling(48) == 10
    assert state.take_cap(60) and state.ceiling(48) == 48  # a cap above the virtual size bounds nothing
    assert state.take_cap(None) and state.ceiling(48) == 48 and not state.take_cap(None)
    assert state.take_cap(7) and state.ungovern("evicted")
    assert state.operator_cap_pages is None and state.ceiling(48) == 48
    closing = PoolState(governed=True)
    closing.take_cap(5)
    closing.close()
    closing.forget()
    assert closing.operator_cap_pages == 5  # done, not ungoverned: the cap stays for status


def test_only_the_state_says_why_a_give_back_fell_short_and_an_answer_keeps_a_pending_limit():
    state = PoolState(governed=True)
    state.defer(3, "deferred: 2 pages in use")
    state.answer()  # a soft ask answered over free pages meanwhile
    assert state.phase is Phase.DEFERRING and state.pending_limit == 3 and state.blocked == ""
    state.answer("rejected: no")
    assert state.blocked == "rejected: no" and state.phase is Phase.DEFERRING
    state.settle()
    assert state.blocked == "" and state.pending_limit is None and state.phase is Phase.GOVERNED
    state.answer("at its floor")
    assert state.blocked == "at its floor" and state.phase is Phase.GOVERNED


def test_a_standing_release_is_taken_once_from_any_thread():
    book = AskBook({"pressure_asks": 0, "misses": 0})
    assert not book.take_standing().due
    book.release_standing(quiet=False)
    book.release_standing(quiet=False)
    taken = book.take_standing()
    assert taken.due and not taken.quiet and not book.take_standing().due
    book.release_standing(quiet=False)
    book.release_standing()  # one of them quiet: the round is quieted
    assert book.take_standing() == Standing(due=True, quiet=True) and book.take_standing() == Standing()


def test_what_the_broker_was_told_is_told_again_only_when_it_changed():
    told = Told()
    assert told.mapped_news(0) is False and told.mapped_news(3)
    told.told_mapped(3)
    assert not told.mapped_news(3) and told.mapped_news(2)
    assert told.idle_news(0)  # never told: even 0 is news
    told.told_idle(0)
    assert not told.idle_news(0)
    views = (("kvcached.mha.limit", 4096),)
    assert told.views_news(views)
    told.told_views(views)
    assert not told.views_news(views) and told.views_news(())
    assert told.zero_page_refused() and not told.zero_page_refused() and told.zero_page_refusals == 2
    assert not told.renamed()  # never reported: nothing to move to a new key
    told.zero_page = True
    assert told.renamed() and not told.zero_page and not told.renamed()


# ---------------------------------------------------------------- a give-back, performed
def _busy_pool(capacity: int = 40) -> ModelPool:
    """A governed pool of the models, 24 pages in use (12 of them a finished request's, in the
    prefix cache) and a few free, after one round."""
    pool = ModelPool(capacity, virtual_pages=VIRTUAL_PAGES, page_size=PAGE_SIZE)
    pool.governor.start()
    pool.governor.attach(pool.manager)
    eviction.register_eviction_hook(pool.manager, pool.cache)
    for now_s in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0):
        if pool.allocator.inuse < 24:
            pool.allocator.alloc(min(4, 24 - pool.allocator.inuse, pool.allocator.total - pool.allocator.mapped))
        pool.governor.step(now_s)
    pool.cache.cached = 12
    assert pool.allocator.inuse == 24 and pool.broker.pages > 24
    return pool


@pytest.mark.parametrize("soft", [True, False])
def test_a_soft_ask_takes_only_idle_pages_and_a_hard_one_defers_the_rest(soft):
    """The broker asks for more than the pool holds idle (its free pages and its prefix cache's
    12 pages): a soft ask lowers the limit over what the eviction freed and stops there; a hard
    one defers the rest, below what running requests use, until blocks are freed."""
    pool = _busy_pool()
    governor, allocator, manager, broker = pool.governor, pool.allocator, pool.manager, pool.broker
    try:
        governor.ask_back(broker.pages, soft=soft)
        governor.step(10.0)
        assert allocator.inuse == 12  # the prefix cache's pages were evicted
        if soft:
            assert governor.pending_limit is None and not manager.in_shrink
            assert allocator.total >= allocator.inuse and broker.pages == allocator.total
        else:
            assert governor.pending_limit == 1 and manager.in_shrink  # down to the null block's page
            assert broker.pages == allocator.total == 12
    finally:
        eviction.register_eviction_hook(manager, None)


@pytest.mark.parametrize("soft", [True, False])
def test_a_lowering_the_engine_overtook_is_withdrawn_unless_a_hard_ask_wants_the_pages(soft):
    """The broker asks for two of the pool's free pages, and the engine takes every free page
    before kvcached resizes: kvcached defers the lower limit, below what is now in use, and
    serves no free page while it waits.  A soft ask wanted idle pages only: the lowering is
    withdrawn (the limit stays, nothing pending, nothing released).  A hard one keeps it
    pending: the pages go back as blocks are freed."""
    pool = _busy_pool()
    governor, allocator, manager, broker = pool.governor, pool.allocator, pool.manager, pool.broker
    try:
        limit, granted = allocator.total, broker.pages
        assert limit - allocator.inuse > 2
        real_resize = allocator.resize

        def resize_after_the_engine(size):
            if size // allocator.page_size < allocator.total:  # the lowering: the engine came first
                assert allocator.alloc(allocator.total - allocator.inuse)
            return real_resize(size)

        allocator.resize = resize_after_the_engine
        governor.ask_back(2, soft=soft)
        governor.step(10.0)
        assert allocator.inuse == limit  # the engine took every page
        if soft:
            assert governor.pending_limit is None and not manager.in_shrink
            assert allocator.total == limit and broker.pages == granted
            assert governor.counters["withdrawn"] == 1
        else:
            assert governor.pending_limit == limit - 2 and manager.in_shrink
            assert governor.counters["withdrawn"] == 0
    finally:
        eviction.register_eviction_hook(manager, None)


@pytest.mark.parametrize("soft", [True, False])
def test_an_ask_while_a_hard_limit_is_pending_takes_the_free_pages_and_keeps_the_hard_one(soft):
    """kvcached keeps one pending target.  An ask's lowering over free pages, made while a hard
    ask's lower limit waits for frees, replaces it: applied, it ends kvcached's shrink, and the
    pages the first ask wanted would never go back.  So the free pages go back at once, and the
    pending limit is applied again, deferred until the rest is freed."""
    pool = _busy_pool()
    governor, allocator, manager, broker = pool.governor, pool.allocator, pool.manager, pool.broker
    try:
        governor.ask_back(broker.pages)  # hard: down to the null block's page, deferred
        governor.step(10.0)
        assert governor.pending_limit == 1 and manager.in_shrink
        manager.free(4)  # some blocks are freed, not enough for the pending limit: pages free
        size = allocator.total
        assert size > allocator.inuse > 1 and manager.in_shrink
        governor.ask_back(1, soft=soft)
        governor.step(10.1)
        governor.step(10.2)
        assert allocator.total == size - 1 and broker.pages == allocator.total  # a free page went back
        assert governor.pending_limit == 1 and manager.in_shrink and manager.target_pages == 1
        manager.free(allocator.inuse - 1)  # the rest is freed: the first ask's pages go back
        governor.step(10.3)
        assert governor.pending_limit is None and allocator.total == 1 and broker.pages == 1
    finally:
        eviction.register_eviction_hook(manager, None)


def test_a_hard_ask_beyond_the_free_pages_while_a_limit_is_pending_never_raises_the_pending_limit():
    """A second hard ask, for more than the pool has free, made while the first one's lower
    limit waits for frees: its free pages go back at once and the rest is deferred, at the lower
    of the two limits (kvcached keeps one: a higher one would give back less than the first ask
    wanted)."""
    pool = _busy_pool()
    governor, allocator, manager, broker = pool.governor, pool.allocator, pool.manager, pool.broker
    try:
        governor.ask_back(broker.pages)  # hard: down to the null block's page, deferred
        governor.step(10.0)
        assert governor.pending_limit == 1
        manager.free(4)
        free = allocator.total - allocator.inuse
        assert free > 0
        governor.ask_back(free + 3)
        governor.step(10.1)
        assert allocator.total == allocator.inuse and broker.pages == allocator.total  # the free pages went
        assert governor.pending_limit == 1 and manager.in_shrink and manager.target_pages == 1
    finally:
        eviction.register_eviction_hook(manager, None)


# ---------------------------------------------------------------- a burst, seen
def _idle_pool(used_pages: int) -> ModelPool:
    """A governed pool with ``used_pages`` in use, idle for a while: one batch or so free."""
    pool = ModelPool(400, virtual_pages=400, page_size=PAGE_SIZE)
    pool.governor.start()
    pool.governor.attach(pool.manager)
    for now_s in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0):
        if pool.allocator.inuse < used_pages:
            pool.allocator.alloc(min(4, used_pages - pool.allocator.inuse, pool.allocator.total - pool.allocator.mapped))
        pool.governor.step(now_s)
    for now_s in (10.0, 11.0):
        pool.governor.step(now_s)
    assert pool.allocator.inuse == used_pages and 0 < pool.allocator.total - used_pages <= pool.MARKS.high_pages
    return pool


@pytest.mark.parametrize("between_s, missed", [(0.03125, True), (0.25, True), (0.03125, False)])
def test_a_burst_on_the_pools_free_pages_is_sized_by_its_rate_when_the_engine_runs_out(between_s, missed):
    """The engine takes every free page between two rounds, then misses.  Taken in 1/32 s, a
    rate a batch would not cover: the growth it waits for is what that rate uses in
    ``RAMP_AHEAD_S`` (a burst), not one batch, so it does not run short again while the
    governor finds the rate.  Taken in 0.25 s, or with no miss (the pool grows ahead of need
    as ever): one batch."""
    pool = _idle_pool(10)
    governor, allocator, broker = pool.governor, pool.allocator, pool.broker
    taken = allocator.total - allocator.inuse
    assert allocator.alloc(taken)
    if missed:
        governor.note_alloc(1, None, PAGE_SIZE)  # the next allocation found no free page
    granted = broker.pages
    governor.step(11.0 + between_s)
    rate_batch = math.ceil(taken / between_s * RAMP_AHEAD_S)
    expected = rate_batch if missed and rate_batch > pool.MARKS.batch_pages else pool.MARKS.batch_pages
    assert broker.pages - granted == expected
    assert allocator.total == allocator.inuse + expected  # the limit follows the grant


# ---------------------------------------------------------------- the governor, property-tested
class GovernedPool(RuleBasedStateMachine):
    """One governed pool: the real governor, kvcached and a broker as models, and the engine."""

    @initialize(capacity=st.integers(min_value=4, max_value=2 * VIRTUAL_PAGES), hook=st.booleans())
    def start(self, capacity, hook):
        self.now_s = 0.0
        self.revision = 100  # an outside caller's revisions (kvcached's start at -1)
        self.schedule: list[str] = []
        self.interleaving = False
        self.violations: list[str] = []
        pool = ModelPool(capacity, virtual_pages=VIRTUAL_PAGES, page_size=PAGE_SIZE)
        self.geometry, self.allocator, self.broker = pool.geometry, pool.allocator, pool.broker
        self.manager, self.cache, self.governor = pool.manager, pool.cache, pool.governor
        self.allocator.check = self.broker.check = self.check
        self.broker.said_mapped = self.said_mapped
        self.broker.called = self.broker_called
        self.allocator.trimmed = self.trimmed
        self.governor.start()
        self.started = True
        self.allocator.interleave = self.interleave
        if hook:
            eviction.register_eviction_hook(self.manager, self.cache)
        self.governor.attach(self.manager)

    def teardown(self):
        if hasattr(self, "manager"):
            eviction.register_eviction_hook(self.manager, None)

    # -------------------------------------------------------- the invariant, at every mutation
    def check(self) -> None:
        """Called at every mutation, from inside the governor's calls too: a violation is kept,
        since the governor logs and carries on after any exception kvcached raises."""
        if not getattr(self, "started", False):
            return
        a = self.allocator
        if not (0 <= a.inuse and 0 <= a.reserved and a.mapped <= a.total):
            self.violations.append(f"kvcached mapped {a.mapped} beyond its size {a.total}")
        if self.governor.governed and self.governor.grants is not None and a.total > self.broker.pages:
            self.violations.append(f"kvcached's size {a.total} above the grant {self.broker.pages} "
                                   f"({self.governor.state.phase})")
        assert not self.violations, self.violations[0]

    def said_mapped(self, pages: int) -> None:
        if pages > self.allocator.physical:
            self.violations.append(f"the broker was told {pages} pages are mapped; {self.allocator.physical} are "
                                   f"({self.allocator.mapping} still being mapped)")

    def broker_called(self) -> None:
        if self.manager._lock.held:
            self.violations.append("the broker was called under kvcached's manager lock")

    def trimmed(self) -> None:
        if not self.manager._lock.held:
            self.violations.append("kvcached's reserve was trimmed outside its manager lock")

    def interleave(self) -> None:
        """The engine's or kvcached's threads act between two of the governor's calls."""
        if self.interleaving or not self.schedule:
            return
        self.interleaving = True
        try:
            self.act(self.schedule.pop(0), 2)
        finally:
            self.interleaving = False

    def act(self, what: str, pages: int) -> None:
        if what in ("alloc", "prealloc") and self.governor.closed:
            return  # kvcached stopped its prealloc thread at shutdown, and the engine allocates no more
        if what in ("alloc", "free") and self.manager._lock.held:
            return  # the engine waits for the manager's lock, and acts once the governor let it go
        if what == "mapped":  # the engine's alloc under way finishes mapping its pages
            self.allocator.finish_mapping()
        elif what == "alloc":
            got = self.allocator.alloc(pages)
            self.governor.note_alloc(pages, object() if got else None, PAGE_SIZE)
        elif what == "free":  # a running request's blocks: not the prefix cache's
            self.manager.free(min(pages, self.allocator.inuse - self.cache.cached))
            self.governor.note_free()
        elif what == "finish":  # a request finished into the prefix cache
            self.cache.cached = min(self.allocator.inuse, self.cache.cached + pages)
        elif what == "prealloc":
            self.allocator.prealloc()
        elif what == "shutdown":  # the engine shuts the pool down (KVCacheManager.shutdown)
            self.governor.close()

    # -------------------------------------------------------- what happens to a pool
    @rule(what=st.sampled_from(["alloc", "free", "finish", "prealloc", "mapped"]), pages=st.integers(1, 12))
    def engine(self, what, pages):
        self.interleaving = True  # the engine's own call: nothing else runs inside it
        try:
            self.act(what, pages)
        finally:
            self.interleaving = False

    @rule(pages=st.integers(1, 24), soft=st.booleans())
    def pressure(self, pages, soft):
        self.governor.ask_back(pages, soft=soft)

    @rule(cap_pages=st.integers(0, VIRTUAL_PAGES), older=st.booleans())
    def outside_limit(self, cap_pages, older):
        self.revision += -50 if older else 1
        if self.governor.governed:  # what the patched set_memory_limit does with an outside call
            self.governor.outside_limit(self.manager, cap_pages * self.geometry.page_bytes, self.revision)
        elif not self.governor.closed:  # kvcached alone takes it
            self.manager.set_memory_limit(cap_pages * self.geometry.page_bytes, revision=self.revision)
            self.manager.statuses.pop()  # not the governor's own call

    @rule(mode=st.sampled_from(["grant", "grant", "grant", "refuse", "lost", "evict"]))
    def broker_turns(self, mode):
        if self.broker.why_lost is not None:
            return  # a process that turned unprotected stays so
        self.broker.mode = mode

    @rule(dt_s=st.sampled_from([0.0, 0.01, 0.06, 0.6, 2.5]),
          schedule=st.lists(st.sampled_from(["alloc", "free", "finish", "prealloc", "alloc", "free", "mapped",
                                             "shutdown"]),
                            max_size=6))
    def step(self, dt_s, schedule):
        self.now_s += dt_s
        self.schedule = list(schedule)
        governed_before, closed_before = self.governor.governed, self.governor.closed
        calls_before = self.broker.calls_after_lost
        self.governor.step(self.now_s)  # raises nothing: the runner would log it and skip the round
        self.schedule = []
        if not governed_before:
            assert self.broker.calls_after_lost == calls_before, "an ungoverned pool called the broker"
        if governed_before and not closed_before and not self.governor.governed and not self.governor.closed:
            # it stopped being governed in this round: it runs as kvcached alone, at its whole size
            assert self.allocator.total == VIRTUAL_PAGES and not self.manager.in_shrink, (
                f"an ungoverned pool left at {self.allocator.total} pages, shrink pending: {self.manager.in_shrink}")

    @rule()
    def shut_down(self):
        self.governor.close()

    # -------------------------------------------------------- after every rule
    @invariant()
    def mapped_within_limit_within_grant_at_every_moment(self):
        assert not self.violations, self.violations[0]

    @invariant()
    def revisions_are_never_stale(self):
        assert not {"stale", "conflict"} & set(self.manager.statuses), self.manager.statuses

    @invariant()
    def the_state_says_what_the_broker_took(self):
        told = self.governor.state.told
        assert told.mapped_pages == (self.broker.mapped_said or 0), (told.mapped_pages, self.broker.mapped_said)
        assert told.idle_pages == self.broker.idle_said, (told.idle_pages, self.broker.idle_said)
        assert told.views == self.broker.views_said, (told.views, self.broker.views_said)
        assert told.zero_page == self.broker.zero_page_taken

    @invariant()
    def an_ungoverned_pool_holds_no_operator_cap(self):
        if self.governor.state.phase is Phase.UNGOVERNED:
            assert self.governor.operator_cap_pages is None
            assert self.governor.pages().ceiling == VIRTUAL_PAGES

    @invariant()
    def the_state_agrees_with_the_pool(self):
        state = self.governor.state
        if state.phase is Phase.DEFERRING:
            assert state.pending_limit is not None
        elif state.phase in (Phase.GOVERNED, Phase.UNGOVERNED):
            assert state.pending_limit is None, state.phase
        self.check()

    @precondition(lambda self: self.governor.closed)
    @rule()
    def a_closed_pool_gives_its_whole_grant_back_once_its_blocks_are_freed(self):
        """Any time after shutdown (other rules run on the closed pool before): the engine frees
        every block, and one round later nothing is mapped and nothing is granted."""
        if self.broker.why_lost is not None or self.broker.evictions:
            return  # a broker that is gone or evicted the session frees the grant itself
        mode, self.broker.mode = self.broker.mode, "grant"
        self.cache.cached = 0
        self.manager.free(self.allocator.inuse)
        self.governor.step(self.now_s)
        assert self.broker.pages == 0 and self.allocator.mapped == 0 and self.governor.state.done
        self.broker.mode = mode


GovernedPool.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_the_governor_keeps_mapped_within_limit_within_grant = GovernedPool.TestCase
