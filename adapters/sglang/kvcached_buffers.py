"""kvcached's elastic MHA pool on SGLang releases that check the KV buffers' rows.

kvcached 0.1.6's ``alloc_kv_cache`` returns K/V views over its whole-GPU virtual range: their
leading axis is ``total_memory / layers / 2 / row_bytes`` token rows, not the pool's
``size + page_size``.  SGLang 0.5.23's ``MHATokenToKVPool._create_buffers`` then builds buffer
descriptors (``_build_kv_buffer_descs``, used for PD-transfer registration and the post-capture
backing) and raises ``ValueError("KV buffer shape ... does not lead with N rows ...")`` for any
other row count: with kvcached mode on, every MHA model would fail at start-up.

The adapter wraps that method on SGLang's own class (before kvcached subclasses it): for a
kvcached pool whose buffers lead with more rows than the pool has slots, the K/V lists are
trimmed to the first ``size + page_size`` rows (views: no memory changes, and no index SGLang
or kvcached hands out reaches beyond them: kvcached's manager has ``ceil(size / page_size) + 1``
blocks of ``page_size`` tokens).  Any other pool, or a release without the method, is left
alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..patching import PatchError, wrap_methods, wrap_once
from .. import announce
from ..kvcached import kvcached_api

log = announce.logger("kvcached_broker.adapters.sglang")

METHOD = "_build_kv_buffer_descs"


def trim_virtual_rows(pool: Any) -> bool:
    """Trim a kvcached pool's K/V views to its slots; True if it did."""
    if not kvcached_api.defines_class(type(pool)) or getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        return False
    rows = int(pool.size) + int(pool.page_size)
    k_buffer, v_buffer = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if not k_buffer or not v_buffer or all(t.shape[0] == rows for t in (*k_buffer, *v_buffer)):
        return False
    if any(t.shape[0] < rows for t in (*k_buffer, *v_buffer)):
        return False  # fewer rows than slots: SGLang's own check says so
    pool.k_buffer = [t[:rows] for t in k_buffer]
    pool.v_buffer = [t[:rows] for t in v_buffer]
    announce.once("kvcached_buffers_trimmed", logging.INFO, "kvcached_buffers_trimmed", pool=type(pool).__name__,
                  rows=rows, detail="kvcached's virtual K/V views cut to the pool's slots")
    return True


def wrap_descs(original: Callable[..., Any]) -> Callable[..., Any]:
    def _build_kv_buffer_descs(self: Any, *args: Any, **kwargs: Any) -> Any:
        trim_virtual_rows(self)
        return original(self, *args, **kwargs)

    return wrap_once(original, _build_kv_buffer_descs)


def apply_memory_pool(module: Any) -> None:
    """Wrap ``MHATokenToKVPool._build_kv_buffer_descs`` in ``sglang.srt.mem_cache.memory_pool``
    where the release has it (0.5.23); a release without it (0.5.12, 0.5.13) checks no rows and
    needs nothing, and kvcached's class in its place is left alone."""
    cls = getattr(module, "MHATokenToKVPool", None)
    if isinstance(cls, type) and kvcached_api.defines_class(cls):
        return
    try:
        wrap_methods(module, "MHATokenToKVPool", {METHOD: wrap_descs})
    except PatchError:
        if cls is None:
            raise  # no pool class at all: the patch says so
        log.info("event=kvcached_buffers_unneeded detail=%s.MHATokenToKVPool has no %s of its own: no row check "
                 "to meet", module.__name__, METHOD)
