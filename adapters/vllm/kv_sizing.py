"""Size vLLM's KV cache by what this GPU's broker can grant.

``Worker.determine_available_memory`` returns the bytes vLLM may spend on KV cache, from a
profile or from ``cache_config.kv_cache_memory_bytes``.  The patch caps that figure at what
the broker can grant this worker after its other reservations, and holds it right away
(a broker hold, ``kv_sizing_hold``, charged on top of what the device measures the process
using, with its runtime base pinned in the same request), so no co-located instance can
take it before vLLM allocates, and the weights it already loaded cannot absorb it.

* A profiled figure above the broker's room is lowered to the room (logged).
* An explicit ``kv_cache_memory_bytes`` is honoured exactly or not at all: above the room,
  the worker fails at startup rather than silently running with less than it was told.
* When the broker's room is below what one ``max_model_len`` request needs (and vLLM's own
  figure is not), the worker fails at startup with a :class:`~.kv_budget.KVCacheBudgetError`
  naming the broker, the budget and what others hold.  A profile that is short by itself
  is left to vLLM's own error.
* In kvcached mode (:mod:`.kvcached_mode`) the buffer is virtual: the figure kvcached's own
  patch computed is capped at the most the broker could ever grant this instance, and nothing
  is held (kvcached maps nothing at sizing time; its pages are granted as it maps them, see
  ``adapters/kvcached``).  The cap wraps kvcached's patched method (``kvcached_mode``), once.

All sizes are bytes.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

from ...client.units import format_bytes
from .. import worker
from ..patching import wrap_methods, wrap_once
from . import kv_budget, kvcached_mode, parallel

log = logging.getLogger("kvcached_broker.adapters.vllm")



def cap_available_memory(vllm_worker: Any, available_bytes: int) -> int:
    """The KV bytes this worker may use: vLLM's figure, capped (and held) by the broker."""
    identity = parallel.identity(vllm_worker.device)
    client = worker.session(identity)
    if client is None:
        return available_bytes
    room = worker.guard(identity, "status", lambda: kv_budget.measure_room(identity, client))
    if room is None:  # the broker failed: unprotected, vLLM's own figure
        return available_bytes
    elastic = kvcached_mode.active()
    limit = room.ever_bytes if elastic else room.grantable_bytes
    explicit = getattr(vllm_worker.cache_config, "kv_cache_memory_bytes", None)
    if explicit and explicit > limit:
        raise kv_budget.refusal(identity, room, int(explicit), "kv_cache_memory_bytes")
    needed = min_kv_bytes(vllm_worker)
    if limit < min(needed, int(available_bytes)):  # the broker, not vLLM's own profile, is short
        raise kv_budget.refusal(identity, room, needed, "the KV cache one max_model_len request needs")
    capped = min(int(available_bytes), limit)
    if capped > 0 and not elastic:
        held = kv_budget.hold(identity, client, capped, min(needed, capped))
        if held is None:  # the broker failed: unprotected, vLLM's own figure
            return available_bytes
        capped = held
    log.info(
        "event=vllm_kv_sized rank=%d vllm=%s broker_limit=%s kv=%s elastic=%s",
        identity.tp_rank, format_bytes(int(available_bytes)), format_bytes(limit), format_bytes(capped), elastic,
    )
    return capped


def min_kv_bytes(vllm_worker: Any) -> int:
    """Bytes of KV one ``max_model_len`` request needs (vLLM's own estimate); 1 if unknown."""
    estimate = _max_memory_usage_function()
    try:
        specs = vllm_worker.model_runner.get_kv_cache_spec()
        if estimate is None or not specs:
            return 1
        return max(1, int(estimate(vllm_worker.vllm_config, specs.values())))
    except (AttributeError, AssertionError, TypeError, ValueError):
        return 1


def _max_memory_usage_function() -> Callable[..., int] | None:
    for module in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            found = getattr(importlib.import_module(module), "max_memory_usage_bytes", None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def wrap_determine_available_memory(original: Callable[..., int]) -> Callable[..., int]:
    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> int:
        return kvcached_mode.outermost(lambda: cap_available_memory(self, original(self, *args, **kwargs)),
                                       lambda: original(self, *args, **kwargs))

    return wrap_once(original, determine_available_memory)


def apply_gpu_worker(module: Any) -> None:
    """Patch ``vllm.v1.worker.gpu_worker.Worker.determine_available_memory``."""
    wrap_methods(module, "Worker", {"determine_available_memory": wrap_determine_available_memory})
