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

A channel's :meth:`apply` returns kvcached's limit state (``{"status": "applied" | "deferred" |
"stale" | "rejected", ...}``) as ``KVCacheManager.set_memory_limit`` does.  Whatever it
returns, the governor releases grants only above the allocator's size that kvcached reports
(``PageAllocator.get_num_total_pages``), so a channel that applies late or not at all can
delay a give-back but never overbook.

A channel calls ``KVCacheManager.set_memory_limit`` from a module of this package
(``kvcached_broker.adapters.kvcached.*``, as :class:`DirectLimits` and :mod:`.agreement` do):
on a governed pool, a call from anywhere else is an outside limit, taken as an operator cap
(:meth:`.governor.PoolGovernor.outside_limit`).  The ungoverning lift to the virtual size goes
through the channel too (:meth:`.governor.PoolGovernor._ungovern`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .. import process_state
from .geometry import PoolGeometry


class LimitChannel(Protocol):
    def apply(self, manager: Any, limit_bytes: int, revision: int) -> dict: ...


class DirectLimits:
    """Apply a limit at once, on the caller's thread."""

    def apply(self, manager: Any, limit_bytes: int, revision: int) -> dict:
        return manager.set_memory_limit(limit_bytes, revision=revision)


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
