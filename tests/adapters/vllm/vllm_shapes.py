"""KV cache configs built by vLLM itself, from vLLM's own spec classes, on a CPU VllmConfig.

* :func:`dsv4_config`: DeepSeek-V4 cache layers as vLLM 0.33's ``vllm.models.deepseek_v4``
  declares them (SWA cache, C4/C128 compressed MLA, the C4 indexer, compressor state), grouped
  and packed by vLLM's planner into one shared buffer.
* :func:`hybrid_config`: a plain full-attention + sliding-window model (every release).
* :func:`mla_config`: a DeepSeek-V3.2-shaped MLA + indexer model (releases without V4 fields).

Nothing here is a fake: the planner, the block pool, the manager and the request are vLLM's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from types import SimpleNamespace
from typing import Any

import torch

PAGE_TOKENS = 256  # the compressed MLA / indexer block (cache_config.block_size for V4)
SWA_BLOCK = 64
RATIOS = (4, 128, 4, 128)  # compress ratio per layer, as in DeepSeek-V4's alternating layers


def kwargs_for(fn: Any, **candidates: Any) -> dict[str, Any]:
    """The candidates ``fn`` accepts (signatures differ between releases)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in candidates.items() if k in params}


def kvi():
    from vllm.v1 import kv_cache_interface

    return kv_cache_interface


def has_v4_specs() -> bool:
    names = {f.name for f in dataclasses.fields(kvi().MLAAttentionSpec)}
    return {"model_version", "tokens_per_state"} <= names and hasattr(kvi(), "SlidingWindowMLASpec")


def planner():
    try:
        from vllm.v1.core import kv_cache_planning

        return kv_cache_planning
    except ImportError:
        from vllm.v1.core import kv_cache_utils

        return kv_cache_utils


def vllm_config():
    """A CPU ``VllmConfig``.  vLLM 0.34 refuses one on x86 unless Triton has a CPU backend (its
    CPU model runner needs triton-cpu): there, the platform's check alone is run again with Triton
    (the base's, no driver here) counted as present.  Only the config is built, and no kernel
    runs; nothing else sees Triton (modules that read ``HAS_TRITON`` at import keep their
    Triton-free paths)."""
    from vllm.config import DeviceConfig, VllmConfig

    try:
        return VllmConfig(device_config=DeviceConfig(device="cpu"))
    except RuntimeError as exc:
        if "requires Triton" not in str(exc):
            raise
    with _cpu_check_counting_triton():
        return VllmConfig(device_config=DeviceConfig(device="cpu"))


@contextlib.contextmanager
def _cpu_check_counting_triton():
    import vllm.triton_utils
    from vllm.platforms import cpu

    check = vars(cpu.CpuPlatform)["check_and_update_config"]

    def check_and_update_config(cls, vllm_config):
        saved = vllm.triton_utils.HAS_TRITON
        vllm.triton_utils.HAS_TRITON = True
        try:
            return check.__func__(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = saved

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        cpu.CpuPlatform.check_and_update_config = check


def _resolve_layout(vc: Any, choices: list[list[str]], specs: dict[str, Any]) -> Any:
    if not hasattr(vc.cache_config, "get_resolved_kv_cache_layout"):
        return None
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    vc.cache_config.kv_cache_layout = None
    return resolve_kv_cache_layout(vc, choices, list(specs.values()))


def _any_layout(vc: Any, specs: dict[str, Any]) -> Any:
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return None
    return _resolve_layout(vc, [[layout.name for layout in KVCacheLayout]], specs)


def layout_of(vc: Any) -> Any:
    getter = getattr(vc.cache_config, "get_resolved_kv_cache_layout", None)
    return getter() if getter else None


def _spec(cls: Any, **fields: Any) -> Any:
    """``cls(**fields)`` with the fields this release's spec class has (``max_tp_shards`` arrived
    after 0.30, say): the layers' shapes are the same."""
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in fields.items() if name in known})


