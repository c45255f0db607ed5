"""Bytes held by SGLang's memory-pool objects, read from their real tensors.

No SGLang pool reports its own size reliably (DeepSeek-V4 pools leave ``mem_usage`` at 0 and
have no ``get_kv_size_bytes``), so the adapter walks the object: its attributes, lists, tuples
and dicts, down into the SGLang objects they hold, and sums every distinct tensor storage
once (views and alias attributes share storage; see ``adapters/tensors.py``).

A pool that kvcached manages (kvcached mode; a ``kvcached.*`` class, or one marked managed) is
*managed*: it is never reported as a static reservation, and its storages are claimed so that a walk of the
pool that contains it does not count them either.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..kvcached import kvcached_api
from ..tensors import storage_bytes, storage_key

#: Set on a pool object whose memory is managed elsewhere (kvcached), never reserved statically.
MANAGED_ATTR = "_kvcached_broker_managed"
#: Attributes that lead to machinery or to memory owned elsewhere, never followed.
SKIPPED_ATTRS = frozenset({
    "memory_saver_adapter",  # torch_memory_saver handle
    "custom_mem_pool",  # an allocator pool object, not a buffer
    "layer_transfer_counter",  # HiCache bookkeeping
    "full_to_swa_index_mapping",  # the SWA allocator's table, registered on the pool later
    "_kvcache",  # an allocator's back-reference to its pool
    "host_allocator",  # a fused draft pool's reference to the target's allocator (0.5.23)
})
_MAX_DEPTH = 5


def is_tensor(obj: Any) -> bool:
    return hasattr(obj, "untyped_storage") and hasattr(obj, "element_size")


def is_managed(obj: Any) -> bool:
    """True for a pool the broker or kvcached manages (its memory is not a reservation)."""
    if obj is None:
        return False
    if getattr(obj, MANAGED_ATTR, False):
        return True
    return kvcached_api.defines_class(type(obj))


def mark_managed(obj: Any) -> None:
    try:
        setattr(obj, MANAGED_ATTR, True)
    except AttributeError:  # a slotted object: it cannot be marked, so it stays static
        pass


def _is_runtime_object(obj: Any) -> bool:
    module = type(obj).__module__ or ""
    return module.startswith(("sglang.", "kvcached_broker.adapters.sglang"))


def _attributes(obj: Any) -> Iterable[tuple[str, Any]]:
    values = getattr(obj, "__dict__", None)
    if values is not None:
        yield from values.items()
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                yield name, getattr(obj, name)


def runtime_tensors(obj: Any, *, skip: frozenset[str] = SKIPPED_ATTRS) -> list[Any]:
    """Every tensor reachable from ``obj`` through SGLang objects and containers.

    Managed sub-pools are not descended into.  Each object is visited once (cycles are cut).
    """
    found: list[Any] = []
    _walk(obj, found, set(), 0, skip)
    return found


def _walk(obj: Any, found: list[Any], visited: set[int], depth: int, skip: frozenset[str]) -> None:
    if obj is None or depth > _MAX_DEPTH or id(obj) in visited:
        return
    if is_tensor(obj):
        found.append(obj)
        return
    if isinstance(obj, (str, bytes, int, float, bool)):
        return
    visited.add(id(obj))
    if isinstance(obj, dict):
        for value in obj.values():
            _walk(value, found, visited, depth + 1, skip)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _walk(value, found, visited, depth + 1, skip)
    elif _is_runtime_object(obj) and not (depth and is_managed(obj)):
        for name, value in _attributes(obj):
            if name not in skip:
                _walk(value, found, visited, depth + 1, skip)


def object_bytes(obj: Any, seen: set | None = None) -> int:
    """Bytes of the distinct storages under ``obj`` not already in ``seen`` (which grows)."""
    return storage_bytes(runtime_tensors(obj), seen)


def claim(obj: Any, seen: set) -> None:
    """Put every storage under ``obj`` into ``seen`` without counting it (managed memory)."""
    for tensor in runtime_tensors(obj, skip=SKIPPED_ATTRS):
        seen.add(storage_key(tensor))
