"""kvcached mode in SGLang: pool limits change only at the scheduler's sync points, in agreement.

SGLang admits a request by ``available_size()`` (plus what the radix cache could evict) and
then allocates; a None from the allocator raises ``RuntimeError("... out of memory")`` in
``mem_cache/allocation.py`` and stops the scheduler.  Every TP rank (attention-TP rank under
DP attention) runs the same scheduler on the same requests; capacities that differ make them
schedule differently and the model's collectives hang.  So here:

* every kvcached pool's limit goes through :class:`~..kvcached.agreement.AgreedLimits`
  (``limits.set_factory``): the governor's thread only *wants* a limit (at most its grant);
* the **sync point** is the end of ``Scheduler.ingest_requests`` (0.5.2x: the top of every
  iteration of ``event_loop_normal``, ``event_loop_overlap``, ``event_loop_pp*`` and the
  disaggregation loops) or, where that does not exist (0.5.12-0.5.13), the end of
  ``Scheduler.process_input_requests``, which those loops call right after receiving.  Every
  :data:`SYNC_EVERY` calls, a count every rank keeps alike (never wall-clock or local state),
  :meth:`Agreement.sync` runs ONE MIN all-reduce over the scheduling group's CPU (gloo) group
  (:func:`parallel.scheduling_group`), evicts the agreed amount from ``scheduler.tree_cache``
  (identical trees, identical evictions) and applies the agreed limit with
  ``set_memory_limit``.  TP=1: the same, without the collective;
* each pool gets a prefix-cache eviction hook (the ``eviction.py`` contract: queue for the
  scheduler, return 0), so broker pressure evicts unused prefix blocks at the next sync.

So ``available_size()`` cannot change between admission and allocation, and a refused grant
is a scheduling miss (the limit simply does not rise), never an exception in SGLang.

Pipeline parallelism: each stage agrees within its own TP group.  Stages schedule the same
requests independently, so their capacities should agree too; an all-reduce across stages at
this point would wait on the stage-to-stage request relay, so it is not done: a warning says
so once (``event=kvcached_sglang_pipeline``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..kvcached import agreement, eviction, identity, kvcached_api, limits
from ..patching import wrap_methods, wrap_once
from .. import announce, process_state
from . import dsv4_reservation, parallel

log = announce.logger("kvcached_broker.adapters.sglang")

#: Sync every this many scheduler iterations (every rank counts alike).
SYNC_EVERY = 1


class _Installed:
    """Whether this process's kvcached pools were routed through sync points (``done``).  Hook
    wiring: the patches that install it do not run again, so a reset keeps it."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.done = False


def install() -> None:
    """Route this process's kvcached pools through sync points, and name their sessions after
    SGLang's TP rank (idempotent; done when SGLang's scheduler or pool builder is patched)."""
    installed = process_state.part(_Installed)
    if installed.done:
        return
    installed.done = True
    limits.set_factory(agreement.channel_factory(agreement.shared()))
    identity.set_resolver(_identity)


def _identity(geometry: Any):
    """The broker identity of a kvcached pool in this SGLang rank (its TP rank, device)."""
    dsv4_reservation.before_kvcached_grant()
    return parallel.identity(_kvcached_device())


def _kvcached_device() -> str:
    found = kvcached_api.integration("sglang")
    return str((found.device if found is not None else None) or "cuda")


# ---------------------------------------------------------------------------- the sync point
class _Steps:
    """Per scheduler: how many iterations it ran (the deterministic sync schedule), and the
    group it syncs over (resolved once: SGLang's groups exist before its event loop starts, and
    do not change)."""

    def __init__(self) -> None:
        self.count = 0
        self.group: parallel.RankGroup | None = None


class _SyncPoints:
    """This process's schedulers' :class:`_Steps` (by the scheduler's ``id``; each touched by its
    scheduler's thread only), and whether the pipeline warning was said (said once)."""

    def __init__(self) -> None:
        self.steps: dict[int, _Steps] = {}
        self.said_pipeline = False


