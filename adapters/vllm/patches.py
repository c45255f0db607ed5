"""The vLLM patch set: what is hooked, where, and for which vLLM releases.

Supported: the range in the table of supported releases (``adapters/support.py``, ``VLLM``),
tested on CPU against the real classes of each release it lists.  Each patch is for a module
layout (the table's gates), and applies to whichever of its hook symbols the installed release
has; a module holding none of them is a failed patch (an error only under ``KVCACHED_REQUIRE=1``).
A release outside the range registers no patch and runs without the broker (the startup hook
says so once, or stops the start under ``KVCACHED_REQUIRE=1``: :mod:`..release_check`).

| concern | module | symbol | layout |
|---|---|---|---|
| reservations | ``vllm.v1.worker.utils`` | ``allocate_kv_cache`` (defining module; later importers bind the wrapper) | ``shared_buffer`` (0.29+) |
| reservations | ``vllm.v1.worker.gpu_model_runner`` | ``allocate_kv_cache`` (0.29+) or ``GPUModelRunner._allocate_kv_cache_tensors`` | before ``v2_runner_only`` (0.34) |
| reservations | ``vllm.v1.worker.gpu.attn_utils`` | ``allocate_kv_cache`` (0.29+) or ``_allocate_kv_cache`` | all |
| reservations | ``vllm.v1.hisparse.binding`` | ``allocate_kv_cache`` | ``hisparse`` (0.30+, optional) |
| reservations | ``vllm.v1.worker.kv_connector_model_runner_mixin`` | ``KVConnectorModelRunnerMixin.allocate_uniform_kv_caches`` (cross-layer KV connectors) | before ``shared_buffer`` |
| extensible KV cache | ``vllm.v1.worker.extensible_kv_cache`` | ``ExtensibleKVCache.commit``, ``.committable_blocks``, ``.free``; ``measure_kv_cache_blocks`` | ``extensible_kv_cache`` (0.34+) |
| extensible KV cache | ``vllm.v1.worker.gpu_worker`` | ``Worker.extend_kv_cache`` (the final size committed) | ``extensible_kv_cache`` |
| sizing | ``vllm.v1.worker.gpu_worker`` | ``Worker.determine_available_memory``, ``Worker.compile_or_warm_up_model`` | all |
| sleep mode | ``vllm.v1.worker.gpu_worker`` | ``Worker.sleep``, ``Worker.wake_up`` (and ``Worker.discard``, 0.33+) | all |
| sleep mode | ``vllm.v1.executor.abstract`` | ``Executor.wake_up`` (admits every worker before any wakes) | all |
| kvcached mode | ``vllm.v1.engine.core`` | ``EngineCore.__init__`` (announce; the prefix-cache eviction hook) | all |
| kvcached mode | ``vllm.v1.core.sched.scheduler`` | ``Scheduler.schedule`` (runs queued evictions on the engine thread) | all |
| kvcached mode | ``kvcached.integration.vllm.patches`` | ``GPUWorkerPatch`` (the sizing cap wraps kvcached's) | all (optional) |

``PATCHES`` is computed when read: the patches for the installed release's module layout (every
patch when the release is outside the supported range, so that each logs its skip).
``ALL_PATCHES`` lists every patch of every layout.

Elastic KV is kvcached mode (``adapters/kvcached``, :mod:`.kvcached_mode`) or, from 0.34, vLLM's
own extensible KV cache (:mod:`.extensible`); otherwise the KV cache is vLLM's static buffer,
sized and charged by the broker.
"""

from __future__ import annotations

from .. import patching, support
from ..patching import AnyOf, Patch, Target
from ..versions import in_range, installed
from . import engine, extensible, kv_reservation, kv_sizing, memory_release, prefix_eviction

RUNTIME = support.VLLM
MINIMUM = RUNTIME.supported.minimum
BELOW = RUNTIME.supported.below
GATES = RUNTIME.gates

_ALLOC = ("kv_cache_config", "device")


def _patch(name: str, module: str, apply, *, since: str | None = None, until: str | None = None,
           required: bool = True, targets: tuple = ()) -> Patch:
    """A patch for the layout ``[since, until)`` (gates), applied inside the supported range only."""
    minimum = since if since is not None and in_range(since, MINIMUM) else MINIMUM
    return Patch(name, "vllm", module, apply, minimum=minimum, below=until or BELOW, required=required,
                 targets=targets, since=since, until=until)


