"""SGLang's paged KV allocator under the broker: precomputed page counts, stale-id filtering,
and elastic pages.

The adapter never edits ``PagedTokenToKVPoolAllocator`` itself.  It derives one subclass from
it and binds that subclass where SGLang *constructs* allocators:

=============================================  ===========================  ==============
module                                         what it binds                releases
=============================================  ===========================  ==============
``sglang.srt.mem_cache.allocator``             legacy module (defines it)   0.5.12
``sglang.srt.mem_cache.allocator``             package re-export            0.5.13+
``sglang.srt.mem_cache.allocator.swa``         SWA sub-allocators           0.5.13+
``sglang.srt.mem_cache.swa_memory_pool``       SWA sub-allocators (legacy)  0.5.12
``...model_executor.model_runner_kv_cache_mixin``  pool construction        0.5.12-0.5.15
``sglang.srt.mem_cache.kv_cache_configurator``  pool construction           0.5.16+
=============================================  ===========================  ==============

Modules that *subclass* the allocator (HiSparse, NPU, page-interleave) keep the upstream
class, and an instance of any further subclass of ours behaves exactly like upstream (the
tracking only runs when ``type(self)`` is the adapter's class), so their own overrides are
never second-guessed.

What the subclass adds:

* ``alloc_extend(..., num_new_pages=None)``: a precomputed count is passed through, so the
  runtime's ``get_num_new_pages`` is not called for it;
* ``free``/``free_page_ids``: stale and out-of-range ids are dropped (``page_tracking``)
  before they reach the free list or the broker, except in SGLang's debug mode
  (``SGLANG_DEBUG_MEMORY_POOL=1``), where every id reaches upstream so that its own
  double-free checks fire;
* elastic mode (an on-demand backing is registered and the pool has tensors): every
  allocation is admitted by the broker first (``elastic_pages``); a refusal returns None.
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from .. import worker
from ..backing import on_demand_backing
from ..patching import PatchError
from . import dsv4_reservation, elastic_pages, page_tracking, pool_bytes, session, parallel

log = logging.getLogger("kvcached_broker.adapters.sglang")

CLASS_NAME = "PagedTokenToKVPoolAllocator"
_OWNER = "_kvcached_broker_owner"
_lock = threading.Lock()
_derived: dict[type, type] = {}


class AllocatorState:
    """The adapter's view of one allocator: its page tracker and, in elastic mode, its gate."""

    def __init__(self, tracker: page_tracking.PageTracker, gate: elastic_pages.ElasticGate | None):
        self.tracker = tracker
        self.gate = gate

    @classmethod
    def create(cls, alloc: Any) -> AllocatorState:
        label = f"{type(alloc).__name__}@{id(alloc):x}"
        tracker = page_tracking.PageTracker(alloc.num_pages, alloc.page_size, alloc.device, label)
        return cls(tracker, _elastic_gate(alloc))

    def admit(self, new_pages: int | None) -> bool:
        return self.gate is None or new_pages is None or self.gate.admit(new_pages)

    def allocated(self, token_ids: Any) -> None:
        if token_ids is None:
            return
        if self.gate is not None:
            self.gate.taken(self.tracker.newly_used_pages(token_ids))
        self.tracker.mark_token_ids(token_ids)

    def freed(self, page_ids: Any) -> None:
        if self.gate is not None:
            self.gate.returned(page_ids)

    def restored(self, in_use: Any) -> None:
        """The allocator went back to a snapshot: pages freed since are in use again, and back."""
        freed, taken = self.tracker.restore(in_use)
        self.freed(freed)
        if self.gate is not None and taken.numel():
            if not self.gate.admit(taken.numel()):  # a rollback cannot be refused; say so
                log.warning("event=sglang_elastic_restore_unadmitted pages=%d", taken.numel())
            self.gate.taken(taken)


