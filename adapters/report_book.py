"""What one worker process reports to its broker session on one device, and what it holds: the
book, with no I/O (:class:`.device_session.DeviceSession` is the shell that sends it; each
device's session keeps one).

Rules (bytes unless a name says pages; docs/accounting.md):

* **B1, pools by reporter.**  A report replaces the reporter's own entry, never another's.  A
  request charges the sum over reporters, pool by pool, leaving out suspended reporters (their
  memory was handed back: their pools stay in the book, uncharged, until resumed).
* **B2, the runtime base.**  Once pinned, every request charges it as the pool
  ``runtime_base``; the request that pins it sends none (the broker measures the process and
  answers with the base).  A plan may book another base instead (memory handed back, or coming
  back).  If a pin moved part of the kept slack into the base (the device measures activations
  the slack was kept for), the book's slack follows the broker's answer.
* **B3, holds by name.**  A change sets the names it gives (0 drops one) and keeps the others.
* **B4, usage views by reporter.**  Shown, never charged; a suspended reporter's are not shown.
* **B5, a plan is one reserve request.**  The book takes a plan only once the broker answered it
  (:meth:`ReportBook.took`); a refusal or a failure leaves the book as it was.
* **B6, holds after a pool.**  A pool the KV sizing hold was for, built larger than before,
  shrinks the KV hold by its growth (the last one drops it); what it takes beyond the KV hold
  comes out of the slack hold, as in the runtime's own arithmetic (a pool padded past its
  budget eats into the slack).
* **B7, pages by holder.**  Mapped and idle pages are kept per holder (a kvcached pool); the
  session's figure is the sum over holders; 0 forgets a holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..client.protocol import RUNTIME_BASE_POOL
from ..client.protocol import RUNTIME_SLACK_POOL as SLACK_POOL  # the name this book's users import
#: The hold KV sizing takes (memory promised between sizing and allocating the KV cache).
KV_SIZING_HOLD = "kv_sizing_hold"
#: The hold for what a runtime keeps beside its KV cache (activations, CUDA graphs, request
#: tables), promised at sizing until its warm-up has allocated it (:mod:`.sizing`).
SLACK_HOLD = "runtime_slack_hold"

Pools = dict[str, int]


@dataclass(frozen=True)
class Plan:
    """One request's worth of book: the book it would leave, and how the base is sent."""

    book: dict[str, Pools]
    usage: dict[str, Pools]
    holds: Pools
    suspended: frozenset[str]
    pin_base: bool = False
    base_bytes: int | None = None  # a runtime base to book instead of the pinned one (B2)
    min_holds: Pools | None = None  # one hold that may shrink to what fits, and its least
    phase: str | None = None  # a new phase to show (None keeps it)


@dataclass(frozen=True)
class Request:
    """What a plan's reserve request sends: the pools charged and the views shown."""

    pools: Pools
    usage: Pools


