"""Each worker reports its KV buffer once, with the per-group view as ``usage_breakdown``.

The configs come from vLLM's own planner; the allocation is vLLM's own function, called
through the module attribute the GPU model runner uses, with the adapter's patch on it.
"""

from __future__ import annotations

import pytest
import torch

from kvcached_broker.adapters import sessions, support
from kvcached_broker.adapters.tensors import storage_bytes
from kvcached_broker.adapters.vllm import kv_config, parallel
from kvcached_broker.adapters.vllm.kv_budget import KVCacheBudgetError
from kvcached_broker.client import BrokerClient

import vllm_shapes as shapes
from helpers import GIB, MIB

pytestmark = pytest.mark.runtime("vllm")

V4_POOLS = {"swa_kv_pool", "c4_kv_pool", "c128_kv_pool", "c4_indexer_kv_pool", "compress_state_pools"}


def instance(status, name="vllm-test"):
    """The instance entry holding this worker's session (or, for ``name``, that instance)."""
    if name != "vllm-test":
        return next(i for i in status["instances"] if i["name"] == name)
    session_id = sessions.session(parallel.identity(0)).client.session_id
    return next(i for i in status["instances"] if any(s["id"] == session_id for s in i["sessions"]))


def expected_views(kv_cfg, name_of):
    """Bytes each role's layers address, computed here from the specs, not by the adapter."""
    views: dict[str, int] = {}
    for _, layer, spec in kv_config.layer_specs(kv_cfg):
        views[name_of(layer)] = views.get(name_of(layer), 0) + kv_cfg.num_blocks * spec.page_size_bytes
    return views


def v4_role(layer: str) -> str:
    if layer.endswith("indexer.k_cache"):
        return "c4_indexer_kv_pool"
    if layer.endswith("state_cache"):
        return "compress_state_pools"
    if layer.endswith("swa_cache"):
        return "swa_kv_pool"
    index = int(layer.split(".")[2])
    return f"c{shapes.RATIOS[index]}_kv_pool"


def test_deepseek_v4_buffer_is_charged_once_and_shows_the_v4_groups(patched_vllm, gpu_broker):
    if not shapes.has_v4_specs():
        pytest.skip("this vLLM has no DeepSeek-V4 spec fields (model_version, tokens_per_state)")
    vc, kv_cfg = shapes.dsv4_config(64 * MIB)
    sizes = [t.size for t in kv_cfg.kv_cache_tensors]
    assert len(kv_cfg.kv_cache_groups) == 5 and len(set(sizes)) == 1 and len(sizes) == 8  # 8 views of 1 buffer

    caches = shapes.allocate(vc, kv_cfg)

    buffer = sizes[0]
    assert storage_bytes(caches) == buffer  # vLLM really made one allocation of that size
    inst = instance(gpu_broker.status())
    assert inst["pools"] == {"kv_static": buffer}
    assert inst["reserved_bytes"] == buffer < sum(sizes)
    assert gpu_broker.status()["free_bytes"] == GIB - buffer
    assert set(inst["usage_breakdown"]) == V4_POOLS
    views = expected_views(kv_cfg, v4_role)
    assert max(views.values()) > buffer  # the SWA layers address the shared buffer more than once
    assert inst["usage_breakdown"] == {name: min(size, buffer) for name, size in views.items()}
    assert inst["sessions"][0]["usage_breakdown"] == inst["usage_breakdown"]


def test_a_plain_hybrid_model_is_charged_once_with_one_view_per_group(patched_vllm, gpu_broker):
    vc, kv_cfg = shapes.hybrid_config(16 * MIB)
    caches = shapes.allocate(vc, kv_cfg)

    allocated = storage_bytes(caches)
    inst = instance(gpu_broker.status())
    assert inst["pools"] == {"kv_static": allocated} and allocated == kv_config.buffer_bytes(kv_cfg)
    assert allocated <= 16 * MIB  # what the planner was given, whatever each release's tensors report
    names = [kv_config.group_pool_name(i, g.kv_cache_spec) for i, g in enumerate(kv_cfg.kv_cache_groups)]
    assert names == ["kv_group0_full_attention", "kv_group1_sliding_window"]
    per_group = {name: kv_cfg.num_blocks * g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                 for name, g in zip(names, kv_cfg.kv_cache_groups)}
    assert inst["usage_breakdown"] == {name: min(size, allocated) for name, size in per_group.items()}


