"""Report each GPU worker's KV buffer to its GPU's broker, once, with the per-group view.

vLLM allocates the KV cache in one function, bound by name where it is used:

* vLLM 0.29+: ``vllm.v1.worker.utils.allocate_kv_cache(kv_cache_config, device, layout, ...)``,
  imported into ``gpu_model_runner`` (before 0.34), ``gpu.attn_utils`` and ``hisparse.binding``
  (0.30+): the defining module's attribute is patched, so later importers bind the wrapper, and
  each of those module attributes too (for a module imported first).  From 0.34 its
  ``allocate=`` may be the extensible KV cache's hook: that buffer is charged as it commits
  (:mod:`.extensible`), not here;
* vLLM 0.19: the method ``GPUModelRunner._allocate_kv_cache_tensors(kv_cache_config)`` and
  ``gpu.attn_utils._allocate_kv_cache(kv_cache_config, device)`` (Model Runner V2), and, for a
  KV connector that prefers cross-layer blocks, the static
  ``KVConnectorModelRunnerMixin.allocate_uniform_kv_caches`` (one tensor for every layer).

Around the allocation, on a preallocated (normal) buffer: *before* vLLM allocates, the
planned bytes become the ``kv_static`` pool and the sizing hold is dropped, in one broker
request (growth beyond the hold is admitted, and a refusal fails startup with a clear error
and nothing allocated); after, ``kv_static`` is set to the bytes really allocated (each
storage once).  The runtime base is pinned before ``kv_static`` is first reported, so the
weights cannot absorb a buffer reported ahead of its allocation.  The per-group view from the
real ``KVCacheConfig`` goes along as ``usage``: shown in status as ``usage_breakdown``,
never charged.  In kvcached mode (:mod:`.kvcached_mode`) the buffers are kvcached's whole-GPU
virtual ones: nothing is charged here, whichever wrapper runs (kvcached's allocation replaces
vLLM's, and its pages are granted as kvcached maps them, ``adapters/kvcached``).
"""

from __future__ import annotations

from typing import Any, Callable

from ...client import BudgetExceeded
from ...client.units import format_bytes
from .. import announce, sessions
from ..patching import PatchError, class_with, wrap_methods, wrap_once
from ..tensors import storage_bytes
from ..worker_identity import WorkerIdentity
from . import extensible, kv_budget, kv_config, kvcached_mode, parallel

log = announce.logger("kvcached_broker.adapters.vllm")



def before_allocation(kv_cache_config: Any, device: Any) -> WorkerIdentity:
    """Hold the planned buffer before vLLM allocates it (not in kvcached mode: virtual buffers)."""
    identity = parallel.identity(device)
    if not kvcached_mode.active():
        _report(identity, kv_config.buffer_bytes(kv_cache_config), kv_cache_config, "the KV cache buffer",
                allocated=False)
    return identity


def after_allocation(identity: WorkerIdentity, kv_cache_config: Any, tensors: Any) -> None:
    """Charge what was allocated as ``kv_static`` (never kvcached's virtual buffers)."""
    if kvcached_mode.active():
        log.info("event=vllm_kv_kvcached rank=%d detail=virtual_buffers_not_charged_pages_granted_as_mapped",
                 identity.tp_rank)
        return
    if sessions.session(identity) is None:
        return
    allocated = storage_bytes(tensors) or kv_config.buffer_bytes(kv_cache_config)
    _report(identity, allocated, kv_cache_config, "the allocated KV cache buffer")
    log.info(
        "event=vllm_kv_reserved rank=%d kv_static=%s groups=%d blocks=%d",
        identity.tp_rank, format_bytes(allocated), len(kv_cache_config.kv_cache_groups), kv_cache_config.num_blocks,
    )


def _report(identity: WorkerIdentity, buffer_bytes: int, kv_cache_config: Any, what: str, *,
            allocated: bool = True) -> None:
    """``kv_static`` at ``buffer_bytes``, with the sizing hold dropped, in one broker request."""
    session = sessions.session(identity)
    if session is None:
        return
    usage = kv_config.within(kv_config.usage_breakdown(kv_cache_config), buffer_bytes)
    try:
        session.report_built(kv_budget.REPORTER, {kv_budget.STATIC_POOL: buffer_bytes}, last=True, usage=usage,
                             allocated=allocated, phase="warming")
    except BudgetExceeded as exc:
        raise kv_budget.explain(identity, session.client, buffer_bytes, what, exc) from exc