def dsv4_specs() -> dict[str, Any]:
    m = kvi()
    specs: dict[str, Any] = {}
    for layer, ratio in enumerate(RATIOS):
        prefix = f"model.layers.{layer}.self_attn"
        specs[f"{prefix}.swa_cache"] = _spec(
            m.SlidingWindowMLASpec,
            block_size=SWA_BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8,
            sliding_window=128, cache_dtype_str="fp8_ds_mla", state_content_bytes=584, alignment=576,
            model_version="deepseek_v4")
        specs[f"{prefix}.attn"] = _spec(
            m.MLAAttentionSpec,
            block_size=PAGE_TOKENS, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8,
            tokens_per_state=ratio, cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
            state_content_bytes=584)
        state_coeff = 2 if ratio == 4 else 1  # C4 compressors keep overlapping windows
        specs[f"{prefix}.compressor.state_cache"] = _spec(
            m.SlidingWindowMLASpec,
            block_size=4 if ratio == 4 else 8, num_kv_heads=1, max_tp_shards=1, head_size=2 * state_coeff * 512,
            dtype=torch.float32, sliding_window=state_coeff * ratio, alignment=576)
        if ratio == 4:
            specs[f"{prefix}.indexer.k_cache"] = _spec(
            m.MLAAttentionSpec,
                block_size=PAGE_TOKENS, num_kv_heads=1, max_tp_shards=1, head_size=128 + 4, dtype=torch.uint8,
                tokens_per_state=4, alignment=576)
            specs[f"{prefix}.indexer.compressor.state_cache"] = _spec(
            m.SlidingWindowMLASpec,
                block_size=4, num_kv_heads=1, max_tp_shards=1, head_size=2 * 2 * 128, dtype=torch.float32,
                sliding_window=8, alignment=576)
    return specs


def dsv4_config(kv_bytes: int) -> tuple[Any, Any]:
    """``(VllmConfig, KVCacheConfig)`` for the DeepSeek-V4 layers, planned into ``kv_bytes``."""
    vc = vllm_config()
    specs = dsv4_specs()
    _resolve_layout(vc, [["BLHNC", "BLNHC"]], specs)  # what V4's indexer backends declare
    groups = planner().get_kv_cache_groups(vc, specs)
    return vc, planner().get_kv_cache_config_from_groups(vc, groups, kv_bytes)


def hybrid_specs(layers: int = 4) -> dict[str, Any]:
    """Alternating full-attention and 128-token sliding-window layers (bf16, 2 KV heads of 64)."""
    m = kvi()
    specs = {}
    for layer in range(layers):
        if layer % 2 == 0:
            specs[f"model.layers.{layer}.attn"] = m.FullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        else:
            specs[f"model.layers.{layer}.attn"] = m.SlidingWindowSpec(
                block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    return specs


def hybrid_config(kv_bytes: int, layers: int = 4) -> tuple[Any, Any]:
    """A full-attention + sliding-window model (two cache groups)."""
    specs = hybrid_specs(layers)
    vc = vllm_config()
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    _any_layout(vc, specs)
    groups = planner().get_kv_cache_groups(vc, specs)
    return vc, planner().get_kv_cache_config_from_groups(vc, groups, kv_bytes)


def mla_config(kv_bytes: int, layers: int = 4) -> tuple[Any, Any]:
    """DeepSeek-V3.2-shaped: fp8_ds_mla MLA plus an indexer K cache per layer."""
    m = kvi()
    specs = {}
    for layer in range(layers):
        prefix = f"model.layers.{layer}.self_attn"
        specs[f"{prefix}.attn"] = m.MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8, cache_dtype_str="fp8_ds_mla")
        specs[f"{prefix}.indexer.k_cache"] = m.MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    vc = vllm_config()
    _any_layout(vc, specs)
    groups = planner().get_kv_cache_groups(vc, specs)
    return vc, planner().get_kv_cache_config_from_groups(vc, groups, kv_bytes)


