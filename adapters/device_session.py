"""One device's session with its broker: the client, the identity it opened under, and the book
of what the process reports and holds there.  Every adapter patch in the process shares it.

A serving worker has several things to report (DeepSeek-V4 side pools, a static KV pool,
elastic pages) but one session per device.  The book (:mod:`.report_book`, no I/O) follows
docs/accounting.md:

* **pools** (resident reservations), by reporter: what each reporter says under its own key
  is merged into the session's one reservation map, so a rebuilt pool replaces its own entry
  and never erases another's;
* **holds**, by name: memory promised to the process that it has not allocated yet (a KV
  sizing hold), charged on top of what the device measures the process using;
* the pinned **runtime base**: what the process already used (weights, CUDA context) when it
  first asked for memory, which the broker measures and keeps as the ``runtime_base`` pool
  (``reserve(..., measured_base=True)``).  It is pinned before or with the first request that
  promises memory, so that measured usage can never absorb a hold or a pool reported ahead of
  its allocation, and a hold can turn into its pools in one request without the charge
  dipping while the device's measurement catches up; and again around memory the runtime
  hands back and maps again (:mod:`.handback`).

:meth:`DeviceSession.report` sets one reporter's pools and changes holds in the same broker
request, so a hold turns into the pools it was for in one call.  A reporter can be
*suspended* (its memory was handed back: SGLang's release of memory occupation, vLLM's
sleep): its pools stay in the book but are not charged until it is resumed, through
admission.  What else the runtime hands back (weights, CUDA graphs) is inside the runtime
base: :meth:`~DeviceSession.repin_base` pins it again at what the device measures, and
:meth:`~DeviceSession.resume` can raise it back before the runtime maps the memory again.

Invariants:

* one request that changes a book at a time in the process: an operation that changes the book
  holds ``lock`` (the registry's, shared by the process's sessions) across its round trip;
* the book changes only once the broker answered (rule B5 of :mod:`.report_book`): a refusal
  or a failure leaves it as it was;
* failing safe: every round trip runs through :meth:`DeviceSession.guard`.  A refusal
  (``BudgetExceeded``) goes to the caller, which explains it; an eviction is always raised
  (its memory was given away); any other broker failure (a timeout, ``rate_limited``,
  ``internal``, an unknown code, an answer of another shape than its request calls for, an
  endpoint the client cannot check at a re-open) turns the device unprotected through its host
  (:class:`SessionHost`, the process's registry in :mod:`.sessions`), and from then on every
  operation answers None (or 0, or False) without a round trip.  Any other exception is a bug
  of the adapter's and reaches its caller: it is not taken for a broker failure.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol, TypeVar

from ..client import BadRequest, BrokerClient, BrokerError, BudgetExceeded
from ..client.endpoint import EndpointError
from ..client.protocol import ProtocolError
from ..client.results import ReserveResult
from . import announce
from .report_book import (KV_SIZING_HOLD, RUNTIME_BASE_POOL, SLACK_HOLD, SLACK_POOL, Plan, ReportBook,
                          Request)
from .worker_identity import WorkerIdentity

log = announce.logger("kvcached_broker.adapters")

T = TypeVar("T")

class SessionHost(Protocol):
    """What a session asks of the registry that opened it."""

    def usable(self, device: str) -> bool:
        """False once ``device`` is unprotected, or the process's sessions are closed."""

    def reason(self, device: str) -> str | None:
        """Why ``device``'s session can no longer be used (None while it can)."""

    def failed(self, device: str, why: str, cause: BaseException) -> None:
        """A round trip failed: mark ``device`` unprotected (raises ``BrokerRequired`` under
        ``KVCACHED_REQUIRE=1``)."""

    def before_settling(self) -> None:
        """Run what must happen before a warm-up's base is pinned (:meth:`DeviceSession.settle_warm_up`)."""


