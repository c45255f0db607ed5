"""Build real SGLang memory pools on CPU, for the tests and their worker processes.

Everything here uses the installed SGLang (an overlay): ``DeepSeekV4TokenToKVPool`` with
``device="cpu"`` and the constructor arguments of the installed release, and the real
``_profile_available_bytes`` of ``KVCacheConfigurator`` (0.5.16+) or
``ModelRunnerKVCacheMixin`` (before), fed a simulated free-memory figure instead of CUDA's.

:func:`tensor_bytes_by_pool` is the test's own account of a DeepSeek-V4 pool: it names every
tensor by its attribute path for the installed release and sums ``numel * element_size``,
independently of the adapter's walk.
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any, Iterator

import torch

from kvcached_broker.adapters.versions import installed, parse

PAGE = 256
SGLANG = installed("sglang") or "0"  # outside an overlay the tests are skipped (conftest)


def at_least(minimum: str) -> bool:
    return parse(SGLANG) >= parse(minimum)


@contextlib.contextmanager
def runtime_config(**server_args: Any) -> Iterator[None]:
    """Publish the server args SGLang's pool constructors and profiler read."""
    if at_least("0.5.16"):
        from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config
        from sglang.srt.runtime_context import get_context

        args = {"page_size": PAGE, "cuda_graph_config": default_cuda_graph_config(), **server_args}
        with get_context().override_server_args(**args):
            yield
        return
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as dsv4

    original = dsv4.get_global_server_args
    dsv4.get_global_server_args = lambda: types.SimpleNamespace(
        enable_deepseek_v4_fp4_indexer=False, speculative_algorithm=None
    )
    try:
        yield
    finally:
        dsv4.get_global_server_args = original


def dsv4_kwargs(full_pages: int, swa_pages: int, ratios=(4, 128, 4, 128), num_reqs: int = 4) -> dict[str, Any]:
    """Constructor arguments of ``DeepSeekV4TokenToKVPool`` for the installed release."""
    full_tokens = full_pages * PAGE
    kwargs: dict[str, Any] = dict(
        max_num_reqs=num_reqs, swa_size=swa_pages * PAGE, c4_size=full_tokens // 4, c128_size=full_tokens // 128,
        c4_state_pool_size=swa_pages * 8, c128_state_pool_size=(num_reqs + 1) * 128, page_size=PAGE,
        swa_page_size=PAGE, dtype=torch.float8_e4m3fn, qk_nope_head_dim=448, qk_rope_head_dim=64,
        indexer_head_dim=128, layer_num=len(ratios), device="cpu", enable_memory_saver=False,
        compression_ratios=list(ratios),
    )
    if at_least("0.5.14"):
        kwargs.update(c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, sliding_window=128,
                      num_req_slots=num_reqs + 1)
    else:
        kwargs.update(state_dtype=torch.float32)
    if at_least("0.5.21"):
        kwargs.update(full_size=full_tokens)
    return kwargs


def build_dsv4_pool(full_pages: int, swa_pages: int, *, request_window: bool = False, **kwargs: Any) -> Any:
    """A real DeepSeek-V4 pool; ``request_window`` builds the DSV4.1 encoder-replay mode (0.5.21+)."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    mode = {"enable_encoder_swa_bounded_replay": True, "chunked_prefill_size": 512} if request_window else {}
    with runtime_config(**mode):
        return DeepSeekV4TokenToKVPool(**dsv4_kwargs(full_pages, swa_pages, **kwargs))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def tensor_bytes_by_pool(pool: Any) -> dict[str, int]:
    """The test's own per-pool byte count of a DeepSeek-V4 pool, by explicit attribute path."""
    out: dict[str, int] = {}
    if pool.swa_kv_pool is not None:
        out["swa_kv_pool"] = _nbytes(pool.swa_kv_pool.kv_buffer)
    window = getattr(pool, "request_window", None)
    if window is not None:
        workspace = window.workspace.kv_buffer if window.workspace is not None else []
        out["request_window"] = _nbytes([*window.state.kv_buffer, *workspace, window.tags])
    if at_least("0.5.20"):
        kv_pools = {r: p for r, p in pool.kv_pools.items() if p is not None}
        index_pools = {r: p for r, p in pool.index_pools.items() if p is not None}
    else:
        kv_pools = {r: getattr(pool, f"c{r}_kv_pool") for r in (4, 128) if getattr(pool, f"c{r}_kv_pool", None)}
        index_pools = {4: pool.c4_indexer_kv_pool} if pool.c4_indexer_kv_pool is not None else {}
    for ratio, sub in kv_pools.items():
        out[f"c{ratio}_kv_pool"] = _nbytes(sub.kv_buffer)
    for ratio, sub in index_pools.items():
        out[f"c{ratio}_indexer_kv_pool"] = _nbytes(sub.index_k_with_scale_buffer)
    for name in ("compress_state_pools", "indexer_compress_state_pools"):
        states = [s.kv_score_buffer.kv_score for s in getattr(pool, name) if s is not None]
        if states:
            out[name] = _nbytes(states)
    return {name: size for name, size in out.items() if size}


