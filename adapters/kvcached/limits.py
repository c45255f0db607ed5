"""Where a governed pool's limit changes are applied: at once, or where the runtime agrees.

A governor decides a limit on its own thread.  Whether it may apply it there depends on the
runtime's allocation path:

* :class:`DirectLimits` applies it at once.  Right for a runtime that treats an allocation
  kvcached refuses as a scheduling miss (vLLM: ``KVCachePoolExhausted`` becomes a step with no
  new blocks), and for pools driven directly.
* A runtime whose scheduler checks capacity and then allocates, and takes a refused allocation
  as fatal (SGLang), or whose tensor-parallel ranks must see the same capacity at the same
  step, needs a channel that applies the limit at a point of its scheduler's own choosing.
  Such a channel is installed with :func:`set_factory`.

A channel's :meth:`apply` returns kvcached's limit state as ``KVCacheManager.set_memory_limit``
answers it, read (:class:`.kvcached_api.LimitState`: applied, deferred, ...).  Whatever it
returns, the governor releases grants only above the allocator's size that kvcached reports
(``PageAllocator.get_num_total_pages``), so a channel that applies late or not at all can
delay a give-back but never overbook.

A channel sets kvcached's limit through the governor (:meth:`OwnLimits.apply_own_limit`, as
:class:`DirectLimits` and :mod:`.agreement` do), which takes the pool's next revision and applies
it under one lock, so the pool's revisions reach kvcached in the order they were taken, whichever
thread applies them.  It calls :func:`set_own_limit`, which marks the call as the broker's own on
its thread for as long as it runs: on a governed pool, any other
``KVCacheManager.set_memory_limit`` is an outside limit, taken as an operator cap
(:meth:`.governor.PoolGovernor.outside_limit`), whatever wrappers sit between the caller and the
patch's.  The ungoverning lift to the virtual size goes through the channel too
(:meth:`.governor.PoolGovernor._ungovern`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .. import process_state
from .geometry import PoolGeometry
from .kvcached_api import LimitState

if TYPE_CHECKING:
    from .grants import Grants


class OwnLimits(Protocol):
    """What a channel needs of the pool's governor (:class:`.governor.PoolGovernor`)."""

    def apply_own_limit(self, manager: Any, limit_bytes: int) -> LimitState:
        """``set_memory_limit`` through :func:`set_own_limit`, with the pool's next revision."""
        ...


class LimitChannel(Protocol):
    #: The pool's limits change only at the runtime's sync points (SGLang's agreement): nothing
    #: else may resize it, not even kvcached's kvctl watcher.
    at_sync_points: bool

    def route_releases(self, grants: Grants, governor: Any) -> Grants:
        """The grants ``governor`` (a :class:`.governor.PoolGovernor`, being built) gives back
        through."""
        ...

    def apply(self, governor: OwnLimits, manager: Any, limit_bytes: int) -> LimitState: ...


#: The manager's attribute counting, per thread, the :func:`set_own_limit` calls in progress.
_OWN_CALLS = "_kvcached_broker_own_limit_threads"


def set_own_limit(manager: Any, limit_bytes: int, revision: int) -> LimitState:
    """``manager.set_memory_limit(limit_bytes, revision=revision)`` as the broker's own call:
    :func:`is_own_limit_call` is True on this thread, for this manager, while it runs."""
    own: dict[int, int] = manager.__dict__.setdefault(_OWN_CALLS, {})  # thread -> calls in progress
    thread = threading.get_ident()
    own[thread] = own.get(thread, 0) + 1
    try:
        return LimitState.of(manager.set_memory_limit(limit_bytes, revision=revision))
    finally:
        if own[thread] > 1:
            own[thread] -= 1
        else:
            del own[thread]


def is_own_limit_call(manager: Any) -> bool:
    """Whether this thread's ``set_memory_limit`` on ``manager`` came through :func:`set_own_limit`."""
    return threading.get_ident() in manager.__dict__.get(_OWN_CALLS, ())


class DirectLimits:
    """Apply a limit at once, on the caller's thread."""

    at_sync_points = False

    def route_releases(self, grants: Grants, governor: Any) -> Grants:
        return grants

    def apply(self, governor: OwnLimits, manager: Any, limit_bytes: int) -> LimitState:
        return governor.apply_own_limit(manager, limit_bytes)


Factory = Callable[[PoolGeometry], "LimitChannel | None"]


class _Factory:
    """The channel factory this process's wiring installed (None: :class:`DirectLimits`).
    Wiring, installed once by the runtime's patches (:mod:`..sglang.kvcached_sync`), so a reset
    of the registry keeps it; :func:`set_factory` replaces it."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.factory: Factory | None = None


def set_factory(factory: Factory | None) -> None:
    """Install how a new pool gets its channel (None, or a factory returning None: direct)."""
    process_state.part(_Factory).factory = factory


def channel_for(geometry: PoolGeometry) -> LimitChannel:
    factory = process_state.part(_Factory).factory
    channel = factory(geometry) if factory is not None else None
    return channel if channel is not None else DirectLimits()