ALL_PATCHES: list[Patch] = [
    _patch("vllm_kv_alloc_utils", "vllm.v1.worker.utils", kv_reservation.apply_allocate_kv_cache,
           since=GATES["shared_buffer"], required=False, targets=(Target("allocate_kv_cache", _ALLOC),)),
    _patch("vllm_kv_alloc_model_runner", "vllm.v1.worker.gpu_model_runner", kv_reservation.apply_gpu_model_runner,
           until=GATES["v2_runner_only"],
           targets=(AnyOf((Target("allocate_kv_cache", _ALLOC),
                           Target("GPUModelRunner._allocate_kv_cache_tensors", ("self", "kv_cache_config")))),)),
    _patch("vllm_kv_alloc_attn_utils", "vllm.v1.worker.gpu.attn_utils", kv_reservation.apply_attn_utils,
           targets=(AnyOf((Target("allocate_kv_cache", _ALLOC), Target("_allocate_kv_cache", _ALLOC))),)),
    _patch("vllm_kv_alloc_hisparse", "vllm.v1.hisparse.binding", kv_reservation.apply_allocate_kv_cache,
           since=GATES["hisparse"], required=False, targets=(Target("allocate_kv_cache"),)),
    _patch("vllm_kv_alloc_uniform", "vllm.v1.worker.kv_connector_model_runner_mixin",
           kv_reservation.apply_uniform_kv_caches, until=GATES["shared_buffer"], required=False,
           targets=(Target("KVConnectorModelRunnerMixin.allocate_uniform_kv_caches",
                           ("kv_cache_config", "attn_groups", "cache_dtype", "device")),)),
    _patch("vllm_kv_extensible", "vllm.v1.worker.extensible_kv_cache", extensible.apply_extensible_kv_cache,
           since=GATES["extensible_kv_cache"],
           targets=(Target("ExtensibleKVCache.commit", ("self", "num_blocks", "defragment", "shrink")),
                    Target("ExtensibleKVCache.committable_blocks", ("self",)),
                    Target("ExtensibleKVCache.free", ("self",)),
                    Target("measure_kv_cache_blocks", ("kv_cache", "vllm_config", "device")))),
    _patch("vllm_kv_extensible_final", "vllm.v1.worker.gpu_worker", extensible.apply_gpu_worker,
           since=GATES["extensible_kv_cache"], targets=(Target("Worker.extend_kv_cache", ("self", "num_blocks")),)),
    _patch("vllm_kv_sizing", "vllm.v1.worker.gpu_worker", kv_sizing.apply_gpu_worker,
           targets=(Target("Worker.determine_available_memory", ("self",)),
                    Target("Worker.compile_or_warm_up_model", ("self",)))),
    _patch("vllm_sleep_mode_worker", "vllm.v1.worker.gpu_worker", memory_release.apply_gpu_worker,
           targets=(Target("Worker.sleep", ("self", "level")), Target("Worker.wake_up", ("self", "tags")),
                    Target("Worker.discard", ("self", "tags"), optional=True))),
    _patch("vllm_sleep_mode_executor", "vllm.v1.executor.abstract", memory_release.apply_executor,
           targets=(Target("Executor.wake_up", ("self", "tags")),)),
    _patch("vllm_engine_core", "vllm.v1.engine.core", engine.apply_engine_core,
           targets=(Target("EngineCore.__init__", ("self",)),)),
    _patch("vllm_prefix_eviction", "vllm.v1.core.sched.scheduler", prefix_eviction.apply_scheduler,
           targets=(Target("Scheduler.schedule", ("self",)),)),
    _patch("vllm_kvcached_sizing", "kvcached.integration.vllm.patches", kv_sizing.apply_kvcached_patches,
           required=False, targets=(Target("GPUWorkerPatch.patch_worker_determine_available_memory",
                                           ("self", "gpuworker_mod")),)),
]


def layout_patches(version: str) -> list[Patch]:
    """The patches for ``version``'s module layout, whatever the supported range (the canary)."""
    return patching.layout_patches(ALL_PATCHES, version)


def patches_for(version: str | None) -> list[Patch]:
    """The patches for ``version``'s module layout; every patch outside the supported range."""
    return patching.patches_for(ALL_PATCHES, version, RUNTIME.supports(version))


def __getattr__(name: str):
    if name == "PATCHES":
        return patches_for(installed("vllm"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_flags() -> None:
    """Nothing to refuse: the vLLM adapter has no flags of its own (an unsupported release is
    :mod:`..release_check`'s, before any patch is registered)."""
