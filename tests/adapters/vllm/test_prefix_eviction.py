"""Under broker pressure, vLLM's prefix cache gives back, evicted on EngineCore's engine thread.

TP = 2: pressure on one worker's broker (a neighbour bursts on its GPU) reaches EngineCore
through the board; EngineCore's governor asks the eviction hook, which runs on the engine thread
through vLLM's idle-state callback and ``WAKEUP`` (the engine is idle); kvcached unmaps the
freed pages in every worker, and the workers release them.  TP = 1: the pool maps in
EngineCore's process, governed through its own session; a queued eviction runs in the
scheduler's next ``schedule()``.
"""

from __future__ import annotations

import pytest
from kvcached_vllm_harness import overlay  # noqa: F401  (autouse: kvcached and vLLM at the overlay's versions)
from kvcached_vllm_harness import gpus, processes  # noqa: F401  (fixtures)
import kv_model
from helpers import python_env, wait_for
from tp_harness import BLOCKS_PER_PAGE, GIB, POOL_PAGE_BYTES, Sampler

from kvcached_broker.tools.kvcached_sim.pools import PoolProcess

pytestmark = pytest.mark.runtime("kvcached", "vllm")

MIB = 1 << 20
#: the neighbour's kvcached pool (tools/kvcached_sim/pool_process.py, 4 layers): 2 MiB x 4 layers x K and V
BURST_PAGE_BYTES = (2 << 20) * 4 * 2


def test_pressure_on_one_workers_broker_evicts_the_prefix_cache_and_both_workers_release(gpus, processes):
    gpu0, gpu1 = gpus(2)
    board = processes.board()
    with Sampler([gpu0, gpu1], board, slots=2) as sampler:
        workers = [processes.worker(gpu, rank, 2) for rank, gpu in enumerate((gpu0, gpu1))]
        engine = processes.engine(2)
        # 640 MiB of prefixes per GPU, running at once, then cached after their requests finished
        assert engine.request("prefill", requests=20, tokens=2048)["scheduled"] == 20
        cached = engine.request("status")
        assert cached["cached_blocks"] >= 20 * 2048 // kv_model.BLOCK_TOKENS - 1
        sampler.observe()
        held_before = [w.request("status")["holder"]["granted_bytes"] for w in workers]
        assert min(held_before) >= 640 * MIB

        # a neighbour on GPU 0 bursts: the broker asks worker 0's session for pages back
        burst = PoolProcess.start(gpu0.endpoint, gpu0.usage, GIB, "burst", env=python_env(), args=("--layers", "4"),
                                  stderr=gpu0.usage.parent / "burst.err", wait=False)
        sampler.zero_page(burst.pid, BURST_PAGE_BYTES)
        burst.wait_ready()
        processes.on_stop(burst.stop)  # after the sampler: a pool that shuts down gives its grant back first
        # 24 of its pages (384 MiB): more than GPU 0 has free (1 GiB less 640 MiB and a zero page of
        # EngineCore's worker), within the neighbour's fair share
        burst_blocks = 24 * burst.request("status")["blocks_per_page"]
        got = burst.request("fill", blocks=burst_blocks, timeout_s=120.0)
        assert got["held_blocks"] == burst_blocks
        sampler.observe()

        status = engine.request("status")
        (pool,) = status["pools"]
        assert pool["pressure_asks"] >= 1 and pool["pages_released"] > 0
        assert status["evicted_blocks"] > 0 and status["cached_blocks"] < cached["cached_blocks"]
        assert status["eviction"]["ran_in"] == "idle" and status["eviction"]["thread"] == "engine-core"
        worker0 = workers[0].request("status")["holder"]
        assert worker0["pressure_asks"] >= 1 and worker0["pressure_posted"] > 0
        for worker, before in zip(workers, held_before):  # both released what kvcached unmapped
            assert worker.request("status")["holder"]["granted_bytes"] < before
    sampler.check()


def test_with_tp1_the_in_process_pool_evicts_in_the_schedulers_next_step(gpus, processes):
    (gpu0,) = gpus(1)
    with Sampler([gpu0], processes.board(), slots=0) as sampler:
        engine = processes.engine(1, gpu0)
        (pool,) = engine.ready["pools"]
        assert pool["governed"] and engine.ready["board"] is None  # in-process: its own session's grants
        assert engine.request("prefill", requests=16, tokens=2048)["scheduled"] == 16  # 512 MiB
        cached = engine.request("status")["cached_blocks"]
        assert cached >= 16 * 2048 // kv_model.BLOCK_TOKENS - 1

        after = engine.request("evict_then_prefill", pages=8, requests=1, tokens=256)

        status = engine.request("status")
        assert status["evicted_blocks"] >= 8 * BLOCKS_PER_PAGE
        assert status["eviction"] == {"thread": "engine-core", "ran_in": "schedule", "runs": 1}
        assert after["cached_blocks"] <= cached - 8 * BLOCKS_PER_PAGE + 16  # the new prefill caches its own
        wait_for(lambda: engine.request("status")["limit_pages"] * POOL_PAGE_BYTES < 640 * MIB,
                 what="the governor to give the pages back")
    sampler.check(min_samples=0)
