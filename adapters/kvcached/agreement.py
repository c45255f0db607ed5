"""Pool limits that change only where every tensor-parallel rank agrees (SGLang's scheduler).

A runtime that checks capacity and then allocates, and takes a refused allocation as fatal
(SGLang: ``available_size()`` decides admission, a None from the allocator raises), must not
see its pool's limit change between the two; and ranks that schedule independently must see
the same capacity, or their collectives hang.  So in such a runtime a governor never lowers or
raises kvcached's limit itself.  Its :class:`AgreedLimits` channel records the limit it wants
(never above its own grant) and waits, bounded, for the next *sync point*.  At a sync point
(:meth:`Agreement.sync`, called by the runtime on its scheduler thread, on a schedule every rank
follows) every rank offers, per pool in creation order, ``[min(wanted, granted), -evict_pages]``;
one MIN reduce over the ranks gives the limit they all apply and the most any of them wants
evicted.  Each rank then evicts that much from its prefix cache (the trees are identical, so the
evictions are too) and sets the agreed limit with ``set_memory_limit``.

Invariants:

* between two sync points no pool's limit changes (only kvcached's own deferred shrink, which
  finishes on a ``free``, the scheduler's thread, identically on every rank);
* the agreed limit of a pool is at most every governed rank's grant (a rank without a broker
  offers no constraint, so nothing deadlocks and the governed ranks still bound the group);
* every rank takes part in every sync with the same vector length, whatever happened to its
  broker: a failure reading a proposal offers no constraint instead of skipping the collective;
* a deferred limit (below what is in use) keeps asking for prefix-cache eviction of the pages
  above it at every sync until it applies or nothing is evictable (kvcached places a request's
  blocks over several pages, so evicting N pages' worth of tokens can free fewer pages);
* when the agreed limit falls, every rank's governor gives back the grant it held above
  kvcached's size (:meth:`~.governor.PoolGovernor.release_standing`): a grant taken to grow
  while a peer could not is not kept once the group shrinks.

Units: pool pages (kvcached compound pages) unless a name says otherwise.  Runtime-neutral:
the runtime passes its reduce and its eviction (:mod:`..sglang.kvcached_sync` for SGLang).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import runner
from .geometry import PoolGeometry

log = logging.getLogger("kvcached_broker.adapters")

#: How long a governor waits for the next sync point before it goes on (the limit it wants
#: stays standing and applies at that sync; the governor releases only what kvcached reports).
WAIT_S = 2.0

Reduce = Callable[[list[int]], list[int]]
#: ``evict([(manager, pages), ...])``: free about that many pool pages of unused prefix blocks.
Evict = Callable[[list[tuple[Any, int]]], None]


@dataclass
class PoolState:
    """What one pool's governor asked the sync points for."""

    wanted_pages: int | None = None  # the limit it wants (None: not asked yet)
    want_seq: int = 0  # the sequence number of that want
    evict_pages: int = 0  # prefix-cache eviction asked since the last sync
    agreed_pages: int | None = None  # the limit the last sync applied


@dataclass
class SyncRecord:
    """One sync point as this rank saw it (tests, status)."""

    number: int
    agreed_pages: list[int] = field(default_factory=list)
    evicted_pages: list[int] = field(default_factory=list)
    limit_pages: list[int] = field(default_factory=list)  # kvcached's allocator size after it


