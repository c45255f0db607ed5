"""vLLM's extensible KV cache (0.34+) under the broker: every commit is admitted before it maps.

vLLM 0.34 (the default on CUDA) reserves the KV cache's address range at its planned capacity
(``ExtensibleKVCache``) and backs a prefix of blocks with physical memory as it goes
(``commit``): the null block when the cache is allocated, what the warm-up addresses (at most
``committable_blocks()``, agreed across ranks), and, once the warm-up measured what is free
(``measure_kv_cache_blocks``, the minimum over ranks), the final size (``Worker.extend_kv_cache``),
after which the scheduler's block count is fixed.  A commit the driver cannot back raises, in
the warm-up or the start-up; nothing commits on the scheduling path.  Sleep, ``discard`` and a
weight update release the physical memory and commit it again.

The broker's book follows it, as the pool ``kv_extensible`` of the ``vllm_kv_cache`` reporter
(the hold sizing took, ``kv_sizing_hold``, covers the whole capacity: :mod:`.kv_sizing`):

* **before** a commit maps more, the pool is raised to the bytes the commit will have mapped
  (``physical_bytes_for``: whole granules per segment), in one request with the sizing hold
  lowered by as much; what exceeds the hold comes out of the slack hold, and what exceeds that
  is growth the broker admits or refuses.  A refusal raises :class:`~.kv_budget.KVCacheBudgetError`
  (a ``RuntimeError``, as vLLM's own failed commit is) before anything is mapped;
* **after** a commit the pool is what is mapped: the bytes a shrinking commit gave up go back to
  the sizing hold until the final size is committed (the warm-up releases its blocks so that the
  CUDA graphs fit, and the final size takes them again), and to the broker after it;
* ``committable_blocks()`` and ``measure_kv_cache_blocks()`` are capped at the blocks the broker
  admitted (the pool and the sizing hold): less room on the broker is fewer blocks for the
  warm-up and for the scheduler, that is scheduling misses later, never a refused commit;
* ``Worker.extend_kv_cache`` committed the final size: what is left of the sizing hold is given
  back; ``free`` gives the pool back;
* sleep, ``discard`` and wake are :mod:`.memory_release`'s: the reporter is suspended and admitted
  again before vLLM commits, so the commit that follows maps what the book already charges.

The per-group view (status ``usage_breakdown``) is the cache groups' bytes over the committed
blocks.  In kvcached mode none of this runs (kvcached's buffers replace vLLM's).  All sizes are
bytes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

from ...client import BudgetExceeded
from ...client.units import format_bytes
from .. import announce, process_state, sessions
from ..patching import PatchError, wrap_methods, wrap_once
from ..report_book import KV_SIZING_HOLD
from ..worker_identity import WorkerIdentity
from . import kv_budget, kv_config, kvcached_mode, parallel

log = announce.logger("kvcached_broker.adapters.vllm")

POOL = "kv_extensible"
CLASS_NAME = "ExtensibleKVCache"
MODULE = "vllm.v1.worker.extensible_kv_cache"


@dataclass
class _Cache:
    """What the adapter keeps of one extensible cache."""

    identity: WorkerIdentity
    views_per_block: dict[str, int]  # cache role -> bytes its layers address per block
    final: bool = False  # Worker.extend_kv_cache committed the final size


class _Caches:
    """What the adapter keeps of each live extensible cache of this process (weakly keyed: a
    cache that is gone takes its entry with it)."""

    def __init__(self) -> None:
        self.by_cache: "weakref.WeakKeyDictionary[Any, _Cache]" = weakref.WeakKeyDictionary()


def is_extensible(allocate: Any) -> bool:
    """True if ``allocate`` (``allocate_kv_cache``'s ``allocate=``) is an extensible cache's hook."""
    owner = getattr(allocate, "__self__", None)
    return type(owner).__name__ == CLASS_NAME and type(owner).__module__ == MODULE


def track(kv_cache: Any, kv_cache_config: Any, device: Any) -> None:
    """Remember the cache ``allocate_kv_cache`` is about to back (its groups, for the views)."""
    blocks = max(1, int(kv_cache_config.num_blocks))
    per_block = {name: size // blocks for name, size in kv_config.usage_breakdown(kv_cache_config).items()}
    process_state.part(_Caches).by_cache[kv_cache] = _Cache(parallel.identity(device), per_block)


def _governed(kv_cache: Any) -> _Cache | None:
    """What the adapter keeps of ``kv_cache``, if the broker governs it (a usable session for its
    device, not in kvcached mode); None otherwise, and for anything that is not an extensible
    cache."""
    if kvcached_mode.active() or type(kv_cache).__name__ != CLASS_NAME:
        return None
    caches = process_state.part(_Caches).by_cache
    state = caches.get(kv_cache)
    if state is None:  # a cache backed some other way than through allocate_kv_cache: no views
        state = caches[kv_cache] = _Cache(parallel.identity(kv_cache.buffer.device), {})
    return state if sessions.session(state.identity) is not None else None


def pool_bytes(identity: WorkerIdentity) -> int:
    session = sessions.existing(identity)
    return session.booked_bytes(kv_budget.REPORTER) if session is not None else 0


def admitted_bytes(identity: WorkerIdentity) -> int:
    """What the broker admitted this cache: its pool and the sizing hold still promised to it."""
    session = sessions.existing(identity)
    return pool_bytes(identity) + (session.held_bytes(KV_SIZING_HOLD) if session is not None else 0)


def planned_bytes(kv_cache: Any, num_blocks: int, defragment: bool, shrink: bool) -> int:
    """The physical bytes ``commit(num_blocks, defragment, shrink)`` will leave mapped (vLLM's rule:
    a remap releases everything first, and a commit never shrinks otherwise)."""
    blocks = min(int(num_blocks), int(kv_cache.capacity_blocks))
    committed = int(kv_cache.num_committed_blocks)
    remaps = shrink and blocks < committed
    if not remaps and defragment:
        sizes = [blocks * stride for stride in kv_cache.segment_strides]
        remaps = not all(kv_cache.buffer.segments_backed_by_one_chunk(sizes))
    if remaps:
        return kv_cache.physical_bytes_for(blocks) if blocks > 0 else 0
    if blocks <= committed:
        return int(kv_cache.physical_bytes)
    return kv_cache.physical_bytes_for(blocks)


def _views(state: _Cache, blocks: int, pool: int) -> dict[str, int]:
    """The groups' bytes over ``blocks`` committed blocks, none above the pool."""
    return kv_config.within({name: size * blocks for name, size in state.views_per_block.items() if size}, pool)


def admit(state: _Cache, kv_cache: Any, target_bytes: int, num_blocks: int) -> None:
    """Raise the pool to ``target_bytes`` before vLLM maps them, the hold lowered by as much."""
    identity = state.identity
    session = sessions.existing(identity)
    booked = pool_bytes(identity)
    if session is None or target_bytes <= booked:
        return
    views = _views(state, min(num_blocks, int(kv_cache.capacity_blocks)), target_bytes)
    try:  # the first commit (the cache allocated) starts the warm-up, as the static buffer's allocation does
        session.report_built(kv_budget.REPORTER, {POOL: target_bytes}, usage=views, allocated=False,
                             phase="warming" if not booked and not state.final else None)
    except BudgetExceeded as exc:
        what = f"{num_blocks} blocks of its extensible KV cache ({format_bytes(target_bytes)} mapped)"
        raise kv_budget.explain(identity, session.client, target_bytes, what, exc) from exc


def settle(state: _Cache, kv_cache: Any) -> None:
    """The pool is what is mapped now; what a shrink gave up goes back to the hold until the
    final size is committed, then to the broker."""
    identity = state.identity
    session = sessions.existing(identity)
    mapped = int(kv_cache.physical_bytes)
    booked = pool_bytes(identity)
    if session is None or mapped == booked:
        return
    holds = None
    if mapped < booked and not state.final:
        holds = {KV_SIZING_HOLD: session.held_bytes(KV_SIZING_HOLD) + booked - mapped}
    session.report(kv_budget.REPORTER, {POOL: mapped} if mapped else {},
                   usage=_views(state, int(kv_cache.num_committed_blocks), mapped), holds=holds)
    log.info("event=vllm_kv_extensible_committed rank=%d blocks=%d of=%d kv_extensible=%s kv_sizing_hold=%s",
             identity.tp_rank, int(kv_cache.num_committed_blocks), int(kv_cache.capacity_blocks), format_bytes(mapped),
             format_bytes(session.held_bytes(KV_SIZING_HOLD)))


def admitted_blocks(kv_cache: Any, identity: WorkerIdentity) -> int:
    """The most blocks whose physical footprint the broker admitted (never below what is committed)."""
    return max(int(kv_cache.blocks_within(admitted_bytes(identity))), int(kv_cache.num_committed_blocks))


# ------------------------------------------------------------------------------- wrappers
def wrap_commit(original: Callable[..., None]) -> Callable[..., None]:
    def commit(self: Any, num_blocks: int, defragment: bool = False, shrink: bool = False) -> None:
        state = _governed(self)
        if state is None:
            return original(self, num_blocks, defragment, shrink)
        admit(state, self, planned_bytes(self, num_blocks, defragment, shrink), int(num_blocks))
        try:
            return original(self, num_blocks, defragment, shrink)
        finally:
            settle(state, self)

    return wrap_once(original, commit)


def wrap_committable_blocks(original: Callable[..., int]) -> Callable[..., int]:
    def committable_blocks(self: Any) -> int:
        blocks = original(self)
        state = _governed(self)
        if state is None:
            return blocks
        return min(int(blocks), admitted_blocks(self, state.identity))

    return wrap_once(original, committable_blocks)


def wrap_free(original: Callable[..., None]) -> Callable[..., None]:
    def free(self: Any) -> None:
        original(self)
        state = process_state.part(_Caches).by_cache.pop(self, None)
        session = sessions.session(state.identity) if state is not None else None
        if session is not None:
            session.forget(kv_budget.REPORTER)

    return wrap_once(original, free)


def wrap_measure(original: Callable[..., int]) -> Callable[..., int]:
    def measure_kv_cache_blocks(kv_cache: Any, *args: Any, **kwargs: Any) -> int:
        measured = original(kv_cache, *args, **kwargs)
        state = _governed(kv_cache)
        if state is None:
            return measured
        admitted = admitted_blocks(kv_cache, state.identity)
        if measured > admitted:
            log.info("event=vllm_kv_extensible_capped rank=%d measured_blocks=%d admitted_blocks=%d "
                     "detail=the_broker_admitted_less_than_vllm_measured_free", state.identity.tp_rank, measured, admitted)
        return min(int(measured), admitted)

    return wrap_once(original, measure_kv_cache_blocks)


def wrap_extend_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    def extend_kv_cache(self: Any, num_blocks: int, *args: Any, **kwargs: Any) -> Any:
        result = original(self, num_blocks, *args, **kwargs)
        kv_cache = getattr(getattr(self, "model_runner", None), "extensible_kv_cache", None)
        state = _governed(kv_cache)
        session = sessions.existing(state.identity) if state is not None else None
        if kv_cache is not None and state is not None and session is not None:
            state.final = True
            left = session.held_bytes(KV_SIZING_HOLD)
            if left:
                session.hold(KV_SIZING_HOLD, 0)
            log.info("event=vllm_kv_extended rank=%d blocks=%d kv_extensible=%s hold_given_back=%s",
                     state.identity.tp_rank, int(kv_cache.num_committed_blocks),
                     format_bytes(pool_bytes(state.identity)), format_bytes(left))
        return result

    return wrap_once(original, extend_kv_cache)


def apply_extensible_kv_cache(module: Any) -> None:
    """``ExtensibleKVCache.commit``, ``.committable_blocks`` and ``.free``, and the module's
    ``measure_kv_cache_blocks`` (``gpu_worker`` imports it from here, after this patch)."""
    wrap_methods(module, CLASS_NAME, {"commit": wrap_commit, "committable_blocks": wrap_committable_blocks,
                                      "free": wrap_free})
    measure = vars(module).get("measure_kv_cache_blocks")
    if not callable(measure):
        raise PatchError(f"{module.__name__} has no measure_kv_cache_blocks")
    module.measure_kv_cache_blocks = wrap_measure(measure)


def apply_gpu_worker(module: Any) -> None:
    """``Worker.extend_kv_cache`` in ``vllm.v1.worker.gpu_worker``; its ``measure_kv_cache_blocks``
    binding too, in case the module was imported before the extensible cache's patch applied."""
    wrap_methods(module, "Worker", {"extend_kv_cache": wrap_extend_kv_cache})
    measure = vars(module).get("measure_kv_cache_blocks")
    if callable(measure):
        module.measure_kv_cache_blocks = wrap_measure(measure)


def reset() -> None:
    """Forget every cache (tests)."""
    process_state.forget(_Caches)
