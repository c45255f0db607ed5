"""This worker process's session with its GPU's broker, shared by every adapter patch in it.

A serving worker has several things to report (DeepSeek-V4 side pools, a static KV pool,
elastic pages) but one session per device.  The book follows docs/accounting.md:

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

:func:`report` sets one reporter's pools and changes holds in the same broker request, so a
hold turns into the pools it was for in one call.  A reporter can be *suspended* (its memory
was handed back: SGLang's release of memory occupation, vLLM's sleep): its pools stay in the
book but are not charged until it is resumed, through admission.  What else the runtime hands
back (weights, CUDA graphs) is inside the runtime base: :func:`repin_base` pins it again at
what the device measures, and :func:`resume` can raise it back before the runtime maps the
memory again (:mod:`.handback`).

Every operation here runs through the device's session (:mod:`.sessions`) and its fail-safe
:func:`.sessions.guard`: None (or False) when the worker runs unprotected.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..client import BadRequest, BrokerClient
from . import announce, process_state
from .report_book import RUNTIME_BASE_POOL, SLACK_POOL, Plan, Request
from .sessions import DeviceSession, guard, registry, session
from .worker_identity import WorkerIdentity

log = announce.logger("kvcached_broker.adapters")

#: The hold KV sizing takes (memory promised between sizing and allocating the KV cache).
KV_SIZING_HOLD = "kv_sizing_hold"
#: The hold for what a runtime keeps beside its KV cache (activations, CUDA graphs, request
#: tables), promised at sizing until its warm-up has allocated it (:mod:`.sizing`).
SLACK_HOLD = "runtime_slack_hold"


def before_settling_warm_up(step: Callable[[], None]) -> None:
    """Have :func:`settle_warm_up` run ``step`` before it pins the base at what the device
    measures (once however often given): kvcached mode's governors report every page they
    mapped first (:mod:`.kvcached.runner`), so the base counts none of them."""
    state = registry()
    with state.hooks_lock:
        if step not in state.before_settling:
            state.before_settling.append(step)


# ------------------------------------------------------------------------------ the book
def report(
    identity: WorkerIdentity,
    reporter: str,
    pools: dict[str, int],
    usage: dict[str, int] | None = None,
    *,
    holds: dict[str, int] | None = None,
    allocated: bool = True,
    phase: str | None = None,
) -> dict[str, int] | None:
    """Set ``reporter``'s pools (replacing what it reported before) and send the whole book.

    ``holds`` changes holds in the same broker request (name -> bytes, 0 drops one; names
    left out are kept), so a hold turns into the pools it was for in one call.  ``usage`` is
    the reporter's informational breakdown (overlapping views, never charged).
    ``allocated`` says whether the pools are already allocated (the device measures them):
    if the base is not pinned yet it is pinned in the same request (it then excludes them),
    or, for pools reported ahead of their allocation, in a request of its own first.

    Raises ``BudgetExceeded`` (naming the pool) if the broker has no room; the book is then
    left as it was.  None when the worker runs unprotected (see :func:`.sessions.guard`).
    """
    state = registry()
    if session(identity) is None:
        return None
    with state.lock:
        entry = state.by_device[str(identity.device)]
        if entry.book.base_bytes is None and not allocated:
            if _send(identity, entry, entry.book.pin(), "pin runtime_base") is None:
                return None
        return _send(identity, entry, entry.book.report(reporter, pools, usage, holds, phase), f"report {reporter}")


def hold_what_fits(identity: WorkerIdentity, holds: dict[str, int], min_holds: dict[str, int] | None,
                   phase: str) -> dict[str, Any] | None:
    """Change holds (name -> bytes, 0 drops one) in one request that pins the base if it is not
    pinned yet, letting the one hold ``min_holds`` names shrink to what fits down to its least;
    returns the broker's whole answer (``holds`` granted, ``grantable_bytes``, ``ever_bytes``).

    ``BudgetExceeded`` when even the least does not fit (nothing changes); None when unprotected.
    """
    state = registry()
    if session(identity) is None:
        return None
    with state.lock:
        entry = state.by_device[str(identity.device)]
        plan = entry.book.hold_what_fits(holds, min_holds, phase)
        if _send(identity, entry, plan, "hold what fits", holds_granted=True) is None:
            return None
        return entry.client.last_reserve


def settle_warm_up(identity: WorkerIdentity, kept_slack_bytes: int | None = None) -> int | None:
    """The runtime's warm-up is over: what it allocated of its slack is in the device's
    measurement now.  Pin the base again there (one request), then turn the slack hold into
    the resident ``runtime_slack`` pool for the part the base did not grow by (or
    ``kept_slack_bytes``), in a second: the charge never grows, and the runtime keeps the room
    its activations need in later batches.  Returns the slack kept; None when unprotected."""
    if session(identity) is None:
        return None
    state = registry()
    with state.hooks_lock:
        first = list(state.before_settling)
    for step in first:
        step()
    with state.lock:
        entry = state.by_device[str(identity.device)]
        book = entry.book
        slack_bytes = book.held_bytes(SLACK_HOLD)
        base_before = book.base_bytes or 0
        if _send(identity, entry, book.pin(), "re-pin runtime_base after warm-up") is None:
            return None
        if not slack_bytes and kept_slack_bytes is None:  # settled before: the re-pin kept its slack
            return book.booked_bytes(SLACK_POOL)
        grown = max(0, (book.base_bytes or 0) - base_before)
        kept = max(0, slack_bytes - grown) if kept_slack_bytes is None else min(kept_slack_bytes, slack_bytes)
        if _send(identity, entry, book.keep_slack(kept, SLACK_HOLD), "slack after warm-up") is None:
            return None
        log.info("event=warm_up_settled runtime=%s device=%s rank=%d runtime_base=%d slack_allocated=%d slack_kept=%d",
                 identity.runtime, identity.device, identity.tp_rank, book.base_bytes or 0, slack_bytes - kept, kept)
        return kept


def hold(identity: WorkerIdentity, name: str, size_bytes: int) -> dict[str, int] | None:
    """Hold ``size_bytes`` under ``name`` (0 drops it): memory promised, not allocated yet.

    The first request of a session that holds anything pins the runtime base with it.
    ``BudgetExceeded`` if the broker has no room (nothing changes); None when unprotected.
    """
    state = registry()
    if session(identity) is None:
        return None
    with state.lock:
        entry = state.by_device[str(identity.device)]
        plan = entry.book.hold(name, size_bytes)
        if plan is None:
            return entry.client.pools
        return _send(identity, entry, plan, f"hold {name}")


def pin_base(identity: WorkerIdentity) -> int | None:
    """Pin what this process uses now as its runtime base, unless already pinned; the bytes.

    For a worker about to take elastic pages: a grant is reported before its pages are
    mapped, so without a base the process's weights would cover it.  None when unprotected.
    """
    state = registry()
    if session(identity) is None:
        return None
    with state.lock:
        entry = state.by_device[str(identity.device)]
        if entry.book.base_bytes is None and _send(identity, entry, entry.book.pin(), "pin runtime_base") is None:
            return None
        return entry.book.base_bytes


def _send(identity: WorkerIdentity, entry: DeviceSession, plan: Plan, action: str, *,
          holds_granted: bool = False) -> dict[str, int] | None:
    """One reserve request for the whole book; once answered, the book is the plan's (with the
    holds the broker granted, for ``holds_granted``)."""
    request = entry.book.request(plan)
    answer = guard(identity, action, lambda: _reserve(entry.client, request, plan))
    if answer is None:
        return None
    charged, base_bytes = answer
    granted = dict(entry.client.holds) if holds_granted else None
    if entry.book.took(plan, request, charged, base_bytes, holds=granted):
        log.info("event=runtime_base_pinned runtime=%s device=%s rank=%d runtime_base=%d",
                 identity.runtime, identity.device, identity.tp_rank, entry.book.base_bytes)
    return charged


def _reserve(client: BrokerClient, request: Request, plan: Plan) -> tuple[dict[str, int], int]:
    """The reserve request and the runtime base its answer gives (sent and read inside :func:`.sessions.guard`).

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


