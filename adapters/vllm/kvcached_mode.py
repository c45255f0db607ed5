"""Whether kvcached serves this vLLM process's KV cache (kvcached mode), and the sizing cap around it.

With kvcached ``>=0.1.6,<0.1.7`` installed and ``ENABLE_KVCACHED=1`` (kvcached's own autopatch
on), kvcached's vLLM integration replaces the KV cache: each GPU worker's KV tensors are
whole-GPU *virtual* buffers whose pages are mapped on demand, and EngineCore's block pool is
kvcached's ``ElasticBlockPool``.  The broker then governs the physical pages
(``adapters/kvcached``), so the vLLM adapter:

* never charges kvcached's virtual buffers as ``kv_static`` (:mod:`.kv_reservation`);
* caps the virtual size at what the broker could ever give this instance and takes no sizing
  hold (:mod:`.kv_sizing`): kvcached maps nothing at sizing time;
* registers the prefix-cache eviction hook in EngineCore (:mod:`.prefix_eviction`).

Both autopatches fire on the same flag, in an order that depends on what imports first.
kvcached's ``Worker.determine_available_memory`` computes its own figure and calls the method it
replaced only for an explicit ``kv_cache_memory_bytes``, so the broker's cap must be the
*outer* wrapper: ``kv_sizing.apply_kvcached_patches`` re-wraps the method right after kvcached's
``GPUWorkerPatch`` replaced it (an inner wrapper of ours then passes through, see
:func:`outermost`).

This module only says whether kvcached mode is on and which wrapper is outermost; the modules
named above build on it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from .. import flags, process_state
from ..kvcached import kvcached_api


class _Outermost:
    """Per thread: whether a wrapper of ours is running on it (``local.depth`` 1), so that an
    inner one passes through."""

    def __init__(self) -> None:
        self.local = threading.local()


def active() -> bool:
    """True in a process where kvcached's vLLM integration is switched on and initialised."""
    if not flags.kvcached_switch():
        return False
    found = kvcached_api.integration("vllm")
    return found is not None and found.initialised


def outermost(call: Callable[[], Any], passthrough: Callable[[], Any]) -> Any:
    """Run ``call`` unless an outer wrapper of ours is already running on this thread (then
    ``passthrough``): the broker's cap applies once, at the outermost wrapper."""
    local = process_state.part(_Outermost).local
    if getattr(local, "depth", 0):
        return passthrough()
    local.depth = 1
    try:
        return call()
    finally:
        local.depth = 0