def wrap_allocate_function(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``allocate(kv_cache_config, device, ...)`` (the 0.29+ and 0.19 module functions).

    An ``allocate=`` hook of vLLM's extensible KV cache (0.34+) backs the buffer with a
    reservation of address space, not memory: it is charged as it commits (:mod:`.extensible`)."""
    def allocate(kv_cache_config: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        hook = kwargs.get("allocate", args[2] if len(args) > 2 else None)
        if hook is not None and extensible.is_extensible(hook):
            extensible.track(hook.__self__, kv_cache_config, device)
            return original(kv_cache_config, device, *args, **kwargs)
        identity = before_allocation(kv_cache_config, device)
        tensors = original(kv_cache_config, device, *args, **kwargs)
        after_allocation(identity, kv_cache_config, tensors)
        return tensors

    return wrap_once(original, allocate)


def wrap_allocate_method(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``GPUModelRunner._allocate_kv_cache_tensors(self, kv_cache_config)`` (0.19)."""
    def allocate(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        identity = before_allocation(kv_cache_config, self.device)
        tensors = original(self, kv_cache_config, *args, **kwargs)
        after_allocation(identity, kv_cache_config, tensors)
        return tensors

    return wrap_once(original, allocate)


def wrap_allocate_uniform(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``allocate_uniform_kv_caches(kv_cache_config, attn_groups, cache_dtype, device, ...)`` (0.19).

    A KV connector that prefers cross-layer blocks allocates the whole cache as one tensor
    here instead of through ``_allocate_kv_cache_tensors``; it returns
    ``(kv_caches, cross_layers_kv_cache, attn_backend)``.
    """
    def allocate_uniform_kv_caches(kv_cache_config: Any, attn_groups: Any, cache_dtype: Any, device: Any,
                                   *args: Any, **kwargs: Any) -> Any:
        identity = before_allocation(kv_cache_config, device)
        result = original(kv_cache_config, attn_groups, cache_dtype, device, *args, **kwargs)
        after_allocation(identity, kv_cache_config, result[1])
        return result

    return wrap_once(original, allocate_uniform_kv_caches)


def apply_uniform_kv_caches(module: Any) -> None:
    """``KVConnectorModelRunnerMixin.allocate_uniform_kv_caches`` (a staticmethod, 0.19)."""
    name = "allocate_uniform_kv_caches"
    mixin = class_with(module, "KVConnectorModelRunnerMixin", [name])
    found = vars(mixin)[name]
    if not isinstance(found, staticmethod):
        raise PatchError(f"{module.__name__}.KVConnectorModelRunnerMixin.{name} is not a staticmethod")
    setattr(mixin, name, staticmethod(wrap_allocate_uniform(found.__func__)))


def _wrap_functions(module: Any, names: tuple[str, ...]) -> list[str]:
    """Wrap each of ``names`` the module binds (defines or imports) with :func:`wrap_allocate_function`,
    once; the names wrapped."""
    found = [name for name in names if callable(vars(module).get(name))]
    for name in found:
        setattr(module, name, wrap_allocate_function(vars(module)[name]))
    return found


def apply_allocate_kv_cache(module: Any) -> None:
    """Patch a module that defines or imports ``allocate_kv_cache`` (vLLM 0.29+)."""
    if not _wrap_functions(module, ("allocate_kv_cache",)):
        raise PatchError(f"{module.__name__} has no allocate_kv_cache")


def apply_gpu_model_runner(module: Any) -> None:
    """``allocate_kv_cache`` bound in the module (0.29+), or the runner's method (0.19)."""
    wrapped = _wrap_functions(module, ("allocate_kv_cache",))
    try:
        wrap_methods(module, "GPUModelRunner", {"_allocate_kv_cache_tensors": wrap_allocate_method})
    except PatchError as exc:  # the runner has no such method of its own (0.29+): the function is enough
        if not wrapped:
            raise PatchError(f"{module.__name__} has neither allocate_kv_cache nor "
                             f"GPUModelRunner._allocate_kv_cache_tensors ({exc})") from exc


def apply_attn_utils(module: Any) -> None:
    """``allocate_kv_cache`` bound in the module (0.29+), or its own ``_allocate_kv_cache`` (0.19)."""
    if not _wrap_functions(module, ("allocate_kv_cache", "_allocate_kv_cache")):
        raise PatchError(f"{module.__name__} has neither allocate_kv_cache nor _allocate_kv_cache")
