"""kvcached mode's pure pieces: when a pool grows or gives back, page units, the kvctl segment."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvcached_broker.adapters.kvcached import segment
from kvcached_broker.adapters.kvcached.geometry import PoolGeometry, session_pages_per_page
from kvcached_broker.adapters.kvcached.policy import (
    RAMP_AHEAD_S, RAMP_MAX, RAMP_WINDOW_S, AfterEviction, GiveBack, Grow, Hold, PoolPages, Ramp, Shrink,
    Watermarks, after_eviction, decide, initial_pages, plan_give_back,
)

MARKS = Watermarks(batch_pages=8, low_pages=4, high_pages=16)


def test_a_pool_grows_a_batch_before_it_runs_short_and_holds_in_between():
    assert decide(PoolPages(inuse=7, limit=10, granted=10, ceiling=100), MARKS) == Grow(8, 1)
    assert decide(PoolPages(inuse=2, limit=10, granted=10, ceiling=100), MARKS) == Hold()
    assert decide(PoolPages(inuse=2, limit=18, granted=18, ceiling=100), MARKS) == Hold()  # 16 free: not above


def test_a_miss_asks_at_least_what_it_needed_and_growth_stops_at_the_ceiling():
    assert decide(PoolPages(inuse=2, limit=10, granted=10, ceiling=100), MARKS, short_pages=20) == Grow(20, 20)
    assert decide(PoolPages(inuse=9, limit=10, granted=10, ceiling=13), MARKS) == Grow(3, 1)
    assert decide(PoolPages(inuse=10, limit=10, granted=10, ceiling=10), MARKS, short_pages=1) == Hold()


def test_idle_memory_above_the_hysteresis_goes_back_down_to_one_batch_free():
    assert decide(PoolPages(inuse=3, limit=20, granted=20, ceiling=100), MARKS) == Shrink(11)


def test_an_operator_cap_below_the_limit_lowers_it_but_never_below_what_is_in_use():
    assert decide(PoolPages(inuse=3, limit=20, granted=20, ceiling=10), MARKS) == Shrink(10)
    assert decide(PoolPages(inuse=12, limit=20, granted=20, ceiling=10), MARKS) == Shrink(12)


def test_pressure_takes_free_pages_now_and_the_rest_once_blocks_are_freed():
    pages = PoolPages(inuse=10, limit=16, granted=16, ceiling=100)
    assert plan_give_back(pages, 4, floor_pages=1, evict=True) == GiveBack(12, 12, done=True)
    plan = plan_give_back(pages, 10, floor_pages=1, evict=True)
    assert plan == GiveBack(10, 6, evict_pages=4)
    assert after_eviction(plan, inuse=8, limit=10, defer=True) == AfterEviction(8, 6)  # 2 freed: lowered, rest deferred
    assert after_eviction(plan, inuse=5, limit=10, defer=True) == AfterEviction(6, None)  # freed enough at once
    assert after_eviction(plan, inuse=8, limit=10, defer=False) == AfterEviction(8, None)  # a soft ask: no deferral
    # the eviction's frees finished an earlier deferred shrink below the target: never raised
    assert after_eviction(plan, inuse=4, limit=5, defer=True) == AfterEviction(None, None)
    # never below the null block's page:
    assert plan_give_back(pages, 100, floor_pages=1, evict=True) == GiveBack(10, 1, evict_pages=9)


def test_a_give_back_at_the_floor_is_answered_short_and_one_without_eviction_defers_at_once():
    at_floor = PoolPages(inuse=0, limit=3, granted=3, ceiling=100)
    assert plan_give_back(at_floor, 5, floor_pages=1, evict=True) == GiveBack(1, 1, done=True, at_floor=True)
    plan = plan_give_back(PoolPages(inuse=10, limit=10, granted=10, ceiling=100), 4, floor_pages=1, evict=False)
    assert plan == GiveBack(None, 6)
    assert after_eviction(plan, inuse=10, limit=10, defer=True) == AfterEviction(None, 6)


@given(inuse=st.integers(0, 64), free=st.integers(0, 64), wanted=st.integers(1, 128), floor=st.integers(1, 4),
       freed=st.integers(0, 64), evict=st.booleans(), defer=st.booleans(), pending=st.none() | st.integers(0, 64))
def test_a_give_back_never_lowers_the_limit_below_what_is_in_use_and_gives_what_was_asked(
        inuse, free, wanted, floor, freed, evict, defer, pending):
    """The whole give-back, run against a model of kvcached (a limit at or above what is in use
    applies at once; below it, it is deferred): the limit only falls, never below the floor nor,
    at once, below what is in use; the pages the ask did not get at once are deferred unless the
    ask was soft, the floor stopped it, or the eviction freed them.  ``pending``: an earlier
    deferred shrink, which the eviction's frees may finish (kvcached's size falls to it)."""
    limit = max(floor, inuse + free)  # the floor is mapped from the pool's start (the null block)
    pages = PoolPages(inuse=inuse, limit=limit, granted=limit, ceiling=limit + 8)
    plan = plan_give_back(pages, wanted, floor, evict=evict)
    if plan.lower_to is not None:
        assert max(inuse, floor) <= plan.lower_to < limit
        limit = plan.lower_to
    assert floor <= plan.target <= limit
    if plan.done:
        assert plan.at_floor == (pages.limit - limit < wanted)
        assert not plan.at_floor or limit == max(inuse, floor)
        return
    assert plan.target < limit and plan.evict_pages == (limit - plan.target if evict else 0)
    inuse = max(0, inuse - (min(freed, plan.evict_pages)))
    if pending is not None and inuse <= pending < limit:  # the frees finished the earlier shrink
        limit = max(floor, pending)
    reached = min(limit, plan.target)  # where the limit is in the end, at the latest
    rest = after_eviction(plan, inuse=inuse, limit=limit, defer=defer)
    if rest.lower_to is not None:
        assert max(inuse, plan.target) <= rest.lower_to < limit
        limit = rest.lower_to
    final = rest.defer_to if rest.defer_to is not None else limit
    assert rest.defer_to is None or (defer and rest.defer_to < inuse)
    # In the end the ask takes the limit to what it wanted, never below the floor; a soft ask
    # (no deferral) stops at what was idle.
    assert plan.target == max(floor, pages.limit - wanted)
    assert final == reached if defer else final >= reached


@given(inuse=st.integers(0, 64), free=st.integers(0, 64), extra=st.integers(0, 64), short=st.integers(0, 64))
def test_decisions_keep_the_limit_within_the_ceiling_and_above_what_is_in_use(inuse, free, extra, short):
    pages = PoolPages(inuse=inuse, limit=inuse + free, granted=inuse + free, ceiling=inuse + free + extra)
    decision = decide(pages, MARKS, short_pages=short)
    if isinstance(decision, Grow):
        assert 1 <= decision.min_pages <= decision.pages <= extra
    elif isinstance(decision, Shrink):
        assert inuse <= decision.limit < pages.limit


def test_the_first_grant_is_the_null_blocks_page_and_a_batch_within_the_virtual_range():
    assert initial_pages(MARKS, 1000) == 9
    assert initial_pages(MARKS, 3) == 3
    marks = Watermarks.for_page_bytes(128 << 20)  # a 32-layer model's compound page
    assert marks.batch_pages == 4 and marks.low_pages == 2 and marks.high_pages == 8


def test_a_burst_asks_for_what_it_uses_in_a_moment_at_its_rate_and_a_pause_ends_it():
    ramp = Ramp(MARKS)
    assert ramp.current(0.0) == MARKS  # not bursting: one batch
    ramp.grew(1.0, inuse_pages=10)  # a first growth: a burst may begin, at one batch
    assert ramp.current(1.0) == MARKS
    ramp.grew(1.1, inuse_pages=10 + 400)  # 400 pages in 0.1 s: 4000 pages/s
    batch = round(4000 * RAMP_AHEAD_S)
    assert ramp.current(1.1) == Watermarks(batch_pages=batch, low_pages=batch // 2, high_pages=2 * batch)
    grow = decide(PoolPages(inuse=410, limit=410 + batch // 2 - 1, granted=500, ceiling=10_000), ramp.current(1.1))
    assert grow == Grow(batch, 1)  # grows by the burst's batch, before it runs short
    ramp.starved(1.1 + RAMP_WINDOW_S)  # it waited for memory: the burst is not over
    assert ramp.current(1.1 + RAMP_WINDOW_S + 0.1).batch_pages == batch
    ramp.grew(1.2 + RAMP_WINDOW_S, inuse_pages=420)  # its rate fell while it waited: the batch stays
    assert ramp.current(1.2 + RAMP_WINDOW_S).batch_pages == batch
    assert ramp.current(1.3 + 2 * RAMP_WINDOW_S) == MARKS  # a pause: back to one batch
    ramp.grew(10.0, inuse_pages=0)
    ramp.grew(10.01, inuse_pages=10**7)  # never past RAMP_MAX batches
    assert ramp.current(10.01).batch_pages == MARKS.batch_pages * RAMP_MAX


def test_a_burst_that_runs_short_at_least_doubles_its_batch():
    """Growths the engine ran out before: the rate so far is what the grants allowed, so the
    batch doubles (up to RAMP_MAX batches) even when the measured rate says less."""
    ramp = Ramp(MARKS)
    ramp.grew(1.0, inuse_pages=10, short=True)  # a burst begins: one batch
    assert ramp.current(1.0) == MARKS
    batches = []
    for i in range(1, 9):
        ramp.grew(1.0 + 0.02 * i, inuse_pages=10 + i, short=True)  # a slow measured rate
        batches.append(ramp.current(1.0 + 0.02 * i).batch_pages)
    assert batches == [16, 32, 64, 128, 256, 512, 512, 512]  # 8 * RAMP_MAX = 512
    ramp.grew(1.2, inuse_pages=20)  # grown ahead of need: the batch is kept, not doubled
    assert ramp.current(1.2).batch_pages == 512


def test_a_burst_seen_on_the_pools_free_pages_starts_at_its_rate_not_at_one_batch():
    """A round that finds the engine ran out, with pages in use rising faster than one batch
    lasts (for RAMP_AHEAD_S), starts the burst at that rate, so the growth the engine waits for
    already covers it; the growths after it measure the burst from the round before.  (Times
    are binary fractions: exact rates.)"""
    ramp = Ramp(MARKS)
    ramp.observed(0.5, inuse_pages=10)
    ramp.observed(1.0, inuse_pages=10)  # idle between rounds: no burst
    assert ramp.current(1.0) == MARKS
    ramp.observed(1.03125, inuse_pages=10 + 64, short=True)  # 64 pages in 1/32 s, then a miss: 2048 pages/s
    batch = 205  # 2048 pages/s for RAMP_AHEAD_S, rounded up
    assert ramp.current(1.03125) == Watermarks(batch_pages=batch, low_pages=batch // 2, high_pages=2 * batch)
    assert decide(PoolPages(inuse=74, limit=75, granted=75, ceiling=10_000), ramp.current(1.03125),
                  short_pages=1) == Grow(batch, 1)  # the engine's first miss asks for the burst's batch
    ramp.grew(1.09375, inuse_pages=10 + 384)  # 384 pages in 3/32 s since the round before: 4096 pages/s
    assert ramp.current(1.09375).batch_pages == 410
    ramp.observed(1.125, inuse_pages=10_000, short=True)  # within a burst only growths set the batch
    assert ramp.current(1.125).batch_pages == 410


def test_a_burst_begun_at_one_batch_ahead_of_need_is_sized_at_its_first_miss():
    """The usual start: the pool runs low and grows one batch ahead of need (a burst begins at
    one batch), then the engine runs out: the round of that miss sizes the batch by the rate
    since the round before, once; a measured batch is left to the growths."""
    ramp = Ramp(MARKS)
    ramp.observed(1.0, inuse_pages=10)
    ramp.grew(1.0, inuse_pages=10)  # ahead of need: a burst at one batch
    assert ramp.current(1.0) == MARKS
    ramp.observed(1.015625, inuse_pages=42, short=True)  # 32 pages in 1/64 s: 2048 pages/s
    assert ramp.current(1.015625).batch_pages == 205
    ramp.observed(1.03125, inuse_pages=10_000, short=True)  # measured now: a miss no longer resizes it
    assert ramp.current(1.03125).batch_pages == 205


def test_no_miss_slow_use_or_a_look_too_long_ago_starts_no_burst():
    ramp = Ramp(MARKS)
    ramp.observed(1.0, inuse_pages=10)
    ramp.observed(1.001, inuse_pages=13)  # a request that fit, just after a round: not a rate
    assert ramp.current(1.001) == MARKS
    ramp.observed(1.125, inuse_pages=13 + MARKS.batch_pages, short=True)  # a batch lasts longer than RAMP_AHEAD_S
    assert ramp.current(1.125) == MARKS
    ramp.observed(1.2 + RAMP_WINDOW_S, inuse_pages=10_000, short=True)  # the round before is too old to time a rate
    assert ramp.current(1.2 + RAMP_WINDOW_S) == MARKS
    ramp.observed(1.21 + RAMP_WINDOW_S, inuse_pages=9_000, short=True)  # pages freed: no rate
    assert ramp.current(1.21 + RAMP_WINDOW_S) == MARKS
    ramp.observed(2.0, inuse_pages=-6)  # kvcached's count while it expands: read as none in use
    ramp.observed(2.0625, inuse_pages=4, short=True)  # 4 pages in 1/16 s (from -6: 10, a burst): none
    assert ramp.current(2.0625) == MARKS
    ramp.observed(3.0, inuse_pages=9_000)
    ramp.observed(3.001, inuse_pages=9_000 + 10**7, short=True)  # never past RAMP_MAX batches
    assert ramp.current(3.001).batch_pages == MARKS.batch_pages * RAMP_MAX
    assert ramp.current(3.002 + RAMP_WINDOW_S) == MARKS  # no growth followed: the burst ends


def test_pool_pages_convert_to_session_pages_only_when_they_divide():
    geometry = PoolGeometry(num_layers=32, page_size=2 << 20, num_kv_buffers=2, virtual_pages=100)
    assert geometry.page_bytes == 128 << 20
    assert session_pages_per_page(geometry.page_bytes, 2 << 20) == 64
    assert session_pages_per_page(geometry.page_bytes, 128 << 20) == 1
    assert session_pages_per_page(geometry.page_bytes, 3 << 20) is None
    assert geometry.allocator_size(5) == 5 * (2 << 20)  # PageAllocator.resize takes per-layer K-or-V bytes


def test_the_segment_is_kvcacheds_three_int64s_and_only_its_limit_is_written(tmp_path):
    name = str(Path("/dev/shm") / f"kvb-policy-{uuid.uuid4().hex[:8]}")
    Path(name).write_bytes(struct.pack("=qqq", 64 << 30, 3 << 20, 5 << 20))
    try:
        assert segment.write_limit(name, 1 << 30)
        assert segment.read(name) == segment.SegmentInfo(1 << 30, 3 << 20, 5 << 20)
    finally:
        Path(name).unlink()
    assert segment.read(name) is None and not segment.write_limit(name, 1)
