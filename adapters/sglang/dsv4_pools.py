"""The runtime-owned pools of a DeepSeek-V4 KV pool, by name, in bytes, from the real tensors.

``DeepSeekV4TokenToKVPool`` holds its side pools under attributes that changed across SGLang
releases; this module names whichever the installed release has and skips the rest:

=================================  ==========================================================
pool name                          where it lives
=================================  ==========================================================
``swa_kv_pool``                    ``pool.swa_kv_pool`` (paged SWA; None in ring/window modes)
``unified_kv_pool``                ``pool.unified_kv_pool`` (0.5.14+, unified-kv mode)
``request_window``                 ``pool.request_window`` (0.5.21+, DSV4.1 encoder replay)
``c{r}_kv_pool``                   ``pool.kv_pools[r]`` (0.5.20+) or ``c4_kv_pool``/``c128_kv_pool``
``c{r}_indexer_kv_pool``           ``pool.index_pools[r]`` (0.5.20+) or ``c4_indexer_kv_pool``
``compress_state_pools``           ``pool.compress_state_pools`` (list, one per layer or None)
``indexer_compress_state_pools``   ``pool.indexer_compress_state_pools``
``dsv4_other``                     any other tensor the pool owns (``swa_valid_from``, ...)
=================================  ==========================================================

Invariant: every tensor storage the pool owns is counted exactly once, under the first name
that reaches it (``c4_kv_pool is kv_pools[4]`` in 0.5.20+, so the alias is never visited),
so the pools sum to the pool's real footprint.  Pools that the broker or kvcached manage
are left out and their storages are not counted under ``dsv4_other`` either.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from . import pool_bytes

OTHER = "dsv4_other"
#: The fixed attributes of 0.5.12-0.5.19, in the order they are counted.
_LEGACY_KV = (("c4_kv_pool", "c4_kv_pool"), ("c128_kv_pool", "c128_kv_pool"))
_LEGACY_INDEX = (("c4_indexer_kv_pool", "c4_indexer_kv_pool"),)


def named_subpools(pool: Any) -> Iterator[tuple[str, Any]]:
    """``(pool name, sub-pool object)`` for every sub-pool attribute the pool has (None skipped)."""
    for name in ("swa_kv_pool", "unified_kv_pool", "request_window"):
        yield from _present(name, getattr(pool, name, None))
    yield from _by_ratio(pool, "kv_pools", "c{}_kv_pool", _LEGACY_KV)
    yield from _by_ratio(pool, "index_pools", "c{}_indexer_kv_pool", _LEGACY_INDEX)
    for name in ("compress_state_pools", "indexer_compress_state_pools"):
        yield from _present(name, getattr(pool, name, None))


def _present(name: str, obj: Any) -> Iterator[tuple[str, Any]]:
    if obj is not None:
        yield name, obj


def _by_ratio(pool: Any, dict_attr: str, template: str, legacy: tuple) -> Iterator[tuple[str, Any]]:
    by_ratio = getattr(pool, dict_attr, None)
    if isinstance(by_ratio, dict):
        for ratio in sorted(by_ratio):
            yield from _present(template.format(ratio), by_ratio[ratio])
        return
    for name, attr in legacy:
        yield from _present(name, getattr(pool, attr, None))


def measure(pool: Any, seen: set | None = None) -> dict[str, int]:
    """Runtime-owned bytes of ``pool`` by pool name (names with 0 bytes are left out).

    ``seen`` holds storages counted elsewhere already (left out here); it grows by the
    storages this measurement counts or claims.
    """
    seen = set() if seen is None else seen
    pools: dict[str, int] = {}
    for name, sub in named_subpools(pool):
        if pool_bytes.is_managed(sub):
            pool_bytes.claim(sub, seen)
            continue
        size = pool_bytes.object_bytes(sub, seen)
        if size:
            pools[name] = pools.get(name, 0) + size
    rest = pool_bytes.object_bytes(pool, seen) if not pool_bytes.is_managed(pool) else 0
    if rest:
        pools[OTHER] = rest
    return pools

