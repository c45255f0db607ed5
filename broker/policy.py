"""Arbitration policy over the ledger (pure, no I/O): weighted fair shares and pressure.

* **Fair share.** Instance i's share of the budget is ``clamp(λ·weight_i, min_i, max_i)``, with
  λ chosen so that the shares sum to the budget (water-filling).  Instances that registered, or
  that hold a floor, take part.
* **Pressure.** When an instance below its floor or its fair share is refused, the broker asks
  instances above their share to give pages back: a push to each chosen session, sized from
  its instance's excess over its share, never more than the session's granted pages (static
  reservations are not reclaimable).  A session is not asked again while an ask is fresh.
  Whatever a session releases after an ask counts as returned.  A session that ignores an ask
  keeps what it holds: the broker never charges it less than it holds.
* **Escalation.** A refused ask says only what it needed at least, and an instance that is
  bursting is refused again and again.  Each refusal of the same instance within
  ``escalate_window_s`` of the last doubles what the broker asks the others for (up to
  ``2**MAX_ESCALATION`` times the refused ask), never beyond what the starved instance lacks
  of its floor or fair share.  So a burst is handed over in a few rounds rather than one
  refused ask at a time, while a single small refusal still costs the others only its size.
* **Idle memory.** Sessions say how many of their pages are idle (``idle_pages``: their
  reserve, free pages, a prefix cache's unused blocks).  What the asks above do not cover, and
  what an instance at or above its share is refused, is asked of idle pages elsewhere (never
  below their instance's floor) with a *soft* ask: give back only idle memory, never what a running request uses.  The kernel's page
  cache works the same way: cached pages go to whoever needs memory now.
* **Watermarks.** While some instance is below its share, the broker keeps free memory between
  a low and a high mark (a share of the budget, at most what those instances lack), refilled
  in the background with soft asks of the idle pages instances hold *above* their share (as
  the kernel's kswapd keeps free pages): a burst starts on free memory while the rest comes back.
* **Who is asked first.** Instances of the lowest ``priority`` (an operator's limit), then
  those that asked for memory least recently (whose cache has been idle longest), then those
  furthest above their share; within an instance, its sessions with the most idle pages.

Units: bytes and pages as ints, times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ..client import results
from .accounts import Limits, Session
from .ledger import Ledger


def participants(ledger: Ledger) -> list[str]:
    names = set(ledger.instance_names())
    names.update(name for name, limits in ledger.limits.items() if limits.min_bytes)
    return sorted(names)


def fair_shares(ledger: Ledger) -> dict[str, int]:
    """Each participating instance's weighted fair share of the budget, in bytes."""
    names = participants(ledger)
    if not names:
        return {}
    budget = ledger.budget_bytes
    limits = {name: ledger.limits.get(name, Limits()) for name in names}

    def share(name: str, lam: float) -> float:
        lim = limits[name]
        value = max(float(lim.min_bytes), lam * lim.weight)
        return min(value, float(lim.max_bytes)) if lim.max_bytes is not None else value

    def total(lam: float) -> float:
        return sum(share(name, lam) for name in names)

    if total(0.0) >= budget:  # floors alone use the budget
        return {name: int(share(name, 0.0)) for name in names}
    level = _fill_level(limits, budget)
    return {name: round(share(name, level)) for name in names}  # round: the level is a float


def _fill_level(limits: dict[str, Limits], budget: int) -> float:
    """The λ at which the shares clamp(λ·weight, min, max) sum to the budget (water-filling).

    The sum is piecewise linear in λ: an instance grows with slope ``weight`` from
    ``min/weight`` until ``max/weight``.  Walk those breakpoints in order; if every instance is
    capped before the budget is reached, the last breakpoint (every share at its cap) is it.
    """
    events: list[tuple[float, float]] = []  # (λ, change of slope)
    filled = 0.0
    for lim in limits.values():
        filled += lim.min_bytes
        events.append((lim.min_bytes / lim.weight, lim.weight))
        if lim.max_bytes is not None:
            events.append((lim.max_bytes / lim.weight, -lim.weight))
    events.sort()
    level, slope = 0.0, 0.0
    for at, change in events:
        if slope > 0 and filled + slope * (at - level) >= budget:
            break
        filled += slope * (at - level)
        level, slope = at, slope + change
    if slope <= 0:
        return level  # everyone is capped: the shares are the caps
    return level + (budget - filled) / slope