def held_bytes(identity: WorkerIdentity, name: str | None = None) -> int:
    """Bytes this device's book holds under ``name`` (every hold, if None)."""
    state = registry()
    with state.lock:
        entry = state.by_device.get(str(identity.device))
        if entry is None:
            return 0
        return entry.book.held_bytes(name)


def base_bytes(identity: WorkerIdentity) -> int | None:
    """The runtime base the broker pinned for this device's session (None: not pinned yet)."""
    state = registry()
    with state.lock:
        entry = state.by_device.get(str(identity.device))
        return entry.book.base_bytes if entry is not None else None


def suspend(identity: WorkerIdentity, names: list[str], *, base_bytes: int | None = None) -> int:
    """Stop charging ``names`` (their memory was handed back) and, with ``base_bytes``, lower the
    runtime base to it, in one request; returns the bytes no longer charged."""
    state = registry()
    with state.lock:
        entry = state.by_device.get(str(identity.device))
        if entry is None:
            return 0
        planned = entry.book.suspend(names, base_bytes)
        if planned is None:
            return 0
        plan, freed = planned
        return freed if _send(identity, entry, plan, "suspend") is not None else 0


def resume(identity: WorkerIdentity, names: list[str] | None = None, *, base_bytes: int | None = None) -> int:
    """Charge the suspended ``names`` (all, if None) again and, with ``base_bytes``, raise the
    runtime base to it, in one request; returns the bytes charged again.

    This is an admission, made before the runtime maps the memory again: ``BudgetExceeded``
    if the broker has no room (nothing changes).  0 when nothing comes back or the worker
    runs unprotected.
    """
    state = registry()
    with state.lock:
        entry = state.by_device.get(str(identity.device))
        if entry is None:
            return 0
        planned = entry.book.resume(names, base_bytes)
        if planned is None:
            return 0
        plan, charged = planned
        return charged if _send(identity, entry, plan, "resume") is not None else 0