def unique_storage_bytes(pool: Any) -> int:
    """Every distinct storage reachable from the pool, found by a walk of its own (no names)."""
    seen, total, stack, visited = set(), 0, [pool], set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited or obj is None:
            continue
        visited.add(id(obj))
        if hasattr(obj, "untyped_storage"):
            key = obj.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("sglang."):
            attrs = getattr(obj, "__dict__", {})
            stack.extend(v for k, v in attrs.items() if k not in ("memory_saver_adapter", "custom_mem_pool"))
    return total


def dsv4_units_for(budget_bytes: int, *, swa_per_unit: int = 1, full_per_unit: int = 4) -> int:
    """The most pool units (``full_per_unit`` full pages + ``swa_per_unit`` SWA pages) that fit.

    The test's stand-in for SGLang's DSV4 pool configurator, which needs a whole model config:
    it measures two probe pools (reservation switched off, so they are not reported) and
    solves the linear cost.
    """
    saved = os.environ.get("KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION")
    os.environ["KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION"] = "0"
    try:
        one = sum(tensor_bytes_by_pool(build_dsv4_pool(full_per_unit, swa_per_unit)).values())
        two = sum(tensor_bytes_by_pool(build_dsv4_pool(2 * full_per_unit, 2 * swa_per_unit)).values())
    finally:
        if saved is None:
            os.environ.pop("KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION")
        else:
            os.environ["KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION"] = saved
    per_unit, fixed = two - one, 2 * one - two
    return max(0, (budget_bytes - fixed) // per_unit)


# ------------------------------------------------------------------------- KV sizing profile
class _Runner:
    """Stands in for the ModelRunner the 0.5.12-0.5.15 mixin method runs on (attributes only)."""


def profiler(free_bytes: int, real_world_group: bool = False) -> Any:
    """An object whose real ``_profile_available_bytes`` sees ``free_bytes`` of free device memory.

    ``get_available_gpu_memory`` (CUDA's free memory, bound by name in the profiling module) is
    replaced by the simulated figure; everything else is the installed SGLang's code.  With
    ``real_world_group`` (a process that joined a TP group) SGLang's world group is left alone.
    """
    free_gib = free_bytes / (1 << 30)
    if at_least("0.5.16"):
        import sglang.srt.mem_cache.kv_cache_configurator as module

        module.get_available_gpu_memory = lambda *args, **kwargs: free_gib
        obj = object.__new__(module.KVCacheConfigurator)
        obj.device, obj.gpu_id, obj.mambaish_config, obj.post_capture_kv_active = "cpu", 0, None, False
        obj.model_config = types.SimpleNamespace(is_multimodal=False)
        from sglang.srt.runtime_context import get_parallel

        if not real_world_group:
            get_parallel().override_permanently(world_group=types.SimpleNamespace(cpu_group=None))
        return obj
    import sglang.srt.model_executor.model_runner_kv_cache_mixin as module

    module.get_available_gpu_memory = lambda *args, **kwargs: free_gib
    if not real_world_group:
        module.get_world_group = lambda: types.SimpleNamespace(world_size=1, cpu_group=None)
    runner_cls = type("Runner", (module.ModelRunnerKVCacheMixin, _Runner), {})
    obj = runner_cls()
    obj.device, obj.gpu_id, obj.mem_fraction_static, obj.mambaish_config = "cpu", 0, 0.9, None
    obj.server_args = types.SimpleNamespace(page_size=PAGE, max_total_tokens=None, mem_fraction_static=0.9)
    return obj


def profile(free_bytes: int, real_world_group: bool = False, pre_model_load_bytes: int = 0) -> int:
    """SGLang's KV budget for ``free_bytes`` free, ``pre_model_load_bytes`` free before the weights
    loaded (SGLang keeps ``(1 - mem_fraction_static)`` of that as slack; 0: no slack)."""
    return run_profile(profiler(free_bytes, real_world_group), pre_model_load_bytes)


def run_profile(obj: Any, pre_model_load_bytes: int = 0) -> int:
    """Run the real ``_profile_available_bytes`` of a :func:`profiler` object (SGLang takes GB)."""
    with runtime_config(mem_fraction_static=0.9):
        return obj._profile_available_bytes(pre_model_load_bytes / (1 << 30))


def configure_logging(level: str) -> None:
    """Configure logging as an SGLang scheduler process does, with SGLang's own function."""
    from sglang.srt.utils import configure_logger

    configure_logger(types.SimpleNamespace(log_level=level), prefix=" TP0")


# ------------------------------------------------------------------ release/resume of memory
class MemorySaver:
    """torch_memory_saver as SGLang's adapter sees it (it needs CUDA): enabled, pausing and
    resuming regions by tag.  ``on_change(tag, mapped)`` follows each one (a test tells the
    simulated device what the process now uses)."""

    def __init__(self, enabled: bool = True, on_change=None):
        self.enabled = enabled
        self.calls: list[tuple[str, str]] = []
        self.on_change = on_change

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))
        if self.on_change is not None:
            self.on_change(tag, False)

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))
        if self.on_change is not None:
            self.on_change(tag, True)


