"""kvcached as the adapters reach it: the one module of ``adapters/`` that imports kvcached or
reads anything of it beyond the public calls listed here.

**Public API of kvcached 0.1.6, called directly** (by the governor, its limit channels and the
patches): ``KVCacheManager.set_memory_limit(limit_bytes, *, revision)`` and
``memory_limit_state()``, the revisioned limit; ``PageAllocator``'s counters and ``resize``,
``trim``, ``get_resize_target``, the native binding's own interface; the module global
``kvcached.kv_cache_manager.PageAllocator`` and ``KVCacheManager``'s methods, which the patch
table names (:mod:`.patches`, and the SGLang and vLLM patches that wrap kvcached's own);
``kvcached.observability``'s ``get_capabilities()`` and ``get_runtime_owned_reservations()``
(:func:`capabilities`, :func:`runtime_owned_reservations`) and each integration's
``observability_snapshot()`` (:func:`integration`); which classes kvcached defines
(:func:`defines_class`) and the elastic allocators its SGLang patch puts in SGLang's allocator
module (:data:`SGLANG_ELASTIC_ALLOCATORS`).

**What 0.1.6 has no public form for**, each read here and nowhere else (a test holds the rest of
the adapters to it, ``tests/adapters/kvcached/test_kvcached_contact.py``):

* whether the manager's post-init ran (``_post_init_done``, a ``threading.Event``): before it,
  the null block may be waiting for a grant and no manager call returns;
* the manager's lock (``_lock``; ``kvcached.locks.NoOpLock`` under synchronous scheduling) and
  its post-init wait (``_wait_post_init``): :func:`make_lock_real`;
* the limit's current revision: ``memory_limit_state()["revision"]`` once the manager runs; the
  attribute behind it (``_memory_limit_revision``) only where that call is missing;
* which runtime's integration was initialised in this process, and on which device, where its
  ``observability_snapshot()`` is missing (``kvcached.integration.<runtime>.interfaces``:
  ``_kvcached_initialized``, ``_kvcached_device``);
* broadcast mode's process facts: ``kvcached.integration.vllm.interfaces`` (whether this
  process is a TP worker, its world size and device, ``should_use_worker_ipc``),
  ``kvcached.tp_ipc_util._listeners`` (this worker's listener), ``kvcached.utils``
  (``PAGE_SIZE``, ``get_tp_socket_dir``).

The functions that read (post-init, the revision, the process facts, the observability
records) never raise where kvcached is absent or differs: they answer False, -1 or None.  :func:`make_lock_real`, :func:`page_size`
and :func:`tp_socket_dir` import kvcached: they are called only where kvcached built the pool,
and a failure there is the caller's to contain (a pool's start fails safe, :mod:`.patches`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from dataclasses import dataclass
from typing import Any, ContextManager, TypeGuard

_VLLM_INTERFACES = "kvcached.integration.vllm.interfaces"
_TP_IPC_UTIL = "kvcached.tp_ipc_util"


# ------------------------------------------------------------ a manager
@dataclass(frozen=True)
class LimitState:
    """What kvcached says of a pool's revisioned memory limit: ``set_memory_limit``'s answer or
    ``memory_limit_state()``, read here once (:meth:`of`) so no other module indexes its map.

    ``status`` (0.1.6): ``applied``; ``deferred`` (blocks in use above the limit: it finishes as
    they are freed); ``stale`` (a revision older than the current one); ``conflict`` (the current
    revision with another limit); ``rejected`` (quarantined pages prevent the resize).
    ``effective_limit_bytes``: the limit in whole pages of all layers (None: no limit set yet)."""

    status: str
    reason: str = ""
    revision: int = -1
    effective_limit_bytes: int | None = None

    @property
    def deferred(self) -> bool:
        return self.status == "deferred"

    @classmethod
    def of(cls, state: Any) -> LimitState:
        """kvcached's map; a field missing or of another type reads as the default (a status as
        ``unknown``)."""
        get = state.get if isinstance(state, dict) else (lambda key: None)
        status, reason, revision, effective = get("status"), get("reason"), get("revision"), get("effective_limit_bytes")
        return cls(status=status if isinstance(status, str) else "unknown",
                   reason=reason if isinstance(reason, str) else "",
                   revision=revision if _is_int(revision) else -1,
                   effective_limit_bytes=effective if _is_int(effective) else None)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def limit_state(manager: Any) -> LimitState:
    """``manager.memory_limit_state()``, read."""
    return LimitState.of(manager.memory_limit_state())


def post_init_done(manager: Any) -> bool:
    """True once the manager's post-init thread reserved its null block (its calls return)."""
    done = getattr(manager, "_post_init_done", None)
    return bool(done is not None and done.is_set())


