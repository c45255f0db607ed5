"""The kvcached patch: every ``KVCacheManager`` kvcached creates gets a governed allocator.

One patch, applied right after ``kvcached.kv_cache_manager`` is imported (kvcached in the range
of the table of supported releases, ``adapters/support.py``), however the manager is reached (``kvcached.integration.{sglang,vllm}
.interfaces.get_kv_cache_manager``, vLLM's ``ElasticBlockPool``, or directly):

* the module global ``PageAllocator``, which ``KVCacheManager.__init__`` calls, builds
  kvcached's real allocator and hands back a :class:`GovernedPageAllocator` sized to the
  broker's first grant (:mod:`.allocator`, :mod:`.governor`).  Nothing raises into
  ``KVCacheManager.__init__``: a governor that cannot start (a resolver error, a refused
  runtime base, an eviction) leaves the pool ungoverned with one warning, and only under
  ``KVCACHED_REQUIRE=1`` is it a start-up error (:class:`~..sessions.BrokerRequired`);
* ``KVCacheManager.__init__`` then makes a governed manager's lock real (:func:`.kvcached_api.make_lock_real`),
  attaches the governor and wraps the instance's ``alloc`` and ``free`` to wake the governors'
  thread when the pool runs short or holds too much;
* ``KVCacheManager.set_memory_limit`` from outside the broker's own code, on a governed pool,
  is an operator cap (:meth:`~.governor.PoolGovernor.outside_limit`), never a licence to map
  beyond the grant;
* ``shutdown`` gives back the grant above what kvcached still maps.

Every wrapper goes on once (:func:`..patching.wrap_once`, :func:`..patching.wrap_methods`).

A pool in broadcast mode (``world_size > 1``, or vLLM's EngineCore, whose pages are mapped in
the workers) is governed with every worker's grant (:mod:`.broadcast.board_grants`): each TP
worker holds its own GPU's grant (:mod:`.broadcast.worker_grants`, registered when kvcached
creates its KV tensors) and bounds what kvcached's listener maps there
(:mod:`.broadcast.map_gate`, on ``kvcached.tp_ipc_util``).
"""

from __future__ import annotations

import os
from typing import Any

from ...client.units import parse_size
from .. import announce, flags, support
from ..patching import Patch, Target, wrap_methods, wrap_once
from ..sessions import BrokerRequired
from . import identity, kvcached_api, limits, pressure, runner, segment, shm_files
from .broadcast import board_grants, map_gate, worker_grants
from .allocator import GovernedPageAllocator
from .geometry import PoolGeometry
from .governor import PoolGovernor
from .grants import SessionGrants
from .policy import DEFAULT_BATCH_BYTES, Watermarks

log = announce.logger("kvcached_broker.adapters")

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
    return geometry.world_size > 1 or kvcached_api.uses_worker_ipc()


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
    _start(governor)
    if governor.governed:
        pressure.enlist(grants.client, governor)
    return governor


def _start(governor: PoolGovernor) -> None:
    """Take the first grant; a start that fails midway gives back what it was granted."""
    try:
        governor.start()
    except BaseException:
        governor.abandon()
        raise


def _board_governor(geometry: PoolGeometry, real: Any, marks: Watermarks) -> PoolGovernor:
    """A broadcast-mode pool: its limit is at most what every TP worker was granted (the board)."""
    grants, why = board_grants.open_grants(geometry, real)
    if grants is None:
        return _ungoverned(geometry, real, marks, f"broadcast mode: {why}")
    governor = PoolGovernor(geometry, real, grants, marks, limits=limits.channel_for(geometry))
    _start(governor)
    grants.sized()
    return governor


def _ungoverned(geometry: PoolGeometry, real: Any, marks: Watermarks, why: str) -> PoolGovernor:
    log.warning("event=kvcached_pool_ungoverned group=%d ipc=%s reason=%r detail=runs_as_kvcached_alone",
                geometry.group_id, geometry.ipc_name, why)
    # Its channel too: a runtime whose limits change only where its TP ranks agree (SGLang) keeps
    # an ungoverned pool's kvctl watcher from resizing it on this rank alone (resize_target).
    return PoolGovernor(geometry, real, None, marks, limits=limits.channel_for(geometry), why_ungoverned=why)


def _allocator_factory(real_class: type):
    def build(*args: Any, **kwargs: Any) -> GovernedPageAllocator:
        geometry = geometry_of(args, kwargs)
        member, untrusted = _attach_segment(geometry)  # before kvcached's tracker opens it
        try:
            real = real_class(*args, **kwargs)
        except BaseException:
            if member is not None:
                member.leave()
            raise
        governor = _governor_or_ungoverned(geometry, real)
        governor.kvctl.member = member
        if untrusted:
            governor.kvctl.untrusted(untrusted)
        return GovernedPageAllocator(real, governor)

    return build


def _attach_segment(geometry: PoolGeometry) -> "tuple[segment.Membership | None, str]":
    """Make the pool's segment this user's own before kvcached opens it (so kvcached's ``0666``
    never applies), collect the segments of servers that are gone, and take part in it:
    (membership, "") or (None, why the segment is not trusted).  Never raises."""
    try:
        return segment.attach(geometry.ipc_name), ""
    except shm_files.UnsafeFile as exc:
        return None, str(exc)
    except OSError as exc:  # no /dev/shm to write: kvcached finds out for itself
        log.warning("event=kvcached_segment_unattached ipc=%s error=%r", geometry.ipc_name, str(exc))
        return None, ""


