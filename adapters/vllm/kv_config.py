"""What a vLLM ``KVCacheConfig`` costs on one GPU, and how its cache groups use those bytes.

Pure functions over vLLM's own config objects, read by attribute (no vLLM import), so that
one module serves every supported release:

* **vLLM 0.29+** (``KVCacheTensor(size, layers, layer_stride, block_stride, offset)``): every
  device tensor places its layers in ONE backing allocation and reports that allocation's
  whole ``size``.  The device cost is that size once, never the sum.
* **vLLM 0.19-0.28** (``KVCacheTensor(size, shared_by)``): each tensor is its own allocation; the
  device cost is the sum.

The per-group view (:func:`usage_breakdown`) counts, for each cache role, the bytes its
layers address: ``num_blocks * page_size_bytes`` per layer, at most the whole buffer
(:func:`within`).  Groups overlay one buffer and a block belongs to one group at a time, so
these views overlap and do not add up to the charge.  They go to the broker as ``usage``
(status ``usage_breakdown``), never as charges.

All sizes are bytes (int).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

#: cache roles named as the SGLang adapter names the same DeepSeek-V4 pools
SWA_POOL = "swa_kv_pool"
COMPRESS_STATE_POOL = "compress_state_pools"
V4_MODEL_PREFIX = "deepseek_v4"


def device_tensors(kv_cache_config: Any) -> list[Any]:
    """The config's KVCacheTensors that live on the GPU (hisparse host tensors excluded)."""
    return [t for t in kv_cache_config.kv_cache_tensors if not getattr(t, "host_resident", False)]


def shares_one_buffer(kv_cache_config: Any) -> bool:
    """True when the tensors are placements in one backing allocation (vLLM 0.33 style)."""
    tensors = device_tensors(kv_cache_config)
    return bool(tensors) and not hasattr(tensors[0], "shared_by")


def buffer_bytes(kv_cache_config: Any) -> int:
    """Device bytes the config allocates, each backing allocation counted once."""
    sizes = [int(t.size) for t in device_tensors(kv_cache_config)]
    if not sizes:
        return 0
    return max(sizes) if shares_one_buffer(kv_cache_config) else sum(sizes)


def layer_specs(kv_cache_config: Any) -> Iterator[tuple[int, str, Any]]:
    """``(group_index, layer_name, per_layer_spec)`` for every layer of every group."""
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)
        for name in group.layer_names:
            yield index, name, (inner[name] if isinstance(inner, dict) and name in inner else spec)


def is_deepseek_v4(kv_cache_config: Any) -> bool:
    return any(_model_version(spec).startswith(V4_MODEL_PREFIX) for _, _, spec in layer_specs(kv_cache_config))


def usage_breakdown(kv_cache_config: Any) -> dict[str, int]:
    """Bytes each cache role addresses, by pool name (overlapping views of one buffer).

    DeepSeek-V4 layers are named by role (``swa_kv_pool``, ``c4_kv_pool``, ``c128_kv_pool``,
    ``c4_indexer_kv_pool``, ``compress_state_pools``); any other model gets one entry per
    cache group, ``kv_group{index}_{kind}`` (e.g. ``kv_group0_full_attention``).
    """
    blocks = int(kv_cache_config.num_blocks)
    v4 = is_deepseek_v4(kv_cache_config)
    groups = list(kv_cache_config.kv_cache_groups)
    views: dict[str, int] = {}
    for index, name, spec in layer_specs(kv_cache_config):
        pool = (v4 and v4_pool_name(name, spec)) or group_pool_name(index, groups[index].kv_cache_spec)
        views[pool] = views.get(pool, 0) + blocks * int(spec.page_size_bytes)
    return views


def within(views: dict[str, int], limit_bytes: int) -> dict[str, int]:
    """``views`` with none larger than ``limit_bytes``: what a role's layers address is at most
    the buffer they share (the broker refuses a view larger than the session's reservations)."""
    return {name: min(size, limit_bytes) for name, size in views.items()}


def v4_pool_name(layer_name: str, spec: Any) -> str | None:
    """The SGLang-style pool name of one DeepSeek-V4 cache layer; None if it is none of them."""
    kind = type(spec).__name__
    ratio = _compress_ratio(spec)
    versioned = _model_version(spec).startswith(V4_MODEL_PREFIX)
    if kind == "SlidingWindowMLASpec":
        return SWA_POOL if versioned else COMPRESS_STATE_POOL
    if kind == "MLAAttentionSpec" and ratio > 1:
        if versioned:
            return f"c{ratio}_kv_pool"
        if ".indexer." in f".{layer_name}" or _is_indexer_role(spec):
            return f"c{ratio}_indexer_kv_pool"
    return None


def group_pool_name(index: int, group_spec: Any) -> str:
    """``kv_group{index}_{kind}``: the spec class in snake case, without ``Spec``."""
    inner = getattr(group_spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        kinds = {type(s).__name__ for s in inner.values()}
        kind = kinds.pop() if len(kinds) == 1 else "mixed"
    else:
        kind = type(group_spec).__name__
    return f"kv_group{index}_{_snake(kind.removesuffix('Spec').removesuffix('KVCacheSpecs'))}"


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower() or "kv"


def _model_version(spec: Any) -> str:
    return str(getattr(spec, "model_version", None) or "")


def _compress_ratio(spec: Any) -> int:
    """Tokens per stored state: ``tokens_per_state`` (0.29+) or ``compress_ratio`` (0.20-0.28)."""
    for field in ("tokens_per_state", "compress_ratio"):
        value = getattr(spec, field, None)
        if value:
            return int(value)
    return 1


def _is_indexer_role(spec: Any) -> bool:
    role = getattr(spec, "cache_role", None)
    return str(getattr(role, "value", role) or "").lower() == "indexer"
