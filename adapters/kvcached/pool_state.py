"""A governed kvcached pool's state, with no I/O: its phase, what other threads asked of it,
when it may ask the broker again, and the arithmetic that keeps **mapped <= limit <= granted**.

The governor (:mod:`.governor`) is the shell: it reads kvcached and calls the broker, and every
decision about the pool's state is made here, from page counts and times it passes in.  Units:
pool pages (kvcached compound pages) and seconds on the monotonic clock.

**Phases.**  A pool is in exactly one; an event not listed for its phase is a bug in the shell
and raises :class:`PoolStateError` (nothing changes)::

    phase       event        next        what it means
    GOVERNED    defer        DEFERRING   a lowered limit waits for blocks to be freed
    DEFERRING   defer        DEFERRING   (a newer deferred limit replaces the pending one)
    DEFERRING   settle       GOVERNED    the pending limit applied (or kvcached gave it up)
    GOVERNED    settle       GOVERNED    (nothing was pending)
    GOVERNED    ungovern     UNGOVERNED  no broker, or evicted: the pool runs as kvcached alone
    DEFERRING   ungovern     UNGOVERNED  (the pending limit is dropped with the governing)
    GOVERNED    close        CLOSING     the pool shut down: its grant goes back as kvcached unmaps
    DEFERRING   close        CLOSING     (the pending limit stays, for status: nothing maps any more)
    CLOSING     forget       DONE        all of the grant went back, or the session is gone
    CLOSING     ungovern     DONE        a start that failed midway gave its grant back
    UNGOVERNED  close        DONE        nothing to give back
    UNGOVERNED  ungovern     UNGOVERNED  (already: said once, nothing changes)
    UNGOVERNED, CLOSING, DONE
                defer|settle (the same)  a round already under way when the pool stopped being
                                         governed, or was closed from the engine's thread:
                                         nothing is recorded

``governed`` is GOVERNED, DEFERRING or CLOSING (the pool holds a grant the shell must keep
above kvcached's size); ``closed`` is CLOSING or DONE.  UNGOVERNED and DONE are final for the
broker: the shell never calls it for the pool again, and a round stops as soon as its pool
stopped being governed.  ``pending_limit`` is set in DEFERRING and None in GOVERNED and
UNGOVERNED; a closing pool keeps the one it had (status shows it until the pool is done).

**Limits** (the invariant; :func:`limit_after_grant`, :func:`surplus_pages`):

* L1. the limit rises only after a grant, to at most ``min(granted, ceiling)``;
* L2. pages go back to the broker only above kvcached's allocator size as kvcached reports it
  (the size bounds what it maps; a limit asked but deferred does not lower it);
* L3. each limit the governor applies has a revision newer than any the pool has seen: its own,
  an outside caller's, kvcached's current one (:meth:`PoolState.next_revision`).

**What the pool knows of kvcached's limit** (:class:`PoolState`; the shell reads kvcached and
says what it found, the state says what the shell does next):

* K1. the first round of a governed pool applies kvcached's own size once, with the governor's
  revision (:meth:`PoolState.take_sync`), so every later limit of the pool is the governor's;
* K2. ``operator_cap_pages`` is the last cap an operator set (a foreign ``total_size`` in the
  segment, an outside ``set_memory_limit``; None: none): the pool's ceiling is at most it
  (:meth:`PoolState.ceiling`); a pool that stops being governed drops it;
* K3. kvcached's size fell since the last round ended (:meth:`PoolState.round_ended`,
  :meth:`PoolState.limit_fell`) without this governor lowering it, or a limit channel said it
  lowered it (:meth:`AskBook.release_standing`: the pool's TP peers did, or a sync applied the
  pool's own lowering after its governor stopped waiting): the grant above the size goes back
  (L2) in the next round;
* K4. ``blocked`` says why the last give-back fell short (empty: it did not), and only this
  state writes it: :meth:`PoolState.defer` (the pending limit's reason), :meth:`PoolState.settle`
  and :meth:`PoolState.answer` (a give-back done, short at the floor, or refused by kvcached,
  nothing deferred: the phase stays).

**What the broker was told** (:class:`Told`; the shell tells it, and says what it answered):
the zero page's report (once accepted; a refusal is said in the log the first time only, and it
is reported again under a new key after a rename), the mapped and idle page counts and the
status views last told (each told again only when it changed).

**Asks** (:class:`AskBook`): what the engine's allocation path, the broker's pressure callback,
a limit channel and outside ``set_memory_limit`` callers recorded, on their threads; the
governor's thread takes them in one swap per round (:meth:`AskBook.take`,
:meth:`AskBook.take_outside_cap`, :meth:`AskBook.take_standing`).

**Pacing** (:class:`GrowPacing`): a refused growth ahead of need waits ``GROW_RETRY_S[0]``
before the next, doubling to ``GROW_RETRY_S[1]``; after a pressure ask the pool grows only on a
real miss for ``PRESSURE_QUIET_S``; after a refusal every other ask ahead of need is for the
whole batch (the broker sizes its pressure from what a refused ask needed at least).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

GROW_RETRY_S = (0.05, 0.5)  # first and longest wait after a refused growth
#: After a pressure ask, a pool grows only on a refused allocation (not ahead of need) for this
#: long, so what it gave back goes to the pool that asked rather than straight back to it.
PRESSURE_QUIET_S = 2.0


class Phase(enum.Enum):
    GOVERNED = "governed"
    DEFERRING = "deferring"
    UNGOVERNED = "ungoverned"
    CLOSING = "closing"
    DONE = "done"


class Event(enum.Enum):
    DEFER = "defer"
    SETTLE = "settle"
    UNGOVERN = "ungovern"
    CLOSE = "close"
    FORGET = "forget"


_NEXT: dict[tuple[Phase, Event], Phase] = {
    (Phase.GOVERNED, Event.DEFER): Phase.DEFERRING,
    (Phase.DEFERRING, Event.DEFER): Phase.DEFERRING,
    (Phase.DEFERRING, Event.SETTLE): Phase.GOVERNED,
    (Phase.GOVERNED, Event.SETTLE): Phase.GOVERNED,
    (Phase.GOVERNED, Event.UNGOVERN): Phase.UNGOVERNED,
    (Phase.DEFERRING, Event.UNGOVERN): Phase.UNGOVERNED,
    (Phase.GOVERNED, Event.CLOSE): Phase.CLOSING,
    (Phase.DEFERRING, Event.CLOSE): Phase.CLOSING,
    (Phase.CLOSING, Event.FORGET): Phase.DONE,
    (Phase.CLOSING, Event.UNGOVERN): Phase.DONE,
    (Phase.UNGOVERNED, Event.CLOSE): Phase.DONE,
    (Phase.UNGOVERNED, Event.UNGOVERN): Phase.UNGOVERNED,
    **{(phase, event): phase for phase in (Phase.UNGOVERNED, Phase.CLOSING, Phase.DONE)
       for event in (Event.DEFER, Event.SETTLE)},
}
_DECIDING = frozenset({Phase.GOVERNED, Phase.DEFERRING})  # where defer and settle record something

_GOVERNED = frozenset({Phase.GOVERNED, Phase.DEFERRING, Phase.CLOSING})
_CLOSED = frozenset({Phase.CLOSING, Phase.DONE})


class PoolStateError(RuntimeError):
    """An event the pool's phase does not allow (a bug in the shell, never the runtime's doing)."""


def limit_after_grant(granted_pages: int, ceiling_pages: int) -> int:
    """L1: the limit a pool may have once it holds ``granted_pages``: never above its grant, nor
    above its ceiling (its virtual size, or an operator's cap)."""
    return max(0, min(granted_pages, ceiling_pages))


def surplus_pages(granted_pages: int, size_pages: int, at_most: int | None = None) -> int:
    """L2: the grant kvcached can no longer map (above its allocator's ``size_pages``, as it
    reports it), at most ``at_most``; what may go back to the broker now."""
    surplus = granted_pages - size_pages
    if at_most is not None:
        surplus = min(surplus, at_most)
    return max(0, surplus)


@dataclass(frozen=True)
class Asks:
    """What was asked of a pool since the governor's last round (pool pages)."""

    pressure_pages: int = 0  # the broker wants these back (idle first, then below what is in use)
    soft_pages: int = 0  # the broker wants these back if idle (free pages, the prefix cache's unused blocks)
    short_pages: int = 0  # what the engine's largest missed allocation still needed

    @property
    def any_pressure(self) -> bool:
        return self.pressure_pages > 0 or self.soft_pages > 0


@dataclass(frozen=True)
class Standing:
    """What a limit channel said of a lowered limit since the governor's last round."""

    due: bool = False  # the grant above kvcached's size goes back
    quiet: bool = False  # its TP peers lowered it: the pool grows only on a real miss for a while


class AskBook:
    """The only part of a pool's state other threads write: pressure asks (the broker's callback
    thread), missed allocations (the engine's), an outside ``set_memory_limit`` (an operator's).
    The governor's thread takes them in one swap (:meth:`take`).  ``counters`` is the pool's
    counters dict, whose ``pressure_asks`` and ``misses`` this book counts under its lock.

    Used by every holder the broker's pressure reaches: a governor, and a broadcast-mode TP
    worker's holder (:mod:`.broadcast.worker_grants`)."""

    def __init__(self, counters: dict[str, int]) -> None:
        self._lock = threading.Lock()
        self._counters = counters
        self._pressure_pages = 0
        self._soft_pages = 0
        self._short_pages = 0
        self._outside_cap_pages: int | None = None
        self._outside_revision = -1  # the newest revision of an outside set_memory_limit
        self._standing_due = False  # a limit channel lowered the limit: the grant above it goes back
        self._standing_quiet = False  # below what the pool wanted: it grows only on a real miss a while

    def ask_back(self, pages: int, *, soft: bool = False) -> None:
        """The broker wants ``pages`` pool pages back; ``soft``: only idle ones."""
        with self._lock:
            if soft:
                self._soft_pages += pages
            else:
                self._pressure_pages += pages
            self._counters["pressure_asks"] += 1

    def missed(self, short_pages: int = 0) -> None:
        """An engine allocation missed, still needing ``short_pages`` (0: it missed before
        reaching kvcached, a charge not settled yet)."""
        with self._lock:
            self._short_pages = max(self._short_pages, short_pages)
            self._counters["misses"] += 1

    def outside_limit(self, cap_pages: int, revision: int) -> bool:
        """An outside ``set_memory_limit`` of ``cap_pages`` with ``revision``; False (nothing
        recorded) for a revision older than the last outside one."""
        with self._lock:
            if revision < self._outside_revision:
                return False
            self._outside_revision = revision
            self._outside_cap_pages = cap_pages
            return True

    def release_standing(self, *, quiet: bool = True) -> None:
        """A limit channel lowered the limit (K3): the grant above kvcached's size goes back in
        the next round; ``quiet``: below what the pool wanted (its TP peers gave back), so it then
        grows only on a real miss for a while (False: the pool's own lowering, applied late)."""
        with self._lock:
            self._standing_due = True
            self._standing_quiet = self._standing_quiet or quiet

    def take_standing(self) -> Standing:
        """What :meth:`release_standing` said since the last call."""
        with self._lock:
            standing = Standing(self._standing_due, self._standing_quiet)
            self._standing_due = self._standing_quiet = False
        return standing

    @property
    def outside_revision(self) -> int:
        return self._outside_revision

    def take_outside_cap(self) -> int | None:
        """The last outside ``set_memory_limit``'s cap since the last call (None: none came)."""
        with self._lock:
            cap, self._outside_cap_pages = self._outside_cap_pages, None
        return cap

    def take(self, polled_pages: int = 0) -> Asks:
        """What was asked back and missed since the last call, plus ``polled_pages`` of pressure
        that came through the grants (a broadcast pool's board: counted as one ask); those
        figures are 0 after."""
        with self._lock:
            asks = Asks(self._pressure_pages + polled_pages, self._soft_pages, self._short_pages)
            self._pressure_pages = self._soft_pages = self._short_pages = 0
            if polled_pages:
                self._counters["pressure_asks"] += 1
        return asks


@dataclass
class GrowPacing:
    """When a pool may ask the broker for more ahead of need, and how much it must take."""

    next_grow_s: float = 0.0
    wait_s: float = GROW_RETRY_S[0]
    refusal_streak: int = 0
    quiet_until_s: float = 0.0

    def may_grow(self, now_s: float, *, short: bool) -> bool:
        """A growth the engine is short of always may (it waits at the broker, which paces it);
        one ahead of need waits out a refusal's back-off and a pressure ask's quiet period."""
        return short or (now_s >= self.next_grow_s and now_s >= self.quiet_until_s)

    def min_pages(self, pages: int, min_pages: int, *, waiting: bool) -> int:
        """The least to take of an ask for ``pages``: after a refusal, every other ask ahead of
        need is for all of it."""
        return pages if self.refusal_streak % 2 == 1 and not waiting else min_pages

    def refused(self, now_s: float) -> None:
        self.refusal_streak += 1
        self.backed_off(now_s)

    def backed_off(self, now_s: float) -> None:
        """Wait before the next ask, twice as long as the last time, up to the longest wait."""
        self.next_grow_s = now_s + self.wait_s
        self.wait_s = min(GROW_RETRY_S[1], 2 * self.wait_s)

    def granted(self) -> None:
        self.refusal_streak = 0
        self.wait_s = GROW_RETRY_S[0]
        self.next_grow_s = 0.0

    def quiet(self, now_s: float) -> None:
        """Pressure came (or peers gave back): grow only on a real miss for a while."""
        self.quiet_until_s = max(self.quiet_until_s, now_s + PRESSURE_QUIET_S)


class Told:
    """What the broker was told of a pool (pool pages), and so whether to tell it again.  The
    shell tells it, and calls the ``told_*`` method once the broker took it."""

    def __init__(self) -> None:
        self.zero_page = False  # the zero page's report was accepted (under the pool's key)
        self.zero_page_refusals = 0
        self.mapped_pages = 0  # the mapped pages the broker was last told
        self.idle_pages: int | None = None  # the idle pages the session was last told
        self.views: tuple | None = None  # the status views last published

    def zero_page_refused(self) -> bool:
        """The broker refused the zero page's report; True the first time (the shell says so)."""
        self.zero_page_refusals += 1
        return self.zero_page_refusals == 1

    def renamed(self) -> bool:
        """The pool reports under a new key: True if its zero page was reported under the old
        one (the shell reports it again under the new key, then forgets the old entry)."""
        reported, self.zero_page = self.zero_page, False
        return reported

    def mapped_news(self, mapped_pages: int) -> bool:
        return mapped_pages != self.mapped_pages

    def told_mapped(self, mapped_pages: int) -> None:
        self.mapped_pages = mapped_pages

    def idle_news(self, idle_pages: int) -> bool:
        return idle_pages != self.idle_pages

    def told_idle(self, idle_pages: int) -> None:
        self.idle_pages = idle_pages

    def views_news(self, views: tuple) -> bool:
        return views != self.views

    def told_views(self, views: tuple) -> None:
        self.views = views


class PoolState:
    """A pool's phase and its limit bookkeeping.  ``pending_limit`` is set exactly in DEFERRING;
    ``revision`` is the last revision the governor applied (above any it saw); ``told`` is what
    the broker was told of the pool."""

    def __init__(self, *, governed: bool, why_ungoverned: str = "") -> None:
        self.phase = Phase.GOVERNED if governed else Phase.UNGOVERNED
        self.why_ungoverned = why_ungoverned
        self.pending_limit: int | None = None
        self.blocked = ""  # K4: why the pool could not give back what was asked, if it could not
        self.revision = 0
        self.operator_cap_pages: int | None = None  # K2
        self.told = Told()
        self._synced = False  # K1
        self._seen_limit_pages = 0  # K3: kvcached's size when the last round ended

    @property
    def governed(self) -> bool:
        return self.phase in _GOVERNED

    @property
    def closed(self) -> bool:
        return self.phase in _CLOSED

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def _go(self, event: Event) -> None:
        try:
            self.phase = _NEXT[(self.phase, event)]
        except KeyError:
            raise PoolStateError(f"a pool in phase {self.phase.value} cannot {event.value}") from None

    def defer(self, limit_pages: int, why: str | None = None) -> None:
        """kvcached deferred ``limit_pages`` (below what is in use): it applies as blocks are
        freed; ``why`` (if given) is what ``blocked`` says meanwhile."""
        deciding = self.phase in _DECIDING
        self._go(Event.DEFER)
        if not deciding:
            return
        self.pending_limit = limit_pages
        if why is not None:
            self.blocked = why

    def settle(self, blocked: str = "") -> None:
        """Nothing is pending any more; ``blocked``: why a give-back could not be done, if so."""
        deciding = self.phase in _DECIDING
        self._go(Event.SETTLE)
        if not deciding:
            return
        self.pending_limit = None
        self.blocked = blocked

    def answer(self, blocked: str = "") -> None:
        """K4: a give-back ended without deferring anything: done (``blocked`` empty), short at
        the pool's floor, or refused by kvcached (``blocked`` says so).  The phase stays: a
        limit already pending stays pending."""
        self.blocked = blocked

    def ungovern(self, why: str) -> bool:
        """Stop governing (K2: the operator's cap goes with it); False if the pool already was not
        governed (nothing changes then)."""
        if not self.governed:
            if self.phase is Phase.UNGOVERNED:
                self._go(Event.UNGOVERN)
            return False
        self._go(Event.UNGOVERN)
        self.why_ungoverned = why
        self.pending_limit = None
        self.operator_cap_pages = None
        return True

    def close(self) -> bool:
        """The pool shut down; False (nothing changes) if it already was closed."""
        if self.closed:
            return False
        self._go(Event.CLOSE)
        return True

    def forget(self) -> None:
        """A closed pool's grant and reports are all given back (or its session is gone)."""
        self._go(Event.FORGET)

    def next_revision(self, outside_revision: int, kvcached_revision: int) -> int:
        """L3: a revision newer than this governor's last, an outside caller's and kvcached's."""
        self.revision = max(self.revision, outside_revision, kvcached_revision) + 1
        return self.revision

    def take_sync(self) -> bool:
        """K1: True once, for the first round (it applies kvcached's size with a revision of the
        governor's); False after."""
        due, self._synced = not self._synced, True
        return due

    def take_cap(self, cap_pages: int | None) -> bool:
        """K2: an operator's cap (None: none any more); False if it is the cap already held."""
        if cap_pages == self.operator_cap_pages:
            return False
        self.operator_cap_pages = cap_pages
        return True

    def ceiling(self, virtual_pages: int) -> int:
        """K2: the most the pool's limit may be, its grant aside (pool pages)."""
        if self.operator_cap_pages is None:
            return virtual_pages
        return min(virtual_pages, self.operator_cap_pages)

    def limit_fell(self, size_pages: int) -> bool:
        """K3: kvcached's size is below what it was when the last round ended."""
        return size_pages < self._seen_limit_pages

    def round_ended(self, size_pages: int) -> None:
        """K3: a round ended with kvcached's size at ``size_pages``."""
        self._seen_limit_pages = size_pages