def _governor_or_ungoverned(geometry: PoolGeometry, real: Any) -> PoolGovernor:
    """:func:`new_governor`, failing safe: whatever it raises leaves the pool to kvcached alone
    (its allocator at its whole virtual size, one warning), or, under ``KVCACHED_REQUIRE=1``,
    is a start-up error.  kvcached's allocator maps nothing yet, so resizing it cannot fail."""
    try:
        return new_governor(geometry, real)
    except BrokerRequired:
        raise
    except Exception as exc:  # nothing raises into KVCacheManager.__init__
        why = f"governor failed at pool start ({type(exc).__name__}: {exc})"
        if flags.required():
            raise BrokerRequired(f"kvcached-broker is required (KVCACHED_REQUIRE=1) but cannot govern the kvcached "
                                 f"pool of group {geometry.group_id} ({geometry.ipc_name}): {why}") from exc
        governor = _ungoverned(geometry, real, Watermarks.for_page_bytes(geometry.page_bytes, batch_bytes()), why)
        governor.resize_before_post_init(None, geometry.virtual_pages)  # whatever a failed start left
        return governor


def _wrap_engine_calls(manager: Any, governor: PoolGovernor) -> None:
    """Instance ``alloc``/``free``/``available_size`` that wake the governors' thread when the
    pool needs it.

    While the broker charges the pool's session for fewer pages than its pools hold (a broker
    restart whose re-assertion came back short), ``available_size()`` says 0 until they went
    back, so the runtime admits nothing new; until they were asked back, an allocation is a
    scheduling miss unless the pool's limits change only at sync points (SGLang): there a request
    admitted before the shortfall is allocated (admission and allocation always see the same
    pool), and the shortfall goes back at the next sync point."""
    alloc, free, available_size = manager.alloc, manager.free, manager.available_size
    at_sync_points = governor.limits.at_sync_points

    def governed_available_size() -> int:
        if governor.charge_short():
            runner.wake()
            return 0
        return available_size()

    def governed_alloc(need_size: int):
        if not at_sync_points and governor.charge_unsettled():  # a short re-assertion not yet asked back
            governor.note_miss()
            runner.wake()
            return None
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
    manager.available_size = governed_available_size


def _wrap_init(init):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        allocator = self.page_allocator
        if not isinstance(allocator, GovernedPageAllocator):
            return
        governor = allocator.governor
        try:
            if governor.governed:
                kvcached_api.make_lock_real(self)
            governor.attach(self)
            if governor.governed:
                _wrap_engine_calls(self, governor)
            runner.enlist(governor)  # an ungoverned pool only shows in status(), saying why
        except Exception as exc:  # nothing raises into KVCacheManager.__init__
            if flags.required():
                raise BrokerRequired(f"kvcached-broker is required (KVCACHED_REQUIRE=1) but cannot govern the "
                                     f"kvcached pool {governor.key}: {type(exc).__name__}: {exc}") from exc
            governor._ungovern(f"governor failed at pool start ({type(exc).__name__}: {exc})")

    return wrap_once(init, __init__)


def _wrap_shutdown(shutdown):
    def governed_shutdown(self) -> bool:
        done = shutdown(self)
        allocator = self.page_allocator
        if done and isinstance(allocator, GovernedPageAllocator):
            allocator.governor.close()
        return done

    return wrap_once(shutdown, governed_shutdown)


def _wrap_set_memory_limit(set_memory_limit):
    def governed_set_memory_limit(self, limit_bytes: int, *, revision: int):
        allocator = getattr(self, "page_allocator", None)
        governor = allocator.governor if isinstance(allocator, GovernedPageAllocator) else None
        if governor is None or not governor.governed or limits.is_own_limit_call(self):
            return set_memory_limit(self, limit_bytes, revision=revision)
        return governor.outside_limit(self, int(limit_bytes), int(revision))

    return wrap_once(set_memory_limit, governed_set_memory_limit)


def patch_kv_cache_manager(module: Any) -> None:
    module.PageAllocator = wrap_once(module.PageAllocator, _allocator_factory(module.PageAllocator))
    wrap_methods(module, "KVCacheManager", {"__init__": _wrap_init, "shutdown": _wrap_shutdown,
                                            "set_memory_limit": _wrap_set_memory_limit})


_SUPPORTED = support.KVCACHED.supported
PATCHES = [
    Patch("kvcached_pool_governor", "kvcached", "kvcached.kv_cache_manager", patch_kv_cache_manager,
          minimum=_SUPPORTED.minimum, below=_SUPPORTED.below,
          targets=(Target("PageAllocator"), Target("KVCacheManager.__init__", ("self",)),
                   Target("KVCacheManager.shutdown", ("self",)),
                   Target("KVCacheManager.set_memory_limit", ("self", "limit_bytes")))),
    Patch("kvcached_worker_map_gate", "kvcached", "kvcached.tp_ipc_util", map_gate.install,
          minimum=_SUPPORTED.minimum, below=_SUPPORTED.below,
          targets=(Target("_map_to_kv_tensors_with_result", ("offsets", "group_id")),
                   Target("unmap_from_kv_tensors"))),
    Patch("kvcached_worker_board", "kvcached", "kvcached.integration.vllm.interfaces",
          worker_grants.patch_vllm_interfaces, minimum=_SUPPORTED.minimum, below=_SUPPORTED.below, required=False,
          targets=(Target("create_kv_tensors"),)),
]


def layout_patches(version: str) -> list[Patch]:
    """Every patch: kvcached has one module layout in the supported range (the canary)."""
    return list(PATCHES)


def check_flags() -> None:
    """Nothing to refuse: kvcached mode has no flags of its own beyond ``ENABLE_KVCACHED``."""
