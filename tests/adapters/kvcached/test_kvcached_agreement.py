"""kvcached's sync-point agreement alone: a pool's give-back routed through the agreement
(:class:`agreement.AgreedGrants`) still says what the governor says with it.  The pool's allocator
and grant are small stand-ins; the sync points themselves run in the kvcached+SGLang overlay
tests (tests/adapters/sglang/test_kvcached_sglang_*)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcached_broker.adapters.kvcached import agreement, eviction

from kvcached_model import ModelPool


class Allocator:
    def __init__(self, total_pages: int):
        self.total_pages = total_pages

    def get_num_total_pages(self) -> int:
        return self.total_pages


class Grants:
    """A session grant as the governor gives back through it (``release(pages, mapped=, key=)``)."""

    maps_here, ratio = True, 1

    def __init__(self, pages: int):
        self.pages, self.calls = pages, []

    def release(self, pages: int, *, mapped: int | None = None, key: str | None = None) -> bool:
        self.calls.append((pages, mapped, key))
        self.pages -= pages
        return True


class Governor:
    def __init__(self, grants: Grants, allocator: Allocator, manager: object):
        self.grants, self.real, self.governed, self.key = grants, allocator, True, "kvcached:mha:g0:1"
        self._manager = manager

    def manager(self) -> object:
        return self._manager

    def route(self) -> None:
        """As ``AgreedLimits.route_releases`` does when a governor of the session's grants is built."""
        self.grants = agreement.AgreedGrants(self.grants, agreement.Agreement(), self)


class Manager:
    """Stands in for kvcached's manager: only its identity (a weak reference) is used."""


def test_a_release_through_the_sync_points_says_the_mapped_pages_with_it():
    grants, manager = Grants(10), Manager()
    governor = Governor(grants, Allocator(6), manager)
    governor.route()

    assert governor.grants.release(4, mapped=5, key=governor.key)
    assert grants.calls == [(4, 5, governor.key)] and grants.pages == 6


def test_the_agreement_gives_back_nothing_the_pools_size_still_uses_and_says_so():
    grants, manager = Grants(10), Manager()
    governor = Governor(grants, Allocator(8), manager)
    governor.route()

    assert governor.grants.release(4, mapped=7, key=governor.key)
    assert grants.calls == [(2, 7, governor.key)] and grants.pages == 8  # only what is above its size


def test_a_release_before_the_pool_is_known_goes_straight_to_the_grant():
    grants = Grants(10)
    governor = Governor(grants, Allocator(8), None)
    governor.route()

    assert governor.grants.release(4, mapped=3, key=governor.key)
    assert grants.calls == [(4, 3, governor.key)]  # no sync point holds an offer of a pool it has not seen


# ---------------------------------------------------------------- tensor-parallel ranks, agreeing
# The property test: the real governors and agreements of RANKS tensor-parallel ranks, each with
# its own kvcached and broker session (tests/adapters/kvcached/kvcached_model.py), in one thread.
# The engine acts on every rank alike (SGLang's ranks schedule the same batches); each rank's
# broker grants, refuses, presses, goes or evicts on its own; each governor runs its rounds on its
# own; a sync point is every rank's proposal, the MIN a collective computes, then every rank's
# settle, with a rank's governor round (a release) landing inside the collective when a rule says.
# Checked at every mutation: a governed rank's kvcached size is at most its grant.  After every
# rule: every rank's kvcached size is the same (a rank's admission decisions are its peers'), no
# limit was stale or in conflict, and no offer stays held once its sync ended.

RANKS = 2
TP_VIRTUAL_PAGES = 32
TP_PAGE_SIZE = 4096


class CollectiveFailed(RuntimeError):
    pass


class QueuedEviction:
    """A pool's eviction hook as SGLang's wiring registers it: queued for the next sync point."""

    def __init__(self, agreement_: agreement.Agreement, manager: object):
        self.agreement, self.manager = agreement_, manager

    def evict(self, pages: int) -> int:
        self.agreement.request_eviction(self.manager, pages)
        return 0


