"""Reservations of SGLang pool objects, one reporter per live pool, plus the KV sizing hold.

* Each runtime pool object (a DeepSeek-V4 pool, a static KV pool) reports under its own
  reporter key in the worker's session (its book, ``adapters/report_book.py``, merges them into
  the one reservation map).  Measuring the same object again replaces its entry; a rebuilt pool is a
  new object with a new entry, and a pool that is garbage collected is forgotten.  A target
  and a draft worker in one process therefore each count their own pools.
* Each reporter records the tensor storages it charged, so that a pool which is a *view* of
  a buffer another live reporter already charged (0.5.23's fused draft pool over the
  target's unified buffer) is not charged for it again (:func:`charged_storages`).
* The *sizing hold* (``kv_sizing_hold``) is a broker **hold**, not a pool: memory promised
  between deciding the KV budget and building the pools, charged on top of what the device
  measures the process using, taken with the runtime base pinned (docs/accounting.md).
  Every pool report shrinks the hold by the pool's growth *in the same broker request*, so
  the switch from hold to pools never needs fresh room and the charge never dips; the last
  report of a start-up drops what is left of it in that request too.

All sizes are bytes.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable

from ...client import BudgetExceeded
from ...client.units import format_bytes
from .. import announce, background, process_state, sessions, worker_identity
from ..report_book import KV_SIZING_HOLD
from . import kv_budget

log = announce.logger("kvcached_broker.adapters.sglang")


class _Reporting:
    """This process's pool reporters: each live pool's reporter key (by the pool's ``id``), the
    storage keys each key charged, the identity it reported under, and per device the identity
    that took the sizing hold (what a key reported is its session's book's,
    :meth:`~..device_session.DeviceSession.booked_bytes`).  ``lock`` guards every field; a key in
    ``storages`` or ``identity`` is one :func:`reporter_key` gave out."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.keys: dict[int, str] = {}
        self.storages: dict[str, set] = {}  # reporter key -> storage keys it charged
        self.identity: dict[str, worker_identity.WorkerIdentity] = {}
        self.holders: dict[str, worker_identity.WorkerIdentity] = {}  # device -> the identity that took the sizing hold


class _KeyCounter:
    """Numbers reporter keys once for the life of the process, across resets: a pool from before
    a reset is finalised later under its old key (:func:`_collected`), which must never name a
    pool reported after the reset."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.counter = itertools.count(1)  # next() is atomic under the GIL


def reporter_key(pool: Any, kind: str) -> str:
    """The reporter key of ``pool`` (stable while it lives; forgotten when it is collected)."""
    state = process_state.part(_Reporting)
    with state.lock:
        key = state.keys.get(id(pool))
        if key is None:
            key = f"sglang:{kind}#{next(process_state.part(_KeyCounter).counter)}"
            state.keys[id(pool)] = key
            _forget_when_collected(pool, key)
        return key


def _forget_when_collected(pool: Any, key: str) -> None:
    pool_id = id(pool)
    try:
        weakref.finalize(pool, _collected, pool_id, key)
    except TypeError:  # not weak-referenceable: kept until reset()
        pass


def _collected(pool_id: int, key: str) -> None:
    """Finaliser of a pool: forget its reservations, on the adapter's background thread.

    A finaliser runs wherever garbage collection happens, possibly in the middle of a
    request on this very session, so it never talks to the broker itself.
    """
    state = process_state.part(_Reporting)
    with state.lock:
        state.keys.pop(pool_id, None)
        state.storages.pop(key, None)
        identity = state.identity.pop(key, None)
    if identity is not None:
        background.submit(f"forget {key}", lambda: _forget(identity, key))


def _forget(identity: worker_identity.WorkerIdentity, key: str) -> None:
    session = sessions.existing(identity)
    if session is not None:
        session.forget(key)


def report_pool(identity: worker_identity.WorkerIdentity, pool: Any, kind: str, pools: dict[str, int], what: str,
                *, last: bool = False, storages: set | None = None) -> bool:
    """Reserve ``pools`` (name -> bytes) for ``pool``; False if the worker runs unprotected.

    One broker request: the pool's pools, and the sizing hold shrunk by their growth (or,
    with ``last``, dropped).  ``storages`` are the storage keys measured for them (recorded,
    so no other reporter charges them again).  Raises :class:`~.kv_budget.BrokerBudgetError`
    (naming the broker, the budget and the other instances) if the broker has no room, which
    stops the worker at startup.  Any other broker failure leaves the worker unprotected.
    """
    session = sessions.session(identity)
    if session is None:
        return False
    key = reporter_key(pool, kind)
    total = sum(pools.values())
    state = process_state.part(_Reporting)
    with state.lock:
        state.identity[key] = identity
    try:
        if session.report_built(key, pools, last=last, phase="warming" if last else None) is None:
            return False
    except BudgetExceeded as exc:
        growth = total - session.booked_bytes(key)  # a refusal left the book as it was
        raise kv_budget.explain_refusal(identity, session.client, max(0, growth), what, exc) from exc
    with state.lock:
        if storages is not None:
            state.storages[key] = set(storages)
    log.info(
        "event=sglang_pool_reported reporter=%s device=%s rank=%d total=%s pools=%s hold_left=%s",
        key, identity.device, identity.tp_rank, format_bytes(total),
        {name: size for name, size in sorted(pools.items())}, format_bytes(held_bytes(identity)),
    )
    return True


def hold(identity: worker_identity.WorkerIdentity, size_bytes: int) -> bool:
    """Hold ``size_bytes`` for the KV cache (replacing any earlier hold on this device).

    The base is pinned with the first hold.  False if the worker runs unprotected;
    ``BudgetExceeded`` if the broker has no room.
    """
    session = sessions.session(identity)
    if session is None or session.hold(KV_SIZING_HOLD, size_bytes) is None:
        return False
    sized(identity)
    return True


def sized(identity: worker_identity.WorkerIdentity) -> None:
    """``identity``'s device sized a start-up: its holds end with the start-up (:func:`end_start_ups`)."""
    state = process_state.part(_Reporting)
    with state.lock:
        state.holders[str(identity.device)] = identity


