"""One kvcached pool under its GPU's broker: its memory limit is what the broker granted.

**The invariant.**  What the pool maps (pages in use plus kvcached's prealloc reserve) is at
most kvcached's allocator size, and the governor keeps that size at most what the broker
granted the pool, on every mapping path (``alloc_page``, the prealloc thread, a broadcast) and
at every moment:

* at birth, the allocator is resized to the first grant before ``KVCacheManager.__init__``
  starts the thread that maps the null block and the reserve (:mod:`.allocator`);
* growth: the grant comes first, the limit rises after it;
* give-back: the limit falls first (``set_memory_limit``), and pages go back to the broker only
  once kvcached's allocator size is below the grant (a deferred limit is released as blocks
  are freed);
* kvctl: a foreign ``total_size`` in the pool's segment is an operator cap (the limit is at
  most it), never more than the grant (:mod:`.segment`, :mod:`.allocator`); so is a
  ``set_memory_limit`` from outside the broker (``kvcached.control.set_instance_memory_limit``,
  an operator's script): :meth:`PoolGovernor.outside_limit`, and the governor's own revisions
  are always newer than any it saw.  A segment or record that is not this user's own private
  file (:mod:`.shm_files`) is never read for a cap nor written: one warning, and kvctl has no
  effect on the pool (not even through kvcached's watcher once the pool is ungoverned);
* a broker restart whose re-assertion came back short (the client books held pages the broker
  no longer charges as *uncharged*): the pools of that session are asked for them back as
  under pressure, and the engine's allocations miss until they were asked (:mod:`.pressure`);
* shutdown: only what kvcached unmapped goes back; a page still mapped stays granted;
* mapped pages: after each round the governor tells the broker how many of its granted pages
  kvcached has mapped (in use and its prealloc reserve, read then: a lower bound until the next
  round, as pages only get mapped in between, except those kvcached unmaps on a free, which
  wakes the governor); the others are charged as promised memory, so what the process allocates
  outside its pool (CUDA graphs, activations) never hides in granted but unmapped pages.

**Threads.**  Every broker round trip and every limit change happens on the governor's thread
(:mod:`.runner`), never on the engine's allocation path: the engine's ``alloc``/``free`` only
read two counters and wake that thread when the pool runs short or holds too much, and a
pressure ask from the broker only records how much is wanted.  kvcached's manager lock is
made real at construction, before the engine can call the manager (an ``RLock`` where
synchronous scheduling left a no-op; :func:`.kvcached_api.make_lock_real`), so a limit change
never races the engine's own calls.  A round holds the governor's round lock, and a shutdown
(``close``, on the engine's thread) gives back under it, or leaves the give-back to the next
round, which it wakes: a give-back never lands between a round's read of the grant and the
limit it sets from it.  The pool's state decides the rest (:mod:`.pool_state`): a round stops as
soon as its pool is no longer governed or is closed.

**Failing safe.**  A refusal leaves the pool as it is (the engine's allocation misses, as when
kvcached finds no physical memory, and is retried); a broker failure turns the process
unprotected (the session's ``guard``, :mod:`..device_session`), and an eviction ends the governing: the pool then runs as
kvcached alone would (:meth:`PoolGovernor._ungovern`: its limit lifted to the virtual size,
through its limit channel, the segment showing it, and no limit the governor wrote re-applied
by kvctl's sticky watcher target), said once.  Nothing here raises into the runtime.

**Composition.**  :class:`PoolGovernor` performs the I/O (kvcached, the grants) and feeds back
what happened; the pool's state, and every decision about it, is its
:class:`.pool_state.PoolState` (rules at the top of that module); what the pool shows outside (its
kvctl segment, its views in the broker's status, its ``status()`` entry) is its
:class:`.display.PoolDisplay`.

Units: pool pages (kvcached compound pages, :class:`PoolGeometry`) unless a name says bytes.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from typing import Any

from ...client import SessionEvicted
from .. import announce, process_state
from . import eviction, kvcached_api, runner
from .display import PoolDisplay
from .geometry import PoolGeometry
from .kvctl import KvctlSegment
from .grants import Grants
from .kvcached_api import LimitState
from .limits import DirectLimits, LimitChannel, set_own_limit
from .policy import (Grow, PoolPages, Ramp, Shrink, Watermarks, after_eviction, decide, initial_pages,
                     plan_give_back)
from .pool_state import AskBook, GrowPacing, PoolState, limit_after_grant, surplus_pages

log = announce.logger("kvcached_broker.adapters")
#: A growth the engine is waiting for (it missed) waits at the broker this long for memory to
#: come back (``acquire(wait_s=)``) rather than taking a refusal and a back-off.
GROW_WAIT_S = 0.5


class _Sequence:
    """Numbers this process's governors in the order they were made (from 1).  A reset of the
    registry keeps counting: a governor's key (its reporter name on the session) is never
    another's in the process, not even one made before the reset that outlived it."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.numbers = itertools.count(1)