def _agreed_pool(wait_s: float) -> tuple[agreement.Agreement, ModelPool]:
    """One rank's pool of the models whose limits change at sync points (``wait_s``: how long
    its governor waits for one), started."""
    agreement_ = agreement.Agreement()
    pool = ModelPool(64, virtual_pages=TP_VIRTUAL_PAGES, page_size=TP_PAGE_SIZE,
                     limits=agreement.AgreedLimits(agreement_, wait_s=wait_s))
    pool.governor.start()
    pool.governor.attach(pool.manager)
    return agreement_, pool


def _round_with_sync_points(pool, agreement_: agreement.Agreement, now_s: float, evicted: list[int],
                            before_sync: Callable[[], None] | None = None) -> int:
    """One governor round on its own thread, as SGLang runs it, while this thread is the
    scheduler: a sync point whenever the governor waits for one (``before_sync`` first: what the
    engine does before that sync); the sync points run."""
    round_ = threading.Thread(target=pool.governor.step, args=(now_s,))
    round_.start()
    syncs = 0
    while round_.is_alive():
        if agreement_.pending_wants() > 0:
            if before_sync is not None:
                before_sync()
                before_sync = None
            agreement_.sync(None, lambda asks: evicted.extend(pages for _, pages in asks),
                            [(pool.governor, pool.manager)])
            syncs += 1
        round_.join(0.001)
    return syncs


def test_a_shrink_the_engine_overtook_before_its_sync_is_withdrawn_asking_no_eviction_nor_quiet():
    """SGLang's pools change their limits only at sync points.  The governor's own shrink waits
    for the next one, and the engine's next burst takes the free pages before it: the sync
    applies the lower limit deferred, below what is in use (kvcached then serves no free page).
    The governor withdraws it at the following sync, which asks for no eviction (the shrink wanted
    free pages only: nothing cached is the broker's), and the pool, not quieted as after its
    peers' give-back, grows as soon as the engine runs low."""
    agreement_, pool = _agreed_pool(wait_s=60.0)
    governor, allocator, manager, broker = pool.governor, pool.allocator, pool.manager, pool.broker
    eviction.register_eviction_hook(manager, QueuedEviction(agreement_, manager))
    evicted: list[int] = []
    try:
        agreement_.sync(None, None, [(governor, manager)])
        now_s = 0.0
        while allocator.inuse < 24:  # a burst: the pool grows ahead of it
            allocator.alloc(min(3, allocator.total - allocator.mapped))
            now_s += 1.0
            _round_with_sync_points(pool, agreement_, now_s, evicted)
        manager.free(allocator.inuse - 2)  # the burst ends: far more free than the pool keeps
        pool.cache.cached = 2  # a finished request's blocks, cached: nothing the shrink needs
        assert allocator.total - allocator.inuse > pool.MARKS.high_pages

        def the_next_burst() -> None:
            allocator.alloc(allocator.total - allocator.mapped)

        now_s += 1.0
        syncs = _round_with_sync_points(pool, agreement_, now_s, evicted, the_next_burst)
        assert syncs == 2  # the shrink, applied deferred; its withdrawal
        assert governor.counters["withdrawn"] == 1
        assert governor.pending_limit is None and not manager.in_shrink
        assert evicted == []

        granted = broker.pages
        allocator.alloc(allocator.total - allocator.mapped)  # the engine runs low: the pool grows
        _round_with_sync_points(pool, agreement_, now_s + 0.1, evicted)
        assert broker.pages > granted and allocator.total > allocator.inuse
    finally:
        eviction.register_eviction_hook(manager, None)


