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
  most it), never more than the grant (:mod:`.segment`, :mod:`.allocator`).

**Threads.**  Every broker round trip and every limit change happens on the governor's thread
(:mod:`.runner`), never on the engine's allocation path: the engine's ``alloc``/``free`` only
read two counters and wake that thread when the pool runs short or holds too much, and a
pressure ask from the broker only records how much is wanted.  kvcached's manager lock is
made real (an ``RLock`` where synchronous scheduling left a no-op), so a limit change never
races the engine's own calls.

**Failing safe.**  A refusal leaves the pool as it is (the engine's allocation misses, as when
kvcached finds no physical memory, and is retried); a broker failure turns the process
unprotected (``worker.guard``) and the pool runs as kvcached alone would (its limit lifted,
kvctl's watcher seen again), said once.  Nothing here raises into the runtime.

Units: pool pages (kvcached compound pages, :class:`PoolGeometry`) unless a name says bytes.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import weakref
from typing import Any

from ...client import BudgetExceeded, SessionEvicted
from . import eviction, segment
from .geometry import PoolGeometry
from .grants import SessionGrants
from .limits import DirectLimits, LimitChannel
from .policy import Grow, PoolPages, Shrink, Watermarks, decide, give_back_plan, initial_pages

log = logging.getLogger("kvcached_broker.adapters")

ZERO_PAGE_POOL = "kvcached_zero_page"
GROW_RETRY_S = (0.05, 0.5)  # first and longest wait after a refused growth
#: After a pressure ask, a pool grows only on a refused allocation (not ahead of need) for this
#: long, so what it gave back goes to the pool that asked rather than straight back to it.
PRESSURE_QUIET_S = 2.0

_sequence = itertools.count(1)


class PoolGovernor:
    def __init__(self, geometry: PoolGeometry, real_allocator: Any, grants: SessionGrants | None,
                 marks: Watermarks, *, limits: LimitChannel | None = None, why_ungoverned: str = ""):
        self.geometry = geometry
        self.real = real_allocator
        self.grants = grants
        self.limits = limits or DirectLimits()
        self.marks = marks
        self.governed = grants is not None
        self.why_ungoverned = why_ungoverned
        self.sequence = next(_sequence)  # creation order in this process
        self.key = f"kvcached:g{geometry.group_id}:{self.sequence}"
        self.pool_name = ""
        self._manager: "weakref.ref[Any] | None" = None
        self._revision = 0
        self._lock_installed = False
        self._synced = False
        self._seen_limit_pages = 0  # kvcached's allocator size when the last round ended
        self._standing_due = False  # a limit channel lowered the limit below what this pool wanted
        self.operator_cap_pages: int | None = None
        self._segment_bytes: int | None = None  # total_size the governor last wrote
        self.pending_limit: int | None = None  # a deferred limit, waiting for frees
        self.blocked = ""  # why the pool could not give back what was asked, if it could not
        self._asks = threading.Lock()  # guards the two fields below (set from other threads)
        self._short_pages = 0
        self._pressure_pages = 0
        self._next_grow_s = 0.0
        self._grow_wait_s = GROW_RETRY_S[0]
        self._refusal_streak = 0
        self._quiet_until_s = 0.0
        self.counters = {"grows": 0, "refusals": 0, "pages_granted": 0, "pages_released": 0,
                         "pressure_asks": 0, "misses": 0, "deferred": 0}
        self._published: tuple | None = None
        self._zero_reported = False
        self._zero_refusals = 0
        self.closed = False

    # ------------------------------------------------------------ birth (constructing thread)
    def start(self) -> None:
        """Take the first grant and size the allocator to it, before anything is mapped."""
        if not self.governed:
            return
        assert self.grants is not None
        self._report_zero_page()
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
        self.pool_name = str(getattr(manager, "pool_name", "") or "")
        if self.pool_name:
            self.key = f"kvcached:{self.pool_name}:g{self.geometry.group_id}:{self.key.rsplit(':', 1)[1]}"
        if self.governed and self.real.get_num_total_pages() >= 1:
            self._install_real_lock(manager)  # see _install_real_lock: never before a page exists
        self._write_segment()

    # ------------------------------------------------------------ engine path (any thread)
    def note_alloc(self, need_blocks: int, result: Any, block_mem_size: int) -> bool:
        """After ``alloc``: True if the governor's thread should run (a miss, or running low)."""
        if not self.governed:
            return False
        if result is None:
            blocks_per_page = max(1, self.geometry.page_size // max(1, block_mem_size))
            with self._asks:
                self._short_pages = max(self._short_pages, math.ceil(need_blocks / blocks_per_page))
                self.counters["misses"] += 1
            return True
        return self._free_pages() < self.marks.low_pages

    def note_free(self) -> bool:
        """After ``free``: True if the governor's thread should run (too much free, or deferred)."""
        return self.governed and (self.pending_limit is not None or self._free_pages() > self.marks.high_pages)

    def ask_back(self, pages: int) -> None:
        """The broker wants ``pages`` pool pages back (recorded; the governor's thread acts)."""
        with self._asks:
            self._pressure_pages += pages
            self.counters["pressure_asks"] += 1

    def release_standing(self) -> None:
        """A limit channel lowered the limit below what this pool wanted (its TP peers gave
        back): the grant above kvcached's size goes back at the next round (any thread)."""
        self._standing_due = True

    def _free_pages(self) -> int:
        return self.real.get_num_total_pages() - self.real.get_num_inuse_pages()

    # ------------------------------------------------------------ the governor's thread
    def step(self, now_s: float) -> None:
        """One round: kvctl, a deferred limit, pressure, then grow or give back."""
        manager = self.manager()
        if manager is None or self.closed or not self.governed:
            return
        if not manager._post_init_done.is_set():
            self._grow_before_post_init(now_s)
            return
        self._install_real_lock(manager)
        if not self._synced:
            self._set_limit(manager, self.real.get_num_total_pages())
            self._synced = True
        try:
            self._read_operator_cap()
            if self.pending_limit is not None:
                self._finish_deferred(manager)
            self._adopt_lowered_limit(now_s)
            polled = self.grants.poll() if self.grants is not None else 0
            with self._asks:
                pressure, self._pressure_pages = self._pressure_pages + polled, 0
                short, self._short_pages = self._short_pages, 0
                if polled:  # pressure that came through the grants object (a broadcast pool's board)
                    self.counters["pressure_asks"] += 1
            if pressure:
                self._quiet_until_s = now_s + PRESSURE_QUIET_S
                pressure -= self._release_above_limit(pressure)  # a grant held above the limit first
            if pressure > 0:
                self._give_back(manager, pressure, evict=True)
            if self.pending_limit is None:
                self._follow_policy(manager, short, now_s)
            self._write_segment()
            self._publish()
            self._seen_limit_pages = self._limit_pages()
        except SessionEvicted as exc:
            self.governed = False
            self.why_ungoverned = f"evicted: {exc}"
            log.error("event=kvcached_pool_evicted pool=%s detail=%s", self.key, exc)

    def _follow_policy(self, manager: Any, short_pages: int, now_s: float) -> None:
        pages = self.pages()
        decision = decide(pages, self.marks, short_pages=short_pages)
        if isinstance(decision, Grow):
            if not short_pages and (now_s < self._next_grow_s or now_s < self._quiet_until_s):
                return
            if now_s < self._next_grow_s:
                with self._asks:
                    self._short_pages = max(self._short_pages, short_pages)  # keep it for the retry
                return
            self._grow(manager, decision, now_s)
        elif isinstance(decision, Shrink):
            if pages.limit > pages.ceiling:
                self._give_back(manager, pages.limit - pages.ceiling, evict=False)
            else:
                self._lower_now(manager, decision.limit)

    def _grow(self, manager: Any, decision: Grow, now_s: float) -> None:
        assert self.grants is not None
        standing = min(self.grants.pages, self.pages().ceiling)
        if standing > self._limit_pages():
            # A grant already held above the limit (a limit channel that applies where TP
            # peers agree has not raised it yet): use it before asking the broker for more.
            self._set_limit(manager, standing)
            return
        # After a refusal, every other ask is for the whole batch: the broker sizes the pressure
        # it puts on pools above their share from what a refused ask needed at least.
        whole = self._refusal_streak % 2 == 1
        got = self.grants.acquire(decision.pages, decision.pages if whole else decision.min_pages)
        if got is None:
            self._ungovern("broker unusable while growing")
            return
        if got == 0:
            self._refusal_streak += 1
            self._refused()
            self._next_grow_s = now_s + self._grow_wait_s
            self._grow_wait_s = min(GROW_RETRY_S[1], 2 * self._grow_wait_s)
            return
        self._count_grant(got)
        self._refusal_streak = 0
        self._grow_wait_s = GROW_RETRY_S[0]
        self._next_grow_s = 0.0
        self._set_limit(manager, min(self.grants.pages, self.pages().ceiling))

    def _grow_before_post_init(self, now_s: float) -> None:
        """A pool that started with no page: its null block waits; grow the allocator itself."""
        if self.real.get_num_total_pages() >= 1 or now_s < self._next_grow_s or self.grants is None:
            return
        got = self.grants.acquire(initial_pages(self.marks, self.geometry.virtual_pages), 1)
        if got is None:
            self._ungovern("broker unusable at pool start")
        elif got == 0:
            self._refused()
            self._next_grow_s = now_s + self._grow_wait_s
            self._grow_wait_s = min(GROW_RETRY_S[1], 2 * self._grow_wait_s)
        else:
            self.real.resize(self.geometry.allocator_size(got))
            self._count_grant(got)

    # ------------------------------------------------------------ giving back
    def _give_back(self, manager: Any, wanted: int, *, evict: bool) -> None:
        """Lower the limit by ``wanted`` pages: over free pages at once, then (after asking the
        prefix cache to evict) below what is in use, deferred until blocks are freed."""
        pages = self.pages()
        now, later = give_back_plan(pages, wanted, self.marks.floor_pages)
        if now < pages.limit:
            self._lower_now(manager, now)
        if later >= now:  # free pages covered the ask, or the pool is at its floor
            self.blocked = "" if pages.limit - now >= wanted else self._floor_reason(wanted)
            return
        if evict:
            self._evict(manager, now - later)
            inuse = self.real.get_num_inuse_pages()
            if later >= inuse:  # the eviction freed enough at once
                self._lower_now(manager, later)
                self.blocked = ""
                return
            if inuse < self._limit_pages():
                self._lower_now(manager, inuse)
        self._defer(manager, later)

    def _lower_now(self, manager: Any, limit_pages: int) -> None:
        """Lower the limit to ``limit_pages`` (>= in use: kvcached applies it) and release."""
        state = self._set_limit(manager, limit_pages)
        if state.get("status") == "deferred":
            self.pending_limit = limit_pages
            return
        self._release_above_limit()

    def _defer(self, manager: Any, limit_pages: int) -> None:
        inuse = self.real.get_num_inuse_pages()
        state = self._set_limit(manager, limit_pages)
        status = state.get("status")
        if status == "deferred":
            self.pending_limit = limit_pages
            self.counters["deferred"] += 1
            hook = "a prefix-cache hook" if eviction.hook_for(manager) is not None else "no prefix-cache hook"
            self.blocked = (f"deferred: {inuse - limit_pages} pages in use by blocks still allocated "
                            f"({hook}); released as they are freed")
            log.info("event=kvcached_giveback_deferred pool=%s limit_pages=%d inuse_pages=%d detail=%r",
                     self.key, limit_pages, inuse, self.blocked)
        elif status == "rejected":
            self.blocked = f"rejected: {state.get('reason') or 'kvcached refused the resize'}"
            log.warning("event=kvcached_giveback_blocked pool=%s reason=%r", self.key, self.blocked)
        self._release_above_limit()

    def _finish_deferred(self, manager: Any) -> None:
        """Release what a deferred limit freed; re-apply it once its blocks are freed (kvcached
        finishes it on a ``free``, but a prealloc refill racing that resize can leave it pending)."""
        state = manager.memory_limit_state()
        assert self.pending_limit is not None
        if state.get("status") == "deferred" and self.real.get_num_inuse_pages() <= self.pending_limit:
            state = self._set_limit(manager, self.pending_limit)
        self._release_above_limit()
        if state.get("status") != "deferred":
            self.pending_limit = None
            self.blocked = "" if state.get("status") == "applied" else f"{state.get('status')}: {state.get('reason')}"

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
        surplus = self.grants.pages - self._limit_pages()
        if at_most is not None:
            surplus = min(surplus, at_most)
        if surplus <= 0:
            return 0
        if not self.grants.release(surplus):
            self._ungovern("broker unusable while releasing")
            return 0
        self.counters["pages_released"] += surplus
        return surplus

    def _adopt_lowered_limit(self, now_s: float) -> None:
        """kvcached's size fell since the last round without this governor lowering it (a limit
        its TP peers agreed on, or a deferred limit finishing), or a limit channel said its peers
        lowered the limit: the grant above kvcached's size goes back, and, as after pressure, the
        pool grows only on a real miss for a while (its peers gave back; it would hold alone)."""
        due, self._standing_due = self._standing_due, False
        if due:
            self._quiet_until_s = max(self._quiet_until_s, now_s + PRESSURE_QUIET_S)
        if due or self._limit_pages() < self._seen_limit_pages:
            self._release_above_limit()

    def _floor_reason(self, wanted: int) -> str:
        return f"at its floor: {self.marks.floor_pages} page(s) kept for kvcached's null block ({wanted} asked)"

    # ------------------------------------------------------------ kvcached's limit
    def _set_limit(self, manager: Any, limit_pages: int) -> dict:
        """``set_memory_limit`` with the next revision; the state kvcached reports."""
        self._revision += 1
        try:
            return self.limits.apply(manager, self.geometry.limit_bytes(limit_pages), self._revision)
        except Exception as exc:  # noqa: BLE001 - a limit kvcached cannot take changes nothing
            log.warning("event=kvcached_limit_failed pool=%s limit_pages=%d error=%r", self.key, limit_pages, str(exc))
            return {"status": "rejected", "reason": str(exc)}

    def _limit_pages(self) -> int:
        """kvcached's allocator size: the bound on what the pool maps."""
        return self.real.get_num_total_pages()

    def pages(self) -> PoolPages:
        ceiling = self.geometry.virtual_pages
        if self.operator_cap_pages is not None:
            ceiling = min(ceiling, self.operator_cap_pages)
        return PoolPages(inuse=self.real.get_num_inuse_pages(), limit=self._limit_pages(),
                         granted=self.grants.pages if self.grants else 0, ceiling=ceiling)

    # ------------------------------------------------------------ kvctl
    def _read_operator_cap(self) -> None:
        info = segment.read(self.geometry.ipc_name)
        if info is None or self._segment_bytes is None or info.total_bytes == self._segment_bytes:
            return
        cap = self.geometry.pages_of(info.total_bytes)
        self.operator_cap_pages = cap
        granted = self.grants.pages if self.grants else 0
        log.info("event=kvcached_operator_cap pool=%s cap_bytes=%d granted_bytes=%d detail=%s", self.key,
                 info.total_bytes, self.geometry.limit_bytes(granted),
                 "a cap below the grant lowers the limit" if cap < granted else "the grant bounds the pool, not the cap")
        self._segment_bytes = None  # rewrite it with the broker's limit

    def _write_segment(self) -> None:
        shown = self.pending_limit if self.pending_limit is not None else self._limit_pages()
        if not self.governed:
            return
        size = self.geometry.limit_bytes(shown)
        if size != self._segment_bytes and segment.write_limit(self.geometry.ipc_name, size):
            self._segment_bytes = size

    # ------------------------------------------------------------ the broker's view
    def _report_zero_page(self) -> None:
        """kvcached's zero page (one compound page per pool) is physical memory outside the pages."""
        assert self.grants is not None
        try:
            if self.grants.report(self.key, {ZERO_PAGE_POOL: self.geometry.page_bytes}, allocated=False):
                self._zero_reported = True
        except BudgetExceeded as exc:
            if not self._zero_refusals:
                log.warning("event=kvcached_zero_page_unreported pool=%s detail=%s (charged as measured "
                            "usage meanwhile; reported once there is room)", self.key, exc)
            self._zero_refusals += 1

    def _publish(self) -> None:
        """Show the pool's limit and pending give-back in status (usage views, never charged)."""
        assert self.grants is not None
        if not self._zero_reported:
            self._report_zero_page()
            if not self._zero_reported:
                return
        name = self.pool_name or f"g{self.geometry.group_id}"
        # Views may not exceed what the session holds (the broker refuses them), so an operator
        # cap above the grant is not shown here: the limit is what binds.
        views = {f"kvcached.{name}.limit": self.geometry.limit_bytes(self._limit_pages())}
        if self.pending_limit is not None:
            views[f"kvcached.{name}.pending_release"] = self.geometry.limit_bytes(
                max(0, self._limit_pages() - self.pending_limit))
        key = tuple(sorted(views.items()))
        if key == self._published:
            return
        try:
            if self.grants.report(self.key, {ZERO_PAGE_POOL: self.geometry.page_bytes}, usage=views):
                self._published = key
        except BudgetExceeded:
            pass

    # ------------------------------------------------------------ states
    def _count_grant(self, pages: int) -> None:
        if pages:
            self.counters["grows"] += 1
            self.counters["pages_granted"] += pages

    def _refused(self) -> None:
        self.counters["refusals"] += 1

    def _install_real_lock(self, manager: Any) -> None:
        """A real ``RLock`` for kvcached's no-op one (synchronous scheduling), so the governor's
        limit changes never race the engine.  Only once a page exists: with none, kvcached's
        null-block wait runs under the manager lock, and an early ``alloc`` waiting for it
        under a real lock would never let it finish."""
        if self._lock_installed:
            return
        from kvcached.locks import NoOpLock

        if isinstance(manager._lock, NoOpLock):
            manager._lock = threading.RLock()
        self._lock_installed = True

    def _ungovern(self, why: str) -> None:
        """No broker: run as kvcached alone would (limit lifted, kvctl's watcher seen again)."""
        if not self.governed:
            return
        self.governed = False
        self.why_ungoverned = why
        manager = self.manager()
        if manager is not None and manager._post_init_done.is_set():
            self._set_limit(manager, self.geometry.virtual_pages)
        else:
            self.real.resize(self.geometry.allocator_size(self.geometry.virtual_pages))
        log.warning("event=kvcached_pool_ungoverned pool=%s reason=%r detail=runs_as_kvcached_alone", self.key, why)

    def manager(self) -> Any:
        return self._manager() if self._manager is not None else None

    def close(self) -> None:
        """The pool shut down: give its grant back."""
        if self.closed:
            return
        self.closed = True
        if self.governed and self.grants is not None:
            held = self.grants.pages
            if held and self.grants.release(held):
                self.counters["pages_released"] += held
            self.grants.forget(self.key)

    def status(self) -> dict[str, Any]:
        """This pool as the governor sees it (bytes, and pool pages where named)."""
        pages = self.pages()
        reserved = self.real.get_num_reserved_pages()
        g = self.geometry
        return {
            "pool": self.pool_name, "key": self.key, "group_id": g.group_id, "ipc_name": g.ipc_name,
            "governed": self.governed, "why_ungoverned": self.why_ungoverned, "page_bytes": g.page_bytes,
            "limit_bytes": g.limit_bytes(pages.limit), "granted_bytes": g.limit_bytes(pages.granted),
            "mapped_bytes": g.limit_bytes(pages.inuse + reserved), "inuse_pages": pages.inuse,
            "reserve_pages": reserved, "virtual_bytes": g.limit_bytes(g.virtual_pages),
            "operator_cap_bytes": None if self.operator_cap_pages is None else g.limit_bytes(self.operator_cap_pages),
            "pending_limit_bytes": None if self.pending_limit is None else g.limit_bytes(self.pending_limit),
            "blocked": self.blocked, "revision": self._revision, **self.counters,
        }


def now_s() -> float:
    return time.monotonic()
