"""DeepSeek-V4 runtime-owned pools as per-pool reservations (``KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION``).

SGLang keeps ownership of the V4 side pools (SWA, compressed C4/C128 KV, indexer K,
compressor state): the adapter only accounts for them, so co-located models cannot overbook
memory this worker holds.  Hook points:

* ``DeepSeekV4TokenToKVPool.__init__`` (in ``sglang.srt.mem_cache.deepseek_v4_memory_pool``,
  the class itself, so every construction site and subclass is covered): measure and report
  right after the pool is built.
* the sites that build it (``KVCacheConfigurator._init_pools`` in 0.5.16+,
  ``ModelRunnerKVCacheMixin._init_pools`` before): measure again once construction,
  including any platform subclass, is complete (see ``kv_sizing``).
* ``RequestWindow._ensure_workspace`` (0.5.21+): the DSV4.1 request window grows its
  workspace lazily, inside a forward pass; the owning pool is measured again when it does,
  on the adapter's background thread (``adapters/background.py``), so no broker round trip
  (which can be slow or fail) ever runs inside the forward pass.

The flag is read each time a pool is built, never frozen at import.  Pools the installed
kvcached reports itself are left out (``dsv4_ownership``), and measured again before a kvcached
pool takes its first grant (:func:`before_kvcached_grant`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .. import announce, background, flags, process_state
from ..patching import wrap_methods, wrap_once
from . import dsv4_ownership, dsv4_pools, kv_budget, parallel, pool_bytes, reporting

log = announce.logger("kvcached_broker.adapters.sglang")


class _V4Pools:
    """The live V4 pools this process measured (``registered``) and each live request window's
    pool (``windows``: window -> weak reference to its pool).  Weak: a pool or window that is
    collected drops out.  ``lock`` guards both: pools register on the scheduler's thread and are
    measured again on the governors' and the background's."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()
        self.registered: weakref.WeakSet[Any] = weakref.WeakSet()


def is_dsv4_pool(pool: Any) -> bool:
    """True for a DeepSeek-V4 token-to-KV pool (or a platform subclass of it)."""
    return any(cls.__name__ == "DeepSeekV4TokenToKVPool" for cls in type(pool).__mro__)


def register(pool: Any, *, last: bool = False) -> dict[str, int] | None:
    """Measure ``pool`` and report its runtime-owned pools; returns what was reported.

    The report shrinks the KV sizing hold by what it adds (or, with ``last``, drops it) in
    the same broker request.  None when the flag is off, the pool is managed, or the worker
    runs unprotected.
    """
    if not flags.dsv4_runtime_reservation():
        announce.once("dsv4_reservation_off", logging.WARNING, "dsv4_reservation_off",
                      detail="KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION=0_pools_not_reported")
        return None
    if pool_bytes.is_managed(pool):
        return None
    identity = parallel.identity(getattr(pool, "device", None))
    _track_window(pool)
    _remember(pool)
    return reporting.report_measured(
        identity, pool, "dsv4", lambda seen: dsv4_ownership.without_kvcached_reports(dsv4_pools.measure(pool, seen)),
        "DeepSeek-V4 runtime-owned pools", last=last)


def _remember(pool: Any) -> None:
    state = process_state.part(_V4Pools)
    try:
        with state.lock:
            state.registered.add(pool)
    except TypeError:
        pass


def remeasure_all() -> None:
    """Measure every live V4 pool again (what kvcached reports or owns by now is left out)."""
    state = process_state.part(_V4Pools)
    with state.lock:
        pools = list(state.registered)
    for pool in pools:
        register(pool)


def before_kvcached_grant() -> None:
    """A kvcached pool is about to take its first grant: if kvcached reports V4 pools itself,
    measure every live V4 pool again (``dsv4_ownership``)."""
    if not dsv4_ownership.kvcached_reports():
        return
    remeasure_all()


def _track_window(pool: Any) -> None:
    window = getattr(pool, "request_window", None)
    if window is not None:
        state = process_state.part(_V4Pools)
        try:
            with state.lock:
                state.windows[window] = weakref.ref(pool)
        except TypeError:
            pass


def wrap_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        register(self)

    return wrap_once(original, __init__)


def apply_memory_pool(module: Any) -> None:
    """Patch ``DeepSeekV4TokenToKVPool.__init__`` in ``deepseek_v4_memory_pool``."""
    wrap_methods(module, "DeepSeekV4TokenToKVPool", {"__init__": wrap_init})


def wrap_ensure_workspace(original: Callable[..., None]) -> Callable[..., None]:
    def _ensure_workspace(self: Any, *args: Any, **kwargs: Any) -> None:
        before = getattr(self, "workspace", None)
        original(self, *args, **kwargs)
        state = process_state.part(_V4Pools)
        with state.lock:
            owner_ref = state.windows.get(self)
        if owner_ref is not None and getattr(self, "workspace", None) is not before:
            background.submit(f"dsv4 request window {id(self):x}", lambda: _remeasure(owner_ref))

    return wrap_once(original, _ensure_workspace)


def _remeasure(owner_ref: weakref.ref) -> None:
    """Measure a request window's pool again (background: never inside the forward pass).

    The workspace is already allocated when this runs, so a refusal cannot be undone: it is
    logged, and the pool stays charged at what it was before it grew.
    """
    owner = owner_ref()
    if owner is None:
        return
    try:
        register(owner)
    except kv_budget.BrokerBudgetError as exc:
        log.warning("event=dsv4_request_window_uncharged reason=%r", str(exc))


def apply_request_window(module: Any) -> None:
    """Patch ``RequestWindow._ensure_workspace`` in ``dsv41_request_window`` (0.5.21+)."""
    wrap_methods(module, "RequestWindow", {"_ensure_workspace": wrap_ensure_workspace})
