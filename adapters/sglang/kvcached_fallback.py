"""Pools kvcached does not manage get SGLang's own (static) allocator, not a start-up failure.

With kvcached's SGLang patch on, ``PagedTokenToKVPoolAllocator`` and ``TokenToKVPoolAllocator``
are aliased to kvcached's elastic allocators everywhere SGLang builds allocators (the
configurator or model-runner mixin, the SWA allocator's sub-allocators).  Their ``__init__``
raises ``ValueError("... requires elastic MHA pool")`` for a KV pool without a
``kvcached_allocator``: every pool kvcached 0.1.6 does not replace, first of all
DeepSeek-V4's ``DeepSeekV4TokenToKVPool`` (and the SWA sub-allocators it gets ``kvcache=None``
for).  The server would fail at start-up.

This module gives each kvcached elastic allocator class a ``__new__`` that, for such a pool,
builds SGLang's own allocator instead (the adapter's subclass of it, with the precomputed page
counts and the stale-id filter; ``paged_allocator``), logged once per allocator kind.  That pool
is then broker-sized static KV: charged as reservations (a DeepSeek-V4 pool per pool,
``dsv4_reservation``), never governed.  A pool kvcached manages is untouched.

The classes are found where kvcached puts them (``sglang.srt.mem_cache.allocator``'s
``ElasticPagedTokenToKVPoolAllocator`` / ``ElasticTokenToKVPoolAllocator``), whenever a module
that builds allocators is patched (``allocator_binding``, which also records SGLang's own
classes here, and ``kv_sizing``), which is after kvcached aliased them (kvcached imports the
pool builder only once every alias is in place).  Idempotent.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from .. import announce, process_state
from . import paged_allocator
from ..kvcached import kvcached_api

_ALLOCATOR_MODULE = "sglang.srt.mem_cache.allocator"
_MARK = "__kvcached_broker_fallback__"


class _Natives:
    """SGLang's own allocator classes, by name, as the binding patch first saw them (before
    kvcached aliased the names; never replaced), and the lock under which a kvcached class is
    given its fallback.  Hook wiring: the fallbacks already given find their class here after a
    reset, and the patch that recorded them does not run again."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.classes: dict[str, type] = {}


def remember_native(name: str, cls: Any) -> None:
    """Record SGLang's own allocator class ``name`` (before kvcached aliases the name)."""
    if isinstance(cls, type) and not kvcached_api.defines_class(cls):
        process_state.part(_Natives).classes.setdefault(name, cls)


def install() -> list[str]:
    """Give every kvcached elastic allocator class present the fallback; the names given it."""
    module = sys.modules.get(_ALLOCATOR_MODULE)
    done = []
    for elastic_name, native_name in kvcached_api.SGLANG_ELASTIC_ALLOCATORS.items():
        elastic = getattr(module, elastic_name, None) if module is not None else None
        if isinstance(elastic, type) and _give_fallback(elastic, native_name):
            done.append(elastic_name)
    return done


def _give_fallback(elastic: type, native_name: str) -> bool:
    with process_state.part(_Natives).lock:
        if vars(elastic).get(_MARK):
            return True
        native = native_class(native_name)
        if native is None:
            return False

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            kvcache = _kvcache_argument(native_name, args, kwargs)
            if hasattr(kvcache, "kvcached_allocator"):
                return object.__new__(cls)
            _say_once(native_name, kvcache)
            fallback = native_class(native_name)
            if fallback is None:  # found when the fallback was given, and never forgotten since
                raise TypeError(f"SGLang's own {native_name} is gone")
            return fallback(*args, **kwargs)  # fully built: not an instance of cls

        elastic.__new__ = staticmethod(__new__)  # type: ignore[assignment]
        setattr(elastic, _MARK, True)
        return True


def native_class(name: str) -> type | None:
    """SGLang's own allocator class ``name`` with the adapter's bindings (``paged_allocator``
    for the paged one): from its implementation module (0.5.13+) or as first seen (0.5.12)."""
    native = process_state.part(_Natives).classes.get(name) or _implementation(name)
    if native is None:
        return None
    return paged_allocator.broker_class(native) if name == paged_allocator.CLASS_NAME else native


def _implementation(name: str) -> type | None:
    module_name = {"PagedTokenToKVPoolAllocator": f"{_ALLOCATOR_MODULE}.paged",
                   "TokenToKVPoolAllocator": f"{_ALLOCATOR_MODULE}.token"}[name]
    module = sys.modules.get(module_name)
    if module is None:
        try:
            import importlib

            module = importlib.import_module(module_name)
        except ImportError:  # 0.5.12: one allocator module, the class as first seen
            return None
    cls = getattr(module, name, None)
    return cls if isinstance(cls, type) and not kvcached_api.defines_class(cls) else None


def _kvcache_argument(native_name: str, args: tuple, kwargs: dict) -> Any:
    """The ``kvcache`` argument: ``(size, page_size, dtype, device, kvcache, ...)`` for the
    paged allocator, ``(size, dtype, device, kvcache, ...)`` for the token one."""
    if "kvcache" in kwargs:
        return kwargs["kvcache"]
    position = 4 if native_name == "PagedTokenToKVPoolAllocator" else 3
    return args[position] if len(args) > position else None


def _say_once(native_name: str, kvcache: Any) -> None:
    kind = type(kvcache).__name__ if kvcache is not None else "None"
    announce.once(f"kvcached_pool_static:{native_name}:{kind}", logging.WARNING, "kvcached_pool_static",
                  allocator=native_name, kvcache=kind,
                  detail="kvcached does not manage this pool: SGLang's own allocator, broker-sized static KV")


def apply(module: Any) -> None:
    """Patch hook for the modules that build allocators: install the fallback if kvcached's
    classes are there by now (no-op without kvcached)."""
    install()