class Agreement:
    """This process's pools under sync points, and the syncs themselves."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._states: "weakref.WeakKeyDictionary[Any, PoolState]" = weakref.WeakKeyDictionary()
        self._seq = 0
        self._served_seq = 0  # every want up to this one was offered at a completed sync
        self.syncs = 0
        self.last: SyncRecord | None = None

    # ------------------------------------------------------------ the governors' thread
    def want(self, manager: Any, pages: int) -> int:
        """Record the limit ``manager``'s governor wants; the sequence number to wait for
        (0: nothing changed, nothing to wait for)."""
        with self._lock:
            state = self._states.setdefault(manager, PoolState())
            if state.wanted_pages == pages:
                return 0
            self._seq += 1
            state.wanted_pages, state.want_seq = pages, self._seq
            return self._seq

    def wait(self, seq: int, timeout_s: float = WAIT_S) -> bool:
        """Wait until a sync point offered want ``seq``; False on timeout (or before the
        runtime's first sync point: nothing would answer)."""
        if seq <= 0:
            return True
        with self._lock:
            if not self.syncs:
                return False
            return self._lock.wait_for(lambda: self._served_seq >= seq, timeout=timeout_s)

    def request_eviction(self, manager: Any, pages: int) -> None:
        """Ask the next sync point to evict about ``pages`` pool pages of unused prefix blocks."""
        with self._lock:
            state = self._states.setdefault(manager, PoolState())
            state.evict_pages = max(state.evict_pages, int(pages))

    # ------------------------------------------------------------ the scheduler's thread
    def sync(self, reduce: Reduce | None, evict: Evict | None) -> SyncRecord | None:
        """One sync point: agree, evict, apply.  Every rank calls it at the same points; None
        (and no collective) when this process has no kvcached pool, on every rank alike."""
        pools = ordered_pools()
        if not pools:
            return None
        offer, served = self._offer(pools, [_deferred_overage(governor, manager) for governor, manager in pools])
        agreed = reduce(offer) if reduce is not None else offer
        record = SyncRecord(self.syncs + 1)
        lowered = False
        evictions = []
        for i, (governor, manager) in enumerate(pools):
            record.agreed_pages.append(agreed[2 * i])
            record.evicted_pages.append(max(0, -agreed[2 * i + 1]))
            if record.evicted_pages[-1]:
                evictions.append((manager, record.evicted_pages[-1]))
        if evictions and evict is not None:
            _guarded("evict", lambda: evict(evictions))
        for i, (governor, manager) in enumerate(pools):
            before = governor.real.get_num_total_pages()
            previous = self._states[manager].agreed_pages
            _guarded("apply", lambda: self._apply(governor, manager, record.agreed_pages[i]))
            after = governor.real.get_num_total_pages()
            record.limit_pages.append(after)
            if previous is not None and record.agreed_pages[i] < previous:
                governor.release_standing()
                lowered = True
            lowered = lowered or after < before
        with self._lock:
            self.syncs = record.number
            self.last = record
            self._served_seq = max(self._served_seq, served)
            self._lock.notify_all()
        if lowered:
            runner.wake()  # governors give back the grant above a limit their peers lowered
        return record

    def _offer(self, pools: list[tuple[Any, Any]], overages: list[int]) -> tuple[list[int], int]:
        """``[min(wanted, granted), -evict_pages]`` per pool, and the newest want offered."""
        offer: list[int] = []
        with self._lock:
            served = self._seq
            for (governor, manager), overage in zip(pools, overages):
                state = self._states.setdefault(manager, PoolState())
                offer += [_proposal(governor, state), -max(state.evict_pages, overage)]
                state.evict_pages = 0
        return offer, served

    def _apply(self, governor: Any, manager: Any, pages: int) -> None:
        state = self._states.setdefault(manager, PoolState())
        limit = manager.memory_limit_state()
        unchanged = state.agreed_pages == pages
        finishing = limit.get("status") == "deferred" and governor.real.get_num_inuse_pages() <= pages
        if unchanged and not finishing:
            return
        revision = int(limit.get("revision") or 0) + 1
        manager.set_memory_limit(governor.geometry.limit_bytes(pages), revision=revision)
        state.agreed_pages = pages

    def state_of(self, manager: Any) -> PoolState | None:
        with self._lock:
            return self._states.get(manager)

    def pending_wants(self) -> int:
        """Wants recorded and not yet offered at a sync point."""
        with self._lock:
            return self._seq - self._served_seq


def _proposal(governor: Any, state: PoolState) -> int:
    """What this rank offers for a pool: the limit it wants, at most its grant; a rank without
    a broker offers no constraint (the pool's whole virtual range)."""
    try:
        virtual = governor.geometry.virtual_pages
        if not governor.governed or governor.grants is None:
            return virtual
        wanted = state.wanted_pages if state.wanted_pages is not None else governor.real.get_num_total_pages()
        return max(0, min(wanted, governor.grants.pages, virtual))
    except Exception as exc:  # noqa: BLE001 - still take part in the collective, constraining nothing
        log.warning("event=kvcached_agreement_offer_failed pool=%s error=%r", getattr(governor, "key", "?"), str(exc))
        return getattr(getattr(governor, "geometry", None), "virtual_pages", 1 << 40)


def _deferred_overage(governor: Any, manager: Any) -> int:
    """Pages in use above a deferred limit (0 when kvcached applied its limit)."""
    try:
        limit = manager.memory_limit_state()
        if limit.get("status") != "deferred":
            return 0
        return max(0, governor.real.get_num_inuse_pages() - int(limit["effective_limit_bytes"]) // governor.geometry.page_bytes)
    except Exception:  # noqa: BLE001 - no eviction asked rather than no sync
        return 0


def ordered_pools() -> list[tuple[Any, Any]]:
    """``(governor, manager)`` of every live kvcached pool of this process, in creation order
    (the same on every rank: they build the same pools in the same order)."""
    from .governor import PoolGovernor

    found = []
    for governor in runner.governors():
        if not isinstance(governor, PoolGovernor):  # a TP worker's grant holder (vLLM): no pool here
            continue
        manager = governor.manager()
        if manager is not None and not governor.closed:
            found.append((governor, manager))
    return sorted(found, key=lambda pair: pair[0].sequence)


def _guarded(action: str, call: Callable[[], None]) -> None:
    """A failure after the collective is logged, never raised into the scheduler."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the runtime must never see an agreement failure
        log.warning("event=kvcached_agreement_failed action=%s error=%r", action, str(exc))


class AgreedLimits:
    """A :class:`~.limits.LimitChannel` whose limits apply at the runtime's sync points."""

    #: No limit of such a pool changes anywhere else: not even kvcached's kvctl watcher on a pool
    #: without a broker (:meth:`~.governor.PoolGovernor.resize_target`).  The ranks share one
    #: segment, so the watcher would apply a governed peer's limit on this rank alone; an
    #: operator's ``kvctl limit`` reaches the group through its governed ranks' caps.
    at_sync_points = True

    def __init__(self, agreement: Agreement, wait_s: float = WAIT_S):
        self.agreement = agreement
        self.wait_s = wait_s

    def apply(self, manager: Any, limit_bytes: int, revision: int) -> dict:
        governor = manager.page_allocator.governor
        pages = governor.geometry.pages_of(limit_bytes)
        if governor.governed and governor.grants is not None:
            pages = min(pages, governor.grants.pages)  # never want more than this rank holds
        self.agreement.wait(self.agreement.want(manager, pages), self.wait_s)
        return manager.memory_limit_state()


#: The process's agreement (one scheduler per process in SGLang).
AGREEMENT = Agreement()


def channel_factory(agreement: Agreement = AGREEMENT) -> Callable[[PoolGeometry], AgreedLimits]:
    """A ``limits.set_factory`` factory: every new pool's limits go through ``agreement``."""
    return lambda geometry: AgreedLimits(agreement)


def split_offer(values: Sequence[int]) -> list[tuple[int, int]]:
    """``[(limit pages, evict pages), ...]`` of a reduced offer (tests, logs)."""
    return [(values[i], max(0, -values[i + 1])) for i in range(0, len(values), 2)]