def _elastic_gate(alloc: Any) -> elastic_pages.ElasticGate | None:
    """A gate when the pool can be elastic: an on-demand backing and a KV pool of our own.

    The decision depends only on what every TP rank has alike (the backing, the pool), never
    on whether this rank's broker answers: a rank that runs unprotected still gets a gate
    (one without a client), so it joins the same min-reduces as its peers.
    """
    backing = on_demand_backing()
    kvcache = getattr(alloc, "_kvcache", None)
    if backing is None or kvcache is None or dsv4_reservation.is_dsv4_pool(kvcache):
        return None
    page_bytes = kv_page_bytes(kvcache, alloc.page_size)
    if page_bytes <= 0:
        return None
    identity = parallel.identity(alloc.device)
    worker.pin_base(identity)  # before any page: a grant is reported before its pages are mapped
    client = session.client_for(identity)
    pool_bytes.mark_managed(kvcache)
    log.info("event=sglang_elastic_allocator pages=%d page_bytes=%d protected=%s", alloc.num_pages, page_bytes,
             client is not None)
    gate = elastic_pages.ElasticGate(
        client, backing, page_bytes=page_bytes, session_page_bytes=parallel.SESSION_PAGE_BYTES,
        physical_pages=alloc.num_pages, reduce_min=parallel.tp_group().reducer(),
        on_failure=lambda action, exc: worker.serving_failure(identity, f"elastic {action}", exc),
    )
    weakref.finalize(alloc, gate.close_later)  # a dropped allocator gives its grant back
    return gate


def kv_page_bytes(kvcache: Any, page_size: int) -> int:
    """KV bytes of one allocator page: every per-token buffer of the pool, ``page_size`` rows of it.

    Per-token buffers are the tensors with one row per token slot (``size + page_size`` rows,
    the padding page included); the pool's small tables (layer pointers) are left out.
    """
    rows = int(getattr(kvcache, "size", 0)) + page_size
    row_bytes = sum(
        t.numel() * t.element_size() // rows
        for t in pool_bytes.runtime_tensors(kvcache)
        if t.dim() and t.shape[0] == rows
    )
    return row_bytes * page_size if rows > page_size else 0


def debug_mode(alloc: Any) -> bool:
    """SGLang's ``SGLANG_DEBUG_MEMORY_POOL=1``: its allocator checks frees itself, so the
    adapter passes every id through unfiltered and lets those checks fire."""
    return bool(getattr(alloc, "debug_mode", False))


def in_free_group(alloc: Any) -> bool:
    """True while frees are deferred (``free_group_begin`` .. ``free_group_end``)."""
    if hasattr(alloc, "is_not_in_free_group"):  # 0.5.12-0.5.19
        return not alloc.is_not_in_free_group
    return getattr(alloc, "free_group", None) is not None


class BrokerPagedAllocatorMixin:
    """Placed before the upstream class; ``self._kvb`` is None on instances of subclasses."""

    _kvb: AllocatorState | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._kvb = None
        super().__init__(*args, **kwargs)
        if type(self) is getattr(type(self), _OWNER, None):
            self._kvb = AllocatorState.create(self)

    def clear(self) -> None:
        state = self._kvb
        if state is not None:
            state.freed(state.tracker.in_use.nonzero().flatten())
        super().clear()
        if state is not None:
            state.tracker.reset(self.num_pages)

    def alloc(self, need_size: int) -> Any:
        state = self._kvb
        if state is None:
            return super().alloc(need_size)
        if not state.admit(need_size // self.page_size):
            return None
        out = super().alloc(need_size)
        state.allocated(out)
        return out

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                     num_new_pages: int | None = None) -> Any:
        state = self._kvb
        if state is not None and state.gate is not None and num_new_pages is None:
            num_new_pages = page_tracking.extend_new_pages(seq_lens_cpu, prefix_lens_cpu, self.page_size)
        if state is not None and not state.admit(num_new_pages):
            return None
        out = super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                   extend_num_tokens, num_new_pages=num_new_pages)
        if state is not None:
            state.allocated(out)
        return out

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc) -> Any:
        state = self._kvb
        if state is None:
            return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        if state.gate is not None and not state.admit(page_tracking.decode_new_pages(seq_lens_cpu, self.page_size)):
            return None
        out = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        state.allocated(out)
        return out

    def free(self, free_index: Any) -> None:
        state = self._kvb
        if state is None or free_index.numel() == 0:
            return super().free(free_index)
        debug = debug_mode(self)  # upstream's own checks see every id, double frees included
        if in_free_group(self):  # applied at free_group_end, which frees through here again
            return super().free(free_index if debug else state.tracker.in_range_token_ids(free_index))
        if debug:
            _kept, freed_pages = state.tracker.release_token_ids(free_index, count=False)
            try:
                return super().free(free_index)
            finally:
                state.freed(freed_pages)
        kept, freed_pages = state.tracker.release_token_ids(free_index)
        if kept.numel():
            super().free(kept)
        state.freed(freed_pages)

    @property
    def stale_free_ids(self) -> int:
        """Ids dropped by ``free``/``free_page_ids`` so far (0 on untracked instances)."""
        return self._kvb.tracker.stale.dropped_ids if self._kvb is not None else 0


