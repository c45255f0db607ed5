"""Where SGLang constructs allocators, the adapter's paged allocator (``paged_allocator``) is bound.

=============================================  ===========================  ==============
module                                         what it binds                releases
=============================================  ===========================  ==============
``sglang.srt.mem_cache.allocator``             legacy module (defines it)   0.5.12
``sglang.srt.mem_cache.allocator``             package re-export            0.5.13+
``sglang.srt.mem_cache.allocator.swa``         SWA sub-allocators           0.5.13+
``sglang.srt.mem_cache.swa_memory_pool``       SWA sub-allocators (legacy)  0.5.12
``...model_executor.model_runner_kv_cache_mixin``  pool construction        0.5.12-0.5.15
``sglang.srt.mem_cache.kv_cache_configurator``  pool construction           0.5.16+
=============================================  ===========================  ==============

Each binding first records SGLang's own classes as the module names them (before kvcached's
patch aliases the names to its elastic allocators), for ``kvcached_fallback``, and gives
kvcached's elastic classes their fallback if its patch aliased them already.
"""

from __future__ import annotations

from typing import Any

from ..patching import PatchError
from . import kvcached_fallback, paged_allocator


def apply_binding(module: Any) -> None:
    """Bind the adapter's allocator class as ``PagedTokenToKVPoolAllocator`` in ``module``."""
    name = paged_allocator.CLASS_NAME
    base = getattr(module, name, None)
    if not isinstance(base, type):
        raise PatchError(f"{module.__name__} has no {name}")
    kvcached_fallback.remember_native(name, base)
    kvcached_fallback.remember_native("TokenToKVPoolAllocator", getattr(module, "TokenToKVPoolAllocator", None))
    setattr(module, name, paged_allocator.broker_class(base))
    kvcached_fallback.install()  # kvcached's elastic classes, if its patch aliased them already