def starving(ledger: Ledger, instance: str, shares: dict[str, int]) -> bool:
    """Is ``instance`` below its floor or below its fair share?"""
    charge = ledger.instance_charge_bytes(instance)
    floor = ledger.limits.get(instance, Limits()).min_bytes
    return charge < max(floor, shares.get(instance, 0))


#: What an ask is for (the pressure log's ``kind=``): ``share`` takes back what an instance
#: holds above its share for one below its floor or share (hard: the session gives back what it
#: can, running requests' memory included, as they finish); ``idle`` and ``watermark`` are soft.
SHARE = "share"
IDLE = "idle"
WATERMARK = "watermark"


@dataclass(frozen=True)
class Ask:
    session_id: str
    instance: str
    pages: int
    page_bytes: int
    kind: str = SHARE
    priority: int = 0

    @property
    def soft(self) -> bool:
        """Only idle memory is asked for (the push's ``soft``)."""
        return self.kind != SHARE


@dataclass
class PendingAsk:
    instance: str
    page_bytes: int
    asked_pages: int
    asked_at_s: float
    returned_pages: int = 0
    soft: bool = False

    @property
    def outstanding_pages(self) -> int:
        return max(0, self.asked_pages - self.returned_pages)


@dataclass
class InstancePressure:
    asks: int = 0
    asked_bytes: int = 0
    returned_bytes: int = 0
    ignored_bytes: int = 0
    soft_asks: int = 0


#: Refusals of one instance in a row that keep doubling the pressure (2**6 = 64 times an ask).
MAX_ESCALATION = 6


def idle_pages(session: Session) -> int:
    """What a session could give back without touching a running request's memory: what it
    says is idle, and at least its credit reserve (never more than it holds)."""
    return min(session.granted_pages, max(session.idle_pages, session.reserve_pages))


