"""Under broker pressure, vLLM's prefix cache gives back: cached free blocks evicted on the engine thread.

In kvcached mode EngineCore's scheduler draws blocks from kvcached's ``ElasticBlockPool``.  It
keeps blocks no request uses (ref count 0) in ``_evictable_blocks`` for prefix reuse; kvcached
can unmap a page only once every block on it is freed.  When the broker asks for memory back,
the pool's governor (``adapters/kvcached``) asks this hook to evict about ``pages`` pages' worth
of such blocks, with kvcached's own page-aware ``_evict_blocks_from_pool`` (whole pages first).

The pool's dicts are not locked, and the governor runs on its own thread, so :meth:`evict` only
queues the work; it runs on **the engine thread**, at the first of:

* the scheduler's next ``schedule()`` (``Scheduler.schedule`` is wrapped), when serving; or
* EngineCore's next idle turn, when idle: an idle-state callback is queued
  (``engine_core._idle_state_callbacks``) and a ``WAKEUP`` put on its input queue, which vLLM's
  busy loop (``_process_input_queue``) answers by running the callbacks.

The hook returns 0 (it only queued); the governor releases only what kvcached then reports
unmapped.  It is registered for EngineCore's pool whatever its topology: TP = 1 (the pool maps
in-process) and TP > 1 (broadcast mode) alike.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from ..patching import wrap_methods, wrap_once
from .. import announce, process_state
from ..kvcached import register_eviction_hook, runner

log = announce.logger("kvcached_broker.adapters.vllm")


class PrefixEviction:
    """The eviction hook of one ``ElasticBlockPool`` (sizes in blocks unless a name says pages)."""

    def __init__(self, pool: Any, engine_core: Any = None):
        self._pool = weakref.ref(pool)
        self._engine = weakref.ref(engine_core) if engine_core is not None else None
        self._lock = threading.Lock()
        self._pending_blocks = 0
        self._idle_turn_asked = False
        self.evicted_blocks = 0
        self.runs = 0
        self.last_run = ""  # "schedule" or "idle": where the last eviction ran (status, tests)
        self.last_thread = ""

    # ------------------------------------------------------------ the governor's thread
    def evict(self, pages: int) -> int:
        """Queue the eviction of ``pages`` pages' worth of unused cached blocks; 0 (nothing freed yet)."""
        pool = self._pool()
        if pool is None or pages <= 0:
            return 0
        manager = pool.kv_cache_manager
        blocks = pages * max(1, manager.page_size // max(1, manager.block_mem_size))
        with self._lock:
            self._pending_blocks += blocks
        self._ask_idle_turn()
        return 0

    def pending_blocks(self) -> int:
        with self._lock:
            return self._pending_blocks

    def _ask_idle_turn(self) -> None:
        """When EngineCore idles, it blocks on its input queue: queue a callback and wake it."""
        core = self._engine() if self._engine is not None else None
        callbacks = getattr(core, "_idle_state_callbacks", None)
        inputs = getattr(core, "input_queue", None)
        if callbacks is None or inputs is None:
            return  # no busy loop (an in-process engine): the next schedule() runs it
        with self._lock:
            if self._idle_turn_asked:
                return
            self._idle_turn_asked = True
        from vllm.v1.engine import EngineCoreRequestType

        callbacks.append(lambda _core: self.run_pending("idle"))
        inputs.put_nowait((EngineCoreRequestType.WAKEUP, None))

    # ------------------------------------------------------------ the engine thread
    def run_pending(self, where: str = "schedule") -> int:
        """Evict what was asked (on the engine thread, ``where``: schedule or idle); the blocks freed."""
        with self._lock:
            blocks, self._pending_blocks = self._pending_blocks, 0
            self._idle_turn_asked = False
        pool = self._pool()
        if blocks <= 0 or pool is None:
            return 0
        try:
            freed = int(pool._evict_blocks_from_pool(blocks, page_aware=True))
        except Exception as exc:  # noqa: BLE001 - an eviction that fails frees nothing, never stops the engine
            log.warning("event=vllm_prefix_evict_failed blocks=%d error=%r", blocks, str(exc))
            return 0
        self.evicted_blocks += freed
        self.runs += 1
        self.last_run = where
        self.last_thread = threading.current_thread().name
        log.info("event=vllm_prefix_evicted asked_blocks=%d freed_blocks=%d", blocks, freed)
        runner.wake()  # the governor re-reads what kvcached unmapped
        return freed


class _Hooks:
    """The hook of each live kvcached block pool of this process (weakly keyed: a pool that is
    gone takes its hook with it)."""

    def __init__(self) -> None:
        self.by_pool: "weakref.WeakKeyDictionary[Any, PrefixEviction]" = weakref.WeakKeyDictionary()


def attach(engine_core: Any) -> PrefixEviction | None:
    """Register the hook for EngineCore's scheduler pool if it is kvcached's; None otherwise."""
    pool = getattr(getattr(getattr(engine_core, "scheduler", None), "kv_cache_manager", None), "block_pool", None)
    return attach_pool(pool, engine_core)


def attach_pool(pool: Any, engine_core: Any = None) -> PrefixEviction | None:
    manager = getattr(pool, "kv_cache_manager", None)
    if manager is None or not hasattr(pool, "_evict_blocks_from_pool") or not hasattr(manager, "page_allocator"):
        return None
    hook = PrefixEviction(pool, engine_core)
    process_state.part(_Hooks).by_pool[pool] = hook
    register_eviction_hook(manager, hook)
    log.info("event=vllm_prefix_eviction_attached blocks=%d", int(getattr(pool, "num_gpu_blocks", 0)))
    return hook


def hook_of(pool: Any) -> PrefixEviction | None:
    return process_state.part(_Hooks).by_pool.get(pool) if pool is not None else None


def wrap_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        hook = hook_of(getattr(getattr(self, "kv_cache_manager", None), "block_pool", None))
        if hook is not None and hook.pending_blocks():
            hook.run_pending()
        return original(self, *args, **kwargs)

    return wrap_once(original, schedule)


def apply_scheduler(module: Any) -> None:
    """``vllm.v1.core.sched.scheduler.Scheduler.schedule`` (AsyncScheduler inherits it)."""
    wrap_methods(module, "Scheduler", {"schedule": wrap_schedule})
