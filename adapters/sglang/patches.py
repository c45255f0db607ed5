"""The SGLang patch set: what is hooked, where, and for which SGLang releases.

Supported: the range in the table of supported releases (``adapters/support.py``, ``SGLANG``;
0.5.12 is the first release with DeepSeek-V4 pools), verified against the real classes of each
release it lists.  A release outside the range registers no patch and runs without the broker (the startup
hook says so once, and with ``KVCACHED_REQUIRE=1`` stops the start: :mod:`..release_check`).  The releases' module layouts are the table's gates.

| concern | module | symbol | releases |
|---|---|---|---|
| DSV4 reservations | ``mem_cache.deepseek_v4_memory_pool`` | ``DeepSeekV4TokenToKVPool.__init__`` | all |
| DSV4 reservations | ``mem_cache.dsv41_request_window`` | ``RequestWindow._ensure_workspace`` | 0.5.21+ |
| KV sizing, ``kv_static`` | ``mem_cache.kv_cache_configurator`` | ``KVCacheConfigurator`` | 0.5.16+ |
| KV sizing, ``kv_static`` | ``model_executor.model_runner_kv_cache_mixin`` | ``ModelRunnerKVCacheMixin`` | 0.5.12-0.5.15 |
| paged allocator | ``mem_cache.allocator`` | ``PagedTokenToKVPoolAllocator`` (module or package) | all |
| paged allocator | ``mem_cache.allocator.swa`` | the name the SWA allocator builds from | 0.5.13+ |
| paged allocator | ``mem_cache.swa_memory_pool`` | the same, legacy layout | 0.5.12 |
| paged allocator | ``mem_cache.kv_cache_configurator`` | the name pools are built from | 0.5.16+ |
| paged allocator | ``model_executor.model_runner_kv_cache_mixin`` | the same, before the configurator | 0.5.12-0.5.15 |
| KV sizing hold | ``managers.scheduler`` | ``Scheduler.init_model_worker`` (target and draft pools) | all |
| kvcached mode: sync points | ``managers.scheduler`` | ``Scheduler.ingest_requests`` (``process_input_requests`` where absent) | all |
| kvcached mode: virtual K/V rows | ``mem_cache.memory_pool`` | ``MHATokenToKVPool._build_kv_buffer_descs`` | where present |
| kvcached mode: sizing order | ``kvcached.integration.sglang.patches`` | kvcached's capacity patch (the broker's cap re-wrapped outside) | all |
| memory occupation | ``managers.scheduler_components.weight_updater`` | ``SchedulerWeightUpdaterManager.release/resume_memory_occupation`` | 0.5.13+ |
| memory occupation | ``managers.scheduler_update_weights_mixin`` | ``SchedulerUpdateWeightsMixin.release/resume_memory_occupation`` | 0.5.12 |

``PATCHES`` is computed when read: the patches for the installed release's module layout
(every patch when the release is outside the supported range, so that each logs its skip).
``ALL_PATCHES`` lists every patch of every layout.
"""

from __future__ import annotations

from .. import flags, patching, support
from ..patching import AnyOf, Patch, PatchError, Target
from ..versions import installed
from . import (allocator_binding, dsv4_reservation, kv_sizing, kvcached_buffers, kvcached_sizing, kvcached_sync,
               memory_release, startup)

RUNTIME = support.SGLANG
MINIMUM = RUNTIME.supported.minimum
BELOW = RUNTIME.supported.below
CONFIGURATOR = RUNTIME.gates["configurator"]  # KVCacheConfigurator replaces the model-runner mixin
PACKAGE_LAYOUT = RUNTIME.gates["allocator_package"]  # the allocator module becomes a package
REQUEST_WINDOW = RUNTIME.gates["request_window"]

_MEM = "sglang.srt.mem_cache"
_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin"


def _patch(name: str, module: str, apply, minimum: str | None = None, below: str | None = None, *,
           required: bool = True, targets: tuple = ()) -> Patch:
    """A patch for the layout ``[minimum, below)`` (gates; None: every layout), applied inside the
    supported range only."""
    return Patch(name, "sglang", module, apply, minimum=minimum or MINIMUM, below=below or BELOW, required=required,
                 targets=targets, since=minimum, until=below)


_SIZING = (Target("_profile_available_bytes"), Target("_resolve_memory_pool_config"), Target("_init_pools"))
_ALLOCATOR = (Target("PagedTokenToKVPoolAllocator"),)
_OCCUPATION = ("release_memory_occupation", "resume_memory_occupation")


def _methods(cls: str, targets) -> tuple[Target, ...]:
    return tuple(Target(f"{cls}.{t.symbol}" if isinstance(t, Target) else f"{cls}.{t}") for t in targets)