def after_ingest(scheduler: Any) -> agreement.SyncRecord | None:
    """The scheduler received this iteration's requests: sync if the schedule says so.

    Never raises into SGLang.  Every step that can fail before the collective is contained so
    that the collective itself still runs, once per sync point, on every rank: the prefix-cache
    hook and the pipeline warning are guarded, the group is resolved once per scheduler, and
    :meth:`~..kvcached.agreement.Agreement.sync` calls its reduce exactly once whatever fails
    before it.  A failure that leaves a rank unable to take part (no group at its first sync)
    is logged as such."""
    try:
        steps = process_state.part(_SyncPoints).steps.setdefault(id(scheduler), _Steps())
        steps.count += 1
        if steps.count % SYNC_EVERY:
            return None
        _guarded("pipeline_warning", _say_pipeline_once)
        _guarded("prefix_cache_hook", lambda: _hook_prefix_cache(scheduler))
        if steps.group is None:
            steps.group = parallel.scheduling_group()
        group = steps.group
    except Exception as exc:  # noqa: BLE001 - only resolving the group can fail here
        log.error("event=kvcached_sync_skipped error=%r detail=no scheduling group: this rank cannot take part "
                  "in this sync point", str(exc))
        return None
    reduce = group.reduce_min_each if group.size > 1 else None
    try:
        return agreement.shared().sync(reduce, lambda asks: evict_prefix_cache(scheduler, asks))
    except Exception as exc:  # noqa: BLE001 - a failed collective (a peer gone) must not stop this rank here
        log.warning("event=kvcached_sync_failed error=%r", str(exc))
        return None


def _guarded(action: str, call: Callable[[], None]) -> None:
    """Work before the collective: a failure is logged, and the sync point goes on."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the collective must still run on this rank
        log.warning("event=kvcached_sync_step_failed action=%s error=%r", action, str(exc))


def _say_pipeline_once() -> None:
    sync_points = process_state.part(_SyncPoints)
    if not sync_points.said_pipeline and parallel.pipeline_size() > 1:
        sync_points.said_pipeline = True
        log.warning("event=kvcached_sglang_pipeline detail=pipeline stages agree on kvcached pool limits "
                     "within their own TP group only")


# ---------------------------------------------------------------------------- the prefix cache
class QueuedEviction:
    """A pool's eviction hook: queue for the scheduler's next sync point, free nothing now."""

    def __init__(self, manager: Any):
        self._manager = manager

    def evict(self, pages: int) -> int:
        agreement.shared().request_eviction(self._manager, pages)
        return 0


def _hook_prefix_cache(scheduler: Any) -> None:
    """Every pool of a scheduler whose radix cache can evict gets a :class:`QueuedEviction`."""
    tree_cache = getattr(scheduler, "tree_cache", None)
    if tree_cache is None or not _shares_prefixes(tree_cache):
        return
    for _governor, manager in agreement.ordered_pools():
        if eviction.hook_for(manager) is None:
            eviction.register_eviction_hook(manager, QueuedEviction(manager))


def _shares_prefixes(tree_cache: Any) -> bool:
    check = getattr(tree_cache, "supports_prefix_sharing", None)
    return bool(check()) if callable(check) else not getattr(tree_cache, "disable", True)


def evict_prefix_cache(scheduler: Any, asks: list[tuple[Any, int]]) -> int:
    """Evict what the sync agreed (pool pages per pool) from the scheduler's radix cache, in
    SGLang tokens; the tokens it evicted.  Scheduler thread only."""
    tree_cache = getattr(scheduler, "tree_cache", None)
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if tree_cache is None or not _shares_prefixes(tree_cache):
        return 0
    tokens_per_block = int(getattr(allocator, "page_size", 1) or 1)
    tokens = max(pages * tokens_per_page(manager, tokens_per_block) for manager, pages in asks)
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    result = tree_cache.evict(EvictParams(num_tokens=tokens))
    evicted = int(getattr(result, "num_tokens_evicted", 0) or 0)
    log.info("event=kvcached_prefix_evicted tokens_asked=%d tokens_evicted=%d", tokens, evicted)
    return evicted


def tokens_per_page(manager: Any, tokens_per_block: int) -> int:
    """SGLang tokens in one kvcached pool page (blocks per compound page x tokens per block)."""
    return max(1, int(manager.page_size) // max(1, int(manager.block_mem_size))) * tokens_per_block


# ---------------------------------------------------------------------------- the patch
def wrap_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        after_ingest(self)
        return result

    return wrap_once(original, step)


def apply_scheduler(module: Any) -> None:
    """Patch ``Scheduler.ingest_requests`` (or ``process_input_requests`` where there is no
    ``ingest_requests``) in ``sglang.srt.managers.scheduler``."""
    install()
    cls = getattr(module, "Scheduler", None)
    name = "ingest_requests" if cls is not None and "ingest_requests" in vars(cls) else "process_input_requests"
    wrap_methods(module, "Scheduler", {name: wrap_step})