def test_an_own_shrink_a_sync_applies_after_the_governor_stopped_waiting_still_gives_its_grant_back():
    """A rank's own shrink waits for the next sync point at most ``wait_s`` (here none): the
    governor goes on, releasing nothing, since kvcached's size has not fallen.  The sync then
    applies it before the round ends, so the round ends with the lower size and sees no fall
    (K3).  The grant above the new size goes back at the next round all the same, and the pool,
    whose own lowering it was, is not quieted."""
    agreement_, pool = _agreed_pool(wait_s=0.0)
    governor, allocator, manager, broker = pool.governor, pool.allocator, pool.manager, pool.broker
    pools = [(governor, manager)]
    agreement_.sync(None, None, pools)
    now_s = 0.0
    while allocator.inuse < 24:  # a burst: each growth applies at the next sync point
        allocator.alloc(min(3, allocator.total - allocator.mapped))
        now_s += 1.0
        governor.step(now_s)
        agreement_.sync(None, None, pools)
    manager.free(allocator.inuse - 2)  # the burst ends: far more free than the pool keeps
    size = allocator.total
    assert size - allocator.inuse > pool.MARKS.high_pages and broker.pages == size

    real_end_round = governor._end_round

    def sync_then_end_round(manager_):
        agreement_.sync(None, None, pools)  # the scheduler's sync point, in the middle of the round
        real_end_round(manager_)

    governor._end_round = sync_then_end_round
    now_s += 1.0
    governor.step(now_s)
    del governor._end_round
    assert allocator.total < size and broker.pages == size  # shrunk, the grant above it still held
    governor.step(now_s + 0.1)
    assert broker.pages == allocator.total  # given back
    assert governor.pacing.quiet_until_s <= now_s + 0.1


