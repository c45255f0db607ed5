"""kvcached mode for vLLM with tensor parallelism: EngineCore's broadcast-mode pool is governed.

vLLM's EngineCore (a real ``Scheduler`` over kvcached's ``ElasticBlockPool`` and a real
``KVCacheManager(world_size=2)``) maps every page in two worker processes through kvcached's
real ``tp_ipc_util`` listeners; each worker is on its own simulated GPU with its own broker.
A sampler checks at every sample that each worker maps at most its grant and that EngineCore's
limit is at most every governed worker's grant (tp_harness.py).
"""

from __future__ import annotations

import pytest
from kvcached_vllm_harness import overlay  # noqa: F401  (autouse: kvcached and vLLM at the overlay's versions)
from kvcached_vllm_harness import gpus, processes  # noqa: F401  (fixtures)
from helpers import wait_for
from tp_harness import BLOCKS_PER_PAGE, KV_BATCH_BYTES, POOL_PAGE_BYTES, Sampler

from kvcached_broker.adapters.kvcached.broadcast import board as board_mod
from kvcached_broker.adapters.kvcached.policy import Watermarks

pytestmark = pytest.mark.runtime("kvcached", "vllm")


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
        # idle memory goes back: the limit falls, and each worker releases what kvcached unmapped.
        # The pool rests with at most its high mark free above the null block's page (a round that
        # read the pool in the middle of the frees lowers it to that, and it holds there).
        rest_bytes = (1 + Watermarks.for_page_bytes(POOL_PAGE_BYTES, KV_BATCH_BYTES).high_pages) * POOL_PAGE_BYTES
        assert rest_bytes < 21 * POOL_PAGE_BYTES
        wait_for(lambda: all(w.request("status")["holder"]["granted_bytes"] <= rest_bytes for w in workers),
                 what="the workers to release what EngineCore gave back",
                 explain=lambda: {"engine": engine.request("status"), "workers": [w.request("status") for w in workers]})
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


def test_a_worker_that_creates_its_kv_tensors_again_keeps_its_slot_its_grant_and_the_board(gpus, processes):
    gpu0, gpu1 = gpus(2)
    board = processes.board()
    with Sampler([gpu0, gpu1], board, slots=2) as sampler:
        engine, workers = start_tp([gpu0, gpu1], processes)
        assert engine.request("fill", blocks=20 * BLOCKS_PER_PAGE)["got"] == 20 * BLOCKS_PER_PAGE
        sampler.observe()
        before = workers[1].request("status")

        again = workers[1].request("recreate")  # kvcached creates group 0's tensors a second time

        after = workers[1].request("status")
        assert again["holder_id"] == before["holder_id"]  # the same holder: its slot, grant and bound
        assert after["board"] == before["board"] and board.same_file()  # the board EngineCore maps, not a new one
        assert after["holder"]["governed"] and after["holder"]["granted_bytes"] == before["holder"]["granted_bytes"]
        assert after["gate"]["bound_pages"] == before["gate"]["bound_pages"] >= after["gate"]["mapped_pages"]
        # the pool keeps growing within every worker's grant
        assert engine.request("fill", blocks=10 * BLOCKS_PER_PAGE)["got"] == 10 * BLOCKS_PER_PAGE
        sampler.observe()
        grown = workers[1].request("status")
        assert grown["holder"]["granted_bytes"] >= grown["holder"]["mapped_bytes"] >= 31 * POOL_PAGE_BYTES
        assert engine.request("status")["limit_pages"] * POOL_PAGE_BYTES <= grown["holder"]["granted_bytes"]
    sampler.check()
    assert workers[1].request("status")["pools"][0]["key"] == before["holder"]["key"]  # one holder stepped
    assert len(workers[1].request("status")["pools"]) == 1


def test_a_worker_that_registers_after_engine_core_governs_maps_nothing_until_granted_and_lowers_its_limit(
        gpus, processes):
    gpu0, gpu1 = gpus(2)
    with gpu1.broker.admin() as admin:  # worker 1's GPU gives this instance its zero page and 4 pages
        admin.limit("vllm-tp", max_bytes=5 * POOL_PAGE_BYTES)
    worker0 = processes.worker(gpu0, 0, 2)
    worker1 = processes.worker(gpu1, 1, 2, KVB_TEST_DEFER_TENSORS="1", KVB_TEST_HOLD_ACTIVATE="1")
    assert not worker1.ready["registered"]
    board = processes.board()
    # EngineCore stops waiting for worker 1 and governs with worker 0 alone (its limit: worker 0's grant)
    engine = processes.engine(2, wait=False, KVB_TEST_REGISTER_WAIT_S="0.2")
    wait_for(lambda: (lambda s: s and s[0].state == board_mod.ENGINE_GOVERNING and s[0].limit_pages >= 5)(
        board.snapshot(2)), what="EngineCore to govern with worker 0")

    assert worker1.request("create")["registered"]  # registers late; its broker session is not open yet
    # EngineCore maps its null block and reserve on every worker once every worker has tensors: worker 1's
    # gate refuses them whole (bounded at 0 from registration), nothing is mapped there
    late = wait_for(lambda: (lambda s: s if s["gate"]["refused_maps"] >= 1 or s["vmm_mapped_bytes"] else None)(
        worker1.request("status")), what="EngineCore to map on worker 1")
    assert late["vmm_mapped_bytes"] == 0 and late["gate"]["bound_pages"] == 0 and late["gate"]["mapped_pages"] == 0

    worker1.request("activate")  # its broker grants it 4 pages, less than EngineCore's limit
    assert engine.wait_ready()["post_init"]
    # EngineCore lowers its limit to what worker 1 was granted, through its give-back (the board shows it)
    lowered = wait_for(lambda: (lambda s: s if s and s[1][1].state == board_mod.SLOT_GOVERNED
                                and s[0].limit_pages <= s[1][1].granted_pages else None)(board.snapshot(2)),
                       what="EngineCore's limit to come down to worker 1's grant")
    assert 0 < lowered[1][1].granted_pages <= 4 and lowered[1][0].granted_pages >= 5
    assert engine.request("status")["pools"][0]["pressure_asks"] >= 1  # the give-back path ran
    with Sampler([gpu0, gpu1], board, slots=2) as sampler:
        sampler.observe()
        filled = engine.request("fill", blocks=8 * BLOCKS_PER_PAGE, misses=5)
        assert 0 < filled["got"] < 8 * BLOCKS_PER_PAGE  # served within worker 1's grant, then misses
        sampler.observe()
    sampler.check()
    assert worker0.request("status")["holder"]["governed"]
    assert "Traceback" not in processes.stderr("engine")
