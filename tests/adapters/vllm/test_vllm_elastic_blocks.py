"""An elastic vLLM BlockPool: broker-gated, refusals are scheduling misses, blocks go back.

EngineCore side: vLLM's own ``KVCacheManager`` (its ``BlockPool``) with real ``Request``s.
Worker side: vLLM's own KV allocation through the adapter's patch, with a recording
on-demand backing, each worker's pages from its own (simulated) GPU's broker.
"""

from __future__ import annotations

import random

import pytest

from kvcached_broker.adapters import backing, worker
from kvcached_broker.adapters.vllm import engine, kv_config, parallel, worker_pages
from kvcached_broker.adapters.vllm.block_pool import gate_of
from kvcached_broker.client import BrokerClient, BudgetExceeded

import vllm_shapes as shapes
from helpers import GIB, MIB

PAGE = 2 * MIB


def config(kind: str):
    if kind == "dsv4":
        if not shapes.has_v4_specs():
            pytest.skip("this vLLM has no DeepSeek-V4 spec fields")
        return shapes.dsv4_config(64 * MIB)
    return shapes.hybrid_config(64 * MIB)


def local_workers(*ranks: worker_pages.WorkerKVPages | None) -> engine.Workers:
    """EngineCore's view of its workers, called in-process (what ``collective_rpc`` does remotely)."""
    if not ranks:
        return engine.Workers(lambda method, args: [engine.on_worker(None, method, *args)])
    return engine.Workers(lambda method, args: [getattr(rank, method)(*args) for rank in ranks])


@pytest.fixture
def recording(gpu_broker):
    b = backing.RecordingBacking()
    backing.register_on_demand_backing(b)
    return b


@pytest.fixture
def neighbour(gpu_broker):
    client = BrokerClient.connect("sglang-neighbour", endpoint=gpu_broker.endpoint, credit_pages=0)
    yield client
    client.close()


def elastic_manager(kind: str, batch_pages: int = 2):
    """A worker that allocated its KV buffer elastically, and EngineCore's gated manager over it."""
    vc, kv_cfg = config(kind)
    shapes.allocate(vc, kv_cfg)
    manager = shapes.kv_cache_manager(vc, kv_cfg)
    gate = engine.attach_workers(manager.block_pool, local_workers(), batch_pages=batch_pages, refusal_backoff_s=0)
    assert gate is not None and gate_of(manager.block_pool) is gate
    return manager, gate, kv_cfg


def my_session(broker) -> dict:
    session_id = worker.session(parallel.identity(0)).session_id
    return next(s for i in broker.status()["instances"] for s in i["sessions"] if s["id"] == session_id)


def assert_never_overbooked(broker, gate, pages: worker_pages.WorkerKVPages, rec: backing.RecordingBacking) -> None:
    status = broker.status()
    assert status["reserved_bytes"] + status["granted_bytes"] <= status["budget_bytes"]
    assert not status["overcommitted"]
    assert gate.limit <= pages.usable_blocks  # every block the scheduler may hand out is backed
    assert pages.usable_blocks * pages.bytes_per_block <= pages.granted_pages * pages.page_bytes
    assert rec.mapped == set(range(pages.granted_pages))
    in_use = [b.block_id for b in gate.pool.blocks if b.ref_cnt > 0 and not b.is_null]
    assert all(block_id < gate.limit for block_id in in_use)


#: prompt tokens of a request that needs more than 6 pages, and of one that needs fewer
SIZES = {"dsv4": (1000, 100), "hybrid": (8000, 100)}


@pytest.mark.parametrize("kind", ["dsv4", "hybrid"])
def test_a_refusal_is_a_scheduling_miss_and_blocks_go_back(patched_vllm, gpu_broker, recording, neighbour, kind):
    big_tokens, small_tokens = SIZES[kind]
    neighbour.reserve({"weights": GIB - 12 * MIB})  # 6 pages left on this GPU
    manager, gate, kv_cfg = elastic_manager(kind)
    pages = worker_pages.current()
    start_pages = pages.granted_pages
    assert my_session(gpu_broker)["pools"] == {} and start_pages >= 1  # elastic: pages, not kv_static

    big = shapes.request("big", big_tokens)
    assert manager.allocate_slots(big, big_tokens) is None  # needs more than 6 pages: refused, not raised
    assert gate.refusals >= 1
    assert_never_overbooked(gpu_broker, gate, pages, recording)
    assert my_session(gpu_broker)["granted_pages"] == pages.granted_pages <= 6

    small = shapes.request("small", small_tokens)
    assert manager.allocate_slots(small, small_tokens) is not None
    assert_never_overbooked(gpu_broker, gate, pages, recording)
    grown = pages.granted_pages

    manager.free(small)  # everything free again: the gate holds the top blocks back
    assert pages.granted_pages < grown
    assert my_session(gpu_broker)["granted_pages"] == pages.granted_pages
    assert gate.free_blocks() <= 2 * gate.batch_blocks
    assert_never_overbooked(gpu_broker, gate, pages, recording)

    neighbour.reserve({})  # room again: the same request now fits
    assert manager.allocate_slots(big, big_tokens) is not None
    assert pages.granted_pages > 6
    assert_never_overbooked(gpu_broker, gate, pages, recording)
    manager.free(big)
    assert pages.granted_pages == pages.pages_for(gate.limit)  # handed back down to the hysteresis band
    assert gate.free_blocks() <= 2 * gate.batch_blocks


