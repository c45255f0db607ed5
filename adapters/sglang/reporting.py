"""Reservations of SGLang pool objects, one reporter per live pool, plus the KV sizing hold.

* Each runtime pool object (a DeepSeek-V4 pool, a static KV pool) reports under its own
  reporter key in the worker's session (``adapters/worker.py`` merges them into the one
  reservation map).  Measuring the same object again replaces its entry; a rebuilt pool is a
  new object with a new entry, and a pool that is garbage collected is forgotten.  A target
  and a draft worker in one process therefore each count their own pools.
* The *sizing hold* is what KV sizing reserved (``kv_sizing_hold``) between deciding the KV
  budget and building the pools, so that no co-located instance can size itself from the
  same free memory meanwhile.  Every pool report first shrinks the hold by its growth (a
  decrease always fits), then adds its own pools, so the switch never needs extra room.

All sizes are bytes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from typing import Any

from ...client import BudgetExceeded
from ...client.units import format_bytes
from .. import background, worker
from . import budget, session

log = logging.getLogger("kvcached_broker.adapters.sglang")

HOLD_REPORTER = "sglang:kv_sizing_hold"
HOLD_POOL = "kv_sizing_hold"

_lock = threading.RLock()
_counter = itertools.count(1)
_keys: dict[int, str] = {}
_totals: dict[str, int] = {}
_holds: dict[str, int] = {}
_identity: dict[str, worker.WorkerIdentity] = {}


def reporter_key(pool: Any, kind: str) -> str:
    """The reporter key of ``pool`` (stable while it lives; forgotten when it is collected)."""
    with _lock:
        key = _keys.get(id(pool))
        if key is None:
            key = f"sglang:{kind}#{next(_counter)}"
            _keys[id(pool)] = key
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
    with _lock:
        _keys.pop(pool_id, None)
        _totals.pop(key, None)
        identity = _identity.pop(key, None)
    if identity is not None:
        background.submit(f"forget {key}", lambda: worker.forget(identity, key))


def report_pool(identity: worker.WorkerIdentity, pool: Any, kind: str, pools: dict[str, int], what: str) -> bool:
    """Reserve ``pools`` (name -> bytes) for ``pool``; False if the worker runs unprotected.

    Raises :class:`~.budget.BrokerBudgetError` (naming the broker, the budget and the other
    instances) if the broker has no room, which stops the worker at startup.  Any other
    broker failure leaves the worker unprotected (``worker.guard``).
    """
    client = session.client_for(identity)
    if client is None:
        return False
    key = reporter_key(pool, kind)
    total = sum(pools.values())
    with _lock:
        growth = total - _totals.get(key, 0)
        _identity[key] = identity
    consume_hold(identity, growth)
    try:
        if worker.report(identity, key, pools) is None:
            return False
    except BudgetExceeded as exc:
        raise budget.explain_refusal(identity, client, growth, what, exc) from exc
    with _lock:
        _totals[key] = total
    log.info(
        "event=sglang_pool_reported reporter=%s device=%s rank=%d total=%s pools=%s",
        key, identity.device, identity.tp_rank, format_bytes(total),
        {name: size for name, size in sorted(pools.items())},
    )
    return True


def hold(identity: worker.WorkerIdentity, size_bytes: int) -> bool:
    """Reserve ``size_bytes`` as the sizing hold (replacing any earlier hold on this device).

    False if the worker runs unprotected; ``BudgetExceeded`` if the broker has no room.
    """
    if worker.report(identity, HOLD_REPORTER, {HOLD_POOL: size_bytes}) is None:
        return False
    with _lock:
        _holds[str(identity.device)] = size_bytes
    return True


def consume_hold(identity: worker.WorkerIdentity, growth_bytes: int) -> None:
    """Shrink the sizing hold by ``growth_bytes`` (never below 0) before a pool grows."""
    device = str(identity.device)
    with _lock:
        held = _holds.get(device, 0)
        if growth_bytes <= 0 or held <= 0:
            return
        left = max(0, held - growth_bytes)
        _holds[device] = left
    worker.report(identity, HOLD_REPORTER, {HOLD_POOL: left})


def release_hold(identity: worker.WorkerIdentity) -> None:
    """Drop whatever is left of the sizing hold (the pools are built)."""
    with _lock:
        held = _holds.pop(str(identity.device), 0)
    if held:
        worker.report(identity, HOLD_REPORTER, {})


def kv_reporters_by_device() -> list[tuple[worker.WorkerIdentity, list[str]]]:
    """``(identity, reporter keys)`` per device: every KV pool this module reported."""
    with _lock:
        by_device: dict[str, tuple[worker.WorkerIdentity, list[str]]] = {}
        for key, identity in _identity.items():
            by_device.setdefault(str(identity.device), (identity, []))[1].append(key)
    return [(identity, sorted(keys)) for identity, keys in by_device.values()]


def totals_of(keys: list[str]) -> int:
    """Bytes the reporters ``keys`` last reported."""
    with _lock:
        return sum(_totals.get(key, 0) for key in keys)


def held_bytes(identity: worker.WorkerIdentity) -> int:
    with _lock:
        return _holds.get(str(identity.device), 0)


def reset() -> None:
    """Forget every reporter and hold (tests; a worker shutting down).  The session is not closed."""
    with _lock:
        _keys.clear()
        _totals.clear()
        _holds.clear()
        _identity.clear()