@dataclass
class PressureBook:
    """Who was asked for how much, and how much came back.

    ``low_fraction`` and ``high_fraction`` are the watermarks, as shares of the budget
    (:meth:`replenish`); 0 turns them off."""

    retry_s: float = 1.0
    expire_s: float = 10.0
    escalate_window_s: float = 2.0
    low_fraction: float = 0.05
    high_fraction: float = 0.10
    #: The watermarks take only from instances that have not asked for memory for this long (a
    #: pool that is growing keeps what it was just granted ahead of its need).
    idle_after_s: float = 0.2
    pending: dict[str, PendingAsk] = field(default_factory=dict)
    totals: dict[str, InstancePressure] = field(default_factory=dict)
    #: starved instance -> (refusals in a row, when the last one was planned)
    streaks: dict[str, tuple[int, float]] = field(default_factory=dict)
    #: instance -> when it last asked for memory (its cache is idle since, as far as the broker knows)
    active_s: dict[str, float] = field(default_factory=dict)

    def note_active(self, instance: str, now_s: float) -> None:
        """``instance`` asked for memory now (a grant or a refusal)."""
        self.active_s[instance] = now_s

    def plan(self, ledger: Ledger, starved: str, need_bytes: int, now_s: float,
             reachable: Callable[[str], bool] | None = None) -> list[Ask]:
        """Asks that would free up to ``need_bytes`` for ``starved``: from instances above their
        share if it is below its floor or share (escalated), then from idle pages elsewhere
        (soft) for what is left beyond its own idle pages.  ``reachable(session_id)``: whether a
        push can reach the session (others are not asked)."""
        if need_bytes <= 0:
            return []
        shares = fair_shares(ledger)
        asks: list[Ask] = []
        left = need_bytes
        if starving(ledger, starved, shares):
            left = self._plan_share(ledger, starved, self._escalated(ledger, starved, need_bytes, shares, now_s),
                                    shares, now_s, asks, reachable)
        own_idle = sum(idle_pages(s) * s.page_bytes for s in ledger.sessions.values() if s.instance == starved)
        if left - own_idle > 0:
            self._plan_idle(ledger, starved, left - own_idle, shares, now_s, asks, reachable, IDLE)
        for ask in asks:
            self._record(ask, now_s)
        return asks

    def replenish(self, ledger: Ledger, now_s: float, reachable: Callable[[str], bool] | None = None) -> list[Ask]:
        """The watermarks: while an instance is below its share and free memory is under the low
        mark, soft asks of the idle pages instances hold above their share, up to the high mark
        (both at most what the instances below their share lack)."""
        if self.high_fraction <= 0:
            return []
        shares = fair_shares(ledger)
        lacking = 0
        for name in ledger.instance_names():
            lacking += max(0, shares.get(name, 0) - ledger.instance_charge_bytes(name))
        if lacking <= 0:
            return []
        budget = ledger.budget_bytes
        free = ledger.free_bytes
        if free >= min(int(budget * self.low_fraction), lacking):
            return []
        coming = sum(a.outstanding_pages * a.page_bytes for a in self.pending.values()
                     if now_s - a.asked_at_s < self.retry_s)
        need = min(int(budget * self.high_fraction), lacking) - free - coming
        if need <= 0:
            return []
        asks: list[Ask] = []
        self._plan_idle(ledger, None, need, shares, now_s, asks, reachable, WATERMARK)
        for ask in asks:
            self._record(ask, now_s)
        return asks

    def _order(self, ledger: Ledger, name: str) -> tuple[int, float]:
        """Who is asked first: the lowest priority, then the longest since it asked for memory."""
        return ledger.limits.get(name, Limits()).priority, self.active_s.get(name, -math.inf)

    def _fresh_pages(self, session_id: str, now_s: float) -> int | None:
        """Pages still coming from an ask made within ``retry_s`` (None: no such ask)."""
        fresh = self.pending.get(session_id)
        if fresh is not None and now_s - fresh.asked_at_s < self.retry_s:
            return fresh.outstanding_pages
        return None

    def _plan_share(self, ledger: Ledger, starved: str, need_bytes: int, shares: dict[str, int], now_s: float,
                    asks: list[Ask], reachable: Callable[[str], bool] | None) -> int:
        """Hard asks of instances above their share; returns what is left of ``need_bytes``."""
        excess = []
        for name in ledger.instance_names():
            if name == starved:
                continue
            over = ledger.instance_charge_bytes(name) - shares.get(name, 0)
            if over > 0:
                excess.append((self._order(ledger, name), -over, name))
        excess.sort()
        left = need_bytes
        for order, negative_over, name in excess:
            take = min(-negative_over, left)
            for session in sorted(
                (s for s in ledger.sessions.values() if s.instance == name and s.granted_pages
                 and (reachable is None or reachable(s.id))),
                key=lambda s: (idle_pages(s), s.granted_pages),
                reverse=True,
            ):
                if take <= 0:
                    break
                coming = self._fresh_pages(session.id, now_s)
                if coming is not None:
                    take -= coming * session.page_bytes
                    left -= coming * session.page_bytes
                    continue
                pages = min(session.granted_pages, math.ceil(take / session.page_bytes))
                asks.append(Ask(session.id, name, pages, session.page_bytes, SHARE, order[0]))
                take -= pages * session.page_bytes
                left -= pages * session.page_bytes
            if left <= 0:
                break
        return left

    def _plan_idle(self, ledger: Ledger, starved: str | None, need_bytes: int, shares: dict[str, int], now_s: float,
                   asks: list[Ask], reachable: Callable[[str], bool] | None, kind: str) -> None:
        """Soft asks of idle pages, never below their instance's floor (what it gave back there
        would be its unfilled floor, which nobody else may be granted); for a watermark, only
        idle pages above their instance's share."""
        asked = {a.session_id for a in asks}
        room: dict[str, int] = {}  # what each instance holds above its floor (a watermark: its share)
        candidates = []
        for session in ledger.sessions.values():
            if session.instance == starved or session.id in asked or (reachable is not None and not reachable(session.id)):
                continue
            idle = idle_pages(session)
            if idle <= 0 or self._fresh_pages(session.id, now_s) is not None:
                continue
            if kind == WATERMARK and now_s - self.active_s.get(session.instance, -math.inf) < self.idle_after_s:
                continue
            if session.instance not in room:
                keep = ledger.limits.get(session.instance, Limits()).min_bytes
                if kind == WATERMARK:
                    keep = max(keep, shares.get(session.instance, 0))
                room[session.instance] = ledger.instance_charge_bytes(session.instance) - keep
            if room[session.instance] <= 0:
                continue
            candidates.append((self._order(ledger, session.instance), -idle, session.id, session))
        candidates.sort(key=lambda c: (c[0], c[1], c[2]))
        left = need_bytes
        for order, negative_idle, _, session in candidates:
            if left <= 0:
                break
            idle_bytes = min(-negative_idle * session.page_bytes, room[session.instance])
            pages = min(-negative_idle, idle_bytes // session.page_bytes,
                        math.ceil(min(idle_bytes, left) / session.page_bytes))
            if pages <= 0:
                continue
            asks.append(Ask(session.id, session.instance, pages, session.page_bytes, kind, order[0]))
            left -= pages * session.page_bytes
            room[session.instance] -= pages * session.page_bytes

    def _escalated(self, ledger: Ledger, starved: str, need_bytes: int, shares: dict[str, int], now_s: float) -> int:
        """``need_bytes`` doubled once per refusal of ``starved`` in a row, within its deficit."""
        streak, last_s = self.streaks.get(starved, (-1, -math.inf))
        streak = min(streak + 1, MAX_ESCALATION) if now_s - last_s <= self.escalate_window_s else 0
        self.streaks[starved] = (streak, now_s)
        floor = ledger.limits.get(starved, Limits()).min_bytes
        deficit = max(floor, shares.get(starved, 0)) - ledger.instance_charge_bytes(starved)
        return max(need_bytes, min(need_bytes << streak, deficit))

    def _record(self, ask: Ask, now_s: float) -> None:
        self.pending[ask.session_id] = PendingAsk(ask.instance, ask.page_bytes, ask.pages, now_s, soft=ask.soft)
        totals = self.totals.setdefault(ask.instance, InstancePressure())
        totals.asks += 1
        totals.asked_bytes += ask.pages * ask.page_bytes
        if ask.soft:
            totals.soft_asks += 1

    def on_release(self, session_id: str, pages: int) -> int:
        """Count released pages against an open ask; returns how many counted.  A soft ask is
        answered by the first release after it (the session gave what it held idle: it may be
        asked again at once)."""
        ask = self.pending.get(session_id)
        if ask is None:
            return 0
        counted = min(pages, ask.outstanding_pages)
        ask.returned_pages += counted
        self.totals.setdefault(ask.instance, InstancePressure()).returned_bytes += counted * ask.page_bytes
        if not ask.outstanding_pages or ask.soft:
            del self.pending[session_id]
        return counted

    def on_close(self, session_id: str) -> None:
        ask = self.pending.pop(session_id, None)
        if ask is not None:  # its memory came back with the session
            self.totals.setdefault(ask.instance, InstancePressure()).returned_bytes += ask.outstanding_pages * ask.page_bytes

    def expire(self, now_s: float) -> list[tuple[str, PendingAsk]]:
        """Asks left unanswered for ``expire_s``: recorded as ignored and dropped (a soft ask
        answered short is not ignored: the session gave what was idle; it is dropped)."""
        self.streaks = {name: s for name, s in self.streaks.items() if now_s - s[1] <= self.escalate_window_s}
        gone = [(sid, ask) for sid, ask in self.pending.items() if now_s - ask.asked_at_s >= self.expire_s]
        ignored = []
        for sid, ask in gone:
            del self.pending[sid]
            if ask.soft:
                continue
            self.totals.setdefault(ask.instance, InstancePressure()).ignored_bytes += ask.outstanding_pages * ask.page_bytes
            ignored.append((sid, ask))
        return ignored

    def instance_view(self, instance: str) -> results.PressureView:
        totals = self.totals.get(instance, InstancePressure())
        pending = sum(a.outstanding_pages * a.page_bytes for a in self.pending.values() if a.instance == instance)
        return results.PressureView(pending_bytes=pending, asks=totals.asks, soft_asks=totals.soft_asks,
                                    asked_bytes=totals.asked_bytes, returned_bytes=totals.returned_bytes,
                                    ignored_bytes=totals.ignored_bytes)