def test_tp_ranks_agree_on_the_blocks_the_poorest_gpu_backs(patched_vllm, inproc_factory, adapter_state):
    vc, kv_cfg = config("hybrid")
    gpus = [inproc_factory(total_bytes=GIB, device=d) for d in (0, 1)]
    clients = [BrokerClient.connect("vllm-tp", endpoint=g.endpoint, tp_rank=r, tp_size=2, credit_pages=0)
               for r, g in enumerate(gpus)]
    squatter = BrokerClient.connect("squatter", endpoint=gpus[1].endpoint, credit_pages=0)
    squatter.reserve({"weights": GIB - 6 * MIB})  # GPU 1 can back 3 pages
    recs = [backing.RecordingBacking() for _ in gpus]
    ranks = [worker_pages.WorkerKVPages(c, rec, num_blocks=kv_cfg.num_blocks,
                                        bytes_per_block=kv_config.bytes_per_block(kv_cfg), page_bytes=PAGE)
             for c, rec in zip(clients, recs)]
    manager = shapes.kv_cache_manager(vc, kv_cfg)
    gate = engine.attach_workers(manager.block_pool, local_workers(*ranks), batch_pages=1, refusal_backoff_s=0)

    assert manager.allocate_slots(shapes.request("r", 8000), 8000) is None  # 4 MiB of full attention: too much
    granted = [g.status()["granted_bytes"] for g in gpus]
    assert granted[0] == granted[1] == 3 * PAGE  # rank 0 got more from its broker and gave the surplus back
    assert gate.limit <= min(r.usable_blocks for r in ranks)
    assert [rec.mapped for rec in recs] == [set(range(3))] * 2

    squatter.close()
    assert manager.allocate_slots(shapes.request("r2", 8000), 8000) is not None
    assert ranks[0].granted_pages == ranks[1].granted_pages > 3
    for c in clients:
        c.close()


def test_churn_with_a_credit_reserve_never_overbooks(patched_vllm, gpu_broker, recording, neighbour):
    worker.client_factory = lambda ident: BrokerClient.connect(  # with the client's own credit reserve
        ident.instance_name(), endpoint=gpu_broker.endpoint, page_bytes=ident.page_bytes)
    manager, gate, _ = elastic_manager("hybrid", batch_pages=1)
    pages = worker_pages.current()
    rng = random.Random(5)
    live: list = []
    for step in range(60):
        if step % 15 == 0:
            try:
                neighbour.reserve({"weights": rng.choice([GIB - 24 * MIB, GIB - 96 * MIB, 0])})
            except BudgetExceeded:
                pass  # the vLLM worker holds those pages now
        if live and rng.random() < 0.4:
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            req = shapes.request(f"r{step}", rng.randrange(16, 3000))
            if manager.allocate_slots(req, req.num_tokens) is not None:
                live.append(req)
        assert_never_overbooked(gpu_broker, gate, pages, recording)
    for req in live:
        manager.free(req)
    assert gate.free_blocks() <= 2 * gate.batch_blocks


def test_reset_prefix_cache_and_usage_see_only_the_granted_blocks(patched_vllm, gpu_broker, recording):
    manager, gate, _ = elastic_manager("hybrid")
    pool = manager.block_pool
    held = gate.held_back_blocks
    assert held > 0 and pool.get_usage() == 0.0
    req = shapes.request("r", 64)
    blocks = manager.allocate_slots(req, 64)
    used = sum(len(ids) for ids in blocks.get_block_ids())
    assert pool.get_usage() == pytest.approx(used / gate.usable_blocks)
    manager.free(req)
    assert pool.reset_prefix_cache() is True  # held-back blocks do not count as in use
    assert gate.held_back_blocks == held
    assert pool.get_num_free_blocks() == gate.usable_blocks


def test_a_static_worker_leaves_the_pool_ungated(patched_vllm, gpu_broker):
    vc, kv_cfg = config("hybrid")
    shapes.allocate(vc, kv_cfg)  # no on-demand backing: kv_static, no pages
    manager = shapes.kv_cache_manager(vc, kv_cfg)
    assert engine.attach_workers(manager.block_pool, local_workers()) is None
    assert my_session(gpu_broker)["pools"] == {"kv_static": kv_config.buffer_bytes(kv_cfg)}
    with pytest.raises(ValueError):  # vLLM's own behaviour, untouched
        manager.block_pool.get_new_blocks(manager.block_pool.num_gpu_blocks + 1)


def test_without_a_broker_elastic_pages_grant_themselves_and_engine_core_still_coordinates(
    patched_vllm, adapter_state, monkeypatch
):
    """An unprotected worker keeps its elastic pages (granting itself), so that EngineCore gates
    the pool alike for every rank: a rank backed whole beside gated ranks would be asked for
    blocks its peers never mapped."""
    monkeypatch.setenv("KVCACHED_BROKER", "off")
    rec = backing.RecordingBacking()
    backing.register_on_demand_backing(rec)
    vc, kv_cfg = config("hybrid")
    shapes.allocate(vc, kv_cfg)
    pages = worker_pages.current()
    assert pages is not None and not pages.budget.protected
    manager = shapes.kv_cache_manager(vc, kv_cfg)
    gate = engine.attach_workers(manager.block_pool, local_workers())
    assert gate is not None
    assert manager.allocate_slots(shapes.request("r", 3000), 3000) is not None  # grown without a broker
    assert rec.mapped == set(range(pages.granted_pages)) and pages.usable_blocks >= gate.limit
