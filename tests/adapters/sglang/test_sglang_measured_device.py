"""SGLang's KV sizing on a simulated GPU that measures this process as NVML would.

The test process plays the SGLang worker: the device is told what it has allocated (its
weights before it sizes, weights and KV once the pools exist; ``device_usage``), the profile
is the installed SGLang's ``_profile_available_bytes``, the pools are SGLang's own classes.
The broker charges a process ``max(measured, pools + pages) + holds`` (docs/accounting.md).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import types

import pytest
import torch

import sglang_cpu
from helpers import GIB, MIB

from kvcached_broker.adapters import sessions
from kvcached_broker.adapters.sglang import kv_sizing, reporting, startup, parallel
from kvcached_broker.client import BrokerClient, BudgetExceeded

pytestmark = pytest.mark.runtime("sglang")

WEIGHTS = 256 * MIB
PID = os.getpid()


@pytest.fixture
def weights_loaded(sg_broker, measured):
    """The device measures this process using its weights (nothing reported yet)."""
    measured.set(PID, WEIGHTS)
    return measured


@pytest.fixture
def neighbour(sg_broker):
    client = BrokerClient.connect("neighbour", endpoint=sg_broker.endpoint, credit_pages=0)
    yield client
    client.close()


def _me(broker) -> dict:
    """This process's SGLang session (the neighbour's session lives in this process too)."""
    session_id = sessions.session(parallel.identity("cpu")).client.session_id
    (found,) = [s for i in broker.status()["instances"] for s in i["sessions"] if s["id"] == session_id]
    return found


def _mha_pool(tokens: int, layers: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(tokens, 16, torch.bfloat16, 4, 64, layers, "cpu", False)


def _owner(role: str, algorithm: str = "EAGLE"):
    """What ``_init_pools`` runs on, as far as the adapter reads it: the real speculative algorithm."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return types.SimpleNamespace(spec_algorithm=SpeculativeAlgorithm[algorithm], is_draft_worker=role == "draft")


def _count_reserves(monkeypatch, broker) -> list[int]:
    """Free bytes after each reserve request this process's session sends (one entry per request)."""
    client = sessions.session(parallel.identity("cpu")).client
    original, after = client.reserve, []

    def reserve(*args, **kwargs):
        result = original(*args, **kwargs)
        after.append(broker.status()["free_bytes"])
        return result

    monkeypatch.setattr(client, "reserve", reserve)
    return after


def test_the_sizing_hold_is_charged_on_top_of_the_weights_the_device_measures(sg_broker, weights_loaded, neighbour):
    kv_bytes = sglang_cpu.profile(900 * MIB)  # SGLang sees the device as nearly empty
    assert kv_bytes == GIB - WEIGHTS  # capped at what the broker has: the weights are charged
    me = _me(sg_broker)
    assert me["holds"] == {"kv_sizing_hold": kv_bytes} and me["measured_bytes"] == WEIGHTS
    assert me["pools"] == {"runtime_base": WEIGHTS, "kv_sizing_hold": kv_bytes}  # pinned with the hold
    assert sg_broker.status()["free_bytes"] == 0  # not max(weights, hold): the hold is on top
    with pytest.raises(BudgetExceeded):
        neighbour.reserve({"weights": MIB})


def test_the_hold_turns_into_the_pools_in_one_request_with_no_dip_while_the_device_lags(
    sg_broker, weights_loaded, monkeypatch
):
    kv_bytes = sglang_cpu.profile(128 * MIB)
    assert sg_broker.status()["free_bytes"] == GIB - WEIGHTS - kv_bytes
    pool = _mha_pool(16 * 1024, 4)
    pool_bytes = sglang_cpu.unique_storage_bytes(pool)
    assert pool_bytes < kv_bytes
    free_after = _count_reserves(monkeypatch, sg_broker)
    kv_sizing.charge_pools("cpu", 0, pool)  # the device still measures only the weights
    assert free_after == [GIB - WEIGHTS - pool_bytes]  # one request, and never more room than that
    me = _me(sg_broker)
    assert me["holds"] == {} and me["pools"] == {"runtime_base": WEIGHTS, "kv_static": pool_bytes}
    weights_loaded.set(PID, WEIGHTS + pool_bytes)  # the device catches up with the allocation
    assert sg_broker.status()["free_bytes"] == GIB - WEIGHTS - pool_bytes  # and nothing changes