def limit_revision(manager: Any) -> int:
    """The revision of the manager's current memory limit (-1: none yet, or unreadable)."""
    state = getattr(manager, "memory_limit_state", None)
    if state is not None:
        try:
            revision = LimitState.of(state()).revision
        except Exception:  # noqa: BLE001 - a revision unread is -1: the governor's own stays newer
            revision = -1
        if revision != -1:
            return revision
    revision = getattr(manager, "_memory_limit_revision", -1)
    return revision if _is_int(revision) else -1


def held_lock(manager: Any) -> ContextManager[Any]:
    """The manager's lock, held for a change kvcached's post-init thread must see whole (a
    no-op context where there is no manager yet)."""
    lock = getattr(manager, "_lock", None) if manager is not None else None
    return lock if lock is not None else contextlib.nullcontext()


def make_lock_real(manager: Any) -> None:
    """A governed manager's lock, real from construction (before the engine can call it).

    kvcached uses a no-op lock under synchronous scheduling; the governor's thread changes the
    limit while the engine allocates, so the lock must be real, and swapping it while the engine
    is inside a call would not exclude that call.  One hazard of a real lock: kvcached's
    ``alloc``/``free``/``resize`` wait for its post-init (the null block, which may wait for a
    grant) while holding it, and the post-init thread needs it to reserve the null block.  So a
    governed manager's ``_wait_post_init`` releases the lock while it waits and takes it back
    after, as a condition variable does (CPython's ``RLock`` save/restore): every caller waits
    before it reads any state."""
    from kvcached.locks import NoOpLock

    if isinstance(manager._lock, NoOpLock):
        manager._lock = threading.RLock()
    lock, done = manager._lock, manager._post_init_done
    if not all(hasattr(lock, name) for name in ("_is_owned", "_release_save", "_acquire_restore")):
        return

    def _wait_post_init() -> None:
        if done.is_set():
            return
        if not lock._is_owned():
            done.wait()
            return
        state = lock._release_save()
        try:
            done.wait()
        finally:
            lock._acquire_restore(state)

    manager._wait_post_init = _wait_post_init


# ------------------------------------------------------------ the process
def defines_class(cls: type) -> bool:
    """True for a class kvcached defines (its elastic pools and allocators)."""
    module = getattr(cls, "__module__", "") or ""
    return module == "kvcached" or module.startswith("kvcached.")


@dataclass(frozen=True)
class Integration:
    """kvcached's integration for one runtime in this process."""

    initialised: bool  # init_kvcached ran (and no shutdown_kvcached since)
    device: Any  # the device it was initialised on, as kvcached holds it (None before)


def integration(runtime: str) -> Integration | None:
    """kvcached's integration for ``runtime`` (``sglang``, ``vllm``) as its public
    ``observability_snapshot()`` says (the module's own names where that call is missing or
    fails); None where that integration is not imported in this process."""
    module = sys.modules.get(f"kvcached.integration.{runtime}.interfaces")
    if module is None:
        return None
    snapshot = getattr(module, "observability_snapshot", None)
    try:
        found = snapshot() if callable(snapshot) else None
    except Exception:  # noqa: BLE001 - an unreadable snapshot: the module's own names say it
        found = None
    if found is None:
        return Integration(bool(getattr(module, "_kvcached_initialized", False)),
                           getattr(module, "_kvcached_device", None))
    return Integration(bool(getattr(found, "initialized", False)), getattr(found, "device", None))


