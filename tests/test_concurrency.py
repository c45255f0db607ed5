"""Many worker processes at once: the budget is never overbooked, and tensor-parallel gangs agree."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys

import pytest

from kvcached_broker.client import BrokerClient

from helpers import GIB

CHURN = r"""
import json, random, sys, time
from kvcached_broker.client import BrokerClient, BudgetExceeded
endpoint, name, seconds, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
asked = granted = 0
with BrokerClient.connect(name, endpoint=endpoint, page_bytes=64 << 20, credit_pages=rng.choice([0, 2, 8])) as c:
    try:
        c.reserve({"weights": rng.randrange(1, 4) << 30})
    except BudgetExceeded:
        pass  # the others filled the GPU first: a refusal, which is what the broker is for
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if c.held_pages and rng.random() < 0.45:
            c.release(rng.randint(1, c.held_pages))
        else:
            n = rng.randint(1, 40)
            asked += n
            granted += c.acquire(n, min_pages=rng.choice([None, 1]))
print(json.dumps({"asked": asked, "granted": granted}))
"""


def test_eight_workers_churning_never_overbook(broker_factory):
    b = broker_factory(simulate="40GiB", extra_args=["--headroom", "2GiB"])
    procs = [
        subprocess.Popen([sys.executable, "-c", CHURN, b.endpoint, f"w{i}", "4", str(i)], stdout=subprocess.PIPE, text=True)
        for i in range(8)
    ]
    samples = 0
    saw_pressure = False
    with b.admin() as admin:
        while any(p.poll() is None for p in procs):
            s = admin.status()
            samples += 1
            charged = s["reserved_bytes"] + s["granted_bytes"] + s["unreported_bytes"]
            assert charged <= s["budget_bytes"], s
            assert s["free_bytes"] == s["budget_bytes"] - charged
            per_instance = sum(i["reserved_bytes"] + i["granted_bytes"] for i in s["instances"])
            assert per_instance == s["reserved_bytes"] + s["granted_bytes"]
            saw_pressure |= s["free_bytes"] < 2 * GIB
    results = [json.loads(p.stdout.read()) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert samples > 20
    assert saw_pressure, "the workload never came close to the budget; the test proves nothing"
    assert sum(r["granted"] for r in results) < sum(r["asked"] for r in results)  # some were refused
    final = b.status()
    assert final["instances"] == [] and final["reserved_bytes"] == 0 and final["granted_bytes"] == 0


# ----------------------------------------------------------------------------- tensor parallel
def _tp_rank(rank, endpoints, barrier, shared, asks, out):
    """One TP rank: its own GPU's broker, and a reduce_min built from shared memory + a barrier."""

    def reduce_min(value: int) -> int:
        shared[rank] = value
        barrier.wait()
        agreed = min(shared[:])
        barrier.wait()
        return agreed

    with BrokerClient.connect("tp-model", endpoint=endpoints[rank], tp_rank=rank, tp_size=len(endpoints),
                              page_bytes=GIB, credit_pages=0) as c:
        results = []
        for pages, min_pages in asks:
            results.append((c.acquire_tp(pages, reduce_min, min_pages=min_pages), c.held_pages))
        out.put((rank, results))


def test_tp_gang_agrees_on_the_minimum_across_brokers(broker_factory):
    sizes = ["8GiB", "5GiB", "12GiB", "8GiB"]
    brokers = [broker_factory(device=i, simulate=size, extra_args=["--headroom", "0"]) for i, size in enumerate(sizes)]
    endpoints = [b.endpoint for b in brokers]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(endpoints))
    shared = ctx.Array("q", len(endpoints))
    out = ctx.Queue()
    asks = [(3, None), (4, None), (4, 1), (1, None)]
    procs = [ctx.Process(target=_tp_rank, args=(r, endpoints, barrier, shared, asks, out)) for r in range(len(endpoints))]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    # GPU 1 has 5 GiB: 3 fit; then 4 more all-or-nothing do not (2 left); partial gets 2; then 1 fails.
    expected = [(3, 3), (0, 3), (2, 5), (0, 5)]
    for rank in range(len(endpoints)):
        assert results[rank] == expected, (rank, results[rank])
    for b in brokers:
        assert b.status()["granted_bytes"] == 0  # all closed; no rank kept a surplus


def test_tp_reduce_is_called_once_even_when_this_ranks_broker_is_gone(broker_factory):
    from kvcached_broker.client import BrokerClient
    from kvcached_broker.client.errors import BrokerUnavailable

    b = broker_factory()
    client = BrokerClient.connect("tp", endpoint=b.endpoint, credit_pages=0, timeout_s=0.5, background=False)
    b.kill()
    calls = []
    with pytest.raises(BrokerUnavailable):
        client.acquire_tp(4, lambda v: calls.append(v) or 0)
    assert calls == [0]  # this rank still took part in the collective, with nothing
    client.close(timeout_s=0.2)


def test_tp_reduce_is_called_once_even_when_this_ranks_session_was_evicted(broker_factory):
    """An evicted rank still takes part in the collective (with nothing), then raises."""
    from kvcached_broker.client import BrokerClient
    from kvcached_broker.client.errors import SessionEvicted

    b = broker_factory()
    client = BrokerClient.connect("tp", endpoint=b.endpoint, credit_pages=0, background=False)
    with b.admin() as admin:
        admin.evict(client.session_id)
    with pytest.raises(SessionEvicted):
        client.acquire(1)  # the broker says so; from now on the client knows
    calls = []
    with pytest.raises(SessionEvicted):
        client.acquire_tp(4, lambda v: calls.append(v) or 0)
    assert calls == [0]
    client.close(timeout_s=0.2)
