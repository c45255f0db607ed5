"""kvcached mode in SGLang: a refused grant or a give-back is a scheduling miss, never a crash.

SGLang admits a request by ``available_size() + evictable_size()`` and then allocates through
``mem_cache/allocation.py``, which raises ``RuntimeError("Prefill out of memory ...")`` on a
None.  With the limits applied on the governors' thread (``--direct``, the old ``DirectLimits``),
broker pressure between the admission and the allocation lowers the limit under the admitted
request and the allocation raises; with sync points it cannot, and the limit falls at the next
iteration.  One SGLang rank (TP=1) on a simulated 1 GiB GPU with a real broker.
"""

from __future__ import annotations

import pytest
from kvcached_sglang_harness import overlay  # noqa: F401  (autouse: kvcached and SGLang at the overlay's versions)
from kvcached_sglang_harness import gpu_broker, ranks  # noqa: F401  (fixtures)
from helpers import wait_for

from kvcached_broker.client import BrokerClient

pytestmark = pytest.mark.runtime("kvcached", "sglang")

TOKENS_PER_PAGE = 1024
#: What the neighbour holds, in its 2 MiB pages (80 MiB): more than model-a's pool leaves of the budget.
NEIGHBOUR_ROOM_PAGES = 40


def fill(rank, pages: int) -> dict:
    for _ in range(200):
        done = rank.request("allocate", requests=4, tokens=TOKENS_PER_PAGE)
        if done["inuse_pages"] - 1 >= pages:
            return done
        rank.request("step", n=20)
    raise AssertionError(f"could not fill {pages} pages")


@pytest.mark.parametrize("direct", [False, True], ids=["sync-points", "limits-on-the-governors-thread"])
def test_pressure_between_admission_and_allocation(gpu_broker, ranks, direct):
    broker = gpu_broker(0)
    (rank,) = ranks([broker.endpoint], direct=direct, instance="model-a")
    rank.request("build")
    fill(rank, 40)  # 640 MiB: above the fair share once a second instance asks
    rank.request("step", n=50)  # the growth ahead of need applies
    room = rank.request("status")["available_tokens"]
    assert room >= TOKENS_PER_PAGE
    assert rank.request("admit", tokens=room)["admitted"]

    neighbour = BrokerClient.connect("neighbour", endpoint=broker.endpoint, credit_pages=0)
    try:
        assert neighbour.acquire(200, min_pages=200) == 0  # refused: broker pressure on model-a
        assert rank.request("wait_want")["wanted"]  # the governor gave back (or wants to)
        result = rank.request("alloc_admitted")
        if direct:
            assert not result["allocated"] and "out of memory" in result["runtime_error"]
            return  # the latent crash: SGLang's scheduler would have stopped here
        assert result["allocated"] and "runtime_error" not in result
        limit = rank.request("status")["limit_pages"]
        lowered = rank.request("step", limit_at_most=limit - 1)["record"]  # the give-back applies now
        assert lowered["agreed_pages"][0] < limit
        taken = wait_for(lambda: neighbour.acquire(200, min_pages=1), what="the neighbour got model-a's pages")

        # The neighbour keeps its room, and takes what model-a frees until it holds more than
        # model-a's whole pool leaves of the budget (972.8 MiB at the default 5 % headroom, less
        # model-a's 896 MiB pool and its 16 MiB zero page: 60.8 MiB), so model-a's growth is
        # refused from then on.  Requests go on arriving; each is admitted or not, and none
        # raises inside SGLang.
        asked = admitted = 0
        for _ in range(400):
            asked += 1
            if taken < NEIGHBOUR_ROOM_PAGES:
                taken += neighbour.acquire(NEIGHBOUR_ROOM_PAGES - taken, min_pages=1)
            rank.request("free", requests=2)
            admitted += rank.request("allocate", requests=4, tokens=TOKENS_PER_PAGE)["allocated"]
            rank.request("step", n=20)
            status = rank.request("status")
            assert not status["errors"]
            if status["pools"][0]["refusals"] >= 1:  # it asked to grow and the broker said no
                break
        assert status["pools"][0]["refusals"] >= 1
        assert admitted < asked * 4  # so requests waited: scheduling misses
        assert taken > 0
    finally:
        neighbour.close()


def test_a_broker_restart_that_comes_back_short_is_a_scheduling_miss_never_an_exception(gpu_broker, ranks):
    """The broker restarts without its state, with room for less than the pool holds: the
    re-assertion comes back short and the client books the rest as uncharged.  A request SGLang
    admitted before is still allocated (a pool's limits change only at sync points, so never
    between an admission and its allocation); from then on ``available_size()`` counts only what
    the pool can hand out, so nothing more is admitted until the shortfall went back at the sync
    points, and no allocation raises inside SGLang."""
    import shutil

    broker = gpu_broker(0)
    (rank,) = ranks([broker.endpoint], instance="model-a")
    rank.request("build")
    fill(rank, 20)
    rank.request("step", n=50)
    assert rank.request("admit", tokens=TOKENS_PER_PAGE)["admitted"]
    charged = rank.request("status")["pools"][0]["granted_bytes"]
    broker.kill()
    shutil.rmtree(broker.state_dir, ignore_errors=True)  # its state is lost: the session is re-asserted
    broker.extra_args[broker.extra_args.index("--headroom") + 1] = str((1 << 30) - charged // 2)
    broker.start()
    short = wait_for(lambda: (lambda s: s if s["pools"][0]["uncharged_pages"] else None)(rank.request("status")),
                     what="the client to book what the restarted broker no longer charges")
    assert short["available_tokens"] == 0  # nothing more is admitted meanwhile
    assert rank.request("admit", tokens=TOKENS_PER_PAGE)["admitted"] is False
    result = rank.request("alloc_admitted")  # admitted before: allocated, never an exception
    assert "runtime_error" not in result
    settled = None
    for _ in range(200):  # requests finish; what they held goes back at the sync points
        rank.request("free", requests=2)
        rank.request("step", n=20)
        status = rank.request("status")
        pool = status["pools"][0]
        if not pool["uncharged_pages"] and pool["mapped_bytes"] <= pool["granted_bytes"] < charged:
            settled = status
            break
    assert settled is not None, status
    assert not settled["errors"]

    # The restarted broker may have room for no more than the pool kept (its charge is half the
    # old one, less what else it charges): the room to admit comes from requests that finish,
    # within the grant the broker charges; it never grows back above it.
    for _ in range(200):
        if rank.request("admit", tokens=TOKENS_PER_PAGE)["admitted"]:
            break
        rank.request("free", requests=1)
        rank.request("step", n=20)
        status = rank.request("status")
        pool = status["pools"][0]
        assert not status["errors"]
        assert not pool["uncharged_pages"] and pool["mapped_bytes"] <= pool["granted_bytes"] < charged, pool
    assert rank.request("admit", tokens=TOKENS_PER_PAGE)["admitted"]  # admissions resume within the charge
