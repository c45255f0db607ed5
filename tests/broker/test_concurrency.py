"""Many worker processes at once: the budget is never overbooked, and tensor-parallel gangs agree."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import threading
import time

import pytest

from kvcached_broker.client import BrokerClient

from helpers import GIB, set_timeout

CHURN = r"""
import json, random, sys, threading
from kvcached_broker.client import BrokerClient, BudgetExceeded
endpoint, name, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
asked = granted = 0
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()  # churn until stdin closes
with BrokerClient.connect(name, endpoint=endpoint, page_bytes=64 << 20, credit_pages=rng.choice([0, 2, 8])) as c:
    try:
        c.reserve({"weights": rng.randrange(1, 4) << 30})
    except BudgetExceeded:
        pass  # the others filled the GPU first: a refusal, which is what the broker is for
    short = False
    while not done.is_set():
        if c.held_pages and rng.random() < 0.45:
            c.release(rng.randint(1, c.held_pages))
        else:
            n = rng.randint(1, 40)
            asked += n
            got = c.acquire(n, min_pages=rng.choice([None, 1]))
            granted += got
            if got < n and not short:
                short = True
                print("short", flush=True)  # the first acquire that got less than it asked for
print(json.dumps({"asked": asked, "granted": granted}))
"""

#: How much churn before the workers stop: an amount of work, not a time (about 4 s on a quiet machine).
CHURN_REQUESTS = 20_000


def test_eight_workers_churning_never_overbook(broker_factory):
    b = broker_factory(simulate="40GiB", extra_args=["--headroom", "2GiB"])
    procs = [
        subprocess.Popen([sys.executable, "-c", CHURN, b.endpoint, f"w{i}", str(i)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        for i in range(8)
    ]
    lines: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, out=out: out.extend(p.stdout), daemon=True)
               for p, out in zip(procs, lines)]
    for r in readers:
        r.start()
    samples = 0
    saw_pressure = False
    deadline = time.monotonic() + 300  # bounds a failure only

    def enough(s: dict) -> bool:
        counters = s["broker"]["counters"]
        return (samples > 20 and saw_pressure and counters["requests"] >= CHURN_REQUESTS
                and any("short\n" in out for out in lines))

    try:
        with b.admin() as admin:
            while True:
                assert all(p.poll() is None for p in procs), "a worker ended before it was told to"
                s = admin.status()
                samples += 1
                charged = s["reserved_bytes"] + s["granted_bytes"] + s["unreported_bytes"]
                assert charged <= s["budget_bytes"], s
                assert s["free_bytes"] == s["budget_bytes"] - charged
                per_instance = sum(i["reserved_bytes"] + i["granted_bytes"] for i in s["instances"])
                assert per_instance == s["reserved_bytes"] + s["granted_bytes"]
                saw_pressure |= s["free_bytes"] < 2 * GIB
                if enough(s):
                    break
                assert time.monotonic() < deadline, (samples, saw_pressure, s["broker"]["counters"], lines)
    finally:
        for p in procs:
            p.stdin.close()  # stop churning, close the session, report
    for p, r in zip(procs, readers):
        p.wait(timeout=60)
        r.join(timeout=60)
    results = [json.loads(out[-1]) for out in lines]
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
    client = BrokerClient.connect("tp", endpoint=b.endpoint, credit_pages=0, timeout_s=60, background=False)
    b.kill()
    set_timeout(client, 0.5)  # nothing can answer now: short
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
