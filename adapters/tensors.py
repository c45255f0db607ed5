"""Bytes held by tensors, each storage counted once (views and aliases share storage)."""

from __future__ import annotations

from typing import Any, Iterable


def iter_tensors(obj: Any) -> Iterable[Any]:
    """Every tensor in ``obj``: a tensor, or lists/tuples/dicts of them (None is skipped)."""
    if obj is None:
        return
    if hasattr(obj, "untyped_storage") and hasattr(obj, "element_size"):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)


def storage_key(tensor: Any) -> tuple[str, int]:
    storage = tensor.untyped_storage()
    return str(tensor.device), storage.data_ptr()


def storage_bytes(obj: Any, seen: set | None = None) -> int:
    """Bytes of every distinct storage under ``obj``; ``seen`` shares the dedup across calls."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in iter_tensors(obj):
        key = storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total
