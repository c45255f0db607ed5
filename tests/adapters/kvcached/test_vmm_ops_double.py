"""The vmm_ops double behaves as kvcached 0.1.6's native allocator, so kvcached alone shows the
hazards the governor closes: the start-up race and kvctl's sticky override.

These run kvcached's real ``KVCacheManager`` in this process, without the broker's patch.
"""

from __future__ import annotations

import uuid

import pytest
from helpers import wait_for
from kv_harness import GIB, POOL_PAGE_BYTES, kvctl

pytestmark = pytest.mark.runtime("kvcached")

NUM_LAYERS, BLOCK_TOKENS, CELL_BYTES = 4, 16, 8 * 128 * 2
BLOCKS_PER_PAGE = 64


@pytest.fixture
def kvcached_alone(short_tmp, monkeypatch):
    """kvcached's SGLang integration on a 2 GiB shared simulated GPU, in this process."""
    from kvcached_broker.tools.kvcached_sim import kvcached_cpu

    ipc = f"kvb-double-{uuid.uuid4().hex[:10]}"
    gpu = kvcached_cpu.install(short_tmp / "gpu-usage", 2 * GIB, ipc, setattr_=monkeypatch.setattr)
    from kvcached.integration.sglang import interfaces
    import kvcached.kv_cache_manager as kvm

    from kvcached_broker.adapters.patching import WRAPPED

    assert not getattr(kvm.PageAllocator, WRAPPED, False), "these tests need kvcached unpatched"
    managers = []

    def make(num_blocks: int = 1 << 17):
        import torch

        interfaces.init_kvcached(device="cuda:0")
        manager = interfaces.get_kv_cache_manager(num_blocks, BLOCK_TOKENS, CELL_BYTES, NUM_LAYERS, pool_name="mha")
        interfaces.alloc_kv_cache((num_blocks * BLOCK_TOKENS, 8, 128), torch.float16, "cuda:0", NUM_LAYERS,
                                  page_size=BLOCK_TOKENS)
        assert manager._post_init_done.wait(10)
        managers.append(manager)
        return manager

    yield gpu, ipc, make
    for manager in managers:
        manager.shutdown()
    interfaces.shutdown_kvcached()


def test_kvcached_alone_maps_the_null_block_and_a_reserve_before_any_limit_can_be_set(kvcached_alone):
    gpu, _, make = kvcached_alone
    manager = make()
    state = wait_for(lambda: (lambda s: s if s["reserved_pages"] == 5 else None)(manager.page_allocator.get_page_state()),
                     what="the prealloc thread to map its reserve")
    assert state["inuse_pages"] == 1  # the null block
    assert gpu.mine_bytes() == (1 + 1 + 5) * POOL_PAGE_BYTES  # the zero page, the null block's page, the reserve


def test_a_memory_limit_bounds_every_mapping_path_and_a_deferred_one_waits_for_frees(kvcached_alone):
    gpu, _, make = kvcached_alone
    manager = make()
    blocks = manager.alloc(3 * BLOCKS_PER_PAGE)  # 4 pages in use (page 0 holds the null block)
    assert manager.set_memory_limit(2 * POOL_PAGE_BYTES, revision=1)["status"] == "deferred"
    assert manager.alloc(BLOCKS_PER_PAGE) is None  # no fresh page while the limit is pending
    manager.free(blocks)
    # kvcached finishes a deferred limit on a free; its resize unmaps the reserve outside the
    # allocator lock, so a prealloc refill racing it can leave the limit pending (the governor
    # re-applies it each round, as here)
    revisions = iter(range(2, 1 << 30))
    wait_for(lambda: manager.memory_limit_state()["status"] == "applied"
             or manager.set_memory_limit(2 * POOL_PAGE_BYTES, revision=next(revisions))["status"] == "applied",
             what="the deferred limit to apply")
    assert manager.page_allocator.get_num_total_pages() == 2
    assert manager.alloc(2 * BLOCKS_PER_PAGE) is None  # 63 blocks left on page 0 + one page: not two
    assert manager.alloc(BLOCKS_PER_PAGE) is not None
    assert gpu.mine_bytes() - POOL_PAGE_BYTES <= 2 * POOL_PAGE_BYTES  # prealloc thread included


def test_kvcached_alone_lets_a_kvctl_write_override_its_memory_limit(kvcached_alone):
    """The sticky override: after ``set_memory_limit(2 pages)`` a kvctl write of 8 pages makes the
    next allocation resize to 8 while ``memory_limit_state()`` still says 2."""
    gpu, _, make = kvcached_alone
    manager = make()
    ipc = manager.ipc_name  # kvcached fixes its segment name at first import
    manager.set_memory_limit(2 * POOL_PAGE_BYTES, revision=1)
    assert manager.alloc(2 * BLOCKS_PER_PAGE) is None  # beyond the limit: a miss
    assert kvctl("limit", ipc, str(8 * POOL_PAGE_BYTES)).returncode == 0
    wait_for(lambda: manager.page_allocator.get_resize_target() > 0 or None, what="the kvctl watcher")
    assert manager.alloc(5 * BLOCKS_PER_PAGE) is not None  # 6 pages mapped now
    assert manager.memory_limit_state()["limit_bytes"] == 2 * POOL_PAGE_BYTES
    assert gpu.mine_bytes() - POOL_PAGE_BYTES >= 6 * POOL_PAGE_BYTES  # far beyond its limit


def test_a_neighbour_taking_the_memory_after_the_capacity_check_is_a_miss(kvcached_alone, monkeypatch):
    """Another process takes the last pages between kvcached's capacity check (cudaMemGetInfo,
    cached) and its map: cuMemCreate runs out of memory, kvcached rolls back and misses."""
    import kvcached.kv_cache_manager as kvm

    monkeypatch.setattr(kvm, "_AVAIL_PHYSICAL_PAGES_TTL_S", 3600.0)  # the check's figure stays stale
    gpu, _, make = kvcached_alone
    manager = make()
    manager.page_allocator.stop_prealloc_thread()  # no reserve: every page this test takes is mapped now
    manager.trim()
    headroom = int(gpu.total_bytes * (1.0 - 0.95))  # KVCACHED_GPU_UTILIZATION's, as the allocator computes it
    gpu.allocate(gpu.free_bytes() - headroom - 3 * POOL_PAGE_BYTES)
    manager._avail_physical_pages_cache = None
    assert manager.available_size() >= 2 * BLOCKS_PER_PAGE  # two pages' room, as cudaMemGetInfo says
    gpu.allocate(gpu.free_bytes())  # the neighbour takes everything left
    before = gpu.mine_bytes()
    assert manager.alloc(2 * BLOCKS_PER_PAGE) is None  # a miss, not an exception
    assert gpu.mine_bytes() == before  # nothing left mapped by the failed allocation
    assert manager.alloc(BLOCKS_PER_PAGE // 2) is not None  # the null block's page still serves