ALL_PATCHES: list[Patch] = [
    _patch("sglang_dsv4_pool_reservation", f"{_MEM}.deepseek_v4_memory_pool", dsv4_reservation.apply_memory_pool,
           targets=(Target("DeepSeekV4TokenToKVPool.__init__", ("self",)),)),
    _patch("sglang_dsv4_request_window", f"{_MEM}.dsv41_request_window", dsv4_reservation.apply_request_window,
           minimum=REQUEST_WINDOW, targets=(Target("RequestWindow._ensure_workspace", ("self",)),)),
    _patch("sglang_kv_sizing_configurator", f"{_MEM}.kv_cache_configurator", kv_sizing.apply_configurator,
           minimum=CONFIGURATOR, targets=_methods("KVCacheConfigurator", _SIZING)),
    _patch("sglang_kv_sizing_mixin", _MIXIN, kv_sizing.apply_mixin, below=CONFIGURATOR,
           targets=_methods("ModelRunnerKVCacheMixin", _SIZING)),
    _patch("sglang_paged_allocator", f"{_MEM}.allocator", allocator_binding.apply_binding, targets=_ALLOCATOR),
    _patch("sglang_paged_allocator_swa", f"{_MEM}.allocator.swa", allocator_binding.apply_binding,
           minimum=PACKAGE_LAYOUT, targets=_ALLOCATOR),
    _patch("sglang_paged_allocator_swa_legacy", f"{_MEM}.swa_memory_pool", allocator_binding.apply_binding,
           below=PACKAGE_LAYOUT, targets=_ALLOCATOR),
    _patch("sglang_paged_allocator_configurator", f"{_MEM}.kv_cache_configurator", allocator_binding.apply_binding,
           minimum=CONFIGURATOR, targets=_ALLOCATOR),
    _patch("sglang_paged_allocator_mixin", _MIXIN, allocator_binding.apply_binding, below=CONFIGURATOR,
           targets=_ALLOCATOR),
    _patch("sglang_kv_startup", "sglang.srt.managers.scheduler", startup.apply_scheduler,
           targets=(Target("Scheduler.init_model_worker", ("self",)),)),
    _patch("sglang_kvcached_sync", "sglang.srt.managers.scheduler", kvcached_sync.apply_scheduler,
           targets=(AnyOf((Target("Scheduler.ingest_requests", ("self",)),
                           Target("Scheduler.process_input_requests", ("self",)))),)),
    _patch("sglang_kvcached_buffers", f"{_MEM}.memory_pool", kvcached_buffers.apply_memory_pool,
           targets=(Target("MHATokenToKVPool"), Target(f"MHATokenToKVPool.{kvcached_buffers.METHOD}", optional=True))),
    _patch("sglang_kvcached_sizing_order", "kvcached.integration.sglang.patches",
           kv_sizing.apply_kvcached_patches, required=False,  # ensure_outermost covers it
           targets=(Target(f"{kvcached_sizing.CAPACITY_PATCH_CLASS}.patch_profile_available_bytes",
                           ("self", "target_module")),)),
    _patch("sglang_memory_occupation", "sglang.srt.managers.scheduler_components.weight_updater",
           memory_release.apply_weight_updater, minimum=PACKAGE_LAYOUT,
           targets=_methods("SchedulerWeightUpdaterManager", _OCCUPATION)),
    _patch("sglang_memory_occupation_legacy", "sglang.srt.managers.scheduler_update_weights_mixin",
           memory_release.apply_update_weights_mixin, below=PACKAGE_LAYOUT,
           targets=_methods("SchedulerUpdateWeightsMixin", _OCCUPATION)),
]


def layout_patches(version: str) -> list[Patch]:
    """The patches for ``version``'s module layout, whatever the supported range (the canary)."""
    return patching.layout_patches(ALL_PATCHES, version)


def patches_for(version: str | None) -> list[Patch]:
    """The patches for ``version``'s module layout; every patch outside the supported range."""
    return patching.patches_for(ALL_PATCHES, version, RUNTIME.supports(version))


def __getattr__(name: str):
    if name == "PATCHES":
        return patches_for(installed("sglang"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_flags() -> None:
    """Refuse the unimplemented pool bridge (an unsupported release is :mod:`..release_check`'s)."""
    if flags.dsv4_kv_pool_bridge():
        raise PatchError(
            "KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE=1 is not supported: bridging a DeepSeek-V4 pool into elastic "
            "management is future work; unset it (the V4 pools stay runtime-owned and are reported as reservations)"
        )