def test_draft_pools_are_built_inside_the_hold(sg_broker, weights_loaded, neighbour):
    kv_bytes = sglang_cpu.profile(GIB)  # EAGLE: SGLang sized the target's budget for the draft too
    assert kv_bytes == GIB - WEIGHTS and sg_broker.status()["free_bytes"] == 0
    target, draft = _mha_pool(32 * 1024, 4), _mha_pool(32 * 1024, 1)
    kv_sizing.charge_pools("cpu", 0, target, owner=_owner("target"))
    target_bytes = sglang_cpu.unique_storage_bytes(target)
    assert _me(sg_broker)["holds"] == {"kv_sizing_hold": kv_bytes - target_bytes}  # kept for the draft
    with pytest.raises(BudgetExceeded):  # so nobody else can take the draft's room meanwhile
        neighbour.reserve({"weights": MIB})
    kv_sizing.charge_pools("cpu", 0, draft, owner=_owner("draft"))
    both_bytes = target_bytes + sglang_cpu.unique_storage_bytes(draft)
    me = _me(sg_broker)
    assert me["holds"] == {} and me["pools"] == {"runtime_base": WEIGHTS, "kv_static": both_bytes}
    assert sg_broker.status()["free_bytes"] == kv_bytes - both_bytes


@pytest.mark.parametrize("algorithm", ["NONE", "NGRAM"])
def test_without_a_draft_pool_the_target_drops_the_hold_with_its_pools(sg_broker, weights_loaded, algorithm):
    sglang_cpu.profile(128 * MIB)
    pool = _mha_pool(16 * 1024, 4)
    kv_sizing.charge_pools("cpu", 0, pool, owner=_owner("target", algorithm))
    assert _me(sg_broker)["holds"] == {}


def test_the_model_worker_start_up_keeps_the_hold_until_every_draft_runner_is_built(sg_broker, weights_loaded):
    held_after: list[int] = []
    identity = parallel.identity("cpu")

    def init_model_worker(scheduler):  # what SGLang's does: target pools, then each draft runner's
        sglang_cpu.profile(GIB)
        for role, layers in (("target", 4), ("draft", 1), ("draft", 1)):
            kv_sizing.charge_pools("cpu", 0, _mha_pool(16 * 1024, layers), owner=_owner(role, "NONE"))
            held_after.append(reporting.held_bytes(identity))

    startup.wrap_init_model_worker(init_model_worker)(None)
    assert all(held > 0 for held in held_after)  # not even the last draft runner drops it inside
    assert _me(sg_broker)["holds"] == {} and reporting.held_bytes(identity) == 0


def test_the_scheduler_start_up_of_this_release_is_the_hold_scope(patched_sglang):
    spec = importlib.util.find_spec("sglang.srt.managers.scheduler")
    tree = ast.parse(open(spec.origin).read())
    scheduler = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    assert any(isinstance(n, ast.FunctionDef) and n.name == "init_model_worker" for n in scheduler.body)
    if not sglang_cpu.at_least("0.5.23"):
        return  # 0.5.12/0.5.13's scheduler module needs sgl_kernel/uvicorn to import, which CPU overlays lack
    module = importlib.import_module("sglang.srt.managers.scheduler")
    assert getattr(vars(module.Scheduler)["init_model_worker"], "__kvcached_broker_wrapped__", False)
    assert getattr(module, "__kvcached_broker_patched_sglang_kv_startup__", False)


@pytest.mark.skipif(not sglang_cpu.at_least("0.5.23"), reason="fused draft pools arrived with 0.5.23's unified memory")
def test_a_fused_draft_pool_viewing_the_target_buffer_is_not_charged_again(sg_broker, weights_loaded):
    from sglang.srt.mem_cache.layout.fused_draft import DenseDraftRegion, FusedDraftPlacement
    from sglang.srt.mem_cache.unified_draft_pool import UnifiedDraftKVPool
    from sglang.srt.mem_cache.unified_memory_pool import MHASubPoolSpec, UnifiedKVPool

    sglang_cpu.profile(GIB)
    region = DenseDraftRegion(lane_num=1, head_num=2, head_dim=64, store_dtype=torch.bfloat16)
    specs = [MHASubPoolSpec(name="full", layer_num=2, grow_direction="up", head_num=2, head_dim=64,
                            store_dtype=torch.bfloat16, draft_region=region),
             MHASubPoolSpec(name="swa", layer_num=2, grow_direction="down", head_num=2, head_dim=64,
                            store_dtype=torch.bfloat16)]
    unified = UnifiedKVPool(total_bytes=64 * MIB, sub_pool_specs=specs, device="cpu", enable_memory_saver=False,
                            page_size=16, fused_draft=FusedDraftPlacement.from_counts(counts={"full": [1]},
                                                                                      regions={"full": region}))
    kv_sizing.charge_pools("cpu", 0, unified, owner=_owner("target"))
    draft = UnifiedDraftKVPool(unified_buffer=unified, host_sub_pool_name="full", host_allocator=None,
                               layer_lanes={0: 0}, page_size=16)
    assert draft.k_buffer[0].untyped_storage().data_ptr() == unified._raw.untyped_storage().data_ptr()  # a view
    assert sglang_cpu.unique_storage_bytes(draft) >= 64 * MIB  # its own walk reaches the whole buffer
    kv_sizing.charge_pools("cpu", 0, draft, owner=_owner("draft"))
    me = _me(sg_broker)
    assert me["holds"] == {} and me["pools"] == {"runtime_base": WEIGHTS, "kv_static": 64 * MIB}  # once