def initialised_device(runtime: str) -> Any:
    """The device kvcached's integration for ``runtime`` (``sglang``, ``vllm``) was initialised
    on in this process (``init_kvcached``); None where it was not."""
    found = integration(runtime)
    if found is None or not found.initialised:
        return None
    return found.device or ""


#: kvcached's elastic allocator classes, by the name its SGLang patch gives each in
#: ``sglang.srt.mem_cache.allocator``, with the name of SGLang's own class it replaces there
SGLANG_ELASTIC_ALLOCATORS = {
    "ElasticPagedTokenToKVPoolAllocator": "PagedTokenToKVPoolAllocator",
    "ElasticTokenToKVPoolAllocator": "TokenToKVPoolAllocator",
}


# ------------------------------------------------------------ observability
def _observability() -> Any:
    """``kvcached.observability`` where kvcached is imported in this process (imported now if it
    is not yet); None where kvcached is not, or that module cannot be imported."""
    module = sys.modules.get("kvcached.observability")
    if module is None and "kvcached" in sys.modules:
        try:
            module = importlib.import_module("kvcached.observability")
        except ImportError:
            return None
    return module


def capabilities() -> Any:
    """``kvcached.observability.get_capabilities()``: the surfaces the installed kvcached says it
    has (a dict: ``features`` by name); None where kvcached is not imported or the call fails."""
    get = getattr(_observability(), "get_capabilities", None)
    try:
        return get() if callable(get) else None
    except Exception:  # noqa: BLE001 - an unreadable record is no record
        return None


def runtime_owned_reservations() -> list[Any] | None:
    """``kvcached.observability.get_runtime_owned_reservations()``: the runtime-owned pools
    kvcached reports itself (entries with a ``pool_name``); None where it has no such call or
    the call fails."""
    listing = getattr(_observability(), "get_runtime_owned_reservations", None)
    try:
        return list(listing()) if callable(listing) else None
    except Exception:  # noqa: BLE001 - unreadable: the caller decides what an unknown listing means
        return None


# ------------------------------------------------------------ broadcast mode
def uses_worker_ipc() -> bool:
    """kvcached's vLLM integration maps this process's pools in its TP workers (EngineCore)."""
    try:
        from kvcached.integration.vllm.interfaces import should_use_worker_ipc
    except ImportError:
        return False
    return bool(should_use_worker_ipc())


@dataclass(frozen=True)
class TpWorker:
    """This process as one of kvcached's TP workers (vLLM's multiproc executor)."""

    tp_size: int
    tp_rank: int
    pp_rank: int
    device: Any  # the worker's kvcached device, as kvcached's vLLM integration set it


def tp_worker() -> TpWorker | None:
    """This process's place among kvcached's TP workers, where it is one and runs its listener."""
    interfaces = sys.modules.get(_VLLM_INTERFACES)
    listener = listener_ranks()
    if listener is None or interfaces is None or not getattr(interfaces, "_is_worker", False):
        return None
    return TpWorker(max(1, int(getattr(interfaces, "_world_size", 1))), listener[0], listener[1],
                    getattr(interfaces, "_kvcached_device", None))


def listener_ranks() -> "tuple[int, int] | None":
    """(tp rank, pp rank) of this process's kvcached listener, if it runs one."""
    tp_ipc_util = sys.modules.get(_TP_IPC_UTIL)
    listeners = getattr(tp_ipc_util, "_listeners", None) or {}
    return next(iter(listeners), None)


def page_size() -> int:
    """kvcached's ``PAGE_SIZE``: bytes of one layer's K (or V) per page id."""
    from kvcached.utils import PAGE_SIZE

    return int(PAGE_SIZE)


def tp_socket_dir() -> str:
    """The directory of this engine instance's kvcached TP sockets (names its boards)."""
    from kvcached.utils import get_tp_socket_dir

    return str(get_tp_socket_dir())