class DeviceSession:
    """One device's session and its book; ``lock`` (the registry's) guards the book."""

    def __init__(self, client: BrokerClient, identity: WorkerIdentity, host: SessionHost,
                 lock: threading.RLock) -> None:
        self.client = client
        self.identity = identity
        self.book = ReportBook()
        self.lock = lock
        self._host = host
        self._device = str(identity.device)

    @property
    def usable(self) -> bool:
        """False once the device turned unprotected (or the process's sessions closed)."""
        return self._host.usable(self._device)

    def unusable_reason(self) -> str | None:
        """Why this session can no longer be used (None while it can)."""
        return self._host.reason(self._device)

    def guard(self, action: str, call: Callable[[], T]) -> T | None:
        """Run ``call`` (a broker round trip: the client checks its answer's shape); None if the
        device is, or just turned, unprotected.  A broker failure turns it unprotected: an error
        the client raises for the broker (``BrokerError``: gone, slow, refusing, untrusted), an
        answer of another shape (``ProtocolError``), or an endpoint the client cannot check now
        (``EndpointError``, ``OSError``: a user lookup or a stat that failed at a re-open).
        ``BudgetExceeded`` and an eviction propagate, and so does any other exception: it is a bug
        of the caller's, not a broker failure."""
        if not self.usable:
            return None
        cause: Exception
        try:
            return call()
        except BudgetExceeded:
            raise
        except BrokerError as exc:
            if exc.fatal:
                raise
            why, cause = str(exc), exc
        except ProtocolError as exc:  # an answer of another shape than its request calls for
            why, cause = str(exc), exc
        except (EndpointError, OSError) as exc:  # the endpoint cannot be checked now (a user lookup, a stat)
            why, cause = f"{type(exc).__name__}: {exc}", exc
        self._host.failed(self._device, f"{action}: {why}", cause)
        return None

    # -------------------------------------------------------------- the book
    def report(self, reporter: str, pools: dict[str, int], usage: dict[str, int] | None = None, *,
               holds: dict[str, int] | None = None, allocated: bool = True,
               phase: str | None = None) -> dict[str, int] | None:
        """Set ``reporter``'s pools (replacing what it reported before) and send the whole book.

        ``holds`` changes holds in the same broker request (name -> bytes, 0 drops one; names
        left out are kept), so a hold turns into the pools it was for in one call.  ``usage`` is
        the reporter's informational breakdown (overlapping views, never charged).
        ``allocated`` says whether the pools are already allocated (the device measures them):
        if the base is not pinned yet it is pinned in the same request (it then excludes them),
        or, for pools reported ahead of their allocation, in a request of its own first.

        Raises ``BudgetExceeded`` (naming the pool) if the broker has no room; the book is then
        left as it was.  None when the device is unprotected.
        """
        return self._report(reporter, pools, usage, holds, allocated, phase)

    def report_built(self, reporter: str, pools: dict[str, int], *, last: bool = False,
                     usage: dict[str, int] | None = None, allocated: bool = True,
                     phase: str | None = None) -> dict[str, int] | None:
        """:meth:`report` for a pool the KV sizing hold was for: the holds shrink by its growth,
        what ``pools`` add to what ``reporter`` has in the book, in the same request (rule B6 of
        :mod:`.report_book`; with ``last``, the KV hold drops), read from the book under the same
        lock as the request."""
        with self.lock:
            growth = sum(pools.values()) - self.book.booked_bytes(reporter)
            return self._report(reporter, pools, usage, self.book.holds_after_pool(growth, last), allocated, phase)

    def _report(self, reporter: str, pools: dict[str, int], usage: dict[str, int] | None,
                holds: dict[str, int] | None, allocated: bool, phase: str | None) -> dict[str, int] | None:
        if not self.usable:
            return None
        with self.lock:
            if self.book.base_bytes is None and not allocated:
                if self._send(self.book.pin(), "pin runtime_base") is None:
                    return None
            return self._send(self.book.report(reporter, pools, usage, holds, phase), f"report {reporter}")

    def hold_what_fits(self, holds: dict[str, int], min_holds: dict[str, int] | None,
                       phase: str) -> ReserveResult | None:
        """Change holds (name -> bytes, 0 drops one) in one request that pins the base if it is not
        pinned yet, letting the one hold ``min_holds`` names shrink to what fits down to its least;
        returns the broker's whole answer (``holds`` granted, ``grantable_bytes``, ``ever_bytes``;
        checked by the client, so every field is there).

        ``BudgetExceeded`` when even the least does not fit (nothing changes); None when unprotected.
        """
        if not self.usable:
            return None
        with self.lock:
            plan = self.book.hold_what_fits(holds, min_holds, phase)
            if self._send(plan, "hold what fits", holds_granted=True) is None:
                return None
            return self.client.last_reserve

    def settle_warm_up(self, kept_slack_bytes: int | None = None) -> int | None:
        """The runtime's warm-up is over: what it allocated of its slack is in the device's
        measurement now.  Pin the base again there (one request), then turn the slack hold into
        the resident ``runtime_slack`` pool for the part the base did not grow by (or
        ``kept_slack_bytes``), in a second: the charge never grows, and the runtime keeps the room
        its activations need in later batches.  Returns the slack kept; None when unprotected.

        Its host's steps run first (:meth:`SessionHost.before_settling`: kvcached mode's governors
        report every page they mapped), so the base counts none of the pools' pages."""
        if not self.usable:
            return None
        self._host.before_settling()
        with self.lock:
            book = self.book
            slack_bytes = book.held_bytes(SLACK_HOLD)
            base_before = book.base_bytes or 0
            if self._send(book.pin(), "re-pin runtime_base after warm-up") is None:
                return None
            if not slack_bytes and kept_slack_bytes is None:  # settled before: the re-pin kept its slack
                return book.booked_bytes(SLACK_POOL)
            grown = max(0, (book.base_bytes or 0) - base_before)
            kept = max(0, slack_bytes - grown) if kept_slack_bytes is None else min(kept_slack_bytes, slack_bytes)
            if self._send(book.keep_slack(kept, SLACK_HOLD), "slack after warm-up") is None:
                return None
            identity = self.identity
            log.info("event=warm_up_settled runtime=%s device=%s rank=%d runtime_base=%d slack_allocated=%d "
                     "slack_kept=%d", identity.runtime, identity.device, identity.tp_rank, book.base_bytes or 0,
                     slack_bytes - kept, kept)
            return kept

    def hold(self, name: str, size_bytes: int) -> dict[str, int] | None:
        """Hold ``size_bytes`` under ``name`` (0 drops it): memory promised, not allocated yet.

        The first request of a session that holds anything pins the runtime base with it.
        ``BudgetExceeded`` if the broker has no room (nothing changes); None when unprotected.
        """
        if not self.usable:
            return None
        with self.lock:
            plan = self.book.hold(name, size_bytes)
            if plan is None:
                return self.client.pools
            return self._send(plan, f"hold {name}")

    def shrink_kv_hold(self, kv_bytes: int) -> None:
        """Keep only ``kv_bytes`` of the KV sizing hold (another TP rank got less: every rank
        builds the agreed size).  A decrease: never refused."""
        with self.lock:
            if self.book.held_bytes(KV_SIZING_HOLD) > kv_bytes:
                self.hold(KV_SIZING_HOLD, kv_bytes)

    def pin_base(self) -> int | None:
        """Pin what this process uses now as its runtime base, unless already pinned; the bytes.

        For a worker about to take elastic pages: a grant is reported before its pages are
        mapped, so without a base the process's weights would cover it.  None when unprotected.
        """
        if not self.usable:
            return None
        with self.lock:
            if self.book.base_bytes is None and self._send(self.book.pin(), "pin runtime_base") is None:
                return None
            return self.book.base_bytes

    def suspend(self, names: list[str], *, base_bytes: int | None = None) -> int:
        """Stop charging ``names`` (their memory was handed back) and, with ``base_bytes``, lower the
        runtime base to it, in one request; returns the bytes no longer charged."""
        with self.lock:
            return self._send_counted(self.book.suspend(names, base_bytes), "suspend")

    def resume(self, names: list[str] | None = None, *, base_bytes: int | None = None) -> int:
        """Charge the suspended ``names`` (all, if None) again and, with ``base_bytes``, raise the
        runtime base to it, in one request; returns the bytes charged again.

        This is an admission, made before the runtime maps the memory again: ``BudgetExceeded``
        if the broker has no room (nothing changes).  0 when nothing comes back or the device is
        unprotected.
        """
        with self.lock:
            return self._send_counted(self.book.resume(names, base_bytes), "resume")

    def repin_base(self, suspend: list[str] | tuple[str, ...] = ()) -> int | None:
        """Pin the runtime base again at what the device measures the process using now, and stop
        charging ``suspend`` in the same request; returns the new base.

        Around a release of memory (:mod:`.handback`): before it, so that the base covers all the
        process uses; after it, so that what it handed back is no longer charged.  None when the
        device is unprotected.
        """
        if not self.usable:
            return None
        with self.lock:
            if self._send(self.book.repin(suspend), "re-pin runtime_base") is None:
                return None
            return self.book.base_bytes

    def forget(self, reporter: str) -> None:
        """Drop ``reporter``'s pools (its pool was freed)."""
        with self.lock:
            if reporter in self.book.book:
                self.report(reporter, {})
                self.book.drop(reporter)

    # -------------------------------------------------------------- reading the book
    def held_bytes(self, name: str | None = None) -> int:
        """Bytes the book holds under ``name`` (every hold, if None)."""
        with self.lock:
            return self.book.held_bytes(name)

    def base_bytes(self) -> int | None:
        """The runtime base the broker pinned (None: not pinned yet)."""
        with self.lock:
            return self.book.base_bytes

    def booked_bytes(self, reporter: str) -> int:
        """The bytes ``reporter`` has in the book (charged or suspended)."""
        with self.lock:
            return self.book.booked_bytes(reporter)

    def suspended(self) -> list[str]:
        with self.lock:
            return sorted(self.book.suspended)

    # -------------------------------------------------------------- elastic pages
    def report_mapped(self, holder: str, session_pages: int) -> None:
        """``holder`` (a kvcached pool) has ``session_pages`` of the session's pages mapped now; the
        session tells its broker the sum over its holders when it changes (``BrokerClient.mapped``),
        so a granted page is charged as promised memory until it is mapped.  Never more than the
        broker charges the session (a re-assertion that came back short books the rest uncharged).
        A broker failure turns the device unprotected, as any."""
        if not self.usable:
            return
        client = self.client
        with self.lock:
            total = max(0, min(self.book.count_mapped(holder, session_pages), _charged_pages(client)))
            if total != client.mapped_pages:
                self.guard("report mapped pages", lambda: client.mapped(total))

    def release_mapped(self, holder: str, session_pages: int, mapped_session_pages: int) -> bool:
        """``holder`` gives ``session_pages`` back and keeps ``mapped_session_pages`` mapped: one
        release that says the session's new mapped total (the broker reads the device at once, so
        the memory is free for others in the same round).  False if the device is unprotected."""
        if not self.usable:
            return False
        client = self.client
        with self.lock:
            mapped = self.book.count_mapped(holder, mapped_session_pages)
            total = max(0, min(mapped, _charged_pages(client) - session_pages)) if client.report_mapping else None
        return self.guard("release pages", lambda: _release(client, session_pages, total)) is not None

    def report_idle(self, holder: str, session_pages: int) -> None:
        """``holder`` holds ``session_pages`` of the session's pages idle (free, or unused cache): the
        session says the sum over its holders with its next request (``BrokerClient.report_idle``; no
        round trip), and the broker asks sessions with idle pages first when memory must come back."""
        if not self.usable:
            return
        with self.lock:
            total = self.book.count_idle(holder, session_pages)
        self.client.report_idle(total)

    # -------------------------------------------------------------- sending
    def _send_counted(self, planned: tuple[Plan, int] | None, action: str) -> int:
        """Send ``planned`` (a plan and the bytes it moves, or None: nothing to send); those bytes
        once the broker answered, else 0."""
        if planned is None:
            return 0
        plan, moved_bytes = planned
        return moved_bytes if self._send(plan, action) is not None else 0

    def _send(self, plan: Plan, action: str, *, holds_granted: bool = False) -> dict[str, int] | None:
        """One reserve request for the whole book; once answered, the book is the plan's (with the
        holds the broker granted, for ``holds_granted``)."""
        request = self.book.request(plan)
        answer = self.guard(action, lambda: _reserve(self.client, request, plan))
        if answer is None:
            return None
        charged, base_bytes = answer
        granted = dict(self.client.holds) if holds_granted else None
        if self.book.took(plan, request, charged, base_bytes, holds=granted):
            identity = self.identity
            log.info("event=runtime_base_pinned runtime=%s device=%s rank=%d runtime_base=%d",
                     identity.runtime, identity.device, identity.tp_rank, self.book.base_bytes)
        return charged