def test_a_mla_indexer_model_without_v4_fields_is_reported_per_group(patched_vllm, gpu_broker):
    vc, kv_cfg = shapes.mla_config(32 * MIB)
    caches = shapes.allocate(vc, kv_cfg)

    inst = instance(gpu_broker.status())
    assert inst["pools"] == {"kv_static": storage_bytes(caches)}
    assert list(inst["usage_breakdown"]) == ["kv_group0_mla_attention"]
    assert inst["usage_breakdown"]["kv_group0_mla_attention"] == kv_config.buffer_bytes(kv_cfg)


def test_a_hisparse_buffer_turns_the_sizing_hold_into_kv_static(patched_vllm, gpu_broker, vllm_version):
    """HiSparse (0.30+) allocates its device KV through ``vllm.v1.hisparse.binding``'s own
    ``allocate_kv_cache`` binding: sized, held, and allocated there, the hold becomes ``kv_static``
    in one request (up to 0.32 that binding stayed unpatched and the hold stayed charged on top of
    the buffer until the process exited).  The host-resident pool is host memory: never charged."""
    import importlib.util

    if importlib.util.find_spec("vllm.v1.hisparse") is None:
        assert not support.VLLM.at_least("hisparse", vllm_version)
        pytest.skip("HiSparse arrived in vLLM 0.30")
    import dataclasses
    from types import SimpleNamespace

    from vllm.v1.hisparse import binding
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    held = shapes.determine(32 * MIB)(shapes.gpu_worker())
    assert instance(gpu_broker.status())["holds"] == {"kv_sizing_hold": held}
    vc, kv_cfg = shapes.mla_config(held)
    attn = [name for _, name, _ in kv_config.layer_specs(kv_cfg) if name.endswith(".attn")]
    device_tensor = next(t for t in kv_cfg.kv_cache_tensors if set(t.layers) <= set(attn))
    spec = next(spec for _, name, spec in kv_config.layer_specs(kv_cfg) if name in attn)
    kv_cfg.kv_cache_tensors.append(dataclasses.replace(device_tensor, host_resident=True))  # HiSparse's host pool
    kv_cfg.kv_cache_groups.append(KVCacheGroupSpec(list(device_tensor.layers), spec, host_resident=True))
    kv_cfg.hisparse_host_num_blocks = kv_cfg.num_blocks
    host_pool = SimpleNamespace(allocate=lambda size: torch.zeros(size, dtype=torch.uint8))  # pinned host memory
    kernel_block_sizes = [group.kv_cache_spec.block_size for group in kv_cfg.kv_cache_groups]

    caches = binding.allocate_hisparse_kv_caches(kv_cfg, torch.device("cpu"), shapes.layout_of(vc), kernel_block_sizes,
                                                 host_pool)
    assert set(attn) <= set(caches)
    inst = instance(gpu_broker.status())
    assert inst["holds"] == {} and inst["pools"] == {"kv_static": kv_config.buffer_bytes(kv_cfg)}
    assert kv_config.buffer_bytes(kv_cfg) == device_tensor.size <= held  # the device buffer, once; not the host pool


def test_reallocating_replaces_the_charge(patched_vllm, gpu_broker):
    vc, big = shapes.hybrid_config(32 * MIB)
    shapes.allocate(vc, big)
    vc, small = shapes.hybrid_config(8 * MIB)
    shapes.allocate(vc, small)
    assert instance(gpu_broker.status())["pools"] == {"kv_static": kv_config.buffer_bytes(small)}


def test_a_buffer_the_broker_cannot_grant_fails_before_it_is_allocated(patched_vllm, gpu_broker, monkeypatch):
    other = BrokerClient.connect("sglang-neighbour", endpoint=gpu_broker.endpoint, credit_pages=0)
    other.reserve({"weights": GIB - 8 * MIB})
    zeros_calls = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: zeros_calls.append(a) or real_zeros(*a, **k))
    vc, kv_cfg = shapes.hybrid_config(16 * MIB)

    with pytest.raises(KVCacheBudgetError) as caught:
        shapes.allocate(vc, kv_cfg)

    message = str(caught.value)
    assert gpu_broker.endpoint in message and "budget" in message and "sglang-neighbour" in message
    assert "\n" not in message
    assert zeros_calls == []  # refused before vLLM touched the device
    assert instance(gpu_broker.status(), "sglang-neighbour")["reserved_bytes"] == GIB - 8 * MIB
    assert instance(gpu_broker.status())["reserved_bytes"] == 0
    other.close()


