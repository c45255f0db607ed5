"""kvcached 0.1.6 and a broker as a pool governor sees them, in pool pages, with no threads.

For the property test of adapters/kvcached (tests/adapters/kvcached/test_kvcached_pool_state.py): the real
``PoolGovernor`` drives these models, and an *interleaver* runs the engine's and kvcached's
prealloc thread's actions between any two of the governor's calls, as their threads can.

The allocator follows kvcached's ``PageAllocator`` (csrc/page_allocator.cpp of the 0.1.6 sdist,
as ``tools/kvcached_sim/vmm_ops_double.py`` models it): mapped (in use + reserve) never exceeds
its size; ``resize`` refuses to go below what is in use, and otherwise shrinks over unmapped
pages, then the reserve; frees refill the reserve up to ``MAX_RESERVED`` and unmap the rest;
``trim`` unmaps the reserve.  The engine's ``alloc`` counts its pages in use before it has
mapped them (kvcached's ``alloc_page`` pops a free page, then maps it), and holds the manager's
lock until they are mapped: whoever takes that lock (the governor, or kvcached's own synchronized
calls) waits for the mapping to finish.  The manager follows ``KVCacheManager.set_memory_limit`` of 0.1.6:
a revision older than the current one is ``stale``, the same revision with another limit a
``conflict``; a limit below what is in use leaves the size as it is and is ``deferred`` until
frees bring the use down to it.

Every mutation checks the invariant through ``check`` (given by the test): the model's own
``mapped <= size``, and the governor's ``size <= granted``.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any, Callable

from helpers import FixedGrants

from kvcached_broker.adapters.kvcached.geometry import PoolGeometry
from kvcached_broker.adapters.kvcached.governor import PoolGovernor
from kvcached_broker.adapters.kvcached.policy import Watermarks
from kvcached_broker.client import SessionEvicted

MIN_RESERVED = 2
MAX_RESERVED = 4


class ModelAllocator:
    def __init__(self, size_pages: int, page_size: int):
        self.page_size = page_size
        self.total = size_pages
        self.inuse = 0
        self.reserved = 0
        self.mapping = 0  # counted in use, not mapped yet: the engine's alloc is under way
        self.interleave: Callable[[], None] = lambda: None
        self.check: Callable[[], None] = lambda: None
        self.trimmed: Callable[[], None] = lambda: None  # the test's check of each trim

    # what the governor calls (each may let the engine or the prealloc thread act first)
    def get_num_total_pages(self) -> int:
        self.interleave()
        return self.total

    def get_num_inuse_pages(self) -> int:
        self.interleave()
        return self.inuse

    def get_num_reserved_pages(self) -> int:
        self.interleave()
        return self.reserved

    def resize(self, new_mem_size: int) -> bool:
        self.interleave()
        pages = new_mem_size // self.page_size
        if pages < self.inuse:
            return False
        self.total = pages
        self.reserved = min(self.reserved, pages - self.inuse)
        self.check()
        return True

    def trim(self) -> None:
        self.interleave()
        self.trimmed()
        self.reserved = 0

    def reset_free_page_order(self) -> None:
        pass

    def get_resize_target(self) -> int:
        return -1

    # what the engine and kvcached's prealloc thread do
    def unmapped_free(self) -> int:
        return self.total - self.inuse - self.reserved

    def alloc(self, pages: int) -> bool:
        """The engine's alloc starts: it counts ``pages`` in use at once, and maps those not taken
        from the reserve until :meth:`finish_mapping` (it holds the manager's lock meanwhile)."""
        self.finish_mapping()
        if self.reserved + self.unmapped_free() < pages:
            return False
        from_reserve = min(self.reserved, pages)
        self.reserved -= from_reserve
        self.inuse += pages
        self.mapping = pages - from_reserve
        self.check()
        return True

    def finish_mapping(self) -> None:
        self.mapping = 0

    def free(self, pages: int) -> None:
        self.finish_mapping()
        pages = min(pages, self.inuse)
        self.inuse -= pages
        self.reserved = min(MAX_RESERVED, self.reserved + pages)
        self.check()

    def prealloc(self) -> None:
        self.reserved = max(self.reserved, min(MIN_RESERVED, self.reserved + self.unmapped_free()))
        self.check()

    @property
    def mapped(self) -> int:
        """What kvcached counts mapped (in use and the reserve)."""
        return self.inuse + self.reserved

    @property
    def physical(self) -> int:
        """What the device would measure: the pages the engine is still mapping are not in it."""
        return self.mapped - self.mapping


class ModelLock:
    """The manager's lock as another thread meets it: taking it waits for the engine's alloc
    under way to finish mapping (the engine holds the lock until then)."""

    def __init__(self, allocator: ModelAllocator):
        self.allocator = allocator
        self.held = 0

    def __enter__(self) -> bool:
        self.allocator.finish_mapping()
        self.held += 1
        return True

    def __exit__(self, *exc: object) -> None:
        self.held -= 1


class ModelManager:
    """``KVCacheManager`` as the governor calls it, after its post-init."""

    def __init__(self, allocator: ModelAllocator, page_bytes: int, virtual_pages: int):
        self.page_allocator = allocator
        self.page_bytes = page_bytes
        self.virtual_pages = virtual_pages
        self.pool_name = "mha"
        self._post_init_done = threading.Event()
        self._post_init_done.set()
        self._lock = ModelLock(allocator)
        self._memory_limit_revision = -1
        self._memory_limit_bytes: int | None = None
        self.in_shrink = False
        self.target_pages: int | None = None
        self.statuses: list[str] = []  # what each set_memory_limit call returned

    def set_memory_limit(self, limit_bytes: int, *, revision: int) -> dict:
        self.page_allocator.finish_mapping()  # synchronized: it waits for the engine's alloc
        if revision < self._memory_limit_revision:
            return self._record("stale")
        if revision == self._memory_limit_revision:
            return self._record("applied" if limit_bytes == self._memory_limit_bytes else "conflict")
        pages = min(limit_bytes // self.page_bytes, self.virtual_pages)
        if self.page_allocator.resize(pages * self.page_allocator.page_size):
            self.in_shrink, self.target_pages = False, None
        else:
            self.in_shrink, self.target_pages = True, pages
        self._memory_limit_bytes, self._memory_limit_revision = limit_bytes, revision
        return self._record(None)

    def _record(self, status: str | None) -> dict:
        state = self.memory_limit_state()
        if status is not None:
            state["status"] = status
        self.statuses.append(state["status"])
        return state

    def memory_limit_state(self) -> dict:
        self.page_allocator.finish_mapping()
        limit = self._memory_limit_bytes
        effective = None if limit is None else min(limit // self.page_bytes, self.virtual_pages) * self.page_bytes
        return {"status": "deferred" if self.in_shrink else "applied", "revision": self._memory_limit_revision,
                "limit_bytes": limit, "effective_limit_bytes": effective}

    def free(self, pages: int) -> None:
        """The engine frees ``pages``; a deferred limit finishes once the use is down to it."""
        self.page_allocator.free(pages)
        if self.in_shrink and self.target_pages is not None and self.page_allocator.inuse <= self.target_pages:
            if self.page_allocator.resize(self.target_pages * self.page_allocator.page_size):
                self.in_shrink, self.target_pages = False, None


class ModelBroker(FixedGrants):
    """A broker session's grant to one pool (the ``Grants`` interface, ``maps_here``): grants
    what fits in ``capacity_pages``, refuses, has gone (the process turned unprotected), or
    evicts, as its ``mode`` says.  The calls it does not model (no shortfall, nothing polled,
    nothing forgotten) are :class:`helpers.FixedGrants`'."""

    maps_here = True

    def __init__(self, capacity_pages: int):
        self.capacity_pages = capacity_pages
        self.pages = 0
        self.mode = "grant"  # grant | refuse | lost | evict
        self.why_lost: str | None = None
        self.check: Callable[[], None] = lambda: None
        self.calls_after_lost = 0
        self.evictions = 0
        self.mapped_said: int | None = None
        self.idle_said: int | None = None
        self.views_said: tuple | None = None  # the status views last taken (sorted items)
        self.zero_page_taken = False  # the zero page's report was taken
        self.said_mapped: Callable[[int], None] = lambda pages: None  # the test's check of each
        self.called: Callable[[], None] = lambda: None  # the test's check of every call

    def lost(self) -> str | None:
        return self.why_lost

    def _call(self) -> None:
        """Every call the governor makes: counted once the broker is gone or evicted the session
        (an ungoverned pool must make none), and failing as the mode says."""
        self.called()
        if self.why_lost is not None or self.evictions:
            self.calls_after_lost += 1
        if self.mode == "lost" and self.why_lost is None:
            self.why_lost = "broker gone (model)"
        if self.mode == "evict":
            self.evictions += 1
            raise SessionEvicted("evicted (model)")

    def acquire(self, pages: int, min_pages: int, *, wait_s: float | None = None) -> int | None:
        self._call()
        if self.why_lost is not None:
            return None
        if self.mode == "refuse":
            return 0
        got = min(pages, self.capacity_pages - self.pages)
        if got < min_pages or got <= 0:
            return 0
        self.pages += got
        self.check()
        return got

    def release(self, pages: int, *, mapped: int | None = None, key: str | None = None) -> bool:
        self._call()
        if self.why_lost is not None:
            return False
        pages = min(pages, self.pages)
        self.pages -= pages
        if mapped is not None:
            self.said_mapped(mapped)
            self.mapped_said = mapped
        self.check()
        return True

    def mapped(self, key: str, pages: int) -> None:
        self._call()
        self.said_mapped(pages)
        self.mapped_said = pages

    def idle(self, key: str, pages: int) -> None:
        self._call()
        self.idle_said = pages

    def report(self, key: str, pools: dict, *, usage: dict | None = None, allocated: bool = True) -> bool:
        self._call()
        if self.why_lost is not None:
            return False
        if not allocated:
            self.zero_page_taken = True
        if usage is not None:
            self.views_said = tuple(sorted(usage.items()))
        return True


class ModelPrefixCache:
    """A prefix cache's eviction hook: ``cached`` of the pages in use hold only finished
    requests' blocks, and go back through the engine's free path when evicted."""

    def __init__(self, manager: ModelManager):
        self.manager = manager
        self.cached = 0

    def evict(self, pages: int) -> int:
        freed = min(pages, self.cached, self.manager.page_allocator.inuse)
        self.cached -= freed
        self.manager.free(freed)
        return freed

    def cached_pages(self) -> int:
        return min(self.cached, self.manager.page_allocator.inuse)


class ModelPool:
    """One pool of these models under the real governor, built and not started: the caller wires
    its checks into the models first, then ``governor.start()`` and ``governor.attach(manager)``.
    One layer and one buffer, so a pool page is ``page_size`` bytes; marks of 4 pages a batch."""

    MARKS = Watermarks(batch_pages=4, low_pages=2, high_pages=8)

    def __init__(self, capacity_pages: int, *, virtual_pages: int, page_size: int, limits: Any = None):
        self.geometry = PoolGeometry(num_layers=1, page_size=page_size, num_kv_buffers=1, virtual_pages=virtual_pages,
                                     ipc_name=f"kvcached_broker_model_{uuid.uuid4().hex}")
        self.allocator = ModelAllocator(virtual_pages, page_size)
        self.broker = ModelBroker(capacity_pages)
        self.manager = ModelManager(self.allocator, self.geometry.page_bytes, virtual_pages)
        self.cache = ModelPrefixCache(self.manager)
        self.governor = PoolGovernor(self.geometry, self.allocator, self.broker, self.MARKS, limits=limits)
