"""Size vLLM's KV cache by what this GPU's broker admits, and settle its warm-up.

``Worker.determine_available_memory`` returns the bytes vLLM may spend on KV cache, from a
profile or from ``cache_config.kv_cache_memory_bytes``.  The profile also leaves on the
worker what vLLM keeps beside the KV cache and allocates later: its activation peak
(``peak_activation_memory``) and its CUDA graphs (``cudagraph_memory_estimate``, counted in
the peak where vLLM applies it).  The patch admits both in **one** broker request
(:func:`..sizing.size`): the runtime base pinned, that slack held in full
(``runtime_slack_hold``), and the KV cache held at most at vLLM's figure and at least at what
one ``max_model_len`` request needs (``kv_sizing_hold``), so no co-located instance can take
any of it before vLLM allocates it, and the weights it already loaded cannot absorb it.

* A profiled figure above what fits is lowered to what fits (logged).
* An explicit ``kv_cache_memory_bytes`` is honoured exactly or not at all: when it does not
  fit, the worker fails at startup rather than silently running with less than it was told.
* When even one ``max_model_len`` request's KV cache and the slack do not fit (and vLLM's own
  figure covers the request), the worker fails at startup with a
  :class:`~.kv_budget.KVCacheBudgetError` naming the broker, the ask, the room and who holds
  the rest.  A profile that is short by itself is left to vLLM's own error.
* In kvcached mode (:mod:`.kvcached_mode`) the buffer is virtual: the figure kvcached's own
  patch computed is capped at the most the broker could ever grant this instance, and no KV is
  held (kvcached maps nothing at sizing time; its pages are granted as it maps them, see
  ``adapters/kvcached``); the slack still is.  The cap wraps kvcached's patched method
  (``kvcached_mode``), once: :func:`apply_kvcached_patches` puts it back outside right after
  kvcached's ``GPUWorkerPatch`` replaced the method.

``Worker.compile_or_warm_up_model`` (CUDA graphs captured, the sampler warmed up) ends the
warm-up: :meth:`~..device_session.DeviceSession.settle_warm_up` pins the base where the device measures it and
keeps the slack the warm-up did not allocate as the resident ``runtime_slack`` pool.

All sizes are bytes.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from ...client.units import format_bytes
from .. import announce, sessions, sizing
from ..patching import wrap_methods, wrap_once
from ..versions import installed, parse
from . import kv_budget, kvcached_mode, parallel

log = announce.logger("kvcached_broker.adapters.vllm")

#: The first release that counts its CUDA graph estimate in ``peak_activation_memory`` (when
#: ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` is on, its default since).
GRAPHS_IN_PEAK = "0.21.0"


def cap_available_memory(vllm_worker: Any, available_bytes: int) -> int:
    """The KV bytes this worker may use: vLLM's figure, capped by what the broker admits."""
    identity = parallel.identity(vllm_worker.device)
    if sessions.session(identity) is None:
        return available_bytes
    elastic = kvcached_mode.active()
    explicit = getattr(vllm_worker.cache_config, "kv_cache_memory_bytes", None)
    needed = min_kv_bytes(vllm_worker)
    wanted = int(explicit) if explicit else int(available_bytes)
    least = wanted if explicit else min(needed, int(available_bytes))
    reason = "as kv_cache_memory_bytes sets it" if explicit else "what one max_model_len request needs"
    ask = sizing.StartupAsk("vLLM", wanted, least, slack_bytes(vllm_worker), elastic, reason)
    try:
        sized = sizing.size(identity, ask)
    except sizing.StartupRefused as exc:
        raise kv_budget.KVCacheBudgetError(str(exc)) from exc
    if sized is None:  # the broker failed: unprotected, vLLM's own figure
        return available_bytes
    capped = sized.kv_bytes if not explicit or sized.kv_bytes >= wanted else 0
    if elastic and capped < least:  # the broker, not vLLM's own profile, is short
        raise kv_budget.KVCacheBudgetError(str(sizing.refusal(
            identity, ask, f"it could never give the instance more than {format_bytes(sized.ever_bytes)} of KV cache")))
    log.info(
        "event=vllm_kv_sized rank=%d vllm=%s slack=%s broker_ever=%s kv=%s elastic=%s",
        identity.tp_rank, format_bytes(int(available_bytes)), format_bytes(sized.slack_bytes),
        format_bytes(sized.ever_bytes), format_bytes(capped), elastic,
    )
    return capped


def slack_bytes(vllm_worker: Any) -> int:
    """What vLLM keeps beside its KV cache, from its own profile: the activation peak and the
    CUDA graphs it will capture (0 where it did not profile, as with ``kv_cache_memory_bytes``)."""
    peak = _bytes(getattr(vllm_worker, "peak_activation_memory", 0))
    graphs = _bytes(getattr(vllm_worker, "cudagraph_memory_estimate", 0))
    return peak + (0 if _graphs_counted_in_peak() else graphs)


def _bytes(value: Any) -> int:
    return max(0, int(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _graphs_counted_in_peak() -> bool:
    version = installed("vllm")
    if version is None or parse(version) < parse(GRAPHS_IN_PEAK):
        return False
    try:
        import vllm.envs as envs

        return bool(envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS)
    except Exception:  # noqa: BLE001 - no envs module to ask: count the graphs once more, never less
        return False


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


def wrap_compile_or_warm_up_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        identity = parallel.identity(self.device)
        session = sessions.session(identity)
        if session is not None:
            session.settle_warm_up()
        return result

    return wrap_once(original, compile_or_warm_up_model)


def apply_gpu_worker(module: Any) -> None:
    """Patch ``vllm.v1.worker.gpu_worker.Worker``: ``determine_available_memory`` (sizing) and
    ``compile_or_warm_up_model`` (the end of the warm-up)."""
    wrap_methods(module, "Worker", {"determine_available_memory": wrap_determine_available_memory,
                                    "compile_or_warm_up_model": wrap_compile_or_warm_up_model})


def wrap_patch_determine_available_memory(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GPUWorkerPatch.patch_worker_determine_available_memory``: once kvcached replaced the method,
    put the broker's cap around what it put in place."""

    def patch_worker_determine_available_memory(self: Any, gpuworker_mod: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, gpuworker_mod, *args, **kwargs)
        apply_gpu_worker(gpuworker_mod)  # wraps whatever kvcached put in place
        return result

    return wrap_once(original, patch_worker_determine_available_memory)


def apply_kvcached_patches(module: Any) -> None:
    """``kvcached.integration.vllm.patches``: put the broker's sizing cap outside kvcached's."""
    wrap_methods(module, "GPUWorkerPatch",
                 {"patch_worker_determine_available_memory": wrap_patch_determine_available_memory})
