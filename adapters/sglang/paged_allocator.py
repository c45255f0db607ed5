"""SGLang's paged KV allocator under the broker: precomputed page counts and stale-id filtering.

The adapter never edits ``PagedTokenToKVPoolAllocator`` itself.  It derives one subclass from
it (:func:`broker_class`), which ``allocator_binding`` binds where SGLang *constructs*
allocators.  Modules that *subclass* the allocator (HiSparse, NPU, page-interleave) keep the
upstream class, and an instance of any further subclass of ours behaves exactly like upstream
(the tracking only runs when ``type(self)`` is the adapter's class), so their own overrides are
never second-guessed.  kvcached's elastic allocators (kvcached mode, where its SGLang patch
aliases these names) are left as they are: kvcached owns their free lists
(``kvcached_fallback`` gives them SGLang's own allocator, this subclass, for pools kvcached does
not manage).

What the subclass adds:

* ``alloc_extend(..., num_new_pages=None)``: a precomputed count is passed through, so the
  runtime's ``get_num_new_pages`` is not called for it;
* ``free``/``free_page_ids``: stale and out-of-range ids are dropped (``page_tracking``)
  before they reach the free list, except in SGLang's debug mode
  (``SGLANG_DEBUG_MEMORY_POOL=1``), where every id reaches upstream so that its own
  double-free checks fire.

The KV memory behind it is static: sized by the broker and charged as a reservation
(``kv_sizing``).  Elastic KV is kvcached mode (``adapters/kvcached``), not this class.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any

from ..patching import PatchError
from .. import announce, process_state
from . import page_tracking
from ..kvcached import kvcached_api

log = announce.logger("kvcached_broker.adapters.sglang")

CLASS_NAME = "PagedTokenToKVPoolAllocator"
_OWNER = "_kvcached_broker_owner"


class _Derived:
    """The adapter's subclass of each upstream allocator class (upstream -> derived), made once
    under ``lock``.  Hook wiring: SGLang's modules are bound to these classes, so a reset keeps
    them and a later :func:`broker_class` returns the same class, never a second one."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.classes: dict[type, type] = {}


class AllocatorState:
    """The adapter's view of one allocator: which of its pages are handed out."""

    def __init__(self, tracker: page_tracking.PageTracker):
        self.tracker = tracker

    @classmethod
    def create(cls, alloc: Any) -> AllocatorState:
        label = f"{type(alloc).__name__}@{id(alloc):x}"
        return cls(page_tracking.PageTracker(alloc.num_pages, alloc.page_size, alloc.device, label))

    def allocated(self, token_ids: Any) -> None:
        if token_ids is not None:
            self.tracker.mark_token_ids(token_ids)


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
    """Placed before the upstream class; ``self._kvb`` is None on instances of subclasses.

    Its methods reach upstream through :func:`_upstream` (``super()``, untyped: the upstream
    class is known only at run time)."""

    _kvb: AllocatorState | None = None
    num_pages: int  # the upstream allocator's

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._kvb = None
        super().__init__(*args, **kwargs)
        if type(self) is getattr(type(self), _OWNER, None):
            self._kvb = AllocatorState.create(self)

    def clear(self) -> None:
        _upstream(self).clear()
        if self._kvb is not None:
            self._kvb.tracker.reset(self.num_pages)

    def alloc(self, need_size: int) -> Any:
        out = _upstream(self).alloc(need_size)
        if self._kvb is not None:
            self._kvb.allocated(out)
        return out

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                     num_new_pages: int | None = None) -> Any:
        out = _upstream(self).alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                           extend_num_tokens, num_new_pages=num_new_pages)
        if self._kvb is not None:
            self._kvb.allocated(out)
        return out

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc) -> Any:
        out = _upstream(self).alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        if self._kvb is not None:
            self._kvb.allocated(out)
        return out

    def free(self, free_index: Any) -> None:
        state = self._kvb
        if state is None or free_index.numel() == 0:
            return _upstream(self).free(free_index)
        debug = debug_mode(self)  # upstream's own checks see every id, double frees included
        if in_free_group(self):  # applied at free_group_end, which frees through here again
            return _upstream(self).free(free_index if debug else state.tracker.in_range_token_ids(free_index))
        if debug:
            state.tracker.release_token_ids(free_index, count=False)
            return _upstream(self).free(free_index)
        kept, _freed_pages = state.tracker.release_token_ids(free_index)
        if kept.numel():
            _upstream(self).free(kept)

    @property
    def stale_free_ids(self) -> int:
        """Ids dropped by ``free``/``free_page_ids`` so far (0 on untracked instances)."""
        return self._kvb.tracker.stale.dropped_ids if self._kvb is not None else 0


class _OptionalMethods:
    """Overrides for methods only some releases have; copied in only where the base has them.

    They run inside the derived class, so they reach upstream through ``_upstream``.
    """

    _kvb: AllocatorState | None  # the mixin's, in the derived class

    def free_page_ids(self, page_ids: Any) -> None:  # 0.5.20+
        state = self._kvb
        if state is None or page_ids.numel() == 0:
            return _upstream(self).free_page_ids(page_ids)
        if debug_mode(self):  # upstream's own checks see every id, double frees included
            state.tracker.release_page_ids(page_ids, count=False)
            return _upstream(self).free_page_ids(page_ids)
        freed_pages = state.tracker.release_page_ids(page_ids)
        if freed_pages.numel():
            _upstream(self).free_page_ids(freed_pages)

    def backup_state(self) -> Any:  # 0.5.12-0.5.13 (speculative decoding rollbacks)
        state = self._kvb
        upstream = _upstream(self).backup_state()
        return upstream if state is None else _TrackedState(upstream, state.tracker.snapshot())

    def restore_state(self, saved: Any) -> None:
        state = self._kvb
        if state is None or not isinstance(saved, _TrackedState):
            return _upstream(self).restore_state(saved)
        _upstream(self).restore_state(saved.upstream)
        state.tracker.restore(saved.in_use)


def _upstream(alloc: Any) -> Any:
    """``alloc`` as the upstream class sees it (the next class after the mixin)."""
    return super(BrokerPagedAllocatorMixin, alloc)


@dataclass(frozen=True)
class _TrackedState:
    """An upstream allocator state plus the adapter's in-use flags at that moment."""

    upstream: Any
    in_use: Any


def broker_class(base: type) -> type:
    """The adapter's subclass of the upstream allocator ``base`` (made once, then reused);
    ``base`` itself when it is kvcached's elastic allocator (kvcached owns its free list)."""
    if getattr(base, _OWNER, None) is base or kvcached_api.defines_class(base):
        return base
    made = process_state.part(_Derived)
    with made.lock:
        derived = made.classes.get(base)
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
            made.classes[base] = derived
        return derived


def _check_upstream(base: type[Any]) -> None:
    params = inspect.signature(base.alloc_extend).parameters
    if "num_new_pages" not in params:
        raise PatchError(f"{base.__module__}.{base.__name__}.alloc_extend has no num_new_pages (SGLang < 0.5.12)")
