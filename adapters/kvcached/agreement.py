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
evictions are too) and sets the agreed limit with ``set_memory_limit`` (through the governor,
:meth:`~.governor.PoolGovernor.apply_own_limit`: the pool's revisions come from one place).

Invariants:

* between two sync points no pool's limit changes (only kvcached's own deferred shrink, which
  finishes on a ``free``, the scheduler's thread, identically on every rank);
* the agreed limit of a pool is at most every governed rank's grant (a rank without a broker
  offers no constraint, so nothing deadlocks and the governed ranks still bound the group);
* **an offer is a reservation.**  The grant a rank offers stays held until that sync applied
  the agreed limit: a release on the governor's thread (pressure, a limit its peers lowered, a
  deferred limit finishing) that lands while the scheduler is inside the collective waits,
  bounded, for the sync to end and then gives back only what is above the limit it applied
  (never what the sync is using: :meth:`Agreement.release`).  So the limit a sync applies is
  never above the rank's grant, on every rank alike;
* every rank takes part in every sync with the same vector length, whatever happened to its
  broker: a failure reading a proposal offers no constraint instead of skipping the collective;
* a deferred limit (below what is in use) keeps asking for prefix-cache eviction of the pages
  above it at every sync until it applies or nothing is evictable (kvcached places a request's
  blocks over several pages, so evicting N pages' worth of tokens can free fewer pages);
* when the agreed limit falls, every rank's governor gives back the grant it held above
  kvcached's size (:meth:`~.governor.PoolGovernor.release_standing`): a grant taken to grow
  while a peer could not is not kept once the group shrinks.  Only a rank whose limit fell
  below what it offered (its peers lowered it) is then quieted, growing only on a real miss
  for a while; a rank whose own lowering the sync applied is not (a shrink of its own that its
  engine overtook is withdrawn, and it must grow again at once);
* a rank that wants a limit at or above kvcached's size (a withdrawn shrink, lifting a deferred
  limit) asks for no eviction of the pages above the deferred one.

Units: pool pages (kvcached compound pages) unless a name says otherwise.  Runtime-neutral:
the runtime passes its reduce and its eviction (:mod:`..sglang.kvcached_sync` for SGLang).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import announce, process_state
from . import kvcached_api, limits, runner
from .geometry import PoolGeometry
from .governor import PoolGovernor
from .grants import Grants

log = announce.logger("kvcached_broker.adapters")

#: How long a governor waits for the next sync point before it goes on (the limit it wants
#: stays standing and applies at that sync; the governor releases only what kvcached reports).
WAIT_S = 2.0

Reduce = Callable[[list[int]], list[int]]
#: ``evict([(manager, pages), ...])``: free about that many pool pages of unused prefix blocks.
Evict = Callable[[list[tuple[Any, int]]], object]


@dataclass
class SyncState:
    """What one pool's governor asked the sync points for."""

    wanted_pages: int | None = None  # the limit it wants (None: not asked yet)
    evict_pages: int = 0  # prefix-cache eviction asked since the last sync
    agreed_pages: int | None = None  # the limit the last sync applied
    offered: int | None = None  # the grant offered into the sync in flight: held until it ends
    releasing: int = 0  # pages the governor's thread is giving back right now
    release_waits: int = 0  # releases that waited for a sync to end (status, tests)


@dataclass(frozen=True)
class Proposal:
    """A rank's offer into a sync point's collective: ``[min(wanted, granted), -evict_pages]``
    per pool, and the newest want it covers (every want up to it is served once it settles)."""

    offer: list[int]
    served: int


@dataclass
class SyncRecord:
    """One sync point as this rank saw it (tests, status)."""

    number: int
    agreed_pages: list[int] = field(default_factory=list)
    evicted_pages: list[int] = field(default_factory=list)
    limit_pages: list[int] = field(default_factory=list)  # kvcached's allocator size after it


