"""The ledger: pure accounting of one GPU's memory budget (sans-I/O).

The ledger takes requests and clock readings and returns decisions.  It opens no socket or
file and starts no thread, so every rule below can be checked by a property test.

Vocabulary (docs/accounting.md has the model with a worked example):

* **session**: one worker process of an instance (a TP rank), with a page size.
* **reservation**: static bytes a session holds, by pool name; replaced wholesale.  A
  *resident* pool (``pools``) is memory the process has allocated, or is allocating as it
  reports it; a **hold** (``holds``) is memory promised to it that it has not allocated yet
  (a KV sizing hold).  ``reserved_bytes`` counts both.
* **grant**: elastic pages a session holds (``granted_pages``, of which ``reserve_pages`` sit
  unused in its client's credit reserve).  A session that reports mapping (hello
  ``report_mapping``) says how many of them it has mapped (``set_mapped``, or with a release);
  the rest (``unmapped_pages``) are *promised*, charged in full like a hold, so that what its
  process allocates outside its pages can never hide inside pages it has not mapped yet.
* **reported** bytes of a process: its sessions' resident pools plus mapped pages.
* **measured** bytes of a process: what the device says it uses (NVML; ``simulate
  --process`` on a simulated device).
* **charge** of a process: ``max(reported, measured) + held + unmapped pages``.  Measured usage can cover a
  resident pool (it is in there once allocated) but never a hold (it is not, yet), so a hold
  taken after the weights load is never absorbed by them.  ``excess = max(0, measured -
  reported)`` is the unreported usage.  A process pins what it already uses as its
  ``runtime_base`` pool (``reserve(..., measured_base=True)``) before it holds, so that the
  hold can turn into resident pools in one request without the charge dipping while the
  device's measurement catches up.
* **budget** = ``total - headroom - external``.

Invariant: at every decision that adds charge, ``sum(charges) <= budget`` afterwards, and
also ``sum(charges) + unfilled floors of every other instance <= budget``.  A request that would
break it is refused and changes nothing.  Decreases are always allowed, so a ledger pushed
over budget by external usage (``overcommitted``) can only move back towards it.  One
exception: while growth is held after state damage that may have lost whole records
(``hold_growth(..., records_lost=True)``), a re-assertion within its allowance is memory its
process already holds, and is charged whether or not it fits (refusing it would only hide it:
the room would go to someone else); the ledger may then be overcommitted until the restored
figures that over-charge are re-asserted lower.

Units: ``*_bytes`` are ints of bytes, ``*_pages`` ints of pages, ``*_s`` float seconds.
"""

from __future__ import annotations

from typing import Iterable

from msgspec import UNSET, UnsetType

from ..client.errors import BadRequest, BrokerError, LimitExceeded, StaleRevision
from ..client.protocol import RUNTIME_BASE_POOL, RUNTIME_SLACK_POOL
from ..client.units import format_bytes
from .accounts import (
    SMALL_GRANTS,
    Claim,
    DeviceInfo,
    Grant,
    InstanceAccount,
    LedgerChanges,
    Limits,
    LimitSource,
    ProcessAccount,
    Session,
    SessionState,
)
from .refusals import clean_pools, clean_views, largest_growth
from .refusal_errors import error_for
from .refusals import refusal as refusal_for


