"""The vLLM patch set: what is hooked, where, and for which vLLM releases.

Supported: ``vllm >=0.19.1,<0.34`` (verified on 0.19.1 and 0.33.0 against the real classes).
Every patch is gated by that range, and each applies to whichever of its hook symbols the
installed release has; a module holding none of them is a failed patch (an error only under
``KVCACHED_REQUIRE=1``).  A release outside the range logs one skip per patch and runs
without the broker.

| concern | module | symbol |
|---|---|---|
| reservations | ``vllm.v1.worker.utils`` | ``allocate_kv_cache`` (0.33; defining module) |
| reservations | ``vllm.v1.worker.gpu_model_runner`` | ``allocate_kv_cache`` (0.33) or ``GPUModelRunner._allocate_kv_cache_tensors`` (0.19) |
| reservations | ``vllm.v1.worker.gpu.attn_utils`` | ``allocate_kv_cache`` (0.33) or ``_allocate_kv_cache`` (0.19) |
| reservations | ``vllm.v1.hisparse.binding`` | ``allocate_kv_cache`` (0.33, optional) |
| reservations | ``vllm.v1.worker.kv_connector_model_runner_mixin`` | ``KVConnectorModelRunnerMixin.allocate_uniform_kv_caches`` (0.19, cross-layer KV connectors) |
| sizing | ``vllm.v1.worker.gpu_worker`` | ``Worker.determine_available_memory`` |
| sleep mode | ``vllm.v1.worker.gpu_worker`` | ``Worker.sleep``, ``Worker.wake_up`` |
| sleep mode | ``vllm.v1.executor.abstract`` | ``Executor.wake_up`` (admits every worker before any wakes) |
| kvcached mode | ``vllm.v1.engine.core`` | ``EngineCore.__init__`` (announce; the prefix-cache eviction hook) |
| kvcached mode | ``vllm.v1.core.sched.scheduler`` | ``Scheduler.schedule`` (runs queued evictions on the engine thread) |
| kvcached mode | ``kvcached.integration.vllm.patches`` | ``GPUWorkerPatch`` (the sizing cap wraps kvcached's) |

Elastic KV is kvcached mode (``adapters/kvcached``, :mod:`.kvcached_mode`); without kvcached
the KV cache is vLLM's own, sized and charged by the broker.
"""

from __future__ import annotations

import logging

from ..patching import Patch
from ..versions import in_range, installed
from . import engine, kv_reservation, kv_sizing, kvcached_mode, memory_release, prefix_eviction

log = logging.getLogger("kvcached_broker.adapters.vllm")

MINIMUM = "0.19.1"
BELOW = "0.34"
#: the first release verified to define ``allocate_kv_cache`` in ``vllm.v1.worker.utils``
SHARED_BUFFER_MINIMUM = "0.33.0"


def _patch(name: str, module: str, apply, *, minimum: str = MINIMUM, below: str = BELOW,
           required: bool = True) -> Patch:
    return Patch(name, "vllm", module, apply, minimum=minimum, below=below, required=required)


PATCHES: list[Patch] = [
    _patch("vllm_kv_alloc_utils", "vllm.v1.worker.utils", kv_reservation.apply_allocate_kv_cache,
           minimum=SHARED_BUFFER_MINIMUM, required=False),  # 0.19 allocates elsewhere
    _patch("vllm_kv_alloc_model_runner", "vllm.v1.worker.gpu_model_runner", kv_reservation.apply_gpu_model_runner),
    _patch("vllm_kv_alloc_attn_utils", "vllm.v1.worker.gpu.attn_utils", kv_reservation.apply_attn_utils),
    _patch("vllm_kv_alloc_hisparse", "vllm.v1.hisparse.binding", kv_reservation.apply_allocate_kv_cache,
           minimum=SHARED_BUFFER_MINIMUM, required=False),
    _patch("vllm_kv_alloc_uniform", "vllm.v1.worker.kv_connector_model_runner_mixin",
           kv_reservation.apply_uniform_kv_caches, below=SHARED_BUFFER_MINIMUM, required=False),
    _patch("vllm_kv_sizing", "vllm.v1.worker.gpu_worker", kv_sizing.apply_gpu_worker),
    _patch("vllm_sleep_mode_worker", "vllm.v1.worker.gpu_worker", memory_release.apply_gpu_worker),
    _patch("vllm_sleep_mode_executor", "vllm.v1.executor.abstract", memory_release.apply_executor),
    _patch("vllm_engine_core", "vllm.v1.engine.core", engine.apply_engine_core),
    _patch("vllm_prefix_eviction", "vllm.v1.core.sched.scheduler", prefix_eviction.apply_scheduler),
    _patch("vllm_kvcached_sizing", "kvcached.integration.vllm.patches", kvcached_mode.apply_kvcached_patches,
           required=False),
]


def check_flags() -> None:
    """Say once, at startup, when the installed vLLM is outside the supported range."""
    version = installed("vllm")
    if version is not None and not in_range(version, MINIMUM, BELOW):
        log.warning(
            "event=vllm_unsupported version=%s supported=>=%s,<%s detail=patches_skipped_running_without_broker",
            version, MINIMUM, BELOW,
        )