class AgreeingRanks(RuleBasedStateMachine):
    @initialize(capacities=st.lists(st.integers(2, 2 * TP_VIRTUAL_PAGES), min_size=RANKS, max_size=RANKS))
    def start(self, capacities):
        self.now_s = 0.0
        self.violations: list[str] = []
        self.ranks = []
        for capacity in capacities:
            agreement_ = agreement.Agreement()
            pool = ModelPool(capacity, virtual_pages=TP_VIRTUAL_PAGES, page_size=TP_PAGE_SIZE,
                             limits=agreement.AgreedLimits(agreement_, wait_s=0.0))
            pool.allocator.check = pool.broker.check = self.check
            pool.governor.start()
            pool.governor.attach(pool.manager)
            eviction.register_eviction_hook(pool.manager, QueuedEviction(agreement_, pool.manager))
            self.ranks.append(SimpleNamespace(allocator=pool.allocator, broker=pool.broker, manager=pool.manager,
                                              cache=pool.cache, governor=pool.governor, agreement=agreement_))
        self.started = True
        self.sync_point()  # the runtime's first sync point comes before its first batch

    def teardown(self):
        for rank in getattr(self, "ranks", []):
            eviction.register_eviction_hook(rank.manager, None)

    # -------------------------------------------------------- checked at every mutation
    def check(self) -> None:
        if not getattr(self, "started", False):
            return
        for i, rank in enumerate(self.ranks):
            if rank.governor.governed and rank.governor.grants is not None and rank.allocator.total > rank.broker.pages:
                self.violations.append(f"rank {i}: kvcached's size {rank.allocator.total} above its grant "
                                       f"{rank.broker.pages}")
        assert not self.violations, self.violations[0]

    # -------------------------------------------------------- the sync point
    def sync_point(self, inside: Callable[[], None] | None = None) -> None:
        pools = [[(rank.governor, rank.manager)] for rank in self.ranks]
        proposals = [rank.agreement.propose(p) for rank, p in zip(self.ranks, pools)]
        agreed = [min(column) for column in zip(*(proposal.offer for proposal in proposals))]
        if inside is not None:
            inside()
        for rank, p, proposal in zip(self.ranks, pools, proposals):
            rank.agreement.settle(p, proposal, agreed, self.evict_on(rank))

    @staticmethod
    def evict_on(rank):
        return lambda asks: [rank.cache.evict(pages) for _manager, pages in asks]

    # -------------------------------------------------------- what happens to the ranks
    @rule(what=st.sampled_from(["alloc", "alloc", "free", "finish", "prealloc"]), pages=st.integers(1, 8))
    def engine(self, what, pages):
        """Every rank's engine does the same (the same batch on every rank)."""
        outcomes = set()
        for rank in self.ranks:
            if what == "alloc":
                got = rank.allocator.alloc(pages)
                outcomes.add(got)
                rank.governor.note_alloc(pages, object() if got else None, TP_PAGE_SIZE)
            elif what == "free":  # a running request's blocks
                rank.manager.free(min(pages, rank.allocator.inuse - rank.cache.cached))
                rank.governor.note_free()
            elif what == "finish":  # a request finished into the prefix cache
                rank.cache.cached = min(rank.allocator.inuse, rank.cache.cached + pages)
            else:
                rank.allocator.prealloc()
        assert len(outcomes) <= 1, "an allocation succeeded on one rank and missed on another"

    @rule(rank=st.integers(0, RANKS - 1), pages=st.integers(1, 16), soft=st.booleans())
    def pressure(self, rank, pages, soft):
        self.ranks[rank].governor.ask_back(pages, soft=soft)

    @rule(rank=st.integers(0, RANKS - 1), mode=st.sampled_from(["grant", "grant", "grant", "refuse", "lost", "evict"]))
    def broker_turns(self, rank, mode):
        broker = self.ranks[rank].broker
        if broker.why_lost is None:  # a process that turned unprotected stays so
            broker.mode = mode

    @rule(rank=st.integers(0, RANKS - 1), capacity=st.integers(2, 2 * TP_VIRTUAL_PAGES))
    def room_changes(self, rank, capacity):
        """What this rank's broker can grant changes (its GPU's other tenants grew or shrank)."""
        self.ranks[rank].broker.capacity_pages = max(capacity, self.ranks[rank].broker.pages)

    @rule(rank=st.integers(0, RANKS - 1), dt_s=st.sampled_from([0.0, 0.06, 0.6, 2.5]))
    def governor_round(self, rank, dt_s):
        self.now_s += dt_s
        self.ranks[rank].governor.step(self.now_s)

    @rule(dt_s=st.sampled_from([0.0, 0.06, 0.6, 2.5]))
    def every_governor_round(self, dt_s):
        """Every rank's governor runs a round (their threads run alike, seeing the same engine)."""
        self.now_s += dt_s
        for rank in self.ranks:
            rank.governor.step(self.now_s)

    @rule(inside=st.none() | st.tuples(st.integers(0, RANKS - 1), st.integers(1, 16)))
    def sync(self, inside):
        """A sync point; ``inside``: that rank is asked for pages back and its governor runs a round
        while the collective is in flight (its release meets the offer the sync holds)."""
        def round_inside():
            rank = self.ranks[inside[0]]
            rank.governor.ask_back(inside[1])
            rank.governor.step(self.now_s)

        self.sync_point(round_inside if inside is not None else None)

    @rule()
    def a_collective_that_fails(self):
        """The collective raises on every rank (a peer died): each rank's sync raises it, holds
        no offer after it (the invariant below), and applies nothing."""
        sizes = [rank.allocator.total for rank in self.ranks]

        def fail(offer):
            raise CollectiveFailed("a peer died")

        for rank in self.ranks:
            with pytest.raises(CollectiveFailed):
                rank.agreement.sync(fail, self.evict_on(rank), [(rank.governor, rank.manager)])
        assert [rank.allocator.total for rank in self.ranks] == sizes

    # -------------------------------------------------------- after every rule
    @invariant()
    def kvcached_holds_the_governors_latest_revision(self):
        """Every limit applied, by the governor's thread or at a sync point, took its revision
        from the governor (``apply_own_limit``): kvcached's is the last one it took."""
        for rank in self.ranks:
            applied = rank.manager._memory_limit_revision
            assert applied == -1 or applied == rank.governor.state.revision, (applied, rank.governor.state.revision)

    @invariant()
    def every_rank_has_the_same_capacity(self):
        sizes = [rank.allocator.total for rank in self.ranks]
        assert len(set(sizes)) == 1, f"kvcached's sizes differ across the ranks: {sizes}"

    @invariant()
    def no_limit_was_stale_or_in_conflict(self):
        for rank in self.ranks:
            assert not {"stale", "conflict"} & set(rank.manager.statuses), rank.manager.statuses

    @invariant()
    def no_offer_outlives_its_sync(self):
        for rank in self.ranks:
            state = rank.agreement.state_of(rank.manager)
            assert state is None or state.offered is None

    @invariant()
    def the_grant_bounds_the_size_on_every_governed_rank(self):
        self.check()


AgreeingRanks.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_tensor_parallel_ranks_agree_within_every_grant = AgreeingRanks.TestCase
