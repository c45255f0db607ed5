"""When a pool grows, gives back, or holds (sans-I/O: page counts in, one decision out).

Invariants the governor keeps with these decisions (pool pages):

* ``limit <= granted``: a grant is taken before the limit rises, and the limit is lowered (and
  kvcached reports it applied) before pages go back;
* ``limit <= min(operator cap, virtual pages)``;
* ``inuse + reserve <= limit`` is kvcached's own (its allocator's size bounds what it maps).

Hysteresis: a pool grows by ``batch_pages`` once fewer than ``low_pages`` of its limit are
free, so the engine's allocation path rarely waits on the broker; it gives back what is free
beyond ``high_pages``, down to ``batch_pages`` free, so a pool that oscillates around a size
makes no round trip per allocation.

Ramp: a pool that grows again within ``RAMP_WINDOW_S`` of its last growth is in a burst: its
batch becomes what it consumed in the burst per second times ``RAMP_AHEAD_S`` (at least one
batch, at most ``RAMP_MAX``), and its marks scale with it.  A burst of many GiB then takes a
few round trips, each granted before the engine runs short, and asks the broker (and so the
pools it takes memory from) for about what the next ``RAMP_AHEAD_S`` will use, not a
doubling's overshoot.  Once it pauses for the window, the batch is back to one, and what the
ramp left free goes back.  A burst that starts on the pool's free pages is seen at its first
miss: the round that finds the engine ran out, with more pages in use than the round before at
a rate one batch would not cover for ``RAMP_AHEAD_S``, starts the burst at that rate
(otherwise its first growths would be one batch each, and the engine would run short of each
in turn).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

DEFAULT_BATCH_BYTES = 512 << 20
#: Growths this close together are one burst (seconds).
RAMP_WINDOW_S = 0.5
#: A burst's batch covers what it uses in this long, at its rate so far (seconds): about one
#: hand-over's protocol time, so the next grant is there before the engine runs short.
RAMP_AHEAD_S = 0.1
#: The largest batch a burst ramps to, in batches (32 GiB at the default 512 MiB).
RAMP_MAX = 64
#: A burst's rate is measured over at least this long (seconds): two growths a moment apart say
#: little about it.
RAMP_MIN_ELAPSED_S = 0.01


@dataclass(frozen=True)
class Watermarks:
    """In pool pages: ``low_pages < batch_pages < high_pages``."""

    batch_pages: int
    low_pages: int
    high_pages: int
    floor_pages: int = 1  # the page holding kvcached's null block

    @classmethod
    def for_page_bytes(cls, page_bytes: int, batch_bytes: int = DEFAULT_BATCH_BYTES) -> "Watermarks":
        batch = max(2, math.ceil(batch_bytes / page_bytes))
        return cls(batch_pages=batch, low_pages=max(1, batch // 2), high_pages=2 * batch)


@dataclass
class Ramp:
    """A pool's growth batch (pool pages): one batch, or, in a burst (growths within
    ``RAMP_WINDOW_S`` of each other, the first of them on a miss that :meth:`observed` saw at a
    rate), what the burst uses in ``RAMP_AHEAD_S`` at its rate so far (in-use pages gained per
    second since it began), between one and ``RAMP_MAX`` batches.  Times on the monotonic
    clock."""

    marks: Watermarks
    batch_pages: int = 0  # in a burst, the batch (0: one batch of the marks)
    active_s: float = -math.inf  # the burst's last growth, or the round that saw it begin
    burst_start_s: float = -math.inf
    burst_start_inuse: int = 0
    seen_s: float = -math.inf  # the last round's look at the pool
    seen_inuse: int = 0

    def current(self, now_s: float) -> Watermarks:
        """The marks in force: the batch, and the low and high marks scaled with it."""
        m = self.marks
        if now_s - self.active_s > RAMP_WINDOW_S or self.batch_pages <= m.batch_pages:
            return m
        batch = self.batch_pages
        return replace(m, batch_pages=batch, low_pages=max(m.low_pages, batch // 2),
                       high_pages=max(m.high_pages, 2 * batch))

    def grew(self, now_s: float, inuse_pages: int, *, short: bool = False) -> None:
        """A growth was granted now, with ``inuse_pages`` in use: the next batch follows the
        burst's rate, never below the batch before (a growth after a pause starts a new burst at
        one batch).  ``short``: the engine ran out before this growth (the batch was too small
        for the burst): the batch at least doubles, as TCP's slow start does, since the rate so
        far is limited by the grants themselves."""
        m = self.marks
        if now_s - self.active_s > RAMP_WINDOW_S:
            self.burst_start_s, self.burst_start_inuse = now_s, inuse_pages
            self.batch_pages = m.batch_pages
        else:
            floor = 2 * self.batch_pages if short else self.batch_pages
            at_rate = _ahead_pages(inuse_pages - self.burst_start_inuse, now_s - self.burst_start_s)
            self.batch_pages = min(m.batch_pages * RAMP_MAX, max(floor, m.batch_pages, at_rate))
        self.active_s = now_s

    def observed(self, now_s: float, inuse_pages: int, *, short: bool = False) -> None:
        """A round saw ``inuse_pages`` in use (``short``: the engine ran out of free pages since
        the last round).  A pool that ran out, having used more since the round before (within
        ``RAMP_WINDOW_S``) than one batch covers in ``RAMP_AHEAD_S`` at that rate, and whose
        burst has no measured batch yet (none, or one begun at one batch by a growth ahead of
        need), bursts at that rate from the round before: the growth the engine waits for is
        sized by it, so the engine does not run short of one batch after another while growths
        measure the rate.  A pool with pages free never starts a burst here: a request that fits
        is not a rate, however soon after a round it comes."""
        inuse_pages = max(0, inuse_pages)  # kvcached's count is transiently negative while it expands
        before_s, before_inuse = self.seen_s, self.seen_inuse
        self.seen_s, self.seen_inuse = now_s, inuse_pages
        measured = now_s - self.active_s <= RAMP_WINDOW_S and self.batch_pages > self.marks.batch_pages
        if not short or measured or now_s - before_s > RAMP_WINDOW_S:
            return
        batch = _ahead_pages(inuse_pages - before_inuse, now_s - before_s)
        if batch <= self.marks.batch_pages:
            return
        self.burst_start_s, self.burst_start_inuse = before_s, before_inuse
        self.batch_pages = min(self.marks.batch_pages * RAMP_MAX, batch)
        self.active_s = now_s

    def starved(self, now_s: float) -> None:
        """An ask the engine waited for was not granted: the burst goes on (its batch is kept
        for when memory comes back), however long the pool waits."""
        if now_s - self.active_s <= RAMP_WINDOW_S:
            self.active_s = now_s


def _ahead_pages(gained_pages: int, elapsed_s: float) -> int:
    """What ``RAMP_AHEAD_S`` uses at the rate of ``gained_pages`` in use over ``elapsed_s`` (timed
    over at least ``RAMP_MIN_ELAPSED_S``; pages freed count as none gained), rounded up."""
    return math.ceil(max(0, gained_pages) / max(RAMP_MIN_ELAPSED_S, elapsed_s) * RAMP_AHEAD_S)


@dataclass(frozen=True)
class PoolPages:
    """What a pool has, in pool pages."""

    inuse: int  # pages holding blocks (kvcached's in-use pages)
    limit: int  # kvcached's allocator size: the bound on mapped pages
    granted: int  # what the broker granted this pool
    ceiling: int  # min(operator cap, virtual pages): never grow past it

    @property
    def free(self) -> int:
        return max(0, self.limit - self.inuse)


@dataclass(frozen=True)
class Grow:
    pages: int  # ask the broker for this many
    min_pages: int  # and take no fewer


@dataclass(frozen=True)
class Shrink:
    limit: int  # lower kvcached's limit to this (>= inuse: applies at once)


@dataclass(frozen=True)
class Hold:
    pass


Decision = Grow | Shrink | Hold


def decide(pages: PoolPages, marks: Watermarks, *, short_pages: int = 0) -> Decision:
    """The next step for a pool; ``short_pages`` is what a refused allocation still needed."""
    if pages.limit > pages.ceiling:
        return Shrink(max(pages.ceiling, pages.inuse))
    room = pages.ceiling - pages.limit
    if (pages.free < marks.low_pages or short_pages > 0) and room > 0:
        want = min(room, max(marks.batch_pages, short_pages))
        return Grow(want, min(want, max(1, short_pages)))
    if pages.free > marks.high_pages:
        return Shrink(max(marks.floor_pages, pages.inuse + marks.batch_pages))
    return Hold()


def initial_pages(marks: Watermarks, virtual_pages: int) -> int:
    """What a new pool asks for at construction: its null-block page and one batch."""
    return max(1, min(virtual_pages, marks.floor_pages + marks.batch_pages))


@dataclass(frozen=True)
class GiveBack:
    """The first steps of giving back ``wanted`` pool pages (:func:`plan_give_back`), in order.

    1. ``lower_to``: lower the limit to it at once, over free pages only (None: no change; when
       set, ``inuse <= lower_to < limit`` and ``lower_to >= floor``);
    2. ``done``: free pages covered the ask, or the pool reached its floor (``at_floor``: the
       ask was not met, nothing more can go): the give-back is answered here;
    3. otherwise, ask the prefix cache to free ``evict_pages`` (0: no eviction asked) and let
       :func:`after_eviction` decide the rest from what is in use then, toward ``target``
       (``floor <= target < lower_to or limit``), the limit the ask needs in the end.
    """

    lower_to: int | None
    target: int
    done: bool = False
    at_floor: bool = False
    evict_pages: int = 0


@dataclass(frozen=True)
class AfterEviction:
    """The last steps of a give-back, once the eviction ran (:func:`after_eviction`), in order:
    ``lower_to``, lower the limit to it at once (``target <= lower_to < limit``, at or above
    what is in use; None: no change); ``defer_to``, then lower it below what is in use, deferred
    until blocks are freed (None: nothing deferred, the give-back is answered)."""

    lower_to: int | None
    defer_to: int | None


def plan_give_back(pages: PoolPages, wanted: int, floor_pages: int, *, evict: bool) -> GiveBack:
    """For a pressure ask of ``wanted`` pool pages: what to lower at once, and whether eviction
    and a deferred limit must follow (``evict``: the prefix cache may be asked to free blocks)."""
    now = max(pages.inuse, pages.limit - wanted, floor_pages)
    rest = wanted - (pages.limit - now)
    target = max(floor_pages, now - rest) if rest > 0 else now
    lower_to = now if now < pages.limit else None
    if target >= now:  # free pages covered the ask, or the pool is at its floor
        return GiveBack(lower_to, target, done=True, at_floor=pages.limit - now < wanted)
    return GiveBack(lower_to, target, evict_pages=now - target if evict else 0)


def after_eviction(plan: GiveBack, *, inuse: int, limit: int, defer: bool) -> AfterEviction:
    """The rest of a give-back not ``done`` by :func:`plan_give_back`, from what is in use and
    kvcached's size after the eviction: lower the limit at once as far toward ``plan.target``
    as what is in use allows (after an eviction only: without one nothing was freed since the
    first step), then defer the rest (``defer``; False for a soft ask: only what was idle).
    Never raises the limit: where the eviction's frees finished an earlier deferred shrink, to
    or below the target, kvcached's size is already there (``lower_to`` None)."""
    lower_to: int | None = None
    if plan.evict_pages:
        floor = max(plan.target, inuse)
        lower_to = floor if floor < limit else None
        if plan.target >= inuse:  # the eviction freed enough at once
            return AfterEviction(lower_to, None)
    return AfterEviction(lower_to, plan.target if defer else None)
