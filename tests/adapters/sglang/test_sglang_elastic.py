"""Elastic mode: the paged allocator hands out only pages the broker granted.

The allocator and its KV pool are the installed SGLang's ``PagedTokenToKVPoolAllocator`` and
``MHATokenToKVPool`` on CPU; the physical backing is ``RecordingBacking``, which records the
pages an on-demand backing (kvcached's VMM) would map.  Pool geometry: 128 tokens x 8 heads x
128 dims x 4 layers of bf16 K and V, so one allocator page is exactly one 2 MiB session page.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import sglang_cpu
from helpers import MIB, wait_for

from kvcached_broker.adapters import backing
from kvcached_broker.adapters.sglang import kv_sizing
from kvcached_broker.client import BrokerClient

WORKER = os.path.join(os.path.dirname(__file__), "sglang_worker.py")
PS, PAGES = 128, 64


def t(*values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.fixture
def recorder(sg_broker):
    found = backing.RecordingBacking()
    backing.register_on_demand_backing(found)
    return found


@pytest.fixture
def crowded(sg_broker):
    """Another instance holding all but 120 MiB of the 1 GiB device."""
    client = BrokerClient.connect("neighbour", endpoint=sg_broker.endpoint, credit_pages=0)
    client.reserve({"weights": 1024 * MIB - 120 * MIB})
    yield client
    client.close()


def _elastic_allocator():
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool(PAGES * PS, PS, torch.bfloat16, 8, 128, 4, "cpu", False)
    return kv, PagedTokenToKVPoolAllocator(PAGES * PS, PS, torch.bfloat16, "cpu", kv, False)


def _granted_pages(broker) -> int:
    inst = next((i for i in broker.status()["instances"] if i["name"] == "under-test"), {"sessions": []})
    return sum(s["granted_pages"] for s in inst["sessions"])


def _in_use(alloc) -> set[int]:
    return set(alloc._kvb.tracker.in_use.nonzero().flatten().tolist())


def test_pages_come_from_the_broker_and_a_refusal_returns_none(sg_broker, recorder, crowded):
    kv, alloc = _elastic_allocator()
    assert alloc._kvb.gate is not None and alloc._kvb.gate.page_bytes == 2 * MIB
    taken = []
    while (out := alloc.alloc(PS)) is not None:
        taken.append(out)
    assert len(taken) == 60  # 120 MiB of room / 2 MiB pages, though the pool has 64
    assert _granted_pages(sg_broker) == 60 and recorder.mapped == _in_use(alloc) and len(recorder.mapped) == 60
    kv_sizing.charge_pools("cpu", 0, kv)
    assert "kv_static" not in next(i for i in sg_broker.status()["instances"] if i["name"] == "under-test")["pools"]

    alloc.free(torch.cat(taken[:50]))
    assert len(recorder.mapped) == 10
    assert _granted_pages(sg_broker) == 10 + 16  # back down to use plus one batch
    alloc.free(torch.cat(taken[50:]))
    assert _granted_pages(sg_broker) == 26 and not recorder.mapped  # within slack: kept (hysteresis)
    del alloc
    gc.collect()
    wait_for(lambda: _granted_pages(sg_broker) == 0, what="a dropped allocator giving its grant back")


def test_extend_and_decode_are_admitted_by_the_broker(sg_broker, recorder, crowded):
    _, alloc = _elastic_allocator()
    out = alloc.alloc_extend(t(0, 0), t(0, 0), t(300, 10), t(300, 10), t(-1, -1), 310)
    assert out is not None and len(recorder.mapped) == 4 and recorder.mapped == _in_use(alloc)
    dec = alloc.alloc_decode(t(385), t(385), out[299:300] + 84)  # opens page 4 of the first request
    assert dec is not None and len(recorder.mapped) == 5
    crowded.reserve({"weights": 1024 * MIB - _granted_pages(sg_broker) * 2 * MIB})  # the device is now full
    big = alloc.alloc_extend(t(0), t(0), t(PS * 40), t(PS * 40), t(-1), PS * 40)
    assert big is None and len(recorder.mapped) == 5  # refused before any page was taken
    alloc.free(torch.cat([out, dec]))
    assert not recorder.mapped and alloc.available_size() == PAGES * PS


def test_without_an_on_demand_backing_the_pool_is_static(sg_broker):
    kv, alloc = _elastic_allocator()
    assert alloc._kvb.gate is None
    assert alloc.alloc(PAGES * PS) is not None and _granted_pages(sg_broker) == 0
    kv_sizing.charge_pools("cpu", 0, kv)
    inst = next(i for i in sg_broker.status()["instances"] if i["name"] == "under-test")
    assert inst["pools"] == {"kv_static": sglang_cpu.unique_storage_bytes(kv)}


# ------------------------------------------------------------------ tensor parallel, 2 processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp_ranks_report_to_their_own_brokers_and_agree_on_elastic_pages(broker_factory):
    big = broker_factory(device=0, simulate="1GiB", extra_args=["--headroom", "0"])
    small = broker_factory(device=1, simulate="64MiB", extra_args=["--headroom", "0"])
    port = _free_port()
    procs = []
    for rank, broker in enumerate((big, small)):
        env = {**os.environ, "ENABLE_KVCACHED": "1", "KVCACHED_BROKER": broker.endpoint,
               "KVCACHED_BROKER_INSTANCE": "dsv4-tp2"}
        procs.append(subprocess.Popen([sys.executable, WORKER, "tp", str(rank), "2", str(port), "16"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        reports = []
        for proc in procs:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-3000:]
            reports.append(json.loads(line))
        assert [(r["rank"], r["size"]) for r in reports] == [(0, 2), (1, 2)]
        pools = reports[1]["pools"]
        room_pages = (64 * MIB - sum(pools.values())) // (2 * MIB)
        assert reports[0]["elastic_pages"] == reports[1]["elastic_pages"] == room_pages  # the small GPU decides
        for rank, broker in enumerate((big, small)):
            (inst,) = broker.status()["instances"]
            (session,) = inst["sessions"]
            assert (session["rank"], session["tp_size"]) == (rank, 2)
            assert inst["pools"] == reports[rank]["pools"]  # each rank's own DeepSeek-V4 pools
            assert session["granted_pages"] == reports[rank]["granted_session_pages"]
        assert reports[0]["granted_session_pages"] == reports[1]["granted_session_pages"]
    finally:
        for proc in procs:
            proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=60)