def test_every_binding_site_calls_the_patched_function(patched_vllm, vllm_version):
    """Every module that binds vLLM's KV allocation in this release's layout (adapters/support.py's
    gates) binds the adapter's wrapper: HiSparse's too from 0.30 (it once stayed unpatched up to
    0.32, its buffer never turning the sizing hold into ``kv_static``)."""
    import importlib

    wrapped = "__kvcached_broker_wrapped__"
    vllm = support.VLLM
    if not vllm.at_least("shared_buffer", vllm_version):  # 0.19-0.28: the method and attn_utils' own helper
        from vllm.v1.worker import gpu_model_runner

        sites = {"vllm.v1.worker.gpu.attn_utils": "_allocate_kv_cache"}
        assert getattr(gpu_model_runner.GPUModelRunner._allocate_kv_cache_tensors, wrapped, False)
    else:
        sites = {"vllm.v1.worker.utils": "allocate_kv_cache", "vllm.v1.worker.gpu.attn_utils": "allocate_kv_cache"}
        if not vllm.at_least("v2_runner_only", vllm_version):
            sites["vllm.v1.worker.gpu_model_runner"] = "allocate_kv_cache"
        if vllm.at_least("hisparse", vllm_version):
            sites["vllm.v1.hisparse.binding"] = "allocate_kv_cache"
    for module_name, name in sites.items():
        module = importlib.import_module(module_name)
        assert getattr(getattr(module, name), wrapped, False), f"{module_name}.{name} is not patched"


def test_the_model_runner_v2_path_is_charged_the_same(patched_vllm, gpu_broker):
    """``gpu.attn_utils`` allocates for Model Runner V2 through its own binding."""
    from vllm.v1.worker.gpu import attn_utils

    vc, kv_cfg = shapes.hybrid_config(16 * MIB)
    if hasattr(attn_utils, "allocate_kv_cache"):
        caches = attn_utils.allocate_kv_cache(kv_cfg, torch.device("cpu"), shapes.layout_of(vc))
    else:
        caches = attn_utils._allocate_kv_cache(kv_cfg, torch.device("cpu"))
    assert instance(gpu_broker.status())["pools"] == {"kv_static": storage_bytes(caches)}
    assert storage_bytes(caches) == kv_config.buffer_bytes(kv_cfg)


def test_a_cross_layer_kv_connector_allocation_is_charged_too(patched_vllm, gpu_broker, vllm_version):
    """vLLM 0.19: a KV connector that prefers cross-layer blocks allocates every layer as one
    tensor through ``allocate_uniform_kv_caches``, not ``_allocate_kv_cache_tensors``."""
    if support.VLLM.at_least("shared_buffer", vllm_version):
        pytest.skip("this vLLM allocates cross-layer caches through allocate_kv_cache")
    from vllm.v1.worker import gpu_model_runner

    runner_cls = gpu_model_runner.GPUModelRunner
    from types import SimpleNamespace

    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    specs = {f"model.layers.{i}.attn": shapes.kvi().FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16) for i in range(4)}
    vc = shapes.vllm_config()
    groups = shapes.planner().get_kv_cache_groups(vc, specs)
    kv_cfg = shapes.planner().get_kv_cache_config_from_groups(vc, groups, 16 * MIB)
    group = SimpleNamespace(kv_cache_spec=kv_cfg.kv_cache_groups[0].kv_cache_spec, backend=TritonAttentionBackend)
    kv_caches, cross_layers, _ = runner_cls.allocate_uniform_kv_caches(  # as GPUModelRunner calls it
        kv_cfg, [[group]], "auto", torch.device("cpu"), [16])
    assert set(kv_caches) == set(specs)
    allocated = storage_bytes(cross_layers)
    assert allocated == kv_config.buffer_bytes(kv_cfg) > 0
    assert instance(gpu_broker.status())["pools"] == {"kv_static": allocated}