class _OptionalMethods:
    """Overrides for methods only some releases have; copied in only where the base has them.

    They run inside the derived class, so they reach upstream through ``_upstream``.
    """

    def free_page_ids(self, page_ids: Any) -> None:  # 0.5.20+
        state = self._kvb
        if state is None or page_ids.numel() == 0:
            return _upstream(self).free_page_ids(page_ids)
        if debug_mode(self):  # upstream's own checks see every id, double frees included
            freed_pages = state.tracker.release_page_ids(page_ids, count=False)
            try:
                return _upstream(self).free_page_ids(page_ids)
            finally:
                state.freed(freed_pages)
        freed_pages = state.tracker.release_page_ids(page_ids)
        if freed_pages.numel():
            _upstream(self).free_page_ids(freed_pages)
        state.freed(freed_pages)

    def backup_state(self) -> Any:  # 0.5.12-0.5.13 (speculative decoding rollbacks)
        state = self._kvb
        upstream = _upstream(self).backup_state()
        return upstream if state is None else _TrackedState(upstream, state.tracker.snapshot())

    def restore_state(self, saved: Any) -> None:
        state = self._kvb
        if state is None or not isinstance(saved, _TrackedState):
            return _upstream(self).restore_state(saved)
        _upstream(self).restore_state(saved.upstream)
        state.restored(saved.in_use)


def _upstream(alloc: Any) -> Any:
    """``alloc`` as the upstream class sees it (the next class after the mixin)."""
    return super(BrokerPagedAllocatorMixin, alloc)


@dataclass(frozen=True)
class _TrackedState:
    """An upstream allocator state plus the adapter's in-use flags at that moment."""

    upstream: Any
    in_use: Any


def broker_class(base: type) -> type:
    """The adapter's subclass of the upstream allocator ``base`` (made once, then reused)."""
    if getattr(base, _OWNER, None) is base:
        return base
    with _lock:
        derived = _derived.get(base)
        if derived is None:
            _check_upstream(base)
            namespace = {
                name: vars(_OptionalMethods)[name]
                for name in ("free_page_ids", "backup_state", "restore_state")
                if callable(getattr(base, name, None))
            }
            namespace.update(__module__=__name__, __qualname__=base.__name__, __doc__=base.__doc__)
            derived = type(base.__name__, (BrokerPagedAllocatorMixin, base), namespace)
            setattr(derived, _OWNER, derived)
            _derived[base] = derived
        return derived


def _check_upstream(base: type) -> None:
    params = inspect.signature(base.alloc_extend).parameters
    if "num_new_pages" not in params:
        raise PatchError(f"{base.__module__}.{base.__name__}.alloc_extend has no num_new_pages (SGLang < 0.5.12)")


def apply_binding(module: Any) -> None:
    """Bind the adapter's allocator class as ``PagedTokenToKVPoolAllocator`` in ``module``."""
    base = getattr(module, CLASS_NAME, None)
    if not isinstance(base, type):
        raise PatchError(f"{module.__name__} has no {CLASS_NAME}")
    setattr(module, CLASS_NAME, broker_class(base))
