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

Units: bytes and pages as ints, times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .accounts import Limits
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


@dataclass(frozen=True)
class Ask:
    session_id: str
    instance: str
    pages: int
    page_bytes: int


@dataclass
class PendingAsk:
    instance: str
    page_bytes: int
    asked_pages: int
    asked_at_s: float
    returned_pages: int = 0

    @property
    def outstanding_pages(self) -> int:
        return max(0, self.asked_pages - self.returned_pages)


@dataclass
class InstancePressure:
    asks: int = 0
    asked_bytes: int = 0
    returned_bytes: int = 0
    ignored_bytes: int = 0


#: Refusals of one instance in a row that keep doubling the pressure (2**6 = 64 times an ask).
MAX_ESCALATION = 6


@dataclass
class PressureBook:
    """Who was asked for how much, and how much came back."""

    retry_s: float = 1.0
    expire_s: float = 10.0
    escalate_window_s: float = 2.0
    pending: dict[str, PendingAsk] = field(default_factory=dict)
    totals: dict[str, InstancePressure] = field(default_factory=dict)
    #: starved instance -> (refusals in a row, when the last one was planned)
    streaks: dict[str, tuple[int, float]] = field(default_factory=dict)

    def plan(self, ledger: Ledger, starved: str, need_bytes: int, now_s: float) -> list[Ask]:
        """Asks that would free up to ``need_bytes`` for ``starved`` from instances above their share."""
        if need_bytes <= 0:
            return []
        shares = fair_shares(ledger)
        if not starving(ledger, starved, shares):
            return []
        need_bytes = self._escalated(ledger, starved, need_bytes, shares, now_s)
        excess = []
        for name in ledger.instance_names():
            if name == starved:
                continue
            over = ledger.instance_charge_bytes(name) - shares.get(name, 0)
            if over > 0:
                excess.append((over, name))
        excess.sort(reverse=True)
        asks: list[Ask] = []
        left = need_bytes
        for over, name in excess:
            take = min(over, left)
            for session in sorted(
                (s for s in ledger.sessions.values() if s.instance == name and s.granted_pages),
                key=lambda s: s.granted_bytes,
                reverse=True,
            ):
                if take <= 0:
                    break
                fresh = self.pending.get(session.id)
                if fresh is not None and now_s - fresh.asked_at_s < self.retry_s:
                    take -= fresh.outstanding_pages * session.page_bytes
                    continue
                pages = min(session.granted_pages, math.ceil(take / session.page_bytes))
                asks.append(Ask(session.id, name, pages, session.page_bytes))
                take -= pages * session.page_bytes
                left -= pages * session.page_bytes
            if left <= 0:
                break
        for ask in asks:
            self._record(ask, now_s)
        return asks

    def _escalated(self, ledger: Ledger, starved: str, need_bytes: int, shares: dict[str, int], now_s: float) -> int:
        """``need_bytes`` doubled once per refusal of ``starved`` in a row, within its deficit."""
        streak, last_s = self.streaks.get(starved, (-1, -math.inf))
        streak = min(streak + 1, MAX_ESCALATION) if now_s - last_s <= self.escalate_window_s else 0
        self.streaks[starved] = (streak, now_s)
        floor = ledger.limits.get(starved, Limits()).min_bytes
        deficit = max(floor, shares.get(starved, 0)) - ledger.instance_charge_bytes(starved)
        return max(need_bytes, min(need_bytes << streak, deficit))

    def _record(self, ask: Ask, now_s: float) -> None:
        self.pending[ask.session_id] = PendingAsk(ask.instance, ask.page_bytes, ask.pages, now_s)
        totals = self.totals.setdefault(ask.instance, InstancePressure())
        totals.asks += 1
        totals.asked_bytes += ask.pages * ask.page_bytes

    def on_release(self, session_id: str, pages: int) -> int:
        """Count released pages against an open ask; returns how many counted."""
        ask = self.pending.get(session_id)
        if ask is None:
            return 0
        counted = min(pages, ask.outstanding_pages)
        ask.returned_pages += counted
        self.totals.setdefault(ask.instance, InstancePressure()).returned_bytes += counted * ask.page_bytes
        if not ask.outstanding_pages:
            del self.pending[session_id]
        return counted

    def on_close(self, session_id: str) -> None:
        ask = self.pending.pop(session_id, None)
        if ask is not None:  # its memory came back with the session
            self.totals.setdefault(ask.instance, InstancePressure()).returned_bytes += ask.outstanding_pages * ask.page_bytes

    def expire(self, now_s: float) -> list[tuple[str, PendingAsk]]:
        """Asks left unanswered for ``expire_s``: recorded as ignored and dropped."""
        self.streaks = {name: s for name, s in self.streaks.items() if now_s - s[1] <= self.escalate_window_s}
        gone = [(sid, ask) for sid, ask in self.pending.items() if now_s - ask.asked_at_s >= self.expire_s]
        for sid, ask in gone:
            del self.pending[sid]
            self.totals.setdefault(ask.instance, InstancePressure()).ignored_bytes += ask.outstanding_pages * ask.page_bytes
        return gone

    def instance_view(self, instance: str) -> dict[str, Any]:
        totals = self.totals.get(instance, InstancePressure())
        pending = sum(a.outstanding_pages * a.page_bytes for a in self.pending.values() if a.instance == instance)
        return {
            "pending_bytes": pending,
            "asks": totals.asks,
            "asked_bytes": totals.asked_bytes,
            "returned_bytes": totals.returned_bytes,
            "ignored_bytes": totals.ignored_bytes,
        }
