"""The kvcached patch: every ``KVCacheManager`` kvcached creates gets a governed allocator.

One patch, applied right after ``kvcached.kv_cache_manager`` is imported (kvcached
``>=0.1.6,<0.1.7``), however the manager is reached (``kvcached.integration.{sglang,vllm}
.interfaces.get_kv_cache_manager``, vLLM's ``ElasticBlockPool``, or directly):

* the module global ``PageAllocator``, which ``KVCacheManager.__init__`` calls, builds
  kvcached's real allocator and hands back a :class:`GovernedPageAllocator` sized to the
  broker's first grant (:mod:`.allocator`, :mod:`.governor`);
* ``KVCacheManager.__init__`` then attaches the governor to the manager and wraps the
  instance's ``alloc`` and ``free`` to wake the governors' thread when the pool runs short or
  holds too much; ``shutdown`` gives the grant back.

A pool in broadcast mode (``world_size > 1``, or vLLM's EngineCore, whose pages are mapped in
the workers) is governed with every worker's grant (:mod:`.board_grants`): each TP worker holds
its own GPU's grant (:mod:`.worker_grants`, registered when kvcached creates its KV tensors) and
bounds what kvcached's listener maps there (:mod:`.map_gate`, on ``kvcached.tp_ipc_util``).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

from ...client.units import parse_size
from ..patching import Patch
from . import board_grants, identity, limits, map_gate, pressure, runner, worker_grants
from .allocator import GovernedPageAllocator
from .geometry import PoolGeometry
from .governor import PoolGovernor
from .grants import SessionGrants
from .policy import DEFAULT_BATCH_BYTES, Watermarks

log = logging.getLogger("kvcached_broker.adapters")

BATCH_ENV = "KVCACHED_BROKER_KV_BATCH"
_ALLOCATOR_PARAMS = ("num_layers", "mem_size_per_layer", "page_size", "world_size", "pp_rank", "async_sched",
                     "contiguous_layout", "enable_page_prealloc", "num_kv_buffers", "group_id", "ipc_name")
_ALLOCATOR_DEFAULTS = {"world_size": 1, "pp_rank": 0, "num_kv_buffers": 2, "group_id": 0, "ipc_name": ""}


def batch_bytes() -> int:
    """``KVCACHED_BROKER_KV_BATCH`` (a size, e.g. ``512MiB``): how much a pool grows by at once."""
    raw = os.environ.get(BATCH_ENV, "").strip()
    if not raw:
        return DEFAULT_BATCH_BYTES
    try:
        return max(1, parse_size(raw))
    except ValueError:
        log.warning("event=bad_flag name=%s value=%r detail=using_default_%d", BATCH_ENV, raw, DEFAULT_BATCH_BYTES)
        return DEFAULT_BATCH_BYTES


def geometry_of(args: tuple, kwargs: dict) -> PoolGeometry:
    """The pool's geometry from ``PageAllocator(...)``'s arguments (the C++ binding's order)."""
    bound = {**_ALLOCATOR_DEFAULTS, **dict(zip(_ALLOCATOR_PARAMS, args)), **kwargs}
    page_size = int(bound["page_size"])
    group_id = int(bound["group_id"])
    return PoolGeometry(
        num_layers=int(bound["num_layers"]), page_size=page_size, num_kv_buffers=int(bound["num_kv_buffers"]),
        virtual_pages=int(bound["mem_size_per_layer"]) // page_size, group_id=group_id,
        world_size=int(bound["world_size"]), pp_rank=int(bound["pp_rank"]),
        ipc_name=str(bound["ipc_name"]) or _default_ipc_name(group_id))


def _default_ipc_name(group_id: int) -> str:
    """The segment kvcached's native tracker names when given none."""
    base = os.environ.get("KVCACHED_IPC_NAME") or f"kvcached_engine_{os.getpgrp()}"
    return base if group_id == 0 else f"{base}_g{group_id}"


def _broadcast_mode(geometry: PoolGeometry) -> bool:
    if geometry.world_size > 1:
        return True
    try:
        from kvcached.integration.vllm.interfaces import should_use_worker_ipc
    except ImportError:
        return False
    return bool(should_use_worker_ipc())


def new_governor(geometry: PoolGeometry, real: Any) -> PoolGovernor:
    """A governor for a pool being built (its first grant taken), or an ungoverned one saying why."""
    marks = Watermarks.for_page_bytes(geometry.page_bytes, batch_bytes())
    if _broadcast_mode(geometry):
        return _board_governor(geometry, real, marks)
    who = identity.resolve(geometry)
    if who is None:
        return _ungoverned(geometry, real, marks, "no broker identity for this pool")
    grants, why = SessionGrants.open(who, geometry)
    if grants is None:
        return _ungoverned(geometry, real, marks, why)
    governor = PoolGovernor(geometry, real, grants, marks, limits=limits.channel_for(geometry))
    governor.start()
    if governor.governed:
        pressure.enlist(grants.client, governor)
    return governor


def _board_governor(geometry: PoolGeometry, real: Any, marks: Watermarks) -> PoolGovernor:
    """A broadcast-mode pool: its limit is at most what every TP worker was granted (the board)."""
    grants, why = board_grants.open_grants(geometry, real)
    if grants is None:
        return _ungoverned(geometry, real, marks, f"broadcast mode: {why}")
    governor = PoolGovernor(geometry, real, grants, marks, limits=limits.channel_for(geometry))
    governor.start()
    grants.sized()
    return governor


def _ungoverned(geometry: PoolGeometry, real: Any, marks: Watermarks, why: str) -> PoolGovernor:
    log.warning("event=kvcached_pool_ungoverned group=%d ipc=%s reason=%r detail=runs_as_kvcached_alone",
                geometry.group_id, geometry.ipc_name, why)
    return PoolGovernor(geometry, real, None, marks, why_ungoverned=why)


def _allocator_factory(real_class: type):
    def build(*args: Any, **kwargs: Any) -> GovernedPageAllocator:
        real = real_class(*args, **kwargs)
        return GovernedPageAllocator(real, new_governor(geometry_of(args, kwargs), real))

    build.__kvcached_broker_real__ = real_class  # type: ignore[attr-defined]
    return build


def _wrap_engine_calls(manager: Any, governor: PoolGovernor) -> None:
    """Instance ``alloc``/``free`` that wake the governors' thread when the pool needs it."""
    alloc, free = manager.alloc, manager.free

    def governed_alloc(need_size: int):
        result = alloc(need_size)
        if governor.note_alloc(need_size, result, manager.block_mem_size):
            runner.wake()
        return result

    def governed_free(indices):
        result = free(indices)
        if governor.note_free():
            runner.wake()
        return result

    manager.alloc = governed_alloc
    manager.free = governed_free


def patch_kv_cache_manager(module: ModuleType) -> None:
    real_class = module.PageAllocator
    if getattr(real_class, "__kvcached_broker_real__", None) is not None:
        return
    module.PageAllocator = _allocator_factory(real_class)
    cls = module.KVCacheManager
    init, shutdown = cls.__init__, cls.shutdown

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        allocator = self.page_allocator
        if isinstance(allocator, GovernedPageAllocator):
            allocator.governor.attach(self)
            if allocator.governor.governed:
                _wrap_engine_calls(self, allocator.governor)
            runner.enlist(allocator.governor)  # an ungoverned pool only shows in status(), saying why

    def governed_shutdown(self) -> bool:
        done = shutdown(self)
        allocator = self.page_allocator
        if done and isinstance(allocator, GovernedPageAllocator):
            allocator.governor.close()
        return done

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls.shutdown = governed_shutdown


PATCHES = [
    Patch("kvcached_pool_governor", "kvcached", "kvcached.kv_cache_manager", patch_kv_cache_manager,
          minimum="0.1.6", below="0.1.7"),
    Patch("kvcached_worker_map_gate", "kvcached", "kvcached.tp_ipc_util", map_gate.install,
          minimum="0.1.6", below="0.1.7"),
    Patch("kvcached_worker_board", "kvcached", "kvcached.integration.vllm.interfaces",
          worker_grants.patch_vllm_interfaces, minimum="0.1.6", below="0.1.7", required=False),
]


def check_flags() -> None:
    """Nothing to refuse: kvcached mode has no flags of its own beyond ``ENABLE_KVCACHED``."""