def repin_base(identity: WorkerIdentity, suspend: list[str] | tuple[str, ...] = ()) -> int | None:
    """Pin the runtime base again at what the device measures the process using now, and stop
    charging ``suspend`` in the same request; returns the new base.

    Around a release of memory (:mod:`.handback`): before it, so that the base covers all the
    process uses; after it, so that what it handed back is no longer charged.  None when the
    worker runs unprotected.
    """
    state = registry()
    if session(identity) is None:
        return None
    with state.lock:
        entry = state.by_device[str(identity.device)]
        if _send(identity, entry, entry.book.repin(suspend), "re-pin runtime_base") is None:
            return None
        return entry.book.base_bytes


def report_mapped(identity: WorkerIdentity, holder: str, session_pages: int) -> None:
    """``holder`` (a kvcached pool) has ``session_pages`` of the session's pages mapped now; the
    session tells its broker the sum over its holders when it changes (``BrokerClient.mapped``),
    so a granted page is charged as promised memory until it is mapped.  Never more than the
    broker charges the session (a re-assertion that came back short books the rest uncharged).
    A broker failure turns the worker unprotected, as any."""
    state = registry()
    if session(identity) is None:
        return
    with state.lock:
        entry = state.by_device[str(identity.device)]
        client = entry.client
        total = max(0, min(entry.book.count_mapped(holder, session_pages), _charged_pages(client)))
        if total != client.mapped_pages:
            guard(identity, "report mapped pages", lambda: client.mapped(total))


def release_mapped(identity: WorkerIdentity, holder: str, session_pages: int, mapped_session_pages: int) -> bool:
    """``holder`` gives ``session_pages`` back and keeps ``mapped_session_pages`` mapped: one
    release that says the session's new mapped total (the broker reads the device at once, so
    the memory is free for others in the same round).  False if the worker is unprotected."""
    state = registry()
    if session(identity) is None:
        return False
    with state.lock:
        entry = state.by_device[str(identity.device)]
        client = entry.client
        mapped = entry.book.count_mapped(holder, mapped_session_pages)
        total = max(0, min(mapped, _charged_pages(client) - session_pages)) if client.report_mapping else None
    return guard(identity, "release pages", lambda: _release(client, session_pages, total)) is not None


def _release(client: BrokerClient, session_pages: int, mapped_pages: int | None) -> bool:
    client.release(session_pages, mapped_pages=mapped_pages)
    return True


def report_idle(identity: WorkerIdentity, holder: str, session_pages: int) -> None:
    """``holder`` holds ``session_pages`` of the session's pages idle (free, or unused cache): the
    session says the sum over its holders with its next request (``BrokerClient.report_idle``; no
    round trip), and the broker asks sessions with idle pages first when memory must come back."""
    state = registry()
    client = session(identity)
    if client is None:
        return
    with state.lock:
        total = state.by_device[str(identity.device)].book.count_idle(holder, session_pages)
    client.report_idle(total)


def _charged_pages(client: BrokerClient) -> int:
    """The session's pages the broker charges: held and in reserve, less those a short
    re-assertion booked uncharged."""
    return client.held_pages + client.reserve_pages - client.uncharged_pages


def booked_bytes(identity: WorkerIdentity, reporter: str) -> int:
    """The bytes ``reporter`` has in this device's book (charged or suspended)."""
    state = registry()
    with state.lock:
        entry = state.by_device.get(str(identity.device))
        return entry.book.booked_bytes(reporter) if entry is not None else 0


def suspended(identity: WorkerIdentity) -> list[str]:
    state = registry()
    with state.lock:
        entry = state.by_device.get(str(identity.device))
        return sorted(entry.book.suspended) if entry is not None else []


def forget(identity: WorkerIdentity, reporter: str) -> None:
    """Drop ``reporter``'s pools (its pool was freed)."""
    state = registry()
    key = str(identity.device)
    with state.lock:
        entry = state.by_device.get(key)
        if entry is not None and reporter in entry.book.book:
            report(identity, reporter, {})
            entry.book.drop(reporter)


def reset() -> None:
    """Close every session and forget everything this process's adapters keep but the hook's
    wiring (:func:`.process_state.reset`): unprotected devices, what was handed back, what was
    said, the default instance name (tests; a worker shutting down)."""
    process_state.reset()