def weight_updater(saver: MemorySaver, tp_cpu_group: Any = None) -> Any:
    """The object SGLang runs release/resume of memory occupation on (``SchedulerWeightUpdaterManager``
    in 0.5.13+, a scheduler with ``SchedulerUpdateWeightsMixin`` in 0.5.12), holding only what
    those methods read: the saver, a one-layer model (the weights path stashes its buffers) and
    the TP CPU group (the weights path has a barrier on it)."""
    if at_least("0.5.13"):
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager as cls
    else:
        from sglang.srt.managers.scheduler_update_weights_mixin import SchedulerUpdateWeightsMixin

        cls = type("Scheduler", (SchedulerUpdateWeightsMixin,), {})
    model = torch.nn.Linear(2, 2)
    model.register_buffer("scale", torch.ones(2))
    obj = object.__new__(cls)
    for name, value in {"memory_saver_adapter": saver, "offload_tags": set(), "scheduler": None,
                        "tp_worker": types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model)),
                        "tp_cpu_group": tp_cpu_group, "draft_worker": None, "flush_cache": lambda *a, **k: True,
                        "is_fully_idle": lambda *a, **k: True}.items():
        try:
            setattr(obj, name, value)
        except AttributeError:  # a slotted release without that field (0.5.13 has no scheduler)
            pass
    return obj


def occupation_request(kind: str, tags: list[str] | None) -> Any:
    """SGLang's ``ReleaseMemoryOccupationReqInput`` or ``ResumeMemoryOccupationReqInput``."""
    from sglang.srt.managers import io_struct

    return getattr(io_struct, f"{kind}MemoryOccupationReqInput")(tags=tags)


def release(updater: Any, tags: list[str] | None = None) -> Any:
    """SGLang's own ``release_memory_occupation`` (its weights path reads the published config)."""
    with runtime_config():
        return updater.release_memory_occupation(occupation_request("Release", tags))


def resume(updater: Any, tags: list[str] | None = None) -> Any:
    with runtime_config():
        return updater.resume_memory_occupation(occupation_request("Resume", tags))
