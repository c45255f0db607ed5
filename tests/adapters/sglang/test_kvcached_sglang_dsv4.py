"""kvcached mode in SGLang with DeepSeek-V4: its pools fall back to SGLang's own allocator and stay
reported per pool; kvcached's virtual buffers are never charged.

kvcached 0.1.6 does not manage V4 pools: with its SGLang patch on, the allocators SGLang builds
for a ``DeepSeekV4TokenToKVPool`` (the configurator's paged allocator, the SWA allocator's
sub-allocators) are kvcached's elastic classes, which refuse such a pool.  One SGLang rank on a
simulated 1 GiB GPU with a real broker builds a real V4 pool and a real kvcached MHA pool side by
side (a V4 server's MHA draft, or another model's pool: what matters is both kinds in one process).
"""

from __future__ import annotations

import pytest
from kvcached_sglang_harness import overlay  # noqa: F401  (autouse: kvcached and SGLang at the overlay's versions)
from kvcached_sglang_harness import gpu_broker, ranks  # noqa: F401  (fixtures)
from helpers import wait_for

from helpers import MIB

pytestmark = pytest.mark.runtime("kvcached", "sglang")

ADAPTER = "kvcached_broker.adapters.sglang.paged_allocator"
#: The names a later kvcached would report itself (``dsv4.<pool>``) when it owns or reports them.
SWA = "swa_kv_pool"


def _usage(broker, name: str = "model-v4") -> dict:
    (inst,) = [i for i in broker.status()["instances"] if i["name"] == name]
    return inst["usage_breakdown"]


def instance_pools(broker, name: str = "model-v4") -> dict:
    (inst,) = [i for i in broker.status()["instances"] if i["name"] == name]
    return inst["pools"]


def test_dsv4_pools_fall_back_and_stay_reserved_per_pool_and_no_virtual_buffer_is_charged(gpu_broker, ranks):
    broker = gpu_broker(0, total="2GiB")
    (rank,) = ranks([broker.endpoint], instance="model-v4", total_bytes=2 << 30)
    built = rank.request("build_dsv4")
    assert built["swa_sub_allocators"] == [f"{ADAPTER}.PagedTokenToKVPoolAllocator"] * 2  # SGLang's own
    assert built["paged"] == f"{ADAPTER}.PagedTokenToKVPoolAllocator" and built["paged_alloc"]
    tensors = built["tensor_pools"]
    pools = instance_pools(broker)
    assert {name: pools[name] for name in tensors} == tensors  # one reservation per V4 pool, exact

    mha = rank.request("build")
    assert mha["pool"] == "ElasticMHATokenToKVPool" and mha["pools"][0]["governed"]
    rank.request("charge")  # what the pool builder does once the pools exist
    wait_for(lambda: any(view.startswith("kvcached.mha.") for view in _usage(broker)),
             what="the pool's governor to show its limit (it reports under the pool's name from then on)")
    pools = instance_pools(broker)
    assert "kv_static" not in pools  # kvcached's whole-GPU virtual buffer is not a reservation
    reserved = sum(size for name, size in pools.items() if name not in ("runtime_base", "kvcached_zero_page"))
    assert reserved == sum(tensors.values()) < 64 * MIB
    assert pools["kvcached_zero_page"] == 16 * MIB  # the one page kvcached maps at every unmapped offset


def test_pools_kvcached_reports_itself_are_not_reserved_here_before_its_pool_takes_grants(gpu_broker, ranks):
    broker = gpu_broker(0, total="2GiB")
    (rank,) = ranks([broker.endpoint], instance="model-v4", total_bytes=2 << 30)
    tensors = rank.request("build_dsv4")["tensor_pools"]
    assert instance_pools(broker)[SWA] == tensors[SWA]

    # A later kvcached takes the SWA pool into its own management and reports it itself (0.1.6
    # reports nothing): the adapter's reservation for it goes away before kvcached's pool takes
    # its first grant, so the same memory is never counted twice.
    rank.request("kvcached_reports", names=[f"dsv4.{SWA}"])
    rank.request("trace_first_grant")
    rank.request("build")
    at_first_grant = rank.request("first_grant")["pools"]
    assert SWA not in at_first_grant
    assert {name: at_first_grant[name] for name in tensors if name != SWA} == {
        name: size for name, size in tensors.items() if name != SWA}
    assert SWA not in instance_pools(broker)