class Ledger:
    """Accounting state machine for one device."""

    def __init__(self, device: DeviceInfo, *, total_bytes: int, headroom_bytes: int, external_bytes: int = 0):
        self.device = device
        self.total_bytes = total_bytes
        self.headroom_bytes = headroom_bytes
        self.external_bytes = external_bytes
        self.sessions: dict[str, Session] = {}
        self.limits: dict[str, Limits] = {}
        self._instances: dict[str, InstanceAccount] = {}
        self._accounts: dict[object, ProcessAccount] = {}
        self._measured_by_pid: dict[int, int] = {}
        self._reserved_total = 0
        self._held_total = 0
        self._granted_total = 0
        self._excess_total = 0
        self._unfilled_floor_total = 0
        self._changes = LedgerChanges()
        #: Why nobody may grow right now (state restored from damage), or None.  Growth that
        #: adds no charge is exempt, and so is a session's re-assertion within its allowance
        #: (``Session.reassert_allowance_bytes``), and the adoption of a restored session's claims.
        self.growth_hold: str | None = None
        #: The hold is for damage that may have lost whole records: the broker cannot tell
        #: who held what, so re-assertions within their allowances are charged as they come.
        self.records_lost = False

    # ----------------------------------------------------------------- totals
    @property
    def budget_bytes(self) -> int:
        return max(0, self.total_bytes - self.headroom_bytes - self.external_bytes)

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_total

    @property
    def granted_bytes(self) -> int:
        return self._granted_total

    @property
    def held_bytes(self) -> int:
        """The part of ``reserved_bytes`` that is holds (promised, not allocated)."""
        return self._held_total

    @property
    def unreported_bytes(self) -> int:
        return self._excess_total

    @property
    def charged_bytes(self) -> int:
        return self._reserved_total + self._granted_total + self._excess_total

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self.charged_bytes)

    @property
    def overcommitted(self) -> bool:
        return self.charged_bytes > self.budget_bytes

    def instance_charge_bytes(self, instance: str) -> int:
        inst = self._instances.get(instance)
        return inst.charge_bytes if inst else 0

    def grantable_bytes(self, instance: str) -> int:
        """How much more this instance could be granted or reserve right now (before any
        measured usage its processes have beyond their reports): within the budget less the
        other instances' unfilled floors, and within its own cap; 0 when overcommitted or
        while growth is held."""
        if self.overcommitted or self.growth_hold is not None:
            return 0
        others_unfilled = self._unfilled_floor_total - self.unfilled_floor_bytes(instance)
        room = self.budget_bytes - self.charged_bytes - others_unfilled
        limits = self.limits.get(instance)
        if limits is not None and limits.max_bytes is not None:
            room = min(room, limits.max_bytes - self.instance_charge_bytes(instance))
        return max(0, room)

    def ever_bytes(self, instance: str) -> int:
        """The most this instance could ever be charged beyond what it is now, once every other
        instance is down to its floor: ``min(budget - other floors, own cap) - charge``."""
        ceiling = self.budget_bytes - sum(lim.min_bytes for name, lim in self.limits.items() if name != instance)
        limits = self.limits.get(instance)
        if limits is not None and limits.max_bytes is not None:
            ceiling = min(ceiling, limits.max_bytes)
        return max(0, ceiling - self.instance_charge_bytes(instance))

    def top_charges(self, exclude: str, count: int = 3) -> list[tuple[str, int]]:
        """The ``count`` instances charged most, other than ``exclude``, most first (refusals name
        who holds the room).  O(instances)."""
        ranked = sorted(((-inst.charge_bytes, name) for name, inst in self._instances.items()
                         if name != exclude and inst.charge_bytes > 0))
        return [(name, -negative) for negative, name in ranked[:count]]

    def holds_of_others(self, exclude: str) -> list[tuple[str, int]]:
        """Each instance other than ``exclude`` with holds, and their bytes, most first: memory
        promised to start-ups in progress, which turns into their pools or is given back (a
        refused start-up can wait for it).  O(sessions): for refusals only."""
        held: dict[str, int] = {}
        for session in self.sessions.values():
            if session.instance != exclude and session.held_bytes > 0:
                held[session.instance] = held.get(session.instance, 0) + session.held_bytes
        return sorted(held.items(), key=lambda item: (-item[1], item[0]))

    def unfilled_floor_bytes(self, instance: str) -> int:
        limits = self.limits.get(instance)
        if limits is None or not limits.min_bytes:
            return 0
        return max(0, limits.min_bytes - self.instance_charge_bytes(instance))

    def check_invariant(self) -> None:
        """Recompute every total from scratch and compare (for tests; O(sessions))."""
        self._check_session_totals()
        for account in self._accounts.values():
            resident = sum(self.sessions[sid].resident_bytes for sid in account.session_ids)
            assert resident == account.reported_bytes, (resident, account.reported_bytes)
        excess = sum(a.excess_bytes for a in self._accounts.values())
        assert excess == self._excess_total, (excess, self._excess_total)
        names = set(self.limits) | set(self._instances)
        unfilled = sum(self.unfilled_floor_bytes(n) for n in names)
        assert unfilled == self._unfilled_floor_total, (unfilled, self._unfilled_floor_total)
        for session in self.sessions.values():
            _check_session_books(session)

    def _check_session_totals(self) -> None:
        """The running totals over sessions (reserved, held, granted bytes) against their sums."""
        reserved = sum(s.reserved_bytes for s in self.sessions.values())
        assert reserved == self._reserved_total, (reserved, self._reserved_total)
        held = sum(s.held_bytes for s in self.sessions.values())
        assert held == self._held_total, (held, self._held_total)
        granted = sum(s.granted_bytes for s in self.sessions.values())
        assert granted == self._granted_total, (granted, self._granted_total)

    # ------------------------------------------------------------ device view
    def observe_device(
        self,
        *,
        total_bytes: int | None = None,
        headroom_bytes: int | None = None,
        external_bytes: int | None = None,
        measured_by_pid: dict[int, int] | None = None,
    ) -> None:
        """Take a new device reading.  May leave the ledger overcommitted; never refuses."""
        if total_bytes is not None:
            self.total_bytes = total_bytes
        if headroom_bytes is not None:
            self.headroom_bytes = headroom_bytes
        if external_bytes is not None:
            self.external_bytes = external_bytes
        if measured_by_pid is not None:
            self._measured_by_pid = dict(measured_by_pid)
            for key, account in self._accounts.items():
                measured = self._measured_by_pid.get(key, 0) if isinstance(key, int) else 0
                if measured != account.measured_bytes:
                    self._recharge(account, measured_delta=measured - account.measured_bytes)

    # --------------------------------------------------------------- sessions
    def open_session(
        self,
        session_id: str,
        *,
        instance: str,
        pid: int,
        pid_verified: bool,
        tp_rank: int,
        tp_size: int,
        page_bytes: int,
        now_s: float,
        pools: dict[str, int] | None = None,
        granted_pages: int = 0,
        reserve_pages: int = 0,
        state: SessionState = SessionState.LIVE,
        restored: bool = False,
        holds: dict[str, int] | None = None,
        report_mapping: bool = False,
        unmapped_pages: int = 0,
        phase: str = "",
    ) -> Session:
        """Register a session.  Holdings passed here are adopted without admission: they
        describe memory the process already holds (a reconnect after a broker restart)."""
        if session_id in self.sessions:
            raise BadRequest(f"session {session_id} is already open")
        if page_bytes <= 0:
            raise BadRequest(f"page_bytes must be positive, got {page_bytes}")
        resident = clean_pools(pools or {})
        session = Session(
            id=session_id,
            instance=instance,
            pid=pid,
            pid_verified=pid_verified,
            tp_rank=tp_rank,
            tp_size=tp_size,
            page_bytes=page_bytes,
            opened_s=now_s,
            last_seen_s=now_s,
            state=state,
            restored=restored,
            report_mapping=report_mapping,
            phase=phase,
        )
        self.sessions[session_id] = session
        inst = self._instances.get(instance)
        if inst is None:
            inst = self._instances[instance] = InstanceAccount(instance)
        inst.session_ids.add(session_id)
        session.account = self._account_for(session)
        session.account.session_ids.add(session_id)
        unmapped = min(max(0, unmapped_pages), granted_pages) if report_mapping else 0
        self._apply(session, pools=resident, granted_pages=granted_pages, holds=clean_pools(holds or {}),
                    unmapped_pages=unmapped)
        session.reserve_pages = min(reserve_pages, session.granted_pages)
        self._changed(session)
        return session

    def close_session(self, session_id: str) -> Session:
        """Free everything the session holds and forget it."""
        session = self._session(session_id)
        self._apply(session, pools={}, granted_pages=0, holds={}, unmapped_pages=0)
        key = self._account_key(session)
        account = self._accounts[key]
        account.session_ids.discard(session_id)
        if not account.session_ids:
            self._recharge(account, measured_delta=-account.measured_bytes)
            del self._accounts[key]
        elif account.instance == session.instance:
            heir = next(iter(account.session_ids))
            self._reattribute(account, self.sessions[heir].instance)
        inst = self._instances[session.instance]
        inst.session_ids.discard(session_id)
        if not inst.session_ids:
            old_unfilled = self.unfilled_floor_bytes(session.instance)
            del self._instances[session.instance]
            self._unfilled_floor_total += self.unfilled_floor_bytes(session.instance) - old_unfilled
        del self.sessions[session_id]
        self._changes.sessions.discard(session_id)
        self._changes.closed.add(session_id)
        return session

    def touch(self, session_id: str, now_s: float) -> bool:
        """Record activity; a stale session comes back to live.  Returns True if it revived."""
        session = self._session(session_id)
        session.last_seen_s = now_s
        if session.state is SessionState.STALE:
            session.state = SessionState.LIVE
            self._changed(session)
            return True
        return False

    def resume(self, session_id: str, now_s: float, *, holdings: "Claim | None") -> tuple[Session, bool]:
        """A worker reconnected to its session; returns it and whether its claims were adopted.

        A session restored from a checkpoint adopts what the worker re-asserts (the worker
        knows what it holds; the broker may have answered a request it then forgot), but only
        through admission: claims above the checkpoint must fit like any grant, or the
        checkpoint's figures stay.  A session that never left this broker keeps the broker's
        figures: its reply cache covers any request whose answer the worker missed.
        """
        session = self._session(session_id)
        adopted = False
        session.resume_claims = "kept"
        if session.restored and holdings is not None:
            pools, holds = clean_pools(holdings.pools), clean_pools(holdings.holds)
            unmapped = self._claimed_unmapped(session, holdings)
            page_bytes = session.page_bytes
            resident_delta = (sum(pools.values()) + (holdings.granted_pages - unmapped) * page_bytes
                              - session.resident_bytes)
            held_delta = sum(holds.values()) + unmapped * page_bytes - session.promised_bytes
            if self.growth_hold is not None and self.records_lost:
                # whole records may be lost: the restored figures may be an older, smaller or
                # larger record; what the worker re-asserts (within its allowance) is charged
                fits = max(0, resident_delta) + max(0, held_delta) <= self._reassertion_left_bytes(session)
            else:
                fits = self._fits(session, resident_delta, held_delta, resuming=True) is None
            if fits:
                self._apply(session, pools=pools, granted_pages=holdings.granted_pages, holds=holds,
                            unmapped_pages=unmapped)
                session.reserve_pages = min(holdings.reserve_pages, session.granted_pages)
                adopted = True
            session.resume_claims = "adopted" if adopted else "refused"
        session.restored = False
        session.reassert_allowance_bytes = 0  # a restored session grows no further than its claims
        session.state = SessionState.LIVE
        session.last_seen_s = now_s
        self._changed(session)
        return session, adopted

    @staticmethod
    def _claimed_unmapped(session: Session, holdings: Claim) -> int:
        """The unmapped pages a claim implies: none unless the session reports mapping; then
        the granted pages it does not say are mapped (all, if it says nothing)."""
        if not session.report_mapping:
            return 0
        mapped = holdings.mapped_pages or 0
        return max(0, holdings.granted_pages - min(mapped, holdings.granted_pages))

    def hold_growth(self, reason: str, *, records_lost: bool = False) -> None:
        """Refuse growth that adds charge, except a re-assertion within its allowance
        (:meth:`allow_reassertion`) and a restored session's claims (:meth:`resume`).

        ``records_lost``: whole records may be gone, so the figures restored are no measure of
        who holds what: a re-assertion within its allowance (a restored session's claims
        likewise, within the allowance it is given) is charged whether or not it fits."""
        self.growth_hold = reason
        self.records_lost = records_lost

    def release_growth(self) -> None:
        self.growth_hold = None
        self.records_lost = False
        for session in self.sessions.values():
            session.reassert_allowance_bytes = 0

    def allow_reassertion(self, session_id: str, claimed_bytes: int) -> int:
        """While growth is held, let a session opened for a worker whose record was lost grow
        back by up to ``claimed_bytes`` (what its hello claimed it held; at most the budget).
        Returns the allowance (0 when growth is not held).

        The allowance only exempts growth from the hold: each request still passes admission
        (caps, budget, floors) like any, and uses the allowance up by what it adds.
        """
        session = self._session(session_id)
        allowance_bytes = 0 if self.growth_hold is None else max(0, min(claimed_bytes, self.budget_bytes))
        session.reassert_allowance_bytes = allowance_bytes
        return allowance_bytes

    def expire_leases(self, now_s: float, lease_s: float) -> list[Session]:
        """Mark sessions silent for longer than ``lease_s`` stale (still charged).

        A ``recovering`` session (restored, its worker not back since the restart) turns stale
        the same way, ``lease_s`` after the restart, so that an operator sees it as one to
        evict; it stays ``restored`` until its worker resumes it.
        """
        stale = []
        for session in self.sessions.values():
            if session.state is not SessionState.STALE and now_s - session.last_seen_s > lease_s:
                session.state = SessionState.STALE
                self._changed(session)
                stale.append(session)
        return stale

    def set_reserve_pages(self, session_id: str, reserve_pages: int) -> None:
        session = self._session(session_id)
        clamped = min(reserve_pages, session.granted_pages)
        if clamped != session.reserve_pages:
            session.reserve_pages = clamped
            self._changed(session)

    # ------------------------------------------------------------ reservations
    def reserve(
        self,
        session_id: str,
        pools: dict[str, int],
        usage: dict[str, int] | None = None,
        *,
        holds: dict[str, int] | None = None,
        measured_base: bool = False,
        min_holds: dict[str, int] | None = None,
        phase: str | None = None,
    ) -> dict[str, int]:
        """Replace the session's resident pools (a pool set to 0 is removed), and its holds
        unless ``holds`` is None.  Returns the resident pools.

        ``measured_base`` sets the ``runtime_base`` pool to what the device measures this
        process using beyond everything else it reports after this request.  ``min_holds``
        (one hold name: the least of it the caller can use) lets that hold shrink to what fits,
        as ``min_pages`` lets an acquire: the largest size between the least and the asked one
        is held (``session.holds`` says which).  ``phase`` (None keeps it) is what status shows
        of where the worker is.  Raises :class:`BudgetExceeded` (or
        ``LimitExceeded``/``Overcommitted``) naming the pool if the growth does not fit; the
        ledger is then unchanged.
        """
        session = self._session(session_id)
        new_pools, new_holds = _asked_books(session, pools, holds)
        flexible = self._flexible_hold(holds or {}, min_holds) if min_holds else None
        if flexible is not None and flexible[0] not in new_holds:
            flexible = None  # asked at 0: dropped, nothing to shrink
        if measured_base:
            new_pools = self._with_measured_base(session, new_pools)
        resident_delta = sum(new_pools.values()) - (session.reserved_bytes - session.held_bytes)
        held_delta = sum(new_holds.values()) - session.held_bytes
        fit = self._fits(session, resident_delta, held_delta)
        if fit is not None and flexible is not None:
            new_holds, held_delta, fit = self._shrink_flexible_hold(session, resident_delta, held_delta, new_holds,
                                                                    flexible)
        views_bound = session.reserved_bytes + resident_delta + held_delta + session.granted_bytes
        views = None if usage is None else clean_views(usage, views_bound)
        if fit is not None:
            raise self._reservation_refused(session, fit, new_pools, new_holds, resident_delta, held_delta)
        self._apply(session, pools=new_pools, granted_pages=session.granted_pages, holds=new_holds,
                    unmapped_pages=session.unmapped_pages)
        if session.reassert_allowance_bytes:
            self._use_allowance(session, max(0, resident_delta) + max(0, held_delta))
        _book_views(session, views, views_bound)
        if phase is not None:
            session.phase = phase
        self._changed(session)
        return dict(session.pools)

    def _shrink_flexible_hold(self, session: Session, resident_delta: int, held_delta: int,
                              new_holds: dict[str, int], flexible: tuple[str, int],
                              ) -> tuple[dict[str, int], int, tuple[str, int] | None]:
        """A refused reservation with ``min_holds``: its one flexible hold set to the largest size
        that fits, or to its least where none does.  Returns the holds, the held delta and the
        fit (None: it fits now; else the refusal, worded for the least that did not fit)."""
        name, least_bytes = flexible
        size = self._largest_hold_that_fits(session, resident_delta, held_delta, new_holds[name], least_bytes)
        held_delta -= new_holds[name] - (least_bytes if size is None else size)
        new_holds = clean_pools({**new_holds, name: least_bytes if size is None else size})
        fit = None if size is not None else self._fits(session, resident_delta, held_delta)
        return new_holds, held_delta, fit

    def _reservation_refused(self, session: Session, fit: tuple[str, int], new_pools: dict[str, int],
                             new_holds: dict[str, int], resident_delta: int, held_delta: int) -> BrokerError:
        """The error a refused reservation raises: ``fit``'s code and room, naming the pool that
        grew most (a hold, charged in full, before a pool measured usage may cover)."""
        code, room_bytes = fit
        grown = (session.holds, new_holds) if held_delta > 0 else (session.pools, new_pools)
        pool, pool_growth = largest_growth(*grown)
        return error_for(refusal_for(
            code,
            what=f"reservation of pool {pool!r} (+{format_bytes(pool_growth)})",
            instance=session.instance,
            asked_bytes=max(0, self._charge_growth(session, resident_delta, held_delta)),
            room_bytes=room_bytes,
            ledger=self,
            details={"pool": pool, "pool_asked_bytes": pool_growth},
        ))

    @staticmethod
    def _flexible_hold(holds: dict[str, int], min_holds: dict[str, int]) -> tuple[str, int]:
        """The one hold ``min_holds`` lets shrink, and the least of it (checked)."""
        if len(min_holds) != 1:
            raise BadRequest(f"min_holds names one hold, got {len(min_holds)}")
        ((name, least_bytes),) = min_holds.items()
        if name not in holds:
            raise BadRequest(f"min_holds names {name!r}, which this request does not hold")
        if not isinstance(least_bytes, int) or isinstance(least_bytes, bool) or not 0 <= least_bytes <= holds[name]:
            raise BadRequest(f"min_holds[{name!r}] must be between 0 and the hold ({holds[name]}), got {least_bytes!r}")
        return name, least_bytes

    def _largest_hold_that_fits(self, session: Session, resident_delta: int, held_delta: int,
                                asked_bytes: int, least_bytes: int) -> int | None:
        """The largest size in ``[least_bytes, asked_bytes]`` of one hold for which the request
        fits (its other changes as they are), or None.  Fitting only gets harder as the hold
        grows, so a bisection finds it (about 40 checks at most, only on a refused request)."""
        def fits(size: int) -> bool:
            return self._fits(session, resident_delta, held_delta - (asked_bytes - size)) is None

        if not fits(least_bytes):
            return None
        low, high = least_bytes, asked_bytes  # fits(low) holds; fits(asked) does not
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

    def measured_bytes(self, session_id: str) -> int:
        """What the device measures the session's process using (0 where it cannot say)."""
        account = self._session(session_id).account
        return account.measured_bytes if account is not None else 0

    def _with_measured_base(self, session: Session, pools: dict[str, int]) -> dict[str, int]:
        """``pools`` with ``runtime_base`` set to what the process measures beyond everything
        else it reports.  Once a base is pinned, a ``runtime_slack`` pool (room kept for later
        activations, allocated as they come) is not counted as allocated: the base grows into
        it by what the device measures beyond the base and the other pools, and it shrinks by as
        much, so a re-pin never gives away the part of the slack not allocated yet."""
        account = session.account
        assert account is not None
        others_bytes = account.reported_bytes - session.resident_bytes  # the process's other sessions
        mapped_bytes = session.mapped_pages * session.page_bytes
        old_base_bytes = session.pools.get(RUNTIME_BASE_POOL)
        slack_bytes = pools.get(RUNTIME_SLACK_POOL, 0) if old_base_bytes is not None else 0
        mine_bytes = sum(size for name, size in pools.items() if name != RUNTIME_BASE_POOL) + mapped_bytes - slack_bytes
        base_bytes = max(0, account.measured_bytes - others_bytes - mine_bytes)
        pools = {name: size for name, size in pools.items() if name != RUNTIME_BASE_POOL}
        if slack_bytes:
            kept_bytes = max(0, slack_bytes - max(0, base_bytes - (old_base_bytes or 0)))
            pools[RUNTIME_SLACK_POOL] = kept_bytes
            if not kept_bytes:
                del pools[RUNTIME_SLACK_POOL]
        if base_bytes:
            pools[RUNTIME_BASE_POOL] = base_bytes
        return pools

    # ------------------------------------------------------------------ pages
    def acquire(self, session_id: str, pages: int, min_pages: int | None = None, mapped: bool = False) -> Grant:
        """Grant ``pages``, or with ``min_pages`` the largest k in [min_pages, pages] that fits.

        ``mapped`` (a session that reports mapping): the pages are mapped already (a worker
        asking a broker that lost its session for what it holds), so they are resident, and
        usage the device measures beyond the process's reports covers them as any resident
        growth; otherwise such a session's new pages are promised, charged in full.
        A refusal is ``Grant(0, refusal)``, not an exception; the ledger is then unchanged.
        """
        session = self._session(session_id)
        if pages <= 0:
            raise BadRequest(f"acquire needs a positive page count, got {pages}")
        floor_pages = pages if min_pages is None else min_pages
        if not 0 <= floor_pages <= pages:
            raise BadRequest(f"min_pages must be between 0 and pages ({pages}), got {min_pages}")
        resident = mapped or not session.report_mapping
        fit_pages, code, room_bytes = self._pages_that_fit(session, pages, resident)
        if fit_pages < floor_pages or fit_pages == 0:
            refusal = refusal_for(
                code or "budget_exceeded",
                what=f"{pages} page(s) of {format_bytes(session.page_bytes)}",
                instance=session.instance,
                asked_bytes=pages * session.page_bytes,
                room_bytes=room_bytes,
                ledger=self,
                details={"pool": "elastic", "asked_pages": pages, "min_pages": min_pages, "fit_pages": fit_pages},
            )
            return Grant(0, refusal)
        self._add_pages(session, fit_pages, resident)
        if session.reassert_allowance_bytes:
            self._use_allowance(session, fit_pages * session.page_bytes)
        return SMALL_GRANTS[fit_pages] if fit_pages < len(SMALL_GRANTS) else Grant(fit_pages)

    def fit_pages(self, session_id: str, pages: int, mapped: bool = False) -> int:
        """How many of ``pages`` an ``acquire`` would grant now (changes nothing; O(1))."""
        session = self._session(session_id)
        return self._pages_that_fit(session, pages, mapped or not session.report_mapping)[0]

    def release(self, session_id: str, pages: int, mapped_pages: int | None = None) -> int:
        """Return pages; releasing more than the session holds is ``bad_request``.

        For a session that reports mapping, ``mapped_pages`` says how many of the pages it
        keeps are mapped (it unmapped what it gives back); without it the pages given back are
        taken from its unmapped ones first (a page it still says is mapped stays charged as
        resident, which over-charges until it says otherwise: never the other way)."""
        session = self._session(session_id)
        if pages <= 0:
            raise BadRequest(f"release needs a positive page count, got {pages}")
        if pages > session.granted_pages:
            raise BadRequest(
                f"release of {pages} page(s) but session {session.id} holds {session.granted_pages}",
                details={"pages": pages, "granted_pages": session.granted_pages},
            )
        if session.report_mapping:
            left_pages = session.granted_pages - pages
            if mapped_pages is None:
                unmapped = max(0, session.unmapped_pages - pages)
            else:
                unmapped = left_pages - self._checked_mapped(session, mapped_pages, left_pages)
            self._apply(session, pools=session.pools, granted_pages=left_pages, holds=session.holds,
                        unmapped_pages=unmapped)
            self._changed(session)
        else:
            if mapped_pages is not None:
                raise BadRequest(f"session {session.id} does not report mapping (hello report_mapping)")
            self._add_pages(session, -pages, True)
        if session.reserve_pages > session.granted_pages:
            session.reserve_pages = session.granted_pages
        return session.granted_pages

    def set_mapped(self, session_id: str, mapped_pages: int) -> int:
        """The session has ``mapped_pages`` of its granted pages mapped now; returns its
        unmapped pages.  Never refused for room: mapping turns a promised page into one the
        device measures (no more charge); unmapping one charges it in full again until the
        device's measurement drops (more charge, for a moment, never less)."""
        session = self._session(session_id)
        if not session.report_mapping:
            raise BadRequest(f"session {session.id} does not report mapping (hello report_mapping)")
        unmapped = session.granted_pages - self._checked_mapped(session, mapped_pages, session.granted_pages)
        if unmapped != session.unmapped_pages:
            self._apply(session, pools=session.pools, granted_pages=session.granted_pages, holds=session.holds,
                        unmapped_pages=unmapped)
            self._changed(session)
        return unmapped

    @staticmethod
    def _checked_mapped(session: Session, mapped_pages: int, granted_pages: int) -> int:
        if not isinstance(mapped_pages, int) or isinstance(mapped_pages, bool) or not 0 <= mapped_pages <= granted_pages:
            raise BadRequest(
                f"mapped_pages must be between 0 and the {granted_pages} page(s) session {session.id} holds, "
                f"got {mapped_pages!r}",
                details={"mapped_pages": mapped_pages, "granted_pages": granted_pages},
            )
        return mapped_pages

    # ----------------------------------------------------------------- limits
    def set_limits(
        self,
        instance: str,
        *,
        max_bytes: int | None | UnsetType = UNSET,
        min_bytes: int | UnsetType = UNSET,
        weight: float | UnsetType = UNSET,
        revision: int | None = None,
        source: LimitSource = "admin",
        priority: int | UnsetType = UNSET,
        owner_uid: int | None = None,
    ) -> Limits:
        """Change an instance's limits (the instance need not be registered yet): a limit left
        ``UNSET`` (msgspec's, as a request that omits it decodes) stays as it is; ``max_bytes=None``
        is no cap.

        Refused with ``limit_exceeded`` if ``min > max`` or the floors would sum past the
        budget, and with ``stale_revision`` if ``revision`` is given and is not current.
        """
        current = self.limits.get(instance, Limits())
        if revision is not None and revision != current.revision:
            raise StaleRevision(
                f"limits of {instance!r} are at revision {current.revision}, not {revision}",
                details={"instance": instance, "revision": current.revision},
            )
        new = Limits(
            max_bytes=current.max_bytes if max_bytes is UNSET else max_bytes,
            min_bytes=current.min_bytes if min_bytes is UNSET else min_bytes,
            weight=current.weight if weight is UNSET else weight,
            revision=current.revision + 1,
            source=source,
            priority=current.priority if priority is UNSET else priority,
            owner_uid=owner_uid,
        )
        if new.max_bytes is not None and new.min_bytes > new.max_bytes:
            raise LimitExceeded(
                f"floor of {instance!r} ({format_bytes(new.min_bytes)}) exceeds its cap ({format_bytes(new.max_bytes)})",
                details={"instance": instance, "min_bytes": new.min_bytes, "max_bytes": new.max_bytes},
            )
        floors = sum(lim.min_bytes for name, lim in self.limits.items() if name != instance) + new.min_bytes
        if floors > self.budget_bytes:
            raise LimitExceeded(
                f"floors would sum to {format_bytes(floors)}, past the budget of {format_bytes(self.budget_bytes)}",
                details={"instance": instance, "floors_bytes": floors, "budget_bytes": self.budget_bytes},
            )
        self._set_limits_unchecked(instance, new)
        return new

    def restore_limits(self, instance: str, limits: Limits) -> None:
        """Load limits from a checkpoint or config as they are (no budget check)."""
        self._set_limits_unchecked(instance, limits)

    def forget_limits(self, instance: str) -> None:
        """Drop an instance's limits (those its own worker asked for, once it has left)."""
        if instance in self.limits:
            old_unfilled = self.unfilled_floor_bytes(instance)
            del self.limits[instance]
            self._unfilled_floor_total -= old_unfilled
            self._changes.limits.add(instance)

    def _set_limits_unchecked(self, instance: str, limits: Limits) -> None:
        old_unfilled = self.unfilled_floor_bytes(instance)
        self.limits[instance] = limits
        self._unfilled_floor_total += self.unfilled_floor_bytes(instance) - old_unfilled
        self._changes.limits.add(instance)

    # ---------------------------------------------------------------- changes
    def drain_changes(self) -> LedgerChanges | None:
        """What changed since the last call, or None if nothing did."""
        if not self._changes:
            return None
        changes, self._changes = self._changes, LedgerChanges()
        return changes

    def instance_names(self) -> Iterable[str]:
        return self._instances.keys()

    def instance_session_ids(self, instance: str) -> list[str]:
        """The ids of a registered instance's sessions (none if it is not registered)."""
        inst = self._instances.get(instance)
        return sorted(inst.session_ids) if inst is not None else []

    def instance_totals(self, instance: str) -> tuple[int, int, int]:
        """``(reserved_bytes, granted_bytes, unreported_bytes)`` of a registered instance."""
        inst = self._instances.get(instance)
        if inst is None:
            return 0, 0, 0
        return inst.reserved_bytes, inst.granted_bytes, inst.excess_bytes

    # --------------------------------------------------------------- internals
    def _session(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise BadRequest(f"no session {session_id}") from None

    def _changed(self, session: Session) -> None:
        self._changes.sessions.add(session.id)

    @staticmethod
    def _account_key(session: Session) -> object:
        if session.pid_verified and session.pid > 0:
            return session.pid
        return ("session", session.id)

    def _account_for(self, session: Session) -> ProcessAccount:
        key = self._account_key(session)
        account = self._accounts.get(key)
        if account is None:
            account = self._accounts[key] = ProcessAccount(instance=session.instance)
            measured = self._measured_by_pid.get(key, 0) if isinstance(key, int) else 0
            if measured:
                self._recharge(account, measured_delta=measured)
        return account

    def _recharge(self, account: ProcessAccount, *, reported_delta: int = 0, measured_delta: int = 0) -> None:
        """Move an account's reported/measured figures and keep every total in step."""
        old_excess = account.excess_bytes
        account.reported_bytes += reported_delta
        account.measured_bytes += measured_delta
        excess_delta = account.excess_bytes - old_excess
        if excess_delta:
            self._excess_total += excess_delta
            self._move_instance_excess(account.instance, excess_delta)

    def _move_instance_excess(self, instance: str, excess_delta: int) -> None:
        inst = self._instances.get(instance)
        if inst is None:
            return
        old_unfilled = self.unfilled_floor_bytes(instance)
        inst.excess_bytes += excess_delta
        self._unfilled_floor_total += self.unfilled_floor_bytes(instance) - old_unfilled

    def _reattribute(self, account: ProcessAccount, instance: str) -> None:
        """Charge a process's unreported excess to another of its instances."""
        if instance == account.instance:
            return
        excess = account.excess_bytes
        self._move_instance_excess(account.instance, -excess)
        account.instance = instance
        self._move_instance_excess(instance, excess)

    def _apply(self, session: Session, *, pools: dict[str, int], granted_pages: int, holds: dict[str, int],
               unmapped_pages: int) -> None:
        """Set a session's holdings and keep instance, process and device totals in step."""
        held_delta = sum(holds.values()) - session.held_bytes
        reserved_delta = sum(pools.values()) + held_delta + session.held_bytes - session.reserved_bytes
        granted_delta = (granted_pages - session.granted_pages) * session.page_bytes
        resident_before = session.resident_bytes
        inst = self._instances[session.instance]
        old_unfilled = self.unfilled_floor_bytes(session.instance)
        session.pools = dict(pools)
        session.holds = dict(holds)
        session.reserved_bytes += reserved_delta
        session.held_bytes += held_delta
        session.granted_pages = granted_pages
        session.unmapped_pages = unmapped_pages
        inst.reserved_bytes += reserved_delta
        inst.granted_bytes += granted_delta
        self._reserved_total += reserved_delta
        self._held_total += held_delta
        self._granted_total += granted_delta
        self._unfilled_floor_total += self.unfilled_floor_bytes(session.instance) - old_unfilled
        self._recharge(self._account_for(session), reported_delta=session.resident_bytes - resident_before)

    def _add_pages(self, session: Session, pages: int, resident: bool) -> None:
        """``_apply`` for a change of granted pages only, recorded as a change: the grant
        path, kept short."""
        delta = pages * session.page_bytes
        inst = self._instances[session.instance]
        limits = self.limits.get(session.instance) if self.limits else None
        floor = limits.min_bytes if limits is not None else 0
        unfilled_before = max(0, floor - inst.charge_bytes) if floor else 0
        self._changes.sessions.add(session.id)
        session.granted_pages += pages
        inst.granted_bytes += delta
        self._granted_total += delta
        if floor:
            self._unfilled_floor_total += max(0, floor - inst.charge_bytes) - unfilled_before
        account = session.account
        assert account is not None  # bound at open_session
        if not resident:  # a grant (never a release: see release) that is promised, not measured yet
            session.unmapped_pages += pages
        elif account.measured_bytes:
            self._recharge(account, reported_delta=delta)
        else:  # nothing measured: no unreported excess can appear or vanish
            account.reported_bytes += delta

    def _growth_room(self, session: Session, resident: bool) -> tuple[int, int | None, int]:
        """``(device_room, cap_room, slack)`` in bytes for growing this session's reported bytes.

        ``slack`` is measured-but-unreported usage of its process: growth up to it adds no
        charge (it is already charged).
        """
        account = self._accounts[self._account_key(session)]
        slack = account.excess_bytes if resident else 0  # unmapped pages are charged in full
        others_unfilled = self._unfilled_floor_total - self.unfilled_floor_bytes(session.instance)
        device_room = self.budget_bytes - self.charged_bytes - others_unfilled + slack
        limits = self.limits.get(session.instance)
        cap_room = None
        if limits is not None and limits.max_bytes is not None:
            own_slack = slack if account.instance == session.instance else 0
            cap_room = limits.max_bytes - self.instance_charge_bytes(session.instance) + own_slack
        return device_room, cap_room, slack

    def _fits(
        self, session: Session, resident_delta: int, held_delta: int, *, resuming: bool = False
    ) -> tuple[str, int] | None:
        """None if the session may change its resident bytes and holds by these deltas; else
        the refusal code and the room there is.  Decreases always fit.

        Resident growth is first covered by what the process is measured using beyond its
        reports (it is charged already); holds are charged in full.
        """
        account = session.account
        assert account is not None
        device_delta = self._charge_growth(session, resident_delta, held_delta)
        own_excess = account.instance == session.instance
        instance_delta = device_delta if own_excess else held_delta + resident_delta
        if device_delta <= 0 and instance_delta <= 0:
            return None
        if self.growth_hold is not None and not resuming:
            if max(0, resident_delta) + max(0, held_delta) > self._reassertion_left_bytes(session):
                return "held", 0
            if self.records_lost:
                return None  # memory the process already holds, re-asserted: charged as it is
        if self.overcommitted:
            return "overcommitted", 0
        limits = self.limits.get(session.instance)
        if limits is not None and limits.max_bytes is not None:
            cap_room = limits.max_bytes - self.instance_charge_bytes(session.instance)
            if instance_delta > cap_room:
                return "limit_exceeded", max(0, cap_room)
        others_unfilled = self._unfilled_floor_total - self.unfilled_floor_bytes(session.instance)
        device_room = self.budget_bytes - self.charged_bytes - others_unfilled
        if device_delta > device_room:
            return "budget_exceeded", max(0, device_room)
        return None

    @staticmethod
    def _charge_growth(session: Session, resident_delta: int, held_delta: int) -> int:
        """What the device's charge grows by if the session's resident bytes and holds change by
        these deltas: resident growth is first covered by what the process is measured using
        beyond its reports; holds are charged in full."""
        account = session.account
        assert account is not None
        measured, reported = account.measured_bytes, account.reported_bytes
        return held_delta + max(measured, reported + resident_delta) - max(measured, reported)

    def _use_allowance(self, session: Session, grown_bytes: int) -> None:
        session.reassert_allowance_bytes = max(0, session.reassert_allowance_bytes - grown_bytes)

    def _reassertion_left_bytes(self, session: Session) -> int:
        """What the session may still grow by while growth is held: its allowance, capped where
        the device measures its process at what that usage leaves beyond everything the
        process already claims (a process cannot hold more than it uses)."""
        left_bytes = session.reassert_allowance_bytes
        account = session.account
        if left_bytes and account is not None and account.measured_bytes:
            claimed_bytes = account.reported_bytes + sum(self.sessions[sid].promised_bytes for sid in account.session_ids)
            left_bytes = min(left_bytes, max(0, account.measured_bytes - claimed_bytes))
        return left_bytes

    def _pages_that_fit(self, session: Session, pages: int, resident: bool) -> tuple[int, str | None, int]:
        """The most pages (≤ ``pages``) that fit, the binding constraint and its room in bytes.

        While growth is held, only pages that add no charge (measured usage covers them) or
        that fit the session's re-assertion allowance may be granted.
        """
        budget = self.budget_bytes
        charged = self._reserved_total + self._granted_total + self._excess_total
        if charged > budget:
            return 0, "overcommitted", 0
        account = session.account
        assert account is not None  # bound at open_session
        if self.growth_hold is None:
            if not self._unfilled_floor_total and session.instance not in self.limits and not account.measured_bytes:
                fit = min(pages, (budget - charged) // session.page_bytes)  # no floors, cap or slack to weigh
                return fit, (None if fit == pages else "budget_exceeded"), budget - charged
            return self._pages_within(session, pages, resident)
        exempt_bytes = max(self._reassertion_left_bytes(session), account.excess_bytes if resident else 0)
        exempt_pages = min(pages, exempt_bytes // session.page_bytes)
        if not exempt_pages:
            return 0, "held", 0
        if self.records_lost:  # re-asserted (or covered by measured usage): charged as it is
            return exempt_pages, (None if exempt_pages == pages else "held"), 0
        fit, code, room_bytes = self._pages_within(session, exempt_pages, resident)
        if code is None and exempt_pages < pages:
            return fit, "held", 0
        return fit, code, room_bytes

    def _pages_within(self, session: Session, pages: int, resident: bool) -> tuple[int, str | None, int]:
        """``_pages_that_fit`` against the budget, floors and caps alone."""
        device_room, cap_room, _ = self._growth_room(session, resident)
        device_fit = max(0, device_room) // session.page_bytes
        cap_fit = device_fit if cap_room is None else max(0, cap_room) // session.page_bytes
        fit = min(pages, device_fit, cap_fit)
        if fit == pages:
            return fit, None, 0
        if cap_room is not None and cap_fit <= device_fit:
            return fit, "limit_exceeded", max(0, cap_room)
        return fit, "budget_exceeded", max(0, device_room)


def _check_session_books(session: Session) -> None:
    """One session's own books agree: reserved = pools + holds, every size positive, the credit
    reserve and the unmapped pages within the grant (unmapped pages only where it reports mapping)."""
    assert session.reserved_bytes == sum(session.pools.values()) + sum(session.holds.values())
    assert session.held_bytes == sum(session.holds.values())
    assert all(v > 0 for v in session.pools.values()) and all(v > 0 for v in session.holds.values())
    assert 0 <= session.reserve_pages <= session.granted_pages
    assert 0 <= session.unmapped_pages <= session.granted_pages
    assert session.report_mapping or not session.unmapped_pages


def _asked_books(session: Session, pools: dict[str, int],
                 holds: dict[str, int] | None) -> tuple[dict[str, int], dict[str, int]]:
    """A reservation's pools and holds, checked (the session's holds where ``holds`` is None);
    :class:`BadRequest` for a name that is both."""
    new_pools = clean_pools(pools)
    new_holds = session.holds if holds is None else clean_pools(holds)
    both = set(new_pools) & set(new_holds)
    if both:
        raise BadRequest(f"pool {sorted(both)[0]!r} cannot be both a reservation and a hold")
    return new_pools, new_holds


def _book_views(session: Session, views: dict[str, int] | None, views_bound: int) -> None:
    """Keep a reservation's checked usage views, or, where it sent none, forget the session's
    views of memory that is gone (any larger than what it may now hold, ``views_bound``)."""
    if views is not None:
        session.usage = views
    elif any(size > views_bound for size in session.usage.values()):
        session.usage = {}