class Agreement:
    """This process's pools under sync points, and the syncs themselves.  The process's one
    (:func:`shared`) is hook wiring: the limit factory kvcached mode installs once closes over
    it, so a reset of the process's state keeps it."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._states: "weakref.WeakKeyDictionary[Any, SyncState]" = weakref.WeakKeyDictionary()
        self._seq = 0
        self._served_seq = 0  # every want up to this one was offered at a completed sync
        self.syncs = 0
        self.last: SyncRecord | None = None

    # ------------------------------------------------------------ the governors' thread
    def want(self, manager: Any, pages: int) -> int:
        """Record the limit ``manager``'s governor wants; the sequence number to wait for
        (0: nothing changed, nothing to wait for)."""
        with self._lock:
            state = self._states.setdefault(manager, SyncState())
            if state.wanted_pages == pages:
                return 0
            self._seq += 1
            state.wanted_pages = pages
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
            state = self._states.setdefault(manager, SyncState())
            state.evict_pages = max(state.evict_pages, int(pages))

    # ------------------------------------------------------------ the scheduler's thread
    def sync(self, reduce: Reduce | None, evict: Evict | None,
             pools: list[tuple[Any, Any]] | None = None) -> SyncRecord | None:
        """One sync point: :meth:`propose`, the runtime's ``reduce`` (the collective), then
        :meth:`settle`.  Every rank calls it at the same points; None (and no collective) when
        this process has no kvcached pool (``pools``: :func:`ordered_pools` by default), on every
        rank alike.  With pools, ``reduce`` is called exactly once, whatever fails before it."""
        pools = ordered_pools() if pools is None else pools
        if not pools:
            return None
        try:
            proposal = self.propose(pools)
            agreed = reduce(proposal.offer) if reduce is not None else proposal.offer
        except BaseException:
            self._unpin(pools)
            raise
        return self.settle(pools, proposal, agreed, evict)

    def propose(self, pools: list[tuple[Any, Any]]) -> Proposal:
        """What this rank offers into the collective for ``pools`` (``(governor, manager)`` in
        creation order).  Each governed pool's offer is held until :meth:`settle` ends the sync;
        a failure reading it offers no constraint, so the rank still takes part."""
        try:
            offer, served = self._offer(pools, [_deferred_overage(governor, manager) for governor, manager in pools])
        except Exception as exc:  # noqa: BLE001 - take part all the same, constraining nothing
            log.warning("event=kvcached_agreement_offer_failed error=%r", str(exc))
            self._unpin(pools)
            offer, served = [_NO_CONSTRAINT, 0] * len(pools), 0
        return Proposal(offer, served)

    def settle(self, pools: list[tuple[Any, Any]], proposal: Proposal, agreed: Sequence[int],
               evict: Evict | None) -> SyncRecord:
        """After the collective (``agreed``: the element-wise MIN of every rank's offer): evict
        the agreed amount, apply the agreed limits, and release the offers :meth:`propose` held."""
        try:
            return self._settle(pools, agreed, proposal.served, evict)
        finally:
            self._unpin(pools)

    def _settle(self, pools: list[tuple[Any, Any]], agreed: Sequence[int], served: int,
                evict: Evict | None) -> SyncRecord:
        record = SyncRecord(self.syncs + 1)
        lowered = False
        evictions = []
        for i, (_governor, manager) in enumerate(pools):
            record.agreed_pages.append(agreed[2 * i])
            record.evicted_pages.append(max(0, -agreed[2 * i + 1]))
            if record.evicted_pages[-1]:
                evictions.append((manager, record.evicted_pages[-1]))
        if evictions and evict is not None:
            _guarded("evict", evict, evictions)
        for i, (governor, manager) in enumerate(pools):
            before = _size(governor)
            state = self._states[manager]
            previous = state.agreed_pages
            own = state.offered if state.offered is not None else state.wanted_pages  # what this rank offered
            _guarded("apply", self._apply, governor, manager, record.agreed_pages[i])
            after = _size(governor)
            record.limit_pages.append(after)
            if previous is not None and record.agreed_pages[i] < previous:
                governor.release_standing(quiet=own is None or record.agreed_pages[i] < own)
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
        """``[min(wanted, granted), -evict_pages]`` per pool, and the newest want offered; each
        governed pool's offer is held (:attr:`SyncState.offered`) until the sync ends."""
        offer: list[int] = []
        with self._lock:
            served = self._seq
            for (governor, manager), overage in zip(pools, overages):
                state = self._states.setdefault(manager, SyncState())
                proposal = _proposal(governor, state)
                if _governed(governor):
                    size = governor.real.get_num_total_pages()
                    if not isinstance(governor.grants, AgreedGrants):  # its releases do not wait: nothing above its size
                        proposal = min(proposal, size)
                    state.offered = proposal
                    if proposal >= size:  # it lifts a deferred limit (a withdrawn shrink): nothing to evict for it
                        overage = 0
                offer += [proposal, -max(state.evict_pages, overage)]
                state.evict_pages = 0
        return offer, served

    def _unpin(self, pools: list[tuple[Any, Any]]) -> None:
        with self._lock:
            for _governor, manager in pools:
                state = self._states.get(manager)
                if state is not None:
                    state.offered = None
            self._lock.notify_all()

    def release(self, governor: Any, manager: Any, release: Callable[[int], bool], pages: int,
                wait_s: float = WAIT_S) -> bool:
        """The governor gives back ``pages`` of ``manager``'s grant (its thread).  While a sync
        holds the pool's offer, wait (at most ``wait_s``) for it to end; then give back only what
        is above both the offer still held and kvcached's size (the limit the sync applied)."""
        with self._lock:
            state = self._states.setdefault(manager, SyncState())
            if state.offered is not None:
                state.release_waits += 1
                self._lock.notify_all()
                self._lock.wait_for(lambda: state.offered is None, timeout=wait_s)
            floor = max(state.offered or 0, governor.real.get_num_total_pages())
            allowed = max(0, min(int(pages), governor.grants.pages - floor))
            state.releasing += allowed
        try:
            done = release(allowed) if allowed > 0 else True
        finally:
            with self._lock:
                state.releasing -= allowed
        if allowed < pages:
            log.info("event=kvcached_agreement_release_held pool=%s asked_pages=%d released_pages=%d "
                     "detail=the rest is what the sync point's limit uses", getattr(governor, "key", "?"),
                     pages, allowed)
        return done

    def _apply(self, governor: Any, manager: Any, pages: int) -> None:
        state = self._states.setdefault(manager, SyncState())
        if _governed(governor) and pages > governor.grants.pages:  # the offer is held: cannot happen
            log.error("event=kvcached_agreement_above_grant pool=%s agreed_pages=%d granted_pages=%d "
                      "detail=applying the grant (this rank's limit differs from its peers' until the next sync)",
                      getattr(governor, "key", "?"), pages, governor.grants.pages)
            pages = governor.grants.pages
        limit = kvcached_api.limit_state(manager)
        unchanged = state.agreed_pages == pages
        finishing = limit.deferred and governor.real.get_num_inuse_pages() <= pages
        if unchanged and not finishing:
            return
        applied = governor.apply_own_limit(manager, governor.geometry.limit_bytes(pages))
        for _ in range(_PREALLOC_RETRIES):
            if not applied.deferred or governor.real.get_num_inuse_pages() > pages:
                break
            # Nothing in use keeps the pool above the limit: kvcached's page preallocation was
            # mapping pages outside its allocator's lock (not free, not yet reserved), so the
            # shrink failed.  Those maps take moments; deferring would leave this rank's capacity
            # unlike its peers' until blocks are freed.
            time.sleep(_PREALLOC_RETRY_S)
            applied = governor.apply_own_limit(manager, governor.geometry.limit_bytes(pages))
        state.agreed_pages = pages

    def state_of(self, manager: Any) -> SyncState | None:
        with self._lock:
            return self._states.get(manager)

    def pending_wants(self) -> int:
        """Wants recorded and not yet offered at a sync point."""
        with self._lock:
            return self._seq - self._served_seq


#: A limit kvcached deferred only because its page preallocation was mid-map is applied again,
#: at most this many times, this far apart (on the scheduler's thread, inside the sync point).
_PREALLOC_RETRIES = 20
_PREALLOC_RETRY_S = 0.002

#: An offer that constrains nothing (a failed offer still takes part in the collective).
_NO_CONSTRAINT = 1 << 40


def _governed(governor: Any) -> bool:
    return bool(governor.governed) and governor.grants is not None


def _proposal(governor: Any, state: SyncState) -> int:
    """What this rank offers for a pool: the limit it wants, at most its grant (less what the
    governor is giving back right now); a rank without a broker offers no constraint (the
    pool's whole virtual range)."""
    try:
        virtual = governor.geometry.virtual_pages
        if not _governed(governor):
            return virtual
        wanted = state.wanted_pages if state.wanted_pages is not None else governor.real.get_num_total_pages()
        return max(0, min(wanted, governor.grants.pages - state.releasing, virtual))
    except Exception as exc:  # noqa: BLE001 - still take part in the collective, constraining nothing
        log.warning("event=kvcached_agreement_offer_failed pool=%s error=%r", getattr(governor, "key", "?"), str(exc))
        return getattr(getattr(governor, "geometry", None), "virtual_pages", _NO_CONSTRAINT)


class AgreedGrants:
    """A pool's grants whose give-backs go through :meth:`Agreement.release` (the offer a sync
    holds stays granted: "an offer is a reservation"); everything else is ``inner``'s.  The
    :class:`AgreedLimits` channel composes it when the governor is built
    (:meth:`AgreedLimits.route_releases`) for grants mapped in this process, so every release of
    that pool's grant, from its first, passes the sync points.  Before the manager is known (or
    once it is gone) a release goes straight to ``inner``: no sync point holds an offer of a pool
    it has not seen."""

    def __init__(self, inner: Grants, agreement: Agreement, governor: PoolGovernor, wait_s: float = WAIT_S):
        self.inner = inner
        self.agreement = agreement
        self.governor = governor
        self.wait_s = wait_s  # how long a release waits for a sync that holds the pool's offer
        self.maps_here = inner.maps_here
        self.ratio = inner.ratio

    @property
    def pages(self) -> int:
        return self.inner.pages

    def release(self, pages: int, *, mapped: int | None = None, key: str | None = None) -> bool:
        manager = self.governor.manager()
        if manager is None:
            return self.inner.release(pages, mapped=mapped, key=key)
        return self.agreement.release(self.governor, manager,
                                      lambda allowed: self.inner.release(allowed, mapped=mapped, key=key), pages,
                                      self.wait_s)

    def lost(self) -> str | None:
        return self.inner.lost()

    def acquire(self, pages: int, min_pages: int, *, wait_s: float | None = None) -> int | None:
        return self.inner.acquire(pages, min_pages, wait_s=wait_s)

    def mapped(self, key: str, pages: int) -> None:
        self.inner.mapped(key, pages)

    def idle(self, key: str, pages: int) -> None:
        self.inner.idle(key, pages)

    def uncharged_pages(self) -> int:
        return self.inner.uncharged_pages()

    def unasked_shortfall(self) -> int:
        return self.inner.unasked_shortfall()

    def report(self, key: str, pools: dict[str, int], *, usage: dict[str, int] | None = None,
               allocated: bool = True) -> bool:
        return self.inner.report(key, pools, usage=usage, allocated=allocated)

    def forget(self, key: str) -> None:
        self.inner.forget(key)

    def forget_report(self, key: str) -> None:
        self.inner.forget_report(key)

    def poll(self) -> int:
        return self.inner.poll()


def _size(governor: Any) -> int:
    """kvcached's allocator size (-1 if it cannot be read)."""
    try:
        return int(governor.real.get_num_total_pages())
    except Exception:  # noqa: BLE001 - a record without it rather than a sync that raises
        return -1


def _deferred_overage(governor: Any, manager: Any) -> int:
    """Pages in use above a deferred limit (0 when kvcached applied its limit)."""
    try:
        limit = kvcached_api.limit_state(manager)
        if not limit.deferred or limit.effective_limit_bytes is None:
            return 0
        return max(0, governor.real.get_num_inuse_pages() - limit.effective_limit_bytes // governor.geometry.page_bytes)
    except Exception:  # noqa: BLE001 - no eviction asked rather than no sync
        return 0


def ordered_pools() -> list[tuple[Any, Any]]:
    """``(governor, manager)`` of every live kvcached pool of this process, in creation order
    (the same on every rank: they build the same pools in the same order)."""
    found = []
    for governor in runner.governors():
        if not isinstance(governor, PoolGovernor):  # a TP worker's grant holder (vLLM): no pool here
            continue
        manager = governor.manager()
        if manager is not None and not governor.closed:
            found.append((governor, manager))
    return sorted(found, key=lambda pair: pair[0].sequence)


def _guarded(action: str, call: Callable[..., object], *args: Any) -> None:
    """``call(*args)``; a failure after the collective is logged, never raised into the scheduler."""
    try:
        call(*args)
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

    def route_releases(self, grants: Grants, governor: PoolGovernor) -> Grants:
        """Grants of a pool mapped in this process, routed through the agreement (they wait for a
        sync that holds their offer, at most ``wait_s``); grants mapped elsewhere as they are
        (none today): their releases would not wait, so :meth:`Agreement._offer` offers no more
        than the pool's size for them."""
        return AgreedGrants(grants, self.agreement, governor, self.wait_s) if grants.maps_here else grants

    def apply(self, governor: limits.OwnLimits, manager: Any, limit_bytes: int) -> kvcached_api.LimitState:
        """Record the limit the governor wants (never more than its grant) for the next sync
        point, and wait for it, at most ``wait_s``; kvcached's limit state then."""
        assert isinstance(governor, PoolGovernor)
        pages = governor.geometry.pages_of(limit_bytes)
        if governor.governed and governor.grants is not None:
            pages = min(pages, governor.grants.pages)  # never want more than this rank holds
        self.agreement.wait(self.agreement.want(manager, pages), self.wait_s)
        return kvcached_api.limit_state(manager)


def shared() -> Agreement:
    """The process's agreement (one scheduler per process in SGLang)."""
    return process_state.part(Agreement)


def channel_factory(agreement: Agreement | None = None) -> Callable[[PoolGeometry], AgreedLimits]:
    """A ``limits.set_factory`` factory: every new pool's limits go through ``agreement`` (the
    process's, :func:`shared`, by default)."""
    chosen = shared() if agreement is None else agreement
    return lambda geometry: AgreedLimits(chosen)
