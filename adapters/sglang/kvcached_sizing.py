"""The broker's KV sizing cap stays outermost when kvcached's capacity patch wraps the same method.

SGLang sizes its KV cache in ``_profile_available_bytes`` (``KVCacheConfigurator`` 0.5.16+,
``ModelRunnerKVCacheMixin`` before).  The adapter wraps it when SGLang's module is imported;
kvcached's capacity patch wraps it *afterwards* (``KVCacheConfigurator`` 0.5.16+, ``ModelRunner``
0.5.11-0.5.15), and in kvcached mode its wrapper returns ``total_memory x mem_fraction_static``
(MIN-reduced over the world group) without calling what it wrapped, so the broker's cap would
never run.  Hence:

* :func:`ensure_outermost`, called from the adapter's ``_resolve_memory_pool_config`` (the
  caller of ``_profile_available_bytes``, which kvcached leaves alone) and right after kvcached's
  capacity patch ran (``kv_sizing.apply_kvcached_patches``), wraps the method again wherever
  the owner's class resolves it to someone else's function;
* a wrapper already running on this thread lets an inner one pass straight through (kvcached's
  fallback calls the method it wrapped, which may be the adapter's): one cap and one world
  min-reduce per profile, on every rank;
* the figure is kvcached's **virtual** budget when kvcached's capacity patch is beneath the
  outer wrapper and SGLang's own profile did not run (kvcached did not fall back), and the model
  is not DeepSeek-V4 (whose pools kvcached does not manage, ``kvcached_fallback``).

The cap itself, and where it is applied, are ``kv_sizing``'s: this module is given them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..patching import mark_wrapper
from .. import announce, process_state

log = announce.logger("kvcached_broker.adapters.sglang")

METHOD = "_profile_available_bytes"
#: kvcached's mark on its capacity wrapper (``BasePatch._mark_as_patched(fn, marker)``)
KVCACHED_MARK = "virtual_kv_capacity"

Cap = Callable[[Any, Any, int, bool], int]  # (owner, pre_model_load_memory, runtime bytes, elastic) -> bytes


class _Ours:
    """The ``_profile_available_bytes`` wrappers this process made (weak: a class that is
    collected drops its own).  Hook wiring: SGLang's classes hold these wrappers, so a reset
    keeps the set, and one of ours is never wrapped again."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.wrappers: weakref.WeakSet[Callable[..., int]] = weakref.WeakSet()


class _Profiling:
    """Per thread, while an outer wrapper runs: ``active``, and ``native_ran`` (SGLang's own
    profile ran beneath it).  Both unset outside a profile."""

    def __init__(self) -> None:
        self.local = threading.local()


def outer_profile(original: Callable[..., int], cap: Cap) -> Callable[..., int]:
    """``original`` wrapped so its figure goes through ``cap`` (``original`` if already ours).

    Ours are told by identity, not by :func:`~..patching.wrap_once`'s mark: kvcached's capacity
    wrapper is made with ``functools.wraps`` over ours, which copies the mark onto it, and it
    must be wrapped again (:func:`ensure_outermost`)."""
    ours = process_state.part(_Ours).wrappers
    if original in ours:
        return original

    def _profile_available_bytes(self: Any, pre_model_load_memory: int) -> int:
        local = process_state.part(_Profiling).local
        if getattr(local, "active", False):  # inside the outer wrapper: SGLang's own profile runs
            local.native_ran = True
            return original(self, pre_model_load_memory)
        local.active, local.native_ran = True, False
        try:
            runtime_bytes = original(self, pre_model_load_memory)
            elastic = bool(getattr(original, KVCACHED_MARK, False)) and not local.native_ran and not dsv4_model(self)
        finally:
            local.active = False
        return cap(self, pre_model_load_memory, runtime_bytes, elastic)

    ours.add(mark_wrapper(original, _profile_available_bytes))
    return _profile_available_bytes


def ensure_outermost(cls: type, wrap: Callable[[Callable[..., int]], Callable[..., int]]) -> bool:
    """Wrap ``cls``'s ``_profile_available_bytes`` again if someone wrapped it over ours; True
    if it did (where the class resolves it: ``cls`` or a base)."""
    owner = next((klass for klass in cls.__mro__ if METHOD in vars(klass)), None)
    if owner is None:
        return False
    current = vars(owner)[METHOD]
    if current in process_state.part(_Ours).wrappers:
        return False
    setattr(owner, METHOD, wrap(current))
    log.info("event=sglang_kv_sizing_rewrapped class=%s detail=the broker's cap runs outside %s",
             owner.__name__, getattr(current, "__module__", "?"))
    return True


def dsv4_model(owner: Any) -> bool:
    """True when the configurator or model runner ``owner`` sizes a DeepSeek-V4 model."""
    try:
        from sglang.srt.configs.model_config import is_deepseek_v4

        return bool(is_deepseek_v4(owner.model_config.hf_config))
    except Exception:  # noqa: BLE001 - no model config (tests, other runtimes): not V4
        return False


#: kvcached's class whose ``patch_profile_available_bytes`` wraps SGLang's profile (``kv_sizing``
#: patches it to call :func:`ensure_outermost` right after)
CAPACITY_PATCH_CLASS = "_SGLangVirtualKVCapacityPatchBase"