class PoolGovernor:
    def __init__(self, geometry: PoolGeometry, real_allocator: Any, grants: Grants | None,
                 marks: Watermarks, *, limits: LimitChannel | None = None, why_ungoverned: str = ""):
        self.geometry = geometry
        self.real = real_allocator
        self.limits = limits or DirectLimits()
        self.grants = grants if grants is None else self.limits.route_releases(grants, self)
        self.marks = marks
        self.ramp = Ramp(marks)
        self.state = PoolState(governed=grants is not None, why_ungoverned=why_ungoverned)
        self.counters = {"grows": 0, "refusals": 0, "pages_granted": 0, "pages_released": 0,
                         "pressure_asks": 0, "misses": 0, "deferred": 0,
                         "withdrawn": 0}
        self.asks = AskBook(self.counters)  # the only state other threads write
        self.pacing = GrowPacing()
        self.sequence = next(process_state.part(_Sequence).numbers)  # creation order in this process
        #: the pool's name, its kvctl segment and what it shows in the broker's status
        self.display = PoolDisplay(geometry, self.state, f"kvcached:g{geometry.group_id}:{self.sequence}")
        self._manager: "weakref.ref[Any] | None" = None
        self._round_lock = threading.Lock()  # held by a round, and by a shutdown's give-back
        self._revision_lock = threading.Lock()  # a revision taken and applied (apply_own_limit), on any thread

    # ------------------------------------------------------------ the state, read
    @property
    def key(self) -> str:
        """What the pool reports under (it names kvcached's pool once the manager is known)."""
        return self.display.key

    @property
    def pool_name(self) -> str:
        return self.display.pool_name

    @property
    def kvctl(self) -> KvctlSegment:
        return self.display.kvctl

    @property
    def governed(self) -> bool:
        """The pool holds a grant the governor keeps above kvcached's size (closing included)."""
        return self.state.governed

    @property
    def why_ungoverned(self) -> str:
        return self.state.why_ungoverned

    @property
    def closed(self) -> bool:
        return self.state.closed

    @property
    def pending_limit(self) -> int | None:
        """A deferred limit, waiting for blocks to be freed (pool pages)."""
        return self.state.pending_limit

    @property
    def blocked(self) -> str:
        """Why the pool could not give back what was asked, if it could not."""
        return self.state.blocked

    @property
    def operator_cap_pages(self) -> int | None:
        """An operator's cap on the limit (pool pages; None: none)."""
        return self.state.operator_cap_pages

    # ------------------------------------------------------------ birth (constructing thread)
    def start(self) -> None:
        """Take the first grant and size the allocator to it, before anything is mapped."""
        if not self.governed:
            return
        assert self.grants is not None
        self.display.report_zero_page(self.grants)
        want = initial_pages(self.marks, self.geometry.virtual_pages)
        got = self.grants.acquire(want, 1)
        if got is None:
            self._ungovern("broker unusable at pool start")
            return
        self.real.resize(self.geometry.allocator_size(got))
        self._count_grant(got)
        if got == 0:
            self._refused()
            log.warning("event=kvcached_pool_refused pool=%s asked_pages=%d detail=starts_empty_and_waits_for_a_grant",
                        self.key, want)
        log.info("event=kvcached_pool_governed pool=%s page_bytes=%d granted_pages=%d limit_bytes=%d ipc=%s",
                 self.key, self.geometry.page_bytes, got, self.geometry.limit_bytes(got), self.geometry.ipc_name)

    def attach(self, manager: Any) -> None:
        """Called once ``KVCacheManager.__init__`` returned: the manager this allocator serves."""
        self._manager = weakref.ref(manager)
        self.display.name(str(getattr(manager, "pool_name", "") or ""), self.grants)
        self._write_segment()

    # ------------------------------------------------------------ engine path (any thread)
    def note_alloc(self, need_blocks: int, result: Any, block_mem_size: int) -> bool:
        """After ``alloc``: True if the governor's thread should run (a miss, or running low)."""
        if not self.governed:
            return False
        if result is None:
            blocks_per_page = max(1, self.geometry.page_size // max(1, block_mem_size))
            self.asks.missed(math.ceil(need_blocks / blocks_per_page))
            return True
        return self._free_pages() < self.ramp.current(now_s()).low_pages

    def note_free(self) -> bool:
        """After ``free``: True if the governor's thread should run (too much free, deferred, or
        kvcached unmapped pages the broker still counts as mapped)."""
        return self.governed and (self.pending_limit is not None
                                  or self._free_pages() > self.ramp.current(now_s()).high_pages
                                  or self._mapped_pages() < self.state.told.mapped_pages)

    def note_miss(self) -> None:
        """An allocation missed before reaching kvcached (a charge not settled yet)."""
        self.asks.missed()

    def charge_unsettled(self) -> bool:
        """Before ``alloc``: True while the broker charges this pool's session for fewer pages
        than its pools hold and the governors have not yet asked them back (a broker restart
        whose re-assertion came back short); the allocation then misses, so nothing is mapped
        on pages the broker does not charge.  Reads two numbers: no broker round trip."""
        grants = self.grants if self.governed else None
        return grants is not None and grants.unasked_shortfall() > 0

    def charge_short(self) -> bool:
        """True while the broker charges this pool's session for fewer pages than its pools hold,
        asked back or not yet: the runtime must admit nothing new until they went back."""
        return self._uncharged_pages() > 0

    def resize_target(self, target: int) -> int:
        """What kvcached's ``_alloc`` may apply of its kvctl watcher's sticky ``target`` (per-layer
        bytes; -1: nothing).  Governed: nothing (the governor reads the segment itself and takes a
        foreign value as an operator cap).  Ungoverned: the watcher's target as kvcached alone
        would apply it, unless it is one the governor's own segment writes made (a stale broker
        limit, or the lift itself, which a limit channel applies where the TP ranks agree), or the
        pool's limits change only where its TP ranks agree (``at_sync_points``, SGLang): the
        segment is shared by the ranks, so the target may be a governed peer's limit, and a
        resize on this rank alone would leave the ranks' capacities unequal."""
        if (self.governed or self.kvctl.own_target(target) or self.limits.at_sync_points
                or self.kvctl.unsafe):
            return -1  # (an untrusted segment's value is never applied)
        return target

    def outside_limit(self, manager: Any, limit_bytes: int, revision: int) -> dict:
        """A ``set_memory_limit`` from outside the broker on this governed pool
        (``kvcached.control.set_instance_memory_limit``, an operator's script), on the caller's
        thread.  Taken as an operator cap, as a kvctl write is: the limit becomes at most it and
        at most the grant, on the governor's thread and through its limit channel (so TP ranks
        stay in agreement).  Its revision is remembered, so the governor's next one is newer.
        Returns kvcached's limit state: ``applied`` when the cap is at or above the limit (the
        grant binds, nothing changes), ``deferred`` when the governor will lower the limit to it,
        ``stale`` for a revision older than the last outside one."""
        cap = self.geometry.pages_of(limit_bytes)
        if not self.asks.outside_limit(cap, revision):
            return {**manager.memory_limit_state(), "status": "stale"}
        runner.wake()
        state = manager.memory_limit_state()
        lowers = cap < self._limit_pages()
        log.info("event=kvcached_operator_cap pool=%s source=set_memory_limit cap_bytes=%d revision=%d detail=%s",
                 self.key, limit_bytes, revision,
                 "the governor lowers the limit to it" if lowers else "the grant bounds the pool, not the cap")
        return {**state, "status": "deferred" if lowers else "applied",
                "reason": "kvcached_broker_operator_cap", "operator_cap_bytes": self.geometry.limit_bytes(cap)}

    def ask_back(self, pages: int, *, soft: bool = False) -> None:
        """The broker wants ``pages`` pool pages back (recorded; the governor's thread acts);
        ``soft``: only idle ones (free pages, the prefix cache's unused blocks)."""
        self.asks.ask_back(pages, soft=soft)

    def release_standing(self, *, quiet: bool = True) -> None:
        """A limit channel lowered the limit: the grant above kvcached's size goes back at the
        next round (any thread); ``quiet``: below what this pool wanted (its TP peers gave back),
        so it grows only on a real miss for a while, as after pressure."""
        self.asks.release_standing(quiet=quiet)

    def _free_pages(self) -> int:
        return self.real.get_num_total_pages() - self.real.get_num_inuse_pages()

    # ------------------------------------------------------------ the governor's thread
    def step(self, now_s: float) -> None:
        """One round: kvctl, a deferred limit, pressure, then grow or give back (under the
        round lock: a shutdown on the engine's thread never gives back in the middle of one)."""
        with self._round_lock:
            self._step(now_s)

    def _step(self, now_s: float) -> None:
        if self.closed:
            self._release_unmapped()
            return
        manager = self.manager()
        if manager is None or not self.governed:
            return
        why = self.grants.lost() if self.grants is not None else None
        if why is not None:
            # Whatever call of the process found the broker unusable (a report, another pool's
            # grow), this pool is no longer arbitrated: it runs as kvcached alone from now on.
            self._ungovern(f"unprotected ({why})")
            return
        try:
            if not kvcached_api.post_init_done(manager):
                self._grow_before_post_init(manager, now_s)
                return
            self._round(manager, now_s)
        except SessionEvicted as exc:
            log.error("event=kvcached_pool_evicted pool=%s detail=%s", self.key, exc)
            self._ungovern(f"evicted: {exc}")

    def _round(self, manager: Any, now_s: float) -> None:
        """One round on a governed pool: what changed the limit since the last round, the asks,
        the policy, and what the pool shows.  It stops as soon as the pool is no longer governed
        (a broker failure found by one of its calls) or closed (from the engine's thread): nothing
        more is asked of the broker, and an ungoverned pool's lifted limit is never lowered again."""
        self._take_limit_news(manager)
        if self._live():
            self._adopt_lowered_limit(now_s)
        if not self._live():
            return
        short = self._answer_asks(manager, now_s)
        if self.pending_limit is None and self._live():
            self._follow_policy(manager, short, now_s)
        if self._live():
            self._end_round(manager)

    def _take_limit_news(self, manager: Any) -> None:
        """K1, K2 and a deferred limit: the first round's sync, an operator's cap (from the segment,
        or an outside ``set_memory_limit``), what a deferred limit freed."""
        if self.state.take_sync():
            self._set_limit(manager, self.real.get_num_total_pages())
        self._read_operator_cap()
        outside_cap = self.asks.take_outside_cap()
        if outside_cap is not None:  # an outside set_memory_limit: an operator cap
            self.state.take_cap(outside_cap)
        if self.pending_limit is not None:
            self._finish_deferred(manager)

    def _answer_asks(self, manager: Any, now_s: float) -> int:
        """Give back what the broker asked since the last round (a grant held above the limit
        first); the pages the engine's largest missed allocation still needs."""
        polled = self.grants.poll() if self.grants is not None else 0
        asks = self.asks.take(polled)  # pressure that came through the grants: a broadcast pool's board
        asked, soft = asks.pressure_pages, asks.soft_pages
        if asks.any_pressure:
            self.pacing.quiet(now_s)
            asked -= self._release_above_limit(asked + soft)  # a grant held above the limit first
            if asked < 0:
                soft, asked = max(0, soft + asked), 0
        if asked > 0 and self._live():
            self._give_back(manager, asked, evict=True)
        elif soft > 0 and self._live():
            self._give_back(manager, soft, evict=True, defer=False)
        return asks.short_pages

    def _end_round(self, manager: Any) -> None:
        """Show the limit (segment, status), tell the broker what is mapped and idle, and note
        kvcached's size as the round ends (K3)."""
        self._write_segment()
        self._publish()
        self._report_mapped()
        self._report_idle(manager)
        self.state.round_ended(self._limit_pages())

    def _live(self) -> bool:
        """The round may go on: the pool is governed and not closed."""
        return self.governed and not self.closed

    def _mapped_pages(self) -> int:
        """What kvcached has mapped: pages in use and its prealloc reserve (never below 0: the
        in-use count is two relaxed loads, transiently negative during an expansion)."""
        return max(0, self.real.get_num_inuse_pages()) + self.real.get_num_reserved_pages()

    def _mapped_pages_done(self) -> int:
        """What kvcached has finished mapping, as the broker must be told it: read under the
        manager's lock, which kvcached's ``alloc`` holds while it maps a page it already counts in
        use.  A page said to be mapped comes off the broker's promised charge against a device
        reading made at once, so a page still being mapped would be charged nowhere."""
        with kvcached_api.held_lock(self.manager()):
            return self._mapped_pages()

    def _report_mapped(self) -> None:
        """Tell the broker how many of the pool's granted pages are mapped, if that changed."""
        if self.grants is None or not self.grants.maps_here:
            return
        mapped = min(self._mapped_pages_done(), self.grants.pages)
        if self.state.told.mapped_news(mapped):
            self.grants.mapped(self.key, mapped)
            self.state.told.told_mapped(mapped)

    def _report_idle(self, manager: Any) -> None:
        """Tell the session how many of the pool's granted pages are idle: its free pages and what
        its prefix cache could evict (the hook's ``cached_pages()``, if it has one).  No round
        trip: it goes with the session's next request; the broker asks idle pages first."""
        if self.grants is None or not self.grants.maps_here:
            return
        idle = min(self.grants.pages, max(0, self.grants.pages - self.real.get_num_inuse_pages())
                   + self._cached_pages(manager))
        if self.state.told.idle_news(idle):
            self.grants.idle(self.key, idle)
            self.state.told.told_idle(idle)

    def _cached_pages(self, manager: Any) -> int:
        """About how many pool pages the prefix cache could free now: its hook's ``cached_pages()``
        (0 for a hook without that figure, or none)."""
        cached = getattr(eviction.hook_for(manager), "cached_pages", None)
        if cached is None:
            return 0
        try:
            return max(0, int(cached()))
        except Exception:  # noqa: BLE001 - a figure for the broker's choice, never a failure
            return 0

    def _follow_policy(self, manager: Any, short_pages: int, now_s: float) -> None:
        pages = self.pages()
        self.ramp.observed(now_s, pages.inuse, short=short_pages > 0)
        decision = decide(pages, self.ramp.current(now_s), short_pages=short_pages)
        if isinstance(decision, Grow):
            if not self.pacing.may_grow(now_s, short=short_pages > 0):
                return
            # An ask the engine is waiting for waits at the broker (it paces itself there), so a
            # back-off after refused asks ahead of need does not delay it.
            self._grow(manager, decision, now_s, waiting=short_pages > 0)
        elif isinstance(decision, Shrink):
            if pages.limit > pages.ceiling:
                self._give_back(manager, pages.limit - pages.ceiling, evict=False)
            else:
                self._lower_now(manager, decision.limit, keep_deferred=False)

    def _grow(self, manager: Any, decision: Grow, now_s: float, *, waiting: bool = False) -> None:
        assert self.grants is not None
        standing = limit_after_grant(self.grants.pages, self.pages().ceiling)
        if standing > self._limit_pages():
            # A grant already held above the limit (a limit channel that applies where TP
            # peers agree has not raised it yet): use it before asking the broker for more.
            self._set_limit(manager, standing)
            return
        # What the engine mapped since the last round first: a page mapped but not reported is
        # charged twice (measured, and promised) until it is, and would take the room asked for.
        self._report_mapped()
        got = self.grants.acquire(decision.pages,
                                  self.pacing.min_pages(decision.pages, decision.min_pages, waiting=waiting),
                                  wait_s=GROW_WAIT_S if waiting else None)
        if got is None:
            self._ungovern("broker unusable while growing")
            return
        if got == 0:
            if waiting:
                self.ramp.starved(now_s)
            self.pacing.refused(now_s)
            self._refused()
            return
        self._count_grant(got)
        self.ramp.grew(now_s, self.real.get_num_inuse_pages(), short=waiting)
        self.pacing.granted()
        self._set_limit(manager, limit_after_grant(self.grants.pages, self.pages().ceiling))

    def _grow_before_post_init(self, manager: Any, now_s: float) -> None:
        """A pool that started with no page: its null block waits; grow the allocator itself."""
        if self.real.get_num_total_pages() >= 1 or now_s < self.pacing.next_grow_s or self.grants is None:
            return
        got = self.grants.acquire(initial_pages(self.marks, self.geometry.virtual_pages), 1)
        if got is None:
            self._ungovern("broker unusable at pool start")
        elif got == 0:
            self._refused()
            self.pacing.backed_off(now_s)
        else:
            self.resize_before_post_init(manager, got)
            self._count_grant(got)
            log.info("event=kvcached_pool_started pool=%s granted_pages=%d detail=its_null_block_can_be_reserved",
                     self.key, got)

    def resize_before_post_init(self, manager: Any, pages: int) -> None:
        """Resize kvcached's allocator before its post-init, keeping page 0 first.

        kvcached's allocator shrinks by moving its highest free ids to a reclaimed list and grows
        by taking them back from that list's front, so a pool shrunk to 0 at birth would hand out
        its highest page id first when it grows; kvcached's null block must be block 0
        (``_reserve_null_block`` raises otherwise).  While nothing is mapped, the allocator is
        therefore grown to its whole virtual size, its free list sorted (as kvcached's ``clear()``
        does) and shrunk to ``pages`` (which reclaims the highest ids again).  All of it under the
        manager's lock (real since construction), which the post-init thread takes to reserve the
        null block: it sees every step or none, and the transient size maps nothing."""
        real, size = self.real, self.geometry.allocator_size(pages)
        with kvcached_api.held_lock(manager):
            if real.get_num_inuse_pages() == 0 and real.get_num_reserved_pages() == 0:
                real.resize(self.geometry.allocator_size(self.geometry.virtual_pages))
                real.reset_free_page_order()
            real.resize(size)

    # ------------------------------------------------------------ giving back
    def _give_back(self, manager: Any, wanted: int, *, evict: bool, defer: bool = True) -> None:
        """Lower the limit by ``wanted`` pages: over free pages at once, then (after asking the
        prefix cache to evict) below what is in use, deferred until blocks are freed (not for
        ``defer=False``, a soft ask: only what the eviction freed).  The steps are
        :func:`.policy.plan_give_back`'s and :func:`.policy.after_eviction`'s; this performs them."""
        plan = plan_give_back(self.pages(), wanted, self.marks.floor_pages, evict=evict)
        if plan.lower_to is not None:
            self._lower_now(manager, plan.lower_to, keep_deferred=defer)
            if not self._live():
                return
        if plan.done:
            self.state.answer(self._floor_reason(wanted) if plan.at_floor else "")
            return
        if plan.evict_pages:
            self._evict(manager, plan.evict_pages)
        rest = after_eviction(plan, inuse=self.real.get_num_inuse_pages(), limit=self._limit_pages(), defer=defer)
        if rest.lower_to is not None:
            self._lower_now(manager, rest.lower_to, keep_deferred=defer)
            if not self._live():
                return
        if rest.defer_to is not None:
            self._defer(manager, rest.defer_to)  # (it releases what is above the limit)
            return
        if rest.lower_to is None and plan.evict_pages:
            # The eviction's frees may have finished a deferred shrink, to or below the target:
            # kvcached's size fell without this governor lowering it; the grant above it goes back.
            self._release_above_limit()
        self.state.answer()

    def _lower_now(self, manager: Any, limit_pages: int, *, keep_deferred: bool = True) -> None:
        """Lower the limit to ``limit_pages`` (>= in use when decided: kvcached applies it) and
        release what is above kvcached's size.

        kvcached keeps one pending limit.  While a lower one is pending (a hard give-back waiting
        for frees), this lowering replaces it, applied or deferred: the pending one is applied
        again after it (deferred again), so free pages go back now and the rest as blocks are
        freed.  Otherwise kvcached defers this lowering when the engine took those free pages
        meanwhile (or its prealloc thread had pages in flight), and while it is deferred it
        serves no free page: the engine runs short with pages granted.  A hard give-back keeps
        it pending (the broker wants the pages; they go as blocks are freed).  The policy's own
        shrink and a soft ask for idle pages (``keep_deferred`` False) withdraw it: the limit is
        set back to the size kvcached kept, and the next round decides again."""
        pending, size_before = self.pending_limit, self._limit_pages()
        state = self._set_limit(manager, limit_pages)
        if pending is not None and pending < limit_pages:
            state = self._set_limit(manager, pending)
            limit_pages = pending
        elif state.deferred and not keep_deferred:
            self.counters["withdrawn"] += 1
            log.info("event=kvcached_shrink_withdrawn pool=%s limit_pages=%d inuse_pages=%d",
                     self.key, limit_pages, self.real.get_num_inuse_pages())
            limit_pages = self._limit_pages()
            state = self._set_limit(manager, limit_pages)
        if state.deferred:
            self.state.defer(limit_pages)
        if not state.deferred or self._limit_pages() < size_before:
            self._release_above_limit()

    def _defer(self, manager: Any, limit_pages: int) -> None:
        if self.pending_limit is not None:  # kvcached keeps one pending limit: never a higher one
            limit_pages = min(limit_pages, self.pending_limit)
        inuse = self.real.get_num_inuse_pages()
        state = self._set_limit(manager, limit_pages)
        if state.deferred:
            self.counters["deferred"] += 1
            hook = "a prefix-cache hook" if eviction.hook_for(manager) is not None else "no prefix-cache hook"
            self.state.defer(limit_pages, f"deferred: {inuse - limit_pages} pages in use by blocks still allocated "
                                          f"({hook}); released as they are freed")
            log.info("event=kvcached_giveback_deferred pool=%s limit_pages=%d inuse_pages=%d detail=%r",
                     self.key, limit_pages, inuse, self.blocked)
        elif state.status == "rejected":
            self.state.answer(f"rejected: {state.reason or 'kvcached refused the resize'}")
            log.warning("event=kvcached_giveback_blocked pool=%s reason=%r", self.key, self.blocked)
        self._release_above_limit()

    def _finish_deferred(self, manager: Any) -> None:
        """Release what a deferred limit freed; re-apply it once its blocks are freed (kvcached
        finishes it on a ``free``, but a prealloc refill racing that resize can leave it pending)."""
        state = kvcached_api.limit_state(manager)
        pending = self.pending_limit
        assert pending is not None
        above = self.real.get_num_inuse_pages() - pending
        if state.deferred and above > 0 and self._cached_pages(manager) > 0:
            # Requests finished into the prefix cache since the limit was deferred: what they
            # left there goes now, rather than at the next ask.
            self._evict(manager, above)
        if state.deferred and self.real.get_num_inuse_pages() <= pending:
            state = self._set_limit(manager, pending)
        self._release_above_limit()
        if not state.deferred:
            self.state.settle("" if state.status == "applied" else f"{state.status}: {state.reason}")

    def _evict(self, manager: Any, pages: int) -> None:
        hook = eviction.hook_for(manager)
        if hook is None:
            return
        try:
            freed = int(hook.evict(pages) or 0)
        except Exception as exc:  # noqa: BLE001 - a hook failure frees nothing, never reaches the runtime
            log.warning("event=kvcached_evict_failed pool=%s error=%r", self.key, str(exc))
            return
        log.info("event=kvcached_evicted pool=%s asked_pages=%d freed_blocks=%d", self.key, pages, freed)

    def _release_above_limit(self, at_most: int | None = None) -> int:
        """Give the broker what kvcached can no longer map: granted pages above its size (at
        most ``at_most``); the pages released."""
        assert self.grants is not None
        surplus = surplus_pages(self.grants.pages, self._limit_pages(), at_most)
        if surplus <= 0:
            return 0
        if not self._release(surplus):
            self._ungovern("broker unusable while releasing")
            return 0
        self.counters["pages_released"] += surplus
        return surplus

    def _release(self, pages: int) -> bool:
        """Give ``pages`` back, saying in the same request how many the pool still maps (the
        broker then reads the device at once: the memory is free for others in this round)."""
        assert self.grants is not None
        if not self.grants.maps_here:
            return self.grants.release(pages)
        mapped = min(self._mapped_pages_done(), max(0, self.grants.pages - pages))
        if not self.grants.release(pages, mapped=mapped, key=self.key):
            return False
        self.state.told.told_mapped(mapped)
        return True

    def _adopt_lowered_limit(self, now_s: float) -> None:
        """kvcached's size fell since the last round without this governor lowering it (a limit
        its TP peers agreed on, or a deferred limit finishing), or a limit channel said it lowered
        the limit: the grant above kvcached's size goes back; and where its peers lowered it below
        what this pool wanted, as after pressure, the pool grows only on a real miss for a while
        (its peers gave back; it would hold alone)."""
        standing = self.asks.take_standing()
        if standing.quiet:
            self.pacing.quiet(now_s)
        if standing.due or self.state.limit_fell(self._limit_pages()):
            self._release_above_limit()

    def _floor_reason(self, wanted: int) -> str:
        return f"at its floor: {self.marks.floor_pages} page(s) kept for kvcached's null block ({wanted} asked)"

    # ------------------------------------------------------------ kvcached's limit
    def _set_limit(self, manager: Any, limit_pages: int) -> LimitState:
        """The limit through the pool's channel (at once, or recorded for the TP ranks' next sync
        point); the state kvcached reports."""
        try:
            return self.limits.apply(self, manager, self.geometry.limit_bytes(limit_pages))
        except Exception as exc:  # noqa: BLE001 - a limit kvcached cannot take changes nothing
            log.warning("event=kvcached_limit_failed pool=%s limit_pages=%d error=%r", self.key, limit_pages, str(exc))
            return LimitState("rejected", str(exc))

    def apply_own_limit(self, manager: Any, limit_bytes: int) -> LimitState:
        """kvcached's limit set to ``limit_bytes`` as the broker's own call
        (:func:`.limits.set_own_limit`), with a revision newer than any the pool has seen (L3: its
        own, an outside caller's, kvcached's current one).  The revision is taken and applied
        under one lock, so the pool's revisions reach kvcached in the order they were taken, on
        whichever thread applies them (the governor's, or a limit channel's that applies where
        the TP ranks agree); only a limit applied takes one."""
        with self._revision_lock:
            revision = self.state.next_revision(self.asks.outside_revision, kvcached_api.limit_revision(manager))
            return set_own_limit(manager, limit_bytes, revision)

    def _limit_pages(self) -> int:
        """kvcached's allocator size: the bound on what the pool maps."""
        return self.real.get_num_total_pages()

    def pages(self) -> PoolPages:
        ceiling = self.state.ceiling(self.geometry.virtual_pages)
        return PoolPages(inuse=self.real.get_num_inuse_pages(), limit=self._limit_pages(),
                         granted=self.grants.pages if self.grants else 0, ceiling=ceiling)

    # ------------------------------------------------------------ what the pool shows
    def _read_operator_cap(self) -> None:
        """An operator's cap from the segment (``kvctl limit``), if it changed (:mod:`.kvctl`)."""
        self.display.read_cap(self.grants)

    def _write_segment(self) -> None:
        """Show the limit (a deferred one while it waits) in the segment, and take a cap it brings."""
        if not self.governed:
            return
        self.display.show_limit(self._limit_pages(), self.grants)

    def _publish(self) -> None:
        """Show the pool's limit and pending give-back in status (usage views, never charged)."""
        assert self.grants is not None
        self.display.publish(self.grants, self._limit_pages())

    # ------------------------------------------------------------ states
    def _count_grant(self, pages: int) -> None:
        if pages:
            self.counters["grows"] += 1
            self.counters["pages_granted"] += pages

    def _refused(self) -> None:
        self.counters["refusals"] += 1

    def _ungovern(self, why: str) -> None:
        """No broker (or an eviction): run as kvcached alone would.  The limit is lifted to the
        virtual size through the limit channel (where TP ranks agree, for a channel that applies
        there), the segment shows it, and kvctl's watcher targets that the governor's own
        segment writes made are never applied (:meth:`resize_target`); a later kvctl write is,
        as kvcached alone applies it.  Before kvcached's post-init (no manager call is possible
        yet: its null block may be waiting for a grant) the allocator itself is resized."""
        if not self.state.ungovern(why):
            return
        manager = self.manager()
        if manager is not None and kvcached_api.post_init_done(manager):
            self._set_limit(manager, self.geometry.virtual_pages)
        else:
            self.resize_before_post_init(manager, self.geometry.virtual_pages)
        self.kvctl.show_lifted()
        log.warning("event=kvcached_pool_ungoverned pool=%s reason=%r detail=runs_as_kvcached_alone", self.key, why)

    def abandon(self) -> None:
        """A start that failed midway: give back what was granted (best effort) and govern nothing."""
        grants, self.grants = self.grants, None
        self.state.ungovern("the pool's start failed")
        try:
            if grants is not None and grants.pages:
                grants.release(grants.pages)
        except Exception as exc:  # noqa: BLE001 - an evicted or failed session frees it itself
            log.warning("event=kvcached_grant_unreleased pool=%s error=%r", self.key, str(exc))

    def _kvctl_target_bytes(self) -> int | None:
        """kvcached's kvctl watcher's sticky target, in pool bytes (what kvcached alone would
        resize to on its next allocation); None when it has none."""
        try:
            target = int(self.real.get_resize_target())
        except Exception:  # noqa: BLE001 - status only
            return None
        return None if target < 0 else target // self.geometry.page_size * self.geometry.page_bytes

    def manager(self) -> Any:
        return self._manager() if self._manager is not None else None

    def close(self) -> None:
        """The pool shut down (kvcached stopped its prealloc thread): its reserve is unmapped and
        the grant goes back, except the pages still mapped (blocks the engine has not freed, which
        stay mapped until they are freed or the process exits).  Those go back on the governors'
        thread as kvcached unmaps them; the zero page's report goes with the last of them."""
        if not self.state.close():
            return
        self.kvctl.leave()  # kvcached removes its segment at shutdown
        if not (self.governed and self.grants is not None):
            return
        # A round under way on the governors' thread stops at its next step (it sees the pool
        # closed) and the next round gives back: a give-back here, in the middle of that round,
        # could meet a limit it raised from a grant read before.
        if self._round_lock.acquire(blocking=False):
            try:
                self._release_unmapped()
            finally:
                self._round_lock.release()
        runner.wake()

    def _release_unmapped(self) -> None:
        """A closed pool: unmap its reserve (blocks freed after shutdown land there), shrink
        kvcached's allocator to what is in use (so nothing more can be mapped), give back the
        grant above it, and forget the pool once nothing is mapped.  A broadcast pool's grant goes
        at once: its workers keep what they map, and unmap their own."""
        grants = self.grants
        if not self.governed or grants is None:
            return
        try:
            if grants.maps_here:
                self._shrink_closed()
            mapped = self._mapped_pages()
            bound = max(mapped, self.real.get_num_total_pages()) if grants.maps_here else mapped
            surplus = grants.pages - bound
            if surplus > 0 and grants.release(surplus):
                self.counters["pages_released"] += surplus
            self._report_mapped()
            if grants.pages <= 0 or not grants.maps_here:
                self.state.forget()
                grants.forget(self.key)
        except SessionEvicted as exc:
            self.state.forget()
            log.error("event=kvcached_pool_evicted pool=%s detail=%s", self.key, exc)

    def _shrink_closed(self) -> None:
        """A closed pool's reserve unmapped and kvcached's allocator shrunk to what is in use (no
        broker call: the grant goes back after, with the manager's lock released)."""
        try:
            # Under the manager's lock, as kvcached's own trim and resize: they unmap outside
            # the allocator's mutex and wake no one after, and an engine's alloc_page meeting
            # that moment would wait for ever, holding this lock.
            with kvcached_api.held_lock(self.manager()):
                if self.real.get_num_reserved_pages():
                    self.real.trim()
                inuse = self.real.get_num_inuse_pages()
                if self.real.get_num_total_pages() > inuse:
                    self.real.resize(self.geometry.allocator_size(inuse))
        except Exception as exc:  # noqa: BLE001 - what stays mapped stays granted
            log.warning("event=kvcached_close_shrink_failed pool=%s error=%r", self.key, str(exc))

    def status(self) -> dict[str, Any]:
        """This pool as the governor sees it (bytes, and pool pages where named; :mod:`.display`)."""
        pages = self.pages()
        reserved = self.real.get_num_reserved_pages()
        return self.display.status(pages, reserved, self.counters, uncharged_pages=self._uncharged_pages(),
                                   kvctl_target_bytes=self._kvctl_target_bytes())

    def _uncharged_pages(self) -> int:
        """Session pages of this pool's session its broker no longer charges (a short re-assertion)."""
        grants = self.grants if self.governed else None
        return grants.uncharged_pages() if grants is not None else 0


def now_s() -> float:
    return time.monotonic()