def allocate(vc: Any, kv_cfg: Any) -> dict[str, Any]:
    """Allocate ``kv_cfg`` on CPU as this release's GPU model runner does (through any patch on it):
    the V1 runner's binding (0.29-0.33) or method (0.19-0.28); Model Runner V2's ``gpu.attn_utils``
    binding where the V1 runner is gone (0.34+)."""
    import importlib.util

    if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None:
        from vllm.v1.worker.gpu import attn_utils

        return attn_utils.allocate_kv_cache(kv_cfg, torch.device("cpu"), layout_of(vc))
    from vllm.v1.worker import gpu_model_runner

    if hasattr(gpu_model_runner, "allocate_kv_cache"):  # 0.29+: the name bound in the runner's module
        return gpu_model_runner.allocate_kv_cache(kv_cfg, torch.device("cpu"), layout_of(vc))
    runner = object.__new__(gpu_model_runner.GPUModelRunner)  # 0.19: the runner's own method
    runner.device = torch.device("cpu")
    runner.runner_only_attn_layers = set()
    return runner._allocate_kv_cache_tensors(kv_cfg)


def kv_cache_manager(vc: Any, kv_cfg: Any, *, max_model_len: int = 8192, enable_caching: bool = False) -> Any:
    """vLLM's scheduler-side KVCacheManager over ``kv_cfg`` (the scheduler's copy, as EngineCore makes it)."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    sched_cfg = kv_cache_utils.generate_scheduler_kv_cache_config([kv_cfg])
    if hasattr(kv_cache_utils, "resolve_kv_cache_block_sizes"):
        sched_bs, hash_bs = kv_cache_utils.resolve_kv_cache_block_sizes(sched_cfg, vc)
    else:
        sizes = [g.kv_cache_spec.block_size for g in sched_cfg.kv_cache_groups]
        sched_bs, hash_bs = math.lcm(*sizes), math.gcd(*sizes)
    return KVCacheManager(**kwargs_for(
        KVCacheManager.__init__, kv_cache_config=sched_cfg, max_model_len=max_model_len,
        scheduler_block_size=sched_bs, hash_block_size=hash_bs, enable_caching=enable_caching))


def request(request_id: str, num_tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(**kwargs_for(
        Request.__init__, request_id=request_id, prompt_token_ids=list(range(num_tokens)),
        sampling_params=SamplingParams(max_tokens=16), pooling_params=None))


# ----------------------------------------------------------------------------- the GPU worker
class WithMaxModelLen:
    """A VllmConfig with a model length (a CPU VllmConfig has no model config)."""

    def __init__(self, vc, max_model_len: int):
        self._vc = vc
        self.model_config = SimpleNamespace(max_model_len=max_model_len)

    def __getattr__(self, name):
        return getattr(self._vc, name)


def gpu_worker(kv_cache_memory_bytes=None, max_model_len=4096):
    """vLLM's own ``Worker`` on CPU, as far as its KV sizing reads it (the hybrid model's specs)."""
    from vllm.v1.worker.gpu_worker import Worker

    vc = vllm_config()
    vc.cache_config.kv_cache_memory_bytes = kv_cache_memory_bytes
    w = object.__new__(Worker)
    w.device = torch.device("cpu")
    w.cache_config = vc.cache_config
    w.vllm_config = WithMaxModelLen(vc, max_model_len)
    specs = hybrid_specs()
    w.model_runner = SimpleNamespace(get_kv_cache_spec=lambda: specs)
    return w


def determine(profiled_bytes: int):
    """The adapter's ``determine_available_memory`` wrapper around a stand-in for vLLM's GPU profile."""
    from kvcached_broker.adapters.vllm import kv_sizing

    return kv_sizing.wrap_determine_available_memory(lambda self: profiled_bytes)