@dataclass
class ReportBook:
    book: dict[str, Pools] = field(default_factory=dict)  # reporter -> resident pools
    usage: dict[str, Pools] = field(default_factory=dict)  # reporter -> views (never charged)
    holds: Pools = field(default_factory=dict)  # hold name -> bytes promised, not allocated yet
    base_bytes: int | None = None  # the runtime_base the broker pinned; None until pinned
    suspended: set[str] = field(default_factory=set)
    phase: str = ""  # where the worker is in its start-up, as the broker shows it
    mapped: dict[str, int] = field(default_factory=dict)  # page holder -> session pages it has mapped
    idle: dict[str, int] = field(default_factory=dict)  # page holder -> session pages it holds idle

    # ------------------------------------------------------------ plans
    def _plan(self, **changes: Any) -> Plan:
        """The book as it stands, with ``changes``."""
        return replace(Plan(self.book, self.usage, self.holds, frozenset(self.suspended)), **changes)

    def report(self, reporter: str, pools: Pools, usage: Pools | None, holds: Pools | None,
               phase: str | None) -> Plan:
        """B1, B3, B4: ``reporter``'s pools and views replaced, holds changed; pins the base if
        it is not pinned yet."""
        return self._plan(book={**self.book, reporter: positive(pools)},
                          usage={**self.usage, reporter: positive(usage or {})},
                          holds=with_holds(self.holds, holds), pin_base=self.base_bytes is None, phase=phase)

    def hold_what_fits(self, holds: Pools, min_holds: Pools | None, phase: str) -> Plan:
        """Holds changed, the one ``min_holds`` names allowed to shrink to what fits."""
        return self._plan(holds=with_holds(self.holds, holds), pin_base=self.base_bytes is None,
                          min_holds=min_holds, phase=phase)

    def holds_after_pool(self, growth_bytes: int, last: bool) -> Pools | None:
        """B6: the hold changes once a pool the KV hold was for is built ``growth_bytes`` larger
        than before (with ``last``, the KV hold drops); None if there is no hold to change."""
        kv_held = self.held_bytes(KV_SIZING_HOLD)
        slack_held = self.held_bytes(SLACK_HOLD)
        if not kv_held and not slack_held:
            return None
        growth = max(0, growth_bytes)
        beyond = max(0, growth - kv_held)
        holds = {KV_SIZING_HOLD: 0 if last else max(0, kv_held - growth)}
        if beyond and slack_held:
            holds[SLACK_HOLD] = max(0, slack_held - beyond)
        return holds

    def hold(self, name: str, size_bytes: int) -> Plan | None:
        """Hold ``size_bytes`` under ``name`` (0 drops it); None if nothing changes.  The first
        plan that holds anything pins the base."""
        holds = with_holds(self.holds, {name: size_bytes})
        if holds == self.holds:
            return None
        return self._plan(holds=holds, pin_base=self.base_bytes is None and bool(holds))

    def pin(self, phase: str | None = None) -> Plan:
        """Pin the base at what the device measures, changing nothing else."""
        return self._plan(pin_base=True, phase=phase)

    def keep_slack(self, kept_bytes: int, slack_hold: str) -> Plan:
        """Warm-up is over: the slack hold becomes the resident slack pool of ``kept_bytes``."""
        book = {**self.book, SLACK_POOL: {SLACK_POOL: kept_bytes} if kept_bytes else {}}
        return self._plan(book={k: v for k, v in book.items() if v}, holds=with_holds(self.holds, {slack_hold: 0}),
                          phase="serving")

    def suspend(self, names: list[str], base_bytes: int | None) -> tuple[Plan, int] | None:
        """Stop charging ``names`` and, with ``base_bytes``, lower the base to it: the plan and the
        bytes no longer charged; None if nothing changes."""
        names = [n for n in names if n in self.book and n not in self.suspended]
        base_drop_bytes = max(0, (self.base_bytes or 0) - base_bytes) if base_bytes is not None else 0
        if not names and not base_drop_bytes:
            return None
        freed = sum(sum(self.book[n].values()) for n in names) + base_drop_bytes
        return self._plan(suspended=frozenset(self.suspended | set(names)),
                          base_bytes=base_bytes if base_drop_bytes else None), freed

    def resume(self, names: list[str] | None, base_bytes: int | None) -> tuple[Plan, int] | None:
        """Charge the suspended ``names`` (all, if None) again and, with ``base_bytes``, raise the
        base to it: the plan and the bytes charged again; None if nothing comes back."""
        back = set(self.suspended if names is None else self.suspended.intersection(names))
        base_growth_bytes = max(0, (base_bytes or 0) - (self.base_bytes or 0))
        if not back and not base_growth_bytes:
            return None
        charged = sum(sum(self.book[n].values()) for n in back) + base_growth_bytes
        return self._plan(suspended=frozenset(self.suspended - back),
                          base_bytes=base_bytes if base_growth_bytes else None), charged

    def repin(self, suspend: list[str] | tuple[str, ...]) -> Plan:
        """Pin the base again and stop charging ``suspend`` in the same request."""
        names = {n for n in suspend if n in self.book}
        return self._plan(suspended=frozenset(self.suspended | names), pin_base=True)

    def drop(self, reporter: str) -> None:
        """Forget ``reporter`` (its pool was freed, and the book without it was sent)."""
        self.book.pop(reporter, None)
        self.usage.pop(reporter, None)
        self.suspended.discard(reporter)

    # ------------------------------------------------------------ requests and answers
    def request(self, plan: Plan) -> Request:
        """B1, B2, B4: what ``plan``'s reserve request sends."""
        pools = merge({name: p for name, p in plan.book.items() if name not in plan.suspended})
        base_bytes = self.base_bytes if plan.base_bytes is None else plan.base_bytes
        if base_bytes and not plan.pin_base:
            pools[RUNTIME_BASE_POOL] = base_bytes
        return Request(pools, merge({name: v for name, v in plan.usage.items() if name not in plan.suspended}))

    def took(self, plan: Plan, request: Request, answer: Pools, base_bytes: int, *,
             holds: Pools | None = None) -> bool:
        """B5: the broker answered ``plan``'s ``request`` with the pools ``answer`` charges, its
        runtime base ``base_bytes`` among them; the book is now the plan's (``holds``: the holds
        the broker granted, where a hold could shrink).  True if the answer pinned the base."""
        self.book, self.usage = dict(plan.book), dict(plan.usage)
        self.holds = dict(plan.holds if holds is None else holds)
        self.suspended = set(plan.suspended)
        if plan.phase is not None:
            self.phase = plan.phase
        if plan.pin_base:
            self.base_bytes = base_bytes
            sent_slack = request.pools.get(SLACK_POOL)
            if sent_slack is not None and answer.get(SLACK_POOL, 0) != sent_slack:
                # the base grew into the slack kept: the broker moved that much from one to the other
                kept = answer.get(SLACK_POOL, 0)
                self.book[SLACK_POOL] = {SLACK_POOL: kept} if kept else {}
            return True
        if plan.base_bytes is not None:
            self.base_bytes = plan.base_bytes
        return False

    # ------------------------------------------------------------ pages by holder (B7)
    def count_mapped(self, holder: str, pages: int) -> int:
        return _count(self.mapped, holder, pages)

    def count_idle(self, holder: str, pages: int) -> int:
        return _count(self.idle, holder, pages)

    def held_bytes(self, name: str | None = None) -> int:
        """Bytes held under ``name`` (every hold, if None)."""
        return sum(self.holds.values()) if name is None else self.holds.get(name, 0)

    def booked_bytes(self, reporter: str) -> int:
        """The bytes ``reporter`` has in the book (charged or suspended)."""
        return sum(self.book.get(reporter, {}).values())


def positive(sizes: Pools) -> Pools:
    return {name: size for name, size in sizes.items() if size > 0}


def with_holds(current: Pools, changes: Pools | None) -> Pools:
    if not changes:
        return dict(current)
    return positive({**current, **changes})


def merge(by_reporter: dict[str, Pools]) -> Pools:
    merged: Pools = {}
    for pools in by_reporter.values():
        for name, size in pools.items():
            merged[name] = merged.get(name, 0) + size
    return merged


def _count(by_holder: dict[str, int], holder: str, pages: int) -> int:
    """Set ``holder``'s pages (0 forgets it) and return the sum over every holder."""
    if pages > 0:
        by_holder[holder] = pages
    else:
        by_holder.pop(holder, None)
    return sum(by_holder.values())