def release_hold(identity: worker_identity.WorkerIdentity) -> None:
    """Drop whatever is left of the sizing hold (every pool of the start-up is built)."""
    session = sessions.existing(identity)
    if session is not None and session.held_bytes(KV_SIZING_HOLD):
        session.hold(KV_SIZING_HOLD, 0)


def end_start_ups() -> None:
    """A scheduler's start-up ended (its pools built, its CUDA graphs captured): on every device
    of this process, drop what is left of the KV hold and settle the warm-up
    (:meth:`~..device_session.DeviceSession.settle_warm_up`: the base pinned where the device measures it, the slack
    the warm-up did not allocate kept as ``runtime_slack``)."""
    state = process_state.part(_Reporting)
    with state.lock:
        holders = list(state.holders.values())
        state.holders.clear()
    for identity in holders:
        release_hold(identity)
        session = sessions.session(identity)
        if session is not None:
            session.settle_warm_up()


def report_measured(identity: worker_identity.WorkerIdentity, pool: Any, kind: str,
                    measure: Callable[[set], dict[str, int] | None], what: str, *,
                    last: bool = False) -> dict[str, int] | None:
    """Measure ``pool`` and :func:`report_pool` what it holds: ``measure(seen)`` returns its pools
    (None: nothing to report), skipping the storages in ``seen`` (charged by the device's other
    reporters) and adding those it measured, which are recorded as this pool's.  Returns the
    pools reported; None if the worker runs unprotected or there was nothing to report."""
    seen = charged_storages(identity, pool)
    already = set(seen)
    pools = measure(seen)
    if pools is None or not report_pool(identity, pool, kind, pools, what, last=last, storages=seen - already):
        return None
    return pools


def charged_storages(identity: worker_identity.WorkerIdentity, pool: Any) -> set:
    """Storage keys charged on ``identity``'s device by reporters other than ``pool``'s own."""
    state = process_state.part(_Reporting)
    with state.lock:
        own = state.keys.get(id(pool))
        return set().union(*(keys for key, keys in state.storages.items()
                             if key != own and _same_device(state.identity.get(key), identity)))


def _same_device(other: worker_identity.WorkerIdentity | None, identity: worker_identity.WorkerIdentity) -> bool:
    return other is not None and str(other.device) == str(identity.device)


def kv_reporters_by_device() -> list[tuple[worker_identity.WorkerIdentity, list[str]]]:
    """``(identity, reporter keys)`` per device: every KV pool this module reported."""
    state = process_state.part(_Reporting)
    with state.lock:
        by_device: dict[str, tuple[worker_identity.WorkerIdentity, list[str]]] = {}
        for key, identity in state.identity.items():
            by_device.setdefault(str(identity.device), (identity, []))[1].append(key)
    return [(identity, sorted(keys)) for identity, keys in by_device.values()]


def held_bytes(identity: worker_identity.WorkerIdentity) -> int:
    session = sessions.existing(identity)
    return session.held_bytes(KV_SIZING_HOLD) if session is not None else 0


def reset() -> None:
    """Forget every reporter (tests; a worker shutting down).  The session is not closed."""
    process_state.forget(_Reporting)
