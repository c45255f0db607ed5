"""The test model's KV cache as vLLM plans it and kvcached lays it out, for the overlay's vLLM.

kvcached 0.1.6 has two vLLM integrations: up to vLLM 0.28 its V1 model-runner patch creates K and
V buffers per layer (``interfaces.alloc_kv_cache``); for 0.29 and 0.30 its Model Runner V2
adapter (``model_runner_v2``) backs vLLM's one packed KV buffer (``BLNHC``: a block holds every
layer's page) with one unified pool per layer, and EngineCore's pool uses the same geometry
(kvcached's own ``VLLM_MRV2_RANGE`` decides, as in kvcached).  The engine and the workers of a
test build the same config here, so their pools agree page for page.
"""

from __future__ import annotations

from typing import Any

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 4, 8, 128, 16
VIRTUAL_BLOCKS = 4096
PAGE_BYTES = 2 << 20  # kvcached's page
#: bytes one block holds per layer: K and V of 16 tokens x 8 heads x 128 x fp16
LAYER_BLOCK_BYTES = 2 * BLOCK_TOKENS * HEADS * HEAD_DIM * 2


def runner_v2(version: str | None = None) -> bool:
    """True where kvcached drives vLLM's Model Runner V2 (its own version window).  False without
    kvcached or vLLM: outside a kvcached+vllm overlay, where every test here skips (conftest.py)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        from kvcached.integration.version_utils import VersionRange
        from kvcached.integration.vllm.patches import VLLM_MRV2_RANGE

        version = version or installed("vllm")
    except (ImportError, PackageNotFoundError):
        return False
    return VersionRange(VLLM_MRV2_RANGE).contains(version)


def pool_page_bytes() -> int:
    """Bytes one kvcached page costs across the pool: a page per layer (per K and V buffer on V1)."""
    return PAGE_BYTES * LAYERS * (1 if runner_v2() else 2)


def blocks_per_page() -> int:
    """Blocks one kvcached page holds: a layer's K page (V1) or a layer's K-and-V page (V2)."""
    return PAGE_BYTES // (LAYER_BLOCK_BYTES if runner_v2() else LAYER_BLOCK_BYTES // 2)


def _planner():
    try:
        from vllm.v1.core import kv_cache_planning

        return kv_cache_planning
    except ImportError:
        from vllm.v1.core import kv_cache_utils

        return kv_cache_utils


def kv_cache_config(vc: Any) -> tuple[Any, Any]:
    """``(KVCacheConfig, layout)`` of the test model planned by vLLM for ``VIRTUAL_BLOCKS`` blocks; the
    layout is the one kvcached allows (its ``KVLayoutV2Patch``) where it drives Model Runner V2."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    specs = {f"model.layers.{i}.attn": FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=HEADS,
                                                         head_size=HEAD_DIM, dtype=torch.float16)
             for i in range(LAYERS)}
    layout = None
    if runner_v2():
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

        vc.cache_config.kv_cache_layout = None
        layout = resolve_kv_cache_layout(vc, [["BLNHC", "BLHNC"]], list(specs.values()))
    planner = _planner()
    groups = planner.get_kv_cache_groups(vc, specs)
    return planner.get_kv_cache_config_from_groups(vc, groups, VIRTUAL_BLOCKS * LAYERS * LAYER_BLOCK_BYTES), layout


def create_worker_tensors(vc: Any) -> Any:
    """What kvcached's patched model runner does in a worker: its KV tensors, whole-GPU virtual."""
    import torch

    from kvcached.integration.vllm import interfaces

    if not runner_v2():
        return interfaces.alloc_kv_cache((2, VIRTUAL_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM), BLOCK_TOKENS,
                                         torch.float16, "cuda:0", LAYERS)
    from kvcached.integration.vllm import model_runner_v2

    config, layout = kv_cache_config(vc)
    return model_runner_v2.allocate_kv_cache(config, "cuda:0", layout)
