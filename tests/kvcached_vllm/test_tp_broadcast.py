"""kvcached mode for vLLM with tensor parallelism: EngineCore's broadcast-mode pool is governed.

vLLM's EngineCore (a real ``Scheduler`` over kvcached's ``ElasticBlockPool`` and a real
``KVCacheManager(world_size=2)``) maps every page in two worker processes through kvcached's
real ``tp_ipc_util`` listeners; each worker is on its own simulated GPU with its own broker.
A sampler checks at every sample that each worker maps at most its grant and that EngineCore's
limit is at most every governed worker's grant (tp_harness.py).
"""

from __future__ import annotations

from helpers import wait_for
from tp_harness import BLOCKS_PER_PAGE, POOL_PAGE_BYTES, Sampler

from kvcached_broker.adapters.kvcached import board as board_mod


def start_tp(gpus, processes, world_size: int = 2):
    workers = [processes.worker(gpus[rank], rank, world_size) for rank in range(world_size)]
    assert all(w.ready["registered"] for w in workers)
    engine = processes.engine(world_size)
    return engine, workers


def pool_of(engine) -> dict:
    (pool,) = engine.request("status")["pools"]
    return pool


def test_each_worker_maps_within_its_own_grant_and_engine_core_within_every_grant(gpus, processes):
    gpu0, gpu1 = gpus(2)
    board = processes.board()
    with Sampler([gpu0, gpu1], board, slots=2) as sampler:
        engine, workers = start_tp([gpu0, gpu1], processes)
        assert engine.ready["post_init"] and engine.ready["limit_pages"] >= 1
        got = engine.request("fill", blocks=20 * BLOCKS_PER_PAGE)
        assert got["got"] == 20 * BLOCKS_PER_PAGE
        sampler.observe()
        status = engine.request("status")
        holders = [w.request("status")["holder"] for w in workers]
        # the pool promises no block beyond its limit, and its limit is within every worker's grant
        assert status["free_blocks"] + status["held_blocks"] + 1 <= status["limit_pages"] * BLOCKS_PER_PAGE
        assert status["limit_pages"] * POOL_PAGE_BYTES <= min(h["granted_bytes"] for h in holders)
        for holder in holders:
            assert holder["governed"] and holder["mapped_pages"] >= 21  # the null block's page and 20
            assert holder["granted_bytes"] >= holder["mapped_bytes"]
        engine.request("free", blocks=20 * BLOCKS_PER_PAGE)
        # idle memory goes back: the limit falls, and each worker releases what kvcached unmapped
        wait_for(lambda: all(w.request("status")["holder"]["granted_bytes"] <= 16 * POOL_PAGE_BYTES for w in workers),
                 what="the workers to release what EngineCore gave back")
        sampler.observe()
    sampler.check()
    assert sampler.peak_limit_pages >= 21
    assert max(sampler.peak_mapped.values()) >= 20 * POOL_PAGE_BYTES


def test_a_map_one_worker_refuses_rolls_the_other_back_and_is_a_miss(gpus, processes):
    gpu0, gpu1 = gpus(2)
    workers = [processes.worker(gpu, rank, 2) for rank, gpu in enumerate((gpu0, gpu1))]
    # no prealloc reserve: every new page is a broadcast map in the allocation itself
    engine = processes.engine(2, KVCACHED_MIN_RESERVED_PAGES="0")
    assert engine.request("fill", blocks=4 * BLOCKS_PER_PAGE)["got"] == 4 * BLOCKS_PER_PAGE
    engine.request("settle")
    before = [w.request("status") for w in workers]
    assert engine.request("status")["limit_pages"] > before[1]["holder"]["mapped_pages"]  # room for a new page
    # worker 1's gate bound falls to what it maps (its grant lost: a race the design excludes)
    workers[1].request("pin_bound", pages=before[1]["holder"]["mapped_pages"])

    missed = engine.request("alloc", blocks=BLOCKS_PER_PAGE)  # needs a page no worker has mapped yet

    assert missed["got"] is None  # a scheduling miss (kvcached's KVCachePoolExhausted), not a failure
    after = [w.request("status") for w in workers]
    assert after[1]["holder"]["refused_maps"] >= 1
    assert after[0]["vmm_mapped_bytes"] == before[0]["vmm_mapped_bytes"]  # worker 0's new page was rolled back
    assert after[0]["holder"]["mapped_pages"] == before[0]["holder"]["mapped_pages"]
    status = engine.request("status")
    assert status["post_init"] and engine.request("alloc", blocks=1)["got"] == 1  # the pool still serves
    assert "Traceback" not in processes.stderr("engine")


def test_a_broker_refusal_on_one_worker_is_a_miss_and_the_others_hold_no_more(gpus, processes):
    gpu0, gpu1 = gpus(2)
    with gpu1.broker.admin() as admin:
        admin.limit("vllm-tp", max_bytes=10 * POOL_PAGE_BYTES)  # worker 1's GPU gives this instance 160 MiB
    board = processes.board()
    with Sampler([gpu0, gpu1], board, slots=2) as sampler:
        engine, workers = start_tp([gpu0, gpu1], processes)
        filled = engine.request("fill", blocks=20 * BLOCKS_PER_PAGE, misses=20)
        assert 0 < filled["got"] < 20 * BLOCKS_PER_PAGE and filled["misses"] == 20
        sampler.observe()
        granted = wait_for(lambda: (lambda g: g if g[0] == g[1] else None)(
            [w.request("status")["holder"]["granted_bytes"] for w in workers]),
            what="worker 0 to give back what worker 1 could not get")
        assert granted[1] <= 10 * POOL_PAGE_BYTES - POOL_PAGE_BYTES  # its zero page is charged too
        assert engine.request("status")["limit_pages"] * POOL_PAGE_BYTES <= granted[1]
        assert workers[1].request("status")["holder"]["refusals"] >= 1
        sampler.observe()
    sampler.check()


def test_a_worker_without_a_broker_runs_unprotected_and_caps_nobody(gpus, processes, short_tmp):
    (gpu0,) = gpus(1)
    worker0 = processes.worker(gpu0, 0, 2)
    worker1 = processes.unreachable_worker(short_tmp / "gpu-unbrokered", 1, 2)
    board = processes.board()
    with Sampler([gpu0], board, slots=2) as sampler:
        engine = processes.engine(2)
        assert engine.request("fill", blocks=20 * BLOCKS_PER_PAGE)["got"] == 20 * BLOCKS_PER_PAGE
        sampler.observe()
        unprotected = worker1.request("status")
        assert unprotected["holder"]["governed"] is False and "unprotected" in unprotected["holder"]["why_ungoverned"]
        assert unprotected["vmm_mapped_bytes"] >= 20 * POOL_PAGE_BYTES  # its maps went through (kvcached alone)
        assert worker0.request("status")["holder"]["governed"]
        snapshot = board.snapshot(2)
        assert snapshot is not None and snapshot[1][1].state == board_mod.SLOT_UNPROTECTED
        assert snapshot[0].limit_pages <= snapshot[1][0].granted_pages  # worker 0 alone bounds the pool
    sampler.check()
    worker1.stop()
    assert processes.stderr("worker1").count("event=unprotected") == 1
