"""The ``PageAllocator`` kvcached's ``KVCacheManager`` gets: its own, sized to the grant at birth.

``KVCacheManager.__init__`` builds its allocator through the module global
``kvcached.kv_cache_manager.PageAllocator``, then starts a thread (``_post_init``) that maps
the null block and starts the prealloc thread (5 reserve pages) as soon as the KV tensors
exist, before any limit could be set on the manager.  :class:`GovernedPageAllocator` closes
that race: it builds kvcached's real allocator and resizes it to what the broker granted
*before* returning it, so nothing is ever mapped beyond the grant (resizing an allocator that
maps nothing cannot fail).

It forwards everything to the real allocator except :meth:`get_resize_target`: kvcached's
``_alloc`` re-applies the kvctl watcher's last target on every call (sticky), which would
let an operator's ``kvctl limit`` map beyond the grant.  While the pool is governed the
target is hidden (-1) and the governor reads the segment itself, taking a foreign value as
an operator cap.  Ungoverned (no broker, an eviction), kvcached sees its watcher as it would
alone, except a target the governor's own segment writes made (a stale broker limit, or the
lift to the virtual size that a limit channel applies where TP ranks agree):
:meth:`~.governor.PoolGovernor.resize_target`.
"""

from __future__ import annotations

from typing import Any


class GovernedPageAllocator:
    def __init__(self, real: Any, governor: Any):
        self._kvcached_broker_real = real
        self._kvcached_broker_governor = governor

    @property
    def real(self) -> Any:
        return self._kvcached_broker_real

    @property
    def governor(self) -> Any:
        return self._kvcached_broker_governor

    def get_resize_target(self) -> int:
        governor = self._kvcached_broker_governor
        if governor.governed:
            return -1
        return governor.resize_target(self._kvcached_broker_real.get_resize_target())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kvcached_broker_real, name)