def _reserve(client: BrokerClient, request: Request, plan: Plan) -> tuple[dict[str, int], int]:
    """The reserve request and the runtime base its answer gives (sent and read inside
    :meth:`DeviceSession.guard`).

    Usage views are never charged, so a view the broker finds larger than what the session
    holds (its charge not caught up yet: a short broker restart, a grant in flight) does not
    cost the worker its protection: the request goes again without views, and the views go
    with a later report."""
    holds = dict(plan.holds)
    try:
        charged = client.reserve(request.pools, usage=request.usage, holds=holds, measured_base=plan.pin_base,
                                 min_holds=plan.min_holds, phase=plan.phase)
    except BadRequest as exc:
        if not request.usage or "view" not in exc.details:
            raise
        announce.once("views_dropped", logging.INFO, "usage_views_dropped", view=exc.details.get("view"),
                      detail="larger than the session's charge for now; reported without views")
        charged = client.reserve(request.pools, usage={}, holds=holds, measured_base=plan.pin_base,
                                 min_holds=plan.min_holds, phase=plan.phase)
    return charged, int(charged.get(RUNTIME_BASE_POOL, 0))


def _release(client: BrokerClient, session_pages: int, mapped_pages: int | None) -> bool:
    client.release(session_pages, mapped_pages=mapped_pages)
    return True


def _charged_pages(client: BrokerClient) -> int:
    """The session's pages the broker charges: held and in reserve, less those a short
    re-assertion booked uncharged."""
    return client.held_pages + client.reserve_pages - client.uncharged_pages
